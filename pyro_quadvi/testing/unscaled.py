"""A regression on unstandardized features with a known optimal mean field.

Features on scales ``1e-3, 1, 1e2, 1e4`` and outcomes near 3,000, as users fit them without
standardizing; the noise sd is known, so the model is conjugate and the optimal Gaussian mean
field is in closed form: ``mu`` is the exact posterior mean and ``sigma_i = Lambda_ii^(-1/2)``
for the posterior precision ``Lambda`` (as for `pyro_quadvi.testing.problems.linear_regression`).
The coefficient of the ``1e-3`` feature has a posterior sd near 4.7e3, above QNVB's default
``sigma_max``, and its off-diagonal precision with the ``1e4`` feature is some ``8e6`` times its
own (``docs/qnvb.md``, "Latents far from where they start").
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch

from pyro_quadvi.testing.problems import MeanFieldProblem

__all__ = ["FEATURE_SCALES", "NOISE_SD", "unscaled_regression"]

FEATURE_SCALES = (1e-3, 1.0, 1e2, 1e4)
NOISE_SD = 100.0
_PRIOR_SD = {"a": 1e4, "b": 1e6}


def unscaled_regression(
    n: int = 300, seed: int = 11, dtype: torch.dtype = torch.float64
) -> tuple[MeanFieldProblem, torch.Tensor]:
    """``a ~ N(0, 1e4^2)``, ``b_j ~ N(0, 1e6^2)``, ``y ~ N(a + x b, 100^2)`` with ``x_j`` on the
    scales of `FEATURE_SCALES` (log-normal around them) and true ``b = (1.5e5, 200, 2, 0.03)``,
    ``a = 2000``.

    Returns:
        ``(problem, precision)``: the problem (latents ``a`` then ``b``, flat in that order, as a
        guide lays them out) and the posterior precision ``Lambda`` (float64), whose off-diagonal
        entries set what a quadrature with non-zero cross moments adds to ``h``.
    """
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor(FEATURE_SCALES, dtype=torch.float64)
    x = scales * torch.exp(0.5 * torch.randn(n, 4, generator=generator, dtype=torch.float64))
    truth = torch.tensor([1.5e5, 200.0, 2.0, 0.03], dtype=torch.float64)
    y = 2000.0 + x @ truth + NOISE_SD * torch.randn(n, generator=generator, dtype=torch.float64)
    design = torch.cat([torch.ones(n, 1, dtype=torch.float64), x], 1)
    prior_precision = torch.tensor([_PRIOR_SD["a"] ** -2] + [_PRIOR_SD["b"] ** -2] * 4)
    precision = design.T @ design / NOISE_SD**2 + torch.diag(prior_precision.double())
    mean = torch.linalg.solve(precision, design.T @ y / NOISE_SD**2)
    x_, y_ = x.to(dtype), y.to(dtype)
    zero = torch.zeros((), dtype=dtype)

    def model():
        a = pyro.sample("a", dist.Normal(zero, _PRIOR_SD["a"]))
        b = pyro.sample("b", dist.Normal(zero, _PRIOR_SD["b"]).expand([4]).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("y", dist.Normal(a + (x_ * b).sum(-1), NOISE_SD), obs=y_)

    def neg_log_joint(z):
        z = z.to(torch.float64)
        resid = y - z @ design.T
        prior = 0.5 * (z**2 * prior_precision.double()).sum(-1)
        return 0.5 * (resid**2).sum(-1) / NOISE_SD**2 + prior + _constant(n)

    def neg_elbo(mu, sigma):
        mu, sigma = mu.to(torch.float64), sigma.to(torch.float64)
        expected = neg_log_joint(mu) + 0.5 * (precision.diagonal() * sigma**2).sum()
        entropy = sigma.log().sum() + 0.5 * sigma.numel() * (1 + math.log(2 * math.pi))
        return expected - entropy

    problem = MeanFieldProblem(
        "unscaled regression",
        model,
        neg_log_joint,
        [("a", 1), ("b", 4)],
        neg_elbo,
        mean,
        precision.diagonal().rsqrt(),
    )
    return problem, precision


def _constant(n: int) -> float:
    """The normalizing terms of the likelihood and the priors in ``-log p``."""
    log_norm = 0.5 * math.log(2 * math.pi)
    return (
        n * (log_norm + math.log(NOISE_SD))
        + log_norm
        + math.log(_PRIOR_SD["a"])
        + 4 * (log_norm + math.log(_PRIOR_SD["b"]))
    )
