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
   the CPU time of ``rmse`` against its form before the scaling (the same input checks, then
   ``sqrt(mean((pred - y) ** 2))``) on ``--rows`` float32 residuals.

3. **The check of autograd's derivatives at the Laplace mode**
   (`pyro_quadvi.evidence.weight._check_derivatives`: two more evaluations of the log joint at
   the mode plus and minus a thousandth of a weight standard deviation, a warning where central
   differences disagree with autograd): ``opqa_evidence`` with it and without it (replaced by a
   function that does nothing) on a Bayesian linear regression of 100 rows, 3 weights and a
   LogNormal noise scale (d = 4), at 1 and 8 points a coordinate.

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
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi.distributed.comm import projections
from pyro_quadvi.evidence import opqa_evidence, weight
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO
from pyro_quadvi.metrics import _check_float, _check_same_shape, rmse
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVB


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
    return svi, (x, y), description.leaves()


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


def unscaled_rmse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``metrics.rmse`` before session 24: its input checks, then the squares unscaled."""
    pred = _check_float("pred", pred)
    y = _check_same_shape("y", y, "pred", pred)
    return (pred - y).square().mean().sqrt()


def rmse_row(repeats: int, rows: int) -> str:
    torch.manual_seed(0)
    pred, y = torch.randn(rows), torch.randn(rows)
    scaled, plain = [], []
    for _ in range(repeats):
        scaled.append(cpu_time(lambda: rmse(pred, y), 5))
        plain.append(cpu_time(lambda: unscaled_rmse(pred, y), 5))
    s, p = statistics.median(scaled), statistics.median(plain)
    return f"| {rows:,} | {1e3 * p:.2f} | {1e3 * s:.2f} | {s / p:.2f} |"


def regression(x: torch.Tensor, y: torch.Tensor) -> None:
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("rows", x.shape[0]):
        pyro.sample("y", dist.Normal((x * w).sum(-1), s), obs=y)


def evidence_rows(repeats: int) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(100, 3, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64) + 0.3 * torch.randn(
        100, dtype=torch.float64
    )
    checked = weight._check_derivatives
    rows = []
    for points in (1, 8):
        with_check, without = [], []
        for _ in range(repeats):
            with_check.append(
                cpu_time(lambda n=points: opqa_evidence(regression, x, y, num_points=n))
            )
            weight._check_derivatives = lambda *args: None
            try:
                without.append(
                    cpu_time(lambda n=points: opqa_evidence(regression, x, y, num_points=n))
                )
            finally:
                weight._check_derivatives = checked
        a, b = statistics.median(without), statistics.median(with_check)
        rows.append(f"| {points} | {points**4:,} | {1e3 * a:.1f} | {1e3 * b:.1f} | {b / a:.2f} |")
    return rows


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
    print("| residuals (float32) | rmse unscaled, as before (ms) | metrics.rmse (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    print(rmse_row(args.repeats, args.rows))
    print()
    print(
        "| points a coordinate | nodes | opqa_evidence without the check (ms) | with it (ms) "
        "| ratio |"
    )
    print("|---:|---:|---:|---:|---:|")
    for row in evidence_rows(args.repeats):
        print(row)


if __name__ == "__main__":
    main()
