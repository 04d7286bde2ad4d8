"""Checkpoints of a distributed Pyro fit: written once by rank 0, read by rank 0 and broadcast.

Every rank holds the same state (the same parameters, optimizer state, sequence position and
random state: that is what the ranks agree on), so one copy is the whole checkpoint, and it
restores on any world size that splits the work the same way. Resuming on the same world size
continues bit for bit.

With one GPU per rank (the ``torch.distributed`` convention: each rank's current CUDA device),
rank 0's copy lands on each rank's own device: its tensors, and its device's random state.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import pyro
import torch
import torch.distributed as dist
from pyro.optim import PyroOptim
from pyro.util import get_rng_state, set_rng_state

from .comm import cuda_started, global_rank, raise_together, world

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = "pyro_quadvi.distributed.checkpoint/1"

Generators = torch.Generator | Sequence[torch.Generator] | None
"""``generator=`` of the checkpoint helpers: one ``torch.Generator``, several, or none."""

_GENERATOR_FIX = (
    "pass load_checkpoint the generators passed to save_checkpoint, in the same order (the "
    "ELBO's or optimizer's generator, your minibatch generator, ...)"
)


def _check_optim(optim: object, caller: str) -> None:
    """Refuse an ``optim`` without ``get_state`` and ``set_state`` (``None``, a torch optimizer):
    it failed with ``'NoneType' object has no attribute 'get_state'``."""
    if not (
        callable(getattr(optim, "get_state", None)) and callable(getattr(optim, "set_state", None))
    ):
        raise TypeError(
            f"{caller}: optim must be the Pyro optimizer of the fit (a PyroOptim: QNVB, "
            f"DistributedOptimizer, pyro.optim.Adam, ...), got {type(optim).__name__}"
        )


def _generators(generator: Generators, caller: str) -> list[torch.Generator]:
    """``generator=`` as a list (empty for ``None``), or a ``TypeError`` naming the caller."""
    if generator is None:
        return []
    found = [generator] if isinstance(generator, torch.Generator) else generator
    if isinstance(found, Sequence) and all(isinstance(g, torch.Generator) for g in found):
        return list(found)
    raise TypeError(
        f"{caller}: generator must be a torch.Generator or a sequence of them, got {generator!r}"
    )


def save_checkpoint(
    path: str | os.PathLike,
    optim: PyroOptim,
    *,
    generator: Generators = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write Pyro's param store (with the ELBO's sequence position), ``optim``'s state and the
    random state (the CPU's, and each CUDA device's where CUDA has started, with rank 0's current
    device) to ``path``, from rank 0 only; every rank returns once the file is complete.

    A collective call: every rank makes it (the optimizer's state may be gathered first, then
    the ranks wait for rank 0's write), never under ``if rank == 0:``, where rank 0 would wait for
    the others until the process group's timeout.

    Args:
        path: the file; written to ``path + ".tmp"`` first, then renamed, so a crash never leaves
            half a checkpoint.
        optim: the ``DistributedOptimizer`` (or any ``PyroOptim``) of the fit.
        generator: every ``torch.Generator`` of your own whose state the run depends on, one or
            a sequence of them: the generator given to the ELBO (or to an optimizer) for a random
            rule, the generator that draws your minibatches. torch's, Python's and NumPy's
            global states are always saved. `load_checkpoint` takes the same generators
            in the same order.
        group: the process group (``None``: the default group).

    The objects built with ``group=`` (a ``ProcessGroup``) cannot be deep-copied or pickled
    (torch cannot pickle a ``ProcessGroup``): save and restore a distributed fit with these two
    functions.

    Raises:
        Exception: the error rank 0 met writing ``path`` (a missing folder, a full disk), of the
            same type on every rank (a ``RuntimeError`` where the type takes other arguments),
            naming the file; ``path`` is left as it was.
        TypeError: for an ``optim`` that is no ``PyroOptim`` (no ``get_state``), or a
            ``generator`` that is neither a ``torch.Generator`` nor a sequence of them.
        RuntimeError: when this process is not a member of ``group``.
    """
    _check_optim(optim, "save_checkpoint")
    rank, size = world(group)
    generators = _generators(generator, "save_checkpoint")
    optim_state = optim.get_state()  # collective for DistributedOptimizer(shard_update=True)
    error = None
    if rank == 0:
        try:
            _write(path, optim_state, size, generators)
        except Exception as failed:  # told to every rank below, which then raise it too
            error = failed
    # every rank waits for rank 0's write here, and raises if it failed
    raise_together(error, f"save_checkpoint: writing {os.fspath(path)!r} on rank 0", group)


def _write(path, optim_state: dict, size: int, generators: list[torch.Generator]) -> None:
    """Rank 0's part of `save_checkpoint`: the state, to ``path`` through a temporary. An
    error writing it is reworded to name the file and the fix (what every rank then raises)."""
    state = {
        "format": _FORMAT,
        "world_size": size,
        "param_store": pyro.get_param_store().get_state(),
        "optim": optim_state,
        "rng": get_rng_state(),
        "cuda_rng": _cuda_rng_state(),
        "cuda_device": _own_cuda_device() if cuda_started() else None,
        "generator": [g.get_state() for g in generators] or None,
    }
    tmp = Path(f"{os.fspath(path)}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:  # (torch.save reports a missing folder so)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        reworded = type(error)(
            f"save_checkpoint: rank 0 cannot write {os.fspath(path)!r} ({reason}); rank 0 "
            "writes the checkpoint for every rank: pass a path in a folder that exists and that "
            "rank 0 can write"
        )
        raise reworded from error


def _cuda_rng_state() -> list[torch.Tensor] | None:
    """Every CUDA device's random state where CUDA has started (else ``None``)."""
    return torch.cuda.get_rng_state_all() if cuda_started() else None


def _own_cuda_device() -> int:
    """This rank's own CUDA device: the current one (``torch.cuda.current_device()``, what
    ``torch.cuda.set_device`` chose; with one GPU per rank, the ``torch.distributed``
    convention, each rank's own GPU). Asking starts CUDA: only where CUDA is needed anyway (a
    CUDA storage to place, a CUDA random state to restore) or has started (saving)."""
    return torch.cuda.current_device()


def _onto_own_device(storage, location: str):
    """``torch.load``'s ``map_location``: every CUDA storage onto this rank's own CUDA device
    (rank 0's file holds rank 0's), every other left where it was saved."""
    return storage.cuda(_own_cuda_device()) if location.startswith("cuda") else storage


def _read(path: str) -> bytes | Exception:
    """The file's bytes, or the error reading them raised, reworded to name the file and the
    fix (what rank 0 broadcasts to every rank)."""
    try:
        return Path(path).read_bytes()
    except OSError as error:
        reworded = type(error)(
            f"load_checkpoint: rank 0 cannot read {path!r} ({error.strerror or error}); rank 0 "
            "reads the checkpoint for every rank: pass a path that rank 0 can read"
        )
        reworded.__cause__ = error
        return reworded
    except Exception as error:  # (a path torch or the OS refuses outright): the others hear of it
        return error


def _load_state(path: str, group: dist.ProcessGroup | None) -> dict:
    """The checkpoint's contents on every rank, or the same error on every rank: rank 0 reads
    the file and broadcasts its bytes (or the error reading them); each rank loads them, with
    several ranks every CUDA tensor onto its own device; the ranks compare outcomes
    (`raise_together`), so a load failing on one rank only
    (a rank without CUDA reading a GPU fit's tensors) raises on all."""
    rank, size = world(group)
    box = [_read(path) if rank == 0 else None]
    if size > 1:
        dist.broadcast_object_list(box, src=global_rank(0, group), group=group)
    contents, state, error = box[0], None, None
    if isinstance(contents, Exception):
        error = contents
    else:
        fix = "pass a file written by save_checkpoint"
        try:
            place = None if size == 1 else _onto_own_device  # (one process: devices as saved)
            state = torch.load(io.BytesIO(contents), map_location=place, weights_only=False)
        except Exception as refused:  # not a torch file, or tensors on a device this rank lacks
            error = ValueError(
                f"load_checkpoint: torch.load cannot load {path!r} "
                f"({type(refused).__name__}: {refused}); {fix}, on ranks that have the devices "
                "its tensors were saved on (a GPU fit's: CUDA)"
            )
            error.__cause__ = refused
        else:
            if not isinstance(state, dict) or state.get("format") != _FORMAT:
                error = ValueError(
                    f"load_checkpoint: {path!r} is not a checkpoint (no format {_FORMAT!r}); {fix}"
                )
    raise_together(error, f"load_checkpoint: loading {path!r}", group)
    return state


def load_checkpoint(
    path: str | os.PathLike,
    optim: PyroOptim,
    *,
    generator: Generators = None,
    group: dist.ProcessGroup | None = None,
) -> dict:
    """Restore what `save_checkpoint` wrote, on every rank (rank 0 reads, then broadcasts).

    Only rank 0 needs to see the file, but every rank makes the call (a collective: a
    broadcast of the file's bytes). Restore before the first step, into a fresh param store or
    one the same model and guide have filled (a resumed run creates its parameters first): every
    entry of the live param store must be in the checkpoint with the same shape (the checkpoint
    may hold more, such as the ELBO's sequence position).
    In a world of several ranks, each rank loads the tensors saved on CUDA onto its own current
    CUDA device, and restores rank 0's device's random state into it (one GPU per rank); in one
    process, tensors and every device's random state go back where they were.

    Returns:
        The checkpoint's metadata: ``{"world_size": the world size it was saved from}``.

    Raises:
        OSError: the error rank 0 met reading ``path`` (``FileNotFoundError``, ...), of the same
            type and with the same message on every rank, naming the file.
        ValueError: for a file that is not such a checkpoint, or that ``torch.load`` cannot load
            on some rank (a GPU fit's, on a rank without CUDA), raised on every rank together,
            naming the file (on the other ranks, the failing rank too); when ``generator=``
            gives another number of generators than ``save_checkpoint`` was given; or when an
            entry of the live param store is missing from the checkpoint or has another shape
            there (another model), naming the first such entry. Nothing is restored then.
        TypeError: for an ``optim`` that is no ``PyroOptim`` (no ``get_state``), or a
            ``generator`` that is neither a ``torch.Generator`` nor a sequence of them.
        RuntimeError: when this process is not a member of ``group``.
        Exception: whatever ``optim.set_state`` raised on any rank (a ``QNVB`` built with other
            settings: a ``ValueError`` naming the block and the settings), on every rank
            together; the param store, the random states and every rank's optimizer state are
            then left as they were.
    """
    _check_optim(optim, "load_checkpoint")
    _, size = world(group)
    generators = _generators(generator, "load_checkpoint")
    state = _load_state(os.fspath(path), group)
    saved_generators = state["generator"]
    if isinstance(saved_generators, torch.Tensor):  # (one generator, as the first version saved)
        saved_generators = [saved_generators]
    saved_generators = saved_generators or []
    before = optim.get_state()
    refused = None
    try:  # first: a refused state (other settings) leaves the param store as it was
        if len(saved_generators) != len(generators):
            raise ValueError(
                f"load_checkpoint: {os.fspath(path)!r} holds the states of "
                f"{len(saved_generators)} generator(s), and generator= gives {len(generators)}; "
                + _GENERATOR_FIX
            )
        _check_param_store(state["param_store"], os.fspath(path))
        optim.set_state(state["optim"])
    except Exception as error:  # raised below on every rank, after every rank has heard of it
        refused = error
    try:
        raise_together(refused, "load_checkpoint: restoring the optimizer's state", group)
    except Exception:
        if refused is None:  # this rank took the state another refused: back to its own
            optim.set_state(before)
        raise
    pyro.get_param_store().set_state(state["param_store"])
    set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        # (a checkpoint of a GPU fit resumed on the CPU has no use for them)
        if size == 1:  # one process: each device's state into that device
            for index, device_state in enumerate(state["cuda_rng"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(device_state, index)
        else:  # one GPU per rank: rank 0's device's state into this rank's device
            saved = state["cuda_rng"][state.get("cuda_device") or 0]
            torch.cuda.set_rng_state(saved, _own_cuda_device())
    for live, saved in zip(generators, saved_generators):
        live.set_state(saved)
    return {"world_size": state["world_size"]}


def _check_param_store(saved: dict, path: str) -> None:
    """Refuse a checkpoint of another model: every entry of the live param store must be in the
    saved one (``get_state()``'s) with the same shape. A fresh store passes."""
    saved_params = saved["params"]
    for name, value in pyro.get_param_store().get_state()["params"].items():
        if name not in saved_params:
            found = "is not in the checkpoint"
        elif tuple(saved_params[name].shape) != tuple(value.shape):
            found = (
                f"has shape {tuple(saved_params[name].shape)} in the checkpoint and "
                f"{tuple(value.shape)} here"
            )
        else:
            continue
        raise ValueError(
            f"load_checkpoint: {path!r} is the fit of another model: the parameter {name!r} of "
            f"the live param store {found}; build the model and guide of the saved fit (or "
            "load into a fresh param store, pyro.clear_param_store())"
        )
