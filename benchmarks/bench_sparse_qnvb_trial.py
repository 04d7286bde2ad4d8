"""Session 15's trial net under SparseQNVB, dense QNVB and Adam: which bound stops it learning.

    OMP_NUM_THREADS=1 python benchmarks/bench_sparse_qnvb_trial.py --steps 300 \
        --json benchmarks/results/sparse_qnvb_trial.jsonl

The trial (``tests/test_user_fixes_s15_sparse.py``): a 50-400-200-1 ReLU regression, 200 cases,
``x`` standard normal, ``y = x_1 + x_2 + x_3 + 0.1 eps``, the loss ``0.5 r^2`` per case (a
Gaussian likelihood of scale 1, as the trial's ``BayesianModule`` declares), every weight and
bias uniform in ``+-0.05`` (``init_to_uniform(radius=0.05)``, RMS 0.029) or Kaiming's normal
(``--init kaiming``, biases 0). Every step sees the whole batch, as the trial's ``svi.step(x, y)``
did (``--batch b``: minibatches of ``b`` cases in a fixed order; ``--batch 1
--steps-per-epoch 200`` is the paper's per-case algorithm). Methods, on the same data and initial
net:

- ``sparse``: ``SparseQNVBOptimizer(num_cases=200, steps_per_epoch=S, num_epochs=n_e,
  target_sparsity, tau_max, prior_precision=1 / 1.3^2)``, Table 1's other settings (the trial's
  script, run through the plain-torch front end, which holds the same state step by step as
  ``SparseQNVB`` from Table 1's start). A step is instrumented: for each update it records the
  ratio of the step's curvature term ``h`` to the floor ``1 / tau_max^2`` that its sum is raised
  to (Algorithm 5.3, line 3; median and 99th percentile over the coordinates: a sum of ``n`` such
  terms stays at the floor while ``n h`` is below it), the share of the coordinates whose step
  the trust region ``max(n0, n1) h_min`` bounds (line 7), and the mean move of the Gaussian
  means ``|nu' - nu|``.
- ``qnvb``: ``QNVBOptimizer(likelihood_weight=200, prior_precision=1 / 1.3^2)`` with the settings
  a ``BayesianModule`` declares (``trust_region=0.3, scale_max=2, significance=1``;
  ``--qnvb-defaults`` for the plain defaults).
- ``adam``: ``torch.optim.Adam(lr=1e-3)`` on the mean loss.
- ``pyro`` (not run by default): the trial's script itself, ``SVI`` with ``SparseQNVB`` on a
  ``BayesianModule`` in float64, measured on its realized network (``sparse_network``); the
  guide draws its own uniform start.

Per run, at the steps ``--report``: the loss (for the quadrature methods, averaged over the
nodes), the training RMSE of the network at the means, the test RMSE on 2,000 fresh cases, the
mean move of the parameters in the step per layer, and for ``sparse`` the exact zeros (and the
probability-of-a-nonzero share above 1/2) and the bound shares above.
"""

from __future__ import annotations

import argparse
import json
import time

import pyro
import torch
from pyro.infer import SVI

import pyro_quadvi.optim.sparse_qnvb as sparse_qnvb
import pyro_quadvi.optim.sparse_torch as sparse_torch
from pyro_quadvi import QuadratureELBO, SparseQNVB
from pyro_quadvi.nn import sparse_network
from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer
from pyro_quadvi.optim.sparse_functional import (
    _min_curvature,
    epoch_progress,
    hybrid_coefficients,
    sparse_qnvb_update,
)
from pyro_quadvi.testing.sparse_trial import TRIAL_CASES, trial_data, trial_model, trial_net

NUM_CASES, NUM_TEST = TRIAL_CASES, 2000
PRIOR_PRECISION = 1 / 1.3**2
REPORT = (1, 3, 5, 10, 20, 30, 50, 100, 200, 300)


class BoundRecorder:
    """Wraps ``sparse_qnvb_update`` as ``SparseQNVBOptimizer`` calls it and records, per update,
    which bound set each coordinate's step (Algorithm 5.3, lines 3 and 7)."""

    def __init__(self):
        self.last: dict = {}

    def __call__(self, blocks, counters, g, h, hp, steps_per_epoch, cases_per_step=1.0):
        epoch, in_epoch = epoch_progress(counters.step, hp, steps_per_epoch)
        floor = hp.curvature_floor(epoch)
        n0, n1 = counters.n0, (0.0 if in_epoch == 0 else counters.n1) + 1.0
        alpha0, alpha1 = hybrid_coefficients(n0, n1)
        trust = max(n0, n1) * _min_curvature(hp, steps_per_epoch, cases_per_step)
        bound = total = 0
        ratios = []
        for block, h_b in zip(blocks, h):
            h1 = (torch.zeros_like(block.h1) if in_epoch == 0 else block.h1) + h_b
            h_hat = alpha0 * block.h0 + alpha1 * h1.clamp(min=floor)
            bound += int((h_hat < trust).sum())
            total += h1.numel()
            ratios.append((h_b / floor).reshape(-1))
        ratios = torch.cat(ratios)
        result = sparse_qnvb_update(blocks, counters, g, h, hp, steps_per_epoch, cases_per_step)
        move = sum(float((b.nu - a.nu).abs().sum()) for a, b in zip(blocks, result.blocks))
        self.last = {
            "trust_bound": bound / total,
            "term_over_floor": float(ratios.median()),
            "term_over_floor_99": float(ratios.quantile(0.99)),
            "floor": floor,
            "trust": trust,
            "nu_move": move / total,
        }
        return result


def run_pyro(args, seed: int) -> dict:
    """The trial's own script: ``SVI`` with ``SparseQNVB`` on a ``BayesianModule`` (spike-and-slab
    prior of inclusion 0.5 and slab scale 1.3, Gaussian likelihood of scale 1), ``AutoSpikeSlab``
    started at Table 1's ``initial_lr`` from ``init_to_uniform(radius=0.05)``, in float64 (as
    the trial's test runs it); measured on the realized network (`sparse_network`)."""
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    recorder = BoundRecorder()
    sparse_qnvb.sparse_qnvb_update = recorder
    rows, start = [], time.process_time()
    try:
        x, y, x_test, y_test = (t.double() for t in trial_data(seed, NUM_TEST))
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        bnn, guide = trial_model(trial_net(args.init, seed))
        optim = SparseQNVB(
            num_epochs=args.num_epochs,
            steps_per_epoch=args.steps_per_epoch,
            num_cases=NUM_CASES,
            target_sparsity=args.target_sparsity,
            prior_precision=PRIOR_PRECISION,
            tau_max=args.tau_max,
            late_tau_max=args.late_tau_max,
            late_epoch=args.late_epoch,
        )
        svi = SVI(bnn, guide, optim, QuadratureELBO("hadamard", num_points=4))
        for step in range(1, args.steps + 1):
            loss = svi.step(x, y)
            if step in args.report or step == args.steps:
                sparse = sparse_network(bnn, guide)
                with torch.no_grad():
                    train = float(((sparse.net(x) - y) ** 2).mean().sqrt())
                    test = float(((sparse.net(x_test) - y_test) ** 2).mean().sqrt())
                kept = sum(sparse.nonzeros.values()) / sum(sparse.sizes.values())
                rows.append(
                    {"step": step, "loss": loss, "train_rmse": train, "test_rmse": test}
                    | recorder.last
                    | {"zeros": 1 - kept}
                )
    finally:
        sparse_qnvb.sparse_qnvb_update = sparse_qnvb_update
        torch.set_default_dtype(previous_dtype)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "methods", "seeds")}
    cpu = time.process_time() - start
    return {"method": "pyro", "seed": seed, **settings, "cpu_s": cpu, "rows": rows}


def run(method: str, args, seed: int) -> dict:
    if method == "pyro":
        return run_pyro(args, seed)
    x, y, x_test, y_test = trial_data(seed, NUM_TEST)
    net = trial_net(args.init, seed)
    params = list(net.parameters())
    recorder = None
    if method == "sparse":
        recorder = BoundRecorder()
        sparse_torch.sparse_qnvb_update = recorder
        optimizer = SparseQNVBOptimizer(
            params,
            num_cases=NUM_CASES,
            steps_per_epoch=args.steps_per_epoch,
            num_epochs=args.num_epochs,
            target_sparsity=args.target_sparsity,
            tau_max=args.tau_max,
            late_tau_max=args.late_tau_max,
            late_epoch=args.late_epoch,
            prior_precision=PRIOR_PRECISION,
            generator=torch.Generator().manual_seed(seed),
        )
    elif method == "qnvb":
        settings = (
            {} if args.qnvb_defaults else dict(trust_region=0.3, scale_max=2.0, significance=1.0)
        )
        optimizer = QNVBOptimizer(
            params,
            likelihood_weight=NUM_CASES,
            prior_precision=PRIOR_PRECISION,
            generator=torch.Generator().manual_seed(seed),
            **settings,
        )
    else:
        optimizer = torch.optim.Adam(params, lr=args.adam_lr)

    batch = args.batch or NUM_CASES
    order = torch.randperm(NUM_CASES, generator=torch.Generator().manual_seed(seed))

    def closure(rows):
        if method == "adam":
            optimizer.zero_grad()
        loss = 0.5 * ((net(x[rows]) - y[rows]) ** 2).mean()
        loss.backward()
        return loss

    rows, start = [], time.process_time()
    previous = [p.detach().clone() for p in params]
    try:
        for step in range(1, args.steps + 1):
            first = (step - 1) * batch % NUM_CASES
            cases = order[first : first + batch]
            loss = float(optimizer.step(lambda cases=cases: closure(cases)))
            if step in args.report or step == args.steps:
                with torch.no_grad():
                    train = float(((net(x) - y) ** 2).mean().sqrt())
                    test = float(((net(x_test) - y_test) ** 2).mean().sqrt())
                row = {
                    "step": step,
                    "loss": loss,
                    "train_rmse": train,
                    "test_rmse": test,
                    "move": [
                        float((p.detach() - q).abs().mean())
                        for p, q in zip(params[::2], previous[::2])
                    ],
                }
                if method == "sparse":
                    zeros = sum(int((p == 0).sum()) for p in params)
                    states = [optimizer.state[p] for p in params]
                    p_nonzero = torch.cat([s["p_nonzero"].reshape(-1) for s in states])
                    tau = torch.cat([s["tau"].reshape(-1) for s in states])
                    row |= recorder.last | {
                        "zeros": zeros / sum(p.numel() for p in params),
                        "nonzero_share": float((p_nonzero > 0.5).double().mean()),
                        "tau_median": float(tau.median()),
                    }
                rows.append(row)
            previous = [p.detach().clone() for p in params]
    except ValueError as error:  # a non-finite loss: diverged
        rows.append({"step": step, "diverged": str(error)[:80]})
    finally:
        sparse_torch.sparse_qnvb_update = sparse_qnvb_update
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "methods", "seeds")}
    return {
        "method": method,
        "seed": seed,
        **settings,
        "cpu_s": time.process_time() - start,
        "rows": rows,
    }


def label(result: dict) -> str:
    name = result["method"]
    if name in ("sparse", "pyro"):
        name += (
            f" tau_max={result['tau_max']} late={result['late_tau_max']}@{result['late_epoch']} "
            f"n_e={result['num_epochs']} S={result['steps_per_epoch']} B={result['batch']} "
            f"s0={result['target_sparsity']}"
        )
    return f"{name}, init {result['init']}"


def show(result: dict) -> None:
    print(f"\n{label(result)}, seed {result['seed']} ({result['cpu_s']:.0f} s CPU)")
    for r in result["rows"]:
        if "diverged" in r:
            print(f"  step {r['step']}: diverged ({r['diverged']})")
            continue
        line = (
            f"  step {r['step']:>4}: loss {r['loss']:.4g}, RMSE train {r['train_rmse']:.3f} test "
            f"{r['test_rmse']:.3f}"
        )
        if "move" in r:
            move = r["move"]
            line += f", move W1 {move[0]:.1e} W2 {move[1]:.1e} W3 {move[2]:.1e}"
        if "zeros" in r:
            line += (
                f", zeros {r['zeros']:.3f}, trust-bound {r['trust_bound']:.3f}, h/floor "
                f"{r['term_over_floor']:.1e} (99%: {r['term_over_floor_99']:.1e}; floor "
                f"{r['floor']:.3g}, trust {r['trust']:.3g}), |dnu| {r['nu_move']:.1e}"
            )
        if "tau_median" in r:
            line += f", tau {r['tau_median']:.3g}"
        print(line)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["sparse", "qnvb", "adam"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--init", choices=["uniform", "kaiming"], default="uniform")
    parser.add_argument("--tau-max", type=float, default=0.03)
    parser.add_argument("--late-tau-max", type=float, default=None)
    parser.add_argument("--late-epoch", type=int, default=3)
    parser.add_argument("--num-epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=10)
    parser.add_argument("--target-sparsity", type=float, default=0.9)
    parser.add_argument(
        "--batch", type=int, default=None, help="cases per step (default: all 200, the trial's)"
    )
    parser.add_argument("--adam-lr", type=float, default=1e-3)
    parser.add_argument("--qnvb-defaults", action="store_true")
    parser.add_argument("--report", type=int, nargs="+", default=list(REPORT))
    parser.add_argument("--json", default=None, help="append results (JSON lines) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for seed in args.seeds:
        for method in args.methods:
            result = run(method, args, seed)
            show(result)
            results.append(result)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(result) + "\n")
    print(summary(results))
    return results


def summary(results: list[dict]) -> str:
    """One row per run: the RMSEs at step 30 (the trial's length) and at the last step."""
    lines = [
        "| run | seed | train RMSE, step 30 | test RMSE, step 30 | last step | train RMSE | "
        "test RMSE | exact zeros |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        rows = [r for r in result["rows"] if "diverged" not in r]
        at = {r["step"]: r for r in rows}
        last = rows[-1] if rows else {"step": "-"}
        early = at.get(30, {})

        def cell(row, key, digits=3):
            return f"{row[key]:.{digits}f}" if key in row else "-"

        diverged = [r for r in result["rows"] if "diverged" in r]
        end = f"{last['step']}" + (f" (diverged at {diverged[0]['step']})" if diverged else "")
        lines.append(
            f"| {label(result)} | {result['seed']} | {cell(early, 'train_rmse')} | "
            f"{cell(early, 'test_rmse')} | {end} | {cell(last, 'train_rmse')} | "
            f"{cell(last, 'test_rmse')} | {cell(last, 'zeros')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
