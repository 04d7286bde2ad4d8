"""Keeping a module's own ``nn.Parameter`` and Pyro's param store one tensor.

A plain ``nn.Parameter`` of a ``PyroModule`` (the ``loc`` of Pyro's ``AutoDiagonalNormal``,
``AutoMultivariateNormal`` and ``AutoLowRankMultivariateNormal``, the ``cov_factor`` of the
last) enters the param store through ``pyro.param(fullname, parameter)`` each time the module
reads it, and the module goes on with its own tensor whatever the store returns. While the store
holds that very tensor, the two are one. Once the store holds another tensor under the name
(restored by ``get_param_store().set_state(...)`` or ``load``, or assigned), ``SVI`` collects and
steps the store's tensor, which no gradient reaches, while the module computes with its own,
which nothing steps: the fit silently stops. Pyro's ``PyroParam`` (``AutoNormal``'s parameters,
``AutoMeanFieldNormal``'s) is synchronized by Pyro itself and is left alone here.

`follow_store` mends one parameter; `follow_param_store` every plain parameter of the
``PyroModule`` s of a guide or a model (through ``torch.compile``);
`detached_parameters` names those a restore cut off.
`QuadratureELBO`, `fit`,
`to_inference_data` and `opqa_evidence`
call it on the guide and the model before they run them, `predict` on the
guide; and once a ``QNVB`` exists, its guide watch
(`watch_guides`) calls it on every describable guide before
each run of it, whatever the ELBO (Pyro's ``Trace_ELBO`` included). What is left to the user:
readers that do not run the guide (``guide.median()``, ``quantiles``) right after a restore, and
a fit by another optimizer under Pyro's ELBOs.

`weights_only_state` and `set_weights_only_state` save and restore the param store and Pyro's
random state as tensors, numbers and strings, which ``torch.load`` reads with its default
``weights_only=True``: the store's own state holds its constraint objects and
``pyro.util.get_rng_state()`` numpy arrays, which it refuses. The constraints are taken back from
the store of the guide set up again, and checked against their saved descriptions: the class and
the attributes, tensor bounds by value wherever they live (`constraint_description`).
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Iterable, Iterator

import numpy as np
import pyro
import pyro.util
import torch
from pyro.nn import PyroModule
from pyro.params.param_store import param_with_module_name
from torch import nn
from torch.distributions import constraints

__all__ = [
    "detached_parameters",
    "follow_param_store",
    "follow_store",
    "pyro_parameter_names",
    "set_weights_only_state",
    "weights_only_state",
]

# guide or model -> the store's tensor of each of its parameters, as last installed
_INSTALLED: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def follow_store(fullname: str, param: nn.Parameter, installed: dict[str, torch.Tensor]) -> None:
    """Make the param store hold ``param`` under ``fullname``, with the value the store holds
    now (if it holds one).

    The store keeps a contiguous tensor: for a non-contiguous ``param`` (a channels-last
    convolution's weight, a transposed view) it keeps a contiguous copy, which ``installed``
    remembers: that copy is what is trained, so it stays in the store (replacing it would
    restart its optimizer every step) and its value is copied into ``param``.

    Args:
        fullname: the parameter's name in the param store.
        param: the module's own parameter.
        installed: the caller's record of what this function put in the store, by name.

    Raises:
        TypeError: for a ``fullname`` that is not a string, a ``param`` that is not a tensor or
            an ``installed`` that is not a dict, naming the argument (Python's "unhashable
            type: 'list'" or "'NoneType' object has no attribute 'shape'" named none).
        ValueError: if the store holds a tensor of another shape or dtype under ``fullname``.
    """
    for name, value, kind, what in (
        ("fullname", fullname, str, "the parameter's name in the param store (a str)"),
        ("param", param, torch.Tensor, "the module's parameter (a tensor)"),
        ("installed", installed, dict, "the caller's record, a dict name -> tensor"),
    ):
        if not isinstance(value, kind):
            raise TypeError(
                f"follow_store: {name} must be {what}, got {value!r} ({type(value).__name__})"
            )
    store = pyro.get_param_store()
    if fullname not in store:
        return
    held = store[fullname]
    if held is param:
        return
    if held is installed.get(fullname):
        with torch.no_grad():
            param.copy_(held)
        return
    if held.shape == param.shape and held.dtype != param.dtype:
        raise ValueError(
            f"the param store holds {fullname!r} as {held.dtype}, but the module's parameter is "
            f"{param.dtype}: convert the module (module.to({held.dtype})) before restoring the "
            "store, or convert the saved tensors to the module's dtype before set_state"
        )
    if held.shape != param.shape:
        raise ValueError(
            f"the param store holds {fullname!r} of shape {tuple(held.shape)} and {held.dtype}, "
            f"but the module's parameter is {tuple(param.shape)} and {param.dtype}: the store was "
            "saved from, or shared with, another model or guide. Restore a store saved from this "
            "one, or call pyro.clear_param_store() before building this one"
        )
    with torch.no_grad():
        param.copy_(held)
    store[fullname] = param
    installed[fullname] = store[fullname]  # param itself, or the store's contiguous copy of it


def compiled_original(module: object) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, if ``module`` is its ``OptimizedModule``; else
    ``None``. (Without ``torch._dynamo`` imported there is no such wrapper.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return None


def uncompiled(module: object) -> object:
    """The module ``torch.compile`` wrapped, if ``module`` is its wrapper; else ``module``
    (tested against ``None``, not for truth: a module of no length is falsy)."""
    original = compiled_original(module)
    return module if original is None else original


def follow_param_store(module: object) -> None:
    """Give every plain ``nn.Parameter`` of ``module``'s ``PyroModule`` s the value the param
    store holds under its name, and put the parameter itself back into the store.

    Call it once after restoring the param store (``set_state``, ``load``) when a guide with
    plain parameters (Pyro's ``AutoDiagonalNormal``, ``AutoMultivariateNormal``,
    ``AutoLowRankMultivariateNormal``) or a ``PyroModule`` model with plain parameters (a
    ``PyroModule[nn.Linear]`` whose bias is not a ``PyroSample``) is trained on by Pyro's own
    ELBOs with another optimizer than QNVB, or read by ``Predictive`` or the guide's
    ``median``/``quantiles``; the package's ``QuadratureELBO``, ``fit``, ``to_inference_data``
    and ``opqa_evidence`` (guide and model), ``predict`` (guide) and QNVB's guide watch (every
    describable guide, before each run) call it themselves. Anything else does
    nothing: an object that is not a ``PyroModule``, a parameter not in the store (a module not
    run yet), a ``PyroParam``'s unconstrained leaf (Pyro synchronizes those), the parameters of
    plain ``nn.Module`` s inside it (which Pyro registers with ``pyro.module``; restore those
    with ``pyro.module(name, net, update_module_params=True)``), and everything under
    ``pyro.settings.set(module_local_params=True)`` (no param store).

    Args:
        module: a guide or a model (any object; only a ``PyroModule`` is looked into, also behind
            ``torch.compile``).

    Raises:
        ValueError: if the store holds one of the parameters with another shape or dtype.
    """
    module = uncompiled(module)
    installed = None
    for fullname, param in _plain_parameters(module):
        if installed is None:
            installed = _INSTALLED.setdefault(module, {})
        follow_store(fullname, param, installed)


def detached_parameters(module: object) -> list[str]:
    """The param store names of ``module``'s plain ``nn.Parameter`` s (as
    `follow_param_store` finds them) under which the store holds another tensor than the
    parameter (or the contiguous copy `follow_store` installed for it): the parameters a
    restore cut off, until `follow_param_store` (or the guide's next run under QNVB's guide
    watch) puts them back. Like `follow_param_store` it takes any object and looks only into a
    ``PyroModule``: for anything else (``None``, a function guide) there are none."""
    module = uncompiled(module)
    plain = list(_plain_parameters(module))
    if not plain:  # (an int or None cannot be a key of the weak dict of installed copies)
        return []
    store = pyro.get_param_store()
    installed = _INSTALLED.get(module, {})
    return [
        fullname
        for fullname, param in plain
        if fullname in store
        and store[fullname] is not param
        and store[fullname] is not installed.get(fullname)
    ]


def _plain_parameters(module: object) -> Iterator[tuple[str, nn.Parameter]]:
    """The plain ``nn.Parameter`` s of ``module``'s ``PyroModule`` s with their param store
    names; none for an object that is not a ``PyroModule`` or under
    ``pyro.settings.set(module_local_params=True)``. A ``PyroParam``'s unconstrained leaf is left
    out: Pyro keeps it in step with the store."""
    if not isinstance(module, PyroModule) or pyro.settings.get("module_local_params"):
        return
    for part in _pyro_modules(module):
        for fullname, param, leaf in _own_parameters(part):
            if not leaf:
                yield fullname, param


def pyro_parameter_names(module: object) -> Iterator[tuple[str, nn.Parameter]]:
    """Every parameter of ``module``'s ``PyroModule`` s with the name of its Pyro ``param`` site,
    the param store's name in global mode, which ``module_local_params=True`` does not change: a
    ``PyroParam``'s unconstrained leaf under the ``PyroParam``'s name (``"locs.w"``), a plain
    parameter under its own, a plain ``nn.Module``'s parameters as ``pyro.module`` names them
    (``"net$$$0.weight"``). None for an object that is not a ``PyroModule`` (also behind
    ``torch.compile``)."""
    module = uncompiled(module)
    if not isinstance(module, PyroModule):
        return
    for part in _pyro_modules(module):
        for fullname, param, _ in _own_parameters(part):
            yield fullname, param
        prefix = part.__dict__["_pyro_name"]
        for key, child in part._modules.items():
            if child is not None and not isinstance(child, PyroModule):
                owner = f"{prefix}.{key}" if prefix else key
                for name, param in child.named_parameters():
                    yield param_with_module_name(owner, name), param


def _own_parameters(part: PyroModule) -> Iterator[tuple[str, nn.Parameter, bool]]:
    """``(name, parameter, leaf)`` for the parameters the ``PyroModule`` ``part`` holds itself,
    named as the param store names them: ``leaf`` for a ``PyroParam``'s unconstrained leaf,
    named by its ``PyroParam`` (``"locs.w"``)."""
    prefix = part.__dict__["_pyro_name"]
    leaves = {f"{name}_unconstrained": name for name in part.__dict__["_pyro_params"]}
    for name, param in part._parameters.items():
        if param is not None:
            own = leaves.get(name, name)
            yield (f"{prefix}.{own}" if prefix else own), param, name in leaves


def _pyro_modules(root: PyroModule) -> Iterator[PyroModule]:
    """``root`` and the ``PyroModule`` s below it through ``PyroModule`` s, each once; a child
    not named yet (``_pyro_name`` empty: it has not run inside ``root``) is skipped."""
    seen, stack = set(), [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield module
        stack.extend(
            child
            for child in module._modules.values()
            if isinstance(child, PyroModule) and child.__dict__["_pyro_name"]
        )


def weights_only_state() -> dict:
    """Pyro's param store and random state as ``torch.load`` reads them with
    ``weights_only=True`` (its default): the store's parameters (copies of its unconstrained
    tensors), its constraints described by `constraint_description` (class, attributes with
    their tensors copied to the CPU, and ``repr``), and ``pyro.util.get_rng_state()`` with
    numpy's key as a tensor. Restore it with `set_weights_only_state`.

    Returns:
        ``{"params": {name: tensor}, "constraints": {name: description}, "rng": {"torch",
        "random", "numpy"}}``.
    """
    store = pyro.get_param_store().get_state()
    rng = pyro.util.get_rng_state()
    algorithm, key, *rest = rng["numpy"]
    return {
        "params": copy.deepcopy(store["params"]),
        "constraints": {
            name: {**constraint_description(c), "repr": repr(c)}
            for name, c in store["constraints"].items()
        },
        "rng": {
            "torch": rng["torch"],
            "random": rng["random"],
            "numpy": (algorithm, torch.from_numpy(key.astype(np.int64)), *rest),
        },
    }


def constraint_description(value: object) -> object:
    """A constraint (or one of its attributes) as tensors, numbers, strings, lists and dicts,
    which ``torch.load(weights_only=True)`` reads: ``{"type": its class, "fields": its
    attributes}``, a tensor copied to the CPU (its device is where it was saved, not part of
    the support), anything else by ``repr``. Its ``repr`` alone does not tell constraints apart:
    a tensor bound shows 4 decimals and elides the middle of a long one, and names the device
    and the dtype, so an ``interval`` restored onto another device was refused and one whose
    bounds differ past the fourth decimal accepted."""
    if isinstance(value, constraints.Constraint):
        cls = type(value)
        fields = {name: constraint_description(v) for name, v in sorted(vars(value).items())}
        return {"type": f"{cls.__module__}.{cls.__qualname__}", "fields": fields}
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, list | tuple):
        return [constraint_description(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _same_description(a: object, b: object) -> bool:
    """Whether two `constraint_description` s describe one support: the same classes and
    attributes, numbers and tensors equal by value after broadcasting (a float bound and a
    tensor of it alike; another dtype of the same values alike)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_description(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_description, a, b))
    numeric = torch.Tensor | int | float
    tensor = isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)
    if tensor and isinstance(a, numeric) and isinstance(b, numeric):
        x, y = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
        try:
            shape = torch.broadcast_shapes(x.shape, y.shape)
        except RuntimeError:
            return False
        return bool((x.expand(shape) == y.expand(shape)).all())
    return a == b


def _cut(text: str, length: int = 200) -> str:
    """``text`` for a message: cut after ``length`` characters (a long tensor bound's repr)."""
    return text if len(text) <= length else f"{text[:length]} ..."


def _constraint_matches(saved: object, constraint: constraints.Constraint) -> bool:
    """Whether the store's ``constraint`` is the one a checkpoint saved (`weights_only_state`'s
    description; a ``repr`` string, as checkpoints of the first version held, by ``repr``)."""
    if isinstance(saved, str):
        return repr(constraint) == saved
    described = {key: value for key, value in saved.items() if key != "repr"}
    return _same_description(described, constraint_description(constraint))


def shortened(items: Iterable[str], most: int, total: str | None = "in all") -> str:
    """``items`` joined by commas for a message, the first ``most`` of them, then how many in
    all (``"a, b, ... (40 in all)"``, ``total="sites"``: ``"a, b, ... (40 sites)"``) or, with
    ``total=None``, how many more (``"a, b and 38 more"``); all of them where they are no more
    than ``most``."""
    items = list(items)
    shown = ", ".join(items[:most])
    if len(items) <= most:
        return shown
    if total is None:
        return f"{shown} and {len(items) - most} more"
    return f"{shown}, ... ({len(items)} {total})"


def listed_names(names: Iterable[str], most: int = 6) -> str:
    """Parameter names for a message: the first ``most`` quoted, and how many in all
    (``"'a', 'b', ... (40 in all)"``, `shortened`)."""
    return shortened(map(repr, names), most)


def _check_like_held(name: str, saved: torch.Tensor, held: torch.Tensor | None) -> None:
    """Refuse a saved parameter whose shape or dtype is not that of the tensor the set-up
    guide's store holds under its name (none held: nothing to compare)."""
    if held is None or (saved.shape == held.shape and saved.dtype == held.dtype):
        return
    fix = (
        f"; to resume a fit saved in {saved.dtype} in {held.dtype}, convert the checkpoint's "
        f"parameters first (state['params'] = {{k: t.to({held.dtype}) ...}}), or build the model "
        f"in {saved.dtype}"
        if saved.shape == held.shape
        else ""
    )
    raise ValueError(
        f"the checkpoint's parameter {name!r} has shape {tuple(saved.shape)} and {saved.dtype}, "
        f"but the set-up guide's param store holds it with shape {tuple(held.shape)} and "
        f"{held.dtype}: the checkpoint is of another model or guide. Restore a checkpoint into "
        f"the model and guide it was saved from{fix}"
    )


def set_weights_only_state(state: dict) -> None:
    """Restore a `weights_only_state`: clear the param store, fill it with copies of the saved
    parameters under the constraints the store holds now, and set Pyro's random state.

    Set the guide up first, in a new process by calling it once with the model's arguments
    (``guide(x, y)``): that puts its parameters' (and the model's) constraints into the store, and
    the draws of its set-up (a subsampled plate's rows) come before the random state is restored.

    Args:
        state: what `weights_only_state` returned (or ``torch.load`` read back).

    Raises:
        ValueError: if ``state`` is not such a dict, or a saved parameter's constraint is not the
            one the store holds under its name (another model or guide), or is not
            ``constraints.real`` and the store holds none (the guide not set up, or, where the
            store holds others, which the message lists, another model or guide), or has
            another shape or dtype than the store's tensor under its name (another model),
            naming it. Nothing is restored then.
    """
    if not isinstance(state, dict) or set(state) != {"params", "constraints", "rng"}:
        raise ValueError(
            "set_weights_only_state takes what weights_only_state() returned, a dict of params, "
            f"constraints and rng; got {type(state).__name__}"
            + (f" with keys {sorted(state)}" if isinstance(state, dict) else "")
        )
    store = pyro.get_param_store()
    held_state = store.get_state()
    held, held_params = held_state["constraints"], held_state["params"]
    restored = {}
    for name in state["params"]:
        saved = state["constraints"].get(name, repr(constraints.real))
        shown = _cut(saved if isinstance(saved, str) else saved["repr"])
        constraint = held.get(name)
        if constraint is None and _constraint_matches(saved, constraints.real):
            constraint = constraints.real
        if constraint is None:
            other = (  # a store holding parameters: a guide was set up, perhaps another one
                "; or the checkpoint is of another model or guide (a renamed site, another "
                f"guide class): the store holds {listed_names(held)}"
                if held
                else ""
            )
            raise ValueError(
                f"the checkpoint's parameter {name!r} has the constraint {shown}, which the param "
                "store does not hold now: set the guide up before restoring (call it once with "
                "the model's arguments, guide(x, y)), so that the store holds its constraints"
                + other
            )
        if not _constraint_matches(saved, constraint):
            same = " (the same repr: they differ in a bound's digits or elided entries)"
            held_shown = _cut(repr(constraint))
            raise ValueError(
                f"the checkpoint's parameter {name!r} was saved under the constraint {shown}, "
                f"but the param store holds it under {held_shown}"
                f"{same if held_shown == shown else ''}: restore a checkpoint into the "
                "model and guide it was saved from"
            )
        _check_like_held(name, state["params"][name], held_params.get(name))
        restored[name] = constraint
    store.clear()
    store.set_state({"params": copy.deepcopy(state["params"]), "constraints": restored})
    rng = state["rng"]
    algorithm, key, *rest = rng["numpy"]
    pyro.util.set_rng_state(
        {
            "torch": rng["torch"].cpu(),
            "random": rng["random"],
            "numpy": (algorithm, key.cpu().numpy().astype(np.uint32), *rest),
        }
    )
