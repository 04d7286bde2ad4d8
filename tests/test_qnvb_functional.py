"""The pure QNVB update (rasp paper, eq. 4-8) on problems with exact expected gradients."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

from pyro_quadvi.optim import (
    QNVBHyperparameters,
    anneal_likelihood,
    geometric_annealing,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)
from pyro_quadvi.optim.annealing import check_schedule
from pyro_quadvi.testing import eight_schools

DTYPE = torch.float64


def _run(precision, mean, steps, hp=None, sigma0=0.1):
    """QNVB with the exact g and h of the Gaussian loss (z - m)^T P (z - m) / 2."""
    hp = hp or QNVBHyperparameters()
    mu = torch.zeros_like(mean)
    sigma = torch.full_like(mean, sigma0)
    state = init_qnvb_state(mu)
    errors = []
    for _ in range(steps):
        result = qnvb_update(mu, sigma, precision @ (mu - mean), precision.diagonal(), state, hp)
        mu, sigma, state = result.mu, result.sigma, result.state
        errors.append(float(((mu - mean).abs() * precision.diagonal().sqrt()).max()))
    return mu, sigma, errors


def test_one_step_lands_on_a_diagonal_gaussian_posterior():
    # the first step moves the mean by at most lr = 1 (the reference's cap): a posterior within
    # that distance is reached in one step, the scale within the factor scale_max = 10 too
    lam = torch.tensor([1.0, 4.0, 25.0, 100.0], dtype=DTYPE)
    m = torch.tensor([0.9, -0.5, 0.25, 0.0], dtype=DTYPE)
    mu, sigma, _ = _run(torch.diag(lam), m, steps=1)
    torch.testing.assert_close(mu, m, rtol=0, atol=1e-14)
    torch.testing.assert_close(sigma, lam.rsqrt(), rtol=1e-14, atol=0)


def test_likelihood_weight_and_prior_precision_enter_exactly():
    # loss = w * sum(lam (z - m)^2 / 2) + p |z|^2 / 2: posterior N(w lam m / (w lam + p), ...)
    lam = torch.tensor([2.0, 0.5], dtype=DTYPE)
    m = torch.tensor([1.0, -1.0], dtype=DTYPE)
    w, p = 7.0, 3.0
    mu, sigma = torch.zeros(2, dtype=DTYPE), torch.full((2,), 0.3, dtype=DTYPE)
    result = qnvb_update(
        mu, sigma, lam * (mu - m), lam, init_qnvb_state(mu), QNVBHyperparameters(), w, p
    )
    torch.testing.assert_close(result.mu, w * lam * m / (w * lam + p), rtol=1e-14, atol=0)
    torch.testing.assert_close(result.sigma, (w * lam + p).rsqrt(), rtol=1e-14, atol=0)


def test_damping_makes_the_parallel_update_converge_on_a_correlated_gaussian():
    # equicorrelated precision, rho = 0.9: the normalized spectrum is {0.1, 9.1}, so undamped
    # parallel Newton steps (a Jacobi iteration) cannot converge
    d, rho = 10, 0.9
    precision = 50 * ((1 - rho) * torch.eye(d, dtype=DTYPE) + rho * torch.ones(d, d, dtype=DTYPE))
    mean = torch.linspace(-1, 1, d, dtype=DTYPE)
    _, sigma, damped = _run(precision, mean, 300)
    assert max(damped) < 7.0  # never diverges: the error never exceeds its start (6.4 sigma)
    assert damped[-1] < 1e-2  # within 1% of sigma
    torch.testing.assert_close(sigma, precision.diagonal().rsqrt(), rtol=1e-12, atol=0)
    _, _, undamped = _run(precision, mean, 300, QNVBHyperparameters(damping=False))
    assert undamped[-1] > 1.0


def test_mean_curvature_is_unbiased_and_rms_curvature_is_not():
    # h alternates 100 +- 60 around the true curvature 100, at the optimum (g = 0)
    mu, sigma0 = torch.zeros(1, dtype=DTYPE), torch.full((1,), 0.1, dtype=DTYPE)
    for curvature, expected in [("mean", 100.0), ("rms", math.sqrt(100.0**2 + 60.0**2))]:
        hp = QNVBHyperparameters(curvature=curvature)
        sigma, state = sigma0, init_qnvb_state(mu)
        for t in range(400):
            h = torch.full((1,), 100.0 + (60.0 if t % 2 else -60.0), dtype=DTYPE)
            result = qnvb_update(mu, sigma, torch.zeros(1, dtype=DTYPE), h, state, hp)
            sigma, state = result.sigma, result.state
        assert float(sigma) == pytest.approx(expected**-0.5, rel=1e-3)


def test_sigma_changes_at_most_by_the_scale_factors_and_stays_in_bounds():
    hp = QNVBHyperparameters(scale_min=0.5, scale_max=2.0, sigma_min=1e-3, sigma_max=10.0)
    mu = torch.zeros(3, dtype=DTYPE)
    sigma = torch.tensor([1.0, 1.0, 5e-3], dtype=DTYPE)
    # curvature targets sigma = 0.01, 100 and 1e-4
    h = torch.tensor([1e4, 1e-4, 1e8], dtype=DTYPE)
    result = qnvb_update(mu, sigma, torch.zeros(3, dtype=DTYPE), h, init_qnvb_state(mu), hp)
    torch.testing.assert_close(result.sigma, torch.tensor([0.5, 2.0, 2.5e-3], dtype=DTYPE))
    # curvature below 1 / sigma_max^2 is floored there
    result = qnvb_update(
        mu,
        torch.full((3,), 9.0, dtype=DTYPE),
        torch.zeros(3, dtype=DTYPE),
        torch.full((3,), 1e-6, dtype=DTYPE),
        init_qnvb_state(mu),
        hp,
    )
    torch.testing.assert_close(result.sigma, torch.full((3,), 10.0, dtype=DTYPE))


def _design_note_by_hand(a, b, mu, w, steps, lr, betas, eps, sigma_min, sigma_max):
    """The design note's steps 3-6 (docs: qnvb-update-rule.md) in plain Python, for the per-case
    loss ``a t^2 / 2 - b t`` (g = a mu - b, h = a exactly) with likelihood weight ``w``: the
    reference's rms curvature and warm-up averages, no prior, sigma from ``sigma_min``. ``eps``
    is the note's, per case."""
    mu, sigma = list(mu), [sigma_min] * len(mu)
    g_avg, s_avg, h2_avg = [0.0] * len(mu), [0.0] * len(mu), [0.0] * len(mu)
    c_g = c_h = 0
    out = []
    for _ in range(steps):
        c_g, c_h = min(1 / (1 - betas[0]), c_g + 1), min(1 / (1 - betas[1]), c_h + 1)
        b_g, b_h = (c_g - 1) / c_g, (c_h - 1) / c_h
        for j in range(len(mu)):
            g, h = a[j] * mu[j] - b[j], a[j]
            g_avg[j] = b_g * g_avg[j] + (1 - b_g) * g
            s_avg[j] = b_h * s_avg[j] + (1 - b_h) * g * g
            h2_avg[j] = b_h * h2_avg[j] + (1 - b_h) * h * h
            H = math.sqrt(h2_avg[j])
            target = (w * H) ** -0.5
            target = min(max(target, 0.99 * sigma[j]), 1.01 * sigma[j])
            d = g_avg[j] / max(H, (math.sqrt(s_avg[j]) + eps) / lr)  # unfloored H
            mu[j] -= d
            g_avg[j] -= H * d
            sigma[j] = min(max(target, sigma_min), sigma_max)
        out.append((list(mu), list(sigma)))
    return out


@pytest.mark.parametrize("flat", [False, True])
def test_the_mean_steps_on_the_unfloored_curvature_as_in_the_design_note(flat):
    # reference settings: sigma in [1e-5, 1e-3], w = 50, lr = 1e-3. The curvatures w a = 100 and
    # 2.5 lie below 1 / sigma_max^2 = 1e6, where a floor on the mean's curvature too made the
    # first step 3e-5 and 1.5e-5 instead of the note's lr-capped 1e-3 (sigma is floored alone)
    a, b, w, lr, eps = [2.0, 0.05], [1.0, -0.3], 50.0, 1e-3, 1e-8
    hand = _design_note_by_hand(a, b, [0.2, -0.1], w, 3, lr, (0.9, 0.999), eps / w, 1e-5, 1e-3)
    hp = QNVBHyperparameters(
        lr=lr,
        betas=(0.9, 0.999),
        eps=eps,  # in the units of the whole loss's gradient: the note's eps / w
        sigma_min=1e-5,
        sigma_max=1e-3,
        scale_min=0.99,
        scale_max=1.01,
        curvature="rms",
        damping=False,
        drift_forgetting=0.0,
    )
    A, B = torch.tensor(a, dtype=DTYPE), torch.tensor(b, dtype=DTYPE)
    mu = torch.tensor([0.2, -0.1], dtype=DTYPE)
    sigma, state = torch.full((2,), 1e-5, dtype=DTYPE), init_qnvb_state(mu)
    for want_mu, want_sigma in hand:
        g, h = A * mu - B, A.clone()
        if flat:
            (result,) = qnvb_update_many([mu], [sigma], [g], [h], [state], hp, w)
        else:
            result = qnvb_update(mu, sigma, g, h, state, hp, w)
        mu, sigma, state = result.mu, result.sigma, result.state
        assert mu.tolist() == pytest.approx(want_mu, rel=1e-13, abs=0)
        assert sigma.tolist() == pytest.approx(want_sigma, rel=1e-13, abs=0)
    # each step of the first three is the lr-capped one (within 1e-5 of lr: the eps)
    assert mu.tolist() == pytest.approx([0.2 + 3 * lr, -0.1 - 3 * lr], abs=1e-5)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_lr_zero_holds_the_means_bit_for_bit_and_updates_sigma_as_any_lr(flat, eps):
    # a scheduler ending at lr = 0 (CosineAnnealingLR, eta_min = 0): the step is exactly 0 (the
    # last coordinate, g = 0 with eps = 0, would be 0 / 0 in (sqrt(s) + eps) / lr)
    mu = torch.tensor([0.3, -0.7, 2.0, -0.0], dtype=DTYPE)
    sigma = torch.full((4,), 0.1, dtype=DTYPE)
    g = torch.tensor([0.5, -2.0, 1e-3, 0.0], dtype=DTYPE)
    h = torch.tensor([4.0, 0.25, -1.0, 9.0], dtype=DTYPE)

    def run(lr):
        # drift forgetting off: it forgets by the distance travelled, which lr = 0 makes 0
        hp = QNVBHyperparameters(lr=lr, eps=eps, betas=(0.9, 0.999), drift_forgetting=0.0)
        state, s = init_qnvb_state(mu), sigma
        for _ in range(3):  # g and h held: the averages do not depend on the means
            if flat:
                (result,) = qnvb_update_many([mu], [s], [g], [h], [state], hp, 8.0, 0.5)
            else:
                result = qnvb_update(mu, s, g, h, state, hp, 8.0, 0.5)
            assert int(result.num_overflow) == int(result.num_nonfinite) == 0
            s, state = result.sigma, result.state
        return result

    held, moving = run(0.0), run(0.5)
    assert torch.equal(held.mu, mu) and torch.equal(held.mu.signbit(), mu.signbit())
    assert not torch.equal(moving.mu[:3], mu[:3])
    assert torch.equal(held.sigma, moving.sigma)
    assert float(held.sigma[0]) == pytest.approx((8 * 4 + 0.5) ** -0.5, rel=1e-12)
    for name in ("s_avg", "h_avg", "h2_avg", "count", "curvature_count", "damping"):
        assert torch.equal(getattr(held.state, name), getattr(moving.state, name)), name


@pytest.mark.parametrize("flat", [False, True])
def test_a_zero_gradient_without_curvature_or_eps_steps_by_zero(flat):
    # rms curvature of h = 0, eps = 0 and g = 0: the divisor max(w H, (sqrt(s) + eps) / lr) is 0;
    # without the floor of the mean's curvature (the design note's step) 0 / 0 would be caught by
    # the guard as an overflow. The step is 0: the coordinate updates (sigma to sigma_max)
    mu = torch.tensor([0.3], dtype=DTYPE)
    zero = torch.zeros(1, dtype=DTYPE)
    hp = QNVBHyperparameters(eps=0.0, curvature="rms")
    if flat:
        (result,) = qnvb_update_many(
            [mu], [torch.ones(1, dtype=DTYPE)], [zero], [zero], [init_qnvb_state(mu)], hp
        )
    else:
        result = qnvb_update(mu, torch.ones(1, dtype=DTYPE), zero, zero, init_qnvb_state(mu), hp)
    assert int(result.num_overflow) == 0
    assert torch.equal(result.mu, mu)
    assert float(result.sigma) == 10.0  # the rate limit toward sigma_max = 100


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype, g", [(torch.float32, 1e-23), (torch.float64, 1e-170)])
def test_a_gradient_whose_square_underflows_steps_by_zero(flat, dtype, g):
    # rms curvature of h = 0 and eps = 0: s = g^2 underflows to 0, so the divisor
    # max(w H, (sqrt(s) + eps) / lr) is exactly 0. A floor of the divisor at the dtype's smallest
    # number gave g / 1e-38 = 8.5e14 in float32 (review); such a coordinate now steps by 0
    mu = torch.tensor([0.3, 0.3], dtype=dtype)
    grad = torch.tensor([g, -g], dtype=dtype)
    zero, one = torch.zeros(2, dtype=dtype), torch.ones(2, dtype=dtype)
    hp = QNVBHyperparameters(eps=0.0, curvature="rms")
    if flat:
        (result,) = qnvb_update_many([mu], [one], [grad], [zero], [init_qnvb_state(mu)], hp)
    else:
        result = qnvb_update(mu, one, grad, zero, init_qnvb_state(mu), hp)
    assert float(result.state.s_avg.max()) == 0.0  # the premise: g^2 underflowed
    assert torch.equal(result.mu, mu)


def test_negative_curvature_holds_sigma_and_takes_a_natural_gradient_step():
    mu = torch.zeros(1, dtype=DTYPE)
    sigma = torch.full((1,), 0.5, dtype=DTYPE)
    g = torch.full((1,), 0.4, dtype=DTYPE)
    state, hp = init_qnvb_state(mu), QNVBHyperparameters(damping=False)
    for h in (-1.0, -2.0):
        result = qnvb_update(mu, sigma, g, torch.full((1,), h, dtype=DTYPE), state, hp)
        assert torch.equal(result.sigma, sigma)
        # the mean moves by g sigma^2 = 0.1 (below the cap lr = 1)
        torch.testing.assert_close(result.mu, mu - 0.1, rtol=1e-14, atol=0)
        mu, state = result.mu, result.state


@pytest.mark.parametrize("low, expected", [(-4.8, 0.1**-0.5), (-6.5, 14**0.5)])
def test_a_positive_mean_curvature_is_used_however_noisy(low, expected):
    # h alternates 5 and `low`: mean 0.1 > 0 (noise 4.9) sets sigma = 0.1^(-1/2); with -6.5 the
    # mean (6.5 - 1.5 k) / (2k - 1) after k fives is last positive at k = 4 (0.5 / 7: sigma =
    # 14^(1/2)), then negative: sigma holds there
    mu = torch.zeros(1, dtype=DTYPE)
    sigma = torch.full((1,), 0.5, dtype=DTYPE)
    zero = torch.zeros(1, dtype=DTYPE)
    state, hp = init_qnvb_state(mu), QNVBHyperparameters(drift_forgetting=0.0)
    for t in range(400):
        h = torch.full((1,), 5.0 if t % 2 == 0 else low, dtype=DTYPE)
        result = qnvb_update(mu, sigma, zero, h, state, hp)
        sigma, state = result.sigma, result.state
    assert float(sigma) == pytest.approx(expected, rel=1e-9)


def _run_exponential(hp, steps):
    """QNVB on L(z) = exp(z) - z, with exact moments: g = e - 1, h = e, e = exp(mu + sigma^2 / 2).

    The optimal mean field is sigma = 1, mu = -1/2. From mu = 5 the curvature falls from 150 to 1
    on the way: estimates taken on the way must be forgotten. Returns the errors
    max(|mu + 1/2|, |sigma - 1|) after each step.
    """
    mu, sigma = torch.full((1,), 5.0, dtype=DTYPE), torch.full((1,), 0.1, dtype=DTYPE)
    state, errors = init_qnvb_state(mu), []
    for _ in range(steps):
        e = torch.exp(mu + sigma**2 / 2)
        result = qnvb_update(mu, sigma, e - 1, e, state, hp)
        mu, sigma, state = result.mu, result.sigma, result.state
        errors.append(max(abs(float(mu) + 0.5), abs(float(sigma) - 1)))
    return errors


def test_drift_forgetting_drops_the_curvature_seen_on_the_way():
    errors = _run_exponential(QNVBHyperparameters(), 60)
    assert errors[11] < 0.1 and errors[-1] < 1e-2  # 0.078 and 0.0076
    # without it the steep start lingers in the average: 2.2 after 12 steps, 0.63 after 60
    assert _run_exponential(QNVBHyperparameters(drift_forgetting=0.0), 12)[-1] > 2.0


def test_beta1_averages_the_gradient_carried_to_the_new_mean():
    # h = 4 throughout; g = 2 moves the mean by 2 / 4 = 0.5, and the carry g_avg - h * 0.5 = 0 is
    # the gradient the quadratic model predicts there. Then g = 1: beta1 = 0.5 averages it with
    # the carried 0 (step 0.5 / 4), beta1 = 0 takes it alone (step 1 / 4); without the carry
    # the average would be (2 + 1) / 2 (step 0.375)
    mu0, sigma, h = torch.zeros(1, dtype=DTYPE), torch.full((1,), 0.5, dtype=DTYPE), 4.0
    for beta1, expected in [(0.5, -0.625), (0.0, -0.75)]:
        hp = QNVBHyperparameters(betas=(beta1, 0.999))
        mu, state = mu0, init_qnvb_state(mu0)
        for g in (2.0, 1.0):
            full = torch.full((1,), g, dtype=DTYPE)
            result = qnvb_update(mu, sigma, full, torch.full((1,), h, dtype=DTYPE), state, hp)
            mu, state = result.mu, result.state
        assert float(mu) == expected


def test_lr_caps_the_step_of_the_mean():
    # nearly flat loss: the quasi-Newton step g / H would be 1e6; the cap gives lr sign(g)
    mu = torch.zeros(2, dtype=DTYPE)
    g = torch.tensor([3.0, -0.2], dtype=DTYPE)
    h = torch.full((2,), 1e-6, dtype=DTYPE)
    hp = QNVBHyperparameters(lr=0.25, eps=0.0, sigma_max=1e4)
    result = qnvb_update(mu, torch.ones(2, dtype=DTYPE), g, h, init_qnvb_state(mu), hp)
    torch.testing.assert_close(result.mu, torch.tensor([-0.25, 0.25], dtype=DTYPE))


def test_trust_region_caps_the_step_in_units_of_the_current_sigma():
    # flat loss and no lr cap: the step is trust_region * sigma with the sign of g; the third
    # coordinate's quasi-Newton step (0.1 / 1) is inside its radius (2 * 1) and is taken whole
    mu = torch.zeros(3, dtype=DTYPE)
    sigma = torch.tensor([0.5, 0.02, 1.0], dtype=DTYPE)
    g = torch.tensor([3.0, -0.2, 0.1], dtype=DTYPE)
    h = torch.tensor([1e-6, 1e-6, 1.0], dtype=DTYPE)
    hp = QNVBHyperparameters(lr=1e6, eps=0.0, sigma_max=1e4, trust_region=2.0)
    result = qnvb_update(mu, sigma, g, h, init_qnvb_state(mu), hp)
    torch.testing.assert_close(result.mu, torch.tensor([-1.0, 0.04, -0.1], dtype=DTYPE))
    off = qnvb_update(mu, sigma, g, h, init_qnvb_state(mu), QNVBHyperparameters(lr=1e6, eps=0.0))
    assert float(off.mu[0]) < -1e3  # without it, the full step g / H


def test_non_finite_coordinates_keep_their_mean_scale_and_state():
    mu = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=DTYPE)
    sigma = torch.full((4,), 0.5, dtype=DTYPE)
    hp = QNVBHyperparameters()
    state = qnvb_update(
        mu,
        sigma,
        torch.ones(4, dtype=DTYPE),
        torch.full((4,), 2.0, dtype=DTYPE),
        init_qnvb_state(mu),
        hp,
    ).state
    g = torch.tensor([1.0, math.nan, 1.0, 1.0], dtype=DTYPE)
    h = torch.tensor([2.0, 2.0, math.inf, 2.0], dtype=DTYPE)
    result = qnvb_update(mu, sigma, g, h, state, hp)
    assert result.num_nonfinite.dim() == 0 and result.num_nonfinite == 2
    assert result.num_overflow == 0
    bad = torch.tensor([False, True, True, False])
    assert torch.equal(result.mu[bad], mu[bad]) and torch.equal(result.sigma[bad], sigma[bad])
    for new, old in zip(result.state, state):
        assert torch.equal(new[bad], old[bad]) and torch.isfinite(new).all()
    assert not torch.equal(result.mu[~bad], mu[~bad])


def test_overflow_while_g_is_finite_is_counted_apart_from_non_finite_input():
    # float32: g = 1e20 is finite but g^2 = 1e40 is not; the third coordinate's g is NaN
    mu = torch.zeros(3)
    g = torch.tensor([1.0, 1e20, math.nan])
    result = qnvb_update(
        mu, torch.ones(3), g, torch.ones(3), init_qnvb_state(mu), QNVBHyperparameters()
    )
    assert (int(result.num_nonfinite), int(result.num_overflow)) == (1, 1)
    assert torch.equal(result.mu[1:], mu[1:]) and result.mu[0] == -1.0
    assert all(torch.isfinite(t).all() for t in result.state)


def test_a_mean_that_alone_overflows_is_left_unchanged():
    # float32, a flat direction (sigma = 1e10 held, curvature 1e-20) and lr = 1e38: the step
    # g / curvature = 1e38 sends 3e38 beyond the largest float32; every other output is finite
    mu = torch.tensor([3e38])
    hp = QNVBHyperparameters(lr=1e38, sigma_max=1e19, damping=False)
    result = qnvb_update(
        mu, torch.tensor([1e10]), torch.tensor([-1e18]), torch.zeros(1), init_qnvb_state(mu), hp
    )
    assert torch.equal(result.mu, mu) and int(result.num_overflow) == 1


def test_sigma_pinned_at_a_bound_is_counted():
    hp = QNVBHyperparameters(sigma_min=1e-3, sigma_max=10.0)
    mu = torch.zeros(4, dtype=DTYPE)
    # targets: 1e-4 (below sigma_min), 0.1 (inside), sigma_min held there, and a start at 200
    # whose rate limit (scale_min = 0.1) stops at 20 > sigma_max
    sigma = torch.tensor([1e-3, 1.0, 1e-3, 200.0], dtype=DTYPE)
    h = torch.tensor([1e8, 100.0, 1e6, 1e-6], dtype=DTYPE)
    result = qnvb_update(mu, sigma, torch.zeros(4, dtype=DTYPE), h, init_qnvb_state(mu), hp)
    torch.testing.assert_close(result.sigma, torch.tensor([1e-3, 0.1, 1e-3, 10.0], dtype=DTYPE))
    assert (int(result.num_sigma_min), int(result.num_sigma_max)) == (1, 1)


def test_the_update_never_syncs_with_the_host():
    # vmap refuses .item() and int() of a tensor: the update runs under it, counts included
    def update(mu, g):
        result = qnvb_update(
            mu,
            torch.ones_like(mu),
            g,
            torch.ones_like(mu),
            init_qnvb_state(mu),
            QNVBHyperparameters(),
        )
        return result.mu, result.num_nonfinite

    g = torch.tensor([[1.0, math.nan], [math.inf, math.nan]], dtype=DTYPE)
    mu, counts = torch.func.vmap(update)(torch.zeros(2, 2, dtype=DTYPE), g)
    assert counts.tolist() == [1, 2] and float(mu[0, 0]) == pytest.approx(-1.0, rel=1e-7)


def test_significance_sets_when_the_mean_curvature_is_trusted():
    # h = 3, then -1: mean 1, standard error sqrt((5 - 1) / 2) = 1.41 after two samples
    mu, zero = torch.zeros(1, dtype=DTYPE), torch.zeros(1, dtype=DTYPE)
    for significance, expected in [(1.0, 3.0**-0.5), (0.5, 1.0), (0.0, 1.0)]:
        hp = QNVBHyperparameters(significance=significance)
        sigma, state = torch.ones(1, dtype=DTYPE), init_qnvb_state(mu)
        for h in (3.0, -1.0):
            result = qnvb_update(mu, sigma, zero, torch.full((1,), h, dtype=DTYPE), state, hp)
            sigma, state = result.sigma, result.state
        assert float(sigma) == pytest.approx(expected, rel=1e-14)


def test_damping_grows_by_one_on_a_sign_change_and_recovers_by_damping_recovery():
    # gradients +, -, +, +, +: sign changes at steps 2 and 3
    mu, h = torch.zeros(1, dtype=DTYPE), torch.ones(1, dtype=DTYPE)
    for recovery, expected in [(0.5, [1.0, 2.0, 3.0, 2.5, 2.0]), (1.0, [1.0, 2.0, 3.0, 2.0, 1.0])]:
        hp = QNVBHyperparameters(damping_recovery=recovery)
        sigma, state, ks = torch.ones(1, dtype=DTYPE), init_qnvb_state(mu), []
        for g in (1.0, -1.0, 1.0, 1.0, 1.0):
            result = qnvb_update(mu, sigma, torch.full((1,), g, dtype=DTYPE), h, state, hp)
            sigma, state = result.sigma, result.state
            ks.append(float(state.damping))
        assert ks == expected


def test_damping_has_no_ceiling():
    # a gradient that changes sign at every step: k = 1, 2, 3, ... past the old cap of 1e4
    mu, h = torch.zeros(1, dtype=DTYPE), torch.ones(1, dtype=DTYPE)
    sigma, state, hp = torch.ones(1, dtype=DTYPE), init_qnvb_state(mu), QNVBHyperparameters()
    plus, minus = torch.ones(1, dtype=DTYPE), -torch.ones(1, dtype=DTYPE)
    for t in range(10_050):
        state = qnvb_update(mu, sigma, plus if t % 2 else minus, h, state, hp).state
    assert float(state.damping) == 10_050.0


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(lr=-1e-3), ValueError, "lr must be >= 0, got -0.001"),
        (dict(lr="1"), TypeError, "lr must be a real number >= 0, got '1' (str)"),
        (dict(trust_region=0.0), ValueError, "trust_region must be > 0 (inf: off), got 0.0"),
        (
            dict(betas=0.9),
            TypeError,
            "betas must be a pair (beta1, beta2) of numbers in [0, 1), got 0.9 (float)",
        ),
        (dict(betas=(1.0, 0.9)), ValueError, "betas[0] must be in [0, 1), got 1.0"),
        (dict(betas=(0.0, -0.1)), ValueError, "betas[1] must be in [0, 1), got -0.1"),
        (
            dict(betas=(0.0, None)),
            TypeError,
            "betas[1] must be a real number in [0, 1), got None (NoneType)",
        ),
        (dict(eps=math.nan), ValueError, "eps must be finite and >= 0, got nan"),
        # inf was accepted, and the means never moved (the step divides by h + eps)
        (dict(eps=math.inf), ValueError, "eps must be finite and >= 0, got inf"),
        (
            dict(sigma_min=1.0, sigma_max=0.5),
            ValueError,
            "sigma_max must be finite and > sigma_min = 1.0, got 0.5",
        ),
        (dict(scale_min=1.5), ValueError, "scale_min must be in (0, 1], got 1.5"),
        (dict(scale_max=True), TypeError, "scale_max must be a real number >= 1, got True (bool)"),
        (
            dict(curvature="median"),
            ValueError,
            "curvature must be one of ('mean', 'rms'), got 'median'",
        ),
        (dict(significance=-1.0), ValueError, "significance must be finite and >= 0, got -1.0"),
        (dict(damping=1), TypeError, "damping must be True or False, got 1 (int)"),
        (dict(damping_recovery=0), ValueError, "damping_recovery must be finite and > 0, got 0"),
        (
            dict(damping_recovery=math.inf),
            ValueError,
            "damping_recovery must be finite and > 0, got inf",
        ),
        (
            dict(drift_forgetting=-1.0),
            ValueError,
            "drift_forgetting must be finite and >= 0, got -1.0",
        ),
        (
            dict(drift_forgetting=math.inf),
            ValueError,
            "drift_forgetting must be finite and >= 0, got inf",
        ),
        (dict(recent_fraction=0.0), ValueError, "recent_fraction must be in (0, 1], got 0.0"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error) as info:
        QNVBHyperparameters(**kwargs)
    assert str(info.value) == message


def test_betas_given_as_a_list_become_a_tuple():
    assert QNVBHyperparameters(betas=[0.5, 0.9]).betas == (0.5, 0.9)


def test_eight_schools_with_exact_expectations_reaches_the_reference():
    # g and h from the mean-field ELBO's analytic expectations: only the optimizer is tested.
    # Without noise, averaging h only keeps the transient's curvature, fading as 1 / t: 1.1% of
    # sigma after 100 steps, 0.27% after 400
    problem = eight_schools()
    mu = torch.zeros(10, dtype=DTYPE)
    sigma = torch.full((10,), 0.1, dtype=DTYPE)
    state, hp = init_qnvb_state(mu), QNVBHyperparameters()
    errors = []
    for _ in range(400):
        g, dsigma = torch.func.grad(problem.neg_elbo, argnums=(0, 1))(mu, sigma)
        result = qnvb_update(mu, sigma, g, (dsigma + 1 / sigma) / sigma, state, hp)
        mu, sigma, state = result.mu, result.sigma, result.state
        errors.append(problem.error(mu, sigma))
    assert errors[23] < 0.05 and errors[99] < 0.012 and errors[-1] < 3e-3


def test_by_default_the_curvature_average_spans_every_step():
    # at the optimum (g = 0, so nothing drifts) h = 1, 2, ..., 10: the arithmetic mean 5.5, not
    # the mean of a recent window
    mu, zero = torch.zeros(1, dtype=DTYPE), torch.zeros(1, dtype=DTYPE)
    sigma, state, hp = torch.ones(1, dtype=DTYPE), init_qnvb_state(mu), QNVBHyperparameters()
    for h in range(1, 11):
        result = qnvb_update(mu, sigma, zero, torch.full((1,), float(h), dtype=DTYPE), state, hp)
        sigma, state = result.sigma, result.state
    assert float(state.h_avg) == pytest.approx(5.5, rel=1e-14)


def test_recent_fraction_lets_the_transient_fade_faster():
    # eight schools with exact expectations, as above: with the curvature window capped at half
    # the steps, 2e-3 of sigma is reached within 70 steps (69) instead of more than 400
    problem = eight_schools()
    mu = torch.zeros(10, dtype=DTYPE)
    sigma = torch.full((10,), 0.1, dtype=DTYPE)
    state, hp = init_qnvb_state(mu), QNVBHyperparameters(recent_fraction=0.5)
    for _ in range(70):
        g, dsigma = torch.func.grad(problem.neg_elbo, argnums=(0, 1))(mu, sigma)
        result = qnvb_update(mu, sigma, g, (dsigma + 1 / sigma) / sigma, state, hp)
        mu, sigma, state = result.mu, result.sigma, result.state
    assert problem.error(mu, sigma) < 2e-3


def test_geometric_annealing_schedule():
    schedule = geometric_annealing(0.01, num_steps=4)
    values = [schedule(t) for t in range(6)]
    expected = [0.01, 0.01**0.75, 0.1, 0.01**0.25, 1.0, 1.0]
    assert values == pytest.approx(expected, rel=1e-14)
    with pytest.raises(ValueError, match="initial"):
        geometric_annealing(0.0, 10)
    with pytest.raises(ValueError, match="num_steps"):
        geometric_annealing(0.5, 0)


def test_a_qnvb_with_the_geometric_schedule_pickles():
    # the schedule was a closure: pickle and torch.save of such a QNVB raised "Can't pickle
    # local object", where docs/qnvb.md ("Copies") says a QNVB pickles mid-fit
    import pickle

    from pyro_quadvi import QNVB

    schedule = pickle.loads(pickle.dumps(geometric_annealing(0.01, num_steps=4)))
    assert [schedule(t) for t in range(6)] == [geometric_annealing(0.01, 4)(t) for t in range(6)]
    assert repr(schedule) == "geometric_annealing(0.01, 4)"
    qnvb = QNVB(annealing=geometric_annealing(0.01, num_steps=4))
    qnvb.num_steps = 2  # as after two steps
    copy = pickle.loads(pickle.dumps(qnvb))
    assert copy.num_steps == 2 and copy.annealing_factor == pytest.approx(0.1, rel=1e-14)


def test_check_schedule_refuses_what_is_not_a_schedule():
    schedule = geometric_annealing(0.01, num_steps=4)
    assert check_schedule(schedule) is schedule and check_schedule(None) is None
    with pytest.raises(TypeError) as info:
        check_schedule(0.5)
    assert str(info.value) == (
        "annealing must be a callable step -> factor, such as "
        "geometric_annealing(0.01, num_steps=500), got 0.5 (float)"
    )
    with pytest.raises(TypeError, match=r"annealing\(0\) must return a real number > 0, got 'x'"):
        check_schedule(lambda step: "x")
    with pytest.raises(ValueError, match=r"annealing\(0\) must return a finite factor > 0, got 0"):
        check_schedule(lambda step: 0)
    assert check_schedule(lambda step: torch.tensor(0.5)) is not None


def test_anneal_likelihood_scales_observed_sites_only():
    def model():
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 3):
            pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor([0.5, -1.0, 2.0]))

    trace = poutine.trace(poutine.condition(model, {"z": torch.tensor(0.3)})).get_trace()
    annealed = poutine.trace(
        poutine.condition(anneal_likelihood(model, 0.25), {"z": torch.tensor(0.3)})
    ).get_trace()
    trace.compute_log_prob()
    annealed.compute_log_prob()
    prior, lik = trace.nodes["z"]["log_prob_sum"], trace.nodes["x"]["log_prob_sum"]
    assert float(annealed.log_prob_sum()) == pytest.approx(float(prior + 0.25 * lik), rel=1e-6)


# exactly zero curvature (held), and sigma pinned at sigma_max by the curvature floor


def _dead_and_live(flat: bool, hp: QNVBHyperparameters, steps: int = 4, compile: bool = False):
    """Coordinates 0-1 dead (g = h = 0 at every step: a weight behind a dead ReLU), 2 alive
    (h = 1), 3 with h = +1, -1, +1, ... (mean 0 after two steps, but not exactly 0 each time),
    under likelihood weight 64 and prior precision 4; one result per step (``flat``: by
    :func:`qnvb_update_many`, ``compile`` passed to it)."""
    mu = torch.tensor([0.3, -0.7, 0.2, 0.1], dtype=DTYPE)
    sigma = torch.full((4,), 1e-3, dtype=DTYPE)
    state = init_qnvb_state(mu)
    results = []
    for step in range(steps):
        g = torch.tensor([0.0, 0.0, 0.5, 0.0], dtype=DTYPE)
        h = torch.tensor([0.0, 0.0, 1.0, (-1.0) ** step], dtype=DTYPE)
        if flat:
            (result,) = qnvb_update_many(
                [mu], [sigma], [g], [h], [state], hp, 64.0, 4.0, compile=compile
            )
        else:
            result = qnvb_update(mu, sigma, g, h, state, hp, 64.0, 4.0)
        results.append(result)
        mu, sigma, state = result.mu, result.sigma, result.state
    return results


@pytest.mark.parametrize("significance", [0.0, 2.0])
def test_exactly_zero_curvature_holds_sigma_and_takes_a_natural_gradient_step(significance):
    # h_avg = 0 fails h_avg > significance * stderr, so rule 4 holds 1 / sigma^2: sigma stays at
    # 1e-3 and the mean takes the natural-gradient step prior * mu * sigma^2 = 4 mu 1e-6 (the
    # cap 4 |mu| + eps is far below 1e6). Taking the curvature 0 instead (sigma to the prior's
    # 0.5) revived dead ReLU units at wide nodes and made deep networks diverge
    # (tests/test_user_fixes_torch.py, the deep ReLU test)
    hp = QNVBHyperparameters(significance=significance)
    results = _dead_and_live(flat=False, hp=hp)
    mu = torch.tensor([0.3, -0.7], dtype=DTYPE)
    for result in results:
        assert result.sigma[:2].tolist() == [1e-3, 1e-3]
        mu = mu - 4.0 * mu * 1e-6
        assert result.mu[:2].tolist() == pytest.approx(mu.tolist(), rel=1e-12)
        assert int(result.num_sigma_max) == 0  # held: nothing counted as asking wider
    # the live coordinate's curvature is taken: sigma -> (64 + 4)^(-1/2) at the rate limit
    assert float(results[-1].sigma[2]) == pytest.approx(68**-0.5, rel=1e-12)


@pytest.mark.parametrize(
    "hp",
    [
        QNVBHyperparameters(),
        QNVBHyperparameters(significance=2.0, betas=(0.9, 0.99)),
        QNVBHyperparameters(curvature="rms"),
    ],
    ids=["defaults", "significance", "rms"],
)
def test_the_flat_update_agrees_with_the_reference_on_zero_curvature_bit_for_bit(hp):
    for flat, reference in zip(_dead_and_live(True, hp, 5), _dead_and_live(False, hp, 5)):
        assert torch.equal(flat.mu, reference.mu) and torch.equal(flat.sigma, reference.sigma)
        assert all(torch.equal(a, b) for a, b in zip(flat.state, reference.state))
        assert [int(c) for c in flat[3:]] == [int(c) for c in reference[3:]]


@pytest.mark.slow
def test_the_compiled_update_agrees_with_the_reference_on_zero_curvature():
    # torch.compile of the same rules: equal to rounding (a fused rsqrt), the same counts
    hp = QNVBHyperparameters()
    compiled = _dead_and_live(True, hp, 5, compile=True)
    for got, want in zip(compiled, _dead_and_live(False, hp, 5)):
        for a, b in zip((got.mu, got.sigma, *got.state), (want.mu, want.sigma, *want.state)):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-300)
        assert [int(c) for c in got[3:]] == [int(c) for c in want[3:]]
    assert float(compiled[-1].sigma[0]) == 1e-3  # held


@pytest.mark.parametrize("flat", [False, True])
def test_a_curvature_asking_for_more_than_sigma_max_is_counted_as_pinned(flat):
    # before: the floor 1 / sigma_max^2 made the target exactly sigma_max, never above it, so
    # nothing was counted. Weight 1e-8 and h = 1 ask for sigma = 1e4 > sigma_max = 100 (counted
    # from the first step, while sigma still climbs at the rate limit: 1e-2); h = -1 and h = 0
    # (a dead coordinate) are held, not counted
    mu = torch.zeros(3, dtype=DTYPE)
    sigma = torch.full((3,), 1e-3, dtype=DTYPE)
    g = torch.zeros(3, dtype=DTYPE)
    h = torch.tensor([1.0, -1.0, 0.0], dtype=DTYPE)
    hp = QNVBHyperparameters()
    state = init_qnvb_state(mu)
    for step, want in enumerate([1e-2, 1e-1, 1.0, 10.0, 100.0, 100.0]):
        if flat:
            (result,) = qnvb_update_many([mu], [sigma], [g], [h], [state], hp, 1e-8)
        else:
            result = qnvb_update(mu, sigma, g, h, state, hp, 1e-8)
        assert int(result.num_sigma_max) == 1, step
        assert float(result.sigma[0]) == pytest.approx(want, rel=1e-12)
        assert result.sigma[1:].tolist() == [1e-3, 1e-3]
        mu, sigma, state = result.mu, result.sigma, result.state
    # a well-posed coordinate (weight 64: sigma* = 1/8) is never counted
    result = qnvb_update(mu[:1], sigma[:1], g[:1], h[:1], init_qnvb_state(mu[:1]), hp, 64.0)
    assert float(result.sigma) == pytest.approx(10.0, rel=1e-12)  # on its way down from 100
    assert int(result.num_sigma_max) == 0
