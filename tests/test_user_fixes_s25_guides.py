"""Session 25: a guide copied before its first run says so (a trial of the AutoGuide contract)."""

import copy
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_quadvi import AutoMeanFieldNormal, AutoSpikeSlab
from pyro_quadvi.distributions import SpikeSlab


def _model():
    pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))


def _sparse_model():
    pyro.sample("w", SpikeSlab(torch.full((3,), 0.5, dtype=torch.float64), 1.0).to_event(1))


@pytest.mark.parametrize("guide_class", [AutoMeanFieldNormal, AutoSpikeSlab])
@pytest.mark.parametrize("copier", ["deepcopy", "pickle"])
def test_a_guide_copied_before_its_first_run_names_the_fix(guide_class, copier):
    pyro.clear_param_store()
    guide = guide_class(_model if guide_class is AutoMeanFieldNormal else _sparse_model)
    twin = copy.deepcopy(guide) if copier == "deepcopy" else pickle.loads(pickle.dumps(guide))
    with pytest.raises(RuntimeError, match=r"copy .* made before the guide's first run") as info:
        twin()
    assert "Run the guide once before copying it" in str(info.value)
    assert guide()["w"].shape == (3,)  # the original still sets itself up


def test_a_guide_copied_after_its_first_run_draws_as_the_original():
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_model)
    guide()
    twin = copy.deepcopy(guide)
    pyro.set_rng_seed(3)
    first = guide()["w"]
    pyro.set_rng_seed(3)
    assert torch.equal(twin()["w"], first)
