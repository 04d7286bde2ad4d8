"""Faults users found in the distributions and the guides' AutoGuide API (session 7 trials)."""

from __future__ import annotations

import math

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
