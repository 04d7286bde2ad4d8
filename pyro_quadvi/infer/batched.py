"""Evaluate a batch of points in one vectorized pass, one point at a time, or tried then checked.

The quadrature ELBO (nodes), OPQA (grid nodes) and the ArviZ export (posterior draws) each evaluate
a model at many points. One vectorized pass (the model under a particle plate) is fast when the
model broadcasts over the points; a loop always works. `evaluate_batch` gives ``vectorize``
one meaning across the package:

- ``True``: one vectorized pass; on the first call for a model it is compared with single
  evaluations at a few probe points, and a disagreement raises `BatchMismatch` naming the
  reason and the ways out (``vectorize=None`` to fall back, ``False``); later calls are not
  checked. The pass's own errors propagate.
- ``False``: the loop only.
- ``None``: try the vectorized pass, check it against single evaluations at a few probe points,
  and fall back to the loop, with one warning saying why, if the pass fails with a *broadcasting*
  error or an operation that ``vmap`` cannot batch (`is_broadcast_error`) or disagrees with
  the probes. Any other exception (raised by
  the model itself, a NaN in the data, a density that is not finite) propagates with its own
  message: it would be raised by the loop too.

Where the caller has already checked this model (a later call), it passes ``probe=()``: nothing is
compared, and the pass costs what it costs unchecked. `DecisionCache` remembers the decision
per model and guide, weakly, so that an object reused for another model decides (and checks) again
instead of carrying the first model's answer over.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MethodType
from typing import Any

import pyro
import torch
from torch import nn
from torch.func import functional_call

__all__ = [
    "BatchDecision",
    "BatchMismatch",
    "DecisionCache",
    "DtypeMismatch",
    "RecomputedForward",
    "below_float64",
    "call_by_place",
    "called_by_place",
    "check_value_dtype",
    "check_vectorize",
    "evaluate_batch",
    "is_broadcast_error",
    "is_vmap_refusal",
    "probe_tolerance",
    "product_advice",
    "refuse_recomputed_forward",
    "sum_is_finite",
    "vmap_safe_attention",
    "warn_fallback",
    "without_autocast",
]


class DtypeMismatch(ValueError):
    """A model's value in another dtype than the tensor it stands for (a ``BayesianModule``'s
    weight drawn or replayed in float64 for a float32 net): what ``opqa_evidence``, which runs a
    model in float64, turns into its own advice."""


def check_value_dtype(
    site: str, value: torch.Tensor, dtype: torch.dtype, wanted: str, prior: str, example: str
) -> None:
    """Refuse with a `DtypeMismatch` a sampled ``value`` of ``site`` in another dtype than
    ``dtype``, the dtype of what it stands for (``wanted``: "the parameter"), naming the
    distribution that draws it (``prior``) and a remedy (``example``, a prior built in
    ``dtype``)."""
    if value.dtype != dtype:
        raise DtypeMismatch(
            f"the value of {site!r} is {value.dtype}, but {wanted} is {dtype}: {prior} draws "
            f"it, or the guide replays it, in another dtype. Build both in {wanted}'s dtype "
            f"({example}; a guide built for the net as it is now)"
        )


class BatchMismatch(Exception):
    """A vectorized pass that ran but cannot be trusted: a result of the wrong shape, a site that
    cannot be placed under the particle plate, or values that differ from single evaluations.

    Raised by a ``batched`` callable that checks itself; `evaluate_batch` falls back to the
    loop on it (with ``vectorize=None``), and raises it under ``vectorize=True`` when the pass
    disagrees with single evaluations at the probe points.
    """


@dataclass(frozen=True)
class BatchDecision:
    """How a batch was evaluated.

    Attributes:
        vectorized: ``True`` for one vectorized pass, ``False`` for a loop over the points.
        reason: why a tried vectorized pass was abandoned (``None`` if it was not).
        probe_evaluations: evaluations of points spent only on checking the vectorized pass
            (the probes' single runs, and the probed points again in the mixing check).
    """

    vectorized: bool
    reason: str | None = None
    probe_evaluations: int = 0


# Messages of torch.func.vmap refusing to batch an operation (a BayesianModule runs its net under
# vmap, QNVBOptimizer's one pass its loss); one point at a time, without vmap, the operation runs.
_VMAP_REFUSALS = [
    r"Batching rule not implemented for",  # e.g. aten::gru.input
    r"vmap: It looks like you're calling \.item\(\)",
    r"vmap: It looks like you're attempting to use a Tensor in some data-dependent",
    r"vmap: We do not support batching operators that can (output|support) dynamic shape",
    # an in-place write of a batched value into a tensor that is not (out[mask] = h: index_put_;
    # out[:] = h, out.copy_(h): "inplace arithmetic")
    r"vmap: [\w ]+\(self, \*extra_args\) is not possible because",
    # operators without a batching rule for a batched argument, and .data
    r"vmap: Attempted to vmap over",  # masked_select's mask
    r"vmap over torch\.\w+ isn't supported",  # torch.allclose
    r"When vmap-ing torch\.nn\.functional\.one_hot",  # without num_classes
    r"`data` under vmap transform is not allowed",
    # a random operation (F.dropout with training=True, sdpa's dropout_p > 0)
    r"vmap: called random operation while in randomness error mode",
    # a torch.autograd.Function without setup_context, or without vmap / generate_vmap_rule
    r"In order to use an autograd\.Function with functorch transforms",
    r"You tried to vmap over \w+, but it does not have vmap support",
    # batch norm in training mode, whose running statistics are updated in place
    r"Batch norm got a batched tensor as input while the running_mean",
    r"(not supported|NYI: .*) inside (of )?vmap",  # clone(memory_format=...): "inside vmap"
]
_VMAP_REFUSAL = re.compile("|".join(_VMAP_REFUSALS))

# Messages of errors that come from shapes that do not broadcast, raised by torch, by
# torch.distributions or by Pyro, when a model meant for one point meets a batch of points, and
# vmap's refusals.
_BROADCAST_MESSAGES = re.compile(
    "|".join(
        [
            r"The size of tensor a \(\d+\) must match the size of tensor b",
            r"[Ss]hape mismatch",  # torch indexing, Pyro's "Shape mismatch inside plate"
            r"shapes cannot be multiplied",  # "mat1 and mat2 shapes cannot be multiplied"
            r"Expected size for first two dimensions of batch2",  # batched matmul
            r"expects a tensor with <= \d+ dimensions",  # nn.Linear's weight.t()
            r"Expected \d+D \(unbatched\) or \d+D \(batched\) input",  # convolutions
            r"size mismatch",
            r"is invalid for input of size",  # view / reshape
            r"The expanded size of the tensor",
            r"number of sizes provided \(\d+\) must be greater or equal",  # expand([G, n])
            r"Boolean value of Tensor with more than one value",  # if / assert on a latent
            # float(latent) / latent.item() on the batch of points
            r"only one element tensors can be converted to Python scalars",
            r"a Tensor with \d+ elements cannot be converted to Scalar",
            r"doesn't match the broadcast shape",
            r"not broadcastable",  # torch.distributions' validate_sample
            r"cannot be broadcast",
            r"Sizes of tensors must match",  # torch.cat / torch.stack
            r"Tensors must have same number of dimensions",
            r"number of dims don't match",  # permute
            r"[Ii]ncompatible shapes?",
            r"Dimension out of range",
            r"too many indices for tensor",
            r"out of bounds for dimension",
            r"invalid log_prob shape",  # Pyro's trace check
            r"inconsistent tensor size",
            # operations defined on a vector or a matrix only, given a batch of them
            r"Supports 1D or 2D tensors",  # torch.diag
            r"must be a matrix",  # torch.mm, addmm
            r"1D tensors expected",  # torch.dot
            r"expected a matrix",  # torch.trace
            r"matrix @ vector expected",  # torch.mv
            r"Expected 1-D argument",  # torch.outer, ger
            *_VMAP_REFUSALS,
        ]
    )
)


# Messages of a matrix or vector product given a batch of vectors: a model's `x @ b` (or
# torch.matmul, mv, dot) of data by a vector latent `b`, which the pass holds as (K, 1, ..., d).
_PRODUCT_MESSAGES = re.compile(
    r"Expected size for first two dimensions of batch2|shapes cannot be multiplied"
    r"|matrix @ vector expected|1D tensors expected"
)


def product_advice(message: str) -> str:
    """A sentence (with a leading space) on the broadcasting form of a product of data by a
    vector latent, where ``message`` is a product's shape error (`_PRODUCT_MESSAGES`); else
    ``""``. Read on the fallback's path only."""
    if _PRODUCT_MESSAGES.search(message) is None:
        return ""
    return (
        " The failing operation is a matrix product: if the model multiplies data by a vector "
        "latent (a + x @ b, torch.matmul, torch.mv or torch.dot with b of shape (d,)), write "
        "a + (x * b).sum(-1), which broadcasts over the points, so that all of them run in one "
        "pass."
    )


def is_broadcast_error(error: BaseException) -> bool:
    """Whether ``error`` says that the points cannot be evaluated together (so a loop over them
    may work): shapes that do not broadcast, or an operation ``torch.func.vmap`` cannot batch.

    ``True`` for `BatchMismatch`, for the ``RuntimeError``, ``ValueError`` and
    ``IndexError`` that torch, torch.distributions and Pyro raise on incompatible shapes (sizes
    that must match, matrix products, reshapes, indexing, Pyro's plate shape checks), and for
    vmap's refusals: an operator without a batching rule (``nn.GRU``), ``.item()``, control flow
    on a tensor's value, outputs of data-dependent shape (``nonzero``, boolean masks), an
    in-place write of a batched value into an unbatched tensor (``out[mask] = h``,
    ``out[:] = h``), ``masked_select``, ``allclose``, ``one_hot`` without ``num_classes``,
    ``.data``, a random operation (``F.dropout(x, p)``, sdpa's ``dropout_p > 0``), a
    ``torch.autograd.Function`` without ``setup_context`` or a vmap rule. ``False`` for
    everything else: a model's own exceptions, dtype mismatches, failed argument validation
    (a NaN parameter or observation), non-finite densities.
    """
    if isinstance(error, BatchMismatch):
        return True
    if not isinstance(error, RuntimeError | ValueError | IndexError):
        return False
    return _BROADCAST_MESSAGES.search(str(error)) is not None


def is_vmap_refusal(error: BaseException) -> bool:
    """Whether ``error`` is ``torch.func.vmap`` refusing to batch an operation (one of the
    refusals `is_broadcast_error` recognises), which runs one point at a time."""
    return isinstance(error, RuntimeError) and _VMAP_REFUSAL.search(str(error)) is not None


@contextmanager
def vmap_safe_attention() -> Iterator[None]:
    """Turns PyTorch's fused attention fast path off for the ``torch.func.vmap`` passes inside.

    ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` in eval mode take a fused
    inference kernel (``aten::_native_multi_head_attention``,
    ``aten::_transformer_encoder_layer_fwd``) when none of their weights seems to require grad.
    Weights batched by ``vmap`` do not seem to, so the forward takes the kernel, which has no
    derivative, and the backward fails. Inside this context the layers run their composite
    forward, which ``vmap`` and autograd both handle; the global flag
    (``torch.backends.mha.get_fastpath_enabled()``) is restored on exit, also on an error.
    """
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


class RecomputedForward(RuntimeError):
    """A layer with trainable parameters that ran its forward in the backward pass of a node
    loop or of a vectorized pass (`refuse_recomputed_forward`): ``torch.utils.checkpoint``
    recomputing a part of the net at the net's own parameters, not at the node's."""


_CALLED_BY_PLACE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The modules `call_by_place` ran: their layers hold the given tensors only while it runs."""


def called_by_place(module: nn.Module) -> bool:
    """Whether ``module`` is one of, or inside one of, the modules `call_by_place` ran."""
    return any(module is part for net in list(_CALLED_BY_PLACE) for part in net.modules())


@contextmanager
def refuse_recomputed_forward(
    owner: str, fix: str, swapped: Callable[[nn.Module], bool]
) -> Iterator[None]:
    """Raise `RecomputedForward` where a module with trainable parameters of its own runs its
    forward inside: the backward of a loss whose nodes were passed to the net by
    ``torch.func.functional_call``, which puts them in the net only while its forward runs.

    ``torch.utils.checkpoint`` recomputes its part of the forward in the backward, reading the
    layers' parameters then: the net's own (the means), not the node's. Non-reentrant, the
    gradients of the nodes come from values at the means (a trial's fit ended 2.02 off in a
    mean, its loss 776.2 for 700.8, without a warning); reentrant, the layers inside get no
    gradient. The refusal aborts the backward at the first such layer; ``owner`` and ``fix``
    (the ways out) make the message. A module global forward pre-hook, registered for the
    context only, that refuses only a forward run by the backward (an autograd node executing in
    its thread): another thread's own forward meanwhile, a net trained beside the fit, runs.
    Only a layer for which ``swapped`` holds, one whose parameters were swapped for the nodes
    (`called_by_place`: a `BayesianModule`'s net), is refused: another module, checkpointed at
    its own parameters (a point-estimated encoder), recomputes what its forward computed."""

    def refuse(module: nn.Module, args: tuple) -> None:
        if (
            torch._C._current_autograd_node() is not None
            and any(p.requires_grad for p in module.parameters(recurse=False))
            and swapped(module)
        ):
            raise RecomputedForward(
                f"{owner}: the {type(module).__name__} layer of the net ran its forward again "
                "in the backward pass: a torch.utils.checkpoint in the net's forward recomputes "
                f"its part there. {owner} passes each node's weights to the net only while its "
                "forward runs (torch.func.functional_call), so the recomputation reads the "
                "net's own parameters, the means, and the gradients would be silently wrong "
                "(use_reentrant=False), or the layers inside would get none (use_reentrant="
                f"True). {fix}"
            )

    handle = nn.modules.module.register_module_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def without_autocast(device_type: str) -> Iterator[None]:
    """Turns ``torch.autocast`` off for ``device_type`` inside, where it is on (nothing is
    entered otherwise: a device without autocast, ``"meta"``, cannot take the context). A sum
    written as a product (``weights @ values``) is a ``matmul``, which autocast runs in its
    dtype: the -ELBO of 10^4 rows, 7205.5 in float32, came out 7190.5 in bfloat16."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        yield


def check_vectorize(vectorize: object, owner: str = "", allow_none: bool = True) -> None:
    """Refuse a ``vectorize`` other than ``True``, ``False`` or ``None`` (without ``allow_none``:
    ``True`` or ``False``, `LogJoint`'s), the one check of every entry point that takes it
    (``owner``, e.g. ``"opqa_evidence: "``, goes first).

    ``1`` and ``0`` are refused too: ``1 in (True, False)`` holds, so they passed a membership
    test and then matched neither ``is True`` nor ``is False`` (``0`` tried the vectorized pass).

    Raises:
        ValueError: naming ``vectorize``, the value and the values allowed.
    """
    if not isinstance(vectorize, bool) and (vectorize is not None or not allow_none):
        allowed = "True, False or None" if allow_none else "True or False"
        kind = type(vectorize)  # numpy's bool is named "bool" too: its module is said
        named = (
            kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
        )
        raise ValueError(f"{owner}vectorize must be {allowed}, got {vectorize!r} ({named})")


def evaluate_batch(
    batched: Callable[[torch.Tensor], Any],
    single: Callable[[torch.Tensor], Any],
    points: torch.Tensor,
    vectorize: bool | None,
    *,
    probe: Sequence[int] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    what: str = "the model",
) -> tuple[Any, BatchDecision]:
    """Evaluate ``points`` (``K`` of them, along dim 0) vectorized, looped, or tried then checked.

    Args:
        batched: all points at once, ``(K, ...) -> (K, ...)``; may raise `BatchMismatch`
            when it checks itself.
        single: one point, ``points[k] -> value``; the loop stacks the values along a new dim 0.
            Values may be tensors or (nested) mappings of tensors.
        points: the ``K`` points.
        vectorize: ``True``: ``batched``, checked against ``single`` at the probe points (errors
            propagate; a disagreement raises `BatchMismatch`); ``False``: only the loop;
            ``None``: ``batched``, checked against ``single`` at the probe points, else the loop.
        probe: the indices checked (default: first, middle and last); ``()`` skips the
            comparison: for a model already checked on an earlier call, a ``batched`` that checks
            itself, or random draws (nothing to compare a single run with).
        rtol: relative tolerance of the comparison, a finite number ``>= 0``; ``None``:
            `probe_tolerance` of the values' dtype.
        atol: absolute tolerance of the comparison, a finite number ``>= 0``; ``None``: as
            ``rtol``.
        what: who evaluates, for the warning (``"QuadratureELBO"``, ``"opqa_evidence"``).

    Returns:
        The values and the `BatchDecision` taken. With ``vectorize=None`` a fallback warns
        once per call, naming the reason; pass the decision's ``vectorized`` next time (see
        `DecisionCache`) to decide once.

    Whatever ``batched`` or ``single`` raise propagates, except, under ``vectorize=None``, the
    broadcasting errors of ``batched``, its allocation failures (a pass over all the points
    that runs out of memory) and its ``AssertionError`` where ``single`` passes the first point
    (a shape assert of the model that the points' leading dims fail).

    Raises:
        BatchMismatch: with ``vectorize=True``, where the pass disagrees with the probes (or the
            model gives other values when a probe is run twice: it is random apart from the
            points).
        TypeError, ValueError: for a ``vectorize``, ``rtol`` or ``atol`` outside the above.
    """
    check_vectorize(vectorize)
    _check_tolerance("rtol", rtol)
    _check_tolerance("atol", atol)
    K = len(points)
    if vectorize is False:
        return _loop(single, points, {}), BatchDecision(False)
    try:
        values = batched(points)
    except Exception as error:
        if vectorize is True:
            raise
        known: dict[int, Any] = {}
        if isinstance(error, AssertionError):
            try:
                known[0] = single(points[0])
            except AssertionError:
                raise error from None  # it fails one point at a time too: the model's own assert
            reason = _assert_reason(error)
        elif is_broadcast_error(error):
            reason = f"{type(error).__name__}: {first_line(error)}"
        elif _is_out_of_memory(error):
            reason = (
                f"{type(error).__name__}: {first_line(error)}: the pass over all {K} points ran "
                "out of memory; a latent whose batch dim meets the points' dim as well "
                "(a[..., None] + x @ b, with a of shape (K, 1) in the pass, makes a K x K x n "
                "tensor) asks for K times what the points need, and one point at a time needs "
                "1/K of it"
            )
        else:
            raise
    else:
        indices = sorted({0, K // 2, K - 1}) if probe is None else sorted(set(probe))
        known = {k: single(points[k]) for k in indices}
        mixing = _checks_mixing(points, indices)
        reason = _disagreement(values, known, rtol, atol)
        if reason is None and mixing:
            reason = _mixed_points(batched, points, indices)
        if reason is None:  # the probes' single runs and the points of the mixing check
            return values, BatchDecision(True, None, len(known) + (len(indices) if mixing else 0))
        first = indices[0]
        again = _repeat_difference(single(points[first]), known[first], first, rtol, atol)
        if again is not None:  # not the vectorized pass: the model itself is random
            random = (
                f"the model gives other values at the same point when run twice ({again}): it "
                "draws random numbers besides the latent sites the guide covers (a sample site "
                "hidden by poutine.block, a torch.randn in the model, dropout in training mode), "
                "so its log density given the latents is not a function, and the loss is a noisy "
                "estimate of another objective than the ELBO. Make the model deterministic given "
                "its latents (let the guide see every latent site; net.eval())"
            )
            if vectorize is True:
                raise BatchMismatch(
                    f"{what}(vectorize=True): {random} (vectorize=None or False would evaluate "
                    "the points one by one, which leaves the model as random)"
                )
            warnings.warn(
                f"{what}: {random}. Evaluating the points one by one.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            return _loop(single, points, known), BatchDecision(False, again, 0)
        if vectorize is True:
            raise BatchMismatch(
                f"{what}(vectorize=True): the vectorized pass over all {K} points cannot be "
                f"trusted: {reason}. The model may not broadcast over the points (a latent with "
                "batch dims outside every plate, say). Pass "
                "vectorize=None to fall back to a loop over the points (with one warning), or "
                "vectorize=False to loop without trying the pass"
            )
    looped = _loop(single, points, known)  # first: an error of the loop is the model's own
    warn_fallback(what, K, reason)
    return looped, BatchDecision(False, reason, 0)


def warn_fallback(what: str, num_points: int, reason: str) -> None:
    """The warning of a vectorized pass abandoned for a loop over the ``num_points`` points
    (`evaluate_batch` under ``vectorize=None``), naming the ``reason``."""
    warnings.warn(
        f"{what}: the model does not evaluate all {num_points} points in one vectorized pass "
        f"({reason}); evaluating them one by one. Pass vectorize=False to skip the vectorized "
        f"pass and this warning.{product_advice(reason)}",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure: torch's ``OutOfMemoryError`` (CUDA, MPS) or
    its CPU allocator's ``RuntimeError``."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def _assert_reason(error: AssertionError) -> str:
    """Why the pass was left for an ``assert`` of the model that fails in the pass only."""
    said = first_line(error)
    return (
        f"AssertionError{': ' + said if said else ''}: an assert of the model fails in the pass "
        "but not at a single point; a shape assert such as assert d.shape == (3, 4) sees the "
        "points' leading dims in the pass: assert on the rightmost dims, "
        "d.shape[-2:] == (3, 4), to keep the pass"
    )


def _check_tolerance(name: str, value: object) -> None:
    """Refuse a probe tolerance other than ``None`` or a finite number ``>= 0``: under NaN or a
    negative one every comparison fails (even of a value with itself), and an infinite one
    makes ``inf * 0``, NaN, where the largest value is 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"evaluate_batch: {name} must be None (the dtype's probe_tolerance) or a finite "
            f"number >= 0, got {value!r} ({type(value).__name__})"
        )
    if not 0 <= value < math.inf:  # NaN fails every comparison
        raise ValueError(
            f"evaluate_batch: {name} must be None (the dtype's probe_tolerance) or a finite "
            f"number >= 0, got {value!r}; pass 0 for an exact comparison"
        )


# this package's, Pyro's and torch's directories: the frames a warning for the user passes over
_INSIDE = (
    *(
        os.path.dirname(path) + os.sep
        for path in (os.path.dirname(__file__), pyro.__file__, torch.__file__)
    ),
    contextlib.__file__,  # the __enter__ of a context manager (``with opt.sampled_params():``)
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line: the first frame outside
    this package, Pyro, torch and ``contextlib`` (the user's ``opqa_evidence(...)`` or
    ``svi.step(...)``, not Pyro's ``SVI``), however deep inside the package the warning is
    raised. Call it in the warning's own call, ``warnings.warn(message, UserWarning,
    stacklevel=user_stacklevel())`` (Python 3.12's ``skip_file_prefixes``, for 3.10 and 3.11)."""
    frame, level = sys._getframe(1), 1  # the function that calls warnings.warn: stacklevel 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def add_hint(error: BaseException, hint: str) -> None:
    """Append ``hint`` to the first line of ``error``'s message, in place (its type and
    traceback kept). An error without a message (a bare ``assert``) takes ``hint`` as its
    message; one whose first argument is not a string gets it as a note (Python 3.11; kept as
    it is on 3.10, which has no notes)."""
    if error.args and isinstance(error.args[0], str):
        first, newline, rest = error.args[0].partition("\n")
        error.args = (f"{first.rstrip('.')}. {hint}{newline}{rest}", *error.args[1:])
    elif not error.args:
        error.args = (hint,)
    elif hasattr(error, "add_note"):
        error.add_note(hint)


def first_line(error: BaseException) -> str:
    """An error's message without the trace shapes Pyro appends."""
    return str(error).strip().split("\n")[0]


def _loop(single: Callable, points: torch.Tensor, known: Mapping[int, Any]) -> Any:
    """``single`` at every point (reusing the ``known`` values), stacked along a new dim 0."""
    return _stack([known[k] if k in known else single(points[k]) for k in range(len(points))])


def _stack(values: list) -> Any:
    if isinstance(values[0], Mapping):
        return {key: _stack([value[key] for value in values]) for key in values[0]}
    return torch.stack(values)


#: a disagreement within this many tolerances is said to be possibly rounding (the message)
ROUNDING_HINT = 100


def below_float64(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating dtype of a lower precision than float64 (float32,
    bfloat16, float16): a run where "use float64" is advice worth giving."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 64


def probe_tolerance(dtype: torch.dtype) -> float:
    """The relative and absolute tolerance of the probes' check for values of ``dtype``: the
    square root of its machine epsilon (``3.5e-4`` in float32), and never below ``1e-6``
    (float64 keeps ``1e-6``). A batched product sums in another order than a single one: on
    MNIST's 784-400-400-10 MLP at its guide's start the log joint of 128 rows, ``-18425``,
    differs by ``1.4`` (``7.6e-5`` relative) in float32, by ``1e-12`` in float64; a pass that
    mixes the points, or a model that draws its own random numbers, differs by far more."""
    if not dtype.is_floating_point:
        return 1e-6
    return max(torch.finfo(dtype).eps ** 0.5, 1e-6)


def _difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest ``|got - want|`` and the largest ``|want|`` over the whole tensor (equal
    values, infinities or NaNs included, differ by 0; NaN against a number by NaN)."""
    if want.numel() == 0:
        return 0.0, 0.0
    got, want = got.detach(), want.detach()
    if not (want.is_floating_point() or want.is_complex()):  # (bool or integer values)
        got, want = got.double(), want.double()
    same = (got == want) | (got.isnan() & want.isnan())
    difference = (got - want).abs().masked_fill(same, 0).max()
    largest = want.abs().masked_fill(~want.isfinite(), 0).max()
    return float(difference), float(largest)


def _tolerances(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    tolerance = probe_tolerance(dtype)
    return (tolerance if rtol is None else rtol), (tolerance if atol is None else atol)


def _excess(
    got: torch.Tensor, want: torch.Tensor, rtol: float | None, atol: float | None
) -> tuple[float, float, float] | None:
    """``None`` where ``got`` is ``want`` up to ``atol + rtol * max |want|``, the largest value
    of the whole tensor (a batched product's rounding error scales with the largest terms it
    sums, so a logit near 0 beside logits of 1e5 moves by what they round to: an elementwise
    ``allclose`` called such a pass wrong); else the largest difference, the largest value and
    the relative tolerance, for the message."""
    rtol, atol = _tolerances(want.dtype, rtol, atol)
    difference, largest = _difference(got, want)
    return None if difference <= atol + rtol * largest else (difference, largest, rtol)


def _disagreement(
    values: Any, known: Mapping[int, Any], rtol: float | None, atol: float | None
) -> str | None:
    """Why the vectorized ``values`` differ from the single ``known`` ones (``None``: agree)."""
    for k, expected in known.items():
        for path, got, want in _pairs(values, expected, k):
            where = f"{path} at point {k}" if path else f"point {k}"
            if got is None or got.shape != want.shape:
                return f"the vectorized pass returned no value of the shape of {where}"
            excess = _excess(got, want, rtol, atol)
            if excess is not None:
                difference, largest, relative_tolerance = excess
                relative = difference / largest if largest > 0 else math.inf
                reason = (
                    f"its values differ from single evaluations ({where}: "
                    f"{_brief(got)} vectorized, {_brief(want)} alone; largest difference "
                    f"{difference:.3g}, {relative:.2g} of the largest value {largest:.3g})"
                )
                if below_float64(want.dtype) and relative <= ROUNDING_HINT * relative_tolerance:
                    reason += (
                        "; a difference this small may also be the rounding of ill-conditioned "
                        "values (large terms that cancel, as logits of 1e6 at a network guide's "
                        "start), the loop no more accurate than the pass: run in float64 to "
                        "tell, or start the fit where the values are moderate (a "
                        "BayesianModule's init_to_net())"
                    )
                return reason
    return None


def _checks_mixing(points: Any, indices: list[int]) -> bool:
    """Whether `_mixed_points` checks the pass: points of a floating tensor, two probed or more
    (`QNVBOptimizer`'s node stacks run under ``vmap``, which cannot mix the nodes)."""
    return isinstance(points, torch.Tensor) and points.is_floating_point() and len(indices) > 1


def _mixed_points(batched: Callable, points: torch.Tensor, indices: list[int]) -> str | None:
    """Why the vectorized pass mixes the points (``None``: it does not), from a pass over the
    probed points alone.

    A pass that reads one point's latent for all of them (``w[0]`` on a vector latent indexes
    the points' dim) agrees with the single evaluations within the tolerance where the points lie
    closer than it (a tiny ``init_scale``), and its gradients, from which QNVB reads its
    curvature, are wrong. Where the pass is right, the gradient of a point's value is 0 at every
    other point, however close, up to rounding: a gradient there counts where it exceeds
    `probe_tolerance` of the dtype times the largest of that value's gradient (a model that
    centres its logits over the whole tensor, ``logits - logits.mean()``, leaves 1.8e-8 against
    11.9 in float32; the ``w[0]`` pass leaves the whole gradient at the other point). One more
    pass over the ``len(indices)`` probed points (detached: the caller's graph is not touched)
    and a backward pass per point. A pass that fails on the probed points alone depends on the
    number of points (a reason too); where autograd cannot differentiate the pass, there is no
    gradient to read and the probes' agreement stands."""
    tolerance = probe_tolerance(points.dtype)
    with torch.enable_grad():
        free = points[indices].detach().requires_grad_()
        try:
            values = batched(free)
        except Exception as error:  # the full pass ran: this one depends on the count of points
            return (
                f"the pass over the {len(indices)} probe points alone fails "
                f"({type(error).__name__}: {first_line(error)}): the model depends on the number "
                "of points (a latent indexed along their dim, as w[2] for a vector w: write "
                "w[..., 2])"
            )
        for j, k in enumerate(indices):
            total = sum(got.sum() for _, got, _ in _pairs(values, values, j) if got is not None)
            if not (isinstance(total, torch.Tensor) and total.requires_grad):
                continue
            try:
                (grad,) = torch.autograd.grad(total, free, retain_graph=True, allow_unused=True)
            except RuntimeError:  # an operation without a derivative: nothing to read
                return None
            if grad is None:
                continue
            size = grad.abs().nan_to_num(nan=0.0, posinf=0.0)  # 0 * NaN (masked data): none
            reached = size > tolerance * size.max()
            reached[j] = False
            if bool(reached.any()):
                other = indices[int(reached.reshape(len(indices), -1).any(1).nonzero()[0])]
                return (
                    f"the vectorized value at point {k} depends on point {other}: the pass mixes "
                    "the points (a latent indexed along their dim, as w[0] for a vector w: write "
                    "w[..., 0])"
                )
    return None


def _repeat_difference(
    again: Any, first: Any, k: int, rtol: float | None, atol: float | None
) -> str | None:
    """Where a second single evaluation ``again`` of point ``k`` differs from the ``first``."""
    for path, got, want in _pairs(_stack([again]), first, 0):
        where = f"{path} at point {k}" if path else f"point {k}"
        if got is None or _excess(got, want, rtol, atol) is not None:
            return f"{where}: {_brief(want)}, then {_brief(got)}" if got is not None else where
    return None


def _pairs(values: Any, expected: Any, k: int, path: str = ""):
    """``(path, values[k], expected)`` for each tensor of a (nested) result."""
    if isinstance(expected, Mapping):
        for key, sub in expected.items():
            inner = values.get(key) if isinstance(values, Mapping) else None
            yield from _pairs(inner, sub, k, f"{path}[{key!r}]")
        return
    if not isinstance(values, torch.Tensor) or values.dim() == 0 or values.shape[0] <= k:
        yield path, None, expected
        return
    yield path, values[k], expected


def _brief(x: torch.Tensor) -> str:
    return f"{x.item():.6g}" if x.numel() == 1 else f"a tensor of shape {tuple(x.shape)}"


class DecisionCache:
    """Remembers a value (a `BatchDecision`, or what a caller learns with it) per key of
    objects (a model and a guide), weakly.

    An entry lives as long as every object of its key: it is never found for another model or
    guide, even one that reuses a freed object's ``id``. Bound methods count as their object and
    function; objects that cannot be weakly referenced are held until the cache is dropped. A copy
    (``copy.deepcopy``, ``pickle``, ``torch.save``) starts empty: its decisions were about the
    original objects, and the copy decides again.
    """

    def __init__(self) -> None:
        self._entries = _Entries()  # identity -> (references, decision)

    def get(self, *key: Any) -> Any:
        """The value stored for these objects, or ``None``."""
        entry = self._entries.get(_identity(key))
        if entry is None:
            return None
        refs, decision = entry
        if not all(_same(ref(), obj) for ref, obj in zip(refs, key)):
            return None
        return decision

    def set(self, *key: Any, decision: Any) -> None:
        """Store ``decision`` (a `BatchDecision` or any value) for these objects."""
        identity = _identity(key)
        entries = weakref.ref(self._entries)

        def forget(_ref, identity=identity) -> None:
            alive = entries()
            if alive is not None:
                alive.pop(identity, None)

        self._entries[identity] = (tuple(_reference(obj, forget) for obj in key), decision)

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self):
        return (DecisionCache, ())


class _Entries(dict):
    """A dict that can be weakly referenced."""


def _identity(key: tuple) -> tuple:
    return tuple(
        (id(obj.__self__), id(obj.__func__)) if isinstance(obj, MethodType) else id(obj)
        for obj in key
    )


def _same(alive: Any, obj: Any) -> bool:
    return alive is obj or (isinstance(obj, MethodType) and alive == obj)


def _reference(obj: Any, callback: Callable) -> Callable[[], Any]:
    if isinstance(obj, MethodType):
        return weakref.WeakMethod(obj, callback)
    try:
        return weakref.ref(obj, callback)
    except TypeError:  # not weakly referenceable: hold it (its id cannot be reused meanwhile)
        return lambda: obj


def sum_is_finite(values: torch.Tensor) -> torch.Tensor:
    """Whether the sum of a floating tensor is finite, as a 0-d tensor (not read): true where
    every entry is finite, unless the sum overflows. One fast reduction, where ``isfinite``
    of every entry takes several passes (``x == x``, ``abs``, ``!= inf``): 14 us against 260 us
    on 128 x 784 float32 inputs (one CPU thread). Half precision sums in float32."""
    wide = torch.float32 if torch.finfo(values.dtype).bits < 32 else None
    return torch.isfinite(values.sum(dtype=wide))


def call_by_place(module: nn.Module, tensors: Mapping[str, torch.Tensor], args: tuple) -> Any:
    """``module(*args)`` with ``tensors`` (by the names of ``module.named_parameters()`` and
    ``named_buffers()``) in place of its parameters and buffers: ``torch.func.functional_call``,
    each place fed once (`_slots`), with ``tie_weights=False``.

    Torch's ``tie_weights=True`` swaps a module used at two paths (``nn.Sequential(lin, act,
    lin)``, a tied WHVI layer) in twice and so leaves the given tensor in it after the call
    (pytorch/pytorch#164759): from then on the layer holds a plain tensor, no parameter, and
    drops out of ``named_parameters()``. A tensor shared by two modules (``out.weight =
    emb.weight``) still gets the value of its first name at both places. A ``torch.compile``d
    module takes the names of the module it wraps (``"0.weight"``) or its own
    (``"_orig_mod.0.weight"``): the places are the wrapped module's, and a name that is none of
    them is passed on as it is.
    """
    _CALLED_BY_PLACE.add(module)  # (a checkpoint in it is refused in the backward)
    slots = _slots(getattr(module, "_orig_mod", module))
    given = {slot: tensors[name] for slot, name in slots.items() if name in tensors}
    named = set(slots.values())
    given.update({name: t for name, t in tensors.items() if name not in named})
    return functional_call(module, given, args, tie_weights=False)


def _slots(net: nn.Module) -> dict[str, str]:
    """Each place a parameter or buffer sits (a module's attribute), by one of its paths, mapped to
    the tensor's first name in ``net.named_parameters()`` / ``net.named_buffers()``.

    A tensor shared by two modules (a tied weight) has two places, both fed the first name's
    value. A module used at two paths (``nn.Sequential(lin, act, lin)``) has its places once:
    ``functional_call(tie_weights=True)`` swaps such a place in twice and so restores it to the
    value it was given (pytorch/pytorch#164759), leaving the sampled tensor in the net.
    """
    slots, seen, first = {}, set(), {}
    for named in (net.named_parameters, net.named_buffers):
        for name, tensor in named(remove_duplicate=False):
            path, _, attribute = name.rpartition(".")
            place = (id(net.get_submodule(path)), attribute)
            if place not in seen:
                seen.add(place)
                slots[name] = first.setdefault(id(tensor), name)
    return slots
