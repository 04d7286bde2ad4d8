"""The sparsifying QNVB update as pure functions of tensors.

Sequence paper, Sections 4.3 and 5 (Algorithms 5.1-5.3). Each coordinate ``theta_i`` has a
Dirac-Gauss mixture ``q(theta_i) = q(z_i) delta(theta_i) + q(not z_i) N(nu_i, tau_i^2)`` (eq. 4.1),
written here with ``p_nonzero = q(not z_i)``. The quadrature (Algorithm 4.1) is applied to the
mixture's own moments (eq. 4.2)

    mu = p_nonzero nu,        sigma^2 = p_nonzero (1 - p_nonzero) nu^2 + p_nonzero tau^2,

and returns the gradient ``g`` and Hessian diagonal ``h`` of one loss term at ``mu``. One term is
one call of `sparse_qnvb_update`: with minibatches, one step's minibatch sum stands for its
``B = n_c / S`` cases' per-case terms (``n_c`` cases in ``S`` steps per epoch), each case
carrying ``1 / n_c`` of the continuous prior (Section 5.1.2). The counts of terms (``n0``,
``n1``, the annealing target ``n_tgt``) are kept in steps rather than cases: the sums, the
coefficients of eq. 5.1 and ``n1 / n_tgt`` depend on them only through ratios, so counting in
units of ``B`` cases changes nothing but the paper's floors ``floor(n_c 2^(e - n_e))``, which are
dropped. Counted so, the paper's initial stage of ``n_c 2^(1 - n_e)`` cases lasts
``S 2^(1 - n_e)`` steps: less than one step unless ``S > 2^(n_e - 1)`` (512 for 10 epochs).

The trust region is the exception. Its bound ``max(n0, n1) h_min`` is not carried into the sums
(they are carried with ``h0``, ``h1``), so where it binds every update moves ``nu`` by the average
gradient per term over ``h_min`` (Section 5.1.3), however many updates an epoch has: the paper
makes ``n_c`` of them, a minibatch run ``S``. To move a minibatch of ``B`` cases as far as the
paper's ``B`` per-case updates, ``h_min`` keeps the paper's value in cases,
``h_min = 1 / (n_c 2^(1 - n_e) alpha_max)`` (Algorithm 5.1, line 6), with ``max(n0, n1)``
counted in steps: ``cases_per_step = B`` in `sparse_qnvb_update`. (Counting ``n0`` in
steps there as well would divide the maximum learning rate by ``B``.)

One update (Algorithm 5.3, with the errata of ``design/qnvb-update-rule.md``):

1. The term is added to the restarted sums ``g1``, ``h1``; ``h1`` is floored at
   ``1 / tau_max^2`` (or, an extension, ``1 / late_tau_max^2`` from ``late_epoch`` on, the slab
   keeping ``tau <= tau_max``: `SparseQNVBHyperparameters`). At the start of an epoch the
   restarted sums are emptied (Algorithm 5.2, line 2); at the start of the final epoch the most
   probable pattern is realized and kept.
2. The hybrid sums ``g_hat``, ``h_hat`` of eq. 5.1 **as corrected** (the second coefficient
   multiplies ``a_1``; line 5 reads ``h_hat = alpha_0 h_0 + alpha_1 h_1``): they have the mean and
   variance of ``max(n0, n1)`` terms.
3. The Gaussian means move by a Newton step on the hybrid quadratic, inside a trust region:
   ``nu <- nu - g_nu / max(h_hat, max(n0, n1) h_min)`` with ``g_nu = g_hat + h_hat (nu - mu)``
   and ``h_min = 1 / (n_c 2^(1 - n_e) alpha_max)`` (Section 5.1.3, Algorithm 5.1 line 6);
   ``tau = h_hat^(-1/2)``.
4. Zero logits by eq. 4.6 with the prior precision ``h_p = 1 / tau_max^2`` and without ``zeta_p``
   (line 10), then the sieve (lines 11-14): the logits of **all** coordinates are ranked together
   (a stable sort, ties broken by index), the ``s0(t)`` fraction of largest rank is shifted to at
   least ``-logit(p_nonzero_low)``, the ``s1(t)`` fraction of smallest rank to at most
   ``-logit(p_nonzero_high)``, and the rest is mapped affinely between them; the middle piece
   divides by ``zeta^(1) - zeta^(0)`` (erratum: the text prints ``zeta^(1) - zeta_hat^(0)``,
   which is not continuous).
5. The mixture moments (eq. 4.2) give the new expansion point ``mu``; both sums are carried to it
   by their quadratic model, ``g <- g + h (mu_new - mu)`` (line 20). Line 19 prints the exponent
   ``-1/2``; eq. 4.2 gives ``sigma = (...)^(1/2)``, used here.
6. When the restarted sum holds the epoch's target ``n_tgt = S 2^(e - n_e)`` terms (in steps) it
   replaces the previous one and restarts (Algorithm 5.2, lines 13-15).
7. **Guard**: a non-finite ``g`` or ``h`` drops the term at its coordinate; a Gaussian step that
   overflows keeps the coordinate's Gaussian; a coordinate with any other non-finite field keeps
   its whole previous state. Each such coordinate is counted once (`SparseQNVBResult`,
   `result_messages`): no NaN or infinity ever leaves the update.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from .qnvb_functional import IdleWords, _check_number, _check_tensors, or_float64

__all__ = [
    "SPARSE_COUNT_KINDS",
    "SPARSE_IDLE",
    "SURE_NONZERO",
    "SievePieces",
    "SparseQNVBBlock",
    "SparseQNVBCounters",
    "SparseQNVBHyperparameters",
    "SparseQNVBResult",
    "epoch_progress",
    "hybrid_coefficients",
    "hybrid_sum",
    "init_sparse_block",
    "init_sparse_counters",
    "loss_growth_message",
    "mixture_moments",
    "realization_message",
    "result_count_values",
    "result_messages",
    "run_settings",
    "sieve_fractions",
    "sieve_map",
    "sieve_pieces",
    "sparse_qnvb_update",
    "step_cap_message",
    "zero_logits",
]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SparseQNVBHyperparameters:
    """Hyperparameters of the sparsifying QNVB; defaults from the sequence paper's Table 1.

    Attributes:
        target_sparsity: ``s_tgt^(0)``, the fraction of coordinates held near zero (probability
            of a nonzero at most ``p_nonzero_low``) once the sieve has finished, at the end of
            epoch ``num_epochs - 1``.
        target_free: ``s_tgt^(1)``, the fraction held nonzero (probability of a nonzero at least
            ``p_nonzero_high``) at that time. The remaining ``1 - target_sparsity - target_free``
            lie between the two and are rounded when the pattern is realized.
        max_lr: ``alpha_max``, the maximum learning rate: it sets the curvature floor of the
            trust region, ``h_min = 1 / (n0 max_lr)``.
        initial_lr: ``alpha_0``, the initial learning rate: the initial curvature sums are
            ``1 / initial_lr``. At most ``max_lr`` (a ``ValueError`` otherwise).
        tau_max: the largest standard deviation of a nonzero Gaussian; ``1 / tau_max^2`` floors the
            curvature sums and is the slab's prior precision in the zero logits (eq. 4.6).
        p_nonzero_low, p_nonzero_high: the sieve's probabilities ``p_NZ^(0)`` and ``p_NZ^(1)``.
        num_epochs: ``n_e``, the number of epochs (at least 3: the schedule ``s0`` divides by
            ``1 - 2^(2 - n_e)``).
        num_pairs: ``n_q``, antithetic pairs per quadrature (``2 n_q`` evaluations per term).
        late_tau_max: an extension, not in the paper (``None``, the default, is the paper's
            Algorithm 5.3): from epoch ``late_epoch`` on, the curvature sums are floored at
            ``1 / late_tau_max^2`` instead of ``1 / tau_max^2``, while the slab keeps
            ``tau <= tau_max`` (its precision is ``max(h_hat, 1 / tau_max^2)``, also in the zero
            logits). The floor is the cap on the Newton step on ``nu`` wherever the trust region
            does not bind, so a ``late_tau_max`` above ``tau_max`` lets later steps be up to
            ``(late_tau_max / tau_max)^2`` times longer without widening the nodes: Section
            5.1.3's small localized quadratures first, with longer steps once a basin is found.
        late_epoch: the first epoch (1-based) of ``late_tau_max``; read only when it is set.
    """

    target_sparsity: float = 0.97
    target_free: float = 0.01
    max_lr: float = 0.1
    initial_lr: float = 1e-5
    tau_max: float = 0.3
    p_nonzero_low: float = 0.001
    p_nonzero_high: float = 0.999
    num_epochs: int = 10
    num_pairs: int = 2
    late_tau_max: float | None = None
    late_epoch: int = 3

    def __post_init__(self) -> None:
        positive = (lambda v: 0 < v < math.inf, "finite and > 0")
        checks = [
            ("target_sparsity", self.target_sparsity, lambda v: 0 <= v < 1, "in [0, 1)"),
            ("target_free", self.target_free, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("max_lr", self.max_lr, *positive),
            ("initial_lr", self.initial_lr, *positive),
            ("tau_max", self.tau_max, *positive),
            ("p_nonzero_low", self.p_nonzero_low, lambda v: 0 < v < 0.5, "in (0, 0.5)"),
            ("p_nonzero_high", self.p_nonzero_high, lambda v: 0.5 < v < 1, "in (0.5, 1)"),
        ]
        for name, value, ok, expected in checks:
            _check_number(name, value, ok, expected)
        if self.initial_lr > self.max_lr:
            raise ValueError(
                f"initial_lr={self.initial_lr!r} is above max_lr={self.max_lr!r}: the learning "
                "rate rises from initial_lr up to max_lr, and the trust region caps every step "
                "at max_lr (Algorithm 5.3), so a larger initial_lr only starts the nodes wider "
                "(sigma = initial_lr^(1/2)); pass initial_lr <= max_lr (Table 1: 1e-5 and 0.1)"
            )
        if self.target_sparsity + self.target_free > 1:
            raise ValueError(
                f"target_sparsity + target_free must be <= 1, got {self.target_sparsity!r} + "
                f"{self.target_free!r}: lower one of them"
            )
        _check_int("num_epochs", self.num_epochs, 3)
        _check_int("num_pairs", self.num_pairs, 1)
        if self.late_tau_max is not None:
            _check_number("late_tau_max", self.late_tau_max, *positive)
        _check_int("late_epoch", self.late_epoch, 1)
        self.check_widths("", torch.float64)
        if self.late_epoch > self.num_epochs:
            raise ValueError(
                f"late_epoch must be at most num_epochs={self.num_epochs}, got "
                f"{self.late_epoch!r}: late_tau_max would never apply"
            )

    def check_widths(self, owner: str, dtype: torch.dtype) -> None:
        """Refuse a ``tau_max`` (or ``late_tau_max``) whose square or inverse square is beyond
        the range of ``dtype``: the slab's variance ``tau_max^2`` in the zero logits (eq. 4.6)
        and the curvature floor ``1 / tau_max^2`` (Algorithm 5.3, line 3) are computed in it
        (``tau_max=1e300`` overflowed in the first step's zero logits with Python's "Numerical
        result out of range"). ``owner`` (``"SparseQNVBOptimizer: "``, or ``""``) goes first."""
        largest = torch.finfo(dtype).max
        low, high = largest**-0.5, largest**0.5
        for name in ("tau_max", "late_tau_max"):
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                fix = "" if dtype == torch.float64 else ", or use float64 parameters"
                raise ValueError(
                    f"{owner}{name}={value!r} is outside [{low:.3g}, {high:.3g}], where its "
                    f"square (the slab's variance in the zero logits) and its inverse square "
                    f"(the curvature floor) are finite in {dtype}: pass a width within it (Table "
                    f"1's tau_max is 0.3){fix}"
                )

    def curvature_floor(self, epoch: int) -> float:
        """The floor on the curvature sums in ``epoch`` (1-based): ``1 / tau_max^2``
        (Algorithm 5.3, line 3), or ``1 / late_tau_max^2`` from ``late_epoch`` on."""
        late = self.late_tau_max is not None and epoch >= self.late_epoch
        return (self.late_tau_max if late else self.tau_max) ** -2

    @property
    def sieve_logits(self) -> tuple[float, float]:
        """``(zeta_hat^(0), zeta_hat^(1)) = (-logit(p_nonzero_low), -logit(p_nonzero_high))``."""
        low, high = self.p_nonzero_low, self.p_nonzero_high
        return math.log((1 - low) / low), math.log((1 - high) / high)


class SparseQNVBBlock(NamedTuple):
    """Per-coordinate state of one block (a site or a parameter); every field has its shape.

    Attributes:
        nu, tau: mean and standard deviation of the nonzero Gaussian.
        p_nonzero: ``q(not z)``, the probability of a nonzero (after the sieve).
        mu, sigma: the mixture moments (eq. 4.2), the quadrature's expansion point and scale.
        g0, h0: the previous sums of gradients and Hessian diagonals, at ``mu``.
        g1, h1: the restarted (current) sums, at ``mu``.
        pattern: the realized pattern (1: nonzero, 0: exact zero); all ones before the final epoch.
    """

    nu: torch.Tensor
    tau: torch.Tensor
    p_nonzero: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor
    g0: torch.Tensor
    h0: torch.Tensor
    g1: torch.Tensor
    h1: torch.Tensor
    pattern: torch.Tensor


class SparseQNVBCounters(NamedTuple):
    """Global counters. ``step``: updates taken; ``n0``, ``n1``: terms in the two sums, in steps
    (``n0`` starts at the fraction ``S 2^(1 - n_e)`` of a step)."""

    step: int
    n0: float
    n1: float


class SparseQNVBResult(NamedTuple):
    """What `sparse_qnvb_update` returns.

    Attributes:
        blocks: the new per-block states.
        counters: the new counters.
        zero_logits: per block, the zero logits of eq. 4.6 before the sieve (``None`` in the final
            epoch, where the pattern is fixed).
        num_nonfinite: coordinates whose ``g`` or ``h`` was not finite (0-d tensor); their term is
            dropped (it adds nothing to the sums).
        num_overflow: the other coordinates, whose ``g`` and ``h`` were finite, whose update
            overflowed; they drop the term (Gaussian step overflow) or keep their whole previous
            state (any other field), so that no NaN or infinity ever leaves the update. Each
            coordinate is counted once, in one of the two (where both guards keep it, too):
            ``num_nonfinite + num_overflow`` is the number of coordinates that took nothing from
            the term, at most the total (`count_idle_step` reads it).
        num_clamped: coordinates whose zero logit reached the clamp ``+-sqrt(finfo.max)``
            (``h nu^2`` too large, in practice because the Gaussian means diverged): their
            logits tie, and the sieve ranks them by index, not by evidence.
    """

    blocks: tuple[SparseQNVBBlock, ...]
    counters: SparseQNVBCounters
    zero_logits: tuple[torch.Tensor, ...] | None
    num_nonfinite: torch.Tensor
    num_overflow: torch.Tensor
    num_clamped: torch.Tensor


SPARSE_COUNT_KINDS = ("num_nonfinite", "num_overflow", "num_clamped")
"""The counts of a `SparseQNVBResult`, in the order of `result_count_values`."""

SPARSE_IDLE = IdleWords(
    "each one's gradient or curvature was not finite, or its step overflowed, so the update "
    "dropped its term: these steps took nothing from the data (what still moved, moved on the "
    "sums of earlier steps and on the sieve's schedule)",
    "a smaller max_lr or tau_max",
)
"""`IdleWords` of `sparse_qnvb_update` (its guard, step 7 of the module), for
`idle_step_refusal`: a step whose terms the guard dropped at every coordinate is idle
(`count_idle_step`, with ``num_nonfinite + num_overflow`` coordinates kept)."""


def result_count_values(result: SparseQNVBResult) -> list[int]:
    """``[num_nonfinite, num_overflow, num_clamped]`` of ``result``, read to the host in one copy
    (the one read of a step: the idle-step rule and `result_messages` share it)."""
    return torch.stack([getattr(result, kind) for kind in SPARSE_COUNT_KINDS]).tolist()


def result_messages(
    result: SparseQNVBResult,
    warned: set[str],
    cap: Callable[[], str] | None = None,
    counts: list[int] | None = None,
) -> list[str]:
    """One message per kind of count of ``result`` that occurred and is not yet in ``warned``
    (the kinds reported are added to it). Reads the counts only while a kind is left to report,
    and not at all where ``counts`` (`result_count_values`) holds them already.
    ``cap`` (a call of `step_cap_message`, made only for a message) replaces the general advice
    of the overflow and clamp messages; the overflow message advises float64 only where a block
    is of a lower precision (`or_float64`)."""
    kinds = SPARSE_COUNT_KINDS
    if warned.issuperset(kinds):
        return []
    if counts is None:
        counts = result_count_values(result)
    texts = {
        "num_nonfinite": "non-finite gradient or curvature at {} coordinates; their term was "
        "dropped",
        "num_overflow": "the update overflowed at {} coordinates although the gradient and "
        "curvature were finite; they kept their previous state "
        f"({or_float64('rescale the loss', (b.mu.dtype for b in result.blocks), ', or ')}). ",
        "num_clamped": "the zero logits of {} coordinates reached the clamp +-sqrt(finfo.max) "
        "(h nu^2 overflowed: the Gaussian means have diverged); tied there, the sieve ranks them "
        "by index rather than by evidence (see 'Limits' in docs/sparse_qnvb.md). ",
    }
    messages = []
    for kind, count in zip(kinds, counts):
        if count and kind not in warned:
            warned.add(kind)
            text = texts[kind].format(count)
            if kind != "num_nonfinite":
                text += cap() if cap is not None else "Lower tau_max or max_lr"
            messages.append(text)
    return messages


LOSS_GROWTH = 1e3
"""A step whose loss exceeds the first step's by more than ``LOSS_GROWTH`` times the first's
magnitude is taken as divergence (`loss_growth_message`)."""


def loss_growth_message(
    first: float,
    value: float,
    step: int,
    what: str,
    cap: Callable[[], str] | None = None,
    *,
    dtypes: Sequence[torch.dtype],
) -> str | None:
    """The warning for a loss that grew beyond ``first + 1000 |first|``, else ``None``.

    ``first`` is the first step's loss, that of the untrained model, which a converging run stays
    below up to minibatch noise (a small factor), while diverging means (see 'Limits' in the
    docs) grow it by many orders of magnitude. A first loss of exactly 0 gives no scale, and no
    warning. ``step`` (1-based) and ``what`` (the loss, in words) go into the message; ``cap`` (a
    call of `step_cap_message`, made only for a warning) says which setting bounds the steps now,
    in place of the general advice; ``dtypes`` (the means') add "use float64" to it where one is
    of a lower precision (`or_float64`).
    """
    if not value - first > LOSS_GROWTH * abs(first) > 0:
        return None
    advice = or_float64(cap() if cap is not None else "lower tau_max or max_lr", dtypes, "; or ")
    return (
        f"{what} is {value:.3g} at step {step}, more than {LOSS_GROWTH:g} times the first step's "
        f"{first:.3g} above it: the Gaussian means may be diverging (see 'Limits' in "
        f"docs/sparse_qnvb.md). {advice} (from a warm start whose first loss is near 0 the sieve "
        "zeroing weights can do this too). This warning is shown once"
    )


SURE_NONZERO = 0.99
"""The probability of a nonzero (eq. 4.6, before the sieve) above which `realization_message`
counts a weight the realization zeroes as a sure one."""


def realization_message(
    blocks: Sequence[SparseQNVBBlock],
    counters: SparseQNVBCounters,
    hp: SparseQNVBHyperparameters,
    steps_per_epoch: int,
) -> str | None:
    """The warning for a realization that zeroes sure weights the budget could keep, else ``None``.

    ``blocks`` and ``counters`` are the state *before* an update; unless that update is the
    realization (the first step of the final epoch, Algorithm 5.2 line 5), this returns ``None``
    without reading anything. The realization keeps a weight where its sieved ``p_nonzero`` exceeds
    1/2, and the sieve spreads the middle band affinely between the logits ``zeta^(1)`` and
    ``zeta^(0)``, so a weight whose own eq. 4.6 logit (Algorithm 5.3, line 10: without ``zeta_p``)
    makes it nonzero almost surely is zeroed when the strongest weights put ``zeta^(1)`` far below
    it. That is the paper's rule; the message counts such weights (eq. 4.6 probability of a nonzero
    above `SURE_NONZERO`: the unsieved probability, not the sieved one that ``p_nonzero`` reports)
    where fewer than ``d - round(target_sparsity d)`` weights stay nonzero. It names the
    ``target_free`` that would hold them all nonzero in this run: a lower bound, as ``target_free``
    moves the sieve at every step, and so the run; ``1 - target_sparsity`` holds every weight the
    budget keeps nonzero (no middle band), so that none is zeroed this way. One read from the
    device.
    """
    if counters.step != (hp.num_epochs - 1) * steps_per_epoch:
        return None
    sure_logit = -math.log(SURE_NONZERO / (1 - SURE_NONZERO))
    sure_zeroed, kept = [], []
    for block in blocks:
        zeroed = block.p_nonzero <= 0.5  # the pattern the realization takes
        sure = zero_logits(block.tau**-2, block.nu, hp.tau_max) < sure_logit
        sure_zeroed.append((zeroed & sure).sum())
        kept.append((~zeroed).sum())
    num_sure, num_kept = torch.stack([sum(sure_zeroed), sum(kept)]).tolist()
    dim = sum(block.nu.numel() for block in blocks)
    allowed = dim - _counts(hp.target_sparsity, hp.target_free, dim)[0]
    if not num_sure or num_kept >= allowed:
        return None
    bound = min(num_kept + num_sure, allowed) / dim
    return (
        f"realizing the pattern zeroed weights whose eq. 4.6 probability of a nonzero exceeds "
        f"{SURE_NONZERO} (the unsieved one, before the sieve; p_nonzero() reports the sieved "
        f"one): {num_sure} of them, although target_sparsity={hp.target_sparsity!r} allows "
        f"{allowed - num_kept} more of the {dim} to stay nonzero ({num_kept} kept): the sieve "
        "rounds its middle band at the midpoint between the logits held nonzero and held near "
        "zero, so the strongest weights push weaker sure ones to zero (see 'Limits' in "
        f"docs/sparse_qnvb.md). Holding them nonzero in this run takes target_free >= "
        f"{bound:.3g} (target_free={hp.target_free!r} now), only a lower bound: target_free "
        "moves the sieve at every step, and so the run, which can zero other sure weights. Pass "
        "it and, while this warning comes back, the larger bound it names, up to 1 - "
        f"target_sparsity (about {1 - hp.target_sparsity:.4g}), which holds every weight the "
        "budget keeps nonzero; beyond the fraction of weights the model needs, target_free holds "
        "spurious ones nonzero. This warning is shown once"
    )


def step_cap_message(
    counters: SparseQNVBCounters,
    hp: SparseQNVBHyperparameters,
    steps_per_epoch: int,
    cases_per_step: float,
) -> str:
    """Which setting bounds the Newton step on ``nu`` at ``counters`` (Algorithm 5.3, line 7),
    and so which one to lower where the means diverge.

    The step divides by ``max(h_hat, max(n0, n1) h_min)`` and ``h_hat`` is at least the floor
    (``1 / tau_max^2``, or ``1 / late_tau_max^2`` from ``late_epoch`` on). Where the trust region
    ``max(n0, n1) h_min`` (set by ``max_lr``) is below the floor, ``max_lr`` changes nothing and
    ``tau_max`` is the setting: below the floor every coordinate's nodes also lie ``tau_max`` from
    its mean (eq. 4.2 with ``p_nonzero`` near 1), which for a network whose weights are a fraction
    of ``tau_max`` evaluates another network (the 50-400-200-1 regression of 'Limits' in
    ``docs/sparse_qnvb.md``).
    """
    epoch, _ = epoch_progress(counters.step, hp, steps_per_epoch)
    floor = hp.curvature_floor(epoch)
    trust = max(counters.n0, counters.n1) * _min_curvature(hp, steps_per_epoch, cases_per_step)
    if trust >= floor:
        return (
            f"The trust region max(n0, n1) h_min = {trust:.3g}, which max_lr={hp.max_lr!r} sets, "
            f"bounds the steps on the means (above the curvature floor {floor:.3g}): lower max_lr"
        )
    late = hp.late_tau_max is not None and epoch >= hp.late_epoch
    name, width = ("late_tau_max", hp.late_tau_max) if late else ("tau_max", hp.tau_max)
    return (
        f"The curvature floor 1 / {name}^2 = {floor:.3g} ({name}={width!r}) bounds the steps on "
        f"the means, not the trust region max(n0, n1) h_min = {trust:.3g} that max_lr sets, so a "
        f"lower max_lr changes nothing here: lower {name}. Below the floor each weight's "
        f"quadrature nodes lie tau_max={hp.tau_max!r} from its mean: where that is large against "
        "the network's weights, the nodes evaluate another network and the curvature estimates "
        "turn to noise (Table 1's 0.3 suits the paper's ternary network; a 50-400-200-1 ReLU "
        "network with weights near 0.03 diverges at 0.3 and 0.1 and is stable at 0.03: take "
        "tau_max near the smallest layer's weight scale)"
    )


def run_settings(
    hp: SparseQNVBHyperparameters,
    steps_per_epoch: int,
    num_cases: float | None,
    prior_precision: float,
) -> dict:
    """Everything besides the state that fixes a run's schedule and terms: the hyperparameters,
    ``S``, ``n_c`` and ``h_p``. Saved with a state, checked on load by
    `check_settings`."""
    return {
        **asdict(hp),
        "steps_per_epoch": steps_per_epoch,
        "num_cases": num_cases,
        "prior_precision": prior_precision,
    }


def hybrid_coefficients(n0: float, n1: float) -> tuple[float, float]:
    """``(alpha_0, alpha_1)`` of the hybrid sum, eq. 5.1 as corrected in the design note.

    ``a_hat = alpha_0 a_0 + alpha_1 a_1`` with ``alpha_0 = max(0, (n0 - n1) / (n0 + n1))`` and
    ``alpha_1 = max(1, 2 n0 / (n0 + n1))``: for sums of ``n0`` and ``n1`` i.i.d. terms its mean and
    variance are those of ``max(n0, n1)`` terms.

    Raises:
        ValueError: naming the count, for a count that is negative, NaN or infinite (``max(0,
            nan)`` would be 0 and ``inf / inf`` NaN: silently wrong coefficients), or for
            ``n0 + n1 == 0``.
    """
    for name, count in (("n0", n0), ("n1", n1)):
        if not (math.isfinite(count) and count >= 0):
            raise ValueError(
                f"hybrid sums need finite counts >= 0 (numbers of terms summed): {name} is "
                f"{count} (n0={n0}, n1={n1})"
            )
    if n0 + n1 == 0:
        raise ValueError(f"hybrid sums need n0 + n1 > 0, got n0={n0}, n1={n1}")
    total = n0 + n1
    return max(0.0, (n0 - n1) / total), max(1.0, 2 * n0 / total)


def hybrid_sum(a0: torch.Tensor, a1: torch.Tensor, n0: float, n1: float) -> torch.Tensor:
    """The hybrid sum of eq. 5.1 (corrected): ``alpha_0 a_0 + alpha_1 a_1``."""
    alpha0, alpha1 = hybrid_coefficients(n0, n1)
    return alpha0 * a0 + alpha1 * a1


def sieve_fractions(t: float, hp: SparseQNVBHyperparameters) -> tuple[float, float]:
    """The sieve's schedule (Section 5.1.4) at training progress ``t`` in ``[0, n_e]``.

    ``s0(t) = max(0, min(1, (1 - 2^(1 - t)) / (1 - 2^(2 - n_e)))) s_tgt^(0)`` and
    ``s1(t) = s_tgt^(1) + s_tgt^(0) - s0(t)``: nothing is held near zero during the first epoch,
    the target is reached at ``t = n_e - 1``.
    """
    ramp = (1 - 2.0 ** (1 - t)) / (1 - 2.0 ** (2 - hp.num_epochs))
    s0 = max(0.0, min(1.0, ramp)) * hp.target_sparsity
    return s0, hp.target_free + hp.target_sparsity - s0


def _counts(s0: float, s1: float, dim: int) -> tuple[int, int]:
    """Numbers of coordinates held near zero and held nonzero: ``round(s d)`` each, no more than
    ``d`` in all, and at least one held nonzero, which the held-near-zero count yields to (with
    ``round(s0 d) = d``, e.g. 5 weights at ``s0 = 0.97``, it would otherwise leave none)."""
    k1 = min(dim, max(1, math.floor(s1 * dim + 0.5)))
    k0 = min(dim - k1, math.floor(s0 * dim + 0.5))
    return k0, k1


class SievePieces(NamedTuple):
    """The sieve's three pieces over the logits of all coordinates (Section 5.1.4), by rank.

    Attributes:
        upper: ``zeta^(0)``, the smallest logit held near zero (``+inf`` when none is).
        lower: ``zeta^(1)``, the largest logit held nonzero.
        held_zero: mask (the shape of the logits) of the ``round(s0 d)`` coordinates of largest
            rank, mapped to at least ``zeta_hat^(0)``.
        held_nonzero: mask of the ``round(s1 d)`` (at least one) of smallest rank, mapped to at
            most ``zeta_hat^(1)``.
    """

    upper: torch.Tensor
    lower: torch.Tensor
    held_zero: torch.Tensor
    held_nonzero: torch.Tensor


def sieve_pieces(zeta: torch.Tensor, s0: float, s1: float) -> SievePieces:
    """Assign the coordinates to the sieve's pieces by rank (Algorithm 5.3, lines 11-13).

    The logits are ranked by a stable ascending sort of the flat ``zeta``, ties broken by index
    (the lower index ranks lower, nearer to nonzero): the ``round(s1 d)`` first are held nonzero,
    the ``round(s0 d)`` last held near zero, whatever the ties, so exactly those numbers land in
    the outer pieces. (A test ``zeta >= zeta^(0)`` would put every tied logit in the upper piece:
    with all logits equal, every coordinate would be held near zero.)
    """
    flat = zeta.reshape(-1)
    dim = flat.numel()
    k0, k1 = _counts(s0, s1, dim)
    ordered, order = torch.sort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(dim, device=order.device)
    rank = rank.reshape(zeta.shape)
    inf = flat.new_full((), math.inf)  # made on the device (torch.tensor copies from the host)
    return SievePieces(
        upper=ordered[dim - k0] if k0 else inf,
        lower=ordered[k1 - 1],
        held_zero=rank >= dim - k0,
        held_nonzero=rank < k1,
    )


def sieve_map(
    zeta: torch.Tensor, pieces: SievePieces, hp: SparseQNVBHyperparameters
) -> torch.Tensor:
    """The monotone, piecewise-affine sieve (Algorithm 5.3, line 14, corrected).

    With ``(zeta_hat^(0), zeta_hat^(1))`` from `SparseQNVBHyperparameters.sieve_logits`
    and the pieces (``upper = zeta^(0) >= lower = zeta^(1)``) of `sieve_pieces`:

        held near zero:  zeta - zeta^(0) + zeta_hat^(0)
        held nonzero:    zeta - zeta^(1) + zeta_hat^(1)
        otherwise:       zeta_hat^(1) + (zeta - zeta^(1)) (zeta_hat^(0) - zeta_hat^(1))
                         / (zeta^(0) - zeta^(1))

    The map is continuous at both boundaries where ``zeta^(0) > zeta^(1)``. With
    ``zeta^(0) = +inf`` (nothing held near zero yet) the middle piece is flat at
    ``zeta_hat^(1)``: every free coordinate keeps a probability of zero below ``1 - p_high``.
    With ``zeta^(0) = zeta^(1)`` (the middle logits tie both boundaries) it is the midpoint
    ``(zeta_hat^(0) + zeta_hat^(1)) / 2``, the mean of the affine piece over its range.
    """
    zeta_hat0, zeta_hat1 = hp.sieve_logits
    upper, lower = pieces.upper, pieces.lower
    top = zeta - upper + zeta_hat0
    bottom = zeta - lower + zeta_hat1
    width = upper - lower
    # on the device, without a read of upper or width: an infinite width makes the slope 0 (the
    # flat piece), and a zero width, whose slope is not finite, takes the midpoint
    affine = zeta_hat1 + (zeta - lower) * ((zeta_hat0 - zeta_hat1) / width)
    middle = torch.where(width > 0, affine, 0.5 * (zeta_hat0 + zeta_hat1))
    return torch.where(pieces.held_zero, top, torch.where(pieces.held_nonzero, bottom, middle))


def zero_logits(h_hat: torch.Tensor, nu: torch.Tensor, tau_max: float) -> torch.Tensor:
    """Logits of the probability of a zero, eq. 4.6 as Algorithm 5.3 line 10 applies it.

    ``zeta = (log(h_hat / h_p) - h_hat nu^2) / 2`` with the slab precision ``h_p = 1 / tau_max^2``
    (already inside ``h_hat``, the curvature of the whole loss) and without the prior logit
    ``zeta_p``, whose offset the sieve sets instead.
    """
    return 0.5 * (torch.log(h_hat * tau_max**2) - h_hat * nu**2)


def mixture_moments(
    p_nonzero: torch.Tensor, nu: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of the Dirac-Gauss mixture, eq. 4.2.

    ``mu = p nu`` and ``sigma^2 = p (1 - p) nu^2 + p tau^2`` with ``p = q(not z)``.
    """
    mu = p_nonzero * nu
    variance = p_nonzero * (1 - p_nonzero) * nu**2 + p_nonzero * tau**2
    return mu, variance.sqrt()


def _initial_terms(hp: SparseQNVBHyperparameters, steps_per_epoch: int) -> float:
    """``n0 = S 2^(1 - n_e)`` (Algorithm 5.1, line 3, counted in steps; module docstring)."""
    return steps_per_epoch * 2.0 ** (1 - hp.num_epochs)


def _min_curvature(
    hp: SparseQNVBHyperparameters, steps_per_epoch: int, cases_per_step: float
) -> float:
    """``h_min = 1 / (B S 2^(1 - n_e) alpha_max)``, the paper's ``1 / (n_c 2^(1 - n_e)
    alpha_max)`` (Algorithm 5.1, line 6) in cases (module docstring)."""
    return 1.0 / (_initial_terms(hp, steps_per_epoch) * cases_per_step * hp.max_lr)


def _target_terms(epoch: int, hp: SparseQNVBHyperparameters, steps_per_epoch: int) -> float:
    """``n_tgt = S 2^(e - n_e)`` (Algorithm 5.2, line 4, counted in steps)."""
    return steps_per_epoch * 2.0 ** (epoch - hp.num_epochs)


def epoch_progress(
    step: int, hp: SparseQNVBHyperparameters, steps_per_epoch: int
) -> tuple[int, int]:
    """``(e, c)``: the epoch (1-based, at most ``n_e``: later steps repeat the final epoch's rule)
    and the step within it (0-based) of update number ``step``."""
    _check_int("steps_per_epoch", steps_per_epoch, 1)
    return min(hp.num_epochs, step // steps_per_epoch + 1), step % steps_per_epoch


def init_sparse_counters(hp: SparseQNVBHyperparameters, steps_per_epoch: int) -> SparseQNVBCounters:
    """The counters before the first update (Algorithm 5.1, line 3)."""
    _check_int("steps_per_epoch", steps_per_epoch, 1)
    return SparseQNVBCounters(step=0, n0=_initial_terms(hp, steps_per_epoch), n1=0.0)


def init_sparse_block(theta: torch.Tensor, hp: SparseQNVBHyperparameters) -> SparseQNVBBlock:
    """A block's state before the first update (Algorithm 5.1, lines 3-5).

    The initial values ``theta`` are the expansion point and the Gaussian means (nonzero with
    probability one); ``g0 = 0``, ``h0 = 1 / initial_lr`` and ``sigma = tau = h0^(-1/2)``.
    """
    theta = theta.detach().clone()
    zeros = torch.zeros_like(theta)
    h0 = torch.full_like(theta, 1.0 / hp.initial_lr)
    sigma = h0.rsqrt()
    return SparseQNVBBlock(
        nu=theta.clone(),
        tau=sigma.clone(),
        p_nonzero=torch.ones_like(theta),
        mu=theta,
        sigma=sigma,
        g0=zeros,
        h0=h0,
        g1=zeros.clone(),
        h1=zeros.clone(),
        pattern=torch.ones_like(theta),
    )


@torch.no_grad()
def sparse_qnvb_update(
    blocks: Sequence[SparseQNVBBlock],
    counters: SparseQNVBCounters,
    g: Sequence[torch.Tensor],
    h: Sequence[torch.Tensor],
    hp: SparseQNVBHyperparameters,
    steps_per_epoch: int,
    cases_per_step: float = 1.0,
) -> SparseQNVBResult:
    """One term of the sparsifying QNVB (Algorithms 5.2, lines 2-5 and 13-15, and 5.3).

    Args:
        blocks: the state of every block; the sieve sorts the logits of all of them together.
        counters: from `init_sparse_counters` or the previous update.
        g: per block, the gradient of this term of the loss at the expansion point ``mu``
            (Algorithm 4.1), the continuous prior's share included; a tensor of the block's
            shape (a ``ValueError`` naming it otherwise: nothing broadcasts).
        h: per block, the Hessian diagonal of that term, likewise.
        hp: the hyperparameters.
        steps_per_epoch: ``S``, terms per epoch.
        cases_per_step: ``B = n_c / S``, training cases per term (1 for the paper's per-case
            updates): the trust region's ``h_min = 1 / (B S 2^(1 - n_e) alpha_max)`` is the paper's
            ``1 / (n_c 2^(1 - n_e) alpha_max)`` (module docstring).

    Returns:
        `SparseQNVBResult`.
    """
    if not (len(blocks) == len(g) == len(h)) or not blocks:
        raise ValueError(
            f"need one g and one h per block, got {len(blocks)} blocks, {len(g)} g, {len(h)} h"
        )
    for i, (block, g_b, h_b) in enumerate(zip(blocks, g, h)):  # elementwise: no broadcasting
        _check_tensors(
            "sparse_qnvb_update",
            block.mu,
            (g_b, h_b),
            lambda k, i=i: (f"blocks[{i}].mu", f"g[{i}]", f"h[{i}]")[k + 1],
        )
    epoch, in_epoch = epoch_progress(counters.step, hp, steps_per_epoch)
    n0, n1 = counters.n0, counters.n1
    final = epoch == hp.num_epochs
    floor = hp.curvature_floor(epoch)
    slab_floor = hp.tau_max**-2
    _check_number("cases_per_step", cases_per_step, lambda v: 0 < v < math.inf, "finite and > 0")
    h_min = _min_curvature(hp, steps_per_epoch, cases_per_step)

    num_nonfinite = torch.zeros((), dtype=torch.int64, device=blocks[0].mu.device)
    work = []
    for block, g_b, h_b in zip(blocks, g, h):
        g1, h1, pattern = block.g1, block.h1, block.pattern
        if in_epoch == 0:  # Algorithm 5.2, lines 2 and 5
            g1, h1 = torch.zeros_like(g1), torch.zeros_like(h1)
            if final:
                pattern = (block.p_nonzero > 0.5).to(block.p_nonzero.dtype)
        bad = ~torch.isfinite(g_b + h_b)  # NaN as well where g = -h = +-inf
        num_nonfinite = num_nonfinite + bad.sum()
        if bad.any():  # one host sync per block and guard; the masks only when needed
            g_b, h_b = torch.where(bad, 0.0, g_b), torch.where(bad, 0.0, h_b)
        g1_before, h1_before = g1, h1
        g1 = g1 + g_b
        h1 = (h1 + h_b).clamp(min=floor)
        work.append((block, g1, h1, pattern, g1_before, h1_before, bad))
    if in_epoch == 0:
        n1 = 0.0
    n1 += 1.0
    alpha0, alpha1 = hybrid_coefficients(n0, n1)
    trust = max(n0, n1) * h_min

    moved = []
    num_overflow = torch.zeros_like(num_nonfinite)
    for block, g1, h1, pattern, g1_before, h1_before, bad in work:
        g_hat = alpha0 * block.g0 + alpha1 * g1
        h_hat = alpha0 * block.h0 + alpha1 * h1
        g_nu = g_hat + h_hat * (block.nu - block.mu)
        nu = block.nu - g_nu / h_hat.clamp(min=trust)
        # guard: where the step overflowed, the coordinate drops this term and keeps its Gaussian
        overflow = ~torch.isfinite(nu + h_hat)
        # each coordinate counted once: one whose term was dropped already is in num_nonfinite
        num_overflow = num_overflow + (overflow & ~bad).sum()
        if overflow.any():
            nu = torch.where(overflow, block.nu, nu)
            h_hat = torch.where(overflow, block.tau**-2, h_hat)
            g1 = torch.where(overflow, g1_before, g1)
            h1 = torch.where(overflow, h1_before, h1)
        if floor < slab_floor:  # late_tau_max > tau_max: the slab's precision stays >= it
            h_hat = h_hat.clamp(min=slab_floor)
        moved.append((block, g1, h1, pattern, nu, h_hat.rsqrt(), h_hat, bad | overflow))

    num_clamped = torch.zeros_like(num_nonfinite)
    if final:
        logits = None
        p_nonzero = [pattern for _, _, _, pattern, *_ in moved]
    else:
        big = torch.finfo(blocks[0].nu.dtype).max ** 0.5  # h nu^2 may overflow: -inf -> -big
        logits = tuple(
            zero_logits(h_hat, nu, hp.tau_max).clamp(-big, big) for *_, nu, _, h_hat, _ in moved
        )
        num_clamped = sum((z.abs() >= big).sum() for z in logits)
        s0, s1 = sieve_fractions(epoch - 1 + (in_epoch + 1) / steps_per_epoch, hp)
        flat = torch.cat([z.reshape(-1) for z in logits])
        mapped = sieve_map(flat, sieve_pieces(flat, s0, s1), hp)
        p_nonzero = [
            torch.sigmoid(-m).reshape(z.shape)
            for m, z in zip(mapped.split([z.numel() for z in logits]), logits)
        ]

    new_blocks = []
    for (block, g1, h1, pattern, nu, tau, _, counted), p in zip(moved, p_nonzero):
        mu, sigma = mixture_moments(p, nu, tau)
        delta = mu - block.mu
        new = SparseQNVBBlock(
            nu=nu,
            tau=tau,
            p_nonzero=p,
            mu=mu,
            sigma=sigma,
            g0=block.g0 + block.h0 * delta,
            h0=block.h0,
            g1=g1 + h1 * delta,
            h1=h1,
            pattern=pattern,
        )
        # last guard: a coordinate with any non-finite field keeps its whole previous state (a
        # sum of the fields is not finite if one is not; the rare overflow of the sum itself only
        # keeps a coordinate too)
        bad = ~torch.isfinite(sum(new))
        num_overflow = num_overflow + (bad & ~counted).sum()  # not counted by an earlier guard
        if bad.any():
            new = SparseQNVBBlock(*(torch.where(bad, b, a) for a, b in zip(new, block)))
        new_blocks.append(new)
    if n1 >= _target_terms(epoch, hp, steps_per_epoch):  # Algorithm 5.2, lines 13-15
        n0, n1 = n1, 0.0
        new_blocks = [
            b._replace(g0=b.g1, h0=b.h1, g1=torch.zeros_like(b.g1), h1=torch.zeros_like(b.h1))
            for b in new_blocks
        ]
    return SparseQNVBResult(
        blocks=tuple(new_blocks),
        counters=SparseQNVBCounters(step=counters.step + 1, n0=n0, n1=n1),
        zero_logits=logits,
        num_nonfinite=num_nonfinite,
        num_overflow=num_overflow,
        num_clamped=num_clamped,
    )
