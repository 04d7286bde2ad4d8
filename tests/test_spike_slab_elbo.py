"""The two estimators of a spike-and-slab fit: QuadratureELBO over the mixture's moments, and the
sparse-VI paper's Gumbel-softmax ELBO; both meet a SpikeSlab prior in the closed-form KL."""

from __future__ import annotations

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.optim import Adam
from torch.distributions import kl_divergence

from pyro_quadvi import AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.guides.interface import published_moments
from pyro_quadvi.infer import GumbelSpikeSlabELBO
from pyro_quadvi.infer.gumbel import straight_through_gate

pytestmark = pytest.mark.usefixtures("fresh_param_store")

DTYPE = torch.float64
SIGMA = 0.5
LAMBDA, SLAB = 0.3, 1.5


# ------------------------------------------------------------------- the straight-through gate
def test_gate_is_exactly_zero_or_one_forward_with_the_relaxed_gradient():
    torch.manual_seed(0)
    logits = torch.tensor([-2.0, -0.3, 0.0, 0.8, 3.0], dtype=DTYPE, requires_grad=True)
    u = torch.rand(4000, 5, dtype=DTYPE)
    gate = straight_through_gate(logits, 0.5, u)
    assert set(gate.detach().unique().tolist()) <= {0.0, 1.0}
    eta = logits.detach() + torch.log(u) - torch.log1p(-u)
    torch.testing.assert_close(gate.detach(), (eta > 0).to(DTYPE), rtol=0, atol=0)
    # a one with probability phi = sigmoid(logit), within binomial tolerance
    phi = torch.sigmoid(logits.detach())
    tolerance = 4 * (phi * (1 - phi) / len(u)).sqrt()
    assert ((gate.detach().mean(0) - phi).abs() <= tolerance).all()
    # the gradient is the relaxed sample's: d/dlogit sigmoid(eta / t) = s (1 - s) / t
    weights = torch.randn(4000, 5, dtype=DTYPE)
    (grad,) = torch.autograd.grad((gate * weights).sum(), logits)
    relaxed = torch.sigmoid(eta / 0.5)
    torch.testing.assert_close(grad, (weights * relaxed * (1 - relaxed) / 0.5).sum(0))


def test_temperature_and_particles_are_checked():
    with pytest.raises(ValueError, match="temperature must be a positive"):
        GumbelSpikeSlabELBO(temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        GumbelSpikeSlabELBO(temperature=True)  # a bool is an int, but not a temperature
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        GumbelSpikeSlabELBO(temperature=math.inf)
    with pytest.raises(ValueError, match="num_particles must be a positive integer"):
        GumbelSpikeSlabELBO(num_particles=True)
    with pytest.raises(ValueError, match="num_particles must be a positive integer"):
        GumbelSpikeSlabELBO(num_particles=0)


# ---------------------------------------------------- a model whose ELBO is known exactly
X = torch.tensor(
    [[0.9, -0.4, 0.2], [0.1, 0.7, -1.0], [-0.5, 0.3, 0.8], [1.2, -0.2, 0.4], [0.3, 0.9, -0.6]],
    dtype=DTYPE,
)
Y = torch.tensor(
    [[1.1, -0.3, 0.2], [0.4, 1.9, -0.8], [-0.6, 0.5, 1.3], [2.0, 0.1, 0.7], [0.2, 1.0, -1.1]],
    dtype=DTYPE,
)


def separable_model(x, y=None):
    """y_ij ~ N(x_ij w_j, sigma^2): a sum of univariate quadratics in w, which every rule
    integrates exactly (no cross terms)."""
    prior = SpikeSlab(torch.tensor(LAMBDA, dtype=DTYPE), torch.tensor(SLAB, dtype=DTYPE))
    w = pyro.sample("w", prior.expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x * w, SIGMA).to_event(1), obs=y)


def linear_model(x, y=None):
    prior = SpikeSlab(torch.tensor(LAMBDA, dtype=DTYPE), torch.tensor(SLAB, dtype=DTYPE))
    w = pyro.sample("w", prior.expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal((x * w).sum(-1), SIGMA), obs=y)


def fitted_guide(nu, tau, zeta):
    guide = AutoSpikeSlab(separable_model)
    guide(X, Y)
    with torch.no_grad():
        guide.locs.w_unconstrained.copy_(torch.tensor(nu, dtype=DTYPE))
        scale = torch.tensor(tau, dtype=DTYPE)
        guide.scales.w_unconstrained.copy_(scale.expm1().log())  # softplus inverse
        guide.logits.w_unconstrained.copy_(torch.tensor(zeta, dtype=DTYPE))
    return guide


NU, TAU, ZETA = [0.8, -0.3, 0.05], [0.2, 0.4, 0.3], [-1.5, 0.2, 2.0]


def exact_negative_elbo(nu, tau, zeta):
    """-E_q[log p(y | w)] + KL(q || prior), by hand: the likelihood is quadratic in w, so its
    expectation needs only the mixture's mean and variance (eq. 4.2)."""
    q = SpikeSlab(zero_logits=zeta, slab_scale=tau, slab_loc=nu)
    mean, var = q.mean, q.variance
    expected_sq = (Y - X * mean) ** 2 + X**2 * var
    log_lik = -0.5 * math.log(2 * math.pi * SIGMA**2) * Y.numel() - expected_sq.sum() / (
        2 * SIGMA**2
    )
    prior = SpikeSlab(torch.tensor(LAMBDA, dtype=DTYPE), torch.tensor(SLAB, dtype=DTYPE))
    return -log_lik + kl_divergence(q, prior).sum()


@pytest.mark.parametrize("rule", ["blocked_simplex", "rasp_simplex", "rasp_cross", "hadamard"])
def test_quadrature_elbo_is_the_exact_objective_and_gradient_for_a_quadratic_likelihood(rule):
    guide = fitted_guide(NU, TAU, ZETA)
    elbo = QuadratureELBO(rule)
    loss = elbo.differentiable_loss(separable_model, guide, X, Y)
    params = [
        guide.locs.w_unconstrained,
        guide.scales.w_unconstrained,
        guide.logits.w_unconstrained,
    ]
    grads = torch.autograd.grad(loss, params)
    leaves = [p.detach().clone().requires_grad_() for p in params]
    exact = exact_negative_elbo(leaves[0], torch.nn.functional.softplus(leaves[1]), leaves[2])
    assert loss.item() == pytest.approx(exact.item(), rel=1e-12)
    for got, want in zip(grads, torch.autograd.grad(exact, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_quadrature_elbo_publishes_g_and_h_of_the_smooth_loss_under_the_moment_matched_gaussian():
    guide = fitted_guide(NU, TAU, ZETA)
    loss = QuadratureELBO().differentiable_loss(separable_model, guide, X, Y)
    loss.backward()
    moments = published_moments(guide.locs.w_unconstrained)
    assert moments is not None and moments.site.family == "dirac_gauss"
    mean = SpikeSlab(
        zero_logits=torch.tensor(ZETA, dtype=DTYPE),
        slab_scale=torch.tensor(TAU, dtype=DTYPE),
        slab_loc=torch.tensor(NU, dtype=DTYPE),
    ).mean
    # U = sum_ij (y_ij - x_ij w_j)^2 / (2 sigma^2): g = E[dU/dw] at the mean, h its Hessian
    g = -(X * (Y - X * mean)).sum(0) / SIGMA**2
    h = (X**2).sum(0) / SIGMA**2
    torch.testing.assert_close(moments.g, g, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(moments.h, h, rtol=1e-10, atol=1e-12)


def test_gumbel_elbo_is_an_unbiased_draw_of_the_same_objective_for_per_coordinate_quadratics():
    torch.manual_seed(0)
    guide = fitted_guide(NU, TAU, ZETA)
    K = 20_000
    elbo = GumbelSpikeSlabELBO(num_particles=K, vectorize=True)
    description = guide.quadrature_description()
    z = elbo.draw(description).detach()
    assert z.shape == (K, 3)
    zeros = (z == 0).double().mean(0)
    q_zero = torch.sigmoid(torch.tensor(ZETA, dtype=DTYPE))
    assert ((zeros - q_zero).abs() <= 4 * (q_zero * (1 - q_zero) / K).sqrt()).all()
    per_draw = ((Y - X * z[:, None, :]) ** 2).sum((-1, -2))  # the likelihood at each draw
    log_lik = -0.5 * math.log(2 * math.pi * SIGMA**2) * Y.numel() - per_draw / (2 * SIGMA**2)
    se = log_lik.std().item() / math.sqrt(K)
    torch.manual_seed(1)
    loss = elbo.loss(separable_model, guide, X, Y)
    assert abs(loss - exact_negative_elbo(*map(torch.tensor, (NU, TAU, ZETA))).item()) < 4 * se


def float32_model(x, y=None):
    prior = SpikeSlab(torch.tensor(LAMBDA), torch.tensor(SLAB))
    w = pyro.sample("w", prior.expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x * w, SIGMA).to_event(1), obs=y)


def test_a_mixture_whose_variance_underflows_gives_finite_gradients_and_a_finite_adam_step():
    # a zero logit of 200 puts inclusion at exp(-200), 0 in float32: the mixture variance is 0
    x, y = X.float(), Y.float()
    guide = AutoSpikeSlab(float32_model)
    guide(x, y)
    with torch.no_grad():
        guide.logits.w_unconstrained.copy_(torch.tensor([200.0, 0.0, 0.0]))
    assert guide._full_mixture("w_unconstrained").variance[0].item() == 0.0
    elbo = QuadratureELBO("hadamard", 4)
    loss = elbo.differentiable_loss(float32_model, guide, x, y)
    params = [guide.locs.w_unconstrained, guide.scales.w_unconstrained]
    params.append(guide.logits.w_unconstrained)
    grads = torch.autograd.grad(loss, params)
    assert torch.isfinite(loss)
    for grad in grads:
        assert torch.isfinite(grad).all()
    # coordinate 0 is exactly zero at every node: the likelihood does not see its slab mean
    assert grads[0][0].item() == pytest.approx(0.0, abs=1e-6)
    # the published moments are those of the quadratic loss (see the test above), finite
    moments = published_moments(guide.locs.w_unconstrained)
    mean = guide._full_mixture("w_unconstrained").mean.detach()
    torch.testing.assert_close(moments.g, -(x * (y - x * mean)).sum(0) / SIGMA**2)
    assert torch.isfinite(moments.h).all()  # coordinate 0: nodes 1e-19 apart, h rounds
    torch.testing.assert_close(moments.h[1:], (x[:, 1:] ** 2).sum(0) / SIGMA**2)
    svi = SVI(float32_model, guide, Adam({"lr": 0.1}), elbo)
    svi.step(x, y)
    for param in params:
        assert torch.isfinite(param).all()


def normal_prior_model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=DTYPE), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x * w, SIGMA).to_event(1), obs=y)


@pytest.mark.parametrize("elbo", [QuadratureELBO(), GumbelSpikeSlabELBO()])
def test_a_prior_without_a_point_mass_is_refused_by_name(elbo):
    guide = AutoSpikeSlab(normal_prior_model)
    with pytest.raises(ValueError, match=r"site 'w'.*Normal has none.*SpikeSlab"):
        elbo.loss(normal_prior_model, guide, X, Y)


def local_model(data):
    prior = SpikeSlab(torch.tensor(0.4, dtype=DTYPE), torch.tensor(2.0, dtype=DTYPE))
    with pyro.plate("rows", 6, subsample_size=2) as idx:
        u = pyro.sample("u", prior)
        pyro.sample("obs", dist.Normal(u, 1.0), obs=data[idx])
    return idx


def test_the_kl_of_a_subsampled_site_carries_the_minibatch_scale():
    data = torch.linspace(-1, 2, 6, dtype=DTYPE)
    guide = AutoSpikeSlab(local_model, init_scale=0.3, init_inclusion=0.7)
    guide(data)
    pyro.set_rng_seed(5)
    loss = QuadratureELBO().loss(local_model, guide, data)
    pyro.set_rng_seed(5)
    trace = pyro.poutine.trace(guide).get_trace(data)
    rows = trace.nodes["rows"]["value"]
    q = SpikeSlab(zero_logits=guide.logits.u[rows], slab_scale=0.3, slab_loc=guide.locs.u[rows])
    prior = SpikeSlab(torch.tensor(0.4, dtype=DTYPE), torch.tensor(2.0, dtype=DTYPE))
    expected_sq = (data[rows] - q.mean) ** 2 + q.variance
    log_lik = -0.5 * math.log(2 * math.pi) * 2 - expected_sq.sum() / 2
    exact = 3.0 * (-log_lik + kl_divergence(q, prior).sum())
    assert loss == pytest.approx(exact.item(), rel=1e-10)


# ----------------------------- posterior inclusion probabilities, enumerated over all 2^d models
D, N_OBS = 6, 40


def enumeration_data():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(N_OBS, D, generator=gen, dtype=DTYPE)
    w = torch.tensor([1.2, 0.0, -0.9, 0.0, 0.0, 0.7], dtype=DTYPE)
    return x, x @ w + SIGMA * torch.randn(N_OBS, generator=gen, dtype=DTYPE)


def exact_inclusion_probabilities(x, y):
    """P(w_j != 0 | y) by enumerating the 2^d subsets: each is a conjugate Gaussian model with
    marginal y ~ N(0, sigma^2 I + slab^2 X_S X_S^T)."""
    log_weights, subsets = [], []
    for subset in itertools.product([0, 1], repeat=D):
        keep = torch.tensor(subset, dtype=torch.bool)
        cov = SIGMA**2 * torch.eye(N_OBS, dtype=DTYPE) + SLAB**2 * x[:, keep] @ x[:, keep].T
        marginal = dist.MultivariateNormal(torch.zeros(N_OBS, dtype=DTYPE), cov).log_prob(y)
        k = int(keep.sum())
        log_weights.append(marginal + k * math.log(LAMBDA) + (D - k) * math.log(1 - LAMBDA))
        subsets.append(keep)
    weights = torch.softmax(torch.stack(log_weights), 0)
    return (weights[:, None] * torch.stack(subsets).to(DTYPE)).sum(0)


@pytest.mark.parametrize("elbo", ["quadrature", "gumbel"])
def test_fitted_inclusion_probabilities_are_on_the_side_of_one_half_of_the_exact_ones(elbo):
    x, y = enumeration_data()
    exact = exact_inclusion_probabilities(x, y)
    assert ((exact - 0.5).abs() > 0.2).all()  # a clear answer for every coordinate
    guide = AutoSpikeSlab(linear_model, init_inclusion=0.5)
    objective = QuadratureELBO() if elbo == "quadrature" else GumbelSpikeSlabELBO()
    svi = SVI(linear_model, guide, Adam({"lr": 0.05}), objective)
    for _ in range(800):
        svi.step(x, y)
    fitted = guide.inclusion_probs()["w"]
    assert torch.equal(fitted > 0.5, exact > 0.5), (fitted, exact)
    assert ((fitted - exact).abs() < 0.1).all(), (fitted, exact)
