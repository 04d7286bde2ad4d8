"""``predict``'s predictive variance for a Gaussian likelihood: model average plus noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pyro_quadvi import AutoMeanFieldNormal, AutoSpikeSlab
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.quadrature import make_rule

DTYPE = torch.float64
pytestmark = pytest.mark.usefixtures("fresh_param_store")

X = torch.tensor(
    [[0.5, -1.0, 0.2], [1.5, 0.3, -0.7], [-0.4, 0.8, 1.1], [0.0, -0.6, 0.9]], dtype=DTYPE
)
Y = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=DTYPE)
DESIGN = torch.cat([X, torch.ones(len(X), 1, dtype=DTYPE)], dim=1)  # (weight, bias)
MU = torch.tensor([0.3, -0.7, 0.2, 0.1], dtype=DTYPE)
S = torch.tensor([0.4, 0.25, 0.6, 0.35], dtype=DTYPE)


def _set(guide, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
    with torch.no_grad():
        getattr(guide.locs, name).copy_(loc.reshape(getattr(guide.locs, name).shape))
        setattr(guide.scales, name, scale.reshape(getattr(guide.locs, name).shape).clone())


def _linear(likelihood):
    """A linear layer's BNN and its guide at the mean field N(MU, diag(S^2)) over (w, b)."""
    bnn = BayesianModule(nn.Linear(3, 1).double(), priors.Normal(1.0), likelihood)
    guide = AutoMeanFieldNormal(bnn)
    guide(X, Y)
    _set(guide, "weight", MU[:3], S[:3])
    _set(guide, "bias", MU[3:], S[3:])
    return bnn, guide


def test_fixed_noise_predictive_variance_is_the_closed_form():
    bnn, guide = _linear(likelihoods.Gaussian(len(X), scale=0.5))
    pred = bnn.predict(guide, X, quadrature="gauss_hermite", num_points=2)
    # y = x.w + b + noise: mean x.mu + mu_b, variance sum x_i^2 s_i^2 + s_b^2 + 0.5^2
    assert pred.mean.shape == pred.variance.shape == pred.noise_variance.shape == (4, 1)
    torch.testing.assert_close(pred.mean[:, 0], DESIGN @ MU, rtol=0, atol=1e-13)
    torch.testing.assert_close(pred.noise_variance, torch.full((4, 1), 0.25, dtype=DTYPE))
    expected = (DESIGN**2) @ S**2 + 0.25
    torch.testing.assert_close(pred.variance[:, 0], expected, rtol=0, atol=1e-13)


def test_a_prediction_at_quadrature_nodes_draws_no_random_numbers():
    # the guide runs for its description only (trace_for_description): the closed form as above,
    # and torch's random state as it was
    bnn, guide = _linear(likelihoods.Gaussian(len(X), scale=0.5))
    state = torch.get_rng_state()
    pred = bnn.predict(guide, X, quadrature="gauss_hermite", num_points=2)
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(pred.mean[:, 0], DESIGN @ MU, rtol=0, atol=1e-13)
    expected = (DESIGN**2) @ S**2 + 0.25
    torch.testing.assert_close(pred.variance[:, 0], expected, rtol=0, atol=1e-13)


def test_learned_noise_variance_is_the_mean_of_the_squared_noise_scale():
    # noise_scale = exp(z), z ~ N(m, t^2) (the guide's transform onto the positive reals), so
    # E[noise_scale^2] = exp(2 m + 2 t^2), the mean of a log-normal
    bnn, guide = _linear(likelihoods.Gaussian(len(X), scale=None))
    m, t = -1.2, 0.2
    _set(guide, "noise_scale", torch.tensor(m, dtype=DTYPE), torch.tensor(t, dtype=DTYPE))
    pred = bnn.predict(guide, X, quadrature="gauss_hermite", num_points=6)
    noise = math.exp(2 * m + 2 * t**2)
    torch.testing.assert_close(pred.noise_variance, torch.full((4, 1), noise, dtype=DTYPE))
    expected = (DESIGN**2) @ S**2 + noise
    torch.testing.assert_close(pred.variance[:, 0], expected, rtol=1e-10, atol=0)
    torch.testing.assert_close(pred.mean[:, 0], DESIGN @ MU, rtol=0, atol=1e-13)

    # random draws: with scales of 1e-9 every draw is the loc, and the variance is the noise's
    tiny = torch.full((4,), 1e-9, dtype=DTYPE)
    _set(guide, "weight", MU[:3], tiny[:3])
    _set(guide, "bias", MU[3:], tiny[3:])
    _set(guide, "noise_scale", torch.tensor(m, dtype=DTYPE), torch.tensor(1e-9, dtype=DTYPE))
    pred = bnn.predict(guide, X, num_samples=5)
    torch.testing.assert_close(
        pred.variance, torch.full((4, 1), math.exp(2 * m), dtype=DTYPE), rtol=1e-7, atol=0
    )


def test_classification_has_no_predictive_variance():
    bnn = BayesianModule(
        nn.Linear(3, 2).double(), priors.Normal(1.0), likelihoods.Categorical(len(X))
    )
    guide = AutoMeanFieldNormal(bnn)
    guide(X, torch.tensor([0, 1, 1, 0]))
    pred = bnn.predict(guide, X, num_samples=4)
    assert pred.variance is None and pred.noise_variance is None and pred.probs.shape == (4, 2)


def test_a_spike_and_slab_guide_is_refused_with_quadrature_and_drawn_with_num_samples():
    bnn = BayesianModule(
        nn.Linear(3, 1).double(), priors.SpikeSlab(0.5), likelihoods.Gaussian(len(X), scale=0.5)
    )
    guide = AutoSpikeSlab(bnn, init_inclusion=0.6)
    guide(X, Y)
    with torch.no_grad():
        guide.locs.weight.copy_(MU[:3].reshape(1, 3))
        guide.locs.bias.copy_(MU[3:])
    with pytest.raises(ValueError, match=r"dirac_gauss.*num_samples"):
        bnn.predict(guide, X, quadrature="hadamard", num_points=4)
    # the draws' average: E[y] = x.(phi nu_w) + phi nu_b, within 5 standard errors
    S = 4000
    pred = bnn.predict(guide, X, num_samples=S)
    assert pred.outputs.shape == (S, 4, 1)
    torch.testing.assert_close(pred.mean[:, 0], pred.outputs[:, :, 0].mean(0))
    se = pred.outputs[:, :, 0].std(0) / math.sqrt(S)
    assert ((pred.mean[:, 0] - 0.6 * DESIGN @ MU).abs() < 5 * se).all()
    assert (pred.outputs == 0).all(dim=2).all(dim=1).any()  # a draw with all four weights zero


def _hadamard_cross_moments(dim: int, steps: int) -> torch.Tensor:
    """``sum_k w_k x_k x_k^T`` of the nodes of ``steps`` Hadamard steps, averaged."""
    rule = make_rule("hadamard")
    total = torch.zeros(dim, dim, dtype=DTYPE)
    for step in range(steps):
        nodes = rule.draw(dim, step=step, dtype=DTYPE)
        x = nodes.matrix()
        total += (x * nodes.weights[:, None]).T @ x / steps
    return total


def test_one_hadamard_step_misses_cross_terms_and_its_period_gives_the_closed_form():
    # y = a.z with a = (x, 1) and z ~ N(mu, diag(s^2)) over the 7 entries (w, b) of Linear(6, 1):
    # at nodes z_k = mu + s * x_k, Var = sum_ij a_i a_j s_i s_j C_ij, C = sum_k w_k x_k x_k^T;
    # the closed form has C = I. One Hadamard step's C has off-diagonal +-1s; 4 steps (the
    # period in 7 dimensions) average them to 0.
    x = torch.tensor(
        [[0.5, -1.0, 0.2, 0.8, -0.3, 1.1], [1.5, 0.3, -0.7, -0.2, 0.9, 0.4]], dtype=DTYPE
    )
    mu = torch.linspace(-0.6, 0.6, 7, dtype=DTYPE)
    s = torch.tensor([0.4, 0.25, 0.6, 0.35, 0.5, 0.3, 0.45], dtype=DTYPE)
    bnn = BayesianModule(
        nn.Linear(6, 1).double(), priors.Normal(1.0), likelihoods.Gaussian(2, scale=0.5)
    )
    guide = AutoMeanFieldNormal(bnn)
    guide(x, torch.zeros(2, dtype=DTYPE))
    _set(guide, "weight", mu[:6], s[:6])
    _set(guide, "bias", mu[6:], s[6:])
    design = torch.cat([x, torch.ones(2, 1, dtype=DTYPE)], dim=1) * s  # rows a_i s_i
    closed = (design**2).sum(1) + 0.25
    assert make_rule("hadamard").period(7) == 4

    one = bnn.predict(guide, x, quadrature="hadamard")
    assert len(one.weights) == 4
    cross = _hadamard_cross_moments(7, 1)
    assert (cross - torch.eye(7, dtype=DTYPE)).abs().max() == 1.0  # off-diagonal +-1s
    biased = ((design @ cross) * design).sum(1) + 0.25
    torch.testing.assert_close(one.variance[:, 0], biased, rtol=0, atol=1e-13)
    ratio = one.variance[:, 0] / closed
    torch.testing.assert_close(
        ratio, torch.tensor([0.9805, 1.1773], dtype=DTYPE), atol=1e-4, rtol=0
    )

    for steps in (4, "period"):
        full = bnn.predict(guide, x, quadrature="hadamard", steps=steps)
        assert len(full.weights) == 16
        torch.testing.assert_close(full.weights.sum(), torch.tensor(1.0, dtype=DTYPE))
        torch.testing.assert_close(full.variance[:, 0], closed, rtol=0, atol=1e-13)
        torch.testing.assert_close(full.mean[:, 0], (x @ mu[:6]) + mu[6], rtol=0, atol=1e-13)
    # two steps make only the pairs whose indices differ in the two lowest bits exact
    two = bnn.predict(guide, x, quadrature="hadamard", steps=2)
    expected = ((design @ _hadamard_cross_moments(7, 2)) * design).sum(1) + 0.25
    torch.testing.assert_close(two.variance[:, 0], expected, rtol=0, atol=1e-13)
    assert (two.variance[:, 0] - closed).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("steps", "quadrature", "error", "match"),
    [
        (0, "hadamard", ValueError, r"steps must be an int >= 1.*got 0"),
        (True, "hadamard", TypeError, r"steps must be an int >= 1.*got True"),
        (2.0, "hadamard", TypeError, r"steps must be an int >= 1.*got 2.0"),
        ("full", "hadamard", ValueError, r"or \"period\", got 'full'"),
        (2, None, ValueError, r"steps=2 averages steps of a quadrature rule.*quadrature=None"),
        ("period", "blocked_simplex", ValueError, r"'blocked_simplex' has no period.*hadamard"),
    ],
)
def test_bad_steps_are_refused_naming_the_fix(steps, quadrature, error, match):
    bnn, guide = _linear(likelihoods.Gaussian(len(X), scale=0.5))
    with pytest.raises(error, match=match):
        bnn.predict(guide, X, quadrature=quadrature, steps=steps)


@pytest.mark.parametrize("quadrature", [None, "hadamard"])
def test_a_guide_of_another_network_is_refused_naming_the_site_and_shapes(quadrature):
    # before: a raw torch error, "The expanded size of the tensor (2) must match ... (1)" (draws)
    # or a reshape error (nodes), naming neither the site nor the cause
    _, guide = _linear(likelihoods.Gaussian(len(X), scale=0.5))  # nn.Linear(3, 1)
    wider = BayesianModule(
        nn.Linear(3, 2).double(), priors.Normal(1.0), likelihoods.Gaussian(len(X), scale=0.5)
    )
    match = r"site 'weight' has shape \(1, 3\), but the net's parameter 'weight' has shape \(2, 3\)"
    with pytest.raises(ValueError, match=match):
        wider.predict(guide, X, num_samples=4, quadrature=quadrature)
