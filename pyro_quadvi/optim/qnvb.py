"""``QNVB``: the quasi-Newton variational Bayes optimizer as a Pyro ``PyroOptim``.

``SVI(model, guide, QNVB(), loss)`` updates each block of a mean-field guide jointly, as a fixed
point of the mean-field problem (rasp paper, eq. 4-8): for a ``"gaussian"`` block the mean moves by
a quasi-Newton step ``g / h`` and the scale becomes ``h^(-1/2)``, where ``g`` and ``h`` are the
expected gradient and Hessian diagonal of the negative log joint.

**Which parameters.** A guide describes itself (`describe_guide`): per
block its family and the leaf tensors of its parameters by role. QNVB pairs the tensors ``SVI``
hands it with those leaves by identity, never by name, so it pairs under
``pyro.settings.set(module_local_params=True)`` as well. It knows a guide because the guide ran
(every AutoGuide is seen when it runs once a ``QNVB`` exists), because ``QuadratureELBO``
published its moments, or because it was registered (`register_guide`).
Each block goes to the update of its family (`FAMILY_UPDATES`); everything else (a model's
``pyro.param``, a ``pyro.module`` network's weights, a guide that is not a mean field) goes to
the fallback optimizer, with one warning per guide that cannot be paired and one when nothing is
paired.

**Which moments.** ``QuadratureELBO`` publishes ``g`` and ``h`` per block, minibatch scale removed
(`published_moments`); QNVB uses them when present and the gradients it is handed are those of
the loss that published them, or of that loss times one number, which it divides out
(`QNVB._agreed_moments`); else it warns and reads the block from the gradients. Otherwise
(Pyro's own ELBOs) it recovers them from the gradients of a Gaussian block's parameters: for a loss
``-E_q[log p(x, z)] - entropy(q)`` with ``z = mu + sigma * x``

    dL/dmu = E[dU/dz] = g,      dL/dsigma = E[dU/dz * x] - 1/sigma = sigma h - 1/sigma,

with ``U = -log p``, so ``h = (dL/dsigma + 1/sigma) / sigma`` (exact for ``QuadratureELBO``, in
expectation for ``Trace_ELBO`` and ``TraceMeanField_ELBO``); ``dL/dsigma`` comes from the scale
leaf's gradient through its constraint's transform. A block in a subsampled plate carries the
minibatch scale ``s`` in both: QNVB divides it out and updates only the rows of the minibatch.
Where a guide cannot tell its rows (Pyro's ``AutoNormal`` under Pyro's ELBOs) entries whose loc
and scale gradients are both exactly zero are left unchanged.

**No NaN reaches a parameter.** Coordinates with non-finite moments keep their values (in the
update); so do the fallback's coordinates whose gradient or new value is not finite. Each kind is
reported once, naming the parameter. The third step in a row in which no coordinate of any block
could be updated is refused with a ``ValueError`` (one bad minibatch passes with the warning; a
cause that stays would keep every later step a no-op).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields, replace

import numpy
import pyro
import torch
from pyro.infer.autoguide import AutoDelta
from pyro.infer.util import zero_grads
from pyro.optim import PyroOptim
from pyro.optim.lr_scheduler import PyroLRScheduler
from pyro.params.param_store import (
    module_from_param_with_module_name,
    normalize_param_name,
    user_param_name,
)
from pyro.poutine.messenger import unwrap
from torch.distributions import transform_to
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.weak import WeakIdKeyDictionary

from ..guides.interface import (
    GuideDescription,
    MeanFieldSite,
    PublishedMoments,
    describe_live_guides,
    guide_class_name,
    live_guides,
    published_moments,
    undescribed_guides,
    watch_guides,
)
from ..guides.mean_field import RunStamp, last_run_stamp
from ..infer.batched import user_stacklevel
from ..infer.quadrature_elbo import inference_parameters_refusal, step_without_grad_refusal
from ..store import detached_parameters, listed_names, pyro_parameter_names
from .annealing import anneal_likelihood, annealing_factor, check_schedule
from .qnvb_functional import (
    COUNT_KINDS,
    IDLE_STEPS_REFUSED,
    QNVB_IDLE,
    QNVBHyperparameters,
    QNVBResult,
    QNVBState,
    _flatten,
    _Vouched,
    cast_state_to,
    check_settings,
    consecutive_base,
    count_idle_step,
    count_messages,
    count_table,
    idle_step_refusal,
    init_qnvb_state,
    kept_coordinates,
    qnvb_update,
    qnvb_update_many,
    result_counts,
)
from .torch_qnvb import check_precision, check_representable

__all__ = [
    "FAMILY_UPDATES",
    "GRADIENT_IDENTITIES",
    "IDLE_STEPS_REFUSED",
    "QNVB",
    "GradientIdentity",
    "QNVBBlock",
    "masked_site_refusal",
    "minibatch_refusal",
    "outside_rows_refusal",
    "stale_rows_refusal",
]

_DEFAULT_FALLBACK = (torch.optim.Adam, {"lr": 1e-2})
_HP_NAMES = tuple(f.name for f in fields(QNVBHyperparameters))


def _gaussian_update(
    values: dict[str, torch.Tensor],
    g: torch.Tensor,
    h: torch.Tensor,
    state: QNVBState,
    hp: QNVBHyperparameters,
) -> tuple[dict[str, torch.Tensor], QNVBResult]:
    """The ``"gaussian"`` family: ``(loc, scale)`` by `qnvb_update` (rasp paper, eq. 4-8)."""
    result = qnvb_update(values["loc"], values["scale"], g, h, state, hp)
    return {"loc": result.mu, "scale": result.sigma}, result


FAMILY_UPDATES: dict[str, Callable] = {"gaussian": _gaussian_update}
"""family -> pure update ``(values by role, g, h, state, hyperparameters) -> (values, result)``."""


def _gaussian_update_many(
    values: list[dict[str, torch.Tensor]],
    gs: list[torch.Tensor],
    hs: list[torch.Tensor],
    states: list[QNVBState],
    hp: QNVBHyperparameters,
    compile: bool,
) -> list[tuple[dict[str, torch.Tensor], QNVBResult]]:
    """`_gaussian_update` of several blocks on one flat buffer (`qnvb_update_many`), the results
    of each block's loc and state written over them (``donate``): the loc is the parameter's
    memory (or the minibatch rows' copy) and the state QNVB's own, both written with the results
    anyway; the scale is a transform of the parameter that the write-back compares the new one
    with (`_finish_together`), so its results are new. A loc or state that is not contiguous (a
    parameter a user set to a transposed tensor, and the state made like it) cannot take its
    results through a flat view: that field is not donated, and the write-back copies.

    The state is QNVB's own (`set_state` clones what it restores) and the scales, ``gs`` and
    ``hs`` are new tensors of this step, so only two locs can share memory (parameters a user
    set to one tensor): the update scans every argument's memory only where two locs share a
    storage (`_Vouched` otherwise)."""
    locs = [v["loc"] for v in values]
    donate = tuple(
        name
        for name, tensors in (("mu", locs), ("state", [t for s in states for t in s]))
        if all(t.is_contiguous() for t in tensors)
    )
    if len({loc.untyped_storage().data_ptr() for loc in locs}) == len(locs):
        donate = _Vouched(donate)
    results = qnvb_update_many(
        locs,
        [v["scale"] for v in values],
        gs,
        hs,
        states,
        hp,
        compile=compile,
        donate=donate,
    )
    return [({"loc": r.mu, "scale": r.sigma}, r) for r in results]


_FAMILY_BATCH_UPDATES: dict[str, Callable] = {"gaussian": _gaussian_update_many}
"""family -> the update of `FAMILY_UPDATES` for a list of blocks sharing hyperparameters,
``(values list, gs, hs, states, hyperparameters, compile) -> [(values, result)]``; a family
without one is updated block by block."""


@dataclass
class _Prepared:
    """A block ready for its family's update, and what writing the result back needs."""

    site: MeanFieldSite
    values: dict[str, torch.Tensor]
    g: torch.Tensor
    h: torch.Tensor
    old: QNVBState
    hp: QNVBHyperparameters
    state: dict[str, torch.Tensor]
    index: tuple | None
    published: bool = False  # g and h are the moments QuadratureELBO published


def _scale_gradient(
    site: MeanFieldSite, values: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> torch.Tensor:
    """``dL/dsigma / s`` of a ``"gaussian"`` block: the gradient of its unconstrained scale
    through the constraint's transform, the minibatch scale ``s`` taken out."""
    transform = transform_to(site.param_constraints["scale"])
    dsigma_du = transform.log_abs_det_jacobian(values["scale_leaf"], values["scale"]).exp()
    s = site.scale_factor
    return grads["scale"] / dsigma_du if s == 1.0 else grads["scale"] / dsigma_du / s


def _gaussian_identity(
    site: MeanFieldSite, values: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` and ``h`` (rasp paper, eq. 7 and 8) of a ``"gaussian"`` block from the gradients of
    its loc and unconstrained scale: ``g = dL/dmu / s``, ``h = (dL/dsigma / s + 1/sigma) / sigma``
    with ``s`` the minibatch scale (module docstring)."""
    sigma = values["scale"]
    g = grads["loc"] / site.scale_factor
    h = (_scale_gradient(site, values, grads) + 1.0 / sigma) / sigma
    return g, h


CHECKED_COORDINATES = 64
"""The most coordinates of a block at which QNVB checks its published moments against its
gradients (`QNVB._agreed_moments`): all of a block that has no more, else that many spread evenly
over it, the same at every step (`_checked`)."""


def _checked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A block's tensors of one number of coordinates at its checked coordinates, one a row: all
    of them where there are at most `CHECKED_COORDINATES`, else every ``k``-th of the first
    ``k CHECKED_COORDINATES`` of each flat view, ``k = numel // CHECKED_COORDINATES``."""
    shape, m = tensors[0].shape, CHECKED_COORDINATES
    n = shape.numel()
    if n <= m:
        stacked = torch.stack([t if t.shape == shape else t.reshape(shape) for t in tensors])
        return stacked if stacked.dim() == 2 else stacked.view(len(tensors), n)
    k = n // m
    return torch.stack([t.reshape(-1)[: k * m : k] for t in tensors])


def _gaussian_entropy_weights(
    site: MeanFieldSite, checked: torch.Tensor, counts: list[int], dtype: torch.dtype
) -> list[float]:
    """The weight ``c`` of the entropy in the loss whose gradients were handed, for ``"gaussian"``
    blocks of ``site``'s scale constraint and minibatch scale: 1.0 exactly where it is 1 up to
    rounding, NaN where a block's gradients are not those of ``c`` times the loss that published
    its moments (for one ``c`` at every coordinate compared). ``checked`` holds, on the host in
    float64, the blocks' coordinates (``counts`` of them a block, one after another), computed
    in ``dtype``, in seven rows: their loc, unconstrained and constrained scale, published ``g``
    and ``h``, and loc and scale gradients (`QNVB._checked_coordinates`).

    A loss ``c (E_q[U] - H[q])`` has ``dL/dmu / s = g`` and ``dL/dsigma / s = sigma h - c / sigma``
    with the published ``g = c E[dU/dz]``, ``h = c E[d^2U/dz^2]``, so at each coordinate
    ``c = sigma^2 h - sigma dL/dsigma / s`` and ``dL/dmu / s`` must be ``g``. Both are compared
    within ``sqrt(eps)`` of the sizes of their terms (the moments and the gradients round apart:
    the closed-form priors are summed in each on their own). Where some coordinate's weight is
    not finite, only the block's loc gradients are compared and ``c`` is taken as 1. In numpy:
    on a few hundred numbers its operations cost a fraction of torch's."""
    _, u, sigma, _, _, _, scale_grad = checked.unbind()
    q = _scale_gradient(site, {"scale_leaf": u, "scale": sigma}, {"scale": scale_grad}).numpy()
    loc, _, sigma, g, h, loc_grad, _ = checked.numpy()
    s = site.scale_factor
    starts = list(itertools.accumulate(counts[:-1], initial=0))
    tol = torch.finfo(dtype).eps ** 0.5
    with numpy.errstate(all="ignore"):  # NaN (not finite) is left out by fmax and fmin
        ssh, sd = sigma * sigma * h, sigma * q
        weight = ssh - sd
        slack = tol * (abs(ssh) + abs(sd))  # of the terms the weight was rounded from
        sums = numpy.add.reduceat(weight, starts).tolist()
        slacks = numpy.add.reduceat(slack, starts).tolist()
        highs = numpy.fmax.reduceat(weight - slack, starts).tolist()
        lows = numpy.fmin.reduceat(weight + slack, starts).tolist()
        g_off = abs((loc_grad if s == 1.0 else loc_grad / s) - g)
        g_off -= tol * (abs(g) + abs(h) * (abs(loc) + sigma))
        g_offs = numpy.fmax.reduceat(g_off, starts).tolist()
    weights = []
    for n, c, c_slack, high, low, loc_off in zip(counts, sums, slacks, highs, lows, g_offs):
        c, c_slack = c / n, c_slack / n  # |weight - c| > slack + c_slack somewhere: off
        off = high - c > c_slack or c - low > c_slack or loc_off > 0
        if not math.isfinite(c) or abs(c - 1.0) <= c_slack:
            c = 1.0
        weights.append(math.nan if off or c <= 0 else c)
    return weights


GradientIdentity = Callable[
    [MeanFieldSite, dict[str, torch.Tensor], dict[str, torch.Tensor]],
    tuple[torch.Tensor, torch.Tensor],
]
"""``(site, values by role, gradients by role) -> (g, h)``, the values and gradients at the rows
of the step (``values`` holds ``"loc"``, ``"scale"`` and the unconstrained ``"scale_leaf"``)."""

GRADIENT_IDENTITIES: dict[str, GradientIdentity] = {"gaussian": _gaussian_identity}
"""family -> how QNVB reads a block's moments ``g``, ``h`` from its parameters' gradients when no
moments were published (Pyro's ELBOs). The families QNVB reads from gradients are its keys; a
block of another family needs `published_moments`."""


def masked_site_refusal(site: MeanFieldSite) -> ValueError | None:
    """QNVB's refusal of a block whose guide site runs under a ``poutine.mask`` that masks some
    of its entries (`MeanFieldSite.mask`); ``None`` where it masks none.

    A masked entry's entropy is out of the loss (as in Pyro's ELBOs), and nothing holds its
    scale up: the loss falls as the scale shrinks to zero. QNVB's update sets the scale from the
    curvature as the entropy's term would, so it would fit another objective than the loss.
    """
    mask = site.mask
    if mask is None or bool(mask.all()):
        return None
    return ValueError(
        f"QNVB: the guide's site {site.name!r} runs under a poutine.mask that masks out its "
        "entropy (mask=False, or False entries), so the loss has no term that holds its scale "
        "up, and QNVB, which sets the scale from the curvature as the entropy's term would, "
        "cannot fit it. Mask the model's sites instead (poutine.mask(model, mask)), or fit the "
        "masked guide with a gradient optimizer (pyro.optim.Adam)"
    )


def minibatch_refusal(site: MeanFieldSite) -> ValueError | None:
    """QNVB's refusal of a block it reads from gradients (its family in
    `GRADIENT_IDENTITIES`, a gradient on loc and scale) whose guide does not record its
    minibatch (Pyro's ``AutoNormal``: rows ``None``), when this step left some of its entries
    without any gradient; ``None`` when there is none.

    Such entries were outside a subsampled plate's minibatch, so the gradients carry the plate's
    scale ``s = N / B``, which the identity (rasp paper, eq. 7-8) must divide out and cannot know.
    Read with ``s = 1``, ``h`` is ``s h - (s - 1) / sigma^2``, below zero from the start, and the
    scales never move. (Every entry in the minibatch has a gradient: its entropy's ``-1 / sigma``
    on the scale.)
    """
    loc_grad, scale_grad = site.params["loc"].grad, site.params["scale"].grad
    if (
        site.rows is not None
        or site.family not in GRADIENT_IDENTITIES
        or loc_grad is None
        or scale_grad is None
    ):
        return None
    if bool(((loc_grad == 0) & (scale_grad == 0)).any()):  # a sync, for such guides only
        return ValueError(
            f"QNVB: site {site.name!r} was used on part of its entries (a subsampled plate), "
            "but its guide does not record its minibatch, so QNVB cannot take the plate's scale "
            "N / B out of the gradients (the scales would stay where they started). Use "
            "pyro_quadvi's AutoMeanFieldNormal (Pyro's AutoNormal, recording its minibatch), or "
            "fit with QuadratureELBO, which publishes the moments"
        )
    return None


def stale_rows_refusal(
    site: MeanFieldSite, run: RunStamp | None, previous: int | None
) -> ValueError | None:
    """QNVB's refusal of a block read from gradients whose rows are a minibatch (``site.rows``
    not empty) recorded by no run of this step; ``None`` when there is none.

    ``run`` is the stamp of the guide's run that recorded ``site.rows``
    (`last_run_stamp`; ``None``: the guide keeps none, no
    check) and ``previous`` the number of the run QNVB read the block from at its previous step.
    The rows are stale when no run happened since (Pyro's ``JitTrace_ELBO`` replays the guide
    it traced at its first step without running it in Python, so the plate's new indices reach
    the gradients but not the recorded rows; Pyro 1.9's ``JitTraceMeanField_ELBO`` traces again
    at every step, so its guide runs), or when the last run had gradients off (``Predictive``,
    ``SVI.evaluate_loss``), so it cannot be the run this step's gradients came from. QNVB would
    update the recorded rows with their zero gradients and never the rows of the minibatch.
    """
    if not site.rows or run is None or (run.grad and run.number != previous):
        return None
    if run.grad:
        why = "has not run in Python since QNVB's previous step"
    else:
        why = "last ran with gradients off (Predictive or SVI.evaluate_loss, say) and not since"
    return ValueError(
        f"QNVB: site {site.name!r} sits in a subsampled plate, and its guide {why}, so the "
        "minibatch rows and scale it recorded are not this step's (QNVB would update those rows "
        "and never the new ones). A JIT ELBO such as Pyro's JitTrace_ELBO replays the guide it "
        "traced at its first step without running it, so the guide cannot record its minibatch. "
        "Fit with Trace_ELBO (or TraceMeanField_ELBO), or with pyro_quadvi's QuadratureELBO, "
        "which publishes the moments; or keep the JIT ELBO and use pyro.optim.Adam"
    )


def outside_rows_refusal(site: MeanFieldSite, index: tuple | None) -> ValueError | None:
    """QNVB's refusal of a block read from gradients whose scale has a gradient outside the
    minibatch rows its guide recorded (``index``, from `_row_index`); ``None`` when there
    is none (or no rows were recorded).

    Every entry of the minibatch has a scale gradient (its entropy's ``-1 / sigma``) and no entry
    outside it has one, when one run of the guide made the step's gradients. Entries outside mean
    that several runs on different minibatches did (Pyro's ``Trace_ELBO(num_particles=2)`` without
    ``vectorize_particles`` draws a plate's subsample per particle) or that something else
    reached the parameters, and QNVB, updating the last run's rows, would drop the others'
    gradients. A JIT ELBO (Pyro's ``JitTrace_ELBO``) with a subsample the guide draws
    (``create_plates`` with ``subsample_size``) draws other rows in its compiled run than in the
    Python run the guide recorded, from the first step on: the same refusal.
    One host sync, for subsampled blocks only.
    """
    grad = site.params["scale"].grad
    if index is None or grad is None:
        return None
    outside = grad != 0
    outside[index] = False  # what is left: gradients outside the recorded rows
    if not bool(outside.any()):
        return None
    return ValueError(
        f"QNVB: site {site.name!r} sits in a subsampled plate, and this step's gradients reach "
        "entries outside the minibatch its guide recorded last, so the guide ran on several "
        "minibatches in one step (Trace_ELBO with num_particles > 1 and no "
        "vectorize_particles=True draws one per particle), or a JIT ELBO (JitTrace_ELBO) "
        "ran a guide that draws its own subsample (the compiled run draws other rows than the "
        "Python run the guide recorded), or another term reached its parameters; QNVB updates "
        "one minibatch's rows and would drop the other gradients. Use "
        "Trace_ELBO(num_particles=K, vectorize_particles=True) (one minibatch for all "
        "particles), one particle, Trace_ELBO instead of a JIT ELBO, or pyro_quadvi's "
        "QuadratureELBO, which publishes the moments; or keep the JIT ELBO and use "
        "pyro.optim.Adam"
    )


def _not_finite_mask(t: torch.Tensor) -> torch.Tensor:
    """``~isfinite(t)`` in two passes (``isfinite`` is four kernels on the CPU): ``t * 0`` is 0
    for a finite entry and NaN for an infinite or NaN one."""
    return t * 0 != 0


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of one storage (same start, shape, strides)."""
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _constrain(items: list[_Prepared], transform) -> None:
    """Set each block's ``values["scale"]``, ``transform`` of its unconstrained scale, both as
    pieces of one buffer (the update and the write-back then read them flat, without a copy).

    The transform runs block by block: a vectorized ``softplus`` rounds the last few entries of
    a tensor (its scalar tail) its own way, so on all blocks at once a block's scales would
    depend on its neighbours (and on how ranks share the blocks out).
    """
    if not items:
        return
    leaves = [item.values["scale_leaf"] for item in items]
    sizes = [u.numel() for u in leaves]
    flat = _flatten(leaves)
    scales = _flatten([transform(u) for u in flat.split(sizes)]).split(sizes)
    for item, scale, u, piece in zip(items, scales, leaves, flat.split(sizes)):
        item.values["scale"] = scale.view(u.shape)
        item.values["scale_leaf"] = piece.view(u.shape)


@dataclass
class QNVBBlock:
    """A block QNVB updates in one step (`QNVB.find_blocks`).

    Attributes:
        site: the block, as its guide describes it.
        moments: what ``QuadratureELBO`` published for it in this step; ``None``: QNVB reads
            ``g`` and ``h`` from the gradients of its parameters (`GRADIENT_IDENTITIES`).
        run: the stamp of the guide's run that recorded ``site.rows``, where the guide keeps one
            (`last_run_stamp`; see
            `stale_rows_refusal`).
    """

    site: MeanFieldSite
    moments: PublishedMoments | None
    run: RunStamp | None = None


def site_label(name: str) -> str:
    """``"site 'w'"``: how the optimizer's counts, warnings and refusals name a site's block (the
    key by which the step's warnings find a block again in its counts)."""
    return f"site {name!r}"


def _check_dtype(item: _Prepared) -> None:
    """Refuse a block whose loc is narrower than float32 (`check_precision`, the refusal of
    `QNVBOptimizer`) and settings beyond the range of its dtype (`check_representable`:
    ``sigma_max=1e40`` in float32), naming the site; once per group of blocks and step."""
    loc, label = item.values["loc"], site_label(item.site.name)
    check_precision(loc, label, "QNVB")
    check_representable(f"QNVB ({label}): ", "sigma_max", item.hp.sigma_max, loc.dtype)


#: how far below the root mean square of a block's past total gradients (``sqrt(s_avg)``) its
#: current one must be for `_held_coordinates`
HELD_GRADIENT_RATIO = 1e4


def _held_coordinates(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where a block's mean is held nearly still by one past step (``docs/qnvb.md``,
    "A frozen start"): its curvature average is positive and one step holds most of its mean
    square (``h2_avg > count h_avg^2 / 2``: for ``n`` similar values ``h2_avg`` is about
    ``h_avg^2``, for one value among ``n`` near-zero ones ``n h_avg^2``), and the current total
    gradient is below `HELD_GRADIENT_RATIO` of the root mean square of the past ones, which caps
    the mean's step (rule 7, ``g / max(H, sqrt(s_avg) / lr)``). A coordinate whose gradient is
    exactly 0 (a dead unit) is not held: it has nowhere to go. A site counts as held only where
    at least half of its coordinates are (`held_site`): an overflowing step reaches the whole
    site, while in a network a few coordinates of thousands meet these conditions in an
    ordinary fit (1 of 6,400 weights in the classification tutorial's quick run)."""
    n, h, grad = state["curvature_count"], state["h_avg"], state["last_grad"]
    one_step = (n >= 3) & (h > 0) & (state["h2_avg"] > 0.5 * n * h * h)
    return one_step & (grad != 0) & (state["s_avg"] > HELD_GRADIENT_RATIO**2 * grad * grad)


def held_site(state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The held coordinates of a block (`_held_coordinates`) where they are at least half of
    its coordinates, else ``None`` (one host read)."""
    held = _held_coordinates(state)
    return held if 2 * int(held.sum()) >= held.numel() else None


def _is_decade(step: int) -> bool:
    """Whether ``step`` is 10, 100, 1000, ...: when QNVB looks for held means."""
    return step >= 10 and str(step).rstrip("0") == "1"


#: the fraction of the step count above which a site's median damping divisor ``k`` is the
#: stall signature of `_damping_message` (the noise of a random rule grows ``k`` like ``t / 4``)
STALLED_DAMPING_FRACTION = 0.1

#: how far, in its posterior sds (median over its coordinates), a site's mean must have moved
#: since the last check for `_damping_message`: noise about an optimum moved the means of
#: non-centred eight schools by 0.005 to 0.019 sd from step 100 to 1,000, the stalled centred
#: ones 0.08 to 0.42
STALLED_DRIFT = 0.2

#: how much of ``lr`` a step a mean must have moved on average between two checks for
#: `_capped_message` (the cap ``g / max(H, sqrt(s_avg) / lr)`` moves it by at most about ``lr``)
CAPPED_FRACTION = 0.9


def _damping_message(stalled: dict[str, tuple[float, int]], step: int) -> str:
    """The warning of the sites whose damping divisor grew with the step count under the moments
    QuadratureELBO published (`QNVB._warn_if_stalled`), ``stalled`` their median ``k`` and the
    step of the check before by name: the noise of a random rule on a loss far from quadratic,
    which stalls the means (``docs/qnvb.md``, the ``damping`` row)."""
    sites = ", ".join(f"{name!r} ({k:.3g})" for name, (k, _) in stalled.items())
    since = min(since for _, since in stalled.values())
    return (
        f"QNVB: at step {step} the median damping divisor k of the site(s) {sites} is above "
        f"step / {1 / STALLED_DAMPING_FRACTION:g} while their means still travel (by more than "
        f"{STALLED_DRIFT:g} posterior sd since step {since}): their gradients changed sign at "
        "about every other step, so the means' steps shrink like 1 / step and the fit stalls "
        "short of its optimum with the loss nearly flat (centred eight schools: 3 nats short "
        "after 1,000 steps). Under QuadratureELBO that is the noise of a random rule on a loss "
        "far from quadratic, not an oscillation: pass QNVB(damping_recovery=2) (noise then "
        "keeps k near 2.6); for a centred hierarchical model, the non-centred parameterization"
    )


def _capped_message(name: str, item: _Prepared, capped: int, since: int, step: int) -> str:
    """The warning of a site whose mean the step cap ``lr`` held back (`QNVB._warn_if_stalled`)
    at ``capped`` coordinates from step ``since`` to ``step``."""
    lr, loc = item.hp.lr, item.site.param_names["loc"]
    return (
        f"QNVB: site {name!r}: at {capped} of its {item.site.params['loc'].numel()} coordinates "
        f"the mean moved by {CAPPED_FRACTION:g} lr or more a step (lr={lr:g}) from step {since} "
        f"to {step}, in one direction: the cap g / max(H, sqrt(s_avg) / lr), which moves it by "
        "at most about lr, bound at nearly every step and held it back (its latent is "
        "many units from where it started, in its unconstrained space), and the fit is not "
        "there yet although the loss falls. Standardize the data (a feature scaled by 1e-3 "
        "needs a coefficient 1,000 times larger), start the guide near the answer, or raise "
        f"lr for this site: QNVB(lambda name: {{'lr': {100 * lr:g}}} if name == {loc!r} else {{}})"
    )


def _row_index(shape: torch.Size, rows: dict[int, torch.Tensor] | None) -> tuple | None:
    """An outer-product index selecting ``rows[dim]`` along each subsampled dim (None: all)."""
    if not rows:
        return None
    ndim = len(shape)
    index = []
    for d in range(ndim):
        picked = rows.get(d - ndim, rows.get(d))
        if picked is None:  # on the device of the rows given (the parameter's)
            picked = torch.arange(shape[d], device=next(iter(rows.values())).device)
        view = [1] * ndim
        view[d] = -1
        index.append(picked.reshape(view))
    return tuple(index)


ANNEALED_RECENT_FRACTION = 0.1
"""QNVB's default ``recent_fraction`` under an ``annealing`` schedule. The annealed likelihood is
inside the model, so the curvature QNVB averages grows with the factor; with the plain window
(``1 / (1 - beta2)`` steps) the scales stayed up to twice too wide for hundreds of steps after the
schedule ended, with a tenth of the updates they are right within 10 to 100 (``docs/qnvb.md``,
"Annealing the likelihood"; ``benchmarks/bench_anneal_lag.py``)."""


def _one_gradient(name: str, loc_leaf: torch.Tensor) -> str:
    """The warning of a block with a gradient on one of its loc and scale only. A loc without
    one means that nothing of the loss reads the site but the guide's entropy, which reads the
    scale alone: no log density of the model depends on the site. Otherwise the scale is cut
    off from the loss (frozen or detached)."""
    if loc_leaf.grad is None:
        return (
            f"QNVB: site {name!r} has a gradient on its scale only, none on its loc: no log "
            "density of the model depends on the site (its prior and every term that reads it "
            "are masked out, by poutine.mask or .mask(False), or left out of the loss), so only "
            "the guide's entropy reads it. Its posterior is improper, the prior being missing, "
            "and the fallback optimizer, which both go to, widens its scale without end: leave "
            "the site's prior unmasked, or drop the site from the model and the guide"
        )
    return (
        f"QNVB: site {name!r} has a gradient on only one of its loc and scale (is the other "
        "frozen or detached?); both go to the fallback optimizer"
    )


def _half_frozen(name: str, role: str) -> str:
    """The warning of a block whose ``role`` parameter alone is frozen (``requires_grad``
    false): QNVB updates a site's loc and scale together."""
    other = "scale" if role == "loc" else "loc"
    return (
        f"QNVB: site {name!r} has its {role} frozen (requires_grad=False) and its {other} not; "
        f"QNVB updates a site's loc and scale together, so both go to the fallback optimizer, "
        f"which holds the {role} and steps the {other} by its gradient. Freeze both to hold "
        "the site, or neither to let QNVB update it"
    )


def forget_steps(ratio: float, beta2: float) -> float:
    """About how many steps the running average of ``g^2`` (rule 7's ``s_avg``, weight
    ``beta2`` a step) takes to forget one past step whose gradient was ``ratio`` times the
    current one: ``2 ln(ratio) / -ln(beta2)`` (the factor ``ratio^2`` to lose). A held Poisson
    start (``ratio`` 2.3e40) released at step 1672 with ``beta2=0.9`` (this gives 1765 more
    after step 10) and at step 268 with ``0.5`` (268)."""
    if ratio <= 1.0:
        return 0.0
    if beta2 <= 0.0:
        return 1.0
    return 2.0 * math.log(ratio) / -math.log(beta2)


def _two_digits(steps: float) -> str:
    """``steps`` to two significant digits, with thousands separators (``"190,000"``)."""
    digits = 1 - math.floor(math.log10(steps)) if steps >= 1 else 0
    return f"{round(steps, digits):,.0f}"


def _held_message(name: str, item: _Prepared, held: int, ratio: float) -> str:
    """The warning of a site whose mean is held by one past step (`QNVB._warn_if_held`), with
    the steps the averages take to forget it (`forget_steps`) at its ``betas[1]`` and at 0.5.
    Where no ``trust_region`` bounds the mean's step, the held step may also be one after a
    step that went too far, and the warning says so, with the bound as the way out."""
    beta2 = item.hp.betas[1]
    unbounded = item.hp.trust_region == math.inf
    return (
        f"QNVB: site {name!r}: its mean is held nearly still by one past step. At {held} of its "
        f"{item.site.params['loc'].numel()} coordinates the running averages of the squared "
        "gradient and of the curvature are dominated by one earlier step whose gradient was up "
        f"to {ratio:.3g} times the current one: "
        + (
            "one after an early step that took the mean too far, no trust_region bounding it "
            "(a ReLU network on random labels, qnvb_settings={}: the loss went from 5.2e4 to "
            "2.8e7 at step 2), or "
            if unbounded
            else ""
        )
        + "an overflowing start, such as an exp link whose "
        "first nodes mu + sigma * x_k met unscaled inputs (a loss of 1e40 at step 1). The "
        "mean's steps are divided by that step's gradient or curvature, and sigma stays where "
        "that curvature put it (at sigma_min, say), until the averages forget it: a factor of "
        f"{ratio * ratio:.2g} in g^2, about {_two_digits(forget_steps(ratio, beta2))} steps at "
        f"betas[1]={beta2:g}. "
        + ("For an overflowing start, start" if unbounded else "Start")
        + " with a smaller init_scale (the nodes sit sigma * x_k from "
        "the mean, so a start at the optimum overflows too; 1e-3 and 1e-4 fitted a Poisson "
        "start held by init_scale=0.1), or rescale the inputs; or, in a full-batch fit, let "
        "the averages forget faster: betas=(0, 0.5), about "
        f"{_two_digits(forget_steps(ratio, 0.5))} steps"
        + (
            ". After a step too far, bound the mean's step with trust_region (a BayesianModule "
            "declares 0.3 at its weights unless qnvb_settings replaces it; with it that network "
            "is not held)"
            if unbounded
            else ""
        )
    )


def _computed_message(site: MeanFieldSite, roles: list[str]) -> str:
    """The warning for a block whose ``params`` name, under ``roles``, tensors computed from a
    parameter (``loc * 1.0``) rather than the leaves themselves: QNVB pairs a block with the
    parameters it receives by identity, so the block pairs with none of them."""
    return (
        f"QNVB: site {site.name!r} declares under params {roles} a tensor computed from a "
        "parameter, not the parameter itself, so QNVB cannot pair the block with the parameters "
        "it receives and all of them go to the fallback optimizer. A declared parameter must be "
        "the leaf tensor the optimizer receives: an nn.Parameter itself, or a pyro.param's "
        "pyro.param(name).unconstrained(), not a tensor computed from it (compute the block's "
        "loc and scale from the leaves, not its params)"
    )


def _unresolved_words(item: _Prepared) -> str:
    """``"|mu| up to 1e+03, sigma down to 1e-06, float32"``: a site's coordinates whose nodes
    the dtype does not resolve (rule 12: before the step and after it), read from its
    parameters after the step (a warning's words; a host read)."""
    site = item.site
    loc = site.params["loc"].detach()
    sigma = transform_to(site.param_constraints["scale"])(site.params["scale"].detach())
    unresolved = sigma < loc.abs() * torch.finfo(loc.dtype).eps
    if not bool(unresolved.any()):  # the scale parameter's rounding moved it: all coordinates
        unresolved = torch.ones_like(unresolved)
    top, low = loc.abs()[unresolved].max().item(), sigma[unresolved].min().item()
    return f"|mu| up to {top:.3g}, sigma down to {low:.3g}, {loc.dtype}"


def settings_words(settings, defaults, skip: tuple[str, ...] = ()) -> list[str]:
    """``["name=value", ...]`` for the fields of the dataclass ``settings`` that differ from
    ``defaults`` (an instance of the same class), in field order, leaving out ``skip`` (repr)."""
    words = []
    for field in fields(settings):
        value = getattr(settings, field.name)
        if field.name not in skip and value != getattr(defaults, field.name):
            words.append(f"{field.name}={value!r}")
    return words


def _optim_args_arity(optim_args: Callable) -> int:
    """How many arguments ``PyroOptim`` passes a callable ``optim_args``: one (the parameter's
    name) when it takes exactly one, else two (Pyro's deprecated form, module name and parameter
    name). A callable without a readable signature (a builtin) gets the documented one.

    Raises:
        TypeError: if the callable cannot be called with that many names, naming its signature.
    """
    try:
        signature = inspect.signature(optim_args)
    except (TypeError, ValueError):
        return 1
    arity = 1 if len(signature.parameters) == 1 else 2  # as PyroOptim decides
    try:
        signature.bind(*["name"] * arity)
    except TypeError:
        raise TypeError(
            "QNVB calls a callable optim_args as Pyro's optimizers do: with the parameter's name "
            "(lambda name: {...}) or, in Pyro's deprecated form, with the module's name and the "
            f"parameter's name (lambda module_name, param_name: {{...}}); {optim_args!r} takes "
            f"{signature}"
        ) from None
    return arity


def _optim_args_names(name: str, arity: int) -> tuple[str, ...]:
    """The arguments Pyro's optimizers give a callable ``optim_args`` of ``arity`` for the param
    store name ``name``: ``(name,)`` with Pyro's ``$$$`` module separator as ``.`` (the names of
    ``nn.Module.named_parameters``), or ``(module name, parameter name)`` split at it (a guide's
    parameters, which are no ``pyro.module``'s, get their full name twice)."""
    if arity == 1:
        return (normalize_param_name(name),)
    return module_from_param_with_module_name(name), user_param_name(name)


def parameters_given(first: object) -> str | None:
    """What a torch optimizer's constructor takes, in words, where ``first`` is one: a list (or
    an iterator) of parameters or parameter groups, which Pyro's learning-rate schedulers pass the
    optimizer they wrap; ``None`` for anything else."""
    if isinstance(first, Iterator):
        return f"an iterator ({type(first).__name__})"
    if (
        isinstance(first, (list, tuple))
        and first
        and all(
            isinstance(p, torch.Tensor) or (isinstance(p, dict) and "params" in p) for p in first
        )
    ):
        return f"a {type(first).__name__} of {len(first)} parameter(s)"
    return None


def _parameters_refusal(optim_args: object) -> TypeError | None:
    """QNVB's refusal of a torch optimizer's arguments (`parameters_given`); ``None`` for
    anything else."""
    what = parameters_given(optim_args)
    if what is None:
        return None
    return TypeError(
        f"QNVB got {what} as its first argument, the way a torch optimizer is built. QNVB is a "
        "Pyro optimizer: SVI hands it the parameters (SVI(model, guide, QNVB(), loss)). Pyro's "
        "learning-rate schedulers (pyro.optim.ExponentialLR({'optimizer': QNVB, ...}) and the "
        "others) build their optimizer that way, one per parameter, and cannot wrap QNVB, which "
        "updates a guide block's loc and scale together; its lr caps a mean's step and is no "
        "step size to decay. Use QNVB itself: QNVB(lr=...) sets the cap (or a dict or callable "
        "per block), and QNVB(annealing=geometric_annealing(0.01, num_steps=500)) (from "
        "pyro_quadvi.optim) schedules the likelihood ('Hyperparameters' and 'Annealing the "
        "likelihood' in docs/qnvb.md). For a torch network trained without Pyro, "
        "QNVBOptimizer(net.parameters(), ...) is QNVB's torch optimizer"
    )


class QNVB(PyroOptim):
    """Quasi-Newton variational Bayes for Pyro mean-field guides (rasp paper, eq. 4-8).

    Args:
        optim_args: the update's hyperparameters as Pyro's optimizers take them: a dict such as
            ``{"lr": 0.5}``, or a callable ``name -> dict`` called with each block's loc
            parameter name (e.g. ``"AutoMeanFieldNormal.locs.w"``); a callable of two arguments,
            Pyro's deprecated form, is called as Pyro calls it, with the name split into module
            and parameter at Pyro's ``$$$`` (a guide's loc gets its full name twice). A list of
            parameters (how Pyro's learning-rate schedulers build the optimizer they wrap, which
            cannot be QNVB) is refused with a ``TypeError`` saying what to use. A block's model
            may declare settings (`hints`, e.g. a `BayesianModule`'s ``NETWORK_QNVB_SETTINGS``),
            which replace QNVB's defaults for it; keyword arguments below set the same names for
            every block, and the dict or callable overrides them.
        annealing: optional schedule ``step -> factor`` of the likelihood; it takes effect through
            the model returned by `anneal`. Under a schedule QNVB's own default
            ``recent_fraction`` is 0.1 (any setting given wins).
        fallback: the optimizer of every parameter QNVB does not update: a ``pyro.optim``
            optimizer such as ``pyro.optim.Adam({"lr": 1e-2})`` (its constructor and arguments
            are used), or a pair ``(torch optimizer class, arguments dict)``. Default: Adam with
            ``lr = 1e-2``. Pyro's ``clip_args`` is refused (a ``TypeError``; ``None`` or ``{}``, no
            clipping, is accepted): QNVB's steps are
            bounded by ``trust_region`` and ``lr``, not by clipping; the fallback's parameters
            take Pyro's clipping through ``fallback=pyro.optim.ClippedAdam({...})`` or a
            ``PyroOptim`` with ``clip_args``.
        compile: run the update through ``torch.compile``
            (`qnvb_update_many`): an opt-in, it needs a
            C++ compiler on the CPU (Triton on a GPU) and compiles on the first step (seconds
            to a minute).
        **hyperparameters: any field of `QNVBHyperparameters` (``lr``, ``betas``,
            ``sigma_min``, ...), whose defaults are QNVB's (``help(QNVBHyperparameters)``, from
            ``pyro_quadvi.optim``); ``docs/qnvb.md`` says why. ``repr(qnvb)`` shows the
            settings that differ from them.

    The blocks of a family that share hyperparameters are updated together, on one flat buffer
    (`qnvb_update_many`).

    ``get_state()`` / ``set_state()`` (and so ``save()`` / ``load()``) hold deep copies of every
    block's state, the step count and the fallback's state: together with Pyro's param store (and
    the random state, for random quadratures or Monte Carlo losses) a restored run continues
    exactly.
    """

    def __init__(
        self,
        optim_args: dict | Callable[[str], dict] | None = None,
        *,
        annealing: Callable[[int], float] | None = None,
        fallback: PyroOptim | tuple[type, dict] | None = None,
        compile: bool = False,
        **hyperparameters: float | tuple[float, float] | bool | str,
    ):
        # PyroOptim's argument, as a user porting code passes it; None or {} (no clipping) is what
        # QNVB does anyway
        if hyperparameters.pop("clip_args", None):
            raise TypeError(
                "QNVB takes no clip_args: its steps are bounded by trust_region (the mean moves "
                "at most trust_region * sigma per step) and lr (at most an Adam step of size lr), "
                "not by clipping gradients. The parameters QNVB does not update take Pyro's "
                "clipping through their optimizer: fallback=pyro.optim.ClippedAdam({'lr': 1e-2, "
                "'clip_norm': 10.0}), or fallback=pyro.optim.PyroOptim(torch.optim.Adam, "
                "{'lr': 1e-2}, clip_args={'clip_norm': 10.0})"
            )
        refusal = _parameters_refusal(optim_args)
        if refusal is not None:
            raise refusal
        if optim_args is not None and not (isinstance(optim_args, dict) or callable(optim_args)):
            raise TypeError(
                "QNVB's first argument is a dict of hyperparameters or a callable name -> dict, "
                f"as for pyro.optim optimizers (e.g. QNVB({{'lr': 0.5}})); got {optim_args!r}"
            )
        if callable(optim_args):
            _optim_args_arity(optim_args)  # a callable Pyro could not call is refused here
        check_schedule(annealing)
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        self.compile = compile
        self.defaults = dict(hyperparameters)
        self.optim_args = optim_args
        self.annealing = annealing
        self.hyperparameters = self._hyperparameters_for(None)  # validates what applies to all
        self._by_block: dict[tuple, QNVBHyperparameters] = {}
        # PyroOptim's own machinery (one torch optimizer per parameter) is the fallback
        super().__init__(*self._fallback_arguments(fallback))
        self.num_steps = 0
        # the descriptions describe() made, with the step they were made for
        self._described: tuple[int, list] | None = None
        # block name -> (its loc parameter, weakly: a dead model's states are dropped, _live)
        self._bound: dict[str, tuple[weakref.ref, dict[str, torch.Tensor]]] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        # each tensor of the fallback's optimizers -> its name (None: none known), _bind_fallback
        self._fallback_names: dict[torch.Tensor, str | None] = {}
        # a tensor whose name another tensor took in the states -> the name (weakly: a rebuilt
        # model's parameters are dropped with it; one that comes back is refused,
        # _refuse_second_model)
        self._replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._fresh: set[str] = set()  # the blocks whose state started in the current step
        # name -> the hyperparameters a block was updated with and its model's hints (get_state)
        self._block_settings: dict[str, tuple[QNVBHyperparameters, dict]] = {}
        self._warned: set[str] = set()
        # steps in a row in which no coordinate of any block could be updated (saved in get_state)
        self._idle_steps = 0
        # loc name -> the number of the guide run a block was last read from (stale_rows_refusal)
        self._runs_read: dict[str, int] = {}
        watch_guides()

    def _hyperparameters_for(
        self, name: str | None, hints: dict | None = None
    ) -> QNVBHyperparameters:
        unknown = sorted(set(hints or {}) - set(_HP_NAMES))
        if unknown:
            raise TypeError(
                f"the model declares (infer['qnvb']) unknown QNVB hyperparameters {unknown} for "
                f"the block of {name!r}; the update takes {list(_HP_NAMES)}"
            )
        args = {**(hints or {}), **self.defaults}
        if self.annealing is not None:  # under it, QNVB's own default; any setting given wins
            args = {"recent_fraction": ANNEALED_RECENT_FRACTION, **args}
        sources = [f"the model's infer['qnvb'] = {hints!r}"] if hints else []
        if self.defaults:
            sources.append(f"QNVB's keyword arguments {self.defaults!r}")
        if isinstance(self.optim_args, dict):
            args.update(self.optim_args)
            if self.optim_args:
                sources.append(f"optim_args {self.optim_args!r}")
        elif callable(self.optim_args) and name is not None:
            names = _optim_args_names(name, _optim_args_arity(self.optim_args))
            extra = self.optim_args(*names)
            called = f"optim_args({', '.join(map(repr, names))})"
            if not isinstance(extra, dict):
                raise TypeError(
                    f"QNVB's optim_args callable must return a dict for {name!r}, got {called} = "
                    f"{extra!r}"
                )
            args.update(extra)
            sources.append(f"{called} = {extra!r}")
        # a block's settings are refused naming the block and where they came from
        where = "" if name is None else f" for the block of {name!r} (from {', '.join(sources)})"
        unknown = sorted(set(args) - set(_HP_NAMES))
        if unknown:
            raise TypeError(
                f"QNVB got unknown hyperparameters {unknown}{where}; the update takes "
                f"{list(_HP_NAMES)}"
            )
        try:
            return QNVBHyperparameters(**args)
        except (TypeError, ValueError) as error:
            if name is None:
                raise
            raise type(error)(f"QNVB: {error}{where}") from error

    def block_hyperparameters(self, name: str, hints: dict) -> QNVBHyperparameters:
        """The hyperparameters of the block whose loc parameter is ``name``: its model's hints
        (`hints`) under the settings passed to QNVB, and
        the callable's for ``name``.

        Raises:
            TypeError, ValueError: for unknown or invalid settings, naming the block and where
                each setting came from.
        """
        if not callable(self.optim_args) and not hints:
            return self.hyperparameters
        key = (name, repr(sorted(hints.items())))  # a new model may declare other settings
        if key not in self._by_block:
            self._by_block[key] = self._hyperparameters_for(name, hints)
        return self._by_block[key]

    def __repr__(self) -> str:
        defaults = QNVBHyperparameters(
            **({} if self.annealing is None else {"recent_fraction": ANNEALED_RECENT_FRACTION})
        )
        parts = [] if not callable(self.optim_args) else [f"optim_args={self.optim_args!r}"]
        parts += settings_words(self.hyperparameters, defaults)
        if self.annealing is not None:
            parts.append(f"annealing={self.annealing!r}")
        parts += self._fallback_words()
        if self.compile:
            parts.append("compile=True")
        return f"QNVB({', '.join(parts)})"

    def _fallback_words(self) -> list[str]:
        """``["fallback=..."]`` for a fallback other than the default, else ``[]`` (repr)."""
        constructor, args, clip_args = (
            self.pt_optim_constructor,
            self.pt_optim_args,
            self.pt_clip_args,
        )
        if not clip_args and (constructor, args) == _DEFAULT_FALLBACK:
            return []
        if not clip_args:  # PyroOptim keeps no clipping as {}
            return [f"fallback=({constructor.__name__}, {args!r})"]
        return [f"fallback=PyroOptim({constructor.__name__}, {args!r}, {clip_args!r})"]

    @staticmethod
    def _fallback_arguments(fallback) -> tuple:
        """``(torch optimizer class, arguments, clip_args)`` of ``fallback`` (the ``PyroOptim``
        machinery QNVB keeps for it): a plain ``PyroOptim``'s own, or a pair's ``(class,
        arguments)``, the arguments a dict or, as Pyro takes them, a callable of the parameter's
        name.

        Raises:
            ValueError: for anything else, saying what is accepted; a class that is not a
                ``torch.optim.Optimizer`` (a learning-rate scheduler) is refused here, not at the
                first step.
        """
        if fallback is None:
            return _DEFAULT_FALLBACK
        if type(fallback) is PyroOptim:
            arguments = (fallback.pt_optim_constructor, fallback.pt_optim_args)
            clip_args = fallback.pt_clip_args
        elif isinstance(fallback, tuple) and len(fallback) == 2:
            arguments, clip_args = fallback, None
        else:
            arguments = clip_args = None
        constructor, args = arguments or (None, None)
        if (
            isinstance(constructor, type)
            and issubclass(constructor, torch.optim.Optimizer)
            and (isinstance(args, dict) or callable(args))
        ):
            if not isinstance(args, dict):
                try:
                    _optim_args_arity(args)  # one PyroOptim can call
                except TypeError as error:
                    raise TypeError(f"QNVB's fallback: {error}") from None
            return constructor, args, clip_args
        why, got = "", repr(fallback)
        uncalled = [name for name, value in vars(pyro.optim).items() if value is fallback]
        if uncalled:
            got = f"pyro.optim.{uncalled[0]}"
            why = f" ({got} uncalled: call it with its arguments, fallback={got}({{'lr': 0.01}}))"
        elif isinstance(fallback, type) and issubclass(fallback, torch.optim.Optimizer):
            public = getattr(torch.optim, fallback.__name__, None) is fallback
            got = f"torch.optim.{fallback.__name__}" if public else fallback.__qualname__
            why = f" (a class alone: pair it with its arguments, fallback=({got}, {{'lr': 0.01}}))"
        elif isinstance(fallback, PyroLRScheduler) or (
            isinstance(constructor, type) and issubclass(constructor, LRScheduler)
        ):
            why = (
                " (a learning-rate scheduler is not supported as the fallback: pass its optimizer, "
                "e.g. (torch.optim.Adam, {'lr': 1e-2}))"
            )
        elif isinstance(fallback, PyroOptim):
            why = (
                f" ({type(fallback).__name__} is a PyroOptim subclass: the fallback is one torch "
                "optimizer per parameter, built from a class and its arguments, so a subclass's "
                "own step would not run"
            )
            if isinstance(fallback, QNVB):
                why += (
                    "; and the fallback's parameters are those no mean-field guide block holds, "
                    "which QNVB would hand on to its own fallback: give that one here instead"
                )
            why += ")"
        raise ValueError(
            "fallback must be a plain PyroOptim such as pyro.optim.Adam({'lr': 0.01}) "
            "(per-parameter arguments via pyro.optim.Adam(lambda name: {...})), or a pair "
            "(torch.optim.Optimizer subclass, arguments dict or callable name -> dict), such as "
            f"(torch.optim.SGD, {{'lr': 0.1}}); got {got}{why}"
        )

    # ----------------------------------------------------------------------------- annealing
    @property
    def annealing_factor(self) -> float:
        """The likelihood factor of the current step (1 without a schedule).

        Raises:
            ValueError: when the schedule's factor at this step is not finite and ``> 0``
                (`annealing_factor`); read by the annealed
                model, the error comes out of ``svi.step`` before QNVB changes anything.
        """
        if self.annealing is None:
            return 1.0
        return annealing_factor(self.annealing, self.num_steps)

    def anneal(self, model: Callable) -> Callable:
        """``model`` with its likelihood multiplied by `annealing_factor` at every step."""
        return anneal_likelihood(model, self._read_factor)

    def _read_factor(self) -> float:
        """`annealing_factor`, as the annealed model reads it; the step that read it is noted
        (`_warn_if_not_annealed`)."""
        self._factor_read_at = self.num_steps
        return self.annealing_factor

    def _warn_if_not_annealed(self) -> None:
        """Warn once when a step under a schedule ends without the model having read its factor
        (`_read_factor`): the model is not wrapped by `anneal`, or has no observed site to
        temper, so the schedule changes nothing but QNVB's default ``recent_fraction``."""
        if self.annealing is None or self.__dict__.get("_factor_read_at") == self.num_steps:
            return
        self._warn_once(
            "not annealed",
            f"QNVB: step {self.num_steps} ran under the annealing schedule {self.annealing!r}, "
            "but the model did not read its factor: the schedule takes effect only through the "
            "model qnvb.anneal(model) returns (SVI(qnvb.anneal(model), guide, qnvb, loss)), "
            "which tempers the model's observed sites (condition the model inside it: "
            "qnvb.anneal(pyro.condition(model, data))). Without it the fit runs untempered",
        )

    # ------------------------------------------------------------------------------- update
    def __call__(
        self,
        params: Iterable[torch.Tensor],
        *args,
        descriptions: list[tuple[Callable, GuideDescription]] | None = None,
        part_of_step: bool = False,
        **kwargs,
    ) -> None:
        """Update the blocks of described guides among ``params``; pass the rest to the fallback.

        ``descriptions``: what `describe` returned in this step, for a caller that
        described the live guides already
        (`DistributedOptimizer`); ``None``: made here, where
        needed (`find_blocks`). ``part_of_step``: ``params`` are one rank's share of a step
        whose other blocks other ranks update (`DistributedOptimizer` with ``shard_update``), so
        a share in which no coordinate could be updated is warned of, not refused (a refusal on
        one rank would leave the others waiting for its blocks). ``args`` and ``kwargs`` go to
        the fallback's step.
        """
        params = list(params)
        self._live()  # the states of dead models' blocks dropped
        try:
            self._refuse_untrainable(params)
            blocks, explained = self.find_blocks(params, descriptions)
        finally:
            self._described = None
        self._refuse_second_model(params, blocks)
        paired: set[int] = set()
        counts: list[tuple[str, QNVBHyperparameters, torch.dtype, torch.Tensor]] = []
        prepared = []
        self._fresh = set()  # the blocks whose state starts this step (_state_for)
        for block in blocks:
            outcome = self._prepare_block(block)
            if outcome is False:
                continue
            paired.update(id(leaf) for leaf in block.site.params.values())
            if outcome is not True:
                prepared.append(outcome)
        if self.annealing is not None and self.num_steps > 0 and prepared:
            self._warn_if_annealing_elsewhere(prepared)
        rest = [p for p in params if id(p) not in paired]
        if params and not blocks and not explained:  # a refused block said why (_prepare_block)
            self._warn_once("nothing paired", self._nothing_paired(params))
        with self._fallback_first(params, rest, *args, **kwargs):
            self._update_prepared(prepared, counts)
            table = (
                None if part_of_step else self._refuse_if_nothing_updated(params, prepared, counts)
            )
        try:  # the step is taken: a warning raised as an error (-W error) leaves it whole
            table = self._warn_if_held(prepared, counts, table)
            by_label = {site_label(item.site.name): item for item in prepared}
            for message in count_messages(
                counts, self._warned, table, lambda i: _unresolved_words(by_label[counts[i][0]])
            ):
                warnings.warn(
                    f"QNVB: {message} (this warning is shown once)",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
            self._warn_if_unbound_after_restore()
            self._warn_if_not_annealed()
        except BaseException:
            zero_grads(params)
            raise
        finally:
            self.num_steps += 1

    @contextlib.contextmanager
    def _fallback_first(
        self, params: list[torch.Tensor], rest: list[torch.Tensor], *args, **kwargs
    ) -> Iterator[None]:
        """The fallback's step of ``rest`` (`_guarded_fallback`), taken first and undone where
        what runs inside (the blocks' update, its refusal, a Ctrl-C) raises, so that the step is
        taken whole or not at all without a copy of the blocks; on any error the gradients of
        ``params`` are zeroed, as ``SVI`` zeroes them after a step, so that the next step does
        not add to them. `QNVB.__call__` and `SparseQNVB.__call__` step through it."""
        try:
            undo = self._guarded_fallback(rest, *args, **kwargs) if rest else None
            try:
                yield
            except BaseException:
                if undo is not None:
                    undo()
                raise
        except BaseException:
            zero_grads(params)
            raise

    def _refuse_second_model(self, params: list[torch.Tensor], blocks: list[QNVBBlock]) -> None:
        """Refuse a step, before anything changes, in which a parameter comes back that another
        tensor of its name replaced in this QNVB's states: two models (or guides) of the same
        parameter names stepped in turn (under ``module_local_params=True`` every model holds
        its own tensors under the same names). States are kept by name (`_state_for`,
        `_bind_fallback`), so each model's steps would restart the other's states, and the step
        count would advance for both. A rebuilt model, a restored param store or a kept
        reference to an old parameter is no such return: the old tensor is never stepped again.

        Raises:
            ValueError: naming the parameters and the fix (one ``QNVB`` per model).
        """
        in_blocks = {id(leaf) for block in blocks for leaf in block.site.params.values()}
        back = [
            block.site.param_names["loc"]
            for block in blocks
            if block.site.params["loc"] in self._replaced
        ]
        back += [
            self._replaced[p]
            for p in params
            if id(p) not in in_blocks and p not in self.optim_objs and p in self._replaced
        ]
        if back:
            raise ValueError(
                f"QNVB: the parameters {listed_names(sorted(back))} of this step come back after "
                "other tensors of the same names took their places in this QNVB: two models (or "
                "guides) with the same parameter names are stepped in turn with one QNVB (under "
                "pyro.settings.set(module_local_params=True) each model holds its own parameters "
                "under the same names). QNVB keeps its states by parameter name and one step "
                "count, so each model's steps restart the other's states (the other model's "
                "first step started afresh). Give each model (each SVI) its own QNVB(). Neither "
                "the parameters nor QNVB's states were changed by this step"
            )

    def _refuse_untrainable(self, params: list[torch.Tensor]) -> None:
        """Refuse a step that no parameter can take, before anything changes, with
        QuadratureELBO's words (which refuses these before QNVB is called): parameters that are
        inference tensors (the guide's first run was under ``torch.inference_mode()``: the
        fallback failed with torch's bare "Inplace update to inference tensor"), or a step under
        ``torch.no_grad()`` / ``inference_mode`` that no gradient reached (Pyro's ELBOs compute
        none there, and the step changed nothing, silently). Gradients computed before, outside
        such a context, are taken as a torch optimizer takes them."""
        made_in_inference = [p for p in params if p.is_inference()]
        if made_in_inference:
            names = functools.cache(_module_names)
            named = [
                self._fallback_name(p, names) or f"shape {tuple(p.shape)}"
                for p in made_in_inference
            ]
            raise inference_parameters_refusal("QNVB", named)
        if torch.is_grad_enabled():
            return
        if not any(p.grad is not None and bool(p.grad.any()) for p in params):
            raise step_without_grad_refusal("QNVB (svi.step)")

    def _warn_if_unbound_after_restore(self) -> None:
        """At the end of the first step after `set_state`: warn once if blocks started afresh
        in it while saved states bound to no parameter (a renamed site, another guide class)."""
        restored = self.__dict__.get("_restored_step")
        if restored is None or restored[0] != self.num_steps:
            return
        self._restored_step = None
        if restored[1] and self._pending:
            self._warn_once(
                "unbound after set_state",
                "QNVB: in the first step after set_state, the block(s) "
                f"{listed_names(sorted(restored[1]))} started afresh while the saved state(s) "
                f"of {listed_names(sorted(self._pending))} bound to no parameter: the state "
                "was saved for another model or guide (a renamed site, another guide class), "
                "so those blocks restarted (count 0, no curvature average). Restore a state "
                "into the model and guide it was saved from; a state that holds the blocks "
                "of another guide on purpose (two guides fitted in turn) keeps them, and "
                "this warning may be ignored",
            )

    def _warn_if_held(
        self, prepared: list[_Prepared], counts: list, table: list[list[int]] | None
    ) -> list[list[int]] | None:
        """Warn once per site whose mean is held nearly still by one past step
        (`_held_coordinates`), looked for at steps 10, 100, 1000, ... and at the step that would
        first warn of a sigma pinned at ``sigma_min`` (a held start pins it there: its warning,
        whose advice to lower ``sigma_min`` would be wrong, is then replaced by this one where
        every site it would count is held; a site pinned for its own reasons keeps it).
        Returns the step's counts table, read here if it was needed and not read yet."""
        pinned: set[str] = set()  # the labels of the sites with a sigma at sigma_min
        if "num_sigma_min" not in self._warned and counts:
            table = count_table(counts) if table is None else table
            column = COUNT_KINDS.index("num_sigma_min")
            pinned = {label for (label, *_), row in zip(counts, table) if row[column]}
        if not (pinned or _is_decade(self.num_steps + 1)):
            return table
        held_labels = set()
        for item in prepared:
            name = item.site.name
            label = site_label(name)
            warned = f"held {name}" in self._warned
            if warned and label not in pinned:
                continue
            held = held_site(item.state)
            if held is None:
                continue
            held_labels.add(label)
            if not warned:
                grad, s_avg = item.state["last_grad"][held], item.state["s_avg"][held]
                ratio = (s_avg.sqrt() / grad.abs()).max().item()
                message = _held_message(name, item, int(held.sum()), ratio)
                self._warn_once(f"held {name}", message)
        if pinned and pinned <= held_labels:  # else a site pinned for its own reasons is named
            self._warned.add("num_sigma_min")
        if _is_decade(self.num_steps + 1):
            self._warn_if_stalled(prepared)
        return table

    def _warn_if_stalled(self, prepared: list[_Prepared]) -> None:
        """At steps 10, 100, 1000, ...: compare each site's mean with its mean at the last of
        these checks, and warn once of the sites (`_damping_message`, from step 1,000: at 100
        converging fits still travel) whose median damping divisor is above
        `STALLED_DAMPING_FRACTION` of the step count while their means moved by more than
        `STALLED_DRIFT` sds since (still travelling, not noise about an optimum), where
        QuadratureELBO published the moments (under Monte Carlo gradients that growth is the
        averaging the damping is for), ``damping_recovery`` lets noise grow ``k`` (below 1) and
        the model declares no settings for the site (a `BayesianModule`'s weights, for which
        ``docs/qnvb.md`` keeps the default damping);
        and once per site (`_capped_message`) with a coordinate whose mean moved by
        `CAPPED_FRACTION` of ``lr`` a step or more since, in one direction, which the cap (at
        most about ``lr`` a step) allows only where it bound at nearly every step. Each watched
        site's loc is copied at each check for the next (no cost between checks)."""
        step = self.num_steps + 1
        marks = self.__dict__.setdefault("_marks", {})
        stalled = {}
        for item in prepared:
            name, hp, loc = item.site.name, item.hp, item.site.params["loc"].detach()
            watch_damping = (
                step >= 1000
                and "damping" not in self._warned
                and item.published
                and not item.site.hints
                and hp.damping
                and hp.damping_recovery < 1
            )
            watch_cap = 0 < hp.lr < math.inf and f"capped {name}" not in self._warned
            since, mark = marks.pop(name, (None, None))
            if mark is not None and mark.shape == loc.shape and since < step:
                moved = (loc - mark).abs()
                k = float(item.state["damping"].median()) if watch_damping else 0.0
                if k > STALLED_DAMPING_FRACTION * step:
                    scale = transform_to(item.site.param_constraints["scale"])(
                        item.site.params["scale"].detach()
                    )
                    if float((moved / scale).median()) > STALLED_DRIFT:
                        stalled[name] = (k, since)
                if watch_cap:
                    capped = int((moved >= CAPPED_FRACTION * hp.lr * (step - since)).sum())
                    if capped:
                        message = _capped_message(name, item, capped, since, step)
                        self._warn_once(f"capped {name}", message)
            if watch_damping or watch_cap:
                marks[name] = (step, loc.clone())
        if stalled:
            self._warn_once("damping", _damping_message(stalled, step))

    def _refuse_if_nothing_updated(
        self, params: list[torch.Tensor], prepared: list[_Prepared], counts: list
    ) -> list[list[int]] | None:
        """Refuse the `IDLE_STEPS_REFUSED`-th step in a row in which the guard (rule 11) kept
        every coordinate of every block (`count_idle_step`, the rule every QNVB optimizer
        shares): each ``g`` or ``h`` was not finite, or the update overflowed. Such a step
        changes no mean, scale or state. One bad minibatch (an outlier row whose ``g^2``
        overflows) gives one such step and passes with the count warnings; a cause that stays
        (the unscaled Poisson of a user trial ran 1,000 such steps, loss 2.4e25, after one
        warning) repeats at every step. Raised before the fallback steps, with the gradients of
        ``params`` zeroed as ``SVI`` zeroes them after a step, so that the next step may go on.
        Returns the counts it read from the device (`count_table`), which the step's warnings
        then read without another copy (``None`` if nothing was updated: no counts)."""
        total = sum(item.values["loc"].numel() for item in prepared)
        if not total:
            return None
        table = count_table(counts)
        self._idle_steps = count_idle_step(self._idle_steps, kept_coordinates(table), total)
        if self._idle_steps < IDLE_STEPS_REFUSED:
            return table
        zero_grads(params)
        raise idle_step_refusal(
            "QNVB",
            self._idle_steps,
            total,
            [label for label, *_ in counts],
            [dtype for _, _, dtype, _ in counts],
            unit="block",
            words=QNVB_IDLE,
            untaken="the fallback did not step",
            scales=[
                (site_label(item.site.name), item.values["scale"], item.hp.sigma_min)
                for item in prepared
            ],
        )

    def _nothing_paired(self, params: list[torch.Tensor]) -> str:
        """The warning of a step that paired none of ``params`` with a guide: its cause, where
        the received parameters are store tensors a live guide's own plain parameters were cut
        off from (`detached_parameters`: the store was restored after
        the guide's last run), or the guides QNVB updates."""
        head = (
            f"QNVB: none of the {len(params)} parameters it received belongs to a guide it can "
            "update, so all of them go to the fallback optimizer "
            f"({self.pt_optim_constructor.__name__})."
        )
        store = pyro.get_param_store()
        received = {store.param_name(p) for p in params}
        cut = sorted(
            {name for guide in live_guides() for name in detached_parameters(guide)} & received
        )
        if cut:
            return (
                f"{head} The guide's own parameter(s) {cut} are not the param store's tensors "
                "under those names (the store was restored, set_state or load, after the guide's "
                "last run), so the store's tensors it received reach no guide. Call "
                "pyro_quadvi.store.follow_param_store(guide) after restoring the store (the "
                "guide's next run does it under QNVB)."
            )
        return (
            f"{head} Use AutoMeanFieldNormal (or Pyro's AutoNormal / AutoDiagonalNormal), or "
            "describe a guide of your own (quadrature_description; see 'Writing a guide for "
            "QuadratureELBO and QNVB'). An amortized guide (an encoder network: its locs and "
            "scales are the network's outputs, not parameters of a site) has no block QNVB can "
            "update: it trains with pyro.optim.Adam, so pass that to SVI (the fallback optimizer "
            "does its work now). A guide whose run is no nn.Module call (Pyro's "
            "AutoNormalMessenger, a guide function or callable object) is found only once "
            "registered: call pyro_quadvi.guides.register_guide(guide) once (QuadratureELBO "
            "needs none). Pyro's other effect-based guides and easy_guide guides are not read."
        )

    def _warn_if_annealing_elsewhere(self, prepared: list[_Prepared]) -> None:
        """Warn once when every block of this step starts afresh while the annealing schedule is
        read at this QNVB's step count, not at 0: the QNVB is reused for a new fit (after
        ``pyro.clear_param_store()``) or shared with another model, whose schedule then starts
        part-way, or already over."""
        if any(item.site.param_names["loc"] not in self._fresh for item in prepared):
            return
        self._warn_once(
            "annealing elsewhere",
            f"QNVB: every block of this step starts afresh, but this QNVB has taken "
            f"{self.num_steps} steps, and its annealing schedule is read at its step count: this "
            f"fit starts at factor {self.annealing_factor:.4g}, not at the schedule's step 0. The "
            "step count (the annealing position) belongs to the QNVB object: for a new fit or "
            "another model build a new QNVB, or restore its state with set_state (a schedule "
            "shared on purpose, by models fitted in turn, needs nothing).",
        )

    def __getstate__(self) -> dict:
        """The state ``pickle`` and ``copy.deepcopy`` take: without the descriptions of a step
        under way (`describe`), which hold the guides and their non-leaf tensors, and
        with every block's state kept by its name alone, not beside the live parameter it is
        bound to (which belongs to Pyro's param store, and holds a weak reference ``pickle``
        cannot take): a copy binds each state again at its block's next use, as after
        `set_state`, so it goes on exactly as the original would with the same store.
        The guide runs blocks were read from are left out too: their numbers mean nothing to
        another process (`stale_rows_refusal`)."""
        state = self.__dict__.copy()
        state["_described"] = None
        state["_runs_read"] = {}
        state["_pending"] = {
            **self._pending,
            **self._live(),
        }
        state["_bound"] = {}
        state["_marks"] = {}  # the means of the last check (`_warn_if_stalled`): not kept
        del state["_replaced"]  # weak references: made anew (empty) by __setstate__
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore what `__getstate__` kept, and install the guide watch (the global
        module hook by which QNVB finds the guides that run, installed by the constructor): a
        process that only unpickles a QNVB (``torch.load``) found no guide under Pyro's own ELBOs,
        and its steps went to the fallback."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_fallback_names", {})  # (absent from earlier versions)
        self.__dict__.setdefault("_replaced", WeakIdKeyDictionary())
        watch_guides()

    def describe(self, params: Iterable[torch.Tensor]) -> list[tuple[Callable, GuideDescription]]:
        """`describe_live_guides` of ``params``, made for
        this step: the descriptions `find_blocks` and the step (``descriptions=``) take,
        until the step ends. A description holds the rows its guide's last run used, so one made
        for another step would update the wrong rows: they are refused."""
        descriptions = describe_live_guides(params)
        self._described = (self.num_steps, descriptions)
        return descriptions

    @torch.no_grad()
    def find_blocks(
        self,
        params: list[torch.Tensor],
        descriptions: list[tuple[Callable, GuideDescription]] | None = None,
    ) -> tuple[list[QNVBBlock], bool]:
        """The blocks QNVB updates among ``params`` in this step, and whether a warning explained
        why some guide was not paired (else a step pairing nothing warns that nothing was).

        Takes the moments published for ``params``
        (`published_moments`: they are consumed, so a
        caller that changes them, averaging them over ranks say, publishes the new ones again
        with `publish_moments` before calling QNVB, as
        `DistributedOptimizer` does; the blocks come in the order
        of ``params``, which is a set's order under ``SVI``: sort before reducing over ranks); the
        parameters they leave uncovered are paired by identity with the blocks of
        ``descriptions`` (what `describe` returned in this step; made here when
        ``None``), read from their gradients. Warns once for each block it cannot update (a
        family without an update, a parameter missing) and each joint Gaussian holding one of
        ``params``: they go to the fallback.
        """
        if descriptions is not None and (
            self._described is None
            or self._described[1] is not descriptions
            or self._described[0] != self.num_steps
        ):
            raise ValueError(
                "QNVB: descriptions= takes what QNVB.describe(params) returned in this same step "
                "(a description holds the rows its guide's last run used; one made for another "
                "step would update the wrong rows); pass None to let QNVB describe the guides"
            )
        received = {id(p) for p in params}
        blocks: dict[int, QNVBBlock] = {}
        explained = False
        published = [m for m in map(published_moments, params) if m is not None]
        for moments in self._agreed_moments(published):
            blocks[id(moments.site.params["loc"])] = QNVBBlock(moments.site, moments)
        covered = {id(leaf) for block in blocks.values() for leaf in block.site.params.values()}
        if received <= covered:
            # every parameter belongs to a block with published moments: describing the live
            # guides (a transform of every scale each) could add no block and no warning
            return self._checked_blocks(blocks, received, explained)
        if descriptions is None:
            descriptions = describe_live_guides(params)
        stored: set[int] | None = None  # the param store's tensors, read where needed
        for guide, description in descriptions:
            run = last_run_stamp(guide)
            for site in description.sites:
                outside = [r for r, leaf in site.params.items() if id(leaf) not in received]
                if outside:  # a leaf not received: frozen, another model's, or computed
                    if stored is None:
                        stored = {id(p) for _, p in pyro.get_param_store().named_parameters()}
                    own = guide.parameters() if isinstance(guide, torch.nn.Module) else ()
                    known = stored | {id(p) for p in own}
                    computed = [r for r in outside if id(site.params[r]) not in known]
                    if computed:
                        explained = True
                        self._warn_once(f"computed {site.name}", _computed_message(site, computed))
                        continue
                key = id(site.params["loc"])
                if key in received and key not in blocks:
                    blocks[key] = QNVBBlock(site, None, run)
            joint = description.joint
            if joint is not None and any(id(p) in received for p in joint.params.values()):
                explained = True
                self._warn_once(
                    f"joint {description.guide}",
                    f"QNVB: {type(guide).__name__} {description.guide!r} is a joint Gaussian "
                    f"(family {joint.family!r}), not a mean field: QNVB updates mean fields only, "
                    "so its parameters go to the fallback optimizer. Use AutoMeanFieldNormal for "
                    "QNVB updates, or a first-order optimizer for this guide.",
                )
        described = covered | {id(leaf) for _, d in descriptions for leaf in d.leaves()}
        if not received <= described:
            explained |= self._warn_undescribed_parts(params, received & described)
        return self._checked_blocks(blocks, received, explained)

    @staticmethod
    def _checked_coordinates(moments: PublishedMoments) -> torch.Tensor | None:
        """A block's loc, unconstrained and constrained scale, published ``g`` and ``h``, and loc
        and scale gradients at its rows, at its checked coordinates (`_checked`), as
        `_gaussian_entropy_weights` compares them; ``None``: not checked (a family without that
        check, a frozen parameter or a scale without a gradient, which the step holds or sends to
        the fallback, a masked site, which it refuses, or a block without coordinates)."""
        site = moments.site
        loc_leaf, scale_leaf = site.params["loc"], site.params["scale"]
        if (
            site.family != "gaussian"
            or not (loc_leaf.requires_grad and scale_leaf.requires_grad)
            or scale_leaf.grad is None
            or masked_site_refusal(site) is not None
            or site.loc.numel() == 0
        ):
            return None
        loc_grad, scale_grad, scale_leaf = loc_leaf.grad, scale_leaf.grad, scale_leaf.detach()
        index = _row_index(loc_leaf.shape, site.rows)
        if index is not None:
            scale_leaf, loc_grad, scale_grad = scale_leaf[index], loc_grad[index], scale_grad[index]
        # the scale the moments and the gradients were computed at
        return _checked(
            [site.loc, scale_leaf, site.scale, moments.g, moments.h, loc_grad, scale_grad]
        )

    def _entropy_weights(self, published: list[PublishedMoments]) -> list[float | None]:
        """The entropy weight of each of ``published`` at its `_checked_coordinates` (``None``:
        not checked; `_gaussian_entropy_weights`): the blocks' coordinates are read from each
        device in one go, and compared at once for the blocks sharing a dtype, a scale
        constraint and a minibatch scale."""
        groups: dict[tuple, list[int]] = {}
        checked: dict[int, torch.Tensor] = {}
        for i, moments in enumerate(published):
            coordinates = self._checked_coordinates(moments)
            if coordinates is not None:
                site = moments.site
                constraint = site.param_constraints["scale"]
                key = (coordinates.device, coordinates.dtype, constraint, site.scale_factor)
                groups.setdefault(key, []).append(i)
                checked[i] = coordinates
        on_host = {}  # device -> its blocks' coordinates, in the order of groups
        for device in dict.fromkeys(key[0] for key in groups):
            tensors = [
                checked[i] for key, members in groups.items() if key[0] == device for i in members
            ]
            on_host[device] = torch.cat(tensors, 1).to("cpu", torch.float64)
        start = dict.fromkeys(on_host, 0)
        weights: list[float | None] = [None] * len(published)
        for (device, dtype, _, _), members in groups.items():
            counts = [checked[i].shape[1] for i in members]
            end = start[device] + sum(counts)
            rows = on_host[device].narrow(1, start[device], end - start[device])
            site = published[members[0]].site  # its scale constraint and minibatch scale
            for i, c in zip(members, _gaussian_entropy_weights(site, rows, counts, dtype)):
                weights[i] = c
            start[device] = end
        return weights

    def _agreed_moments(self, published: list[PublishedMoments]) -> list[PublishedMoments]:
        """The ``published`` moments QNVB steps on, checked against the gradients it was
        handed (`_gaussian_entropy_weights`, at most `CHECKED_COORDINATES` coordinates a
        block). A block whose loc has no gradient is dropped
        (moments of a backward pass whose gradients were cleared since). A loss ``c`` times one
        ``QuadratureELBO``'s (a mean over ``c`` rows, two backward passes, two terms on one
        guide) gives moments divided by ``c``: the step is that of the loss's optimum. A block
        whose gradients do not fit is dropped with a warning naming the site: it is read from
        its gradients (`GRADIENT_IDENTITIES`), whose fixed points are the loss's stationary
        points whatever its terms."""
        published = [m for m in published if m.site.params["loc"].grad is not None]
        kept = []
        for moments, c in zip(published, self._entropy_weights(published)):
            site = moments.site
            if c is None or c == 1.0:
                kept.append(moments)
            elif c == c:  # not NaN
                kept.append(replace(moments, g=moments.g / c, h=moments.h / c))
            else:
                self._warn_once(
                    f"unpublished {site.name}",
                    f"QNVB: the gradients of site {site.name!r} are not those of the loss that "
                    "QuadratureELBO published its moments with (nor that loss times one "
                    "number): the loss stepped on holds other terms (another ELBO's, a penalty "
                    "on the guide's parameters, a gradient hook), or the moments are another "
                    "backward pass's (a validation loss's, whose gradients were cleared since). "
                    "QNVB reads the site's g and h from its gradients, as for Pyro's ELBOs, "
                    "whose fixed point is the loss's optimum; average two ELBO terms rather than "
                    "sum them (the entropy counted twice reads h too small and can hold the "
                    "scales). To step on the moments, backward only QuadratureELBO terms before "
                    "each step, and take other losses under torch.no_grad() (or "
                    "SVI.evaluate_loss).",
                )
        return kept

    def _warn_undescribed_parts(self, params: list[torch.Tensor], described: set[int]) -> bool:
        """Warn once for each AutoGuide of a kind QNVB cannot describe that holds some of
        ``params`` outside ``described``: they go to the fallback. The message names the guide's
        class and tells a part of an ``AutoGuideList`` (an ``AutoDelta`` beside an
        ``AutoNormal``, say: QNVB updates the other parts) from a whole guide (an
        ``AutoStructured``, say: QNVB updates none of it). The guides are those seen running
        (`undescribed_guides`), matched by the identity of
        their parameters; the model's own ``pyro.param`` s belong to no guide."""
        rest = {id(p) for p in params} - described
        fallback = self.pt_optim_constructor.__name__
        warned = False
        for guide in undescribed_guides():
            held = [p for p in guide.parameters() if id(p) in rest]
            if not held:
                continue
            warned = True
            kind = guide_class_name(guide)
            name = guide._pyro_name or kind
            owner = guide.master() if guide.master is not None else None  # its AutoGuideList
            if owner is None:
                message = (
                    f"QNVB: the guide {name!r} ({kind}, the whole guide, not a part of an "
                    "AutoGuideList) is of a kind QNVB cannot describe, so QNVB updates none of "
                    f"its parameters: they all go to the fallback optimizer ({fallback}). Fit "
                    "it with Pyro's Adam directly (pyro.optim.Adam), or use a guide QNVB "
                    "describes (AutoMeanFieldNormal, AutoNormal, AutoDiagonalNormal)."
                )
            else:
                what = "its point estimates (a MAP fit of its latents)"
                if not isinstance(guide, AutoDelta):
                    what = "its parameters"
                message = (
                    f"QNVB: the guide part {name!r} ({kind}) is of a kind QNVB cannot describe, "
                    f"so {what} go to the fallback optimizer ({fallback}); QNVB updates the "
                    f"parts of the AutoGuideList {owner._pyro_name!r} it describes. For QNVB "
                    "updates of its latents make it a Gaussian part (AutoMeanFieldNormal, "
                    "AutoNormal, AutoDiagonalNormal)."
                )
            self._warn_once(f"undescribed {name}", message)
        return warned

    def _checked_blocks(
        self, blocks: dict[int, QNVBBlock], received: set[int], explained: bool
    ) -> tuple[list[QNVBBlock], bool]:
        """The blocks QNVB can update (a family it knows, all parameters received); a warning
        for each other one, which then goes to the fallback."""
        found = []
        # by the loc's name: the blocks of SVI's set of parameters come in the order of their
        # tensors' addresses, which get_state's keys and the warnings' first site would follow
        for block in sorted(blocks.values(), key=lambda b: str(b.site.param_names["loc"])):
            site = block.site
            missing = [r for r, leaf in site.params.items() if id(leaf) not in received]
            if site.family not in FAMILY_UPDATES:
                explained = True
                self._warn_once(
                    f"family {site.family}",
                    f"QNVB: site {site.name!r} has family {site.family!r}, which QNVB has no "
                    f"update for (it has {sorted(FAMILY_UPDATES)}); its parameters go to the "
                    "fallback optimizer",
                )
            elif any(site.params[role].grad_fn is not None for role in missing):
                explained = True
                self._warn_once(f"computed {site.name}", _computed_message(site, missing))
            elif missing:
                explained = True
                self._warn_once(
                    f"missing {site.name}",
                    f"QNVB: site {site.name!r} came without its {missing} parameters in this step "
                    "(are they frozen or detached?); its parameters go to the fallback optimizer",
                )
            else:
                found.append(block)
        return found, explained

    def _state_for(self, name: str, loc_leaf: torch.Tensor) -> dict[str, torch.Tensor]:
        bound = self._bound.get(name)
        if bound is not None and bound[0]() is loc_leaf:
            return bound[1]
        state = self._pending.get(name)
        if state is not None and state["g_avg"].shape != loc_leaf.shape:
            raise ValueError(
                f"QNVB: the restored state of the block {name!r} has shape "
                f"{tuple(state['g_avg'].shape)}, but its parameter now has shape "
                f"{tuple(loc_leaf.shape)}: the state (and its step count {self.num_steps}, the "
                "annealing position) was saved for another model. Restore a state only into the "
                "model it was saved from; fit a changed model with a new QNVB (no set_state) "
                "after pyro.clear_param_store()"
            )
        if bound is not None and bound[0]() is not None:  # another live tensor of this name
            self._replaced[bound[0]()] = name
        self._pending.pop(name, None)
        if state is None:
            state = init_qnvb_state(loc_leaf.detach())._asdict()
            self._fresh.add(name)
            restored = self.__dict__.get("_restored_step")  # set_state's record of its step
            if restored is not None and restored[0] == self.num_steps:
                restored[1].add(name)
        else:  # a state saved on another device or in another float type follows its
            # parameter, as torch's Optimizer.load_state_dict casts its state
            state = dict(state)
            cast_state_to(loc_leaf, state)
        self._bound[name] = (weakref.ref(loc_leaf), state)
        return state

    def _live(self) -> dict[str, dict[str, torch.Tensor]]:
        """The states of the blocks whose loc parameter is alive. A block whose parameter was
        collected (``pyro.clear_param_store()`` and the guide gone, a QNVB reused for another
        model) could never be bound again, a parameter of the same name being another tensor
        (`_state_for`): its state is dropped, which a reused QNVB kept, 36 bytes a coordinate
        of every earlier model, in memory and in `get_state`."""
        self._bound = {name: bound for name, bound in self._bound.items() if bound[0]() is not None}
        return {name: state for name, (_, state) in self._bound.items()}

    @torch.no_grad()
    def _prepare_block(self, block: QNVBBlock) -> _Prepared | bool:
        """The block's values, moments and state for its family's update; ``True`` if it has
        nothing to do this step, ``False`` if it cannot step (it goes to the fallback)."""
        site = block.site
        loc_leaf, scale_leaf = site.params["loc"], site.params["scale"]
        if block.moments is None and loc_leaf.grad is None and scale_leaf.grad is None:
            return True  # not used by this step's loss: nothing to do, nothing for the fallback
        frozen = [role for role in ("loc", "scale") if not site.params[role].requires_grad]
        if len(frozen) == 2:  # held, as torch's optimizers hold a parameter without a gradient
            return True
        if frozen:
            self._warn_once(f"frozen {site.name}", _half_frozen(site.name, frozen[0]))
            return False
        refusal = masked_site_refusal(site)
        if refusal is not None:
            raise refusal
        if block.moments is None and (loc_leaf.grad is None or scale_leaf.grad is None):
            self._warn_once(f"one gradient {site.name}", _one_gradient(site.name, loc_leaf))
            return False
        name = site.param_names["loc"]
        rows = site.rows
        index = _row_index(loc_leaf.shape, rows)

        def select(t: torch.Tensor) -> torch.Tensor:
            return t if index is None else t[index]

        u = select(scale_leaf.detach())
        # the loc's memory through .data, which the update writes (donated) as the write-back
        # did at every step: without a bump of the parameter's version counter
        values = {"loc": select(loc_leaf.data), "scale_leaf": u}
        if block.moments is None or site.family not in _FAMILY_BATCH_UPDATES:
            # else the blocks updated together transform their scales in one go (_constrain)
            values["scale"] = transform_to(site.param_constraints["scale"])(u)
        if block.moments is not None:
            g, h = block.moments.g, block.moments.h
        elif site.family in GRADIENT_IDENTITIES:
            refusal = (
                minibatch_refusal(site)
                or stale_rows_refusal(site, block.run, self._runs_read.get(name))
                or outside_rows_refusal(site, index)
            )
            if refusal is not None:
                raise refusal
            if block.run is not None:
                self._runs_read[name] = block.run.number
            grads = {"loc": select(loc_leaf.grad), "scale": select(scale_leaf.grad)}
            g, h = GRADIENT_IDENTITIES[site.family](site, values, grads)
        else:
            self._warn_once(
                f"no moments {site.name}",
                f"QNVB: site {site.name!r} (family {site.family!r}) needs the moments that "
                "QuadratureELBO publishes; fit it with QuadratureELBO. It goes to the fallback.",
            )
            return False

        state = self._state_for(name, loc_leaf)
        old = QNVBState(*(select(state[key]) for key in QNVBState._fields))
        hp = self.block_hyperparameters(name, site.hints)
        self._block_settings[name] = (hp, site.hints)
        return _Prepared(site, values, g, h, old, hp, state, index, block.moments is not None)

    @torch.no_grad()
    def _update_prepared(self, prepared: list[_Prepared], counts: list) -> None:
        """The family updates of the prepared blocks, those sharing a family with a batched
        update and hyperparameters together; appends each block's `result_counts`."""
        together: dict[tuple, list[_Prepared]] = {}
        for item in prepared:
            if item.site.family in _FAMILY_BATCH_UPDATES:
                constraint = item.site.param_constraints["scale"]
                loc = item.values["loc"]  # one buffer holds one dtype on one device
                key = (item.site.family, item.hp, constraint, loc.dtype, loc.device)
                together.setdefault(key, []).append(item)
            else:
                _check_dtype(item)
                update = FAMILY_UPDATES[item.site.family]
                new_values, result = update(item.values, item.g, item.h, item.old, item.hp)
                self._finish_block(item, new_values, result, counts)
        for (family, hp, constraint, _, _), items in together.items():
            _check_dtype(items[0])  # one dtype for the group
            transform = transform_to(constraint)
            _constrain([item for item in items if "scale" not in item.values], transform)
            outcomes = _FAMILY_BATCH_UPDATES[family](
                [item.values for item in items],
                [item.g for item in items],
                [item.h for item in items],
                [item.old for item in items],
                hp,
                self.compile,
            )
            whole = [self._whole(item) for item in items]
            rebound = self._finish_together(
                [(item, *outcome) for item, outcome, w in zip(items, outcomes, whole) if w],
                transform,
            )
            for item, (new_values, result), w in zip(items, outcomes, whole):
                if w:
                    label = site_label(item.site.name)
                    dtype = item.values["loc"].dtype
                    counts.append((label, hp, dtype, result_counts(result)))
                else:
                    self._finish_block(item, new_values, result, counts)
            if not (rebound and all(whole)):
                self._share_storage(items)

    @staticmethod
    def _share_storage(items: list[_Prepared]) -> None:
        """Put the states of blocks updated together into one buffer per field, each block's a
        view of it, so that the next update reads them without a copy (states are written in
        place). Blocks updated on a subset of rows keep their own."""
        if len(items) < 2 or any(item.index is not None for item in items):
            return
        for key in QNVBState._fields:
            tensors = [item.state[key] for item in items]
            if consecutive_base(tensors) is not None:
                continue
            pieces = torch.cat([t.reshape(-1) for t in tensors]).split([t.numel() for t in tensors])
            for item, piece, t in zip(items, pieces, tensors):
                item.state[key] = piece.view(t.shape)

    @staticmethod
    def _whole(item: _Prepared) -> bool:
        """Whether a block is updated on all its entries (no minibatch rows):
        `_finish_together` can write it."""
        return item.index is None

    @staticmethod
    def _finish_together(picked: list, transform) -> bool:
        """`_finish_block` of blocks updated on all their entries, sharing the scale's
        transform: the inverse transform and the guard run once on all of them (elementwise,
        and through vectorized kernels without a scalar tail, unlike the softplus: each value is
        the one `_finish_block` writes, bit for bit, as the tests check), and a state that
        the update returned as pieces of one buffer becomes the block's state without a copy.

        Returns whether every field of the states was so rebound (then they share one buffer).
        """
        if not picked:
            return False
        sigma = _flatten([item.values["scale"] for item, _, _ in picked])
        new_sigma = _flatten([new_values["scale"] for _, new_values, _ in picked])
        u = _flatten([item.values["scale_leaf"] for item, _, _ in picked])
        new_u = transform.inv(new_sigma)
        new_u = torch.where((new_sigma == sigma) | _not_finite_mask(new_u), u, new_u)
        new_us = new_u.split([item.values["scale_leaf"].numel() for item, _, _ in picked])
        rebound = True
        for key, field in zip(QNVBState._fields, zip(*(result.state for _, _, result in picked))):
            shared = consecutive_base(list(field)) is not None
            rebound &= shared
            for (item, _, _), value in zip(picked, field):
                if shared:
                    item.state[key] = value
                elif value is not item.state[key]:
                    item.state[key].copy_(value)
        for (item, new_values, _), piece in zip(picked, new_us):
            site = item.site
            loc = site.params["loc"].data
            if not _same_memory(new_values["loc"], loc):  # else written by the update (donated)
                loc.copy_(new_values["loc"])
            site.params["scale"].data.copy_(piece.view(site.params["scale"].shape))
        return rebound

    def _finish_block(self, item: _Prepared, new_values, result: QNVBResult, counts) -> None:
        """Write one block's update back into its parameters and state."""
        site, values, index = item.site, item.values, item.index
        loc_leaf, scale_leaf = site.params["loc"], site.params["scale"]
        transform = transform_to(site.param_constraints["scale"])
        u = values["scale_leaf"]
        new_mu, new_sigma, new_state = new_values["loc"], new_values["scale"], result.state
        counts.append((site_label(site.name), item.hp, values["loc"].dtype, result_counts(result)))
        # an unchanged sigma keeps its parameter bit for bit (no round trip through the transform);
        # sigma_min keeps the inverse finite, a coordinate it cannot represent stays unchanged
        new_u = transform.inv(new_sigma)
        new_u = torch.where((new_sigma == values["scale"]) | _not_finite_mask(new_u), u, new_u)
        for key, value in zip(QNVBState._fields, new_state):
            self._write(item.state[key], index, value)
        self._write(loc_leaf.data, index, new_mu)
        self._write(scale_leaf.data, index, new_u)

    @staticmethod
    def _write(target: torch.Tensor, index: tuple | None, value: torch.Tensor) -> None:
        if index is None:
            target.copy_(value)
        else:
            target[index] = value

    @torch.no_grad()
    def _guarded_fallback(self, params: list[torch.Tensor], *args, **kwargs) -> Callable[[], None]:
        """The fallback's step, with coordinates whose gradient or new value is not finite kept;
        returns what undoes it (for a step whose blocks' update then fails, `_fallback_first`).

        One host sync per step tells whether anything was not finite; only then are the
        coordinates found and named. Where it raises (a Ctrl-C between two parameters' steps, a
        warning turned into an error), and where its undo is called, its parameters and their
        optimizers' states are put back as they were (copies of the parameters taken anyway, and
        of the states: the fallback's parameters are few, point estimates).
        """
        self._bind_fallback(params)
        with_grad = [p for p in params if p.grad is not None]
        bad_grads = [~torch.isfinite(p.grad) for p in with_grad]
        old = [p.detach().clone() for p in with_grad]
        states = [  # a torch optimizer's state: tensors, and numbers (an int step count)
            {k: copy.deepcopy(v) for k, v in self.optim_objs[p].state[p].items()} for p in with_grad
        ]
        for p, bad in zip(with_grad, bad_grads):
            p.grad = torch.where(bad, 0.0, p.grad)

        @torch.no_grad()
        def undo() -> None:  # its parameters and their optimizers' states as they were
            for p, before, state in zip(with_grad, old, states):
                p.copy_(before)
                self.optim_objs[p].state[p] = state

        try:
            super().__call__(params, *args, **kwargs)
            bad = [b | ~torch.isfinite(p) for p, b in zip(with_grad, bad_grads)]
            if not bad or not torch.stack([b.any() for b in bad]).any():
                return undo
            for p, before, mask in zip(with_grad, old, bad):
                if mask.any():
                    p.copy_(torch.where(mask, before, p))
                    name = (
                        pyro.get_param_store().param_name(p)
                        or f"a tensor of shape {tuple(p.shape)}"
                    )
                    self._warn_once(
                        f"fallback {name}",
                        f"QNVB: the fallback optimizer met a non-finite gradient or value at "
                        f"{int(mask.sum())} coordinates of {name!r}; they were left unchanged "
                        "(this warning is shown once per parameter)",
                    )
        except BaseException:
            undo()
            raise
        return undo

    def _bind_fallback(self, params: list[torch.Tensor]) -> None:
        """Give each of ``params`` new to the fallback its torch optimizer, keyed by the name
        `_fallback_name` finds, with the state `set_state` left under that name; the optimizer of
        a tensor that had the name before (a restored store's or a rebuilt model's predecessor)
        is dropped (should that tensor come back, another model's, it is refused:
        `_refuse_second_model`).
        Pyro keys by the param store's name, which is ``None`` for every parameter under
        ``module_local_params=True`` (their states collapsed into one), and keeps the optimizer
        of a replaced tensor for ever. A name another of ``params`` has (two modules of one
        name) is not taken: `get_state` refuses such a parameter."""
        new = [p for p in params if p not in self.optim_objs]
        if not new:
            return
        names = functools.cache(_module_names)
        taken = {self._fallback_names.get(p) for p in params if p in self.optim_objs}
        for p in new:
            name = self._fallback_name(p, names)
            if name is not None and name in taken:
                name = None
            taken.add(name)
            if name is not None:
                for q in [q for q, held in self._fallback_names.items() if held == name]:
                    del self.optim_objs[q], self.grad_clip[q], self._fallback_names[q]
                    self._replaced[q] = name
            self.optim_objs[p] = self._get_optim(p)
            self.grad_clip[p] = self._get_grad_clip(p)
            self._fallback_names[p] = name
            state = None if name is None else self._state_waiting_to_be_consumed.pop(name, None)
            if state is not None:
                self.optim_objs[p].load_state_dict(state)

    @staticmethod
    def _fallback_name(p: torch.Tensor, names: Callable[[], dict[int, str]]) -> str | None:
        """The name of fallback parameter ``p``: the param store's, else that of its Pyro
        ``param`` site in a ``PyroModule`` guide seen running or in that guide's ``PyroModule``
        model (`pyro_parameter_names`: under ``module_local_params=True`` the store names none),
        as QNVB names its blocks; ``None`` if neither knows it."""
        return pyro.get_param_store().param_name(p) or names().get(id(p))

    def _fallback_state(self) -> dict:
        """Deep copies of the fallback's states by name: those `set_state` restored that no
        parameter took yet, and over them the live optimizers' (which a `get_state` right after
        `set_state` would otherwise lose).

        Raises:
            ValueError: for a live optimizer whose parameter has no name (`_bind_fallback`),
                naming its shape and the fix: saved under ``None``, its state would be restored
                into whichever unnamed parameter came first.
        """
        state = dict(self._state_waiting_to_be_consumed)
        names = functools.cache(_module_names)
        for p, optimizer in self.optim_objs.items():
            if p in self._fallback_names:
                name = self._fallback_names[p]
            else:  # (an optimizer made before this version kept the names)
                name = self._fallback_names[p] = self._fallback_name(p, names)
            if name is None:
                raise ValueError(
                    f"QNVB.get_state: the fallback optimizer "
                    f"({self.pt_optim_constructor.__name__}) holds the state of a parameter of "
                    f"shape {tuple(p.shape)} that has no name to save it under: the param store "
                    "does not name it (under pyro.settings.set(module_local_params=True) it names "
                    "none), no PyroModule guide seen running nor that guide's PyroModule model "
                    "holds it, or another parameter of its step has its name (two modules of one "
                    "name). Saved without a name, its state would be restored into another "
                    "parameter. Build the guide from the PyroModule model itself "
                    "(AutoMeanFieldNormal(model)), give the modules distinct names, or fit in "
                    "Pyro's global param store (module_local_params=False)"
                )
            state[name] = optimizer.state_dict()
        return copy.deepcopy(dict(sorted(state.items(), key=lambda item: str(item[0]))))

    def _restore_fallback(self, state: dict) -> None:
        """Drop the fallback's optimizers and keep deep copies of the saved ``state``: each
        parameter takes its own at the next step (`_bind_fallback`)."""
        self.optim_objs.clear()
        self.grad_clip.clear()
        self._fallback_names.clear()
        self._state_waiting_to_be_consumed = copy.deepcopy(state)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())

    # -------------------------------------------------------------------------------- state
    def get_state(self) -> dict:
        """Deep copies of every block's state, the step count and the fallback's states, and
        each block's hyperparameters with its model's hints (checked by `set_state`)."""
        blocks = {name: dict(state) for name, state in self._pending.items()}
        blocks.update(self._live())
        blocks = dict(sorted(blocks.items()))  # by name, whatever order the blocks came in
        return {
            "qnvb": {
                "num_steps": self.num_steps,
                "idle_steps": self._idle_steps,
                "pairs": {
                    name: {key: value.clone() for key, value in state.items()}
                    for name, state in blocks.items()
                },
                "settings": {
                    name: {"hyperparameters": asdict(hp), "hints": dict(hints)}
                    for name, (hp, hints) in sorted(self._block_settings.items())
                    if name in blocks
                },
            },
            "fallback": self._fallback_state(),
        }

    def set_state(self, state_dict: dict) -> None:
        """Restore what `get_state` returned (block states bind at their next use).

        Each block's saved hyperparameters are compared with those this QNVB gives the block
        under the same model hints: a ``ValueError`` names the block and every setting that
        differs, and nothing is restored. A state saved without them (an earlier version) loads
        unchecked. States of blocks not (yet) seen are kept and written out again by
        `get_state`; if in the first step after the restore a block starts afresh while saved
        states stay unbound (a renamed site, another guide class), a warning names both, once
        at the end of that step. A block's state binds on its
        parameter's device and, where floating, in its dtype (a state saved on the CPU resumes a
        CUDA fit), as
        ``torch.optim.Optimizer.load_state_dict`` moves and casts its state.

        Raises:
            ValueError: for a state without the keys ``"qnvb"`` and ``"fallback"``, such as a
                ``PyroOptim``'s (``pyro.optim.Adam(...).get_state()``), saying how to go on.
        """
        if not (isinstance(state_dict, dict) and {"qnvb", "fallback"} <= state_dict.keys()):
            keys = list(state_dict)[:3] if isinstance(state_dict, dict) else None
            raise ValueError(
                "QNVB.set_state takes what QNVB.get_state() returned, a dict with the keys "
                f"'qnvb' and 'fallback'; got {type(state_dict).__name__}"
                + ("" if keys is None else f" with keys {keys}{'...' * (len(state_dict) > 3)}")
                + ". A dict keyed by parameter names is a PyroOptim's per-parameter state "
                "(pyro.optim.Adam(...).get_state()), which QNVB cannot take: its moments are "
                "Adam's, not QNVB's curvature averages. To move a fit from Adam to QNVB, keep "
                "Pyro's param store (the guide's locs and scales hold the fit) and start QNVB "
                "fresh, without set_state; its blocks start their averages at the next step"
            )
        qnvb = state_dict["qnvb"]
        settings = {}
        for name, record in qnvb.get("settings", {}).items():
            hints = dict(record["hints"])
            hp = self.block_hyperparameters(name, hints)
            check_settings(
                f"QNVB.set_state (block {name!r})", record["hyperparameters"], asdict(hp)
            )
            settings[name] = (hp, hints)
        self.num_steps = qnvb["num_steps"]
        self._idle_steps = qnvb.get("idle_steps", 0)  # (absent from earlier states)
        self._bound.clear()
        self._pending = {
            name: {key: value.clone() for key, value in state.items()}
            for name, state in qnvb["pairs"].items()
        }
        self._block_settings = settings
        # the restored step and the blocks that start afresh in it (`_state_for` records them;
        # `_warn_if_unbound_after_restore` warns once at that step's end if saved states stayed
        # unbound: another model or guide)
        self._restored_step = (self.num_steps, set())
        self._restore_fallback(state_dict["fallback"])


def _module_names() -> dict[int, str]:
    """``id(parameter) -> name`` over the ``PyroModule`` guides seen running and their
    ``PyroModule`` models, also behind Pyro's handlers (`pyro_parameter_names`)."""
    found: dict[int, str] = {}
    guides = [*live_guides(), *undescribed_guides()]
    for module in [*guides, *(unwrap(getattr(guide, "model", None)) for guide in guides)]:
        for name, param in pyro_parameter_names(module):
            found.setdefault(id(param), name)
    return found
