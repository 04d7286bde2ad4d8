"""The QNVB update as a pure function of tensors.

Quasi-Newton variational Bayes (rasp paper, eq. 4-8; sequence paper, Sections 4.1-4.2) moves a
Gaussian mean field ``N(mu, diag(sigma^2))`` to the fixed point of the projective integral update:

    mu <- mu - g / h,        sigma <- h^(-1/2),

where ``g`` and ``h`` are the expected gradient and Hessian diagonal of the loss (the negative log
joint) under ``q`` (eq. 7 and 8). :func:`qnvb_update` performs one such step elementwise, with the
safeguards of the public reference optimizer (``shared/design/qnvb-update-rule.md``) and three
additions that make it converge on ordinary Pyro models without tuning:

* **damping** per coordinate: a parallel (Jacobi-like) fixed-point step oscillates when the
  posterior is strongly correlated. Each coordinate divides its step by ``k >= 1``; ``k`` grows by
  one whenever the gradient changes sign between two steps and shrinks by one half otherwise. A
  steady oscillation is damped until it stops; gradient noise (Monte Carlo, random quadratures)
  makes ``k`` grow like the step count, a Robbins-Monro schedule that averages the noise out.
* **mean curvature**: by default ``H`` is the running mean of ``h`` (unbiased) wherever it is
  positive by more than one standard error; elsewhere (negative curvature, or too few samples to
  tell it from noise) ``H`` is the current precision ``1 / sigma^2`` of ``q``: ``sigma`` holds and
  the mean takes a natural-gradient step. The reference's root-mean-square ``sqrt(mean(h^2))`` is
  biased upward whenever ``h`` is noisy (by ``3^(1/2)`` for one Monte Carlo draw) and remains
  available.
* **drift forgetting**: curvature and second-moment averages are taken at past means; their sample
  count is multiplied by ``exp(-|step| / (k sigma))`` each step, so estimates taken far from the
  current mean are forgotten while the mean travels (``k = 1``) and are averaged over long windows
  once it settles, or once its steps are dominated by noise (``k`` large). The window is also
  capped at half the number of steps taken, so the first, transient estimates fade quickly.

The loss is ``weight * L(theta) + prior_precision * |theta|^2 / 2``: ``g`` and ``h`` estimate the
moments of ``L`` and ``weight`` (the likelihood weight times an annealing factor) and the Gaussian
prior enter exactly at every step, as the reference's likelihood weight does. Pyro losses already
hold the prior and the data scale: there ``weight = 1`` and ``prior_precision = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["QNVBHyperparameters", "QNVBResult", "QNVBState", "init_qnvb_state", "qnvb_update"]

_CURVATURES = ("mean", "rms")
SIGNIFICANCE = 1.0
"""With ``curvature="mean"``, the mean of ``h`` is used once it exceeds this many standard errors;
until then (negative curvature, or curvature lost in noise) ``sigma`` holds its value."""
DAMPING_RECOVERY = 0.5
"""How much the damping divisor ``k`` shrinks after a step without a sign change."""
MAX_DAMPING = 1e4
"""The largest damping divisor: every coordinate takes at least ``1 / MAX_DAMPING`` of its step."""
RECENT_FRACTION = 0.5
"""The curvature averages span at most this fraction of a coordinate's updates (and at least two),
so the estimates of the first, transient steps fade (as ``(t0 / t)^2``) instead of lingering in an
arithmetic mean."""


@dataclass(frozen=True)
class QNVBHyperparameters:
    """Hyperparameters of :func:`qnvb_update` (names as in the reference optimizer).

    Attributes:
        lr: caps how far ``mu`` moves: the step is ``g / max(H, (sqrt(s) + eps) / lr)``, the smaller
            of the quasi-Newton step and an Adam step of size ``lr`` (``s``: running mean of
            ``g^2``). In the units of ``mu``.
        betas: ``(beta1, beta2)``: running averages of ``g`` (``beta1``) and of ``g^2``, ``h`` and
            ``h^2`` (``beta2``), as arithmetic means during warm-up (count below ``1/(1-beta)``).
            ``beta1 = 0`` uses the newest gradient only.
        eps: added to ``sqrt(s)`` in the step cap.
        sigma_min, sigma_max: absolute bounds on ``sigma``; the curvature is floored at
            ``1 / sigma_max^2``.
        scale_min, scale_max: per-step bounds on the factor by which ``sigma`` may change.
        curvature: ``"mean"`` (running mean of ``h`` where significantly positive, else the
            current ``1 / sigma^2``) or ``"rms"`` (the reference's ``sqrt(mean(h^2))``).
        damping: adapt a per-coordinate step divisor to oscillation and noise (module docstring);
            ``False`` takes full steps.
        drift_forgetting: rate at which curvature averages forget estimates taken at past means,
            per ``sigma`` travelled; ``0`` keeps the reference's plain warm-up.
    """

    lr: float = 1.0
    betas: tuple[float, float] = (0.0, 0.999)
    eps: float = 1e-8
    sigma_min: float = 1e-6
    sigma_max: float = 1e2
    scale_min: float = 0.1
    scale_max: float = 10.0
    curvature: str = "mean"
    damping: bool = True
    drift_forgetting: float = 1.0

    def __post_init__(self):
        beta1, beta2 = self.betas
        checks = [
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (0 <= beta1 < 1, f"betas[0] must be in [0, 1), got {beta1}"),
            (0 <= beta2 < 1, f"betas[1] must be in [0, 1), got {beta2}"),
            (self.eps >= 0, f"eps must be >= 0, got {self.eps}"),
            (
                0 < self.sigma_min < self.sigma_max < math.inf,
                f"need 0 < sigma_min < sigma_max < inf, got {self.sigma_min}, {self.sigma_max}",
            ),
            (
                0 < self.scale_min <= 1 <= self.scale_max,
                f"need 0 < scale_min <= 1 <= scale_max, got {self.scale_min}, {self.scale_max}",
            ),
            (
                self.curvature in _CURVATURES,
                f"curvature must be one of {_CURVATURES}, got {self.curvature!r}",
            ),
            (
                self.drift_forgetting >= 0,
                f"drift_forgetting must be >= 0, got {self.drift_forgetting}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class QNVBState(NamedTuple):
    """Per-coordinate state of :func:`qnvb_update`; every field has the shape of ``mu``.

    Attributes:
        g_avg: running mean gradient of ``L``, carried to the new mean after each step.
        s_avg: running mean of the squared total gradient (for the step cap).
        h_avg: running mean of ``h``.
        h2_avg: running mean of ``h^2``.
        count: number of updates of the coordinate (gradient warm-up).
        curvature_count: effective number of samples in ``s_avg``, ``h_avg``, ``h2_avg``.
        last_grad: the previous total gradient (sign test of the damping).
        damping: the step divisor ``k >= 1``.
    """

    g_avg: torch.Tensor
    s_avg: torch.Tensor
    h_avg: torch.Tensor
    h2_avg: torch.Tensor
    count: torch.Tensor
    curvature_count: torch.Tensor
    last_grad: torch.Tensor
    damping: torch.Tensor


class QNVBResult(NamedTuple):
    """What :func:`qnvb_update` returns.

    Attributes:
        mu, sigma: the new mean and standard deviation.
        state: the new state.
        num_nonfinite: how many coordinates had a non-finite ``g``, ``h`` or update (they are
            left unchanged).
    """

    mu: torch.Tensor
    sigma: torch.Tensor
    state: QNVBState
    num_nonfinite: int


def init_qnvb_state(mu: torch.Tensor) -> QNVBState:
    """The state before the first step, for a mean of the shape, dtype and device of ``mu``."""
    zeros = torch.zeros_like(mu)
    return QNVBState(
        g_avg=zeros,
        s_avg=zeros.clone(),
        h_avg=zeros.clone(),
        h2_avg=zeros.clone(),
        count=zeros.clone(),
        curvature_count=zeros.clone(),
        last_grad=zeros.clone(),
        damping=torch.ones_like(mu),
    )


def _average(avg: torch.Tensor, new: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Running average with warm-up: weight ``1 / count`` on the new value (count >= 1)."""
    return avg + (new - avg) / count


@torch.no_grad()
def qnvb_update(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    state: QNVBState,
    hp: QNVBHyperparameters,
    weight: float = 1.0,
    prior_precision: float = 0.0,
) -> QNVBResult:
    """One QNVB step (rasp paper, eq. 4-8; sequence paper, Section 4.2), elementwise.

    Args:
        mu, sigma: the current mean field.
        g: expected gradient of ``L`` under ``N(mu, sigma^2)`` (eq. 7).
        h: expected Hessian diagonal of ``L`` (eq. 8), e.g. ``sum_k w_k grad_k x_k / sigma``.
        state: from :func:`init_qnvb_state` or the previous step.
        hp: the hyperparameters.
        weight: multiplies ``L`` in the loss (likelihood weight times annealing factor).
        prior_precision: precision of a zero-mean Gaussian prior added to the loss.

    Coordinates where ``g`` or ``h`` is not finite, or where the update overflows, keep their
    mean, scale and state.

    Returns:
        :class:`QNVBResult` with the new mean, scale and state.
    """
    beta1, beta2 = hp.betas
    finite = torch.isfinite(g) & torch.isfinite(h)
    g = torch.where(finite, g, 0.0)
    h = torch.where(finite, h, 0.0)

    # running averages with warm-up (design note, step 3)
    count = state.count + 1
    g_avg = _average(state.g_avg, g, count.clamp(max=1.0 / (1.0 - beta1)))
    curvature_count = torch.minimum(
        (state.curvature_count + 1).clamp(max=1.0 / (1.0 - beta2)),
        torch.maximum(RECENT_FRACTION * count, count.clamp(max=2.0)),
    )
    grad = weight * g + prior_precision * mu
    s_avg = _average(state.s_avg, grad * grad, curvature_count)
    h_avg = _average(state.h_avg, h, curvature_count)
    h2_avg = _average(state.h2_avg, h * h, curvature_count)

    # curvature of L, then of the whole loss (step 4)
    rms = h2_avg.sqrt()
    if hp.curvature == "rms":
        curv = rms
        significant = torch.ones_like(finite)
    else:
        stderr = ((h2_avg - h_avg**2).clamp(min=0) / curvature_count).sqrt()
        significant = h_avg > SIGNIFICANCE * stderr
        held = ((sigma**-2 - prior_precision) / weight).clamp(min=0)  # q's current precision
        curv = torch.where(significant, h_avg, held)
    total_curv = (weight * curv + prior_precision).clamp(min=hp.sigma_max**-2)

    # damping: a sign change of the gradient means the last step overshot
    if hp.damping:
        flipped = grad * state.last_grad < 0
        damping = torch.where(
            flipped, state.damping + 1, (state.damping - DAMPING_RECOVERY).clamp(min=1.0)
        ).clamp(max=MAX_DAMPING)
    else:
        damping = state.damping

    # mean: quasi-Newton step, capped by an Adam-sized step (step 6)
    cap = (s_avg.sqrt() + hp.eps) / hp.lr
    total_grad = weight * g_avg + prior_precision * mu
    step = total_grad / (damping * torch.maximum(total_curv, cap))
    new_mu = mu - step
    g_avg = g_avg - curv * step  # carry the averaged gradient to the new mean

    # scale: sigma* = (w H + prior)^(-1/2), rate-limited, then bounded (step 5)
    target = torch.where(significant, total_curv.rsqrt(), sigma)
    new_sigma = torch.minimum(torch.maximum(target, sigma * hp.scale_min), sigma * hp.scale_max)
    new_sigma = new_sigma.clamp(hp.sigma_min, hp.sigma_max)

    if hp.drift_forgetting > 0:
        # a step taken while damped (k > 1) is mostly noise or oscillation, not drift
        travelled = step.abs() / (damping * sigma)
        curvature_count = curvature_count * torch.exp(-hp.drift_forgetting * travelled)

    new_state = QNVBState(
        g_avg=g_avg,
        s_avg=s_avg,
        h_avg=h_avg,
        h2_avg=h2_avg,
        count=count,
        curvature_count=curvature_count,
        last_grad=grad,
        damping=damping,
    )
    # overflow (e.g. of g^2) also leaves a coordinate unchanged: no NaN ever leaves this function
    for value in (new_mu, new_sigma, *new_state):
        finite &= torch.isfinite(value)
    num_nonfinite = int(finite.numel() - finite.sum())
    if num_nonfinite:
        new_mu = torch.where(finite, new_mu, mu)
        new_sigma = torch.where(finite, new_sigma, sigma)
        new_state = QNVBState(
            *(torch.where(finite, new, old) for new, old in zip(new_state, state))
        )
    return QNVBResult(new_mu, new_sigma, new_state, num_nonfinite)
