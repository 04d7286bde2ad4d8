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
from collections.abc import Callable
from pathlib import Path

import pyro
import torch
import torch.distributed as dist
from pyro.optim import PyroOptim
from pyro.util import get_rng_state, set_rng_state

from .comm import raise_together, world

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = "pyro_quadvi.distributed.checkpoint/1"


def save_checkpoint(
    path: str | os.PathLike,
    optim: PyroOptim,
    *,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write Pyro's param store (with the ELBO's sequence position), ``optim``'s state and the
    random state (the CPU's, and each CUDA device's where CUDA has started, with rank 0's current
    device) to ``path``, from rank 0 only; every rank returns once the file is complete.

    A collective call: every rank makes it (the optimizer's state may be gathered first, then a
    barrier), never under ``if rank == 0:``, where rank 0 would wait for the others until the
    process group's timeout.

    Args:
        path: the file; written to ``path + ".tmp"`` first, then renamed, so a crash never leaves
            half a checkpoint.
        optim: the ``DistributedOptimizer`` (or any ``PyroOptim``) of the fit.
        generator: the rule's generator, if the ELBO has one (torch's, Python's and NumPy's global
            states are always saved).
        group: the process group (``None``: the default group).
    """
    rank, size = world(group)
    optim_state = optim.get_state()  # collective for DistributedOptimizer(shard_update=True)
    if rank == 0:
        state = {
            "format": _FORMAT,
            "world_size": size,
            "param_store": pyro.get_param_store().get_state(),
            "optim": optim_state,
            "rng": get_rng_state(),
            "cuda_rng": _cuda_rng_state(),
            "cuda_device": _current_cuda_device(),
            "generator": None if generator is None else generator.get_state(),
        }
        tmp = Path(f"{os.fspath(path)}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    if size > 1:
        dist.barrier(group=group)


def _cuda_started() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_rng_state() -> list[torch.Tensor] | None:
    """Every CUDA device's random state where CUDA has started (else ``None``)."""
    return torch.cuda.get_rng_state_all() if _cuda_started() else None


def _current_cuda_device() -> int | None:
    """The current CUDA device's index where CUDA has started (rank 0's own, with one GPU per
    rank), else ``None``."""
    return torch.cuda.current_device() if _cuda_started() else None


def _onto_device(device: int) -> Callable:
    """A ``map_location`` for ``torch.load`` putting every CUDA storage on CUDA device
    ``device`` and leaving every other where it was saved."""

    def place(storage, location: str):
        return storage.cuda(device) if location.startswith("cuda") else storage

    return place


def load_checkpoint(
    path: str | os.PathLike,
    optim: PyroOptim,
    *,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict:
    """Restore what :func:`save_checkpoint` wrote, on every rank (rank 0 reads, then broadcasts).

    Only rank 0 needs to see the file, but every rank makes the call (a collective: a
    broadcast of the file's bytes). Restore before the first step, into a fresh param store.
    In a world of several ranks, each rank loads the tensors saved on CUDA onto its own current
    CUDA device, and restores rank 0's device's random state into it (one GPU per rank); in one
    process, tensors and every device's random state go back where they were.

    Returns:
        The checkpoint's metadata: ``{"world_size": the world size it was saved from}``.

    Raises:
        ValueError: for a file that is not such a checkpoint, or a generator state with no
            ``generator`` to restore it into (or the reverse).
        Exception: whatever ``optim.set_state`` raised on any rank (a ``QNVB`` built with other
            settings: a ``ValueError`` naming the block and the settings), on every rank
            together; the param store, the random states and every rank's optimizer state are
            then left as they were.
    """
    rank, size = world(group)
    if size == 1:
        state = torch.load(path, weights_only=False)
    else:  # the file's bytes, loaded by each rank onto its own CUDA device where it has one
        box = [Path(path).read_bytes() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        own = _current_cuda_device()
        place = None if own is None else _onto_device(own)
        state = torch.load(io.BytesIO(box[0]), map_location=place, weights_only=False)
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a checkpoint written by save_checkpoint")
    before = optim.get_state()
    refused = None
    try:  # first: a refused state (other settings) leaves the param store as it was
        if (state["generator"] is None) != (generator is None):
            raise ValueError(
                "load_checkpoint: the checkpoint was saved "
                + ("without" if state["generator"] is None else "with")
                + " a generator; pass generator= exactly when the fit's ELBO has one"
            )
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
            torch.cuda.set_rng_state(saved, torch.cuda.current_device())
    if generator is not None:
        generator.set_state(state["generator"])
    return {"world_size": state["world_size"]}
