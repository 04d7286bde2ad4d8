"""The QNVB update as a pure function of tensors.

Quasi-Newton variational Bayes (rasp paper, eq. 4-8; sequence paper, Sections 4.1-4.2) moves a
Gaussian mean field ``N(mu, diag(sigma^2))`` to the fixed point of the projective integral update
(rasp eq. 4) on the quadratic basis (eq. 5), that is of the local quadratic model of the loss
(eq. 6):

    mu <- mu - g / h,        sigma <- h^(-1/2),

where ``g`` and ``h`` are the expected gradient and Hessian diagonal of the loss (the negative log
joint) under ``q`` (eq. 7 and 8, estimated by a quadrature as in eq. 11). `qnvb_update`
performs one such step elementwise. Every rule it applies, in order (``docs/qnvb.md``, "The
update's rules, each measured", gives the test and the benchmark row behind each):

1. **Running averages** with warm-up instead of bias correction (reference, design note step 3):
   ``g`` with ``beta1`` (off by default: ``beta1 = 0`` uses the newest ``g``), and ``g^2``,
   ``h``, ``h^2`` with ``beta2`` over at most ``1 / (1 - beta2)`` samples.
2. **Drift forgetting** (``drift_forgetting``): the curvature averages were taken at past means;
   their sample count is multiplied by ``exp(-drift_forgetting |step| / (k sigma))`` after each
   step, so estimates taken far from the current mean are forgotten while the mean travels
   (damping ``k = 1``) and averaged over long windows once it settles or its steps are dominated
   by noise (``k`` large).
3. **Recent window** (``recent_fraction``, off by default): the curvature averages span at most
   this fraction of the steps taken, so a transient fades as ``(t0 / t)^2`` instead of ``t0 / t``.
4. **Mean curvature** (``curvature="mean"``, ``significance``): ``H`` is the running mean of
   ``h`` (unbiased) where it is positive, by more than ``significance`` standard errors if that
   option is set (off by default); elsewhere ``H`` is the current precision ``1 / sigma^2`` of
   ``q``: ``sigma`` holds and the mean takes a natural-gradient step. That includes a curvature
   of exactly 0 at every step (a weight behind a ReLU unit dead at every node): its ``sigma`` is
   held, not widened to the prior's, since a unit widened so comes alive at the wide nodes with
   large activations and a deep ReLU network can diverge (``docs/benchmarks.md``, "Exact zero
   curvature: tried and reverted"). ``curvature="rms"`` is the reference's ``sqrt(mean(h^2))``
   (design note step 4), biased upward by the noise of ``h``.
5. **Curvature floor** (of the scale only): the target of ``sigma`` (rule 9) is taken from the
   curvature of the whole loss floored at ``1 / sigma_max^2``; the mean steps on the unfloored
   curvature (rule 7), as in the design note (steps 5 and 6), where only ``sigma`` is bounded. A
   floor on the mean's curvature too made it step as if ``q`` were at most ``sigma_max`` wide:
   with the reference's ``sigma_max = 1e-3`` and likelihood weight 50, a coordinate of per-case
   curvature 2 moved by ``3e-5`` on its first step instead of the ``lr``-capped ``1e-3``.
6. **Damping** (``damping``, ``damping_recovery``): a parallel (Jacobi-like) Newton step
   oscillates on a correlated posterior. Each coordinate divides its step by ``k >= 1``, which
   grows by one when the gradient changes sign between two steps and shrinks by
   ``damping_recovery`` otherwise. A steady oscillation is damped until it stops; gradient noise
   makes ``k`` grow like the step count, a Robbins-Monro schedule that averages the noise out.
7. **Step cap** (``lr``, ``eps``; design note step 6): the mean moves by
   ``g / (k max(H, (sqrt(s) + eps) / lr))``, the smaller of the (damped) quasi-Newton step and an
   Adam step of size ``lr``, with ``g``, ``H`` and ``s`` those of the whole loss (``eps`` is in
   the units of its gradient, ``weight`` times the per-case one); at ``lr = 0`` (a scheduler's
   end) the step is exactly 0. With ``trust_region`` (off by default) it moves by at most
   ``trust_region * sigma``, the width over which the nodes measured ``g`` and ``h`` (eq. 6 is a
   local model; for Bayesian networks, ``docs/qnvb.md``).
8. **Gradient carry** (with ``beta1 > 0``; design note step 6): the averaged gradient is moved to
   the new mean by the quadratic model, ``g_avg <- g_avg - H step`` (eq. 6).
9. **Scale rate limit** (``scale_min``, ``scale_max``; design note step 5): ``sigma`` moves to
   ``(w H + prior)^(-1/2)`` by a factor in ``[scale_min, scale_max]`` at most per step.
10. **Scale bounds** (``sigma_min``, ``sigma_max``): ``sigma`` is clamped to them; the
    coordinates pinned at a bound by this step are counted, at ``sigma_max`` also those whose
    (taken, not held) curvature asks for a wider ``sigma`` than ``sigma_max`` (the floor of
    rule 5 holds their ``sigma`` at ``sigma_max``, or on its way there).
11. **Guard**: a coordinate whose ``g`` or ``h`` is not finite, or whose update overflows (e.g.
    ``g^2`` beyond the dtype's range while ``g`` is finite), keeps its mean, scale and state; the
    two causes are counted apart. The counts stay 0-d tensors: the update never synchronizes
    with the host.
12. **Resolution** (counted, nothing changed): the coordinates whose ``sigma`` (that of the
    nodes this step's ``g`` and ``h`` came from) is below the dtype's spacing at ``mu``,
    ``2^e eps`` for ``2^e <= |mu| < 2^(e + 1)`` (``eps`` the machine epsilon; float32's is
    ``6.1e-5`` at 1000): their nodes ``mu + sigma x_k`` lie within about one spacing of ``mu``
    (in float32 at a mean of 1000 every node rounds to ``mu`` itself below ``sigma = 3e-5``), so
    ``h``, a difference of gradients over ``sigma``, is rounding: 0, or noise. Counted where the
    step's new ``sigma`` (before the guard, rule 11) is still below the spacing at the new
    ``mu``: a tiny ``init_scale`` that the rate limit (rule 10) widens past it in one step is no
    resolution problem (``init_scale=1e-7`` at a mean of 5 fits exactly).

**Inputs.** Every tensor has the mean's shape (nothing broadcasts: a ``g`` of shape ``(1,)``
would move every coordinate, one of shape ``(3, 1)`` grow a ``(3,)`` mean field to ``(3, 3)``),
dtype and device (nothing is converted: an integer ``g`` is refused, naming it);
``weight`` is finite and ``> 0`` and ``prior_precision`` finite and ``>= 0``. A non-finite mean or
scale is refused where reading one value back costs no sync, on the CPU (a tensor under ``vmap``
or ``torch.compile`` is not read): the guard would keep it as it is at every step, a NaN mean
counted as an overflow and an infinite scale clamped to ``sigma_max``; so is a scale ``<= 0``,
which the bounds would raise to ``sigma_min`` unseen. ``qnvb_update`` tests the mean and scale in
one pass; ``qnvb_update_many`` tests them only in a chunk whose results its guard finds not finite
(an infinite scale makes the scale before its bounds infinite) or whose scale before its bounds
is ``<= 0`` (as the input scale is), so that the usual step costs one reduction more per chunk,
and only when nothing is donated (a donated chunk before it would already be written).

**Two implementations, the same numbers.** `qnvb_update` is the reference: one tensor, each
rule written as above. `qnvb_update_many` is what the optimizers run: it lays every tensor of a
group end to end as one flat buffer and applies the same rules once, with in-place operations,
fused ones where they give the same bits, and without the work that cannot change a result (a
multiplication by a weight of 1, a prior of precision 0, the significance test at
``significance = 0``), in chunks of the flat coordinates, so that its scratch is a chunk's rather
than every tensor's. The guard's test is one sum per result and chunk on the CPU (a value read
back there costs no sync; a chunk whose sums are finite, nearly all of them, skips the guard's
selections and masks), and off the CPU an accumulated probe ``sum(x * 0) == 0`` per coordinate,
read back once per call. With ``donate`` it writes each chunk's results over the inputs it has
just read (the optimizers donate the state they own), so that it allocates no results.
``compile=True`` runs the reference `qnvb_update` through ``torch.compile``, tensor by tensor on
the CPU (a fused loop each; needs a C++ compiler), on one flat buffer elsewhere (fused kernels
for every tensor at once, counted segment by segment). Tests hold the flat update equal to the
reference value for value, and the compiled one to within rounding.

The loss is ``weight * L(theta) + prior_precision * |theta|^2 / 2``: ``g`` and ``h`` estimate the
moments of ``L`` and ``weight`` (the likelihood weight times an annealing factor) and the Gaussian
prior enter exactly at every step, as the reference's likelihood weight does. Pyro losses already
hold the prior and the data scale: there ``weight = 1`` and ``prior_precision = 0``.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..infer.batched import below_float64
from ..store import shortened

__all__ = [
    "COUNT_KINDS",
    "DONATABLE",
    "IDLE_STEPS_REFUSED",
    "PER_LABEL_KINDS",
    "QNVB_IDLE",
    "IdleWords",
    "QNVBHyperparameters",
    "QNVBResult",
    "QNVBState",
    "cast_state_to",
    "check_settings",
    "count_idle_step",
    "count_messages",
    "idle_step_refusal",
    "init_qnvb_state",
    "kept_coordinates",
    "or_float64",
    "qnvb_update",
    "qnvb_update_many",
    "result_counts",
]

_CURVATURES = ("mean", "rms")


def _check_number(name: str, value: object, ok: Callable[[float], bool], expected: str) -> None:
    """Refuse ``value`` unless it is a real number (not a bool) for which ``ok`` holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number {expected}, got {value!r} ({type(value).__name__})"
        )
    if not ok(value):  # NaN fails every comparison
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _finite_positive(value: float) -> bool:
    return 0 < value < math.inf


def _finite_nonnegative(value: float) -> bool:
    return 0 <= value < math.inf


def _is_real_scalar(value: torch.Tensor) -> bool:
    """Whether a tensor holds one real number: one element, neither bool nor complex (what
    `_check_scalar` and the annealing factor take for a number)."""
    return value.numel() == 1 and value.dtype != torch.bool and not value.is_complex()


def _check_scalar(owner: str, name: str, value: object, ok, expected: str) -> None:
    """`_check_number` of ``weight`` or ``prior_precision``, which may also be a one-element real
    tensor (its value read back: a host sync off the CPU; pass a Python number to avoid it)."""
    if isinstance(value, torch.Tensor):
        if not _is_real_scalar(value):
            raise TypeError(
                f"{owner}: {name} must be a real number {expected}, got a tensor of shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        value = value.item()
    _check_number(f"{owner}: {name}", value, ok, expected)


def _check_shared(owner: str, hp: object, weight: object, prior_precision: object) -> None:
    """Refuse an ``hp`` that is not a `QNVBHyperparameters`, a ``weight`` that is not finite and
    ``> 0`` (at 0 the held curvature
    ``(1 / sigma^2 - prior_precision) / weight`` of rule 4 divides by 0: every coordinate whose
    ``h`` was not positive was kept and counted as an overflow) or a ``prior_precision`` that is
    not finite and ``>= 0`` (a negative one steps the wrong way, an infinite one made every
    coordinate non-finite: kept without a word)."""
    if not isinstance(hp, QNVBHyperparameters):
        raise TypeError(f"{owner}: hp must be a QNVBHyperparameters, got {type(hp).__name__}")
    _check_scalar(
        owner, "weight", weight, _finite_positive, "finite and > 0 (likelihood weight times factor)"
    )
    _check_scalar(
        owner, "prior_precision", prior_precision, _finite_nonnegative, "finite and >= 0 (0: none)"
    )


def _check_tensors(owner: str, mu: object, values: tuple, name: Callable[[int], str]) -> None:
    """Refuse a mean ``mu`` that is not a floating-point tensor, or one of ``values`` that is not
    a tensor of its shape: the rules are elementwise, and broadcasting would spread one value
    over every coordinate, or grow the results. ``name(k)`` names ``values[k]`` (``name(-1)``
    the mean), called only for a message: the usual call builds no string."""
    if not (isinstance(mu, torch.Tensor) and mu.is_floating_point()):
        shown = mu.dtype if isinstance(mu, torch.Tensor) else type(mu).__name__
        raise TypeError(f"{owner}: {name(-1)} must be a floating-point tensor, got {shown}")
    shape = mu.shape
    for k, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.shape == shape:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{owner}: {name(k)} must be a tensor of {name(-1)}'s shape {tuple(shape)}, got "
                f"{type(value).__name__}"
            )
        raise ValueError(
            f"{owner}: {name(k)} has shape {tuple(value.shape)}, {name(-1)} {tuple(shape)}: "
            "every tensor of the update has the mean's shape, one value per coordinate (it "
            f"does not broadcast); pass {name(k)} of shape {tuple(shape)}"
        )


def _check_dtypes(owner: str, mu: torch.Tensor, values: tuple, name: Callable[[int], str]) -> None:
    """Refuse one of ``values`` (tensors of the mean's shape, `_check_tensors`) whose dtype or
    device is not the mean ``mu``'s (``name`` as there). The update converts nothing: torch's
    type promotion took an integer ``g`` or ``h`` into ``qnvb_update``'s float arithmetic while
    ``qnvb_update_many``'s in-place operations refused it with torch's casting error, and a
    float64 ``sigma`` made the first return a float64 mean and the second a float32 one."""
    for k, value in enumerate(values):
        if value.dtype != mu.dtype or value.device != mu.device:
            raise TypeError(
                f"{owner}: {name(k)} has dtype {value.dtype} on {value.device}, {name(-1)} "
                f"{mu.dtype} on {mu.device}: every tensor of the update has the mean's dtype and "
                f"device (it converts nothing); pass {name(k)}.to({name(-1)})"
            )


def _check_state(owner: str, state: object, name: Callable[[], str]) -> None:
    """Refuse a ``state`` that is not a tuple of the eight fields of `QNVBState` (``name()``
    names it)."""
    if not (isinstance(state, tuple) and len(state) == len(QNVBState._fields)):
        raise TypeError(
            f"{owner}: {name()} must be a QNVBState (init_qnvb_state(mu), or the state of the "
            f"previous result), got {type(state).__name__}"
        )


def _argument_name(k: int, position: str = "") -> str:
    """The name of the ``k``-th tensor after the mean (sigma, g, h, then the state's fields;
    ``k = -1``: the mean) of `qnvb_update`, or with ``position`` (``"[2]"``) in the lists of
    `qnvb_update_many` (``gs[2]``, ``states[2].h_avg``)."""
    names = ("mu", "sigma", "g", "h")
    if k < 3:
        return f"{names[k + 1]}s{position}" if position else names[k + 1]
    field = QNVBState._fields[k - 3]
    return f"states{position}.{field}" if position else f"state.{field}"


def _readable(t: torch.Tensor) -> bool:
    """Whether a value of ``t`` can be read back without a sync: on the CPU, outside ``vmap`` (or
    another torch.func transform) and ``torch.compile``."""
    return (
        t.device.type == "cpu"
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
        and not torch.compiler.is_compiling()
    )


def _refuse_nonfinite(
    owner: str, means: list[tuple[str, torch.Tensor]], scales: list[tuple[str, torch.Tensor]]
) -> None:
    """A ``ValueError`` naming each of the named ``means`` and ``scales`` that is not finite, and
    each scale that is not ``> 0``, and at how many coordinates, if one is (the counts read back
    in one copy)."""
    named = means + scales
    counts = torch.stack(
        [torch.isfinite(t).logical_not().sum() for _, t in named]
        + [torch.le(t, 0).sum() for _, t in scales]
    ).tolist()
    bad = [
        f"{n} is not finite at {c} of {t.numel()} coordinates"
        for (n, t), c in zip(named, counts)
        if c
    ] + [
        f"{n} is <= 0 at {c} of {t.numel()} coordinates"
        for (n, t), c in zip(scales, counts[len(named) :])
        if c
    ]
    if bad:
        raise ValueError(
            f"{owner}: {', '.join(bad)}; the mean and scale must be finite and the scale > 0 (the "
            "update would keep a non-finite coordinate as it is at every step, and set a scale "
            "<= 0 to sigma_min): start from finite ones, with scales > 0"
        )


@dataclass(frozen=True)
class QNVBHyperparameters:
    """Hyperparameters of `qnvb_update` (names as in the reference optimizer).

    Attributes:
        lr: caps how far ``mu`` moves: the step is ``g / max(H, (sqrt(s) + eps) / lr)``, the smaller
            of the quasi-Newton step and an Adam step of size ``lr`` (``g``, ``H``: gradient and
            curvature of the whole loss, ``s``: running mean of its ``g^2``). In the units of
            ``mu``. ``0`` (where a scheduler ends) holds the means; ``sigma`` and the averages
            update as at any ``lr``.
        betas: ``(beta1, beta2)``: running averages of ``g`` (``beta1``) and of ``g^2``, ``h`` and
            ``h^2`` (``beta2``), as arithmetic means during warm-up (count below ``1/(1-beta)``).
            ``beta1 = 0`` uses the newest gradient only.
        eps: added to ``sqrt(s)`` in the step cap: in the units of the whole loss's gradient
            (``weight`` times the per-case gradient, plus the prior's), not of the per-case
            gradient as in the reference, whose ``eps`` is this one divided by ``weight``.
        sigma_min, sigma_max: absolute bounds on ``sigma``; the curvature that sets ``sigma`` is
            floored at ``1 / sigma_max^2`` (the mean steps on the unfloored one).
        scale_min, scale_max: per-step bounds on the factor by which ``sigma`` may change.
        curvature: ``"mean"`` (running mean of ``h`` where positive, else the current
            ``1 / sigma^2``) or ``"rms"`` (the reference's ``sqrt(mean(h^2))``).
        significance: with ``curvature="mean"``, the mean of ``h`` is used only once it exceeds
            this many standard errors (``0``, the default: once it is positive); until then
            ``sigma`` holds. Tames the first steps under Monte Carlo noise, at a cost in steps.
        damping: adapt a per-coordinate step divisor to oscillation and noise (module docstring);
            ``False`` takes full steps.
        damping_recovery: how much the damping divisor ``k`` shrinks after a step without a sign
            change of the gradient (it grows by one after a sign change).
        drift_forgetting: rate at which curvature averages forget estimates taken at past means,
            per ``sigma`` travelled; ``0`` keeps the reference's plain warm-up.
        recent_fraction: the curvature averages span at most this fraction of a coordinate's
            updates (and at least two), so that the first, transient estimates fade as
            ``(t0 / t)^2`` instead of ``t0 / t``; ``1`` (the default) keeps the plain warm-up.
        trust_region: the mean moves by at most ``trust_region * sigma`` per step (the current
            ``sigma``: the width over which the nodes measured ``g`` and ``h``); ``inf``: off.
    """

    lr: float = 1.0
    betas: tuple[float, float] = (0.0, 0.999)
    eps: float = 1e-8
    sigma_min: float = 1e-6
    sigma_max: float = 1e2
    scale_min: float = 0.1
    scale_max: float = 10.0
    curvature: str = "mean"
    significance: float = 0.0
    damping: bool = True
    damping_recovery: float = 0.5
    drift_forgetting: float = 1.0
    recent_fraction: float = 1.0
    trust_region: float = math.inf

    def __post_init__(self) -> None:
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise TypeError(
                f"betas must be a pair (beta1, beta2) of numbers in [0, 1), got {betas!r} "
                f"({type(betas).__name__})"
            )
        object.__setattr__(self, "betas", tuple(betas))
        unit = (lambda b: 0 <= b < 1, "in [0, 1)")
        checks = [
            ("lr", self.lr, lambda v: v >= 0, ">= 0"),
            ("betas[0]", betas[0], *unit),
            ("betas[1]", betas[1], *unit),
            ("eps", self.eps, lambda v: 0 <= v < math.inf, "finite and >= 0"),
            ("sigma_min", self.sigma_min, lambda v: 0 < v < math.inf, "finite and > 0"),
            (
                "sigma_max",
                self.sigma_max,
                lambda v: self.sigma_min < v < math.inf,
                f"finite and > sigma_min = {self.sigma_min!r}",
            ),
            ("scale_min", self.scale_min, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("scale_max", self.scale_max, lambda v: v >= 1, ">= 1"),
            ("significance", self.significance, lambda v: 0 <= v < math.inf, "finite and >= 0"),
            ("damping_recovery", self.damping_recovery, _finite_positive, "finite and > 0"),
            ("drift_forgetting", self.drift_forgetting, _finite_nonnegative, "finite and >= 0"),
            ("recent_fraction", self.recent_fraction, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("trust_region", self.trust_region, lambda v: v > 0, "> 0 (inf: off)"),
        ]
        for name, value, ok, expected in checks:
            _check_number(name, value, ok, expected)
        if self.curvature not in _CURVATURES:
            raise ValueError(f"curvature must be one of {_CURVATURES}, got {self.curvature!r}")
        if not isinstance(self.damping, bool):
            raise TypeError(
                f"damping must be True or False, got {self.damping!r} "
                f"({type(self.damping).__name__})"
            )


class QNVBState(NamedTuple):
    """Per-coordinate state of `qnvb_update`; every field has the shape of ``mu``.

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
    """What `qnvb_update` returns; the counts are 0-d integer tensors on ``mu``'s device.

    Attributes:
        mu, sigma: the new mean and standard deviation.
        state: the new state.
        num_nonfinite: coordinates whose input ``g`` or ``h`` was not finite; they keep their
            mean, scale and state.
        num_overflow: coordinates whose ``g`` and ``h`` were finite but whose update was not
            (e.g. ``g^2`` overflowed the dtype); they keep their mean, scale and state too.
        num_sigma_min: coordinates (of those updated) whose new ``sigma`` was raised to
            ``sigma_min`` by this step and whose curvature asked for a smaller one (a sigma that
            started below ``sigma_min``, an ``init_scale`` below it, raised to it by the rate
            limit while the curvature asks for more, is not counted).
        num_sigma_max: coordinates (of those updated) whose new ``sigma`` was lowered to
            ``sigma_max`` by this step, or whose curvature (taken, not held) asks for a wider
            ``sigma`` than ``sigma_max``: the curvature floor holds their ``sigma`` at
            ``sigma_max``.
        num_unresolved: coordinates whose input ``sigma`` is below the dtype's spacing at
            ``mu`` and whose new one below that at the new ``mu`` (rule 12): the dtype does not
            resolve their nodes from the mean, and the step did not widen them past it.
    """

    mu: torch.Tensor
    sigma: torch.Tensor
    state: QNVBState
    num_nonfinite: torch.Tensor
    num_overflow: torch.Tensor
    num_sigma_min: torch.Tensor
    num_sigma_max: torch.Tensor
    num_unresolved: torch.Tensor


COUNT_KINDS = ("num_nonfinite", "num_overflow", "num_sigma_min", "num_sigma_max", "num_unresolved")
"""The counts of a `QNVBResult` that an optimizer reports: once each, and
``"num_unresolved"`` once per tensor (`count_messages`)."""

PER_LABEL_KINDS = frozenset({"num_unresolved"})
"""The `COUNT_KINDS` reported once per labelled tensor (a site, a parameter) rather than once:
what to do about one depends on that tensor's scale (`count_messages`)."""


def or_float64(advice: str, dtypes: Iterable[torch.dtype], sep: str = " or ") -> str:
    """``advice`` followed by ``sep`` and "use float64" where one of ``dtypes`` (the run's
    floating dtypes) is of a lower precision than float64 (float32, bfloat16, float16); a run
    already in float64 gets ``advice`` alone, the part that still applies."""
    if any(below_float64(dtype) for dtype in dtypes):
        return f"{advice}{sep}use float64"
    return advice


def _count_message(kind: str, hp: QNVBHyperparameters, dtype: torch.dtype, where: str) -> str:
    """The message for one of `COUNT_KINDS`; ``where``: how many coordinates, and where;
    ``dtype``: that of the first tensor concerned."""
    if kind == "num_nonfinite":
        return f"non-finite gradient or curvature at {where}; they were left unchanged"
    if kind == "num_overflow":
        return (
            "the update overflowed while the gradient was finite (e.g. g^2 beyond the dtype's "
            f"range) at {where}; they were left unchanged: "
            f"{or_float64('rescale the loss', [dtype])}. If "
            "the loss has been growing, the means have diverged: cap their steps (trust_region="
            "0.3, the network settings a BayesianModule declares, or a smaller lr)"
        )
    if kind == "num_sigma_min":
        return (
            f"sigma pinned at sigma_min={hp.sigma_min:g} at {where}: the curvature asks for a "
            "smaller sigma; lower sigma_min if that is wanted"
        )
    if kind == "num_unresolved":
        eps = torch.finfo(dtype).eps
        if torch.finfo(dtype).bits < 32:  # no parameter is in it: the dtype of a torch.autocast
            advice = (
                f"torch.autocast runs the forward with the weights in {dtype} (a linear-"
                "Gaussian fit, sd 0.005 at a mean of 2.0, ended 0.29 sd off): run the forward "
                "without autocast, or keep the layer that holds this parameter in float32 (call "
                "it inside torch.autocast(device_type, enabled=False), on float32 inputs)"
            )
        else:
            advice = or_float64(
                "Centre or rescale the latent (fit its offset from a known value)", [dtype]
            )
        return (
            f"the nodes mu + sigma * x_k round back to (near) mu at {where}: sigma is below "
            f"{dtype}'s spacing at the mean ({eps:.3g} times the largest power of 2 not above "
            "|mu|), so the curvature read from the nodes is 0 or rounding noise, and sigma "
            "holds or goes wrong (in float32, a posterior sd of 1e-6 at a mean of 1000 came out "
            f"2.4 to 20 times too wide over five data sets). {advice}"
        )
    return (
        f"sigma pinned at sigma_max={hp.sigma_max:g}, or rising to it at the scale rate limit "
        f"(scale_max={hp.scale_max:g} a step), at {where}: the curvature asks for a wider "
        "sigma (too small a likelihood weight, a parameter the loss hardly depends on without a "
        "prior, or a curvature estimate still near 0 in the first steps), or sigma started above "
        "it; raise sigma_max if a wider posterior is wanted. The posterior sd itself may be "
        f"above {hp.sigma_max:g}: the coefficient of a feature on a small scale (1e-3, say) has "
        "an sd a thousand times that of a standardized one; standardize the inputs, or raise "
        "sigma_max above that sd"
    )


def result_counts(result: QNVBResult) -> torch.Tensor:
    """The `COUNT_KINDS` of ``result`` as one integer tensor (still on the device)."""
    return torch.stack([getattr(result, kind) for kind in COUNT_KINDS])


def count_table(
    counts: list[tuple[str, QNVBHyperparameters, torch.dtype, torch.Tensor]],
) -> list[list[int]]:
    """The rows of ``counts``' count tensors (`count_messages`), read to the host in one copy."""
    return torch.stack([c for *_, c in counts]).tolist()


def kept_coordinates(table: list[list[int]], kinds: Sequence[str] = COUNT_KINDS) -> int:
    """The coordinates the guard kept (rule 11) in a step's counts, ``table``'s rows of
    ``kinds`` (`count_table`; `sparse_functional.result_count_values`, one row): those whose
    ``g`` or ``h`` was not finite and those whose update overflowed (each counted once, in one
    of the two), what `count_idle_step` compares with the step's total."""
    columns = [kinds.index(kind) for kind in ("num_nonfinite", "num_overflow")]
    return sum(row[column] for row in table for column in columns)


def count_messages(
    counts: list[tuple[str, QNVBHyperparameters, torch.dtype, torch.Tensor]],
    warned: set[str],
    table: list[list[int]] | None = None,
    detail: Callable[[int], str] | None = None,
) -> list[str]:
    """One message per kind of `COUNT_KINDS` not yet in ``warned`` that occurred, and per
    tensor for the `PER_LABEL_KINDS`.

    Args:
        counts: per updated tensor, a label (``"site 'w'"``), its hyperparameters, its dtype
            (which says whether float64 is advice) and its `result_counts`.
        warned: the kinds already reported (``"num_unresolved site 'w'"`` for a kind reported
            per tensor); the kinds reported now are added to it.
        table: the counts already read to the host (`count_table`), or ``None`` to read them here.
        detail: ``detail(i)``, words on the ``i``-th tensor's unresolved coordinates (its mean's
            magnitude and sigma), called only for a message of `PER_LABEL_KINDS`.

    The counts are read to the host only where the caller has not (``table``) and a kind may
    still be reported (one copy, a single sync). Each message names the first tensor concerned
    and the total; a per-tensor one names its tensor.
    """
    if not counts:
        return []
    if table is None:
        if warned.issuperset(set(COUNT_KINDS) - PER_LABEL_KINDS) and all(
            f"{kind} {label}" in warned for kind in PER_LABEL_KINDS for label, *_ in counts
        ):
            return []
        table = count_table(counts)
    messages = []
    for column, kind in enumerate(COUNT_KINDS):
        if kind in PER_LABEL_KINDS:
            for i, (row, (label, hp, dtype, _)) in enumerate(zip(table, counts)):
                key = f"{kind} {label}"
                if row[column] and key not in warned:
                    warned.add(key)
                    where = f"{_coordinates(row[column])} of {label}"
                    if detail is not None:
                        where += f" ({detail(i)})"
                    messages.append(_count_message(kind, hp, dtype, where))
            continue
        rows = [(row[column], *info) for row, (*info, _) in zip(table, counts) if row[column]]
        if kind in warned or not rows:
            continue
        warned.add(kind)
        total = sum(row[0] for row in rows)
        _, label, hp, dtype = rows[0]
        where = f"{_coordinates(total)} (first: {label})"
        messages.append(_count_message(kind, hp, dtype, where))
    return messages


def _coordinates(count: int) -> str:
    """``"1 coordinate"``, ``"5 coordinates"``."""
    return f"{count} coordinate{'' if count == 1 else 's'}"


IDLE_STEPS_REFUSED = 3
"""The number of steps in a row, each updating no coordinate, whose last every QNVB optimizer
refuses (`count_idle_step`): one bad minibatch gives one such step, which passes with a
warning."""


def count_idle_step(idle: int, kept: int, total: int) -> int:
    """The count of idle steps in a row after a step whose guard kept ``kept`` of its ``total``
    coordinates (rule 11; in `sparse_functional`, the guard drops their terms), given the count
    ``idle`` before it: one more where it kept all of them, else 0; a step without coordinates
    (``total`` 0) leaves it. A count of `IDLE_STEPS_REFUSED` or more refuses the step
    (`idle_step_refusal`).

    The rule of `QNVB`, `QNVBOptimizer`, `SparseQNVB` and `SparseQNVBOptimizer`, each of which
    keeps the count in its saved state, so that a resumed run refuses where an unbroken one
    does."""
    if not total:
        return idle
    return idle + 1 if kept >= total else 0


class IdleWords(NamedTuple):
    """What `idle_step_refusal` says of an update's guard.

    Attributes:
        guard: what the guard did to every coordinate, and what that left of the steps.
        remedy: the settings that make a step smaller, for a mean that diverged.
    """

    guard: str
    remedy: str


QNVB_IDLE = IdleWords(
    "each one's expected gradient or curvature was not finite, or its update overflowed (g^2 "
    "beyond the dtype's range), so these steps changed no mean, scale or state",
    "a smaller lr, or trust_region=0.3",
)
"""`IdleWords` of the QNVB update (`qnvb_update_many`)."""


def idle_step_refusal(
    owner: str,
    idle: int,
    total: int,
    labels: list[str],
    dtypes: Iterable[torch.dtype],
    *,
    unit: str,
    words: IdleWords,
    untaken: str,
    scales: Sequence[tuple[str, torch.Tensor, float]] = (),
) -> ValueError:
    """The ``ValueError`` of a step that `count_idle_step` counted ``idle`` (at least
    `IDLE_STEPS_REFUSED`).

    Args:
        owner: the optimizer's name, which begins the message.
        total: the step's coordinates; ``labels``: where they are (``"site 'w'"``, five shown).
        dtypes: the parameters' dtypes (float64 is advised only below it, `or_float64`).
        unit: what holds the coordinates (``"block"``, ``"parameter"``).
        words: what the update's guard did (`IdleWords`).
        untaken: what the refusal left as it was.
        scales: per tensor, its label, its scale ``sigma`` and its ``sigma_min``. A scale below
            its ``sigma_min`` after such steps was never updated (a step raises it to
            ``sigma_min`` at least): it started there, and its precision ``1 / sigma^2`` may be
            beyond the dtype's range. The message then names the smallest against
            ``sigma_min`` as the cause, rather than the data (read only here, at the refusal).
    """
    where = shortened(labels, 5, None)
    head = (
        f"{owner}: no coordinate of any {unit} could be updated in {idle} steps in a row (in "
        f"this one, {total} coordinates of {where}): {words.guard}."
    )
    below = [
        (least, bound, label)
        for label, sigma, bound in scales
        if sigma.numel() and (least := float(sigma.min())) < bound
    ]
    if below:
        least, bound, label = min(below)
        return ValueError(
            f"{head} Likely cause: a starting scale far below sigma_min: the smallest, "
            f"{least:.3g} ({label}), is below sigma_min={bound:g}: no step raised it, and the "
            f"update's precision 1 / sigma^2 there, {least**-2.0 if least > 0 else math.inf:.3g}, "
            f"overflows float32 beyond {torch.finfo(torch.float32).max:.3g}. This step was "
            f"refused, {untaken}: "
            "start from scales >= sigma_min (a guide's init_scale, QNVBOptimizer's init_sigma)"
        )
    return ValueError(
        f"{head} Likely causes: data on "
        "scales far from 1 (unstandardized features under an exp, or a likelihood far sharper "
        f"than the current scales), or a previous step too large (a diverged mean: "
        f"{words.remedy}). This step was refused, {untaken}: "
        f"{or_float64('standardize the inputs', dtypes)}"
    )


def check_settings(owner: str, saved: dict, current: dict) -> None:
    """Raise a ``ValueError`` naming every setting in which a saved state differs from the
    optimizer it is loaded into (``owner`` names the loading method): its counters, sums and
    averages would go on under other settings. ``saved`` and ``current`` map setting names to
    plain values."""
    differing = [
        f"{name}={saved.get(name)!r} (this optimizer: {current.get(name)!r})"
        for name in sorted(set(saved) | set(current))
        if saved.get(name) != current.get(name)
    ]
    if differing:
        raise ValueError(
            f"{owner}: the state was saved with {', '.join(differing)}; construct the optimizer "
            "with the saved settings to continue that run"
        )


def init_qnvb_state(mu: torch.Tensor) -> QNVBState:
    """The state before the first step, for a mean of the shape, dtype and device of ``mu``."""
    if not isinstance(mu, torch.Tensor):
        raise TypeError(f"init_qnvb_state: mu must be a tensor, got {type(mu).__name__}")
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


def _divisor_may_vanish(hp: QNVBHyperparameters, dtype: torch.dtype) -> bool:
    """Whether the step's divisor ``max(w H + prior, (sqrt(s) + eps) / lr)`` (rule 7) can be 0
    in ``dtype``: where no gradient has been seen (``s = 0``) the cap is ``eps / lr``, which is 0
    below the dtype's smallest normal number (``eps = 0``, ``lr = inf``), and the curvature of
    the loss is 0 with ``curvature="rms"`` and ``h = 0``. Only then are the coordinates whose
    divisor is 0 given a step of 0: a zero gradient (or one whose square underflows, ``s = 0``)
    rather than ``0 / 0``, or a gradient divided by nothing (a floor at the smallest number
    made ``1e-23 / 1e-38`` a step of ``1e15`` in float32)."""
    tiny = torch.finfo(dtype).tiny
    return min(hp.eps, hp.eps / hp.lr) < tiny


def cast_state_to(p: torch.Tensor, state: dict) -> None:
    """Every tensor of ``state`` (one parameter's) moved, in place of the entry, to ``p``'s device
    and, for a floating-point ``p``, cast to its dtype: torch's policy when ``load_state_dict``
    pairs a saved state with a parameter of a group that is neither fused nor capturable
    (``Optimizer._process_value_according_to_param_policy``, private, hence written out here),
    applied where an optimizer sees a parameter cast or moved between steps (``net.float()``,
    ``net.to("cuda")``), so that its state follows the parameter rather than keeping the old
    dtype (a float64 state silently driving a float32 net, or a dtype error in a one-pass
    step). Nothing is copied where the state is already of ``p``'s dtype and device."""
    dtype = p.dtype if p.is_floating_point() else None
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            state[key] = value.to(device=p.device, dtype=dtype)


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
        mu: the current means.
        sigma: the current standard deviations.
        g: expected gradient of ``L`` under ``N(mu, sigma^2)`` (eq. 7).
        h: expected Hessian diagonal of ``L`` (eq. 8), e.g. ``sum_k w_k grad_k x_k / sigma``.
        state: from `init_qnvb_state` or the previous step.
        hp: the hyperparameters.
        weight: multiplies ``L`` in the loss (likelihood weight times annealing factor); finite
            and ``> 0``.
        prior_precision: precision of a zero-mean Gaussian prior added to the loss; finite and
            ``>= 0``.

    Coordinates where ``g`` or ``h`` is not finite, or where the update overflows, keep their
    mean, scale and state.

    Returns:
        `QNVBResult` with the new mean, scale and state.

    Raises:
        TypeError, ValueError: naming the argument, for a tensor of another shape, dtype or
            device than ``mu``, a ``weight`` not finite and ``> 0``, a ``prior_precision`` not
            finite and ``>= 0``, and on the CPU a ``mu`` or ``sigma`` not finite or a ``sigma``
            ``<= 0`` (module docstring, "Inputs").
    """
    _check_state("qnvb_update", state, lambda: "state")
    _check_tensors("qnvb_update", mu, (sigma, g, h, *state), _argument_name)
    _check_dtypes("qnvb_update", mu, (sigma, g, h, *state), _argument_name)
    _check_shared("qnvb_update", hp, weight, prior_precision)
    if _readable(mu):
        _refuse_nonfinite("qnvb_update", [("mu", mu)], [("sigma", sigma)])
    return _reference_update(mu, sigma, g, h, state, hp, weight, prior_precision)


def _reference_update(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    state: QNVBState,
    hp: QNVBHyperparameters,
    weight: float | torch.Tensor,
    prior_precision: float | torch.Tensor,
) -> QNVBResult:
    """`qnvb_update` without its checks of the arguments (the compiled update's, whose
    ``weight`` and ``prior_precision`` are device tensors from checked numbers)."""
    new_mu, new_sigma, new_state, masks = _reference_rules(
        mu, sigma, g, h, state, hp, weight, prior_precision
    )
    return QNVBResult(new_mu, new_sigma, new_state, *(mask.sum() for mask in masks))


def _reference_rules(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    state: QNVBState,
    hp: QNVBHyperparameters,
    weight: float | torch.Tensor,
    prior_precision: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, QNVBState, tuple[torch.Tensor, ...]]:
    """The rules of `qnvb_update` as written there, returning the four boolean masks of
    `COUNT_KINDS` rather than their counts (so that one call on a flat buffer can be
    counted segment by segment, `_segment_counts`)."""
    beta1, beta2 = hp.betas
    finite_input = torch.isfinite(g) & torch.isfinite(h)  # the rest is elementwise: a NaN in g
    # or h spoils its own coordinate only, which the guard at the end leaves unchanged

    # rules 1 and 3: running averages with warm-up, the curvature window
    count = state.count + 1
    g_avg = _average(state.g_avg, g, count.clamp(max=1.0 / (1.0 - beta1)))
    curvature_count = (state.curvature_count + 1).clamp(max=1.0 / (1.0 - beta2))
    if hp.recent_fraction < 1:
        window = torch.maximum(hp.recent_fraction * count, count.clamp(max=2.0))
        curvature_count = torch.minimum(curvature_count, window)
    grad = weight * g + prior_precision * mu
    s_avg = _average(state.s_avg, grad * grad, curvature_count)
    h_avg = _average(state.h_avg, h, curvature_count)
    h2_avg = _average(state.h2_avg, h * h, curvature_count)

    # rule 4: curvature of L, then of the whole loss (unfloored: the mean steps on it)
    if hp.curvature == "rms":
        curv = h2_avg.sqrt()
        significant = torch.ones_like(finite_input)
    else:
        stderr = ((h2_avg - h_avg**2).clamp(min=0) / curvature_count).sqrt()
        significant = h_avg > hp.significance * stderr
        held = ((sigma**-2 - prior_precision) / weight).clamp(min=0)  # q's current precision
        curv = torch.where(significant, h_avg, held)
    total_curv = weight * curv + prior_precision
    wider = significant & (total_curv < hp.sigma_max**-2)  # asks for more than sigma_max

    # rule 6, damping: a sign change of the gradient means the last step overshot
    if hp.damping:
        flipped = grad * state.last_grad < 0
        damping = torch.where(
            flipped, state.damping + 1, (state.damping - hp.damping_recovery).clamp(min=1.0)
        )
    else:
        damping = state.damping

    # rule 7: the quasi-Newton step, capped by an Adam-sized step; rule 8: the carry
    if hp.lr == 0:  # a scheduler's lr = 0: the mean holds (exactly; no 0 / 0 where s = eps = 0)
        step = torch.zeros_like(mu)
    else:
        cap = (s_avg.sqrt() + hp.eps) / hp.lr
        divisor = torch.maximum(total_curv, cap)
        total_grad = weight * g_avg + prior_precision * mu
        step = total_grad / (damping * divisor)
        if _divisor_may_vanish(hp, mu.dtype):  # no curvature, no gradient seen: no step
            step = torch.where(divisor > 0, step, 0.0)
    if hp.trust_region < math.inf:  # the mean moves at most trust_region * sigma
        radius = hp.trust_region * sigma
        step = torch.minimum(torch.maximum(step, -radius), radius)
    new_mu = mu - step
    g_avg = g_avg - curv * step  # carry the averaged gradient to the new mean

    # rules 5, 9 and 10: sigma* = (w H + prior)^(-1/2) with the curvature floored at
    # 1 / sigma_max^2, rate-limited, then bounded
    asked = total_curv.clamp(min=hp.sigma_max**-2).rsqrt()
    target = torch.where(significant, asked, sigma)
    limited = torch.minimum(torch.maximum(target, sigma * hp.scale_min), sigma * hp.scale_max)
    new_sigma = limited.clamp(hp.sigma_min, hp.sigma_max)
    narrower = significant & (asked < hp.sigma_min)  # asks for less than sigma_min

    if hp.drift_forgetting > 0:  # rule 2
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
    unresolved = _still_unresolved(mu, sigma, new_mu, new_sigma)  # rule 12, before the guard
    # rule 11: a non-finite input or an overflow (e.g. of g^2) leaves a coordinate unchanged: no
    # NaN or infinity ever leaves this function. Counted as tensors: no host-device sync here.
    updated = finite_input.clone()
    for value in (new_mu, new_sigma, *new_state):
        updated &= torch.isfinite(value)
    new_mu = torch.where(updated, new_mu, mu)
    new_sigma = torch.where(updated, new_sigma, sigma)
    new_state = QNVBState(*(torch.where(updated, new, old) for new, old in zip(new_state, state)))
    masks = (
        ~finite_input,
        finite_input & ~updated,
        updated & (limited < hp.sigma_min) & narrower,
        updated & ((limited > hp.sigma_max) | wider),
        unresolved,
    )
    return new_mu, new_sigma, new_state, masks


_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
"""The integer dtype whose view of a mean's bits `_unresolved` masks to its exponent."""


def _unresolved(
    mu: torch.Tensor, sigma: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Where ``sigma`` is below the spacing of ``dtype`` (by default the mean's) at ``mu``,
    ``2^e eps`` for ``2^e <= |mu| < 2^(e + 1)`` (``eps``: the machine epsilon): the nodes
    ``mu + sigma x_k`` lie within about one spacing of ``mu``. ``2^e`` is ``|mu|`` with its
    mantissa bits cleared (0 for a zero or subnormal mean, never counted; ``eps |mu|`` would
    overstate the spacing by up to 2 times: bfloat16's at 0.134 is 0.000977, not 0.00105).
    Three passes; rule 12 asks it of the step's input and of its result (`_still_unresolved`);
    `QNVBOptimizer` at an autocast dtype (`resolution_dtype`), whose exponent range holds the
    mean's (float32's and bfloat16's are one; float16's spacing below 2^-14 is understated)."""
    info = torch.finfo(mu.dtype)
    mantissa_bits = -round(math.log2(info.eps))
    exponent_bits = ((1 << (info.bits - 1)) - 1) ^ ((1 << mantissa_bits) - 1)
    as_int = _SAME_WIDTH_INT[mu.dtype]
    power = torch.bitwise_and(mu.view(as_int), exponent_bits).view(mu.dtype)
    return torch.gt(power.mul_(torch.finfo(dtype or mu.dtype).eps), sigma)


def _still_unresolved(
    mu: torch.Tensor, sigma: torch.Tensor, new_mu: torch.Tensor, new_sigma: torch.Tensor
) -> torch.Tensor:
    """Rule 12: the coordinates `_unresolved` before the step and after it (the step did not
    widen ``sigma`` past the dtype's spacing at the mean). Seven passes."""
    return torch.logical_and(_unresolved(mu, sigma), _unresolved(new_mu, new_sigma))


#: the update through ``torch.compile``, made on first use: "per tensor" (`_reference_update`) and
#: "flat" (`_reference_rules` on one flat buffer)
_COMPILED: dict[str, Callable] = {}
#: devices whose compiled update goes tensor by tensor (`_compiled_updates`); elsewhere it
#: goes on one flat buffer
_PER_TENSOR_DEVICES = frozenset({"cpu"})
_SCALARS: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _device_scalars(
    like: torch.Tensor, weight: float, prior_precision: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` and ``prior_precision`` as 0-dim tensors of ``like``'s dtype and device: the
    same cached tensors at every call, filled in place (``fill_`` takes a Python number as a
    kernel argument: no copy from the host)."""
    key = (like.dtype, like.device)
    if key not in _SCALARS:
        _SCALARS[key] = (like.new_zeros(()), like.new_zeros(()))
    weight_t, prior_t = _SCALARS[key]
    return weight_t.fill_(weight), prior_t.fill_(prior_precision)


def _is_number(value: object, number: float) -> bool:
    """Whether ``value`` is the Python number ``number`` (a tensor never is: compiled path)."""
    return isinstance(value, numbers.Real) and value == number


def _flat_update(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    state: QNVBState,
    hp: QNVBHyperparameters,
    weight: float | torch.Tensor,
    prior_precision: float | torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """The rules of `qnvb_update` on flat tensors, with the same operations in the same order
    where they can change a value, and in place on fresh tensors (never on an argument), up to
    the guard (rule 11), which the caller applies (`qnvb_update_many`).

    What it leaves out, each provably without effect on the result:

    - ``x * 1``, ``x / 1`` (a weight or ``lr`` of 1; ``beta1 = 0`` makes the gradient count 1) and
      ``x - 0``: exact in IEEE arithmetic.
    - ``x + 0 * mu`` (no prior): exact but for the sign of a zero gradient, which no later rule
      reads (it is squared, multiplied into a sign test that asks for ``< 0``, or divided into a
      zero step).
    - the standard error at ``significance = 0``: ``h_avg > 0 * stderr`` is ``h_avg > 0`` wherever
      ``stderr`` is finite, and it is not only where ``h2_avg`` is not, which the guard discards.
    - the floor at 0 of the held curvature ``sigma^-2 / weight`` without a prior and with a
      positive weight: it is ``>= 0`` or NaN already, and ``clamp`` keeps both.

    And it fuses, with the same bits: ``avg + (new - avg) / count`` is ``addcdiv(avg, new - avg,
    count)`` (its value 1 multiplies exactly, so the quotient is rounded once and added once, as
    written), and ``minimum(maximum(target, lo), hi)`` is ``clamp(target, lo, hi)`` (the same
    NaN propagation; ``tests/test_user_fixes_s15_update.py`` holds both to the reference).

    Returns:
        The new mean, scale and eight state fields before the guard (rule 11), the rate-limited
        scale before its bounds (rule 10: ``limited``), where the curvature asks for a wider
        scale than ``sigma_max`` (``wider``) and a smaller one than ``sigma_min``
        (``narrower``), from which the caller counts the bounds, and where the dtype does not
        resolve the nodes from the mean, before the step and after (rule 12: ``unresolved``).
    """
    beta1, beta2 = hp.betas
    unit_weight = _is_number(weight, 1.0)
    no_prior = _is_number(prior_precision, 0.0)

    def scaled(x: torch.Tensor) -> torch.Tensor:  # weight * x + prior_precision * mu
        if unit_weight and no_prior:
            return x
        out = x * weight
        if not no_prior:
            out += prior_precision * mu
        return out

    def averaged(avg: torch.Tensor, new: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        out = new - avg if new is g or new is h else new.sub_(avg)  # _average, fused
        return torch.addcdiv(avg, out, count, out=out)

    # rules 1 and 3
    count = state.count + 1
    if beta1 == 0:  # the count is clamped to 1: the average is the newest gradient (rounded)
        g_avg = g - state.g_avg
        g_avg += state.g_avg
    else:
        g_avg = averaged(state.g_avg, g, count.clamp(max=1.0 / (1.0 - beta1)))
    curvature_count = state.curvature_count + 1
    curvature_count.clamp_(max=1.0 / (1.0 - beta2))
    if hp.recent_fraction < 1:
        window = torch.maximum(hp.recent_fraction * count, count.clamp(max=2.0))
        curvature_count = torch.minimum(curvature_count, window)
    grad = scaled(g)
    s_avg = averaged(state.s_avg, grad * grad, curvature_count)
    h_avg = averaged(state.h_avg, h, curvature_count)
    h2_avg = averaged(state.h2_avg, h * h, curvature_count)

    # rule 4
    if hp.curvature == "rms":
        curv = h2_avg.sqrt()
        significant = None
    else:
        if hp.significance > 0:
            stderr = ((h2_avg - h_avg**2).clamp(min=0) / curvature_count).sqrt()
            significant = h_avg > hp.significance * stderr
        else:
            significant = h_avg > 0
        held = sigma**-2
        if not no_prior:
            held -= prior_precision
        if not unit_weight:
            held /= weight
        if not (no_prior and isinstance(weight, numbers.Real) and weight > 0):
            held.clamp_(min=0)
        curv = torch.where(significant, h_avg, held)
        del held
    total_curv = curv if unit_weight else curv * weight
    total_curv = total_curv + prior_precision if not no_prior else total_curv
    wider = total_curv < hp.sigma_max**-2
    if significant is not None:
        wider &= significant

    # rule 6
    if hp.damping:
        flipped = grad * state.last_grad
        flipped = flipped < 0
        recovered = state.damping - hp.damping_recovery
        damping = torch.where(flipped, state.damping + 1, recovered.clamp_(min=1.0))
        del flipped, recovered
    else:
        damping = state.damping

    # rules 7 and 8
    if hp.lr == 0:
        step = torch.zeros_like(mu)
    else:
        cap = s_avg.sqrt()
        cap += hp.eps
        if hp.lr != 1:
            cap /= hp.lr
        divisor = torch.maximum(total_curv, cap, out=cap)
        divisor *= damping
        step = scaled(g_avg)
        step = step / divisor if step is g_avg else step.div_(divisor)
        if _divisor_may_vanish(hp, mu.dtype):
            step = torch.where(divisor > 0, step, 0.0)
        del divisor, cap  # temporaries go as soon as they are used: chunks are a cache's size
    if hp.trust_region < math.inf:
        radius = hp.trust_region * sigma
        step = torch.clamp(step, -radius, radius)
        del radius
    new_mu = mu - step
    carried = curv * step
    g_avg = torch.sub(g_avg, carried, out=carried)

    # rules 5, 9 and 10
    target = total_curv.clamp(min=hp.sigma_max**-2)
    del total_curv, curv
    target.rsqrt_()
    narrower = target < hp.sigma_min  # the curvature asks for less than sigma_min
    if significant is not None:
        narrower &= significant
        target = torch.where(significant, target, sigma, out=target)
    limited = torch.clamp(target, sigma * hp.scale_min, sigma * hp.scale_max, out=target)
    new_sigma = limited.clamp(hp.sigma_min, hp.sigma_max)

    if hp.drift_forgetting > 0:  # rule 2
        travelled = step.abs()
        travelled /= damping * sigma
        if hp.drift_forgetting == 1:
            travelled.neg_()
        else:
            travelled *= -hp.drift_forgetting
        curvature_count = curvature_count * travelled.exp_()
        del travelled

    news = (new_mu, new_sigma, g_avg, s_avg, h_avg, h2_avg, count, curvature_count, grad, damping)
    return news, limited, wider, narrower, _still_unresolved(mu, sigma, new_mu, new_sigma)


def _add_to_probe(probe: torch.Tensor, values) -> torch.Tensor:
    """``probe + sum(value * 0)``, in place: it stays 0 where every value is finite and becomes NaN
    elsewhere (``x * 0`` is NaN for an infinite or NaN ``x``): one pass per value where
    ``isfinite`` takes four kernels on the CPU."""
    zero = torch.zeros((), dtype=probe.dtype, device=probe.device)
    for value in values:
        probe.addcmul_(value, zero)
    return probe


#: the results of `_flat_update` whose finiteness the guard (rule 11) reads, by position in its
#: ``news`` (mean, scale, g_avg, s_avg, h_avg, h2_avg, count, curvature_count, last_grad,
#: damping): every one but ``last_grad``, the total gradient, which is not finite only where
#: ``s_avg``, its running mean square, is not either
_PROBED = (0, 1, 2, 3, 4, 5, 6, 7, 9)


def _all_finite(news: tuple[torch.Tensor, ...], limited: torch.Tensor) -> bool:
    """Whether every coordinate of ``g``, ``h`` and the results ``news`` of a chunk is finite, or
    ``False`` (rule 11's fast test, on the CPU, where reading a value back costs no sync): the sum
    of the probed results is finite. A sum is not finite where one of its terms is not (NaN and
    infinities never cancel to a number), and ``g`` and ``h`` are not finite only where ``s_avg``
    and ``h2_avg``, their running mean squares, are not either; a sum of finite values that
    overflows answers ``False`` too, and the caller then finds the coordinates one by one.

    The new scale is summed as ``limited``, the scale before its bounds, from which it is
    clamped: finite where ``limited`` is, and ``limited`` is not finite only where the new scale
    is NaN or the input scale is not finite (an infinite one, clamped to ``sigma_max``, would
    pass the test unseen; the caller then refuses it). ``limited`` is ``<= 0`` exactly where the
    input scale is (the rate limit clamps it between ``sigma * scale_min`` and
    ``sigma * scale_max``): its least value, read in the same copy, answers ``False`` too, so that
    the caller refuses a scale ``<= 0`` which the bounds would raise to ``sigma_min`` unseen."""
    if not limited.numel():  # no coordinates (empty tensors): nothing to test, no least value
        return True
    sums = [news[i].sum() if i != 1 else limited.sum() for i in _PROBED]
    total, least = torch.stack([torch.stack(sums).sum(), limited.amin()]).tolist()
    return math.isfinite(total) and least > 0


def _refuse_nonfinite_means(
    mus: list[torch.Tensor], sigmas: list[torch.Tensor], chunk: list[torch.Tensor]
) -> None:
    """`_refuse_nonfinite` of every mean and scale of `qnvb_update_many` if the mean or the scale
    of a chunk (``chunk``: the two) is not finite, or the scale not ``> 0``: read only in a chunk
    whose guard acts or whose scale is not ``> 0`` (`_all_finite`)."""
    if not (all(bool(torch.isfinite(t).all()) for t in chunk) and bool((chunk[1] > 0).all())):
        _refuse_nonfinite(
            "qnvb_update_many",
            [(f"mus[{i}]", m) for i, m in enumerate(mus)],
            [(f"sigmas[{i}]", s) for i, s in enumerate(sigmas)],
        )


def _segment_counts(masks: tuple[torch.Tensor, ...], sizes: list[int]) -> torch.Tensor:
    """The counts of the masks in each segment of ``sizes``, ``(segments, len(masks))``."""
    # summing bytes into int32 skips the int64 copy a boolean sum makes (5x faster on the CPU)
    dtype = torch.int32 if sum(sizes) < 2**31 else torch.int64
    pieces = torch.stack(masks).view(torch.uint8).split(sizes, dim=1)
    return torch.stack([piece.sum(1, dtype=dtype) for piece in pieces]).long()


def _chunk_counts(
    hp: QNVBHyperparameters,
    limited: torch.Tensor,
    wider: torch.Tensor,
    narrower: torch.Tensor,
    unresolved: torch.Tensor,
    sizes: list[int],
    probes: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The `COUNT_KINDS` of a chunk, per segment of ``sizes``, ``(segments, 5)``, from
    `_flat_update`'s ``limited``, ``wider``, ``narrower`` and ``unresolved`` and, where the
    guard kept a coordinate, its ``probes`` (of ``g`` and ``h``, and of them and the results);
    ``None``: it kept none (the first two kinds are then 0, and every coordinate was updated). A
    sigma raised to ``sigma_min`` whose curvature asks for more (one started below it, raised by
    the rate limit alone) is not pinned by the curvature: not counted."""
    pinned = (
        (limited < hp.sigma_min).logical_and_(narrower),
        (limited > hp.sigma_max).logical_or_(wider),
    )
    if probes is None:
        return torch.nn.functional.pad(_segment_counts((*pinned, unresolved), sizes), (2, 0))
    finite_input, updated = (probe == 0 for probe in probes)
    masks = (
        ~finite_input,
        finite_input & ~updated,
        pinned[0].logical_and_(updated),
        pinned[1].logical_and_(updated),
        unresolved,
    )
    return _segment_counts(masks, sizes)


def consecutive_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat tensor the ``tensors`` are consecutive contiguous pieces of (one storage, in
    order, no gaps), or ``None``."""
    first = tensors[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    total = offset - first.storage_offset()
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,))


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one flat tensor: without a copy when they are consecutive pieces of one
    storage (as the results of the previous `qnvb_update_many` are), else a ``cat``."""
    base = _flat_view(tensors)
    return torch.cat([t.reshape(-1) for t in tensors]) if base is None else base


#: what `qnvb_update_many` may be given to write its results over (``donate``)
DONATABLE = ("mu", "sigma", "state")


class _Vouched(tuple):
    """A ``donate`` of `qnvb_update_many` whose tensors the caller vouches share no memory with
    any other argument (an optimizer's own results of its previous step, written over in
    place): `_check_donate` checks the names and the contiguity but does not scan every
    argument's memory (6% of a one-pass step of a 1-50-1 net)."""


@torch.no_grad()
def qnvb_update_many(
    mus: list[torch.Tensor],
    sigmas: list[torch.Tensor],
    gs: list[torch.Tensor],
    hs: list[torch.Tensor],
    states: list[QNVBState],
    hp: QNVBHyperparameters,
    weight: float = 1.0,
    prior_precision: float = 0.0,
    *,
    compile: bool = False,
    donate: tuple[str, ...] = (),
) -> list[QNVBResult]:
    """`qnvb_update` of several tensors at once, on one flat buffer (rasp paper, eq. 4-8).

    Args:
        mus: per tensor, ``mu`` as for `qnvb_update` (one dtype and device throughout,
            as for every list here).
        sigmas: per tensor, ``sigma``.
        gs: per tensor, ``g``.
        hs: per tensor, ``h``.
        states: per tensor, ``state``.
        hp: shared by all the tensors, as for `qnvb_update`.
        weight: shared, as for `qnvb_update`.
        prior_precision: shared, as for `qnvb_update`.
        compile: run the reference rules through ``torch.compile``: on the CPU tensor by tensor
            (a fused C++ loop each, several times faster than the eager flat update on large
            tensors; needs a C++ compiler), on any other device on one flat buffer (fused kernels
            for all the tensors at once: per tensor, each call's overhead made it slower than the
            eager flat update on an H100). It compiles on first use (seconds to a minute), once
            more for new hyperparameters or a new total size. Results equal the reference's to
            within rounding (a fused ``exp`` or ``rsqrt`` may differ in the last bit).
        donate: the arguments, of `DONATABLE` (``"mu"``: ``mus``, ``"sigma"``: ``sigmas``,
            ``"state"``: ``states``), that the caller gives up: the update writes their results
            over them, each chunk of coordinates once it has read it, and returns them (the
            result's ``mu`` is then ``mus[i]``, and so on). Its memory is then a chunk's scratch
            and the results of the arguments not donated; the values are the same bits. A
            donated tensor must share no memory with any other argument (a ``ValueError``
            otherwise). The default, ``()``, is pure: no argument is written, and the results
            are new tensors.

    Returns:
        One `QNVBResult` per tensor, its counts those of its own coordinates; its fields views
        into one new flat buffer per field, or the donated arguments. Equal, value for value, to
        `qnvb_update` of each tensor.

    Raises:
        TypeError, ValueError: as `qnvb_update`, naming the list and position (``gs[2]``); a
            ``mu`` or ``sigma`` not finite, or a ``sigma <= 0``, on the CPU and without
            ``donate`` (module docstring, "Inputs": in place the guard keeps it, as before);
            means of several dtypes or devices.
    """
    lengths = {len(mus), len(sigmas), len(gs), len(hs), len(states)}
    if len(lengths) != 1:
        raise ValueError(
            "qnvb_update_many needs as many sigmas, gs, hs and states as mus, got lists of "
            f"lengths {sorted(lengths)}"
        )
    for i, (mu, sigma, g, h, state) in enumerate(zip(mus, sigmas, gs, hs, states)):
        _check_state("qnvb_update_many", state, lambda i=i: f"states[{i}]")
        name = functools.partial(_argument_name, position=f"[{i}]")
        _check_tensors("qnvb_update_many", mu, (sigma, g, h, *state), name)
        _check_dtypes("qnvb_update_many", mu, (sigma, g, h, *state), name)
        if mu.dtype != mus[0].dtype or mu.device != mus[0].device:
            raise TypeError(
                f"qnvb_update_many: mus[{i}] has dtype {mu.dtype} on {mu.device}, mus[0] "
                f"{mus[0].dtype} on {mus[0].device}: the tensors updated together are laid end "
                "to end in one buffer, of one dtype on one device; call it once per dtype and "
                "device"
            )
    _check_shared("qnvb_update_many", hp, weight, prior_precision)
    donated = _check_donate(donate, mus, sigmas, gs, hs, states)
    if not mus:
        return []
    if compile:
        compiled = _compiled_flat_update if mus[0].device.type not in _PER_TENSOR_DEVICES else None
        results = (compiled or _compiled_updates)(
            mus, sigmas, gs, hs, states, hp, weight, prior_precision
        )
        return _into_donated(results, mus, sigmas, states, donated) if donated else results
    sizes = [m.numel() for m in mus]
    total = sum(sizes)
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    on_cpu = mus[0].device.type == "cpu"
    # off the CPU each chunk is some hundred kernel launches, and a GPU's step is bound by
    # them already (docs/benchmarks.md, "On an H100 GPU"): chunks there are larger
    chunk = _CHUNK if on_cpu else _DEVICE_CHUNK
    chunks = _chunk_pieces(offsets, sizes, total, chunk)
    inputs = (mus, sigmas, gs, hs, *zip(*states))
    # per field, the one flat view of its tensors where there is one: read, and written where
    # donated (a donated tensor is contiguous, so its view is its memory)
    bases = [_flat_view(list(field)) for field in inputs]
    readers = [_chunk_reader(list(field), offsets, base) for field, base in zip(inputs, bases)]
    # per result (mean, scale, eight state fields): the donated argument, or a new buffer
    fields = (0, 1, *range(4, 12))
    targets = [inputs[i] if donated[i] else None for i in fields]
    writers = [
        None if t is None else _chunk_writer(list(t), offsets, bases[i])
        for i, t in zip(fields, targets)
    ]
    outs: list[torch.Tensor | None] = [None] * len(targets)
    rows: list[list[torch.Tensor]] = [[] for _ in mus]  # per tensor, its counts in each chunk
    kept_flags = []
    for index, pieces in enumerate(chunks):
        start, stop = index * chunk, min((index + 1) * chunk, total)
        olds = [read(start, stop, pieces) for read in readers]
        news, limited, wider, narrower, unresolved = _flat_update(
            *olds[:4], QNVBState(*olds[4:]), hp, weight, prior_precision
        )
        g, h, olds = olds[2], olds[3], olds[:2] + olds[4:]  # olds: those of the results
        # rule 11: on the CPU a value read back costs nothing, and a chunk whose every
        # coordinate is finite (nearly all of them) skips the guard's selections and masks
        probes = None
        if not (on_cpu and _all_finite(news, limited)):
            if on_cpu and not any(donated):  # nothing written over the arguments yet
                _refuse_nonfinite_means(mus, sigmas, olds[:2])
            probes = _probes(g, h, news)
            if on_cpu or any(donated):  # the old values are not kept past this chunk
                updated = probes[1] == 0
                news = [torch.where(updated, new, old) for new, old in zip(news, olds)]
            else:  # one host sync for the call: the chunks where the guard keeps a coordinate
                kept_flags.append(probes[1].sum() == 0)
        for i, new in enumerate(news):
            if writers[i] is not None:
                writers[i](start, stop, pieces, new)
            else:
                if outs[i] is None:  # the results' types are the rules'
                    outs[i] = new.new_empty(total)
                outs[i][start:stop].copy_(new)
        del news, olds, g, h
        sizes_in_chunk = [b - a for _, a, b in pieces]
        counts = _chunk_counts(hp, limited, wider, narrower, unresolved, sizes_in_chunk, probes)
        for (i, _, _), row in zip(pieces, counts):
            rows[i].append(row)
    if kept_flags:
        for index, (pieces, kept) in enumerate(zip(chunks, torch.stack(kept_flags).tolist())):
            if not kept:
                start, stop = index * chunk, min((index + 1) * chunk, total)
                _guard([out[start:stop] for out in outs], readers, start, stop, pieces)
    results = []
    for i, (shape_of, offset, size) in enumerate(zip(mus, offsets, sizes)):
        mu_i, sigma_i, *state_i = (
            out[offset : offset + size].view(shape_of.shape) if target is None else target[i]
            for out, target in zip(outs, targets)
        )
        counts = rows[i][0] if len(rows[i]) == 1 else torch.stack(rows[i]).sum(0)
        results.append(QNVBResult(mu_i, sigma_i, QNVBState(*state_i), *counts))
    return results


def _probes(
    g: torch.Tensor, h: torch.Tensor, news: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 11's probes of a chunk: 0 where ``g`` and ``h`` are finite and NaN elsewhere, and 0
    where they and the results ``news`` are (`_add_to_probe`; ``last_grad`` as in `_PROBED`)."""
    input_probe = _add_to_probe(g * 0, [h])
    return input_probe, _add_to_probe(input_probe.clone(), [news[i] for i in _PROBED])


def _check_donate(donate, mus, sigmas, gs, hs, states) -> tuple[bool, ...]:
    """Per input field (mean, scale, g, h, eight state fields) whether it is donated; a
    ``ValueError`` for a name not in `DONATABLE`, a donated tensor that is not contiguous (its
    results could not be written through a flat view), or one sharing memory with another
    argument (its results would be written over what is still to be read), unless the caller
    vouches for that (`_Vouched`)."""
    if isinstance(donate, str) or not all(name in DONATABLE for name in donate):
        raise ValueError(
            f"qnvb_update_many: donate must be a tuple of names from {DONATABLE}, got {donate!r}"
        )
    donated = ("mu" in donate, "sigma" in donate, False, False, *(("state" in donate,) * 8))
    if not any(donated):
        return donated
    names = ("mus", "sigmas", "gs", "hs", *(f"states[{{}}].{f}" for f in QNVBState._fields))
    fields = (mus, sigmas, gs, hs, *zip(*states))

    def name(field: int, position: int) -> str:
        label = names[field]
        return label.format(position) if "{}" in label else f"{label}[{position}]"

    spans, scan = [], not isinstance(donate, _Vouched)
    for field, tensors in enumerate(fields):
        for position, t in enumerate(tensors):
            if donated[field] and not t.is_contiguous():
                raise ValueError(
                    f"qnvb_update_many: the donated {name(field, position)} is not contiguous; "
                    "pass a contiguous tensor (.contiguous()), or donate nothing"
                )
            if scan and t.numel() and t.device.type != "meta":  # a meta one has no memory
                spans.append((t.untyped_storage().data_ptr(), *_span(t), field, position))
    # sorted by storage and start, an interval meets an earlier one exactly when it starts
    # before the furthest end so far: of any earlier one if it is donated, else of a donated one
    spans.sort()
    reach: dict[bool, tuple] = {}
    for span in spans:
        storage, first, _, field, position = span
        for donated_only in (True, False):
            if donated_only or donated[field]:
                seen = reach.get(donated_only)
                if seen is not None and seen[0] == storage and first < seen[2]:
                    raise ValueError(
                        f"qnvb_update_many: {name(*seen[3:])} and {name(field, position)} share "
                        "memory, and one of them is donated: its results would be written over "
                        "what is still to be read. Pass a clone, or donate nothing"
                    )
        for donated_only in (True, False):
            if not donated_only or donated[field]:
                seen = reach.get(donated_only)
                if seen is None or seen[0] != storage or seen[2] < span[2]:
                    reach[donated_only] = span
    return donated


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that the contiguous or strided ``t`` reaches, ``[first, end)``."""
    first = t.storage_offset()
    last = first + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return first * t.element_size(), (last + 1) * t.element_size()


def _chunk_writer(
    tensors: list[torch.Tensor], offsets: list[int], base: torch.Tensor | None
) -> Callable[[int, int, list[tuple[int, int, int]], torch.Tensor], None]:
    """The writing counterpart of `_chunk_reader`: a function that writes a chunk's values (its
    coordinates ``start:stop``, laid end to end) into the contiguous ``tensors``, through their
    flat view ``base`` (`_flat_view`) where they have one, else piece by piece."""
    if base is not None:
        return lambda start, stop, pieces, value: base[start:stop].copy_(value)
    flats = [t.view(-1) for t in tensors]

    def write(start: int, stop: int, pieces: list[tuple[int, int, int]], value) -> None:
        at = 0
        for i, lo, hi in pieces:
            flats[i][lo:hi].copy_(value[at : at + hi - lo])
            at += hi - lo

    return write


def _into_donated(
    results: list[QNVBResult], mus, sigmas, states, donated: tuple[bool, ...]
) -> list[QNVBResult]:
    """``results`` (of the compiled update, new tensors) copied into the donated arguments,
    which become the results (`qnvb_update_many`'s ``donate``)."""
    flags = donated[:2] + donated[4:]
    written = []
    for result, mu, sigma, state in zip(results, mus, sigmas, states):
        fields = []
        for keep, new, old in zip(
            flags, (result.mu, result.sigma, *result.state), (mu, sigma, *state)
        ):
            fields.append(old.copy_(new) if keep else new)
        written.append(QNVBResult(fields[0], fields[1], QNVBState(*fields[2:]), *result[3:]))
    return written


#: the most coordinates the eager `qnvb_update_many` runs the rules on at once: its scratch
#: (some 20 floats a coordinate) is that of a chunk, not of every tensor. A multiple of 64: each
#: coordinate keeps its place modulo a vector's width, as on one flat buffer, so that a kernel
#: rounding a vector's partial tail its own way rounds the same coordinates (results do not
#: depend on the chunk size). Chosen by measurement (``docs/benchmarks.md``, "The update's
#: scratch memory").
_CHUNK = 2**16
#: the same off the CPU (a multiple of `_CHUNK`): a network of up to 4 M weights in one chunk,
#: as before chunks, and about 20 x 16 MiB of scratch in float32 above that
_DEVICE_CHUNK = 2**22


def _guard(
    news: list[torch.Tensor], readers: list[Callable], start: int, stop: int, pieces
) -> None:
    """Rule 11 on a chunk whose results ``news`` (mean, scale, state) `_flat_update`
    wrote unguarded: where an input ``g`` or ``h`` or a result is not finite, the old value
    (from ``readers``, `_chunk_reader`) is put back, in place."""
    mu, sigma, g, h, *state = (read(start, stop, pieces) for read in readers)
    updated = _add_to_probe(g * 0, (h, *news)) == 0  # the probe of _flat_update
    for new, old in zip(news, (mu, sigma, *state)):
        torch.where(updated, new, old, out=new)


def _chunk_pieces(
    offsets: list[int], sizes: list[int], total: int, length: int
) -> list[list[tuple[int, int, int]]]:
    """Per chunk of ``length`` coordinates of tensors of ``sizes`` laid end to end (from
    ``offsets``), the pieces of tensors it holds: ``(tensor, start, stop)`` within the tensor,
    in order. Every tensor has a piece (an empty tensor an empty one), one with no coordinates in
    a chunk none there; no tensors at all (``total = 0``) make one empty chunk."""
    chunks: list[list[tuple[int, int, int]]] = [[] for _ in range(max(1, -(-total // length)))]
    for i, (offset, size) in enumerate(zip(offsets, sizes)):
        chunk, start = min(offset // length, len(chunks) - 1), offset
        while True:
            stop = min(offset + size, (chunk + 1) * length)
            chunks[chunk].append((i, start - offset, stop - offset))
            if stop == offset + size:
                break
            chunk, start = chunk + 1, stop
    return chunks


def _flat_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``tensors`` as one flat tensor: one tensor reshaped (a view where it is contiguous,
    as a donated one is; else a copy, which only reading may take), consecutive pieces of one
    storage (`consecutive_base`; as the results of `qnvb_update_many` are) viewed whole, else
    ``None``."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return consecutive_base(tensors)


def _chunk_reader(
    tensors: list[torch.Tensor], offsets: list[int], base: torch.Tensor | None
) -> Callable[[int, int, list[tuple[int, int, int]]], torch.Tensor]:
    """A function of a chunk (``start``, ``stop`` and its pieces, `_chunk_pieces`) giving
    the ``tensors``' coordinates ``start:stop`` as one flat tensor: a view of ``base`` (their
    `_flat_view`) where they have one or where the chunk lies in one tensor, else a ``cat`` of
    the pieces (a chunk's size)."""
    if base is not None:
        return lambda start, stop, pieces: base[start:stop]
    flats = [t.reshape(-1) for t in tensors]

    def read(start: int, stop: int, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        views = [flats[i][lo:hi] for i, lo, hi in pieces if hi > lo]
        if len(views) == 1:
            return views[0]
        return torch.cat(views) if views else flats[pieces[0][0]][:0]

    return read


def _compiled_flat_update(mus, sigmas, gs, hs, states, hp, weight, prior_precision):
    """`_reference_rules` through ``torch.compile`` on one flat buffer of every tensor: the
    compiled update off the CPU (fused kernels, whose temporaries are a kernel's registers)."""
    if "flat" not in _COMPILED:
        _COMPILED["flat"] = torch.compile(_reference_rules)
    weight, prior_precision = _device_scalars(mus[0], weight, prior_precision)
    sizes = tuple(m.numel() for m in mus)
    flat_state = QNVBState(*(_flatten(list(field)) for field in zip(*states)))
    args = (_flatten(mus), _flatten(sigmas), _flatten(gs), _flatten(hs), flat_state, hp)
    mu, sigma, state, masks = _COMPILED["flat"](*args, weight, prior_precision)
    counts = _segment_counts(masks, sizes)
    pieces = [t.split(sizes) for t in (mu, sigma, *state)]
    results = []
    for i, shape_of in enumerate(mus):
        mu_i, sigma_i, *state_i = (piece[i].view(shape_of.shape) for piece in pieces)
        results.append(QNVBResult(mu_i, sigma_i, QNVBState(*state_i), *counts[i]))
    return results


def _compiled_updates(mus, sigmas, gs, hs, states, hp, weight, prior_precision):
    """`qnvb_update` through ``torch.compile``, tensor by tensor (flattened, so that sizes
    alone differ and one dynamic-shape compile serves them all): the CPU's compiled update. Per
    tensor rather than on a flat buffer: the counts are then sums inside the fused loop, where
    per-segment boolean masks as outputs made the compiled update four times slower on the CPU."""
    if "per tensor" not in _COMPILED:
        _COMPILED["per tensor"] = torch.compile(_reference_update)
    # the weight as a tensor: a new annealing factor needs no recompile; kept on the device and
    # filled in place, a kernel argument rather than a copy from the host at every step
    weight, prior_precision = _device_scalars(mus[0], weight, prior_precision)
    results = []
    for mu, sigma, g, h, state in zip(mus, sigmas, gs, hs, states):
        flat = QNVBState(*(t.reshape(-1) for t in state))
        result = _COMPILED["per tensor"](
            mu.reshape(-1),
            sigma.reshape(-1),
            g.reshape(-1),
            h.reshape(-1),
            flat,
            hp,
            weight,
            prior_precision,
        )
        shape = mu.shape
        results.append(
            QNVBResult(
                result.mu.view(shape),
                result.sigma.view(shape),
                QNVBState(*(t.view(shape) for t in result.state)),
                *result[3:],
            )
        )
    return results
