"""What the distributed checks' projections cost on the CPU, before and after session 25.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_projections.py [--repeats 15]
        [--calls 200] [--counts 10 200] [--quick]

`pyro_quadvi.distributed.comm.projections` reduces every tensor of a check (the guide's
parameters in `DistributedQuadratureELBO`'s step, the parameters in `DistributedOptimizer`'s, a
node-parallel step's batch) to one float64 number each step. Before session 25 it copied each
tensor's projection to the CPU and summed the 0-d tensors (on CUDA, a host sync per tensor); now
it copies all of them together, once per device (`comm.host_values`), and sums the numbers in
the same order (the same bits, tested in ``tests/test_distributed_devices.py``). This times the
two forms on the CPU, where no copy is a sync, for ``--counts`` tensors of a 1-50-1 and a
784-400-400-10 network's sizes, cycled (weights and biases, locs and scales: float32).

CPU times (``time.process_time``, one thread, the garbage collector off during each timed run),
medians of ``--repeats``, the two forms alternated within each repeat. ``--quick`` runs in a
second.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_session24_checks import cpu_time

from pyro_quadvi.distributed.comm import projection, projections

SHAPES = [(50, 1), (50,), (1, 50), (1,), (400, 784), (400,), (400, 400), (400,), (10, 400), (10,)]


def old_projections(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``projections`` before session 25: one copy to the CPU per tensor, a sum of 0-d tensors."""
    return sum(
        (projection(t).cpu() * (i + 1) for i, t in enumerate(tensors)),
        torch.zeros((), dtype=torch.float64),
    )


def row(count: int, repeats: int, calls: int, small: bool) -> str:
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES[:4] if small else SHAPES
    tensors = [torch.randn(shapes[i % len(shapes)], generator=g) for i in range(count)]
    entries = sum(t.numel() for t in tensors)
    assert torch.equal(projections(tensors), old_projections(tensors))  # the same bits
    old, new = [], []
    for _ in range(repeats):
        old.append(cpu_time(lambda: old_projections(tensors), calls))
        new.append(cpu_time(lambda: projections(tensors), calls))
    a, b = statistics.median(old), statistics.median(new)
    sizes = "1-50-1" if small else "784-400-400-10"
    return f"| {count} | {sizes} | {entries:,} | {1e3 * a:.3f} | {1e3 * b:.3f} | {b / a:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 200])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.calls = 1, 2
    torch.set_num_threads(1)
    print(
        "| tensors | sizes of | entries | one copy per tensor, before (ms) "
        "| one copy per device (ms) | ratio |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for count in args.counts:
        for small in (True, False):
            print(
                row(count, args.repeats, args.calls if small else max(1, args.calls // 20), small)
            )


if __name__ == "__main__":
    main()
