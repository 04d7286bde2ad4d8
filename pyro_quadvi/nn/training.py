"""``fit``: the plain SVI loop of the tutorials, with a progress bar and a history.

Nothing here is needed to train: ``for step in range(n): svi.step(x, y)`` does the same. ``fit``
only adds what a tutorial wants to show: a tqdm bar with the current loss, minibatches drawn from
any iterable (a ``DataLoader``, re-iterated when it runs out), and a history of the loss and of
metrics evaluated every so many steps.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import SVI
from tqdm.auto import tqdm

from ..guides.interface import unwrap_guide
from ..infer.log_joint import cuda_devices
from ..quadrature.base import as_index
from ..store import follow_param_store
from .module import BayesianModule

__all__ = ["History", "fit"]


@dataclass
class History:
    """What `fit` recorded.

    Attributes:
        loss: the loss ``svi.step`` returned at every step.
        metrics: name -> ``[(step, value), ...]``, evaluated after the steps ``every``,
            ``2 every``, ... and after the last step (steps counted from ``fit``'s
            ``start_step``).
    """

    loss: list[float] = field(default_factory=list)
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def _on(batch: tuple, device: torch.device | str | None) -> tuple:
    """The batch with its tensors moved to ``device`` (unchanged without one)."""
    if device is None:
        return batch
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in batch)


def _check_data(data: object, bayesian: bool) -> None:
    """Refuse, before any step, a ``data`` that is not iterable, or that would be iterated row
    by row: a tensor, an array, a dict, a map-style ``Dataset`` (not a ``DataLoader``); or a
    tuple of minibatches (of tuples, and for a ``BayesianModule``, whose ``y`` is no list, of
    lists too)."""
    rows = isinstance(data, torch.utils.data.Dataset) and not isinstance(
        data, torch.utils.data.IterableDataset
    )
    if isinstance(data, torch.Tensor | Mapping) or type(data).__module__ == "numpy" or rows:
        raise TypeError(
            f"fit: data is a {type(data).__name__}; pass the arguments of a step as a tuple "
            "((x, y): the full batch) or an iterable of such tuples (a DataLoader, a list of "
            "(x, y) tuples). This one would be iterated row by row, one step per row"
            + (": wrap the dataset in a DataLoader" if rows else " without labels")
        )
    # a list is another model's argument as often (a list of sequences of their own lengths,
    # fit(svi, (sequences,), n)), and svi.step passes it on as it is
    kinds = tuple | list if bayesian else tuple
    if isinstance(data, tuple) and data and all(isinstance(v, kinds) for v in data):
        raise TypeError(
            f"fit: data is a tuple of {len(data)} {'tuples or lists' if bayesian else 'tuples'}; "
            "a tuple is one step's "
            "arguments ((x, y): the full batch), so each pair would be taken as one argument. "
            "Pass a list of (x, y) minibatches or a DataLoader: fit(svi, list(data), num_steps)"
        )
    # (not iter(data): a DataLoader would start its workers)
    if not isinstance(data, Iterable) and not hasattr(type(data), "__getitem__"):
        raise TypeError(
            f"fit: data must be the arguments of a step as a tuple ((x, y): the full batch) or "
            f"an iterable of such tuples (a DataLoader), got {data!r} ({type(data).__name__})"
        )


def _batches(data: tuple | Iterable) -> Iterator[tuple]:
    if isinstance(data, tuple):
        while True:
            yield data
    passes = 0
    while True:
        count = 0
        for batch in data:
            count += 1
            if isinstance(batch, Mapping):
                raise TypeError(
                    f"fit: a batch is a dict (keys {list(batch)[:4]}); fit passes a batch's items "
                    "to svi.step in order: make the loader yield tuples (x, y), e.g. with a "
                    "collate_fn, or a TensorDataset(x, y)"
                )
            yield batch if isinstance(batch, tuple | list) else (batch,)
        if count == 0 and passes == 0:
            raise ValueError("fit: the data iterable yielded no batch")
        if count == 0:
            raise ValueError(
                "fit: the data ran out: a one-shot iterator (a generator, say) cannot be cycled. "
                "Pass a list of batches or a DataLoader, or at most as many num_steps as it yields"
            )
        passes += 1


def _count(name: str, value: object, least: int) -> int:
    """``value`` as an int ``>= least`` (any integral type: an int, a NumPy integer), or a
    ``ValueError`` naming ``name``."""
    number = as_index(value)
    if number is None or number < least:
        raise ValueError(f"fit: {name} must be an integer >= {least}, got {value!r}")
    return number


def _underlying(model: object) -> object:
    """The model inside Pyro's handler wrappers (``poutine.scale(bnn, ...)``) and
    ``functools.wraps`` wrappers (``QNVB.anneal``); a ``partial`` binding arguments is kept.
    (Not `unwrap_guide`, which goes through any partial to
    its function, so the batch of a model with bound arguments would be counted short.)"""
    for _ in range(32):
        if isinstance(model, functools.partial) and isinstance(model.func, functools.partial):
            model = model.func  # Pyro's _bound_partial around the handler's partial
        elif (
            isinstance(model, functools.partial)
            and getattr(model.func, "__name__", None) == "_context_wrap"
        ):
            model = model.args[1]  # (the handler, the model)
        elif hasattr(model, "__wrapped__"):
            model = model.__wrapped__
        else:
            break
    return model


def _check_batch(bayesian: bool, batch: tuple) -> None:
    """A ``BayesianModule`` step (``bayesian``: the model is one, `_underlying`) takes
    ``(x, y)``: one item would train with ``y`` sampled as a latent, three or more fail in its
    signature."""
    if bayesian and len(batch) != 2:
        raise TypeError(
            f"fit: a BayesianModule's step takes (x, y), got a batch of {len(batch)} item(s). "
            "Pass (x, y) tuples (a list [x, y] is a list of two batches; per-row weights are "
            "not supported: weight the likelihood in the model, or drop them)"
        )


def _metric_value(name: str, value: object, step: int) -> float:
    """A metric's value as a float, if it is one number (a real number or a 0-d real tensor)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_complex():
            return float(value)
        what = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    elif isinstance(value, numbers.Real):
        return float(value)
    elif isinstance(value, dict):
        what = f"a dict (keys {list(value)[:6]})"
    elif isinstance(value, str):
        what = f"the string {value[:40]!r}"
    else:
        what = f"a {type(value).__name__}"
    raise TypeError(
        f"fit: the metric {name!r} returned {what} after step {step}; a metric must return one "
        "number: a float, an int or a 0-d tensor (float(x) of a scalar x; several values are "
        "several metrics: metrics={'nll': f, 'rmse': g})"
    )


def fit(
    svi: SVI,
    data: tuple | Iterable,
    num_steps: int,
    *,
    metrics: dict[str, Callable[[], float]] | None = None,
    every: int = 100,
    progress: bool = True,
    desc: str = "SVI",
    device: torch.device | str | None = None,
    start_step: int = 0,
) -> History:
    """Run ``num_steps`` of ``svi.step`` and record the loss and ``metrics``.

    Args:
        svi: a ``pyro.infer.SVI`` (any guide, optimizer and ELBO).
        data: the arguments of every step (a tuple, e.g. ``(x, y)``: the full batch), or an
            iterable of such tuples (minibatches, e.g. a ``DataLoader``), cycled: each call starts
            at its first batch (``fit`` keeps no position between calls; two calls of 4 steps over
            a list of batches are not one of 8).
        num_steps: how many steps.
        metrics: name -> a function of nothing returning one number (a float, an int or a 0-d
            tensor; e.g. a test NLL), evaluated every ``every`` steps and after the last one,
            with the random states (torch's, Python's, NumPy's) restored after them: a metric
            that draws does not change the fit. Each value is checked as it is taken.
        every: the spacing of the metric evaluations, in steps.
        progress: show a tqdm bar with the latest loss.
        desc: the bar's label.
        device: where to move each batch's tensors before its step (the model's device, e.g.
            ``"cuda"``, for a ``DataLoader`` of CPU tensors); ``None`` leaves them where they are.
        start_step: the steps done before this call, for a fit resumed from a checkpoint (the
            first call's ``num_steps``): the metrics' steps and their spacing ``every`` go on
            from it, so that the two calls' ``History.metrics`` read as one run's. The batches
            still start at ``data``'s first: to resume a fit over minibatches bit for bit, save
            at the end of an epoch (a whole number of passes over ``data``), or pass the rest of
            the epoch's batches to a first resumed call.

    Before the first step the plain parameters of the guide and of a ``PyroModule`` model take
    the values of a restored param store (`follow_param_store`),
    whatever the ELBO.

    Raises:
        ValueError: for ``num_steps < 0``, ``every < 1``, ``start_step < 0``, an empty
            iterable, or a one-shot iterator that runs out before ``num_steps``.
        TypeError: for an ``svi`` without ``step``, ``model`` and ``guide``, ``metrics`` that
            is not a dict of callables, ``data`` that is not iterable or is a tensor, an array,
            a dict or a tuple of tuples (for a ``BayesianModule`` also of lists: minibatches
            go in a list), a batch that is
            a dict, and, for a ``BayesianModule`` model, a batch that is not ``(x, y)``.
        TypeError: for a metric that returns anything but one number (a dict, a string, a
            tensor of several elements), naming the metric, at its first evaluation.
    """
    num_steps, every = _count("num_steps", num_steps, 0), _count("every", every, 1)
    start_step = _count("start_step", start_step, 0)
    if not all(hasattr(svi, name) for name in ("step", "model", "guide")):
        raise TypeError(
            f"fit: svi must be a pyro.infer.SVI (fit calls its step and reads its model and "
            f"guide), got {svi!r} ({type(svi).__name__})"
        )
    bayesian = isinstance(_underlying(svi.model), BayesianModule)  # once: the model is fixed
    _check_data(data, bayesian)
    if metrics is not None and (
        not isinstance(metrics, Mapping) or not all(map(callable, metrics.values()))
    ):
        raise TypeError(
            "fit: metrics must be a dict of name -> a function of nothing returning one number "
            f"(metrics={{'nll': lambda: ...}}), or None; got {metrics!r}"
        )
    history = History(metrics={name: [] for name in metrics or {}})
    batches = _batches(data)
    follow_param_store(unwrap_guide(svi.guide))
    follow_param_store(unwrap_guide(svi.model))
    bar = tqdm(range(num_steps), disable=not progress, desc=desc)
    for step in bar:
        batch = _on(next(batches), device)
        _check_batch(bayesian, batch)
        history.loss.append(svi.step(*batch))
        bar.set_postfix(loss=f"{history.loss[-1]:.4g}", refresh=False)
        done = start_step + step + 1
        if metrics and (done % every == 0 or step + 1 == num_steps):
            # a metric that draws (predict's samples) must not move the training's random
            # streams (a shuffled DataLoader's order, a random rule's nodes): recording a score
            # leaves the fit as it would be without it
            state = pyro.util.get_rng_state()  # torch's (CPU), Python's and NumPy's
            with torch.random.fork_rng(devices=cuda_devices(batch, svi.model, svi.guide)):
                for name, metric in metrics.items():
                    history.metrics[name].append((done, _metric_value(name, metric(), done)))
            pyro.util.set_rng_state(state)
    return history
