"""What the node-parallel step's check of the means, standard deviations and settings costs.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_node_parallel_check.py [--repeats 7]
        [--steps 5] [--quick]

`NodeParallelQNVBOptimizer`'s per-step agreement check (``check_nodes``) also compares, since
session 26, a projection of the parameters' means and one of their standard deviations
(`pyro_quadvi.distributed.comm.projections`, float64) and a checksum of the settings the update
reads (`settings_fingerprint` of the optimizer's and every group's): three more numbers in the
step's one ``all_gather``. Its cost: the CPU time of that work on a rank against one one-pass
``QNVBOptimizer.step(loss_fn=module_loss(net, F.cross_entropy), batch=(x, y))`` of the same
network in one process (the work a rank does besides the collectives; the default rule, 3 nodes,
of which a rank of two evaluates 2 or 1), on a 1-50-1 net (Tanh, MSE, batch 128) and a
784-400-400-10 net (ReLU, random data, batch 256), float32.

CPU times (``time.process_time``, one thread, the garbage collector off during each timed run),
medians of ``--repeats``, the two alternated within each repeat. ``--quick`` runs a few seconds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F
from bench_session24_checks import cpu_time
from torch import nn

from pyro_quadvi.distributed import NodeParallelQNVBOptimizer
from pyro_quadvi.distributed.comm import projections, settings_fingerprint
from pyro_quadvi.optim import module_loss


def added_check(optimizer: NodeParallelQNVBOptimizer) -> torch.Tensor:
    """What the check computes since session 26, as `NodeParallelQNVBOptimizer._check_step` does."""
    tensors = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return torch.stack(
        [
            projections([optimizer.state[p]["mu"] for p in tensors]),
            projections([optimizer.state[p]["sigma"] for p in tensors]),
            settings_fingerprint(optimizer._rank_settings())[0],
        ]
    )


def rows(repeats: int, steps: int) -> list[str]:
    out = []
    cases = [
        ("1-50-1, B=128", [1, 50, 1], 128, False),
        ("784-400-400-10, B=256", [784, 400, 400, 10], 256, True),
    ]
    for name, widths, batch, classes in cases:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU() if classes else nn.Tanh()]
        net = nn.Sequential(*layers[:-1])
        x = torch.randn(batch, widths[0])
        y = torch.randint(widths[-1], (batch,)) if classes else torch.randn(batch, 1)
        criterion = F.cross_entropy if classes else F.mse_loss
        # a world of one rank: the plain QNVBOptimizer step, the check's inputs as a rank's
        optimizer = NodeParallelQNVBOptimizer(
            net.named_parameters(), likelihood_weight=10 * batch, prior_precision=1.0
        )
        loss_fn = module_loss(net, criterion)
        for _ in range(2):
            optimizer.step(loss_fn=loss_fn, batch=(x, y))
        entries = sum(p.numel() for p in net.parameters())
        step_times, check_times = [], []
        for _ in range(repeats):
            step_times.append(
                cpu_time(lambda o=optimizer, f=loss_fn, b=(x, y): o.step(loss_fn=f, batch=b), steps)
            )
            check_times.append(cpu_time(lambda o=optimizer: added_check(o), 10 * steps))
        step, check = statistics.median(step_times), statistics.median(check_times)
        out.append(
            f"| {name} | {entries:,} | {1e3 * step:.2f} | {1e3 * check:.3f} | {check / step:.1%} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 1
    torch.set_num_threads(1)
    print(
        "| network | parameters | one-pass step (ms) | means, sigmas and settings (ms) "
        "| check / step |"
    )
    print("|---|---:|---:|---:|---:|")
    for row in rows(args.repeats, args.steps):
        print(row)


if __name__ == "__main__":
    main()
