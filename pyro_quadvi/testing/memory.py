"""The peak CPU memory of a call, from torch's profiler (tests bounding an update's memory)."""

from __future__ import annotations

from collections.abc import Callable

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["cpu_peak_bytes"]


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """The most CPU memory held at once while ``fn()`` runs beyond what it started with: the
    maximum of the running sum of the allocations and frees that torch's profiler records
    (``profile_memory=True``), in time order; a free of memory allocated before is left out."""
    events = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        for child in node.children:
            walk(child)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live: set[int] = set()
    running = peak = 0
    for _, address, nbytes in sorted(events):
        if nbytes > 0:
            live.add(address)
        elif address in live:
            live.remove(address)
        else:
            continue
        running += nbytes
        peak = max(peak, running)
    return peak
