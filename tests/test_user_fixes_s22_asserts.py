"""Session 22: a model with a shape assert as Pyro's "Tensor shapes" tutorial writes them fits under
``QuadratureELBO``'s default ``vectorize=None`` (the pass's leading dim for the nodes fails the
assert; before, a bare ``AssertionError`` stopped the fit)."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO


def _model(data):
    with pyro.plate("d_plate", 3):
        d = pyro.sample("d", dist.Normal(torch.zeros(3, 4), 1.0).to_event(1))
    assert d.shape == (3, 4)
    with pyro.plate("data", 3):
        pyro.sample("obs", dist.Normal(d.sum(-1), 1.0), obs=data)


def _losses(vectorize):
    data = torch.tensor([1.0, 2.0, 3.0])
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svi = SVI(_model, AutoMeanFieldNormal(_model), QNVB(), QuadratureELBO(vectorize=vectorize))
    return [svi.step(data) for _ in range(5)]


def test_a_shape_assert_falls_back_to_the_loop_with_the_rightmost_dims_advice():
    with pytest.warns(UserWarning, match=r"assert on the rightmost dims, d.shape\[-2:\]"):
        tried = _losses(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        looped = _losses(False)
    assert tried == looped
