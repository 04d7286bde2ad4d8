"""Test and benchmark problems for QNVB with known optimal Gaussian mean fields.

* Bayesian linear regression: the optimal mean field is known in closed form, ``mu`` = the exact
  posterior mean and ``sigma_i = Lambda_ii^(-1/2)`` for the posterior precision ``Lambda``.
* Logistic regression and eight schools: the mean-field ELBO reduces to one-dimensional Gaussian
  integrals (Gauss-Hermite with 80 nodes, exact to machine precision for these smooth integrands)
  and is minimized in float64 (L-BFGS, then Newton's method) until the errors are near 1e-10
  sigma: a tightly converged reference sharing no code with QNVB or the rules under test.

Every problem offers its Pyro model, its negative log joint on flat unconstrained points (for
``QNVBOptimizer`` and exact-gradient runs) and the reference ``(mu, sigma)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule, PyroSample

from pyro_quadvi.quadrature import gauss_hermite

__all__ = [
    "EIGHT_SCHOOLS_SIGMA",
    "EIGHT_SCHOOLS_Y",
    "MeanFieldProblem",
    "TinyNet",
    "eight_schools",
    "linear_regression",
    "logistic_regression",
    "minimize_mean_field",
    "small_network",
]

EIGHT_SCHOOLS_Y = (28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0)
EIGHT_SCHOOLS_SIGMA = (15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0)
_GH_NODES = 80


@dataclass
class MeanFieldProblem:
    """A model, its negative log joint on flat points, and its optimal mean field.

    Attributes:
        name: a short label.
        model: the Pyro model (no arguments).
        neg_log_joint: ``z (..., dim) -> -log p(x, T(z)) - log|J|`` in the unconstrained space,
            with the latent sites laid end to end in the order of ``sites``.
        sites: ``(site name, size)`` of the latent sites, in order.
        neg_elbo: ``(mu, sigma) -> -ELBO`` of the mean field, exact up to a constant.
        mu, sigma: the optimal mean field, flat, in the unconstrained space (float64), or
            ``None`` where it is not known.
    """

    name: str
    model: Callable[[], None]
    neg_log_joint: Callable[[torch.Tensor], torch.Tensor]
    sites: list[tuple[str, int]]
    neg_elbo: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    mu: torch.Tensor | None
    sigma: torch.Tensor | None

    @property
    def dim(self) -> int:
        return sum(size for _, size in self.sites)

    def error(self, mu: torch.Tensor, sigma: torch.Tensor) -> float:
        """``max_i max(|mu_i - mu*_i| / sigma*_i, |sigma_i / sigma*_i - 1|)``."""
        mu = mu.detach().to(self.mu.dtype).reshape(-1)
        sigma = sigma.detach().to(self.mu.dtype).reshape(-1)
        mean_err = ((mu - self.mu).abs() / self.sigma).max()
        scale_err = (sigma / self.sigma - 1).abs().max()
        return float(torch.maximum(mean_err, scale_err))


def _design(n: int, d: int, rho: float, generator: torch.Generator) -> torch.Tensor:
    """Rows with unit variances and ``corr(x_i, x_j) = rho^|i - j|`` (AR(1)); orthogonal columns
    of norm ``sqrt(n)`` when ``rho == 0``."""
    if rho == 0:
        q, _ = torch.linalg.qr(torch.randn(n, d, generator=generator, dtype=torch.float64))
        return q * math.sqrt(n)
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    for j in range(1, d):  # AR(1) across columns keeps every marginal variance at one
        x[:, j] = rho * x[:, j - 1] + math.sqrt(1 - rho**2) * x[:, j]
    return x


def _linear_predictor(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ b`` for coefficients ``b`` of shape ``(d,)``, ``(n,)``; under a particle plate
    ``(K, 1, d)`` (the ``1`` is the data plate's slot): a matrix product, then the slot dropped,
    ``(K, n)``. ``Predictive(parallel=True)`` gives ``(K, d)``, without the slot (it reshapes a
    draw to ``(K,) + (1,) * (max_plate_nesting - 1) + (d,)``, counting the event dim as a plate's
    slot): ``(K, n)`` straight from the product."""
    eta = b @ x.T
    return eta.reshape(*b.shape[:-2], x.shape[0]) if b.dim() > 2 else eta


def linear_regression(
    d: int, rho: float = 0.0, n: int | None = None, seed: int = 0
) -> tuple[MeanFieldProblem, torch.Tensor, torch.Tensor]:
    """``b ~ N(0, I)``, ``y ~ N(X b, 1)``: the optimal mean field in closed form.

    Returns:
        ``(problem, X, y)``.
    """
    generator = torch.Generator().manual_seed(seed)
    n = n or 2 * d + 50
    x = _design(n, d, rho, generator)
    beta = torch.randn(d, generator=generator, dtype=torch.float64)
    y = x @ beta + torch.randn(n, generator=generator, dtype=torch.float64)
    precision = x.T @ x + torch.eye(d, dtype=torch.float64)
    mean = torch.linalg.solve(precision, x.T @ y)

    def model():
        b = pyro.sample("b", dist.Normal(torch.zeros(d, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("y", dist.Normal(_linear_predictor(x, b), 1.0), obs=y)

    def neg_elbo(mu, sigma):
        fit = 0.5 * ((y - x @ mu) ** 2).sum() + 0.5 * ((x**2).sum(0) * sigma**2).sum()
        return fit + 0.5 * (mu**2 + sigma**2).sum() - sigma.log().sum()

    def neg_log_joint(z):
        resid = y - z @ x.T
        return (
            0.5 * (resid**2).sum(-1) + 0.5 * (z**2).sum(-1) + 0.5 * (n + d) * math.log(2 * math.pi)
        )

    problem = MeanFieldProblem(
        f"linear d={d} rho={rho}",
        model,
        neg_log_joint,
        [("b", d)],
        neg_elbo,
        mean,
        precision.diagonal().rsqrt(),
    )
    return problem, x, y


def minimize_mean_field(
    objective: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dim: int,
    loc: torch.Tensor | None = None,
    log_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimize ``objective(mu, sigma)`` over ``(mu, log sigma)`` in float64: L-BFGS from
    ``(loc, log_scale)`` (default ``(0, -1)``), then Newton steps (the loss is too flat in
    floating point for a line search near the end) until ``|dL/dmu| sigma`` and
    ``|dL/dlog sigma|`` are below 1e-10 (errors near 1e-10 sigma).

    Raises:
        RuntimeError: if 20 Newton steps do not get there (a saddle, or an objective that is
            not smooth to that precision).
    """

    def flat_objective(params):
        return objective(params[:dim], params[dim:].exp())

    loc = torch.zeros(dim) if loc is None else loc
    log_scale = torch.full((dim,), -1.0) if log_scale is None else log_scale
    params = torch.cat([loc, log_scale]).double().detach().requires_grad_()
    optimizer = torch.optim.LBFGS(
        [params],
        lr=1.0,
        max_iter=2000,
        tolerance_grad=1e-12,
        tolerance_change=0.0,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimizer.zero_grad()
        loss = flat_objective(params)
        loss.backward()
        return loss

    optimizer.step(closure)
    params = params.detach()
    for _ in range(20):
        grad = torch.func.grad(flat_objective)(params)
        # the Newton step of mu in units of sigma, and the relative error of sigma
        residual = torch.cat([grad[:dim] * params[dim:].exp(), grad[dim:]]).abs().max()
        if residual < 1e-10:
            return params[:dim], params[dim:].exp()
        hessian = torch.func.hessian(flat_objective)(params)
        params = params - torch.linalg.solve(hessian, grad)
    raise RuntimeError(f"the reference did not converge: residual {residual:.2e}")


def logistic_regression(
    d: int, n: int, seed: int = 0, prior_scale: float = 1.0
) -> tuple[MeanFieldProblem, torch.Tensor, torch.Tensor]:
    """``b ~ N(0, prior_scale^2 I)``, ``y ~ Bernoulli(sigmoid(X b))``; reference by L-BFGS.

    The ELBO's likelihood term is a sum of one-dimensional expectations over
    ``x_n^T b ~ N(x_n^T mu, sum_i x_ni^2 sigma_i^2)``, integrated by Gauss-Hermite.

    Returns:
        ``(problem, X, y)``.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    beta = torch.randn(d, generator=generator, dtype=torch.float64)
    y = (torch.rand(n, generator=generator, dtype=torch.float64) < torch.sigmoid(x @ beta)).double()
    sign = 2 * y - 1
    nodes, weights = gauss_hermite(_GH_NODES)

    def neg_elbo(mu, sigma):
        mean, std = x @ mu, ((x**2) @ sigma**2).sqrt()
        t = mean[:, None] + std[:, None] * nodes
        lik = (F.logsigmoid(t * sign[:, None]) * weights).sum()
        prior = 0.5 * ((mu**2 + sigma**2) / prior_scale**2).sum()
        return -lik + prior - sigma.log().sum()

    def model():
        b = pyro.sample("b", dist.Normal(torch.zeros(d, dtype=x.dtype), prior_scale).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("y", dist.Bernoulli(logits=_linear_predictor(x, b)), obs=y)

    def neg_log_joint(z):
        logits = z @ x.T
        lik = F.logsigmoid(logits * sign).sum(-1)
        prior = dist.Normal(0.0, prior_scale).log_prob(z).sum(-1)
        return -(lik + prior)

    mu, sigma = minimize_mean_field(neg_elbo, d)
    problem = MeanFieldProblem(
        f"logistic d={d} n={n}", model, neg_log_joint, [("b", d)], neg_elbo, mu, sigma
    )
    return problem, x, y


def eight_schools() -> MeanFieldProblem:
    """Non-centered eight schools: ``mu ~ N(0, 5)``, ``tau ~ HalfCauchy(5)``, ``eta_j ~ N(0, 1)``,
    ``y_j ~ N(mu + tau eta_j, sigma_j)``; latents ``(mu, log tau, eta)``.

    Under the mean field every expectation is analytic (``E[e^(a u)] = e^(a m + a^2 s^2 / 2)``)
    except ``E[log(1 + tau^2 / 25)]``, integrated by Gauss-Hermite.
    """
    y = torch.tensor(EIGHT_SCHOOLS_Y, dtype=torch.float64)
    s = torch.tensor(EIGHT_SCHOOLS_SIGMA, dtype=torch.float64)
    nodes, weights = gauss_hermite(_GH_NODES)

    def neg_elbo(m, sd):
        m_mu, s_mu, m_u, s_u, m_eta, s_eta = m[0], sd[0], m[1], sd[1], m[2:], sd[2:]
        u = m_u + s_u * nodes
        e_cauchy = (weights * torch.log1p(torch.exp(2 * u) / 25)).sum()
        e_tau = torch.exp(m_u + s_u**2 / 2)
        e_tau2 = torch.exp(2 * m_u + 2 * s_u**2)
        sq = (y - m_mu) ** 2 + s_mu**2 - 2 * (y - m_mu) * e_tau * m_eta
        sq = sq + e_tau2 * (m_eta**2 + s_eta**2)
        value = (m_mu**2 + s_mu**2) / 50 + e_cauchy - m_u
        value = value + 0.5 * (m_eta**2 + s_eta**2).sum() + (sq / (2 * s**2)).sum()
        return value - sd.log().sum()

    def model():
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(5.0, dtype=y.dtype)))
        with pyro.plate("schools", 8):
            eta = pyro.sample("eta", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 1.0))
            pyro.sample("y", dist.Normal(mu + tau * eta, s), obs=y)

    def neg_log_joint(z):
        mu, u, eta = z[..., 0], z[..., 1], z[..., 2:]
        tau = u.exp()
        lp = dist.Normal(0.0, 5.0).log_prob(mu) + dist.HalfCauchy(5.0).log_prob(tau) + u
        lp = lp + dist.Normal(0.0, 1.0).log_prob(eta).sum(-1)
        lp = lp + dist.Normal(mu[..., None] + tau[..., None] * eta, s).log_prob(y).sum(-1)
        return -lp

    mu, sigma = minimize_mean_field(neg_elbo, 10)
    return MeanFieldProblem(
        "eight schools",
        model,
        neg_log_joint,
        [("mu", 1), ("tau", 1), ("eta", 8)],
        neg_elbo,
        mu,
        sigma,
    )


def small_network(n: int = 100, hidden: int = 8, seed: int = 0, num_samples: int = 4096):
    """A Bayesian network ``y ~ N(w2 . tanh(w1 x + b1) + b2, 0.1^2)`` with ``N(0, 1)`` weights,
    fitted to ``sin(3x)`` on ``[-1, 1]``.

    No closed form: ``neg_elbo`` is a Monte Carlo estimate with ``num_samples`` fixed standard
    normal draws (common random numbers, so that differences between mean fields are smooth) and
    ``mu``, ``sigma`` are ``None``; benchmarks compare ELBOs against the best one reached.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.linspace(-1, 1, n, dtype=torch.float64)
    y = torch.sin(3 * x) + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64)
    sizes = [("w1", hidden), ("b1", hidden), ("w2", hidden), ("b2", 1)]
    dim = sum(size for _, size in sizes)
    draws = torch.randn(num_samples, dim, generator=generator, dtype=torch.float64)

    def predict(w1, b1, w2, b2):
        # weights (..., hidden) with batch dims ending in the data plate's slot
        hidden_units = torch.tanh(x.unsqueeze(-1) * w1 + b1)  # (..., n, hidden)
        return (hidden_units * w2).sum(-1) + b2

    def model():
        zero = torch.tensor(0.0, dtype=x.dtype)
        weights = {}
        for name, size in sizes[:3]:
            value = pyro.sample(name, dist.Normal(zero, 1.0).expand([size]).to_event(1))
            weights[name] = value.unsqueeze(0) if value.dim() == 1 else value
        b2 = pyro.sample("b2", dist.Normal(zero, 1.0))
        with pyro.plate("data", n):
            mean = predict(weights["w1"], weights["b1"], weights["w2"], b2)
            pyro.sample("y", dist.Normal(mean, 0.1), obs=y)

    def neg_log_joint(z):
        w1, b1, w2, b2 = torch.split(z, [size for _, size in sizes], dim=-1)
        mean = predict(w1.unsqueeze(-2), b1.unsqueeze(-2), w2.unsqueeze(-2), b2)
        lik = dist.Normal(mean, 0.1).log_prob(y).sum(-1)
        return -(lik + dist.Normal(0.0, 1.0).log_prob(z).sum(-1))

    def neg_elbo(mu, sigma):
        return neg_log_joint(mu + sigma * draws).mean() - sigma.log().sum()

    return MeanFieldProblem(
        f"network {hidden} hidden", model, neg_log_joint, sizes, neg_elbo, None, None
    )


class TinyNet(PyroModule):
    """A 2-1 Bayesian linear network written as Pyro users do (``PyroModule[nn.Linear]``): its
    layer cannot broadcast over a node dimension, so quadrature loops over nodes."""

    def __init__(self):
        super().__init__()
        self.fc = PyroModule[torch.nn.Linear](2, 1)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 2]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, X: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        mean = self.fc(X).squeeze(-1)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(mean, 0.5), obs=y)
        return mean
