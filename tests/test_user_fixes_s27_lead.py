"""Session 27, the lead: items left by session 26, each against an exact reference."""

from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO


def _moving_support():
    lo = pyro.sample("lo", dist.Normal(0.0, 1.0))
    x = pyro.sample("x", dist.Uniform(lo, lo + 1.0))
    pyro.sample("y", dist.Normal(x, 0.5), obs=torch.tensor(2.0))


def test_a_support_that_depends_on_a_latent_is_named_with_its_fix():
    """`Uniform(lo, lo + 1)`: the guide maps ``x`` onto the interval of the set-up run, (0, 1)
    at ``lo``'s initial 0, and on the tensor grid of 10 Gauss-Hermite points (unit-scale nodes
    t, guide scale 0.1) the pairs with sigmoid(0.1 t_j) outside [0.1 t_i, 1 + 0.1 t_i] lie outside
    the model's support; Pyro's validation error names only the values."""
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_moving_support)
    guide()
    t, _ = np.polynomial.hermite_e.hermegauss(10)
    lo = 0.1 * t[:, None]
    x = 1.0 / (1.0 + np.exp(-0.1 * t[None, :]))
    outside = int(((x < lo) | (x > lo + 1.0)).sum())
    assert outside > 0
    with pytest.raises(ValueError, match=rf"site 'x': {outside} of the guide's values") as info:
        QuadratureELBO(rule="gauss_hermite", num_points=10).loss(_moving_support, guide)
    assert "depends on another latent" in str(info.value)
    assert "pyro.sample('u', dist.Uniform(0.0, 1.0))" in str(info.value)
