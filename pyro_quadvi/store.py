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
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator

import pyro
import torch
from pyro.nn import PyroModule
from torch import nn

__all__ = ["detached_parameters", "follow_param_store", "follow_store"]

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
        ValueError: if the store holds a tensor of another shape or dtype under ``fullname``.
    """
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
    watch) puts them back."""
    module = uncompiled(module)
    store = pyro.get_param_store()
    installed = _INSTALLED.get(module, {})
    return [
        fullname
        for fullname, param in _plain_parameters(module)
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
        prefix = part.__dict__["_pyro_name"]
        leaves = {f"{name}_unconstrained" for name in part.__dict__["_pyro_params"]}
        for name, param in part._parameters.items():
            if param is not None and name not in leaves:
                yield (f"{prefix}.{name}" if prefix else name), param


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
