"""Checkpoints of a distributed Pyro fit: written once by rank 0, read by rank 0 and broadcast.

Every rank holds the same state (the same parameters, optimizer state, sequence position and
random state: that is what the ranks agree on), so one copy is the whole checkpoint, and it
restores on any world size that splits the work the same way. Resuming on the same world size
continues bit for bit.
"""

from __future__ import annotations

import os
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
    random state (the CPU's, and each CUDA device's where CUDA has started) to ``path``, from
    rank 0 only; every rank returns once the file is complete.

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
            "generator": None if generator is None else generator.get_state(),
        }
        tmp = Path(f"{os.fspath(path)}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    if size > 1:
        dist.barrier(group=group)


def _cuda_rng_state() -> list[torch.Tensor] | None:
    """Every CUDA device's random state where CUDA has started (else ``None``)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state_all()
    return None


def load_checkpoint(
    path: str | os.PathLike,
    optim: PyroOptim,
    *,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict:
    """Restore what :func:`save_checkpoint` wrote, on every rank (rank 0 reads, then broadcasts).

    Only rank 0 needs to see the file, but every rank makes the call (a collective: a
    broadcast). Restore before the first step, into a fresh param store.

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
    box = [torch.load(path, weights_only=False) if rank == 0 else None]
    if size > 1:
        dist.broadcast_object_list(box, src=0, group=group)
    state = box[0]
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
        # (each device's; a checkpoint of a GPU fit resumed on the CPU has no use for them)
        for index, device_state in enumerate(state["cuda_rng"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)
    if generator is not None:
        generator.set_state(state["generator"])
    return {"world_size": state["world_size"]}
