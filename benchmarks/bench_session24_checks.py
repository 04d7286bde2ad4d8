"""What session 24's checks cost against the work they guard.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_session24_checks.py [--repeats 7]
        [--steps 10] [--rows 1000000] [--quick]

1. **The guide's parameters in the distributed ELBO's collective**
   (`DistributedQuadratureELBO._evaluate`): every rank projects all the guide's parameters on a
   fixed direction (`pyro_quadvi.distributed.comm.projections`, float64) each step, one more
   number in the step's one ``all_gather``; ranks whose parameters differ (an optimizer not
   wrapped in `DistributedOptimizer`, ranks seeded differently) are refused. Its cost: the CPU
   time of that projection against one SVI step (``QNVB`` + ``QuadratureELBO``, K = 4 nodes,
   ``AutoMeanFieldNormal``) of a `BayesianModule` in one process, the work a rank does besides
   the collective, on a 1-50-1 net (Gaussian, batch 128) and a 784-400-400-10 net (ReLU,
   categorical, random data, batch 256).
2. **`metrics.rmse` scaled by the largest residual** (no overflow of the squares in float32):
   the CPU time of the scaled form against the plain ``sqrt(mean(r ** 2))`` on ``--rows``
   float32 residuals.

CPU times (``time.process_time``, one thread, the garbage collector off during each timed run),
medians of ``--repeats``, the variants alternated within each repeat. ``--quick`` runs a few
seconds.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time
from collections.abc import Callable

import pyro
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi.distributed.comm import projections
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO
from pyro_quadvi.metrics import rmse
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVB
from pyro_quadvi.optim.qnvb import _leaves


def cpu_time(fn: Callable[[], object], calls: int = 1) -> float:
    """CPU seconds of ``calls`` calls of ``fn``, the garbage collector off."""
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        for _ in range(calls):
            fn()
        return (time.process_time() - start) / calls
    finally:
        gc.enable()


def network_case(widths: list[int], batch: int, classes: bool):
    """An SVI of a `BayesianModule` on random data after two steps, and its minibatch."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU() if classes else nn.Tanh()]
    net = nn.Sequential(*layers[:-1])
    x = torch.randn(batch, widths[0])
    if classes:
        y = torch.randint(widths[-1], (batch,))
        likelihood = likelihoods.Categorical(dataset_size=10 * batch)
    else:
        y = torch.randn(batch, 1)
        likelihood = likelihoods.Gaussian(dataset_size=10 * batch, scale=0.1)
    bnn = BayesianModule(net, prior=priors.Normal(scale=1.0), likelihood=likelihood)
    guide = AutoMeanFieldNormal(bnn)
    elbo = QuadratureELBO()
    svi = SVI(bnn, guide, QNVB(), elbo)
    for _ in range(2):
        svi.step(x, y)
    with torch.no_grad():
        _, description = elbo._quadrature_loss(bnn, guide, (x,), {"y": y})
    return svi, (x, y), _leaves(description)


def projection_rows(repeats: int, steps: int) -> list[str]:
    rows = []
    cases = [
        ("1-50-1, B=128", [1, 50, 1], 128, False),
        ("784-400-400-10, B=256", [784, 400, 400, 10], 256, True),
    ]
    for name, widths, batch, classes in cases:
        svi, data, leaves = network_case(widths, batch, classes)
        entries = sum(t.numel() for t in leaves)
        step_times, projection_times = [], []
        for _ in range(repeats):
            step_times.append(cpu_time(lambda s=svi, d=data: s.step(*d), steps))
            projection_times.append(cpu_time(lambda p=leaves: projections(p), 10 * steps))
        step, proj = statistics.median(step_times), statistics.median(projection_times)
        rows.append(
            f"| {name} | {entries:,} | {1e3 * step:.2f} | {1e3 * proj:.3f} | {proj / step:.1%} |"
        )
    return rows


def rmse_row(repeats: int, rows: int) -> str:
    torch.manual_seed(0)
    pred, y = torch.randn(rows), torch.randn(rows)
    scaled, plain = [], []
    for _ in range(repeats):
        scaled.append(cpu_time(lambda: rmse(pred, y), 5))
        plain.append(cpu_time(lambda: (pred - y).pow(2).mean().sqrt(), 5))
    s, p = statistics.median(scaled), statistics.median(plain)
    return f"| {rows:,} | {1e3 * p:.2f} | {1e3 * s:.2f} | {s / p:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.rows = 1, 1, 10_000
    torch.set_num_threads(1)
    print(
        "| network | parameter entries (locs and scales) | SVI step (ms) | projection (ms) "
        "| projection / step |"
    )
    print("|---|---:|---:|---:|---:|")
    for row in projection_rows(args.repeats, args.steps):
        print(row)
    print()
    print("| residuals (float32) | plain sqrt(mean(r^2)) (ms) | metrics.rmse (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    print(rmse_row(args.repeats, args.rows))


if __name__ == "__main__":
    main()
