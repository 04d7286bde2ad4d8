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


def _value_model(data):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    assert mu <= 0.2, f"mu must be <= 0.2, got {mu}"
    with pyro.plate("data", 3):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=data)


def test_an_assert_on_a_latents_value_raises_without_the_fallback_warning():
    # the first node passes, another fails: the loop raises the model's own error, and no
    # warning says first that the assert fails in the pass only (the second review)
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_value_model, init_loc_fn=lambda site: torch.tensor(0.1))
    svi = SVI(_value_model, guide, QNVB(), QuadratureELBO(rule="gauss_hermite", num_points=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AssertionError, match=r"mu must be <= 0\.2"):
            svi.step(torch.tensor([1.0, 2.0, 3.0]))
