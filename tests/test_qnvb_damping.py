"""The damping divisor ``k`` (rule 6 of ``qnvb_update``) under gradient noise and overshoots.

``k`` grows by one when the gradient's sign flips between two steps and shrinks by
``damping_recovery`` (``r``) otherwise, floored at 1. Its drift per step is ``p - r (1 - p)`` at
a flip rate ``p``: it grows when ``p > r / (1 + r)``. Pure noise flips half the signs
(``p = 1/2``), a sustained oscillation all of them (``p = 1``): a recovery above 1 puts the
break-even between the two (``r = 2``: 2/3), so that noise no longer grows ``k`` while an
overshoot still does. ``docs/benchmarks.md``, "The damping under noise: a recovery above 1",
measures what that buys (a stalled small network and centred eight schools) and costs (the
suite's Monte Carlo cells, which rely on the noise growing ``k``).
"""

from __future__ import annotations

import math

import pytest
import torch

from pyro_quadvi.optim.qnvb_functional import QNVBHyperparameters, init_qnvb_state, qnvb_update

DTYPE = torch.float64
PHI = (1 + math.sqrt(5)) / 2


def _signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` independent random signs: consecutive draws differ with probability 1/2 exactly."""
    return torch.randint(0, 2, (n,), generator=generator, dtype=DTYPE) * 2 - 1


def _run(gradient, recovery: float, n: int, steps: int, h: float = 1.0):
    """``steps`` updates of ``n`` independent coordinates whose ``g`` is ``gradient(mu, t)``."""
    mu = torch.zeros(n, dtype=DTYPE)
    sigma = torch.ones(n, dtype=DTYPE)
    curvature = torch.full((n,), h, dtype=DTYPE)
    state = init_qnvb_state(mu)
    hp = QNVBHyperparameters(damping_recovery=recovery)
    for t in range(steps):
        result = qnvb_update(mu, sigma, gradient(mu, t), curvature, state, hp)
        mu, sigma, state = result.mu, result.sigma, result.state
    return mu, sigma, state.damping


def test_under_pure_sign_noise_k_grows_like_t_over_4_with_recovery_half():
    # the first step has no previous sign (k stays 1); each of the other 399 adds +1 or -0.5 with
    # probability 1/2: E k = 1 + 399 / 4 = 100.75, plus what the floor at 1 adds in the first
    # steps (at most a few units); the mean over 4,000 coordinates has a standard error of 0.24
    generator = torch.Generator().manual_seed(0)
    _, _, k = _run(lambda mu, t: 3.0 * _signs(4000, generator), 0.5, 4000, 400)
    assert 1 + 399 / 4 - 1.0 < float(k.mean()) < 1 + 399 / 4 + 3.0


def test_under_pure_sign_noise_k_stays_near_one_plus_phi_with_recovery_two():
    # steps of +1 or -2 with probability 1/2, floored: a walk that climbs one unit at a time, whose
    # stationary law is geometric, P(k >= 1 + j) = q^j with q^-1 + q^2 = 2, i.e. q = 1 / phi; so
    # E k = 1 + q / (1 - q) = 1 + phi = 2.618 (standard error of the mean over 4,000
    # coordinates: 0.033); the same noise with recovery 0.5 gives 101 (above)
    generator = torch.Generator().manual_seed(0)
    _, _, k = _run(lambda mu, t: 3.0 * _signs(4000, generator), 2.0, 4000, 400)
    assert abs(float(k.mean()) - (1 + PHI)) < 0.15


@pytest.mark.parametrize("recovery", [0.5, 2.0])
def test_a_sustained_oscillation_grows_k_by_one_per_step_whatever_the_recovery(recovery):
    # g = 1 + 3 (-1)^t: the sign flips at every step after the first although the gradient's
    # mean is not 0 (an overshoot around a point that is not the optimum): k = 1 + 49 after 50
    _, _, k = _run(lambda mu, t: 1.0 + 3.0 * (-1) ** t * torch.ones_like(mu), recovery, 3, 50)
    torch.testing.assert_close(k, torch.full((3,), 50.0, dtype=DTYPE), rtol=0, atol=0)


def test_with_recovery_two_the_parallel_update_still_converges_on_a_correlated_gaussian():
    # as tests/test_qnvb_functional.py's damping test: equicorrelated precision at rho = 0.9
    # (normalized spectrum {0.1, 9.1}), exact g and h; undamped it does not converge
    d, rho = 10, 0.9
    precision = 50 * ((1 - rho) * torch.eye(d, dtype=DTYPE) + rho * torch.ones(d, d, dtype=DTYPE))
    mean = torch.linspace(-1, 1, d, dtype=DTYPE)
    mu, sigma = torch.zeros(d, dtype=DTYPE), torch.full((d,), 0.1, dtype=DTYPE)
    state = init_qnvb_state(mu)
    hp = QNVBHyperparameters(damping_recovery=2.0)
    errors = []
    for _ in range(300):
        result = qnvb_update(mu, sigma, precision @ (mu - mean), precision.diagonal(), state, hp)
        mu, sigma, state = result.mu, result.sigma, result.state
        errors.append(float(((mu - mean).abs() * precision.diagonal().sqrt()).max()))
    assert max(errors) < 7.0  # never beyond its start (6.4 sigma)
    assert errors[-1] < 1e-2


def test_a_weak_drift_under_noise_stalls_with_recovery_half_and_is_followed_with_recovery_two():
    # loss c (z - 5)^2 / 2 with c = 0.1, seen through a gradient noise of +-3 (30 times the drift
    # at the start): the step is about g / (3 k) (the lr cap), so with k ~ t / 4 the distance
    # to 5 shrinks only like t^(-4c/3) = t^(-0.13): about half of it is left after 400 steps.
    # With recovery 2 the means reach 5, at a cost: the noise is no longer averaged, and they
    # scatter by more than the posterior's sigma (c^-1/2 = 3.16) around it
    generator = torch.Generator().manual_seed(0)

    def gradient(mu, t):
        return 0.1 * (mu - 5.0) + 3.0 * _signs(mu.numel(), generator)

    stalled, sigma, _ = _run(gradient, 0.5, 4000, 400, h=0.1)
    assert 1.0 < float(stalled.mean()) < 3.0
    followed, sigma, k = _run(gradient, 2.0, 4000, 400, h=0.1)
    assert abs(float(followed.mean()) - 5.0) < 0.3  # standard error of the mean: 0.07
    assert float(k.mean()) < 1 + PHI + 0.3  # the drift makes flips rarer than pure noise does
    torch.testing.assert_close(sigma, torch.full_like(sigma, 0.1**-0.5))
    assert float(followed.std()) > float(sigma[0]) > float(stalled.std())
