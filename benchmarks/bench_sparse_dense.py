"""Sparsifying QNVB on a dense linear regression: where the 4-node curvature estimate breaks.

    OMP_NUM_THREADS=1 python benchmarks/bench_sparse_dense.py --dtype float64

The problem of the "Limits" bullet of ``docs/sparse_qnvb.md``: 256 cases, 20 i.i.d. standard
normal inputs, true weights ``(1.5, -2, 1, 0, ..., 0)``, Gaussian noise of scale 0.1 (the loss is
its negative log-likelihood per case, ``0.5 r^2 / 0.01``), a bias-free ``nn.Linear(20, 1)``
trained by ``SparseQNVBOptimizer(target_sparsity=0.7, target_free=0.1)`` for 10 epochs of
minibatches of ``B`` cases. Per row (``B``, ``tau_max``, pairs per step, target sparsity): the
squared error of the final weights (mean over the 20), their exact zeros, and the first step whose
quadrature-averaged loss is not finite (``-``: none). ``--pairs 32`` makes every coordinate pair
exact in each step for 20 coordinates (sequence paper, Theorem 3.3: 32 iterates), so the diagonal
curvature estimate of a quadratic loss is exact; with 2 pairs (the default) half of the pairs
are, and the others add ``H_ij sigma_j / sigma_i`` to ``h_i``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import warnings

import torch
from tqdm.auto import tqdm

from pyro_quadvi.optim import SparseQNVBOptimizer

NUM_CASES, DIM, NOISE = 256, 20, 0.1
TRUE = (1.5, -2.0, 1.0)


def run(batch: int, tau_max: float, pairs: int, sparsity: float, dtype, seed: int) -> dict:
    """One training run; returns the weights' squared error, zeros and first non-finite step."""
    torch.manual_seed(seed)
    x = torch.randn(NUM_CASES, DIM, dtype=dtype)
    w = torch.zeros(DIM, dtype=dtype)
    w[: len(TRUE)] = torch.tensor(TRUE, dtype=dtype)
    y = x @ w + NOISE * torch.randn(NUM_CASES, dtype=dtype)
    net = torch.nn.Linear(DIM, 1, bias=False).to(dtype)
    steps = NUM_CASES // batch
    optim = SparseQNVBOptimizer(
        net.parameters(),
        num_cases=NUM_CASES,
        steps_per_epoch=steps,
        target_sparsity=sparsity,
        target_free=0.1,
        tau_max=tau_max,
        num_pairs=pairs,
        generator=torch.Generator().manual_seed(seed),
    )
    failed = None
    for epoch in range(optim.hyperparameters.num_epochs):
        order = torch.randperm(NUM_CASES)
        for s in range(steps):
            rows = order[s * batch : (s + 1) * batch]

            def closure(rows=rows):
                loss = 0.5 * ((net(x[rows]).squeeze(-1) - y[rows]) ** 2).mean() / NOISE**2
                loss.backward()
                return loss

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                try:
                    optim.step(closure)
                except ValueError:  # the optimizer refuses a non-finite loss: diverged
                    failed = epoch * steps + s + 1
                    break
        if failed:
            break
    weights = net.weight.detach().reshape(-1)
    return {
        "mse": float(((weights - w) ** 2).mean()) if failed is None else math.inf,
        "zeros": int((weights == 0).sum()),
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 256])
    parser.add_argument("--tau-max", type=float, nargs="+", default=[0.1, 0.03])
    parser.add_argument("--pairs", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.7, 0.0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    grid = list(itertools.product(args.batches, args.tau_max, args.pairs, args.sparsity))
    rows = []
    for batch, tau_max, pairs, sparsity in tqdm(grid, desc="runs"):
        rows.append(
            (
                batch,
                tau_max,
                pairs,
                sparsity,
                run(batch, tau_max, pairs, sparsity, dtype, args.seed),
            )
        )
    print("| B | tau_max | pairs | target_sparsity | weight MSE | zeros | non-finite at step |")
    print("|---|---|---|---|---|---|---|")
    for batch, tau_max, pairs, sparsity, r in rows:
        failed = "-" if r["failed"] is None else r["failed"]
        print(
            f"| {batch} | {tau_max:g} | {pairs} | {sparsity:g} | {r['mse']:.3g} | {r['zeros']} | "
            f"{failed} |"
        )


if __name__ == "__main__":
    main()
