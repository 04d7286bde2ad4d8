"""Plain ``torch.distributed`` helpers: who we are, what ranks must agree on, one fused sum.

Everything here works without an initialized process group as a world of one rank (rank 0, size
1), so a script runs unchanged under ``python`` and under ``torchrun``.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_mean_",
    "all_reduce_sum_",
    "broadcast_generator",
    "check_agreement",
    "check_sections",
    "collective_device",
    "cuda_started",
    "differing_setting",
    "gather_rows",
    "global_rank",
    "raise_together",
    "refuse_disagreement",
    "same_world",
    "settings_fingerprint",
    "shard",
    "world",
]


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` when ``torch.distributed`` is not set up.

    Every function and class of `pyro_quadvi.distributed` finds its rank here, so each
    refuses a group the calling process is not a member of.

    Raises:
        RuntimeError: when the calling process is not a member of ``group`` (torch would report
            rank ``-1``, and the callers would compute with it).
    """
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(group)
        if rank < 0:
            raise RuntimeError(
                f"global rank {dist.get_rank()} is not a member of this process group; make "
                "these calls only on its ranks"
            )
        return rank, dist.get_world_size(group)
    return 0, 1


def same_world(
    first: int | None, who: str, fix: str, group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """`world`, refused when its size is not ``first``, the size ``who`` found at its first
    use (``None``: not used yet). A process group destroyed after training started would
    otherwise leave each rank going on alone, fitting its own shard (or its own nodes) as if it
    were the whole problem, without any error.

    Raises:
        RuntimeError: naming ``who``, both sizes and ``fix``.
    """
    rank, size = world(group)
    if first is not None and size != first:
        now = (
            f"a world of {size} rank(s)"
            if dist.is_available() and dist.is_initialized()
            else "no process group (torch.distributed.destroy_process_group() was called)"
        )
        raise RuntimeError(
            f"{who} was first used in a world of {first} ranks and now finds {now}; it does not "
            f"go on as another world, which would fit another problem. {fix}"
        )
    return rank, size


def global_rank(rank: int, group: dist.ProcessGroup | None = None) -> int:
    """The global rank of ``group``'s rank ``rank``: what a collective's ``src`` takes (in a
    group that leaves out global rank 0, ``src=0`` names a process outside it)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's own tensors live: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(num_rows: int, group: dist.ProcessGroup | None = None) -> slice:
    """The contiguous rows of a batch of ``num_rows`` that this rank evaluates.

    Rows are split as ``numpy.array_split`` does: the first ``num_rows % W`` ranks get one row
    more. Shards of unequal size (``B_r`` rows of ``B``) need their weight: under
    `DistributedQuadratureELBO`, its ``share`` (``B_r / B``); under ``DistributedDataParallel``,
    which averages the ranks' mean gradients, the closure's loss times ``W * B_r / B``:
    ``criterion(net(x[rows]), y[rows]) * factor`` with ``rows = shard(len(x))`` and
    ``factor = world()[1] * len(x[rows]) / len(x)``.

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


SEED_FIX = (
    "every rank must start from the same parameters, random state and sequence position: "
    "seed every rank identically (pyro.set_rng_seed) or call broadcast_generator()"
)
MODEL_FIX = "the models differ: every rank must build the same model (and guide)"

Section = tuple[torch.Tensor, str, str]
"""``(values, what they are, how to fix a disagreement)``: one part of an agreement check."""


def check_agreement(
    values: torch.Tensor,
    what: str,
    group: dist.ProcessGroup | None = None,
    *,
    fix: str = SEED_FIX,
) -> None:
    """Raise on every rank unless all ranks hold the same ``values`` bit for bit.

    One ``all_gather`` of the ``n`` values: every rank sees every rank's, so every rank raises
    together and none waits forever in a later collective.

    Args:
        values: a small tensor (a fingerprint), the same number of entries on every rank.
        what: what the values are, for the message.
        fix: what to do about a disagreement, for the message.

    Raises:
        RuntimeError: naming ``what``, the first differing entry and ``fix``.
    """
    check_sections([(values, what, fix)], group)


def check_sections(sections: Sequence[Section], group: dist.ProcessGroup | None = None) -> None:
    """`check_agreement` of several fingerprints in one collective; the first section that
    differs names the error. Every rank must pass the same number of entries in each section."""
    _, size = world(group)
    if size == 1:
        return
    values = host_values([v for v, _, _ in sections])
    refuse_disagreement(gather_rows(values, group), sections)


def host_values(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``tensors`` (at least one) flattened and laid end to end in one CPU tensor of their
    promoted dtype, with one copy to the host per device (on CUDA, one host sync per device
    instead of one per tensor). The same bits as ``torch.cat([t.reshape(-1).cpu() for t in
    tensors])``: each tensor is converted to the promoted dtype before the copy, as
    ``torch.cat`` would convert it after.
    """
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    places: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        places.setdefault(t.device, []).append(i)
    pieces: dict[int, torch.Tensor] = {}
    for indices in places.values():
        flat = [tensors[i].reshape(-1) for i in indices]
        host = torch.cat([t if t.dtype == dtype else t.to(dtype) for t in flat]).detach().cpu()
        if len(places) == 1:
            return host
        pieces.update(zip(indices, host.split([t.numel() for t in flat]), strict=True))
    return torch.cat([pieces[i] for i in range(len(tensors))])


def gather_rows(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``values`` (``n`` numbers, the same ``n`` on every rank) as the rows of a
    ``(W, n)`` float64 tensor on the CPU, the same on every rank: one ``all_gather``."""
    _, size = world(group)
    values = values.detach().to(torch.float64).reshape(1, -1)
    if size == 1:
        return values.cpu()
    values = values.to(collective_device(group))
    rows = [torch.empty_like(values) for _ in range(size)]
    dist.all_gather(rows, values, group=group)
    return torch.cat(rows).cpu()


def refuse_disagreement(rows: torch.Tensor, sections: Sequence[Section]) -> None:
    """Raise unless the rows of `gather_rows` agree bit for bit on the entries of
    ``sections`` (their columns, in order, from the first)."""
    start = 0
    for values, what, fix in sections:
        stop = start + values.numel()
        bits = rows[:, start:stop].contiguous().view(torch.int64)
        differ = (bits != bits[:1]).any(0).nonzero()
        if differ.numel():
            i = int(differ[0])
            column = rows[:, start + i]
            low, high = column.min().item(), column.max().item()
            raise RuntimeError(
                f"the ranks disagree on {what} (entry {i}: from {low!r} to {high!r} across "
                f"ranks); {fix}"
            )
        start = stop


Settings = Mapping[str, Mapping[str, Any]]
"""Named records of settings (an optimizer's, a parameter group's, a block's): name -> field ->
value, values with a ``repr`` that tells them apart."""


def settings_fingerprint(settings: Settings) -> torch.Tensor:
    """A CRC-32 of every record of ``settings`` (by name, its fields in order) as one float64
    number: equal on every rank when (almost surely only when) the settings are."""
    records = sorted((name, list(fields.items())) for name, fields in settings.items())
    return torch.tensor([float(zlib.crc32(repr(records).encode()))], dtype=torch.float64)


def differing_setting(
    settings: Settings, group: dist.ProcessGroup | None = None
) -> tuple[str, str, list] | None:
    """The first record (by name) and field in which the ranks' ``settings`` differ, with every
    rank's value: ``(name, field, values)``, the same on every rank; ``None`` when the ranks
    hold the same fields of the records they share. One ``all_gather_object``, a collective
    every rank makes: call it on every rank once `settings_fingerprint` differed."""
    _, size = world(group)
    everyone: list = [None] * size
    dist.all_gather_object(everyone, {name: dict(f) for name, f in settings.items()}, group=group)
    for name in sorted(set(everyone[0]).intersection(*everyone[1:])):
        for field in sorted(set().union(*(held[name] for held in everyone))):
            values = [held[name].get(field) for held in everyone]
            if any(value != values[0] for value in values):
                return name, field, values
    return None


def raise_together(
    error: Exception | None, what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Raise on every rank if ``error`` is not ``None`` on any: one ``all_gather_object`` of the
    ranks' messages, a collective every rank makes. A rank with an error raises it; the others
    raise one of its type (a ``RuntimeError`` where that type cannot be built from a message)
    with the first failing rank's message, saying ``what`` raised where."""
    _, size = world(group)
    if size > 1:
        messages: list = [None] * size
        mine = None if error is None else (type(error), str(error))
        dist.all_gather_object(messages, mine, group=group)
    else:
        messages = [None if error is None else (type(error), str(error))]
    if error is not None:
        raise error
    failed = [rank for rank, message in enumerate(messages) if message is not None]
    if not failed:
        return
    kind, text = messages[failed[0]]
    text = f"{what} raised on rank(s) {failed}; rank {failed[0]}: {text}"
    try:
        refusal = kind(text)
    except Exception:  # an exception type that takes other arguments
        refusal = RuntimeError(text)
    raise refusal


def broadcast_generator(
    generator: torch.Generator | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Give every rank the state of rank ``src``'s ``generator`` (torch's global one if ``None``).

    ``src`` is a global rank, as in ``torch.distributed``'s collectives (default: ``group``'s
    first rank).

    Random rules (``blocked_simplex``, ``rasp_simplex``, ``mc``) draw their nodes from it: ranks
    that share its state draw the same nodes. With ``None``, on a rank ``src`` that has started
    CUDA, the current CUDA device's state goes too (a rule on a CUDA device draws from it), into
    each rank's current device.
    """
    _, size = world(group)
    if size == 1:
        return
    if src is None:
        src = global_rank(0, group)
    if generator is not None:
        state = generator.get_state().to(collective_device(group), copy=True)
        dist.broadcast(state, src=src, group=group)
        generator.set_state(state.cpu())
        return
    box = [_global_states() if dist.get_rank() == src else None]  # (src: a global rank)
    dist.broadcast_object_list(box, src=src, group=group)
    cpu, cuda = box[0]
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def cuda_started() -> bool:
    """Whether this process has started CUDA (reading a CUDA random state or device would start
    it otherwise)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _global_states() -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's global random states: the CPU's, and the current CUDA device's where CUDA has
    started (``None`` otherwise)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda_started() else None


ORDER_FIX = (
    "pass the same tensors in the same order on every rank: sort them by a name every rank "
    "shares (Pyro's param store name, pyro.get_param_store().param_name(p), as "
    "DistributedOptimizer does; SVI hands an optimizer its parameters in an order that differs "
    "between ranks)"
)


def all_reduce_mean_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_shapes: bool = True,
) -> None:
    """Replace each tensor by its mean over the ranks, in one all-reduce per dtype and device.

    **Every rank must pass the same tensors in the same order**: the tensors are laid end to end
    and the ranks' buffers added entry by entry, so a rank that passes ``[a, b]`` while another
    passes ``[b, a]`` (same sizes) adds ``a`` to ``b`` without any error. ``SVI`` hands an
    optimizer its parameters as a set whose order differs between ranks: sort them by their name
    in Pyro's param store (``pyro.get_param_store().param_name(p)``), as
    `DistributedOptimizer` does.

    The sum is IEEE arithmetic: a value that is not finite on any rank makes that entry not finite
    (NaN or infinite) on every rank, and every rank receives the same bits (ring and tree
    all-reduces reduce each entry once and hand the result to all), so the optimizers' guards skip
    the same coordinates everywhere.

    Args:
        tensors: the tensors, reduced in place.
        group: the process group (``None``: the default group).
        check_shapes: first compare the number and the shapes of the tensors, in order, across
            the ranks (one ``all_gather`` of two numbers per rank, before the reduction), and
            raise on every rank if they differ. It catches an order that differs between tensors
            of different shapes, not between tensors of the same shape; ``False`` skips it (the
            package's own optimizers, which checked the names already, skip it).

    Raises:
        RuntimeError: with ``check_shapes``, on every rank, when the ranks' tensors differ in
            number or shapes (in order).
    """
    _fused_all_reduce_(tensors, group, mean=True, check_shapes=check_shapes)


def all_reduce_sum_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_shapes: bool = True,
) -> None:
    """Replace each tensor by its sum over the ranks, as `all_reduce_mean_` does its mean
    (one all-reduce per dtype and device; the same bits on every rank).

    **Every rank must pass the same tensors in the same order** (sorted by a name the ranks share,
    such as Pyro's param store name): `all_reduce_mean_` says why, and what
    ``check_shapes`` checks.
    """
    _fused_all_reduce_(tensors, group, mean=False, check_shapes=check_shapes)


def shapes_layout(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The number of ``tensors`` and a CRC-32 of their shapes in order, as a float64 pair (exact:
    float32 would round the 32-bit checksum to 24 bits, and more layouts would agree)."""
    shapes = repr([tuple(t.shape) for t in tensors]).encode()
    return torch.tensor([float(len(tensors)), float(zlib.crc32(shapes))], dtype=torch.float64)


def _fused_all_reduce_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    mean: bool,
    check_shapes: bool,
) -> None:
    _, size = world(group)
    if size == 1:
        return
    if check_shapes:  # (before the early return: a rank with no tensors must meet the others)
        check_agreement(
            shapes_layout(tensors),
            "the number and shapes of the tensors to reduce (in order)",
            group,
            fix=ORDER_FIX,
        )
    if not tensors:
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


def node_sections(x: torch.Tensor, weights: torch.Tensor) -> list[Section]:
    """The agreement sections of a step's nodes ``x`` ``(K, dim)`` (or a few of them) and the
    ``K`` weights: the dimension (a different one means different models), then the number of
    nodes and a projection of nodes and weights. A fixed number of entries whatever ``K`` and
    ``dim``, so ranks that disagree meet in the same all-reduce; ``O(K dim)`` work."""
    _, d = x.shape
    dimension = torch.tensor([float(d)], dtype=torch.float64, device=x.device)
    nodes = torch.stack(
        [
            torch.tensor(float(weights.numel()), dtype=torch.float64, device=x.device),
            projection(x),
            projection(weights),
        ]
    )
    return [
        (dimension, "the dimension of the latent space (the number of parameters)", MODEL_FIX),
        (nodes, "the quadrature nodes", SEED_FIX),
    ]


def projection(values: torch.Tensor) -> torch.Tensor:
    """One float64 number that changes (almost surely) when any entry of ``values`` does, or its
    position: the rows of ``values`` (its last axis) projected on a fixed irregular direction,
    those numbers on another. ``O(numel)`` work; a 0-d float64 tensor on ``values``' device."""
    flat = values.detach().to(torch.float64)
    flat = flat.reshape(-1, flat.shape[-1] if flat.dim() and flat.shape[-1] else 1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=values.device)
    rows = flat @ _direction(flat.shape[1], flat.device)
    return rows @ _direction(rows.numel(), flat.device)


def arguments_section(args: Sequence, what: str, fix: str) -> Section:
    """An agreement section of the tensors among ``args`` (a step's batch): their number, a
    checksum of their shapes, and the sum of their `projection` times their position. Three
    entries whatever the batch."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    shapes = repr([tuple(t.shape) for t in tensors]).encode()
    values = torch.stack(
        [
            torch.tensor(float(len(tensors))),
            torch.tensor(float(zlib.crc32(shapes))),
            projections(tensors),
        ]
    ).to(torch.float64)
    return values, what, fix


def projections(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of the tensors' `projection` times their position (from 1): one 0-d float64
    number on the CPU that changes (almost surely) when any value, or the order, does.

    The projections are computed on their tensors' devices and copied to the host together,
    one copy per device (`host_values`); the sum runs in order, in float64, as the sum of the
    0-d tensors did before (the same bits)."""
    total = 0.0
    if tensors:
        for i, value in enumerate(host_values([projection(t) for t in tensors]).tolist()):
            total += value * (i + 1)
    return torch.tensor(total, dtype=torch.float64)


@functools.lru_cache(maxsize=32)
def _direction(dim: int, device: torch.device) -> torch.Tensor:
    """``cos((sqrt(2) - 1) i)`` for ``i < dim``: a fixed, irregular direction (cached)."""
    return torch.cos(torch.arange(dim, dtype=torch.float64, device=device) * (math.sqrt(2.0) - 1.0))
