"""Faults users found in the distributions and the guides' AutoGuide API (session 7 trials)."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_quadvi import AutoMeanFieldNormal, AutoSpikeSlab
from pyro_quadvi.distributions import IidNormal, SpikeSlab

pytestmark = pytest.mark.usefixtures("fresh_param_store")


def _normal_model():
    pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))


def _spike_model():
    pyro.sample("w", SpikeSlab(torch.full((3,), 0.5, dtype=torch.float64)).to_event(1))


def test_a_spike_slab_of_inclusion_zero_is_refused_as_logits_too():
    with pytest.raises(ValueError, match=r"zero_logits must be < \+inf"):
        SpikeSlab(zero_logits=torch.tensor([0.0, math.inf]))
    # large finite logits are a valid (nearly always zero) factor, with a finite entropy
    near = SpikeSlab(zero_logits=torch.tensor([30.0]))
    assert torch.isfinite(near.entropy()).all()


@pytest.mark.parametrize("guide_class, model", [(AutoMeanFieldNormal, _normal_model),
                                                (AutoSpikeSlab, _spike_model)])  # fmt: skip
def test_quantiles_outside_zero_one_and_before_a_run_are_refused(guide_class, model):
    guide = guide_class(model)
    with pytest.raises(RuntimeError, match="has not been run yet"):
        guide.median()
    guide()
    for bad in ([-0.1, 0.5], [0.5, 1.2]):
        with pytest.raises(ValueError, match=r"quantiles must be probabilities in \[0, 1\]"):
            guide.quantiles(bad)
    if guide_class is AutoMeanFieldNormal:  # in range: loc + z scale, z the normal quantile
        loc, scale = guide.locs.w.detach(), guide.scales.w.detach()
        z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.8))
        got = guide.quantiles([0.5, 0.8])["w"]
        assert torch.allclose(got[0], loc) and torch.allclose(got[1], loc + z * scale)


def test_init_scale_takes_any_finite_positive_number_and_refuses_the_rest():
    for value in (1, torch.tensor(0.25, dtype=torch.float64)):
        pyro.clear_param_store()
        guide = AutoMeanFieldNormal(_normal_model, init_scale=value)
        guide()
        assert torch.allclose(guide.scales.w.detach(), torch.full((3,), float(value)).double())
    for bad in (math.inf, 0.0, -1.0, True, "0.1"):
        with pytest.raises(ValueError, match="init_scale must be a finite number > 0"):
            AutoMeanFieldNormal(_normal_model, init_scale=bad)


def test_an_iid_normal_over_an_integer_parameter_is_refused():
    with pytest.raises(ValueError, match=r"over a floating parameter, got torch\.int64"):
        IidNormal.of(0.5, 2.0, like=torch.zeros(3, dtype=torch.int64))


def test_qnvb_under_trace_elbo_updates_the_elementwise_parts_of_an_autoguidelist():
    # a ~ N(0, 1), b ~ N(0, I_2), y_i ~ N(a, 1) for 3 points, z_j ~ N(b_j, 1): the posterior of a
    # is N(sum(y) / 4, 1 / 4) and of each b_j N(z_j / 2, 1 / 2). The AutoDiagonalNormal part (a) is
    # QNVB's (no warning names it); the AutoMultivariateNormal part (b) goes to the fallback, with
    # the one warning.
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoMultivariateNormal

    from pyro_quadvi import QNVB

    y = torch.tensor([0.3, 1.1, 0.7], dtype=torch.float64)
    z = torch.tensor([0.4, -0.8], dtype=torch.float64)

    def model():
        zero = torch.zeros((), dtype=torch.float64)
        a = pyro.sample("a", dist.Normal(zero, 1.0))
        b = pyro.sample("b", dist.Normal(zero.expand(2), 1.0).to_event(1))
        with pyro.plate("data", 3):
            pyro.sample("y", dist.Normal(a, 1.0), obs=y)
        pyro.sample("z", dist.Normal(b, 1.0).to_event(1), obs=z)

    pyro.set_rng_seed(0)
    guide = AutoGuideList(model)
    guide.append(AutoDiagonalNormal(pyro.poutine.block(model, expose=["a"])))
    guide.append(AutoMultivariateNormal(pyro.poutine.block(model, expose=["b"])))
    elbo = Trace_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(model, guide, QNVB(fallback=pyro.optim.Adam({"lr": 0.05})), elbo)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(40):
            svi.step()
    handed_over = [str(w.message) for w in caught if "fallback" in str(w.message)]
    assert len(handed_over) == 1 and "'AutoGuideList.1' is a joint Gaussian" in handed_over[0]
    diagonal = guide[0]
    loc, scale = diagonal.loc.detach(), diagonal.scale.detach()
    assert loc.item() == pytest.approx(y.sum().item() / 4, abs=0.05)
    assert scale.item() == pytest.approx(0.5, rel=0.1)
    b_loc = guide[1].loc.detach()
    assert torch.allclose(b_loc, z / 2, atol=0.1)
