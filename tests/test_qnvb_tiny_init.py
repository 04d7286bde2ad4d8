"""QNVB from a tiny ``init_scale``: the update recovers; a model that mixes the nodes does not.

A float32 regression started at ``init_scale`` 1e-5 to 1e-8 ended at ``w = 0.022`` (or 0) against
1.94, without a warning. The update is not the cause: with a model that broadcasts over the
quadrature nodes (or with ``vectorize=False``) QNVB reaches the exact posterior from every such
start, the scale's rate limit widening ``sigma`` tenfold a step. The failing model read its vector
latent as ``w[0]``, which in QuadratureELBO's vectorized pass indexes the nodes' dim: every node
used node 0's ``w``. QuadratureELBO's check of the pass compares it with single evaluations within
a tolerance, and nodes ``1e-5`` apart give values closer than that, so the wrong pass was kept, and
the curvature QNVB read from it (``h = -2.8e7`` at the first step) held ``sigma`` and the mean.
"""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO

N, D, NOISE, PRIOR = 100, 3, 0.5, 10.0


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = x @ torch.full((D,), 2.0, dtype=torch.float64) + NOISE * torch.randn(N, generator=g)
    return x.to(dtype), y.to(dtype)


def _known_noise(x: torch.Tensor, y: torch.Tensor) -> None:
    """Bayesian linear regression with a known noise; broadcasts over the nodes."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), PRIOR).to_event(1))
    with pyro.plate("data", N):
        pyro.sample("y", dist.Normal((x * w).sum(-1), NOISE), obs=y)


def _exact_mean_field() -> tuple[torch.Tensor, torch.Tensor]:
    """The mean-field optimum of `_known_noise` in closed form: the posterior mean, and sds
    ``diag(P)^(-1/2)`` with ``P`` the posterior precision."""
    x, y = _data(torch.float64)
    precision = x.T @ x / NOISE**2 + torch.eye(D) / PRIOR**2
    return torch.linalg.solve(precision, x.T @ y / NOISE**2), precision.diagonal().rsqrt()


def _fit(model, args, init_scale: float, steps: int, **elbo) -> tuple[AutoMeanFieldNormal, list]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model, init_scale=init_scale)
    svi = SVI(model, guide, QNVB(), QuadratureELBO(**elbo))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step(*args)
    return guide, [str(w.message) for w in caught]


@pytest.mark.parametrize("init_scale", [1e-1, 1e-5, 1e-8])
def test_qnvb_reaches_the_exact_posterior_in_float32_from_a_tiny_init_scale(init_scale):
    mean, sd = _exact_mean_field()
    guide, caught = _fit(_known_noise, _data(torch.float32), init_scale, 60)
    assert QuadratureELBO().vectorize is None and not caught  # the vectorized pass, no warning
    loc = guide.locs.w.detach().double()
    scale = guide.scales.w.detach().double()
    assert ((loc - mean) / sd).abs().max() < 1e-3
    assert ((scale / sd) - 1).abs().max() < 1e-2


def _unknown_noise(x: torch.Tensor, y: torch.Tensor) -> None:
    """The regression of the report: ``w[0]`` reads node 0's ``w`` in a vectorized pass."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(x.new_zeros(()), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(w[0] * x, s), obs=y)


def _unknown_noise_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g)
    return x, 2 * x + NOISE * torch.randn(N, generator=g)


def test_the_loop_over_the_nodes_fits_the_mixing_model_from_a_tiny_init_scale():
    reference, _ = _fit(_unknown_noise, _unknown_noise_data(), 0.1, 60, vectorize=False)
    guide, _ = _fit(_unknown_noise, _unknown_noise_data(), 1e-5, 60, vectorize=False)
    assert abs(guide.locs.w.item() - reference.locs.w.item()) < 1e-4
    assert abs(guide.scales.w.item() / reference.scales.w.item() - 1) < 1e-2
    assert abs(reference.locs.w.item() - 2) < 0.2


def test_a_model_that_mixes_the_nodes_is_found_out_from_a_tiny_init_scale():
    reference, _ = _fit(_unknown_noise, _unknown_noise_data(), 0.1, 60, vectorize=False)
    guide, caught = _fit(_unknown_noise, _unknown_noise_data(), 1e-5, 60)
    assert any("evaluating them one by one" in message for message in caught)
    assert abs(guide.locs.w.item() - reference.locs.w.item()) < 1e-4
