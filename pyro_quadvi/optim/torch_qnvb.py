"""QNVB as a ``torch.optim.Optimizer`` for plain PyTorch networks (the reference's use case).

Every parameter ``p`` becomes a Gaussian mean field ``N(mu, sigma^2)``. `QNVBOptimizer.step`
sets the parameters to the quadrature nodes ``mu + sigma * x_k`` itself, evaluates the closure
(loss and backward) at each, and forms (rasp paper, eq. 11)

    g = sum_k w_k grad_k,        h = sum_k w_k grad_k * x_k / sigma,

then applies the QNVB update (`qnvb_update_many`) to
the loss

    likelihood_weight * annealing(step) * closure() + prior_precision * |theta|^2 / 2,

where ``closure()`` is the mean loss per training case, as in the reference. After a step the
parameters hold the mean ``mu``; ``optimizer.state[p]["sigma"]`` holds the standard deviation. A
change made to a parameter between steps is a change of its mean, which the next step takes. As
in torch's optimizers, the tensors of ``optimizer.state[p]`` are the live state, updated in place
by each step: clone one to keep its value (a `QNVBOptimizer.state_dict` keeps its values, and
a tensor you assign into the state is not written over: the next step makes new ones).

**One pass for all nodes.** Instead of a closure, `QNVBOptimizer.step` takes a loss function
of the parameters and a batch, ``loss_fn(params: dict[str, Tensor], *batch)`` (the optimizer
built from ``net.named_parameters()``; `module_loss` makes one from a module and a
criterion). The parameters at all ``K`` nodes are stacked along a leading node axis and the loss
is evaluated once under ``torch.func.vmap`` (through
`evaluate_batch`, so ``vectorize`` means what it means across the
package), followed by one backward of ``sum_k w_k loss_k`` for all nodes. The parameters are never
set to a node.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields

import pyro
import torch
from torch import nn
from torch.func import vmap

from ..guides.interface import (
    GuideDescription,
    describe_live_guides,
    guide_class_name,
    watch_guides,
)
from ..infer.batched import (
    BatchDecision,
    BatchMismatch,
    DecisionCache,
    RecomputedForward,
    call_by_place,
    check_vectorize,
    evaluate_batch,
    first_line,
    is_vmap_refusal,
    refuse_recomputed_forward,
    sum_is_finite,
    user_stacklevel,
    vmap_safe_attention,
    warn_fallback,
)
from ..quadrature import NodeSet, make_rule
from ..quadrature.base import draw_device, generator_kept
from ..store import shortened
from .annealing import annealing_factor, check_schedule
from .qnvb_functional import (
    DONATABLE,
    IDLE_STEPS_REFUSED,
    QNVB_IDLE,
    QNVBHyperparameters,
    QNVBState,
    _check_number,
    _unresolved,
    _Vouched,
    cast_state_to,
    check_settings,
    count_idle_step,
    count_messages,
    count_table,
    idle_step_refusal,
    init_qnvb_state,
    kept_coordinates,
    or_float64,
    qnvb_update_many,
    result_counts,
)

__all__ = ["ModuleLoss", "QNVBOptimizer", "check_tensor_output", "module_loss"]

LossFunction = Callable[..., torch.Tensor]
"""``loss_fn(params: dict[str, Tensor], *batch) -> Tensor``: the mean loss per case (a scalar)."""


def check_tensor_output(outputs: object, net: nn.Module, owner: str, reader: str) -> None:
    """Refuse a network output that is not one tensor (an RNN's ``(output, state)``), naming the
    net, who runs it (``owner``) and what reads its outputs (``reader``)."""
    if not isinstance(outputs, torch.Tensor):
        raise TypeError(
            f"{owner}: the network {type(net).__name__} returned a {type(outputs).__name__}; "
            f"{reader} needs one tensor of outputs. Wrap the net in a module whose forward "
            "returns that tensor (for an RNN: out, _ = rnn(x); return head(out[:, -1]))."
        )


def refuse_script_module(module: nn.Module, owner: str, way_out: str) -> None:
    """Refuse a TorchScript module (``torch.jit.script(net)``, ``torch.jit.trace(net, x)``),
    whose weights cannot be swapped: torch refuses ``torch.func.functional_call`` on it, which
    ``owner`` runs the net with. ``way_out`` ends the message (the eager net; another form)."""
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(
            f"{owner}: the network is a TorchScript module ({type(module).__name__}, from "
            f"torch.jit.script or torch.jit.trace); {owner} runs the net with other weights "
            f"through torch.func.functional_call, which torch refuses for TorchScript modules. "
            f"{way_out}"
        )


def where_entries(values: torch.Tensor, bad: torch.Tensor, name: str) -> str:
    """Where the mask ``bad`` (of ``values``' shape) holds, by rows (dim 0) and the first entry:
    ``"rows [0, 5] (2 of 16 rows; first: x[0, 2] = nan)"``; for a 0-d ``values``,
    ``"x = nan"``. Reads ``values`` back to the host: for error messages only."""
    if values.dim() == 0:
        return f"{name} = {values.item()!r}"
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()
    first = tuple(bad.nonzero()[0].tolist())
    shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
    index = ", ".join(map(str, first))
    return (
        f"rows [{shown}] ({len(rows)} of {values.shape[0]} rows; first: "
        f"{name}[{index}] = {values[first].item()!r})"
    )


def check_representable(owner: str, name: str, value: float, dtype: torch.dtype) -> None:
    """Refuse a setting whose magnitude is beyond the largest number of ``dtype`` (``1e300`` in
    float32, which the step would turn into an infinity or refuse to convert), naming it after
    ``owner`` (``"QNVBOptimizer: "``, or ``""``)."""
    largest = torch.finfo(dtype).max
    if abs(float(value)) > largest:
        raise ValueError(
            f"{owner}{name}={value!r} is beyond the range of {dtype} (largest {largest:.3g}), "
            "the parameters' dtype in which the step computes with it: pass a value within it, "
            "or use float64 parameters"
        )


def refuse_grad_scaler(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a step that ``torch.amp.GradScaler.step`` called (the first thing a step does).

    The plain-torch optimizers declare ``_step_supports_amp_scaling``, so that the scaler calls
    their ``step`` directly after setting ``grad_scale`` and ``found_inf`` on the optimizer
    (torch's contract for optimizers that unscale themselves), instead of an ``AssertionError``
    of its own. QNVB takes no loss scaling: a scaled loss scales every node's gradient, hence
    ``g`` and the curvature ``h``, and ``sigma`` comes out too small, silently. The two
    attributes are removed (the scaler, refused, leaves them) and nothing else is touched.
    """
    state = vars(optimizer)
    if "grad_scale" not in state and "found_inf" not in state:
        return
    state.pop("grad_scale", None)
    state.pop("found_inf", None)
    owner = type(optimizer).__name__
    raise RuntimeError(
        f"{owner}.step was called by torch.amp.GradScaler.step: {owner} takes no loss scaling. "
        "A loss multiplied by the scaler (scaler.scale(loss).backward()) multiplies the "
        "gradient at every node, hence the curvature h, by the scale (65536 at first), and "
        "sigma comes out too small without an error. Drop the scaler: call loss.backward() in "
        "the closure and optimizer.step(closure). The parameters stay in float32 (or float64); "
        "for a half-precision forward use torch.autocast with dtype=torch.bfloat16, which has "
        "float32's range and needs no scaler. Nothing was evaluated or changed by this step"
    )


def refuse_inference_mode(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a step under ``torch.inference_mode()``, before anything changes. A step evaluates
    the loss and its gradient at every quadrature node, and turns gradients on for that itself
    (``torch.no_grad()`` around it is fine), but inference mode it cannot leave: the one-pass
    form blamed ``loss_fn`` for not using its parameters, the closure form gave torch's bare
    "element 0 of tensors does not require grad"."""
    if not torch.is_inference_mode_enabled():
        return
    owner = type(optimizer).__name__
    raise RuntimeError(
        f"{owner}.step was called under torch.inference_mode(): the step needs the loss's "
        "gradient at every quadrature node, and inference mode turns gradients off for good "
        "(the step turns them on under torch.no_grad() or torch.set_grad_enabled(False), which "
        "are fine around it). Take the step outside inference_mode; predict inside it. Nothing "
        "was evaluated or changed by this step"
    )


def check_generator(owner: str, generator: object) -> None:
    """Refuse a ``generator`` that is neither a ``torch.Generator`` nor ``None`` when an
    optimizer is built (the rules refuse one at their first draw; a deterministic rule never
    draws)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{owner}: generator must be a torch.Generator or None, got {generator!r} "
            f"({type(generator).__name__}); pass torch.Generator().manual_seed(seed), or None "
            "for torch's global generator"
        )


def nonfinite_data(values: object, name: str) -> str | None:
    """Where a floating tensor ``values`` holds NaN or an infinity (`where_entries`), or
    ``None`` where it holds none or is no floating tensor: one reduction and one host sync
    (`sum_is_finite`), each entry checked only where the sum is not finite."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        return None
    if bool(sum_is_finite(values)):
        return None
    bad = ~torch.isfinite(values)
    return where_entries(values, bad, name) if bool(bad.any()) else None  # else: an overflow


class ModuleLoss:
    """``loss_fn(params, x, y) = criterion(functional_call(module, params, (x,)), y)``, the
    ``loss_fn`` that `module_loss` makes.

    It carries ``module`` and ``criterion``: `QNVBOptimizer.step` keeps its ``vectorize``
    decision per module and criterion (not per ``ModuleLoss`` object), so
    ``step(loss_fn=module_loss(net, criterion), ...)`` written inside the training loop decides
    once, and restores the module's buffers after a vectorized pass it tried and abandoned.

    Attributes:
        module: the network; its parameters and buffers not in ``params`` are used as they are.
        criterion: ``(outputs, targets) -> mean loss per case``.
    """

    def __init__(self, module: nn.Module, criterion: Callable):
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"module_loss: module must be a torch.nn.Module, got {type(module).__name__}"
            )
        refuse_script_module(
            module,
            "module_loss",
            "Pass the eager net (the module you scripted or traced), or keep the scripted net "
            "and use the closure form, step(closure), which calls it as it is",
        )
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise TypeError(
                "module_loss: a DistributedDataParallel module averages gradients in hooks of its "
                "own forward, which the one-pass step (functional_call on the wrapped net) "
                "bypasses: each rank would step on its own gradients and the ranks drift apart. "
                "With DDP use the closure form, step(closure); or NodeParallelQNVBOptimizer"
            )
        if not callable(criterion):
            raise TypeError(
                "module_loss: criterion must be callable (outputs, targets) -> mean loss per "
                f"case, e.g. torch.nn.functional.cross_entropy; got {criterion!r}"
            )
        self.module = module
        self.criterion = criterion

    def __call__(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        outputs = call_by_place(self.module, params, (x,))
        check_tensor_output(outputs, self.module, "module_loss", "the criterion")
        return self.criterion(outputs, y)

    def __repr__(self) -> str:
        return f"module_loss({type(self.module).__name__}, {self.criterion!r})"


def module_loss(module: nn.Module, criterion: Callable) -> ModuleLoss:
    """A ``loss_fn`` for `QNVBOptimizer.step`: ``criterion(module(x), y)`` at ``params``.

    Args:
        module: the network; its parameters and buffers not in ``params`` are used as they are.
            Its forward must return one tensor (a ``TypeError`` names the net otherwise). A
            TorchScript module is refused with a ``TypeError`` (torch cannot swap its weights):
            pass the eager net, or use the closure form with the scripted one.
        criterion: ``(outputs, targets) -> mean loss per case``, e.g. ``F.cross_entropy``.
            The optimizer's ``likelihood_weight`` multiplies this mean: with
            ``reduction="sum"`` set ``likelihood_weight`` to the number of batches per epoch,
            ``len(loader)`` (``N / B`` only where ``B`` divides ``N``; left at ``N``,
            ``sigma`` is ``sqrt(B)`` too small). ``nn.MSELoss()`` is the negative
            log likelihood of a Gaussian noise of variance ``1/2`` (use ``0.5 * mse`` for
            variance 1); ``nn.GaussianNLLLoss()`` that of the ``var`` it is given.

    Returns:
        A `ModuleLoss`, ``loss_fn(params, x, y) = criterion(functional_call(module,
        params, (x,)), y)``. Calling ``module_loss`` again with the same module and criterion
        gives a loss with which the optimizer reuses its ``vectorize`` decision.
    """
    return ModuleLoss(module, criterion)


_HP_NAMES = tuple(f.name for f in fields(QNVBHyperparameters))
_STATE_NAMES = QNVBState._fields
_CHECKED_NAMES = (*_HP_NAMES, "prior_precision", "init_sigma")
"""The settings of a group that `QNVBOptimizer._group_settings` checks."""
_OWNED_KEYS = ("mu", "sigma", *_STATE_NAMES)
"""The state fields the update writes in place where the optimizer owns them
(`QNVBOptimizer._owns`)."""
_GROUP_KEYS = (*_HP_NAMES, "prior_precision", "init_sigma")
"""The settings a parameter group may hold (besides ``params`` and ``param_names``)."""
_INERT_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
"""Keys torch's learning-rate schedulers keep in a group (``initial_lr`` given in a group
resumes a scheduler with ``last_epoch``), and ``"name"``, a user's label: taken, never read."""


def weight_decay_conversion(prior: str, weight: str, values: str) -> str:
    """How torch's ``weight_decay`` and an L2 term of the loss read as ``prior_precision``, for
    the refusal of ``weight_decay`` by `QNVBOptimizer` and
    `SparseQNVBOptimizer`.

    Torch's coupled ``weight_decay`` adds ``weight_decay * theta`` to the gradient of the mean
    loss per case, which the number of cases multiplies: the gradient of the Gaussian prior
    ``exp(-prior_precision |theta|^2 / 2)`` with ``prior_precision = weight_decay * weight``,
    a prior being a regularization term of the negative log posterior (rasp paper, Section 4).

    Args:
        prior: the sentence saying what the optimizer's prior is.
        weight: the name of what multiplies the mean loss per case (``"likelihood_weight"``,
            ``"num_cases"``).
        values: ``weight_decay * weight`` with the values at hand, as the message shows them
            (e.g. ``"0.0001 * 64"``).
    """
    return (
        f"{prior} Torch's (coupled, SGD/Adam) weight_decay adds weight_decay * theta to the "
        f"gradient of the mean loss per case, which {weight} multiplies: pass prior_precision = "
        f"weight_decay * {weight} ({values}). An L2 term lam * |theta|^2 added to the loss is "
        f"multiplied by {weight} too and acts as prior_precision = 2 * lam * {weight} (leave it "
        "out and pass that)"
    )


_QNVB_PRIOR = (
    "Its prior is prior_precision, a zero-mean Gaussian prior exp(-prior_precision * "
    "|theta|^2 / 2)."
)
"""What `QNVBOptimizer`'s refusal of ``weight_decay`` says its prior is."""


def group_params(param_group: object) -> object:
    """A shallow copy of ``param_group`` whose ``params`` is a list, so that an iterator
    (``net.parameters()``) can be checked before torch's ``add_param_group`` reads it; anything
    torch refuses (not a dict, a tensor, a set) is passed on for torch's own error."""
    if not isinstance(param_group, dict):
        return param_group
    group = dict(param_group)
    params = group.get("params")
    if isinstance(params, torch.Tensor):  # torch takes one tensor as a group of one
        group["params"] = [params]
    elif params is not None and not isinstance(params, set):
        group["params"] = list(params)
    return group


def _labelled_parameters(param_group: object, first_position: int) -> Iterator[tuple[str, object]]:
    """``(label, parameter)`` of every item of a group's ``params`` list (none where the group is
    not a dict with such a list: torch refuses it), each labelled by its position among the
    optimizer's parameters (``first_position`` is the group's first) and by name where
    ``named_parameters()`` gave one (`_parameter_label`)."""
    if not isinstance(param_group, dict) or not isinstance(param_group.get("params"), list):
        return
    for k, item in enumerate(param_group["params"]):
        name, p = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
        yield _parameter_label(first_position + k, name), p


def refuse_half_precision(param_group: object, first_position: int, owner: str) -> None:
    """`check_precision` of every parameter of a group, named by its position among the
    optimizer's parameters (``first_position`` is the group's first) and by name where
    ``named_parameters()`` gave one."""
    for label, p in _labelled_parameters(param_group, first_position):
        if isinstance(p, torch.Tensor):
            check_precision(p, label, owner)


def refuse_duplicate_parameters(param_group: object, first_position: int, owner: str) -> None:
    """Refuse a group that holds one tensor twice, naming both positions (as
    `refuse_half_precision` numbers them) and its shape. Torch's optimizers warn of such a group
    ("duplicate parameters", an error to come); here one tensor would be given two mean fields,
    whose second step failed in the update with the tensor left at a quadrature node. (Torch
    refuses a tensor in two groups itself.)"""
    seen: dict[int, str] = {}
    for label, p in _labelled_parameters(param_group, first_position):
        if id(p) in seen:
            raise ValueError(
                f"{owner}: {seen[id(p)]} and {label} are the same tensor (shape "
                f"{tuple(p.shape)}); torch's optimizers warn that a parameter group with "
                "duplicate parameters will be an error, and here it is one: a tensor has one "
                "mean field. Pass each parameter once (list(dict.fromkeys(params)) drops repeats)"
            )
        seen[id(p)] = label


def _count_label(p: torch.Tensor, name: str | None) -> str:
    """A step's warnings' label of ``p``: ``"parameter '0.weight' of shape (8, 4)"`` where the
    group's ``param_names`` (from ``named_parameters()``) name it, else ``"a parameter of shape
    (8, 4)"``."""
    return f"{'a parameter' if name is None else f'parameter {name!r}'} of shape {tuple(p.shape)}"


def _parameter_label(position: int, name: str | None) -> str:
    """``"parameter 3"``, or ``"parameter 3 ('fc.weight')"`` where it has a name."""
    return f"parameter {position}" + ("" if name is None else f" ({name!r})")


def check_precision(p: torch.Tensor, label: str, owner: str) -> None:
    """Refuse a parameter in float16, bfloat16 (or any float narrower than float32), when it is
    given and again at every step (a net cast with ``net.half()`` after the optimizer was built
    changes its parameters in place); ``label`` names it (``"parameter 3 ('fc.weight')"``,
    ``"site 'w'"``). The one refusal of `QNVBOptimizer`, `SparseQNVBOptimizer` and `QNVB`
    (for a guide's loc, checked once per group of blocks and step).

    The quadrature nodes ``mu + sigma * x_k`` lie ``sigma`` (``1e-3`` at first) from the mean:
    in bfloat16 (8 bits of mantissa) such a move is lost next to a mean of order one, and the
    curvature ``h`` (a difference of gradients over ``sigma``) is rounding noise; the update's
    sums lose the rest in float16.

    A complex parameter is refused too (a ``ValueError``), named with its shape: the mean field
    is a real Gaussian per coordinate, and its nodes are real (a complex parameter failed in
    the middle of a step before).
    """
    if p.is_complex():
        raise ValueError(
            f"{owner}: {label} of shape {tuple(p.shape)} is {p.dtype}; the mean field is a real "
            "Gaussian per coordinate, so complex parameters are not supported. Keep the real "
            "and imaginary parts as two real parameters (torch.view_as_real gives them as a "
            "last axis of 2) and form the complex tensor in the forward (torch.complex(re, im))"
        )
    if p.is_floating_point() and torch.finfo(p.dtype).bits < 32:
        raise TypeError(
            f"{owner}: {label} is {p.dtype}; the quadrature nodes mu + sigma * x_k and the "
            "curvature from them need at least float32 (in half precision the means and "
            "sigma come out silently wrong). Keep the parameters in float32 (net.float(), "
            "before a BayesianModule wraps the net; a Pyro guide takes its model's dtype) "
            "and run the forward pass in half precision under torch.autocast"
        )


def checked_parameters(optimizer: torch.optim.Optimizer, owner: str):
    """``(parameter, group)`` of every parameter that requires grad, each checked by
    `check_precision` (named by position, and by the group's ``param_names``)."""
    position = 0
    for group in optimizer.param_groups:
        names = group.get("param_names")
        for k, p in enumerate(group["params"]):
            if p.requires_grad:
                label = _parameter_label(position, None if names is None else names[k])
                check_precision(p, label, owner)
                yield p, group
            position += 1


def refuse_guide_parameters(
    owner: str,
    params: list[torch.Tensor],
    names: list[str | None],
    described: list[tuple[object, GuideDescription]],
    first_position: int = 0,
) -> None:
    """Refuse parameters of a plain-torch optimizer that are a guide's variational parameters:
    the locs and scales (a joint Gaussian's too) of a guide in ``described`` (pairs of
    `describe_live_guides`), matched by identity as `QNVB` pairs them. ``names[k]`` names
    ``params[k]`` where a name is known (``named_parameters()``); the messages number them
    from ``first_position`` (the first one's position among the optimizer's parameters).

    The optimizer puts a Gaussian of its own around every parameter (rasp paper, eq. 4), so
    on a guide's loc and scale it integrates the ELBO over a second Gaussian and the guide's
    scales come out wrong, with no error: the user's trial of session 22 (one Normal mean, 50
    observations) ended at a posterior sd of 0.080 where the exact one is 0.141.

    Raises:
        TypeError: naming the guide, the parameters and the latent sites, and the way to fit
            the guide (`SVI` with `QNVB` and `QuadratureELBO`, in Pyro's local mode as well).
    """
    position = {id(p): k for k, p in enumerate(params)}
    store = pyro.get_param_store()
    for guide, description in described:
        held = sorted(position[id(t)] for t in description.leaves() if id(t) in position)
        if not held:
            continue
        roles = {
            id(leaf): site.param_names.get(role)
            for site in description.sites
            for role, leaf in site.params.items()
        }
        labels = ", ".join(
            _parameter_label(
                first_position + k,
                names[k] or store.param_name(params[k]) or roles.get(id(params[k])),
            )
            for k in held
        )
        sites = [site.name for site in description.latent_sites]
        raise TypeError(
            f"{owner} was given the variational parameters (locs and scales) of the guide "
            f"{guide_class_name(guide)} {description.guide!r} over the latent sites {sites}: "
            f"{labels}. {owner} is for the weights of a network: it keeps a Gaussian of its "
            "own around every parameter and averages the loss over it, so on a guide's locs "
            "and scales it fits a Gaussian over the guide's Gaussian and the guide's scales "
            "come out wrong, without an error. Fit the guide with SVI(model, guide, QNVB(), "
            "QuadratureELBO()) and svi.step(*args) (QNVB pairs each loc with its scale and "
            "updates them from the quadrature's moments): SVI runs under "
            "pyro.settings.set(module_local_params=True) too, in place of the loop over "
            "loss_fn = elbo(model, guide) with a torch optimizer on loss_fn.parameters(). See "
            "the pages 'QNVB for plain PyTorch' and 'QNVB'."
        )


def refuse_added_guide_parameters(owner: str, items: list, position: int) -> None:
    """At ``add_param_group`` of a plain-torch optimizer (``items``: the group's parameters, or
    ``(name, parameter)`` pairs; ``position``: the first one's among the optimizer's):
    `refuse_guide_parameters` against the guides known to be live, and, where a guide could hold
    one of them (Pyro's local mode, or a parameter in Pyro's param store), `watch_guides`, which
    notes the guides the first step's loss runs for `refuse_run_guides`. Installed once and
    kept, like QNVB's, the watch makes dynamo compile a compiled network no second time."""
    params = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in items]
    if not all(isinstance(p, torch.Tensor) for p in params):
        return  # torch's own error
    names = [p[0] if isinstance(p, tuple) and len(p) == 2 else None for p in items]
    refuse_guide_parameters(owner, params, names, describe_live_guides(params), position)
    store = pyro.get_param_store()
    if pyro.settings.get("module_local_params") or any(
        store.param_name(p) is not None for p in params
    ):
        watch_guides()


def refuse_run_guides(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], mus: list[torch.Tensor]
) -> None:
    """In the first step after parameters were added, once the loss has run the guides it calls
    and before the update: `refuse_guide_parameters` of every parameter of ``optimizer``
    against the guides now known to be live (construction saw only those known then). On a
    refusal ``params`` go back to their means ``mus`` (the loss left them at a node), their
    gradients cleared; else the check is not made again (``_guides_unchecked``, which
    ``add_param_group`` sets)."""
    every, names = [], []
    for group in optimizer.param_groups:
        every.extend(group["params"])
        names.extend(group.get("param_names") or [None] * len(group["params"]))
    try:
        refuse_guide_parameters(type(optimizer).__name__, every, names, describe_live_guides(every))
    except TypeError:
        restore_means(params, mus)
        raise
    optimizer._guides_unchecked = False


def standard_normal(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard normal draws of ``p``'s shape, dtype and device, drawn on ``generator``'s
    device (`draw_device`)."""
    at = draw_device(generator, p.device)
    return torch.randn(p.shape, generator=generator, dtype=p.dtype, device=at).to(p.device)


def drop_autocast_copies() -> None:
    """Drop `torch.autocast`'s cached half-precision copies of the parameters, to be called
    after an optimizer writes them in place (a node, a draw, the means). Autocast casts a leaf
    tensor that requires grad once and keeps the copy until the outermost autocast exits, and
    an in-place write does not renew it: under an autocast entered around a step (or around the
    whole loop), every node would run with the first node's weights (``h = 0``, ``sigma`` held
    at ``init_sigma``) and every draw of `QNVBOptimizer.sampled_params` would give the same
    output. Outside autocast the cache is empty and this does nothing."""
    torch.clear_autocast_cache()


@contextmanager
def sampled_values(
    params: list[torch.Tensor],
    draws: list[torch.Tensor],
    means: list[torch.Tensor],
    marks: dict[int, tuple[int, int]],
) -> Iterator[None]:
    """The parameters set to ``draws`` for the block and to ``means`` after it (also when it
    raises); the block itself runs in the caller's grad mode. ``means`` are the optimizer's,
    and ``marks`` its `written_marks`: the parameters are marked as written after the
    means are back, so the next step does not take them as changed."""
    try:
        with torch.no_grad():
            for p, draw in zip(params, draws):
                p.copy_(draw)
        drop_autocast_copies()
        yield
    finally:
        with torch.no_grad():
            for p, mean in zip(params, means):
                p.copy_(mean)
        drop_autocast_copies()
        marks.update(written_marks(params))


def restore_means(params: list[torch.Tensor], mus: list[torch.Tensor]) -> None:
    """Every parameter set back to its mean (``mus``, in the same order), its gradient cleared:
    where a step stops with an error, at whatever node the parameters were."""
    with torch.no_grad():
        for p, mu in zip(params, mus):
            p.copy_(mu)
            p.grad = None
    drop_autocast_copies()


def written_marks(params: Iterable[torch.Tensor]) -> dict[int, tuple[int, int]]:
    """``id(p) -> (version, storage)`` of parameters an optimizer has just set to their means,
    for `changed_parameters` to compare at the next step."""
    return {id(p): (p._version, p.data_ptr()) for p in params}


def changed_parameters(
    params: Iterable[torch.Tensor], marks: dict[int, tuple[int, int]]
) -> list[torch.Tensor]:
    """The parameters changed since `written_marks` recorded ``marks`` (or never marked).

    Between steps the parameters hold the means, and a change made to one there (a
    ``net.load_state_dict``, a re-initialization, a clamp, under ``torch.no_grad()``) is a
    change of the mean. It is seen without a host-device sync: the parameter's version counter
    (``_version``, which every in-place operation on it bumps) or its storage (``p.data = ...``)
    differs from the mark. A parameter never marked (before its first step, in a copy of the
    optimizer) counts as changed: it holds its mean already, so taking it changes nothing. An
    in-place operation on ``p.data`` (which does not share ``p``'s version counter) is not
    seen.
    """
    return [p for p in params if marks.get(id(p)) != (p._version, p.data_ptr())]


def check_saved_parameters(owner: str, state_dict: dict, param_groups: list[dict]) -> None:
    """Refuse a saved per-parameter state that torch would pair (by position) with another
    parameter of ``param_groups``: where the saved group and the current one both have
    ``param_names``, a name that differs (the state holds the means, so a same-shaped parameter
    in another place would silently take another's weights); anywhere, a saved ``mu`` of another
    shape. Both are named with the parameter's position, in a ``ValueError`` from ``owner``.
    Where either side has no names, torch's pairing by position stands (torch keeps the saved
    names, if any). Where both have names but two of this optimizer's groups have the same
    names and shapes (each group built from a sub-module's ``named_parameters()``), no check
    can tell them apart, so groups listed in another order would pass: that is refused too."""
    saved_state = state_dict["state"]
    _refuse_twin_groups(owner, state_dict["param_groups"], param_groups)
    position = 0
    for saved_group, group in zip(state_dict["param_groups"], param_groups):
        names = group.get("param_names")
        saved_names = saved_group.get("param_names")
        for k, (saved_id, p) in enumerate(zip(saved_group["params"], group["params"])):
            label = f"parameter {position + k}" + ("" if names is None else f" ({names[k]!r})")
            if names is not None and saved_names is not None and saved_names[k] != names[k]:
                raise ValueError(
                    f"{owner}: the saved state of parameter {position + k} is that of "
                    f"{saved_names[k]!r}, but this optimizer's parameter {position + k} is "
                    f"{names[k]!r}; the state holds the means (the weights), so loading it would "
                    "give one parameter another's. Build the optimizer with the groups and "
                    "parameters in the saved order: "
                    f"{[g.get('param_names') for g in state_dict['param_groups']]}"
                )
            mu = saved_state.get(saved_id, {}).get("mu")
            if mu is not None and mu.shape != p.shape:
                raise ValueError(
                    f"{owner}: the saved state of {label} has shape {tuple(mu.shape)}, but the "
                    f"parameter has shape {tuple(p.shape)}; load a state into an optimizer over "
                    "the parameters it was saved with (same shapes, same order)"
                )
        position += len(group["params"])


def _refuse_twin_groups(owner: str, saved_groups: list[dict], param_groups: list[dict]) -> None:
    """Refuse (`check_saved_parameters`) a load between named groups of which two in this
    optimizer have the same ``param_names`` and parameter shapes: the name check cannot tell
    whether they are listed in the saved order."""
    if any(g.get("param_names") is None for g in [*saved_groups, *param_groups]):
        return
    seen: dict[tuple, int] = {}
    for k, group in enumerate(param_groups):
        key = tuple((n, tuple(p.shape)) for n, p in zip(group["param_names"], group["params"]))
        if key in seen:
            raise ValueError(
                f"{owner}: parameter groups {seen[key]} and {k} have the same parameter names "
                f"{list(group['param_names'])} and shapes, so the names cannot tell whether the "
                "groups are listed in the saved order, and a swap would give each layer "
                "another's weights (the state holds the means). Name the parameters by their "
                "place in the whole model, on both sides: "
                "[(f'enc.{n}', p) for n, p in enc.named_parameters()], or build the groups from "
                "model.named_parameters()"
            )
        seen[key] = k


class CopyableOptimizerState:
    """``copy.deepcopy`` and ``pickle`` of an optimizer that keep its own attributes.

    Torch's ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``,
    so a copy of an optimizer with further attributes (the rule, the step count, the generator)
    fails at its first step. Here everything is kept but torch's hooks, which torch leaves out
    of a copy too (they are closures of the original); ``torch.optim.Optimizer.__setstate__``
    makes them anew and re-patches ``step``. A copied generator continues from the original's
    state, so the copy takes the original's next steps bit for bit.
    """

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}

    def __setstate__(self, state: dict) -> None:
        # an unpickled copy brings its defaults; load_state_dict calls this with none
        defaults = state["defaults"] if "defaults" in state else self.defaults
        had_differentiable = "differentiable" in defaults
        super().__setstate__(state)  # type: ignore[misc]
        if not had_differentiable:  # torch adds it to the defaults; the original has none
            self.defaults.pop("differentiable")


class CheckpointHooks(CopyableOptimizerState):
    """The checkpoint of an optimizer whose parameters hold its means (`QNVBOptimizer`,
    `SparseQNVBOptimizer`), through torch's state-dict hooks.

    `_register_checkpoint_hooks` (called last in the subclass's ``__init__``, and again
    in a copy, which torch makes without hooks) registers, before any of the user's: a
    state-dict pre-hook that takes the parameters' changes since the last step as the means
    (the subclass's ``_take_edits(params)``); a post-hook that adds the entry
    ``state_dict[_entry_key] = _checkpoint_entry()``; a load pre-hook, kept after every other
    (`register_load_state_dict_pre_hook`), that refuses a state the optimizer cannot load
    (``_check_loaded(state_dict)``); and a load post-hook that restores the entry and the means
    (``_restore_loaded()``, with `_write_means`). A user's state-dict post-hook and load
    post-hook registered without ``prepend=True`` run after the optimizer's: the first sees the
    entry, the second the restored state; a user's load pre-hook (a migration of an older
    entry), however registered, runs before the check.
    """

    _entry_key: str
    """The key of the optimizer's entry in its state dict."""

    _step_supports_amp_scaling = True
    """Read by ``torch.amp.GradScaler.step``, which then calls ``step`` itself, where
    `refuse_grad_scaler` refuses it by name (not the scaler's own ``AssertionError``)."""

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # loaded, copied or unpickled: every parameter is compared with its mean at the next step
        self._written = {}
        self.__dict__.setdefault("_loaded", None)  # absent from a copy of an earlier version
        self.__dict__.setdefault("_idle_steps", 0)  # likewise
        hooks = getattr(self, "_checkpoint_hooks", None)  # likewise
        if hooks is None or hooks[1] not in self._optimizer_load_state_dict_pre_hooks:
            self._register_checkpoint_hooks()  # a copy (torch leaves the hooks out)

    def _register_checkpoint_hooks(self) -> None:
        """The optimizer's four checkpoint hooks (see the class), ahead of any of the user's."""
        optimizer = torch.optim.Optimizer
        optimizer.register_state_dict_pre_hook(self, _take_edits_hook)
        self._checkpoint_hooks = (
            optimizer.register_state_dict_post_hook(self, _add_entry_hook).id,
            optimizer.register_load_state_dict_pre_hook(self, _check_entry_hook).id,
            optimizer.register_load_state_dict_post_hook(self, _restore_entry_hook).id,
        )

    def register_load_state_dict_pre_hook(self, hook: Callable, prepend: bool = False):
        """Torch's `register_load_state_dict_pre_hook`, with the
        optimizer's own check of the loaded state kept after every user hook: a hook that
        migrates the entry of an older checkpoint runs before it is read."""
        handle = super().register_load_state_dict_pre_hook(hook, prepend=prepend)
        self._optimizer_load_state_dict_pre_hooks.move_to_end(self._checkpoint_hooks[1])
        return handle

    def _saved_entry(self, state_dict: dict, owner: str, contents: str) -> dict:
        """The optimizer's entry of ``state_dict`` (``contents``: what ``owner.state_dict``
        puts there); a ``ValueError`` from ``owner`` where the entry is absent."""
        if self._entry_key not in state_dict:
            raise ValueError(
                f"{owner}.load_state_dict: the state dict has no {self._entry_key!r} entry "
                f"({contents} that {owner}.state_dict adds): it was not saved by a {owner}, or a "
                "state-dict hook dropped the entry"
            )
        return state_dict[self._entry_key]

    def _write_means(self) -> None:
        """Every parameter with a state set to its mean ``state[p]["mu"]`` (just loaded), and
        marked as written (`written_marks`)."""
        params = [p for group in self.param_groups for p in group["params"] if self.state.get(p)]
        with torch.no_grad():
            for p in params:
                p.copy_(self.state[p]["mu"])
        drop_autocast_copies()
        self._written.update(written_marks(params))


def _take_edits_hook(optimizer: CheckpointHooks) -> None:
    """State-dict pre-hook of a `CheckpointHooks`: the parameters changed since the last
    step give the means saved."""
    optimizer._take_edits([p for group in optimizer.param_groups for p in group["params"]])


def _add_entry_hook(optimizer: CheckpointHooks, state_dict: dict) -> None:
    """State-dict post-hook of a `CheckpointHooks`: its entry."""
    state_dict[optimizer._entry_key] = optimizer._checkpoint_entry()


def _check_entry_hook(optimizer: CheckpointHooks, state_dict: dict) -> None:
    """Load pre-hook of a `CheckpointHooks`: the checks of ``load_state_dict``."""
    optimizer._check_loaded(state_dict)


def _restore_entry_hook(optimizer: CheckpointHooks) -> None:
    """Load post-hook of a `CheckpointHooks`: the entry and the means restored."""
    optimizer._restore_loaded()


def _scalar_tensor(loss: object, requirement: str) -> torch.Tensor:
    """``loss`` as a 0-d tensor, or a ``TypeError`` stating ``requirement`` and what came."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else f"{loss!r} ({type(loss).__name__})"
        )
        raise TypeError(f"{requirement}; it returned {got}")
    return loss.reshape(())


def _checked_loss(loss: object, owner: str) -> torch.Tensor:
    """The closure's loss as a detached 0-d tensor, or a clear error for anything else."""
    return _scalar_tensor(
        loss,
        f"{owner}: the closure must return the scalar loss tensor (mean per case) after "
        "calling backward() on it",
    ).detach()


def closure_moments(
    params: list[torch.Tensor],
    mus: list[torch.Tensor],
    sigmas: list[torch.Tensor],
    nodes: NodeSet,
    closure: Callable[[], torch.Tensor],
    owner: str,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """The closure evaluated at each quadrature node in turn (rasp paper, eq. 7-8 before the
    division by ``sigma``; sequence paper, Algorithm 4.1).

    Node ``k`` sets every parameter to ``mu + sigma * x_k`` (its slice of ``x_k``, in the order
    of ``params``) with its gradient cleared, and calls ``closure``. Returns the quadrature
    average of the loss and, per parameter, ``(sum_k w_k grad_k, sum_k w_k grad_k x_k)``, or
    ``None`` for a parameter that received no gradient. On any error the parameters are set
    back to ``mus`` with their gradients cleared; ``owner`` names the optimizer in the messages.
    """
    g_sum = [torch.zeros_like(p) for p in params]
    gx_sum = [torch.zeros_like(p) for p in params]
    seen = [False] * len(params)
    first = params[0]
    loss_avg = torch.zeros((), dtype=first.dtype, device=first.device)
    try:
        for k in range(len(nodes)):
            x, weight_k, start, offsets = nodes.node(k), nodes.weights[k], 0, []
            for p, mu, sigma in zip(params, mus, sigmas):
                x_p = x[start : start + p.numel()].view_as(p)
                start += p.numel()
                p.copy_(mu + sigma * x_p)
                p.grad = None
                offsets.append(x_p)
            drop_autocast_copies()
            with torch.enable_grad():
                loss = _checked_loss(closure(), owner)
            loss_avg += weight_k * loss
            for i, p in enumerate(params):
                if p.grad is None:
                    continue
                seen[i] = True
                g_sum[i] += weight_k * p.grad
                gx_sum[i] += weight_k * p.grad * offsets[i]
        if not any(seen):
            raise RuntimeError(
                f"{owner}: none of the {len(params)} parameters this optimizer holds received a "
                "gradient. The closure must call backward() on the loss before returning it, "
                "and compute the loss from these tensors: did you rebuild or move the module "
                "after creating the optimizer (net.to_empty() after building it on the meta "
                "device, a new module, or a copy.deepcopy of the optimizer stepped with the "
                "original net)? Then the optimizer holds other tensors than the network's: "
                "create it from the parameters the network has now"
            )
    except BaseException:  # the parameters go back to their means, unchanged
        restore_means(params, mus)
        raise
    moments = [(g, gx) if ok else None for g, gx, ok in zip(g_sum, gx_sum, seen)]
    return loss_avg, moments


def data_moments(
    moment: tuple[torch.Tensor, torch.Tensor] | None, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A held parameter's moments of one step (`closure_moments`), a zero data term where it
    received no gradient (``None``: a branch not taken, a head the batch does not use): such a
    batch does not inform it, so its curvature average decays towards the prior's, where
    leaving the step out would count every batch that does use it as the whole data set
    (``sigma`` too small by the square root of the fraction of steps using it)."""
    if moment is not None:
        return moment
    return torch.zeros_like(like), torch.zeros_like(like)


_CHECKPOINT_FIX = (
    "Remove the checkpoint for this fit, or step with a closure, opt.step(closure), which "
    "writes each node into the parameters, where checkpoint(..., use_reentrant=False) "
    "recomputes at the node"
)


def _weighted_gradients(
    losses: torch.Tensor, nodes: NodeSet, stacked: list[torch.Tensor], owned: set[int]
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``sum_k w_k loss_k`` and its gradients with respect to the parameters stacked over the
    nodes (``None`` where one is not used; all ``None`` where the loss reads none of them).
    A failure on a sparse gradient is a ``RuntimeError`` with the way out; a layer holding
    one of the optimizer's parameters (``owned``, their ids) recomputed in the backward is
    refused (`refuse_recomputed_forward`)."""

    def swapped(module: nn.Module) -> bool:
        return any(id(p) in owned for p in module.parameters(recurse=False))

    total = (nodes.weights.to(losses.dtype) * losses).sum()
    if not total.requires_grad:
        return total, [None] * len(stacked)
    try:
        owner = "QNVBOptimizer.step(loss_fn=...)"
        with refuse_recomputed_forward(owner, _CHECKPOINT_FIX, swapped):
            return total, list(torch.autograd.grad(total, stacked, allow_unused=True))
    except (RuntimeError, NotImplementedError) as error:
        if isinstance(error, RecomputedForward) or "sparse" not in str(error).lower():
            raise
        raise RuntimeError(
            "QNVBOptimizer: the one-pass backward failed on a sparse gradient ("
            f"{first_line(error).split('. ')[0]}): step(loss_fn=...) differentiates "
            "the parameters stacked over the nodes, which takes dense gradients "
            "only. Build the layer with dense gradients (nn.Embedding(..., "
            "sparse=False), the default), or use the closure form, step(closure), "
            "which takes sparse gradients"
        ) from error


def _batch_finite(batch: tuple, device: torch.device) -> torch.Tensor | None:
    """Whether every floating tensor of ``batch`` is finite (`sum_is_finite`: false also
    where a sum overflows, which `check_finite_loss` then tells apart), as a 0-d tensor on
    ``device`` (not read here: `check_finite_loss` reads it with the loss, in its one host
    sync); ``None`` for a batch without floating tensors."""
    flags = [
        sum_is_finite(t).to(device)
        for t in batch
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return torch.stack(flags).all() if flags else None


def _nonfinite_moments(moments: list | None) -> bool:
    """Whether a gradient moment (``sum_k w_k grad_k`` or ``sum_k w_k grad_k x_k``) holds NaN
    or an infinity (a host sync: read only where the batch is not finite)."""
    return any(not bool(torch.isfinite(m).all()) for pair in moments or () if pair for m in pair)


def _nonfinite_field(
    params: list[torch.Tensor], mus: list[torch.Tensor], sigmas: list[torch.Tensor]
) -> str | None:
    """Where the mean field the nodes ``mu + sigma x_k`` were placed at is not finite:
    ``"sigma is inf at 12 coordinates of a parameter of shape (4, 3)"``, or ``None``."""
    for p, mu, sigma in zip(params, mus, sigmas):
        for name, values in (("mu", mu), ("sigma", sigma)):
            bad = ~torch.isfinite(values)
            if bool(bad.any()):
                first = values[bad].reshape(-1)[0].item()
                return (
                    f"{name} is {first} at {int(bad.sum())} coordinates of a parameter of shape "
                    f"{tuple(p.shape)}"
                )
    return None


def check_finite_loss(
    loss_avg: torch.Tensor,
    params: list[torch.Tensor],
    mus: list[torch.Tensor],
    owner: str,
    *,
    sigmas: list[torch.Tensor] | None = None,
    batch: tuple = (),
    moments: list | None = None,
    field_hint: str = "",
) -> float:
    """Refuse a step whose quadrature average of the loss is not finite (one host sync); return
    it as a number, read by that one sync.

    A node's NaN or infinite loss makes its gradients so at nearly every coordinate, which the
    update's guard would leave unchanged: a step that learns nothing, told by a warning only.
    The parameters go back to their means (``mus``) before the error, which names the cause it
    finds: where a floating tensor of ``batch`` (the one-pass form's data; read in the same
    sync) holds NaN or an infinity, that tensor's rows, and the step is refused also where the
    loss is finite but a gradient moment (``moments``) is not (an infinite input that a
    ``tanh`` saturates: its gradient is ``0 * inf``); a finite loss and finite gradients from
    such a batch (an attention mask of ``-inf``) go on. Else, where the mean field (``mus``,
    ``sigmas``) is not finite, that, with the optimizer's ``field_hint`` on the setting that
    may have caused it; else the data or an overflow of the model, with float64 named only
    where the loss or a parameter is of a lower precision (`or_float64`).
    """
    finite_batch = _batch_finite(batch, loss_avg.device)
    if finite_batch is None:
        value, batch_ok = float(loss_avg), True
    else:
        # read as "not finite" (0 where all is well, as a zero-filled fake read says too)
        flag = finite_batch.logical_not().to(loss_avg.dtype)
        read = torch.stack([loss_avg.detach(), flag]).tolist()
        value, batch_ok = read[0], read[1] == 0
    if batch_ok and math.isfinite(value):
        return value
    where = None
    if not batch_ok:  # (None where a sum overflowed but every entry is finite)
        where = next(
            (
                f"batch[{i}] at {w}"
                for i, t in enumerate(batch)
                if (w := nonfinite_data(t, f"batch[{i}]"))
            ),
            None,
        )
        if math.isfinite(value) and (where is None or not _nonfinite_moments(moments)):
            return value
    field = None if sigmas is None or where is not None else _nonfinite_field(params, mus, sigmas)
    restore_means(params, mus)
    untaken = "The parameters are left at their means and the step was not taken"
    skip = (
        "To skip such a step and go on, catch this ValueError, but not under "
        "DistributedDataParallel, whose other ranks, finite, took the step"
    )
    if where is not None:
        what = (
            f"the loss is {value}"
            if not math.isfinite(value)
            else "the loss is finite but its gradient is not (an infinite input saturates a "
            "unit, whose gradient is 0 * inf)"
        )
        raise ValueError(
            f"{owner}: the batch holds NaN or infinite values ({where}), and {what}. {untaken}: "
            "drop or impute those rows (keep = torch.isfinite(x).flatten(1).all(1); x[keep], "
            f"y[keep]), or replace the values (torch.nan_to_num). {skip}"
        )
    if field is not None:
        raise ValueError(
            f"{owner}: the loss averaged over the quadrature nodes is {value}, at nodes mu + "
            f"sigma x_k of a mean field that is not finite: {field}.{field_hint} {untaken}"
        )
    dtypes = [loss_avg.dtype, *(p.dtype for p in params)]
    cause = (
        "a NaN or infinity in the batch, or a model that overflows there"
        if finite_batch is None
        else "the batch is finite: a model that overflows there, or makes a NaN"
    )
    raise ValueError(
        f"{owner}: the loss averaged over the quadrature nodes is {value}: the loss is "
        f"not finite at some node ({cause}). {untaken}: "
        f"{or_float64('check the data', dtypes, ', or ')}. {skip}"
    )


def _scalar_loss(loss: object) -> torch.Tensor:
    """``loss_fn``'s value as a 0-d tensor (still differentiable), or a clear error."""
    return _scalar_tensor(
        loss, "QNVBOptimizer: loss_fn must return the scalar loss tensor (mean per case)"
    )


class _NodeStack:
    """The per-parameter node stacks ``(K, *shape)`` as the points of ``evaluate_batch``: its
    length is ``K`` and item ``k`` is the list of every parameter at node ``k``."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __getitem__(self, k: int) -> list[torch.Tensor]:
        return [t[k] for t in self.tensors]


def loss_module(loss_fn: LossFunction) -> nn.Module | None:
    """The network a ``loss_fn`` exposes: a `ModuleLoss`'s ``module``, any ``loss_fn``'s
    ``module`` attribute that is an ``nn.Module`` (a function may carry one:
    ``loss_fn.module = net``), or the ``loss_fn`` itself when it is an ``nn.Module``;
    ``None`` otherwise."""
    if isinstance(loss_fn, nn.Module):
        return loss_fn
    module = getattr(loss_fn, "module", None)
    return module if isinstance(module, nn.Module) else None


def _decision_key(loss_fn: LossFunction) -> tuple[tuple, tuple[bool, ...] | None]:
    """The objects a ``vectorize`` decision is kept for, and the modes it holds in.

    A `ModuleLoss` counts as its module and criterion (a new ``module_loss(net,
    criterion)`` each step reuses the decision); any other ``loss_fn`` as itself. The modes are
    the training flags of the submodules of the network the loss exposes (`loss_module`;
    a net in ``eval()`` may run under ``vmap`` and fail in ``train()``, e.g. with dropout).
    """
    module = loss_module(loss_fn)
    flags = None if module is None else tuple(m.training for m in module.modules())
    if isinstance(loss_fn, ModuleLoss):
        return (loss_fn.module, loss_fn.criterion), flags
    return (loss_fn,), flags


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype of the `torch.autocast` enabled on ``device_type`` around this call, or
    ``None`` where none is."""
    # (a device without autocast, "meta" say, cannot be asked whether it is on)
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def resolution_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype whose spacing resolves ``p``'s nodes in a forward run around this call: under
    a `torch.autocast` on ``p``'s device, its dtype where coarser than ``p``'s (``Linear`` and
    ``Conv`` cast their weights to it: bfloat16's spacing is ``0.0156`` at ``2.0``); otherwise,
    and for a float64 ``p`` (which autocast does not cast), ``p``'s own."""
    cast = autocast_dtype(p.device.type)
    if (
        cast is not None
        and p.dtype != torch.float64
        and torch.finfo(cast).eps > torch.finfo(p.dtype).eps
    ):
        return cast
    return p.dtype


def _check_tolerances(device_type: str) -> tuple[float | None, float | None]:
    """The relative and absolute tolerances of the probes' check: those of the losses' dtype
    (`probe_tolerance`: ``None``), or under ``torch.autocast`` the autocast dtype's machine
    epsilon (``7.8e-3`` for bfloat16): a batched product rounds differently in half precision
    (by ``1.5e-4`` relative on a 20-64-1 net in bfloat16 on the CPU), while a loss that is not a
    function of its parameters (dropout in training mode) or a pass that mixes the nodes differs
    by far more."""
    cast = autocast_dtype(device_type)
    if cast is not None:
        tolerance = torch.finfo(cast).eps
        return tolerance, tolerance
    return None, None


class BufferSnapshot:
    """The buffers of the network a ``loss_fn`` exposes (`loss_module`) around a
    vectorized pass that is tried or checked (before the decision), so that the pass
    leaves them as one evaluation of the chosen kind would: abandoned (an error, or values that
    differ from single evaluations), its changes are undone (BatchNorm in train mode updates
    ``num_batches_tracked`` before ``vmap`` refuses its running statistics); kept, the probes'
    single evaluations are undone. A pass decided on an earlier step is not probed: its buffers
    are only saved, for a backward that fails. Nothing is saved for a ``loss_fn`` that exposes
    no network or a loop. `BayesianModule`'s first-run check saves and restores its net's
    buffers with it too (``BufferSnapshot(net)``, ``undo``)."""

    def __init__(self, loss_fn: LossFunction | None):
        module = None if loss_fn is None else loss_module(loss_fn)
        self.module = module
        self.before = None if module is None else self._save()
        self.after: dict[str, torch.Tensor] | None = None

    def _save(self) -> dict[str, torch.Tensor]:
        return {name: b.detach().clone() for name, b in self.module.named_buffers()}

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, b in self.module.named_buffers():
                if name in saved:
                    b.copy_(saved[name])

    def guarded(self, batched: Callable) -> Callable:
        """``batched``, the buffers restored where it raises (a fallback loop starts from them)."""
        if self.before is None:
            return batched

        def run(points):
            try:
                return batched(points)
            except BaseException:
                self._restore(self.before)
                raise

        return run

    def tried(self, batched: Callable) -> Callable:
        """``batched``, leaving the buffers as they were before it (its own result saved)."""
        if self.before is None:
            return batched
        guarded = self.guarded(batched)

        def run(points):
            values = guarded(points)
            self.after = self._save()
            self._restore(self.before)  # the probes (and a fallback loop) start from here
            return values

        return run

    def settle(self, vectorized: bool) -> None:
        """The buffers the vectorized pass left, if it was kept."""
        if vectorized and self.after is not None:
            self._restore(self.after)

    def undo(self) -> None:
        """The buffers as they were before the pass (a step refused after its probes)."""
        if self.before is not None:
            self._restore(self.before)


class QNVBOptimizer(CheckpointHooks, torch.optim.Optimizer):
    """Quasi-Newton variational Bayes for ``torch.nn`` parameters (rasp paper, eq. 4-8).

    Args:
        params: parameters or parameter groups, in float32 or float64 (half precision is
            refused: keep the parameters in float32 and use ``torch.autocast`` for the
            forward); a group may override ``lr``, ``betas``, ..., ``prior_precision`` and
            ``init_sigma``; any other key (``likelihood_weight``, ``annealing``, ``quadrature``,
            ``num_eval``, ``generator``, a typo) is refused.
        likelihood_weight: the number of training cases ``N``: it multiplies the closure's
            loss, which must be the mean loss per case of the batch (``reduction="mean"``).
            With a summed loss over a batch (``reduction="sum"``) set ``likelihood_weight``
            to the number of batches per epoch, ``len(loader)``: ``N / B`` for batches of ``B``
            only where ``B`` divides ``N`` (a short last batch, ``drop_last=False``, makes
            ``N / B`` wrong); left at ``N``, the likelihood counts ``B`` times and ``sigma``
            comes out ``sqrt(B)`` too small, silently.
        prior_precision: precision of a zero-mean Gaussian prior on every parameter (0: flat,
            like the reference).
        annealing: optional schedule ``step -> factor`` multiplying the likelihood weight
            (e.g. `geometric_annealing`).
        quadrature: a rule name of `pyro_quadvi.quadrature.make_rule`.
        num_eval: its number of nodes (closure evaluations per step); ``None``: the rule's default.
        init_sigma: the standard deviation of every parameter before the first step.
        generator: random generator of random rules (torch's global generator when ``None``);
            when given, its state is saved with `state_dict`.
        compile: run the update through ``torch.compile``
            (`qnvb_update_many`): an opt-in, it needs a
            C++ compiler on the CPU (Triton on a GPU) and compiles on the first step (seconds
            to a minute).
        weight_decay: refused (a ``TypeError``): the prior is ``prior_precision``, and torch's
            ``weight_decay`` is ``prior_precision = weight_decay * likelihood_weight``.
        num_points: refused (a ``TypeError``): the number of nodes is ``num_eval``.

    The keyword arguments ``lr``, ``betas``, ``eps``, ``sigma_min``, ``sigma_max``,
    ``scale_min``, ``scale_max``, ``curvature``, ``significance``, ``damping``,
    ``damping_recovery``, ``drift_forgetting``, ``recent_fraction`` and ``trust_region`` are the
    fields of `QNVBHyperparameters`.

    Every argument is checked when the optimizer (or a parameter group) is built, and a wrong
    type or value is refused by name. Steps warn once per kind, with the number of coordinates
    concerned: a non-finite gradient or curvature, an update that overflowed while the gradient
    was finite (both leave the coordinates unchanged), a ``sigma`` pinned at ``sigma_min``, a
    ``sigma`` pinned at ``sigma_max``. The third step in a row in which every coordinate was left
    unchanged so is refused with a ``ValueError`` (`count_idle_step`, as in ``QNVB``), the
    parameters at their means. The counts are read from the device once per step, a read the
    warnings and that rule share (with the loss's finiteness check, the step's two host syncs).

    The update of all the parameters of a group runs on one flat buffer
    (`qnvb_update_many`).

    The loss is a negative log likelihood per case, up to a constant: ``nn.MSELoss()`` is that
    of a Gaussian noise of variance ``1/2`` (``0.5 * mse`` for variance 1, ``0.5 * mse / s2``
    for ``s2``), ``nn.GaussianNLLLoss()`` of the variance it is given (its ``var``), and
    ``nn.CrossEntropyLoss()`` of a categorical.

    Torch's learning-rate schedulers set ``param_groups[i]["lr"]``, which the next step uses
    (``StepLR``, ``CosineAnnealingLR``, ``ReduceLROnPlateau``); ``OneCycleLR`` also cycles
    ``betas[0]`` unless given ``cycle_momentum=False``. `sampled_params` sets the
    parameters to a draw of the mean field (predictions); ``copy.deepcopy`` and ``pickle`` keep
    the whole optimizer (not its hooks), so that a copy steps as the original.

    Example, with a closure evaluated once per node:

        optimizer = QNVBOptimizer(net.parameters(), likelihood_weight=len(dataset))
        for x, y in loader:
            def closure():
                loss = criterion(net(x), y)      # mean over the batch
                loss.backward()
                return loss
            optimizer.step(closure)

    and with all nodes in one vectorized pass:

        optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=len(dataset))
        loss_fn = module_loss(net, criterion)
        for x, y in loader:
            optimizer.step(loss_fn=loss_fn, batch=(x, y))
    """

    def __init__(
        self,
        params: Iterable,
        *,
        likelihood_weight: float = 1.0,
        prior_precision: float = 0.0,
        annealing: Callable[[int], float] | None = None,
        quadrature: str = "rasp_simplex",
        num_eval: int | None = None,
        init_sigma: float = 1e-3,
        generator: torch.Generator | None = None,
        lr: float = 1.0,
        betas: tuple[float, float] = (0.0, 0.999),
        eps: float = 1e-8,
        sigma_min: float = 1e-6,
        sigma_max: float = 1e2,
        scale_min: float = 0.1,
        scale_max: float = 10.0,
        curvature: str = "mean",
        significance: float = 0.0,
        damping: bool = True,
        damping_recovery: float = 0.5,
        drift_forgetting: float = 1.0,
        recent_fraction: float = 1.0,
        trust_region: float = math.inf,
        compile: bool = False,
        weight_decay: float | None = None,
        num_points: None = None,
    ):
        if num_points is not None:  # QuadratureELBO's and make_rule's name, as a user passes it
            raise TypeError(
                "QNVBOptimizer takes no num_points: the number of nodes (closure evaluations per "
                "step) is num_eval, of the rule named by quadrature=, e.g. "
                f"QNVBOptimizer(params, quadrature={quadrature!r}, num_eval={num_points!r})"
            )
        if weight_decay is not None:
            raise TypeError(
                "QNVBOptimizer takes no weight_decay. "
                + weight_decay_conversion(
                    _QNVB_PRIOR, "likelihood_weight", f"{weight_decay!r} * {likelihood_weight!r}"
                )
            )
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        check_generator("QNVBOptimizer", generator)
        _check_number("likelihood_weight", likelihood_weight, lambda v: 0 < v < math.inf, "> 0")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            sigma_min=sigma_min,
            sigma_max=sigma_max,
            scale_min=scale_min,
            scale_max=scale_max,
            curvature=curvature,
            significance=significance,
            damping=damping,
            damping_recovery=damping_recovery,
            drift_forgetting=drift_forgetting,
            recent_fraction=recent_fraction,
            trust_region=trust_region,
            prior_precision=prior_precision,
            init_sigma=init_sigma,
        )
        self.annealing = check_schedule(annealing)
        super().__init__(params, defaults)  # checks every group (add_param_group)
        self.likelihood_weight = float(likelihood_weight)
        self.rule = make_rule(quadrature, num_eval)
        self.generator = generator
        self.num_steps = 0
        self.compile = compile
        self._warned: set[str] = set()
        self._decisions = DecisionCache()  # vectorize=None: decided once (_decision_key)
        self._written: dict[int, tuple[int, int]] = {}  # id(p) -> (_version, data_ptr)
        self._loaded: dict | None = None  # the "qnvb" entry being loaded (_check_loaded)
        # id(p) -> the state tensors the last step wrote, which the next may write over
        self._in_place: dict[int, tuple[torch.Tensor, ...]] = {}
        self._checked: tuple | None = None  # the last _group_settings: its key and its result
        # steps in a row in which no coordinate could be updated (count_idle_step; saved)
        self._idle_steps = 0
        self._register_checkpoint_hooks()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # loaded (the state dict's tensors are the caller's), copied or unpickled: the next
        # step writes new tensors (_update)
        self._in_place = {}
        self._checked = None

    def _owns(self, p: torch.Tensor) -> bool:
        """Whether every state tensor of ``p`` is the one the last step wrote: not one a user
        assigned into ``optimizer.state`` since (an expanded or shared tensor, or one the user
        keeps), nor one a `state_dict` handed out or `load_state_dict` took in."""
        written = self._in_place.get(id(p))
        state = self.state[p]
        return written is not None and all(state.get(k) is t for k, t in zip(_OWNED_KEYS, written))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch's rule), after checking it: a key that is not a per-group setting
        (``lr``, ``betas``, ``eps``, ``sigma_min``, ``sigma_max``, ``scale_min``, ``scale_max``,
        ``curvature``, ``significance``, ``damping``, ``damping_recovery``, ``drift_forgetting``,
        ``recent_fraction``, ``trust_region``, ``prior_precision``, ``init_sigma``, besides
        ``params``, ``param_names``, ``name`` and the keys torch's lr schedulers write), a bad
        hyperparameter (of the group filled with the defaults) or a half-precision parameter is
        refused by name, and ``param_groups`` is left as it was."""
        group = group_params(param_group)
        if isinstance(group, dict):
            unknown = sorted(
                set(group) - {"params", "param_names", "name", *_GROUP_KEYS, *_INERT_GROUP_KEYS}
            )
            if "weight_decay" in unknown:
                raise ValueError(
                    f"{type(self).__name__}: a parameter group does not take weight_decay. "
                    + weight_decay_conversion(
                        _QNVB_PRIOR, "likelihood_weight", "weight_decay * likelihood_weight"
                    )
                )
            if unknown:
                raise ValueError(
                    f"{type(self).__name__}: a parameter group does not take {unknown}; the "
                    f"per-group settings are {list(_GROUP_KEYS)} (likelihood_weight, annealing, "
                    "quadrature, num_eval and generator are the optimizer's, given to the "
                    "constructor)"
                )
            self._check_group({**self.defaults, **group})
        position = sum(len(g["params"]) for g in self.param_groups)
        refuse_half_precision(group, position, type(self).__name__)
        refuse_duplicate_parameters(group, position, type(self).__name__)
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            items = group["params"]
            params = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in items]
            self._check_ranges({**self.defaults, **group}, params, f"{type(self).__name__}: ")
            refuse_added_guide_parameters(type(self).__name__, items, position)
        super().add_param_group(group)
        self._guides_unchecked = True

    @staticmethod
    def _check_ranges(group: dict, params: list, owner: str = "") -> None:
        """Refuse an ``init_sigma`` or ``sigma_max`` beyond the range of a parameter's dtype
        (`check_representable`); ``owner`` prefixes the message."""
        dtypes = {p.dtype for p in params if isinstance(p, torch.Tensor) and p.is_floating_point()}
        for dtype in dtypes:
            for name in ("init_sigma", "sigma_max"):
                check_representable(owner, name, group[name], dtype)

    @staticmethod
    def _check_group(group: dict) -> QNVBHyperparameters:
        _check_number(
            "prior_precision", group["prior_precision"], lambda v: 0 <= v < math.inf, ">= 0"
        )
        _check_number("init_sigma", group["init_sigma"], lambda v: 0 < v < math.inf, "> 0")
        return QNVBHyperparameters(**{name: group[name] for name in _HP_NAMES})

    def _group_settings(self) -> dict[int, QNVBHyperparameters]:
        """Every group's settings checked, by ``id`` of the group: a scheduler or a user may
        have set any since the group was added. A bad one is refused, naming the optimizer and
        the group's index, before the step evaluates anything.

        The result is kept for the next step while every value the checks read is the same:
        the groups, their settings and their types (``True`` equals ``1.0``, but is refused) and
        their parameters' dtypes (a key of them, 2.3 us where the checks take 17; none where a
        setting is unhashable, such as a list a user may change in place)."""
        parts = []
        for group in self.param_groups:
            values = [group[name] for name in _CHECKED_NAMES]
            betas = group["betas"]
            parts.append(
                (
                    id(group),
                    *values,
                    *map(type, values),  # True equals 1.0, but is refused
                    *(map(type, betas) if isinstance(betas, tuple) else ()),
                    *(p.dtype for p in group["params"]),
                )
            )
        key: tuple | None = tuple(parts)
        try:
            hash(key)
        except TypeError:
            key = None
        if key is not None and self._checked is not None and self._checked[0] == key:
            return self._checked[1]
        settings = {}
        for index, group in enumerate(self.param_groups):
            try:
                settings[id(group)] = self._check_group(group)
                self._check_ranges(group, group["params"])
            except (TypeError, ValueError) as error:
                raise type(error)(
                    f"QNVBOptimizer: parameter group {index}: {error}; nothing was evaluated or "
                    "changed by this step"
                ) from error
        self._checked = None if key is None else (key, settings)
        return settings

    @property
    def weight(self) -> float:
        """The current likelihood weight: ``likelihood_weight * annealing(num_steps)``.

        Raises:
            ValueError: when the schedule's factor at this step is not finite and ``> 0``
                (`annealing_factor`).
        """
        if self.annealing is None:
            return self.likelihood_weight
        return self.likelihood_weight * annealing_factor(self.annealing, self.num_steps)

    @contextmanager
    def sampled_params(self, generator: torch.Generator | None = None) -> Iterator[None]:
        """Set every parameter to one draw ``mu + sigma * eps``, ``eps ~ N(0, 1)``, of the mean
        field (rasp paper, Section 2.2) for the block, and back to the means ``mu`` on exit (also
        when the block raises).

        Args:
            generator: the random generator of the draw (torch's global one when ``None``); a
                CPU generator serves parameters on any device.

        Before the first step the mean field is the parameters' values with ``init_sigma``.
        A Bayesian model average of predictions:

            with torch.no_grad():
                probs = 0
                for _ in range(32):
                    with optimizer.sampled_params():
                        probs = probs + net(x).softmax(-1) / 32
        """
        params = [p for p, _ in self._params()]
        draws = [
            self.state[p]["mu"] + self.state[p]["sigma"] * standard_normal(p, generator)
            for p in params
        ]
        with sampled_values(params, draws, [self.state[p]["mu"] for p in params], self._written):
            yield

    def _params(self) -> list[tuple[torch.Tensor, dict]]:
        """``(parameter, group)`` of every parameter that requires grad, its state made on first
        use; a parameter changed since this optimizer last wrote it gives its mean
        (`_take_edits`)."""
        out = []
        # every parameter checked (a half-precision one refused) before any state is made
        for p, group in list(checked_parameters(self, type(self).__name__)):
            state = self.state[p]
            if not state:
                state["mu"] = p.detach().clone()
                state["sigma"] = torch.full_like(state["mu"], group["init_sigma"])
                state.update(init_qnvb_state(state["mu"])._asdict())
            out.append((p, group))
        self._take_edits([p for p, _ in out])
        return out

    def _take_edits(self, params: list[torch.Tensor]) -> None:
        """The value of every parameter changed since the optimizer last wrote it
        (`changed_parameters`) as its new mean; ``sigma`` and the averages stay, cast to
        the parameter's dtype and device where it was cast or moved (`cast_state_to`).
        Parameters without a state yet are left alone."""
        for p in changed_parameters(params, self._written):
            state = self.state.get(p)
            if state:
                cast_state_to(p, state)
                state["mu"] = p.detach().clone()

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        *,
        loss_fn: LossFunction | None = None,
        batch: tuple = (),
        vectorize: bool | None = None,
    ) -> torch.Tensor:
        """Evaluate the loss at every quadrature node and update the mean field.

        Give either ``closure`` (evaluated once per node) or ``loss_fn`` (all nodes in one pass).

        Args:
            closure: computes the mean loss per case at the current parameter values, calls
                ``backward()`` on it and returns it (gradients are zeroed before each call).
            loss_fn: ``loss_fn(params, *batch)``, the mean loss per case (a scalar) with the
                parameters given by name (the names of ``named_parameters()``, which the
                optimizer must have been built from); see `module_loss`.
            batch: the further arguments of ``loss_fn`` (e.g. ``(x, y)``).
            vectorize: with ``loss_fn``, as for
                `evaluate_batch`: ``True`` one ``vmap`` pass
                (an error if the loss does not run under ``vmap``), checked against single
                evaluations at three nodes on the first step with this ``loss_fn`` (a
                disagreement raises `BatchMismatch` naming the
                reason and the ways out; later steps are not checked), ``False`` a loop over the
                nodes (one backward still), ``None`` (default) the pass checked the same way,
                and the loop with one warning if they disagree, the loss does not run under
                ``vmap`` or the pass's backward fails (where ``True`` raises `BatchMismatch`
                naming ``vectorize=False``); the decision is kept for later steps with the
                same ``loss_fn`` (for a `module_loss`: the same module and criterion, in the
                same ``train()`` / ``eval()`` modes), except that under ``None`` a kept pass
                whose forward or backward fails on a later step falls back too, from then on.
                A tried pass that is abandoned leaves the buffers (BatchNorm's running
                statistics) of the network the loss exposes as it found them: a
                `module_loss`'s module, a ``loss_fn``'s ``module`` attribute, or the
                ``loss_fn`` itself when it is an ``nn.Module`` (`loss_module`).

        Returns:
            The quadrature average of the loss.
        """
        refuse_grad_scaler(self)
        refuse_inference_mode(self)
        if (closure is None) == (loss_fn is None):
            raise TypeError(
                "QNVBOptimizer.step takes either a closure (step(closure)) or a loss function "
                "(step(loss_fn=..., batch=(x, y))), exactly one of them"
                + (
                    ": it evaluates the loss itself at every quadrature node. A Pyro guide's "
                    "parameters are not for QNVBOptimizer: fit a guide with SVI(model, guide, "
                    "QNVB(), QuadratureELBO()) and svi.step(*args)"
                    if closure is None
                    else ""
                )
            )
        if closure is not None and (batch != () or vectorize is not None):
            raise TypeError(
                "QNVBOptimizer.step: batch and vectorize belong to the one-pass form "
                "step(loss_fn=..., batch=(x, y)); a closure reads its data itself"
            )
        # every refusal comes before anything changes: the parameters, their states, the counters
        weight = self.weight  # a bad annealing factor
        settings = self._group_settings()  # a bad group setting (e.g. set by a scheduler)
        if loss_fn is not None:
            check_vectorize(vectorize, "QNVBOptimizer.step: ")
            if not callable(loss_fn):
                raise TypeError(
                    f"loss_fn must be callable (params, *batch) -> loss, got {loss_fn!r}"
                )
            self._names()
        params = self._params()
        if not params:
            raise ValueError("QNVBOptimizer has no parameter that requires grad")
        if loss_fn is not None:
            self._warn_outside(params, loss_fn)
        first = params[0][0]
        dim = sum(p.numel() for p, _ in params)
        tensors = [p for p, _ in params]
        with generator_kept(self.generator):  # a step that fails has drawn nothing
            nodes = self.rule.draw(
                dim,
                step=self.num_steps,
                generator=self.generator,
                dtype=first.dtype,
                device=first.device,
            )
            nodes = self._local_nodes(nodes)
            try:
                if closure is not None:
                    loss_avg, moments = self._closure_moments(params, nodes, closure)
                else:
                    loss_avg, moments = self._one_pass_moments(
                        params, nodes, loss_fn, batch, vectorize
                    )
                if getattr(self, "_guides_unchecked", True):
                    refuse_run_guides(self, tensors, [self.state[p]["mu"] for p in tensors])
                loss_avg, moments = self._combine(params, loss_avg, moments)
                check_finite_loss(
                    loss_avg,
                    tensors,
                    [self.state[p]["mu"] for p in tensors],
                    type(self).__name__,
                    sigmas=[self.state[p]["sigma"] for p in tensors],
                    batch=tuple(batch) if isinstance(batch, tuple | list) else (batch,),
                    moments=moments,
                )
                self._update(params, moments, weight, settings)
            except BaseException:  # whatever failed, the parameters are left at their means
                restore_means(tensors, [self.state[p]["mu"] for p in tensors])
                raise
        return loss_avg

    # Two hooks for pyro_quadvi.distributed.NodeParallelQNVBOptimizer; here, one process
    # evaluates every node and its weighted sums are the whole step's.
    def _local_nodes(self, nodes: NodeSet) -> NodeSet:
        """The nodes this process evaluates (weights as in the full rule): all of them."""
        return nodes

    def _combine(self, params, loss_avg: torch.Tensor, moments: list):
        """The step's weighted sums (loss, ``sum_k w_k grad_k``, ``sum_k w_k grad_k x_k``) from
        this process's: they are the step's already."""
        return loss_avg, moments

    def _closure_moments(self, params, nodes, closure):
        """`closure_moments` at this optimizer's means and standard deviations."""
        tensors = [p for p, _ in params]
        mus = [self.state[p]["mu"] for p in tensors]
        sigmas = [self.state[p]["sigma"] for p in tensors]
        return closure_moments(tensors, mus, sigmas, nodes, closure, "QNVBOptimizer")

    def _one_pass_moments(self, params, nodes, loss_fn, batch, vectorize):
        """The moments of `_closure_moments` from ``loss_fn`` at all nodes at once: the
        parameters with a leading node axis, one (vectorized or looped) evaluation, one backward
        of ``sum_k w_k loss_k``."""
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        names = self._names()
        K = len(nodes)
        matrix = nodes.matrix()
        offsets, stacked, start = [], [], 0
        for p, _ in params:
            state = self.state[p]
            x_p = matrix[:, start : start + p.numel()].reshape((K, *p.shape))
            start += p.numel()
            offsets.append(x_p)
            stacked.append((state["mu"] + state["sigma"] * x_p).requires_grad_())

        def as_dict(values) -> dict[str, torch.Tensor]:
            return dict(zip(names, values))

        def single(point) -> torch.Tensor:
            return _scalar_loss(loss_fn(as_dict(point), *batch))

        def batched(points) -> torch.Tensor:
            try:
                with vmap_safe_attention():
                    losses = vmap(single)(points.tensors)
            except RuntimeError as error:
                if not is_vmap_refusal(error):
                    raise
                # under vectorize=None this is the reason the fallback's warning gives, which
                # names its own way out
                ways = (
                    "; pass vectorize=False to loop over the nodes, or vectorize=None to try the "
                    "pass and fall back"
                    if vectorize is True
                    else ""
                )
                raise BatchMismatch(
                    f"QNVBOptimizer: loss_fn does not run under torch.func.vmap over the {K} "
                    f"nodes ({first_line(error)}){ways}"
                ) from error
            return losses

        key, flags = _decision_key(loss_fn)
        owned = {id(p) for p, _ in params}  # the layers holding them are swapped for the nodes
        known = self._decisions.get(*key) or {}  # the modules' training flags -> vectorized
        mode = known.get(flags) if vectorize is None else vectorize
        checked = mode is True and known.get(flags) is True  # on an earlier step: no probes
        # a decided pass is not probed, but its backward may still fail on a later batch: its
        # buffers are saved (not swapped around probes) so that the fallback starts from them
        buffers = BufferSnapshot(None if mode is False else loss_fn)
        rtol, atol = _check_tolerances(stacked[0].device.type)
        with torch.enable_grad():
            try:
                losses, decision = evaluate_batch(
                    buffers.guarded(batched) if checked else buffers.tried(batched),
                    single,
                    _NodeStack(stacked),
                    # a kept pass that fails on a later batch falls back under None, unprobed
                    None if checked and vectorize is None else mode,
                    probe=() if checked else None,
                    rtol=rtol,
                    atol=atol,
                    what="QNVBOptimizer",
                )
            except BatchMismatch:  # vectorize=True refused by the probes: a step not taken
                buffers.undo()
                raise
            buffers.settle(decision.vectorized)
            try:
                total, grads = _weighted_gradients(losses, nodes, stacked, owned)
            except (RuntimeError, NotImplementedError) as error:
                if isinstance(error, RecomputedForward):  # a checkpoint: no loop helps either
                    buffers.undo()
                    raise
                if not decision.vectorized or "sparse" in str(error).lower():
                    raise  # the loop's own error, or a sparse gradient's (no loop helps)
                # the pass ran and agreed with the probes, but its backward fails (a
                # parametrization written in place, torch's orthogonal): one backward per step
                # cannot be probed, so the loop takes over where the pass was tried now
                reason = f"its backward raised {type(error).__name__}: {first_line(error)}"
                buffers.undo()
                if vectorize is True:
                    raise BatchMismatch(
                        f"QNVBOptimizer(vectorize=True): the vectorized pass over the {K} "
                        f"nodes evaluated the loss, but {reason}. Pass vectorize=False to loop "
                        "over the nodes (one backward still), or vectorize=None to fall back "
                        "with a warning"
                    ) from error
                warn_fallback("QNVBOptimizer", K, reason)
                losses, _ = evaluate_batch(batched, single, _NodeStack(stacked), False)
                decision = BatchDecision(False, reason, 0)
                total, grads = _weighted_gradients(losses, nodes, stacked, owned)
        if all(grad is None for grad in grads):
            raise RuntimeError(
                "QNVBOptimizer: the loss does not depend on any parameter of the optimizer; "
                "loss_fn must use the params it is given (by the names of named_parameters())"
            )
        if vectorize is not False:  # True: checked once, as None decides once
            self._decisions.set(*key, decision={**known, flags: decision.vectorized})
        moments = []
        for grad, x_p in zip(grads, offsets):
            if grad is None:
                moments.append(None)
            else:  # the weights are in the gradients already: dL/dz_k = w_k grad_k
                moments.append((grad.sum(0), (grad * x_p).sum(0)))
        return total.detach(), moments

    def _warn_outside(self, params, loss_fn: LossFunction) -> None:
        """Warn once when the network of ``loss_fn`` (`loss_module`) has trainable
        parameters this optimizer neither holds nor passes by name: the one-pass step gives them
        no ``.grad``, so another optimizer over them would move them by nothing."""
        module = loss_module(loss_fn)
        if module is None or "outside" in self._warned:
            return
        held = {id(p) for p, _ in params}  # or given by name (a copy of the optimizer alone)
        named = set(self._names())
        outside = [
            n
            for n, p in module.named_parameters()
            if p.requires_grad and id(p) not in held and n not in named
        ]
        if not outside:
            return
        self._warned.add("outside")
        shown = shortened(map(repr, outside), 5, None)
        warnings.warn(
            f"QNVBOptimizer: the network of loss_fn has {len(outside)} trainable parameters "
            f"that this optimizer does not hold ({shown}); step(loss_fn=...) evaluates "
            "them as they are and gives them no .grad, so another optimizer over them moves "
            "them by nothing. Put them in QNVB (add_param_group), freeze them "
            "(requires_grad_(False)), or compute their gradient in a pass of your own (this "
            "warning is shown once)",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    def _names(self) -> list[str]:
        names = []
        for group in self.param_groups:
            group_names = group.get("param_names")
            if group_names is None:
                raise ValueError(
                    "QNVBOptimizer.step(loss_fn=...) passes the parameters by name: build the "
                    "optimizer from net.named_parameters() (or give each group 'param_names')"
                )
            names += [n for n, p in zip(group_names, group["params"]) if p.requires_grad]
        return names

    def _update(
        self, params, moments, weight: float, settings: dict[int, QNVBHyperparameters]
    ) -> None:
        """One QNVB step per group (`qnvb_update_many`) at the likelihood ``weight`` and
        with the group ``settings`` (by ``id`` of the group) the step read once, the means into
        the parameters.

        The update writes its results over the state (``donate``) where the state's tensors
        are the optimizer's own: those a previous step made (`_owns`). Those a user assigned
        into ``optimizer.state``, a `state_dict` handed out or `load_state_dict` took in are
        the caller's too (torch's state dict holds the
        state's tensors, not copies), so the next step makes new ones (copy on write): a state
        dict taken earlier keeps its values."""
        counts = []
        scales = []  # per parameter, its label, scale and sigma_min (`idle_step_refusal`)
        moments = [data_moments(m, p) for m, (p, _) in zip(moments, params)]
        by_group: dict[int, list[int]] = {}
        for i, (_, group) in enumerate(params):
            by_group.setdefault(id(group), []).append(i)
        for indices in by_group.values():
            group = params[indices[0]][1]
            hp = settings[id(group)]
            names = dict(zip(map(id, group["params"]), group.get("param_names") or ()))
            states = [self.state[params[i][0]] for i in indices]
            owned = all(self._owns(params[i][0]) for i in indices)
            # rule 12 at the spacing the forward sees, where autocast's is coarser: the
            # coordinates unresolved before the step (the update may write over the state)
            seen = [resolution_dtype(params[i][0]) for i in indices]
            before = [
                None
                if dtype == params[i][0].dtype
                else _unresolved(state["mu"], state["sigma"], dtype)
                for i, state, dtype in zip(indices, states, seen)
            ]
            results = qnvb_update_many(
                [state["mu"] for state in states],
                [state["sigma"] for state in states],
                [moments[i][0] for i in indices],
                [moments[i][1] / state["sigma"] for i, state in zip(indices, states)],
                [QNVBState(*(state[name] for name in _STATE_NAMES)) for state in states],
                hp,
                weight=weight,
                prior_precision=group["prior_precision"],
                compile=self.compile,
                # the state it owns shares no memory with the moments it made (nor one field
                # with another): not scanned
                donate=_Vouched(DONATABLE) if owned else (),
            )
            for i, state, result, dtype, was in zip(indices, states, results, seen, before):
                state["mu"], state["sigma"] = result.mu, result.sigma
                state.update(result.state._asdict())
                self._in_place[id(params[i][0])] = tuple(state[k] for k in _OWNED_KEYS)
                label = _count_label(params[i][0], names.get(id(params[i][0])))
                if was is not None:
                    still = was & _unresolved(result.mu, result.sigma, dtype)
                    result = result._replace(num_unresolved=still.sum())
                counts.append((label, hp, dtype, result_counts(result)))
                scales.append((label, result.sigma, hp.sigma_min))
        for p, _ in params:
            p.copy_(self.state[p]["mu"])
            p.grad = None
        drop_autocast_copies()
        self._written.update(written_marks(p for p, _ in params))
        total = sum(params[i][0].numel() for indices in by_group.values() for i in indices)
        table = self._refuse_if_idle(counts, scales, total)
        self.num_steps += 1
        self._warn(counts, table)

    def _refuse_if_idle(self, counts: list, scales: list, total: int) -> list[list[int]]:
        """Refuse the `IDLE_STEPS_REFUSED`-th step in a row in which the guard (rule 11) kept
        every coordinate (`count_idle_step`, as `QNVB` does): each ``g`` or ``h`` not finite, or
        the update overflowed (the unscaled Poisson of ``docs/qnvb_torch.md`` ran every step so
        with ``blocked_simplex``). Such a step leaves every mean, scale and state as it was, and
        the parameters are back at their means, their gradients cleared; the step count does not
        move, so a deterministic rule's next step evaluates the same nodes. ``total``: the
        coordinates updated. Returns the counts read from the device (`count_table`, the one
        copy the warnings then read). ``counts`` is never empty: a step in which no parameter has
        a gradient is refused before it. ``scales``: per parameter, its label, scale and
        ``sigma_min``, which the refusal names where one started below ``sigma_min``."""
        table = count_table(counts)
        self._idle_steps = count_idle_step(self._idle_steps, kept_coordinates(table), total)
        if self._idle_steps >= IDLE_STEPS_REFUSED:
            raise idle_step_refusal(
                type(self).__name__,
                self._idle_steps,
                total,
                [label for label, *_ in counts],
                [dtype for _, _, dtype, _ in counts],
                unit="parameter",
                words=QNVB_IDLE,
                untaken="the parameters are left at their means",
                scales=scales,
            )
        return table

    def _warn(
        self,
        counts: list[tuple[str, QNVBHyperparameters, torch.dtype, torch.Tensor]],
        table: list[list[int]],
    ) -> None:
        """Warn once per kind of count (`count_messages`, from the counts ``table`` read
        already)."""
        for message in count_messages(counts, self._warned, table):
            warnings.warn(
                f"QNVBOptimizer: {message} (this warning is shown once)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def _settings(self) -> dict:
        """What fixes the run besides the per-group values: the rule and its number of nodes,
        the likelihood weight, the prior precision given to the constructor and whether the
        weight is annealed. Saved by `state_dict`, checked by `load_state_dict`."""
        return {
            "quadrature": self.rule.name,
            "num_eval": self.rule.num_points,
            "likelihood_weight": self.likelihood_weight,
            "prior_precision": self.defaults["prior_precision"],
            "annealing": self.annealing is not None,
        }

    def state_dict(self) -> dict:
        """Torch's state dict plus a ``"qnvb"`` entry: the step count, the count of idle steps
        in a row (`count_idle_step`), the generator's state and the run's settings
        (`_settings`), added by a state-dict post-hook the optimizer registers first, so that a
        post-hook registered without ``prepend=True`` sees it (`CheckpointHooks`). The means
        saved are the parameters' values (a change since the last step included: `_take_edits`).

        With a random rule (``blocked_simplex``, ``rasp_simplex``, ``mc``) and no ``generator``,
        the nodes come from torch's global random state, which this state dict does not hold:
        for a bit-for-bit resume, save and restore it beside it (``pyro.util.get_rng_state()`` /
        ``set_rng_state``), or build the optimizer with a ``generator``, whose state is saved
        here.

        Torch's state dict holds the state's own tensors, not copies; the step after it writes
        new ones, so that the tensors of a state dict keep their values (`_update`)."""
        self._in_place = {}
        return super().state_dict()

    _entry_key = "qnvb"

    def _checkpoint_entry(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "idle_steps": self._idle_steps,
            "generator": None if self.generator is None else self.generator.get_state(),
            "settings": self._settings(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict` saved, into an optimizer built with the same rule,
        ``num_eval``, ``likelihood_weight``, ``prior_precision`` and with (or without) an
        annealing schedule, over parameters of the saved shapes and names (where both the saved
        groups and this optimizer's have ``param_names``), and with a ``generator`` exactly when
        one was saved: anything else is refused by a ``ValueError`` before anything is loaded.
        The per-group values (``lr``, ``betas``, ...) are the saved ones, as for torch's
        optimizers. A state saved without the settings (an earlier version) loads without their
        check.

        The ``"qnvb"`` entry is checked by a load pre-hook that runs after the user's (which may
        migrate it) and restored, ``num_steps`` included, by a post-hook that runs before those
        registered without ``prepend=True`` (`CheckpointHooks`). The parameters are the
        means: that post-hook sets every parameter with a saved state to its saved mean (the
        values the network's own state dict, saved with it, holds); a network state loaded
        after it is a change of the means, which the next step takes."""
        super().load_state_dict(state_dict)

    def _check_loaded(self, state_dict: dict) -> None:
        """Refuse a state dict that `load_state_dict` cannot load, before torch loads
        anything; keep its ``"qnvb"`` entry for `_restore_loaded`."""
        extra = self._saved_entry(
            state_dict, "QNVBOptimizer", "the step count, generator state and settings"
        )
        if "settings" in extra:
            check_settings("QNVBOptimizer.load_state_dict", extra["settings"], self._settings())
        random = self.rule.is_random  # a deterministic rule never draws: no generator to match
        if random and extra["generator"] is not None and self.generator is None:
            raise ValueError(
                "QNVBOptimizer.load_state_dict: the saved state holds a generator state; "
                "construct the optimizer with a generator to restore it"
            )
        if random and extra["generator"] is None and self.generator is not None:
            raise ValueError(
                "QNVBOptimizer.load_state_dict: the saved state holds no generator state (its run "
                "drew any random nodes from torch's global random state), but this optimizer has "
                "a generator, which would go on from its own state; construct the optimizer "
                "without a generator (and restore torch's random state, "
                "pyro.util.set_rng_state) to continue that run"
            )
        check_saved_parameters("QNVBOptimizer.load_state_dict", state_dict, self.param_groups)
        self._loaded = extra

    def _restore_loaded(self) -> None:
        """The step count, the count of idle steps and the generator's state of the ``"qnvb"``
        entry just loaded, and the loaded means into the parameters."""
        self._write_means()
        extra, self._loaded = self._loaded, None
        self.num_steps = extra["num_steps"]
        self._idle_steps = extra.get("idle_steps", 0)  # (absent from earlier states)
        if extra["generator"] is not None and self.generator is not None:
            self.generator.set_state(extra["generator"])
