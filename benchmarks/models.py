"""Models shared by the benchmarks: eight schools, logistic regression, Bayesian networks, and
the models of Pyro's examples (eight schools, baseball, regression, a mixture, a 1-50-1 network).

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


# -- models of Pyro's examples and tutorials (issue 10: the default rule) -----------------------


def eight_schools_pyro(data):
    """Pyro's ``examples/eight_schools/svi.py`` model, as written there: ``eta``, ``mu`` and ``tau``
    all inside the plate (so eight copies of each, 24 latents), ``mu ~ N(0, 10)``,
    ``tau ~ HalfCauchy(25)``. ``data`` is ``(8, 2)``: the effects and their standard errors."""
    y, sigma = data[:, 0], data[:, 1]
    num = data.shape[0]
    with pyro.plate("data", num):
        eta = pyro.sample("eta", dist.Normal(torch.zeros(num), torch.ones(num)))
        mu = pyro.sample("mu", dist.Normal(torch.zeros(1), 10 * torch.ones(1)))
        tau = pyro.sample("tau", dist.HalfCauchy(scale=25 * torch.ones(1)))
        pyro.sample("obs", dist.Normal(mu + tau * eta, sigma), obs=y)


def eight_schools_pyro_data() -> torch.Tensor:
    """The ``(8, 2)`` table of Pyro's eight-schools example: effects and standard errors."""
    return torch.stack([EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA], dim=1).to(torch.get_default_dtype())


BASEBALL_HITS = (18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7)
"""Efron and Morris (1975): hits of 18 players of the 1970 season in their first 45 at-bats
(Clemente, F. Robinson, Howard, Johnstone, Berry, Spencer, Kessinger, L. Alvarado, Santo,
Swaboda, Petrocelli, E. Rodriguez, Scott, Unser, Williams, Campaneris, Munson, Alvis)."""
BASEBALL_AT_BATS = 45


def baseball_data() -> tuple[torch.Tensor, torch.Tensor]:
    """``(at_bats, hits)`` of the Efron-Morris table, in the default dtype."""
    hits = torch.tensor(BASEBALL_HITS, dtype=torch.get_default_dtype())
    return torch.full_like(hits, BASEBALL_AT_BATS), hits


def baseball_partially_pooled(at_bats, hits):
    """Pyro's ``examples/baseball.py`` partially pooled model: a common ``m ~ U(0, 1)``, a
    concentration ``kappa ~ Pareto(1, 1.5)``, and each player's chance ``phi ~ Beta(m kappa,
    (1 - m) kappa)``; 20 latents."""
    zero, one = torch.zeros((), dtype=hits.dtype), torch.ones((), dtype=hits.dtype)
    m = pyro.sample("m", dist.Uniform(zero, one))
    kappa = pyro.sample("kappa", dist.Pareto(one, 1.5 * one))
    with pyro.plate("num_players", hits.shape[-1]):
        phi = pyro.sample("phi", dist.Beta(m * kappa, (1 - m) * kappa))
        pyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)


def rugged_like_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generated data of the shape of the rugged-terrain table of Pyro's Bayesian regression
    tutorial (whose CSV is a download): 170 countries, features ``(cont_africa, rugged,
    cont_africa * rugged)``, target log GDP. About 30% of the rows are African; ruggedness is
    exponential with mean 1.2; the coefficients are those the tutorial fits
    (``9.2 - 1.9 africa - 0.2 rugged + 0.4 africa * rugged``, noise 0.9)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.get_default_dtype()
    num = 170
    africa = (torch.rand(num, generator=generator, dtype=dtype) < 0.3).to(dtype)
    rugged = -1.2 * torch.log(torch.rand(num, generator=generator, dtype=dtype))
    x = torch.stack([africa, rugged, africa * rugged], dim=1)
    noise = 0.9 * torch.randn(num, generator=generator, dtype=dtype)
    y = 9.2 - 1.9 * africa - 0.2 * rugged + 0.4 * africa * rugged + noise
    return x, y


class BayesianRegression(PyroModule):
    """The model of Pyro's Bayesian regression tutorial: ``PyroSample`` priors ``w ~ N(0, 1)``,
    ``b ~ N(0, 10)``, ``sigma ~ U(0, 10)``. The tutorial's ``PyroModule[nn.Linear]`` is written as
    ``(x * w).sum(-1) + b`` so that it broadcasts over quadrature nodes and particles (same
    density, evaluated in one pass instead of a loop)."""

    def __init__(self, in_features: int = 3):
        super().__init__()
        self.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, in_features]).to_event(2))
        self.bias = PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        mean = (x * self.weight[..., 0, :]).sum(-1) + self.bias[..., 0]
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


GMM_DATA = (0.0, 1.0, 10.0, 11.0, 12.0)
"""The data of Pyro's Gaussian mixture tutorial."""


def gmm_marginalized(data):
    """Pyro's Gaussian mixture tutorial (two components, ``weights ~ Dirichlet(0.5)``,
    ``scale ~ LogNormal(0, 2)``, ``locs ~ N(0, 10)``) with the assignment summed out by
    ``logsumexp``: continuous latents only (4 unconstrained coordinates)."""
    num_components = 2
    weights = pyro.sample("weights", dist.Dirichlet(0.5 * torch.ones(num_components)))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 2.0))
    with pyro.plate("components", num_components):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", data.shape[0]):
        # (..., n, components): nodes or particles in front, the data plate at -1 after the sum
        log_lik = dist.Normal(locs.unsqueeze(-2), scale.unsqueeze(-1)).log_prob(data[:, None])
        pyro.factor("obs", torch.logsumexp(weights.log() + log_lik, dim=-1))


class BayesianNetwork(PyroModule):
    """A 1-``hidden``-1 tanh network with ``PyroSample`` priors ``N(0, 1)`` on every weight and a
    noise scale ``sigma ~ Gamma(0.5, 1)``, as in Pyro's Bayesian neural network tutorial; written
    with broadcasting products instead of ``nn.Linear`` so that it vectorizes over nodes."""

    def __init__(self, hidden: int = 50):
        super().__init__()
        self.w1 = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.b1 = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.w2 = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.b2 = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Gamma(0.5, 1.0))
        hidden_units = torch.tanh(x[:, None] * self.w1 + self.b1)  # (..., n, hidden)
        mean = (hidden_units * self.w2).sum(-1) + self.b2[..., 0]
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


def network_data(num: int = 100, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = sin(3 x) + 0.1 noise`` on ``[-1, 1]``."""
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.get_default_dtype()
    x = torch.linspace(-1, 1, num, dtype=dtype)
    return x, torch.sin(3 * x) + 0.1 * torch.randn(num, generator=generator, dtype=dtype)
