"""What session 26's changes cost: `QNVBOptimizer`'s one pass, `SpikeSlab.sample`.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_session26_checks.py [--repeats 7]
        [--steps 5] [--quick]

A vectorized pass decided on an earlier step is no longer trusted to run its backward: the buffers
of the network the loss exposes (BatchNorm's running statistics in ``eval()`` mode, where the pass
runs under ``vmap``) are copied before the pass, so that a backward failing on a later batch can
undo the pass's buffer updates and fall back to the loop
(`pyro_quadvi.optim.torch_qnvb.BufferSnapshot`). Its cost: the CPU time of that copy against one
one-pass ``QNVBOptimizer.step(loss_fn=module_loss(net, F.cross_entropy), batch=(x, y))`` (a unit
Gaussian prior, ``likelihood_weight=8000``, the default rule), on a 784-400-400-10 MLP with a
BatchNorm1d after each hidden layer (batch 256) and a two-convolution network with BatchNorm2d (the
sequence paper's Table 2 layout, batch 64), random data, the nets in ``eval()`` mode.

2. **`SpikeSlab.sample`'s float64 uniform** (the choice between the point mass and the slab; a
float32 uniform, a multiple of ``2^-24``, brought zeroed weights back 590,000 times too often):
the CPU time of ``SpikeSlab.sample()`` on ``--coordinates`` float32 coordinates against the same
draw with the float32 uniform of before (``torch.rand(shape) < inclusion``, then the slab draw
and the ``where``), alternated within each repeat.

CPU times (``time.process_time``, one thread, the garbage collector off during each timed run),
medians of ``--repeats``. ``--quick`` runs a few seconds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from bench_session24_checks import cpu_time
from torch import nn

from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.optim import QNVBOptimizer, module_loss
from pyro_quadvi.optim.torch_qnvb import BufferSnapshot


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 400), nn.BatchNorm1d(400), nn.ReLU(),
        nn.Linear(400, 400), nn.BatchNorm1d(400), nn.ReLU(),
        nn.Linear(400, 10),
    )  # fmt: skip


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(1024, 10),
    )  # fmt: skip


def case(name: str, repeats: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    net, batch = (mlp(), 256) if name == "784-400-400-10 BN" else (cnn(), 64)
    net.eval()
    x = torch.randn(batch, 784) if name.startswith("784") else torch.randn(batch, 1, 28, 28)
    y = torch.randint(10, (batch,))
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=8000, prior_precision=1.0)
    loss_fn = module_loss(net, F.cross_entropy)
    optimizer.step(loss_fn=loss_fn, batch=(x, y))  # decides: the vectorized pass, kept
    step, copy = [], []
    for _ in range(repeats):
        step.append(cpu_time(lambda: optimizer.step(loss_fn=loss_fn, batch=(x, y)), steps))
        copy.append(cpu_time(lambda: BufferSnapshot(loss_fn), 100))
    buffers = sum(b.numel() for b in net.buffers())
    return {
        "buffers": buffers,
        "step_ms": 1e3 * statistics.median(step),
        "copy_ms": 1e3 * statistics.median(copy),
    }


def spike_slab_case(coordinates: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    d = SpikeSlab(
        zero_logits=torch.randn(coordinates) * 10,
        slab_scale=torch.rand(coordinates) + 0.1,
        slab_loc=torch.randn(coordinates),
    )

    def before() -> torch.Tensor:
        keep = torch.rand(coordinates) < d.inclusion
        return torch.where(keep, d.slab().sample(), torch.zeros(coordinates))

    new, old = [], []
    for _ in range(repeats):
        new.append(cpu_time(d.sample, 20))
        old.append(cpu_time(before, 20))
    return {"new_ms": 1e3 * statistics.median(new), "old_ms": 1e3 * statistics.median(old)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--coordinates", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, steps = (2, 1) if args.quick else (args.repeats, args.steps)
    torch.set_num_threads(1)
    print("| network | buffer entries | one-pass step (ms) | buffer copy (ms) | copy / step |")
    print("|---|---|---|---|---|")
    for name in ("784-400-400-10 BN", "Table 2 CNN BN"):
        row = case(name, repeats, steps)
        print(
            f"| {name} | {row['buffers']:,} | {row['step_ms']:.2f} | {row['copy_ms']:.4f} | "
            f"{row['copy_ms'] / row['step_ms']:.2e} |"
        )
    coordinates = 10_000 if args.quick else args.coordinates
    row = spike_slab_case(coordinates, repeats)
    print()
    print("| coordinates | float32 uniform, before (ms) | float64 uniform (ms) | ratio |")
    print("|---|---|---|---|")
    print(
        f"| {coordinates:,} | {row['old_ms']:.3f} | {row['new_ms']:.3f} | "
        f"{row['new_ms'] / row['old_ms']:.2f} |"
    )


if __name__ == "__main__":
    main()
