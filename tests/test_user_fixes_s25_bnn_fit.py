"""User trial t10 (session 25): BayesianModule's noise prior, LayerwiseNormal under weight_norm,
``fit`` with a tuple of minibatches, and ``dataset_size`` of NumPy or torch integers."""

from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer.batched import DtypeMismatch
from pyro_quadvi.nn import BayesianModule, fit, likelihoods, priors

# -- 1. a noise prior of a batch or event shape is refused ---------------------------------------


@pytest.mark.parametrize(
    "prior, shapes",
    [
        (dist.HalfNormal(torch.ones(2)), "batch_shape (2,) and event_shape ()"),
        (dist.HalfNormal(torch.ones(2)).to_event(1), "batch_shape () and event_shape (2,)"),
    ],
)
def test_a_noise_prior_per_output_is_refused_naming_its_shape(prior, shapes):
    # it ran at B = 2 with noise_scale[i] scaling row i, and failed in torch at B = 10
    with pytest.raises(ValueError) as error:
        likelihoods.Gaussian(20, scale=None, noise_prior=prior)
    message = str(error.value)
    for part in ("Gaussian: noise_prior", shapes, "one scalar for all outputs", "HalfNormal(1.0)"):
        assert part in message


# -- 2. a noise prior off the positive reals, or of another dtype, is refused --------------------


@pytest.mark.parametrize(
    "prior, support",
    [
        (dist.Normal(2.0, 0.1), "Real()"),
        (dist.Uniform(-1.0, 2.0), "Interval(lower_bound=-1.0, upper_bound=2.0)"),
        (dist.Poisson(3.0), "IntegerGreaterThan(lower_bound=0)"),
    ],
)
def test_a_noise_prior_off_the_positive_reals_is_refused_naming_its_support(prior, support):
    # Normal(2, 0.1) was accepted; the first step blamed the guide's start (init_to_feasible
    # puts a real site at 0, a noise scale of 0)
    with pytest.raises(ValueError) as error:
        likelihoods.Gaussian(20, scale=None, noise_prior=prior)
    message = str(error.value)
    for part in (f"has support {support}", "not within the positive reals", "dist.LogNormal"):
        assert part in message


def test_a_noise_prior_that_is_no_distribution_is_refused():
    with pytest.raises(TypeError, match=r"noise_prior must be a distribution .* got 0.5 \(float\)"):
        likelihoods.Gaussian(20, scale=None, noise_prior=0.5)


@pytest.mark.parametrize(
    "prior",
    [
        dist.HalfNormal(1.0),  # support [0, inf)
        dist.LogNormal(0.0, 1.0),  # (0, inf)
        dist.Gamma(2.0, 1.0),
        dist.Uniform(0.1, 2.0),  # a lower bound above 0
    ],
)
def test_noise_priors_on_the_positive_reals_give_the_noise_site_their_log_density(prior):
    torch.manual_seed(0)
    bnn = BayesianModule(
        nn.Linear(3, 1), priors.Normal(1.0), likelihoods.Gaussian(5, noise_prior=prior, scale=None)
    )
    trace = poutine.trace(bnn).get_trace(torch.randn(5, 3), torch.randn(5))
    site = trace.nodes["noise_scale"]
    assert float(site["fn"].log_prob(site["value"])) == float(prior.log_prob(site["value"]))


def test_a_noise_prior_of_another_dtype_than_the_net_is_refused_naming_the_site():
    # a float32 HalfNormal in a float64 net ran (a float32 noise scale), while a weight prior of
    # another dtype is refused
    net = nn.Linear(3, 1).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    likelihood = likelihoods.Gaussian(5, scale=None, noise_prior=dist.HalfNormal(1.0))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihood)
    with pytest.raises(DtypeMismatch) as error:
        bnn(x, y)
    message = str(error.value)
    for part in (
        "the value of 'noise_scale' is torch.float32, but the net is torch.float64",
        "noise_prior draws it",
        "dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64))",
    ):
        assert part in message
    one = torch.tensor(1.0, dtype=torch.float64)
    likelihood = likelihoods.Gaussian(5, scale=None, noise_prior=dist.HalfNormal(one))
    trace = poutine.trace(BayesianModule(net, priors.Normal(1.0), likelihood)).get_trace(x, y)
    assert trace.nodes["noise_scale"]["value"].dtype == torch.float64


# -- 3. LayerwiseNormal: the bias of a weight_norm'd layer takes the layer's fans ----------------


@pytest.mark.parametrize(
    "layer, std",
    [(lambda: nn.Conv2d(3, 4, 3), 1 / math.sqrt(27)), (lambda: nn.Linear(4, 8), 0.5)],
)
def test_layerwise_normal_gives_a_weight_normed_layers_bias_the_plain_layers_scale(layer, std):
    # weight_norm(nn.Conv2d(3, 4, 3))'s bias had sd 1.0 (fans (1, 1)): its weight is no
    # parameter, and a conv has no in_features to stand for it
    sds = []
    for net in (nn.Sequential(layer()), nn.Sequential(weight_norm(layer()))):
        bnn = BayesianModule(net, priors.LayerwiseNormal("radford"), likelihoods.Gaussian(10))
        sds.append(bnn.prior.std("0.bias", net[0].bias))
    assert sds == pytest.approx([std, std], rel=1e-12)


# -- 5. fit with a tuple of minibatches: a short message that says what a tuple is ---------------


def _tuple_of_batches():
    x, y = torch.randn(200, 3), torch.randn(200)
    bnn = BayesianModule(nn.Linear(3, 1), priors.Normal(1.0), likelihoods.Gaussian(200, 0.3))
    return bnn, tuple((x[i : i + 100], y[i : i + 100]) for i in (0, 100))


def test_fit_refuses_a_tuple_of_minibatches_saying_to_pass_a_list():
    # it gave a 6 KB error printing every tensor, that never said a tuple is one step's arguments
    pyro.clear_param_store()
    bnn, batches = _tuple_of_batches()
    svi = SVI(bnn, AutoMeanFieldNormal(bnn), QNVB(), QuadratureELBO())
    with pytest.raises(TypeError) as error:
        fit(svi, batches, 4, progress=False)
    message = str(error.value)
    assert len(message) < 300
    for part in ("a tuple of 2 tuples or lists;", "a tuple is one step's arguments", "list(data)"):
        assert part in message


def test_fit_refuses_a_tuple_of_lists_for_a_bayesian_module():
    # a BayesianModule's y is no list: a tuple of [x, y] lists is minibatches too
    pyro.clear_param_store()
    bnn, batches = _tuple_of_batches()
    svi = SVI(bnn, AutoMeanFieldNormal(bnn), QNVB(), QuadratureELBO())
    with pytest.raises(TypeError, match=r"^fit: data is a tuple of 2 tuples or lists; a tuple"):
        fit(svi, tuple(list(batch) for batch in batches), 4, progress=False)


def test_fit_takes_a_tuple_of_lists_as_one_steps_arguments():
    # a model of a list of sequences of their own lengths: refused as "a tuple of 1 tuples or
    # lists" by the check above, where svi.step takes the list as it is
    pyro.clear_param_store()
    sequences = [torch.full((n,), 2.0) for n in (5, 3, 7)]

    def model(sequences):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        for i, s in enumerate(sequences):
            with pyro.plate(f"rows_{i}", len(s)):
                pyro.sample(f"y_{i}", dist.Normal(mu, 1.0), obs=s)

    svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO())
    history = fit(svi, (sequences,), 3, progress=False)
    assert len(history.loss) == 3
    assert pyro.param("AutoMeanFieldNormal.locs.mu").item() == pytest.approx(2.0, abs=0.1)


def test_a_tuple_in_place_of_x_is_summarised_by_shapes_not_printed():
    bnn, batches = _tuple_of_batches()
    with pytest.raises(TypeError) as error:
        bnn(batches)
    item = "a tuple of 2 item(s) (a tensor of shape (100, 3), a tensor of shape (100,))"
    expected = f"got a tuple of 2 item(s) ({item}, {item})"
    assert str(error.value).endswith(expected)
    assert "tensor([" not in str(error.value)


# -- 6. dataset_size takes NumPy and 0-d torch integers, as fit's counts do ----------------------


@pytest.mark.parametrize("size", [np.int64(100), torch.tensor(100)])
def test_dataset_size_takes_numpy_and_torch_integers(size):
    likelihood = likelihoods.Gaussian(size)
    assert likelihood.dataset_size == 100 and type(likelihood.dataset_size) is int


@pytest.mark.parametrize("size", [np.float64(100.0), torch.tensor(100.0), True, 0])
def test_dataset_size_still_refuses_what_is_no_positive_integer(size):
    with pytest.raises(ValueError, match="dataset_size must be a positive int or None"):
        likelihoods.Gaussian(size)


# -- 4. the worked numbers docs/nn.md gives against TyXe's ---------------------------------------


def test_layerwise_normal_scales_docs_compare_with_tyxe():
    # TyXe: biases sd 1.0 (radford, fan_in 1), xavier 0.603 and 0.426 (relu gain, fan_out = out)
    net = nn.Sequential(nn.Linear(5, 6), nn.Conv2d(3, 4, (3, 2)))
    radford = BayesianModule(net, priors.LayerwiseNormal("radford"), likelihoods.Gaussian(10))
    xavier = BayesianModule(net, priors.LayerwiseNormal("xavier"), likelihoods.Gaussian(10))
    params = dict(net.named_parameters())
    biases = [radford.prior.std(n, params[n]) for n in ("0.bias", "1.bias")]
    weights = [xavier.prior.std(n, params[n]) for n in ("0.weight", "1.weight")]
    assert [round(v, 3) for v in biases + weights] == [0.447, 0.236, 0.426, 0.218]
