"""Fixes of session 25's trial: OPQA's Laplace centre on badly scaled problems."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_quadvi import opqa_evidence
from pyro_quadvi.evidence.weight import laplace_weight
from pyro_quadvi.infer import LogJoint, latent_sites_of_model
from pyro_quadvi.testing.evidence_models import (
    F64,
    POISSON_DATA,
    gamma_poisson,
    gamma_poisson_posterior,
    normal_normal_log_evidence,
)

NOISE = 10.0
PRIOR_SCALES = torch.tensor([1e7, 1e6, 1e6], dtype=F64)  # the intercept's, then the slopes'


def _badly_scaled_data(n: int = 200):
    """The trial's regression: features on scales 1e-3 and 1e4, targets near 1e6."""
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 1e4], dtype=F64)
    x = scales * torch.exp(0.5 * torch.randn(n, 2, generator=generator, dtype=F64))
    noise = NOISE * torch.randn(n, generator=generator, dtype=F64)
    y = 1e6 + x @ torch.tensor([5e4, -1e-2], dtype=F64) + noise
    return x, y


def _badly_scaled_regression(x: torch.Tensor, y: torch.Tensor) -> None:
    a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=F64), PRIOR_SCALES[0]))
    b = pyro.sample("b", dist.Normal(torch.zeros(2, dtype=F64), PRIOR_SCALES[1:]).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(a + x @ b, NOISE), obs=y)


def _closed_form_log_evidence(x: torch.Tensor, y: torch.Tensor) -> float:
    """The Gaussian integral by a QR factorization of the whitened least squares problem
    ``[D / noise; I / prior_scale] beta ~ [y / noise; 0]``, whose R gives ``log det`` of the
    posterior precision and whose residual the exponent; QR is stable under the columns' scales
    (1e-3 to 1e4) that make the precision's condition number about 1e14."""
    n = len(y)
    design = torch.cat([torch.ones(n, 1, dtype=F64), x], 1)
    stacked = torch.cat([design / NOISE, torch.diag(1.0 / PRIOR_SCALES)])
    target = torch.cat([y / NOISE, torch.zeros(3, dtype=F64)])
    q, r = torch.linalg.qr(stacked)
    mean = torch.linalg.solve_triangular(r, (q.T @ target)[:, None], upper=True)[:, 0]
    residual = float((target - stacked @ mean).square().sum())
    return (
        -0.5 * n * math.log(2 * math.pi * NOISE**2)
        - float(PRIOR_SCALES.log().sum())
        - float(r.diagonal().abs().log().sum())
        - 0.5 * residual
    )


def test_laplace_centre_reaches_the_mode_on_a_badly_scaled_regression():
    """L-BFGS stopped far from the mode (a loss of 1e12 at the start, absolute tolerances),
    leaving the evidence 745 nats off with no warning; the Newton steps after it, measured in
    weight sds, make one point exact again (the posterior is Gaussian)."""
    x, y = _badly_scaled_data()
    exact = _closed_form_log_evidence(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = opqa_evidence(_badly_scaled_regression, x, y, num_points=1, vectorize=False)
    assert abs(result.log_evidence - exact) < 1e-8
    diagnostics = result.diagnostics
    assert diagnostics["map_distance_sd"] < 1e-6
    assert diagnostics["newton_steps"] >= 1


def _gamma_poisson_weight(**options):
    log_joint = LogJoint(gamma_poisson, latent_sites_of_model(gamma_poisson, POISSON_DATA))
    start = torch.tensor([3.0], dtype=F64)  # log rate 3; the mode is log(26 / 7.5) = 1.24
    return laplace_weight(log_joint, start, (POISSON_DATA,), {}, **options)


def test_a_mode_that_the_newton_steps_do_not_reach_is_warned_of_with_its_distance():
    """One L-BFGS iteration and one Newton step from log rate 3 leave a Gamma-Poisson posterior
    (not Gaussian in the log rate) short of its mode; the default ten Newton steps reach it."""
    with pytest.warns(UserWarning) as record:
        weight = _gamma_poisson_weight(max_iter=1, newton_steps=1)
    distance = weight.info["map_distance_sd"]
    assert 1e-4 < distance < 10.0
    assert weight.info["newton_steps"] == 1
    (message,) = [str(item.message) for item in record]
    assert message.startswith(
        "opqa_evidence(center='laplace'): the MAP search (L-BFGS, then 1 Newton steps) stopped "
        f"{distance:.3g} weight standard deviations from the mode"
    )
    assert f"low by about {distance**2 / 2:.3g} nats (half the square)" in message
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reached = _gamma_poisson_weight(max_iter=1)
    assert reached.info["map_distance_sd"] < 1e-6
    posterior_shape, posterior_rate, _ = gamma_poisson_posterior(POISSON_DATA)
    # the mode of the log rate under Gamma(a, b) with the log-Jacobian is log(a / b), where the
    # curvature is a: 1e-6 weight sds are 1e-6 / sqrt(a)
    mode = math.log(posterior_shape / posterior_rate)
    assert float(reached.loc) == pytest.approx(mode, abs=1e-6 / math.sqrt(posterior_shape))


def _allocate_too_much() -> None:
    torch.empty(2**62, dtype=torch.uint8)  # beyond any address space: the CPU allocator refuses


def _cuda_out_of_memory() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.48 TiB")


@pytest.mark.parametrize(
    ("fail", "error"),
    [
        (_allocate_too_much, "RuntimeError: "),  # then the allocator's message
        (_cuda_out_of_memory, "OutOfMemoryError: CUDA out of memory. Tried to allocate 3.48 TiB"),
    ],
)
def test_a_vectorized_pass_that_runs_out_of_memory_falls_back_to_the_loop(fail, error):
    """A trial's model broadcast a latent's batch dim against the points' (a[..., None] + x @ b)
    and asked for a (K, K, n) tensor, 3.8 TB at n = 1e5 and 3 points: torch's bare allocator error
    came out of opqa_evidence, though one point at a time runs. Here the pass fails the same
    way without the terabytes: the loop gives the closed form, with the usual warning."""

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        if mu.numel() > 1:  # the vectorized pass over the points
            fail()
        pyro.sample("x", dist.Normal(mu, 0.1), obs=x)

    x = torch.tensor(0.7, dtype=F64)
    with pytest.warns(UserWarning) as record:
        result = opqa_evidence(model, x, num_points=3)
    assert abs(result.log_evidence - normal_normal_log_evidence(0.7)) < 1e-8
    assert not result.diagnostics["vectorized"]
    (message,) = [str(item.message) for item in record]
    assert message.startswith(
        "opqa_evidence: the model does not evaluate all 3 points in one vectorized pass (" + error
    )
    assert record[0].filename == __file__
    reason = result.diagnostics["vectorize_fallback"]
    assert reason in message
    assert reason.endswith(
        "the pass over all 3 points ran out of memory; a latent whose batch dim meets the "
        "points' dim as well (a[..., None] + x @ b, with a of shape (K, 1) in the pass, makes a "
        "K x K x n tensor) asks for K times what the points need, and one point at a time needs "
        "1/K of it"
    )
    with pytest.raises(RuntimeError, match="memory"):  # vectorize=True: the pass's own error
        opqa_evidence(model, x, num_points=3, vectorize=True)


def _float32_normal(x: torch.Tensor) -> None:
    """A model computed in float32 (its latents cast to the data's dtype): the gradient carries
    float32 rounding, about 1e-5 weight sds at the mode here."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 10.0))
    log_sd = pyro.sample("log_sd", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
    with pyro.plate("n", len(x)):
        pyro.sample("x", dist.Normal(mu.float(), log_sd.float().exp()), obs=x)


def test_newton_steps_stop_where_the_gradients_rounding_is_all_that_is_left():
    """On a float32 model the distance left after L-BFGS is rounding: the ten Newton steps
    followed it, each rejected step halved 20 times, 108 evaluations where L-BFGS took 28 and
    the evidence moved in its 10th digit only. A step that does not halve a distance below
    1e-2 sds now ends them, and no step shorter than 1e-6 sds is tried."""
    x = 3.0 * torch.randn(1000, generator=torch.Generator().manual_seed(0)) + 5.0
    log_joint = LogJoint(_float32_normal, latent_sites_of_model(_float32_normal, x))
    start = torch.zeros(2, dtype=F64)
    lbfgs_only = laplace_weight(log_joint, start, (x,), {}, newton_steps=0)
    assert 1e-6 < lbfgs_only.info["map_distance_sd"] < 1e-4  # (no warning, before and after)
    weight = laplace_weight(log_joint, start, (x,), {})
    assert weight.info["newton_steps"] <= 1
    assert weight.evaluations - lbfgs_only.evaluations <= 8  # 1 + 2 a step, halvings to 1e-6
    assert torch.allclose(weight.loc, lbfgs_only.loc, rtol=0.0, atol=1e-4)


def test_a_kinked_log_joint_takes_no_newton_step_and_no_distance_warning():
    """A Laplace likelihood has a kink at its mode (the median): autograd's derivatives there
    measure no distance, so after the derivative check warns no Newton step is tried (each
    try halved the step 20 times) and the distance is not warned of with advice about the
    data's scale."""

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Laplace(mu, 1.0), obs=y)

    y = torch.tensor([0.3, -1.2, 0.8, 2.0, 0.1], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = opqa_evidence(model, y, num_points=8)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "autograd's derivatives" in messages[0]
    assert result.diagnostics["newton_steps"] == 0
    assert result.diagnostics["map_distance_sd"] > 1.0  # the kink's one-sided slope
