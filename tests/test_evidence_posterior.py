"""The OPQA posterior density p_T^2 w: normalization, exact conjugate posteriors, marginals."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import integrate, special

from pyro_quadvi import opqa_evidence
from pyro_quadvi.testing.evidence_models import (
    BERNOULLI_DATA,
    F64,
    POISSON_DATA,
    beta_and_gamma,
    beta_bernoulli,
    beta_bernoulli_posterior,
    gamma_poisson_posterior,
    linear_regression,
    linear_regression_posterior,
    logistic_data,
    logistic_regression,
)


@pytest.fixture(autouse=True)
def clear_param_store():
    pyro.clear_param_store()


@pytest.fixture(scope="module")
def regression():
    from pyro_quadvi.testing.evidence_models import regression_data

    X, y = regression_data()
    return X, y, opqa_evidence(linear_regression, X, y, num_points=3)


@pytest.fixture(scope="module")
def beta_result():
    return opqa_evidence(beta_bernoulli, BERNOULLI_DATA, num_points=32)


@pytest.fixture(scope="module")
def logistic_result():
    X, y = logistic_data()
    return opqa_evidence(logistic_regression, X, y, num_points=8)


def test_conjugate_posterior_is_exact(regression):
    X, y, result = regression
    mean, covariance, _ = linear_regression_posterior(X, y)
    generator = torch.Generator().manual_seed(3)
    values = mean + 0.3 * torch.randn(6, 3, generator=generator, dtype=F64)
    expected = dist.MultivariateNormal(mean, covariance).log_prob(values)
    assert torch.allclose(result.posterior.log_prob({"beta": values}), expected, atol=1e-10)
    assert torch.allclose(result.posterior.mean_unconstrained, mean, atol=1e-12)
    assert torch.allclose(result.posterior.covariance_unconstrained, covariance, atol=1e-12)


def test_conjugate_marginals_are_exact(regression):
    X, y, result = regression
    mean, covariance, _ = linear_regression_posterior(X, y)
    marginal = result.posterior.marginals(num=101)["beta"]
    assert marginal.values.shape == (101, 3) and marginal.constrained and marginal.exact
    expected = dist.Normal(mean, covariance.diagonal().sqrt()).log_prob(marginal.values).exp()
    assert torch.allclose(marginal.density, expected, rtol=1e-10, atol=1e-12)


def test_density_integrates_to_one_in_the_constrained_space(beta_result):
    def density(p):
        return math.exp(float(beta_result.posterior.log_prob(torch.tensor(p, dtype=F64))))

    total, _ = integrate.quad(density, 0.0, 1.0, epsabs=1e-13, epsrel=1e-13, limit=200)
    assert abs(total - 1.0) < 1e-9


def test_beta_posterior_matches_the_exact_one(beta_result):
    a, b, _ = beta_bernoulli_posterior(BERNOULLI_DATA)
    exact = dist.Beta(torch.tensor(a, dtype=F64), torch.tensor(b, dtype=F64))
    p = torch.linspace(0.35, 0.9, 12, dtype=F64)  # the posterior mean +- 2.5 sd
    error = (beta_result.posterior.log_prob(p) - exact.log_prob(p)).abs().max()
    assert error < 1e-6
    # exact moments of logit(p) under Beta(a, b): digamma and trigamma differences
    mean = special.digamma(a) - special.digamma(b)
    variance = special.polygamma(1, a) + special.polygamma(1, b)
    assert float(beta_result.posterior.mean_unconstrained[0]) == pytest.approx(mean, abs=1e-9)
    assert float(beta_result.posterior.covariance_unconstrained[0, 0]) == pytest.approx(
        variance, abs=1e-9
    )


def test_constrained_marginals_of_two_sites():
    result = opqa_evidence(beta_and_gamma, BERNOULLI_DATA, POISSON_DATA, num_points=24)
    marginals = result.posterior.marginals(num=401, width=10.0)
    a, b, _ = beta_bernoulli_posterior(BERNOULLI_DATA)
    concentration, rate, _ = gamma_poisson_posterior(POISSON_DATA)
    exact = {
        "p": dist.Beta(torch.tensor(a, dtype=F64), torch.tensor(b, dtype=F64)),
        "rate": dist.Gamma(torch.tensor(concentration, dtype=F64), torch.tensor(rate, dtype=F64)),
    }
    for name, marginal in marginals.items():
        assert marginal.constrained and marginal.exact
        # the unconstrained marginal integrates to 1 (trapezoid on +-10 sd: spectrally accurate)
        total = torch.trapezoid(marginal.unconstrained_density, marginal.unconstrained_values)
        assert abs(float(total) - 1.0) < 1e-8
        expected = exact[name].log_prob(marginal.values).exp()
        peak = float(expected.max())
        assert float((marginal.density - expected).abs().max()) < 1e-5 * peak


def test_marginals_agree_with_the_joint_density(logistic_result):
    # Integrate exp(log_prob) over the other coordinate on a fine grid and compare.
    posterior = logistic_result.posterior
    marginal = posterior.marginals(num=21)["w"]
    assert marginal.exact
    mean = posterior.mean_unconstrained
    sd = posterior.covariance_unconstrained.diagonal().sqrt()
    other = torch.linspace(-9.0, 9.0, 1201, dtype=F64)
    for i in range(2):
        j = 1 - i
        grid = torch.empty(21, 1201, 2, dtype=F64)
        grid[..., i] = marginal.values[:, i, None]
        grid[..., j] = mean[j] + sd[j] * other
        density = posterior.log_prob({"w": grid}).exp()
        integral = torch.trapezoid(density, dx=float(sd[j] * (other[1] - other[0])), dim=-1)
        assert torch.allclose(marginal.density[:, i], integral, rtol=1e-8, atol=1e-12)


def test_logistic_density_integrates_to_one_and_is_skewed(logistic_result):
    posterior = logistic_result.posterior
    mean = posterior.mean_unconstrained
    sd = posterior.covariance_unconstrained.diagonal().sqrt()
    axis = torch.linspace(-9.0, 9.0, 721, dtype=F64)
    grid = torch.stack(
        torch.meshgrid(mean[0] + sd[0] * axis, mean[1] + sd[1] * axis, indexing="ij"), -1
    )
    density = posterior.log_prob_unconstrained(grid).exp()
    step = float((axis[1] - axis[0]) ** 2 * sd[0] * sd[1])
    assert abs(float(density.sum()) * step - 1.0) < 1e-8
    # not the Laplace Gaussian: the exact mean differs from the mode
    assert float((mean - logistic_result.diagnostics["loc"]).abs().max()) > 1e-3


def test_log_prob_refuses_bad_values(regression):
    _, _, result = regression
    with pytest.raises(ValueError, match="shape"):
        result.posterior.log_prob({"beta": torch.zeros(2, dtype=F64)})
    with pytest.raises(ValueError, match="no value for the latent site 'beta'"):
        result.posterior.log_prob({"gamma": torch.zeros(3, dtype=F64)})


def _uniform_location(y):
    bounds = torch.tensor([0.5, 3.0], dtype=F64)
    mu = pyro.sample("mu", dist.Uniform(bounds[0], bounds[1]))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 0.5), obs=y)


def test_a_uniform_prior_gives_the_truncated_normal_and_nothing_outside_its_bounds():
    """The posterior of a Normal location under a ``Uniform(0.5, 3)`` prior is the Normal
    ``N(mean(y), 0.5^2 / n)`` truncated to ``(0.5, 3)``. Outside the bounds the density is 0.
    Before, values there got a finite density: the transform's codomain, its ``Affine`` part's,
    is the whole real line, and the ``Sigmoid``'s inverse clamps what lies beyond (0, 1)."""
    y = torch.tensor([1.2, 1.9, 1.4, 2.2, 1.7, 1.1], dtype=F64)
    posterior = opqa_evidence(_uniform_location, y, num_points=12).posterior
    normal = dist.Normal(y.mean(), 0.5 / math.sqrt(len(y)))
    mass = normal.cdf(torch.tensor(3.0, dtype=F64)) - normal.cdf(torch.tensor(0.5, dtype=F64))
    inside = torch.tensor([1.25, 1.45, 1.6, 1.75, 1.9], dtype=F64)  # within 1.6 sd of the mean
    exact = normal.log_prob(inside) - mass.log()
    assert torch.allclose(posterior.log_prob(inside), exact, atol=2e-3)
    outside = torch.tensor([0.4, 3.1, -1.0], dtype=F64)
    assert torch.equal(posterior.log_prob(outside), torch.full((3,), -math.inf, dtype=F64))


def test_infinite_values_have_no_density():
    """A value at infinity has density 0 (log -inf), on an unbounded site and a half-line; a NaN
    value gives NaN. Before, the transforms' arithmetic at infinity gave NaN."""
    y = torch.tensor([1.2, 1.9, 1.4, 2.2, 1.7, 1.1], dtype=F64)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 2.0))
        noise = pyro.sample("noise", dist.HalfNormal(torch.ones((), dtype=F64)))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu, noise), obs=y)

    posterior = opqa_evidence(model, y, num_points=5).posterior
    mu = torch.tensor([1.6, math.inf, -math.inf, 1.6, 1.6, math.nan], dtype=F64)
    noise = torch.tensor([0.4, 0.4, 0.4, math.inf, 0.0, 0.4], dtype=F64)
    got = posterior.log_prob({"mu": mu, "noise": noise})
    assert torch.isfinite(got[0])
    assert torch.equal(got[1:5], torch.full((4,), -math.inf, dtype=F64))
    assert torch.isnan(got[5])


def test_the_support_of_a_concatenated_or_stacked_transform_is_checked_piece_by_piece():
    """``biject_to`` of a ``cat`` or ``stack`` of intervals: its codomain is the pieces' Affine
    parts' (the real line), so each piece is checked in its own interval, open: the bounds 0 and
    2 are outside, as the Sigmoid inside never reaches them."""
    from torch.distributions import biject_to, constraints

    from pyro_quadvi.evidence.posterior import _in_image

    unit, wide = constraints.interval(0.0, 1.0), constraints.interval(0.0, 2.0)
    values = torch.tensor(
        [[0.5, 1.5], [5.0, 1.0], [0.5, 2.5], [0.0, 2.0], [1e-3, 1.999]], dtype=F64
    )
    cat = biject_to(constraints.cat([unit, wide], dim=-1, lengths=[1, 1]))
    stack = biject_to(constraints.stack([unit, wide], dim=-1))
    for transform in (cat, stack):
        inside = _in_image(transform, values, torch.Size([5]))
        assert inside.tolist() == [True, False, False, False, True]
