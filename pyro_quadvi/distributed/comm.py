"""Plain ``torch.distributed`` helpers: who we are, what ranks must agree on, one fused sum.

Everything here works without an initialized process group as a world of one rank (rank 0, size
1), so a script runs unchanged under ``python`` and under ``torchrun``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_mean_",
    "all_reduce_sum_",
    "broadcast_generator",
    "check_agreement",
    "collective_device",
    "shard",
    "world",
]


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` when ``torch.distributed`` is not set up."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's own tensors live: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(num_rows: int, group: dist.ProcessGroup | None = None) -> slice:
    """The contiguous rows of a batch of ``num_rows`` that this rank evaluates.

    Rows are split as ``numpy.array_split`` does: the first ``num_rows % W`` ranks get one row
    more. Shards of unequal size need their share set on the ELBO
    (:attr:`~pyro_quadvi.distributed.DistributedQuadratureELBO.share`).

    Raises:
        ValueError: when there are fewer rows than ranks (a rank would have no data).
    """
    rank, size = world(group)
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < size:
        raise ValueError(
            f"shard: num_rows must be an integer >= the world size {size}, got {num_rows!r} "
            "(every rank needs at least one row)"
        )
    base, extra = divmod(num_rows, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _as_bits(values: torch.Tensor) -> torch.Tensor:
    """Integers that are equal exactly when the float64 values are equal bit for bit."""
    return values.detach().to(torch.float64).reshape(-1).view(torch.int64)


def check_agreement(
    values: torch.Tensor, what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Raise on every rank unless all ranks hold the same ``values`` bit for bit.

    One all-reduce of ``2 n`` integers (``max`` of the bits and of their complements, that is the
    largest and the smallest bit pattern): every rank sees the same result, so every rank raises
    together and none waits forever in a later collective.

    Args:
        values: a small tensor (a fingerprint), same shape on every rank.
        what: what the values are, for the message.

    Raises:
        RuntimeError: naming ``what`` and the first differing entry.
    """
    _, size = world(group)
    if size == 1:
        return
    bits = _as_bits(values)
    both = torch.cat([bits, ~bits])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = bits.numel()
    largest, smallest = both[:n], ~both[n:]
    differ = (largest != smallest).nonzero()
    if differ.numel():
        i = int(differ[0])
        low, high = (t.view(torch.float64)[i].item() for t in (smallest, largest))
        raise RuntimeError(
            f"the ranks disagree on {what} (entry {i}: from {low!r} to {high!r} across ranks); "
            "every rank must start from the same parameters, random state and sequence position: "
            "seed every rank identically (pyro.set_rng_seed) or call broadcast_generator()"
        )


def broadcast_generator(
    generator: torch.Generator | None = None, src: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """Give every rank the state of rank ``src``'s ``generator`` (torch's global one if ``None``).

    Random rules (``blocked_simplex``, ``rasp_simplex``, ``mc``) draw their nodes from it: ranks
    that share its state draw the same nodes.
    """
    _, size = world(group)
    if size == 1:
        return
    state = torch.get_rng_state() if generator is None else generator.get_state()
    state = state.to(collective_device(group), copy=True)
    dist.broadcast(state, src=src, group=group)
    state = state.cpu()
    if generator is None:
        torch.set_rng_state(state)
    else:
        generator.set_state(state)


def all_reduce_mean_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None):
    """Replace each tensor by its mean over the ranks, in one all-reduce per dtype and device.

    The sum is IEEE arithmetic: a value that is not finite on any rank makes that entry not finite
    (NaN or infinite) on every rank, and every rank receives the same bits (ring and tree
    all-reduces reduce each entry once and hand the result to all), so the optimizers' guards skip
    the same coordinates everywhere.
    """
    _fused_all_reduce_(tensors, group, mean=True)


def all_reduce_sum_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None):
    """Replace each tensor by its sum over the ranks, as :func:`all_reduce_mean_` does its mean
    (one all-reduce per dtype and device; the same bits on every rank)."""
    _fused_all_reduce_(tensors, group, mean=False)


def _fused_all_reduce_(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, *, mean: bool
) -> None:
    _, size = world(group)
    if size == 1 or not tensors:
        return
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        if mean:
            flat /= size
        start = 0
        for t in bucket:
            stop = start + t.numel()
            t.copy_(flat[start:stop].view_as(t))
            start = stop


def node_fingerprint(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A few numbers that change when the nodes ``x`` ``(K, dim)`` or their weights change.

    ``x`` projected on a fixed irregular direction (one number per node), the weights, and the
    shape: ``O(K dim)`` work, a little less than one matrix-vector product with the nodes.
    """
    k, d = x.shape
    direction = _direction(d, x.device)
    return torch.cat(
        [
            x.detach().to(torch.float64) @ direction,
            weights.detach().to(torch.float64),
            torch.tensor([float(k), float(d)], dtype=torch.float64, device=x.device),
        ]
    )


@functools.lru_cache(maxsize=8)
def _direction(dim: int, device: torch.device) -> torch.Tensor:
    """``cos((sqrt(2) - 1) i)`` for ``i < dim``: a fixed, irregular direction (cached)."""
    return torch.cos(torch.arange(dim, dtype=torch.float64, device=device) * (math.sqrt(2.0) - 1.0))
