"""Models shared by the benchmarks: eight schools, logistic regression, a small Bayesian network.

Data are generated from fixed seeds (or are the classic eight-schools table), so every benchmark is
reproducible offline.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample

EIGHT_SCHOOLS_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
EIGHT_SCHOOLS_SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools(y=EIGHT_SCHOOLS_Y, sigma=EIGHT_SCHOOLS_SIGMA):
    """Non-centred eight schools (Rubin 1981)."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", len(y)):
        eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(mu + tau * eta, sigma), obs=y)


def eight_schools_centred(sigma=EIGHT_SCHOOLS_SIGMA, y=None):
    """Centred eight schools; ``y=None`` leaves the observations free (for predictions)."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", len(sigma)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def logistic_data(num_data: int, dim: int, seed: int = 0):
    """Features with unit variance and labels from a logistic model with known weights."""
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(num_data, dim, generator=generator)
    w = torch.randn(dim, generator=generator) / dim**0.5
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=generator)
    return X, y


def logistic_regression(X, y=None):
    """Bayesian logistic regression with a N(0, 1) prior on the weights.

    ``(X * w).sum(-1)`` broadcasts over a particle dimension of ``w`` (shape ``(K, 1, d)``), so the
    model vectorizes over quadrature nodes and Monte Carlo particles alike.
    """
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[-1]]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=(X * w).sum(-1)), obs=y)


class BayesianMLP(PyroModule):
    """A one-hidden-layer network with N(0, 1) priors on every weight (not vectorizable)."""

    def __init__(self, in_dim: int = 4, hidden: int = 16):
        super().__init__()
        self.fc1 = PyroModule[torch.nn.Linear](in_dim, hidden)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([hidden, in_dim]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.fc2 = PyroModule[torch.nn.Linear](hidden, 1)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, hidden]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, X, y=None):
        mean = self.fc2(torch.tanh(self.fc1(X))).squeeze(-1)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(mean, 0.3), obs=y)
        return mean


def mlp_data(num_data: int = 200, in_dim: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(num_data, in_dim, generator=generator)
    y = torch.sin(X.sum(-1)) + 0.1 * torch.randn(num_data, generator=generator)
    return X, y
