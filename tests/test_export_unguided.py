"""to_inference_data refuses latent sites the guide does not sample (they were drawn from the prior
and labelled ``posterior``, and the log likelihood was conditional on them), and a mixture
marginalized in the model exports its marginal pointwise log likelihood."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam

from pyro_quadvi import to_inference_data

DATA = torch.tensor([-3.1, -2.4, -2.9, 2.7, 3.3, 2.8])


@config_enumerate
def gmm(data):
    locs = pyro.sample("locs", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with pyro.plate("d", len(data)):
        z = pyro.sample("z", dist.Categorical(torch.tensor([0.5, 0.5])))
        pyro.sample("obs", dist.Normal(locs[z], 1.0), obs=data)


def marginal_gmm(data):
    locs = pyro.sample("locs", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with pyro.plate("d", len(data)):
        mix = dist.Categorical(torch.tensor([0.5, 0.5]))
        pyro.sample("obs", dist.MixtureSameFamily(mix, dist.Normal(locs, 1.0)), obs=data)


def scale_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("d", len(y)):
        pyro.sample("y", dist.Normal(mu, s), obs=y)


def test_enumerated_site_hidden_from_the_guide_is_refused():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(poutine.block(gmm, hide=["z"]))
    svi = SVI(gmm, guide, Adam({"lr": 0.1}), TraceEnum_ELBO(max_plate_nesting=1))
    svi.step(DATA)
    with pytest.raises(ValueError, match=r"enumerated site\(s\) \['z'\]") as error:
        to_inference_data(gmm, guide, DATA, num_samples=10)
    assert "labelled posterior" in str(error.value)
    assert "dist.MixtureSameFamily" in str(error.value)
    assert "['locs']" not in str(error.value)  # the guide samples locs


def test_continuous_latent_hidden_from_the_guide_is_refused():
    pyro.clear_param_store()
    guide = AutoNormal(poutine.block(scale_model, hide=["s"]))
    guide(DATA)
    with pytest.raises(ValueError, match=r"does not sample the latent site\(s\) \['s'\]") as error:
        to_inference_data(scale_model, guide, DATA, num_samples=10)
    assert "poutine.block" in str(error.value)
    assert "enumerated" not in str(error.value)


def test_a_guide_of_every_latent_exports_the_guides_draws():
    pyro.clear_param_store()
    guide = AutoNormal(scale_model)
    guide(DATA)
    pyro.set_rng_seed(1)
    idata = to_inference_data(scale_model, guide, DATA, num_samples=4000, prior=False)
    log_s = torch.as_tensor(idata.posterior["s"].values[0]).log()
    loc, scale = (x.detach() for x in guide._get_loc_and_scale("s"))  # of log s
    assert log_s.mean().item() == pytest.approx(loc.item(), abs=4 * scale.item() / math.sqrt(4000))
    assert log_s.std().item() == pytest.approx(scale.item(), rel=0.05)


def test_a_mixture_marginalized_in_the_model_exports_the_marginal_log_likelihood():
    pyro.clear_param_store()
    guide = AutoNormal(marginal_gmm)
    guide(DATA)
    idata = to_inference_data(marginal_gmm, guide, DATA, num_samples=50, prior=False)
    locs = torch.as_tensor(idata.posterior["locs"].values[0], dtype=torch.float64)  # (S, 2)
    components = dist.Normal(locs[:, None, :], 1.0).log_prob(DATA.double()[:, None])
    hand = torch.logsumexp(components + math.log(0.5), -1)  # (S, N)
    exported = torch.as_tensor(idata.log_likelihood["obs"].values[0])
    assert exported.shape == (50, len(DATA))
    assert torch.allclose(exported, hand, atol=1e-5)
