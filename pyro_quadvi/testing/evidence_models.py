"""Small models with closed-form evidences (float64), shared by the OPQA tests and benchmarks."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch

F64 = torch.float64


def normal_normal(x: torch.Tensor, sigma_mu: float = 1.0, sigma_x: float = 0.1) -> None:
    """The opqa paper's example (Section 5.1): mu ~ N(0, sigma_mu^2), x ~ N(mu, sigma_x^2)."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), sigma_mu))
    pyro.sample("x", dist.Normal(mu, sigma_x), obs=x)


def normal_normal_log_evidence(x: float, sigma_mu: float = 1.0, sigma_x: float = 0.1) -> float:
    """Paper eq. 40."""
    variance = sigma_mu**2 + sigma_x**2
    return -0.5 * x**2 / variance - 0.5 * math.log(2 * math.pi * variance)


def regression_data(n: int = 20, p: int = 3, seed: int = 0):
    """Features with a shared factor (pairwise correlation about 0.9) and a noisy response."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(n, 1, generator=generator, dtype=F64)
    X = common + 0.3 * torch.randn(n, p, generator=generator, dtype=F64)
    beta = torch.linspace(1.0, -0.5, p, dtype=F64)
    y = X @ beta + 0.4 * torch.randn(n, generator=generator, dtype=F64)
    return X, y


def linear_regression(X: torch.Tensor, y: torch.Tensor, prior_scale=1.5, noise=0.4) -> None:
    """beta ~ N(0, prior_scale^2 I), y ~ N(X beta, noise^2 I); vectorizes under a particle plate."""
    zero = torch.zeros(X.shape[1], dtype=F64)
    beta = pyro.sample("beta", dist.Normal(zero, prior_scale).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal((X * beta).sum(-1), noise), obs=y)


def linear_regression_matmul(X, y, prior_scale=1.5, noise=0.4) -> None:
    """The same model written with ``X @ beta``: it does not run under a particle plate."""
    zero = torch.zeros(X.shape[1], dtype=F64)
    beta = pyro.sample("beta", dist.Normal(zero, prior_scale).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ beta, noise), obs=y)


def linear_regression_misbroadcast(X, y, prior_scale=1.5, noise=0.4) -> None:
    """The same model with a broadcast that runs under a particle plate but gives wrong values."""
    zero = torch.zeros(X.shape[1], dtype=F64)
    beta = pyro.sample("beta", dist.Normal(zero, prior_scale).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal((X * beta.unsqueeze(-2)).sum(-1), noise), obs=y)


def linear_regression_posterior(X, y, prior_scale=1.5, noise=0.4):
    """Exact posterior mean and covariance of beta, and the exact log evidence."""
    precision = X.T @ X / noise**2 + torch.eye(X.shape[1], dtype=F64) / prior_scale**2
    covariance = torch.linalg.inv(precision)
    mean = covariance @ X.T @ y / noise**2
    marginal = prior_scale**2 * X @ X.T + noise**2 * torch.eye(X.shape[0], dtype=F64)
    zeros = torch.zeros(X.shape[0], dtype=F64)
    log_evidence = float(dist.MultivariateNormal(zeros, marginal).log_prob(y))
    return mean, covariance, log_evidence


BERNOULLI_DATA = torch.tensor([1.0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1], dtype=F64)
BETA_PRIOR = (2.0, 3.0)


def beta_bernoulli(data: torch.Tensor) -> None:
    p = pyro.sample("p", dist.Beta(*[torch.tensor(v, dtype=F64) for v in BETA_PRIOR]))
    with pyro.plate("trials", len(data)):
        pyro.sample("y", dist.Bernoulli(p), obs=data)


def log_beta_function(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def beta_bernoulli_posterior(data: torch.Tensor) -> tuple[float, float, float]:
    """Posterior Beta parameters and the log evidence B(a + k, b + n - k) / B(a, b)."""
    a, b = BETA_PRIOR
    k, n = float(data.sum()), len(data)
    return a + k, b + n - k, log_beta_function(a + k, b + n - k) - log_beta_function(a, b)


POISSON_DATA = torch.tensor([3.0, 5, 2, 4, 6, 3, 1], dtype=F64)
GAMMA_PRIOR = (2.0, 0.5)  # concentration, rate


def gamma_poisson(counts: torch.Tensor) -> None:
    rate = pyro.sample("rate", dist.Gamma(*[torch.tensor(v, dtype=F64) for v in GAMMA_PRIOR]))
    with pyro.plate("counts", len(counts)):
        pyro.sample("c", dist.Poisson(rate), obs=counts)


def gamma_poisson_posterior(counts: torch.Tensor) -> tuple[float, float, float]:
    """Posterior Gamma parameters and the log evidence (a negative binomial product)."""
    a, b = GAMMA_PRIOR
    total, n = float(counts.sum()), len(counts)
    log_evidence = (
        a * math.log(b)
        - math.lgamma(a)
        + math.lgamma(a + total)
        - (a + total) * math.log(b + n)
        - sum(math.lgamma(c + 1) for c in counts.tolist())
    )
    return a + total, b + n, log_evidence


def beta_and_gamma(data: torch.Tensor, counts: torch.Tensor) -> None:
    """Two independent conjugate pairs: the evidence is the product of theirs."""
    beta_bernoulli(data)
    gamma_poisson(counts)


def logistic_data(n: int = 30, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=generator, dtype=F64)
    logits = X @ torch.tensor([1.0, -2.0], dtype=F64)
    y = torch.bernoulli(torch.sigmoid(logits), generator=generator)
    return X, y


def logistic_regression(X: torch.Tensor, y: torch.Tensor) -> None:
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=F64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=(X * w).sum(-1)), obs=y)
