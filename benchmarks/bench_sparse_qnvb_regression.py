"""Sparsifying QNVB on the sparse-VI paper's regression (issue 13, benchmark 2), in epochs and time.

    OMP_NUM_THREADS=1 python benchmarks/bench_sparse_qnvb_regression.py --reps 3 \
        --json benchmarks/results/sparse_qnvb_regression.jsonl \
        --plot docs/img/sparse_qnvb_regression.png

The problem, network, prior, likelihood and measures are those of ``bench_spike_slab.py``
(issue 12, the sparse-VI paper's experiment: 200 uniform inputs of which 5 matter, 3,000 training
and 10,000 test rows drawn anew per replication, a 200-7-7-7-1 ReLU network with 1,527 latent
weights and biases, ``SpikeSlab(lambda, 1.3)`` prior, Gaussian likelihood of scale 1). Two methods:

- **sparse** (``sparse_qnvb``): ``SVI(bnn, AutoSpikeSlab(bnn), SparseQNVB(...),
  QuadratureELBO(rule="hadamard", num_points=4))``, the sequence paper's Algorithms 5.1-5.3
  with Table 1's settings but ``tau_max`` (``--tau-max``, default 0.05: Table 1's 0.3 diverges
  within 5 steps here), the targets ``--target-sparsity`` / ``--target-free`` (default 0.9 /
  0.05: at least 5% of the weights nonzero, as the baseline keeps 6-10%) and the slab prior's
  precision ``1 / 1.3^2``; the guide starts at Table 1's
  ``initial_lr = 1e-5`` (slab scale ``1e-5**0.5``, every weight nonzero) from the same uniform
  slab means as the baseline. Its schedule is set by the number of epochs ``n_e``, so each entry
  of ``--sparse-epochs`` is a run of its own; minibatches of ``--sparse-batch`` rows.
- **gumbel**: the sparse-VI paper's method as in ``bench_spike_slab.py`` (``GumbelSpikeSlabELBO``,
  temperature 0.5, Adam lr 5e-3, minibatches of 512), one run of ``max(--gumbel-epochs)`` epochs,
  measured at each entry of ``--gumbel-epochs`` (Adam has no schedule: the state after ``k``
  epochs is that of a ``k``-epoch run).

Measures (each at the end of a run or a checkpoint): test RMSE of the realized network
(``sparse_network``, inclusion > 1/2) and of the model average over 32 guide draws, the fraction of
exact zeros (weights and biases with inclusion <= 1/2), input selection against the 5 true inputs
(an input is selected if any of its first-layer weights is nonzero: FPR over the 195 noise inputs,
FNR over the 5 true ones), and the training loop's wall and CPU time (evaluations excluded).
"""

from __future__ import annotations

import argparse
import time

import pyro
import torch
from bench_spike_slab import (
    BATCH,
    HIDDEN,
    INIT_RADIUS,
    N_TEST,
    N_TRAIN,
    SLAB_SCALE,
    WIDTH,
    P,
    build,
    kept_fraction,
    make_net,
    realized,
    report,
    rmse,
    summarize,
)
from pyro.infer import SVI
from pyro.infer.autoguide import init_to_uniform
from tqdm.auto import tqdm

from pyro_quadvi import AutoSpikeSlab, QuadratureELBO, SparseQNVB
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.testing.sparse_regression import TRUE_INPUTS, sparse_regression_data


class Clock:
    """Wall and CPU time of the training loop, paused while the benchmark evaluates."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self._start = None

    def __enter__(self):
        self._start = (time.perf_counter(), time.process_time())
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._start[0]
        self.cpu += time.process_time() - self._start[1]


def measures(bnn, guide, x_test, y_test) -> dict:
    """The measures of ``bench_spike_slab.py`` for a spike-and-slab guide."""
    net, first = realized(bnn, guide, "gumbel")
    selected = first.any(0)
    bma = bnn.predict(guide, x_test, num_samples=32).mean.squeeze(-1)
    kept = kept_fraction(guide, "gumbel")
    return {
        "rmse": rmse(net, x_test, y_test),
        "rmse_bma": float(((bma - y_test) ** 2).mean().sqrt()),
        "kept": kept,
        "zeros": 1 - kept,
        "fnr": float((~selected[:TRUE_INPUTS]).double().mean()),
        "fpr": float(selected[TRUE_INPUTS:].double().mean()),
        "selected": selected.nonzero().flatten().tolist()[:20],
    }


def minibatches(batch: int):
    order = torch.randperm(N_TRAIN)
    return [order[i : i + batch] for i in range(0, N_TRAIN, batch)]


def run_sparse(rep: int, epochs: int, args) -> dict:
    """One sparsifying-QNVB run of ``epochs`` epochs; the curve holds, per epoch, the test RMSE of
    the network a rounding would realize then and the fraction it would zero."""
    pyro.clear_param_store()
    pyro.set_rng_seed(rep)
    x, y, x_test, y_test = sparse_regression_data(N_TRAIN, N_TEST, P, seed=rep)
    net = make_net()
    num_params = sum(p.numel() for p in net.parameters())
    inclusion = priors.theorem_inclusion(num_params, HIDDEN, WIDTH, N_TRAIN, P)
    likelihood = likelihoods.Gaussian(dataset_size=N_TRAIN, scale=1.0)
    bnn = BayesianModule(net, priors.SpikeSlab(inclusion, SLAB_SCALE), likelihood)
    guide = AutoSpikeSlab(
        bnn,
        init_loc_fn=init_to_uniform(radius=INIT_RADIUS),
        init_scale=1e-5**0.5,
        init_inclusion=1 - 1e-9,
    )
    steps = -(-N_TRAIN // args.sparse_batch)
    optim = SparseQNVB(
        num_epochs=epochs,
        steps_per_epoch=steps,
        num_cases=N_TRAIN,
        target_sparsity=args.target_sparsity,
        target_free=args.target_free,
        tau_max=args.tau_max,
        prior_precision=SLAB_SCALE**-2,
    )
    svi = SVI(bnn, guide, optim, QuadratureELBO(rule="hadamard", num_points=4))
    clock, curve = Clock(), []
    for epoch in tqdm(range(1, epochs + 1), desc=f"sparse {epochs} ep, rep {rep}", leave=False):
        total = 0.0
        with clock:
            for rows in minibatches(args.sparse_batch):
                total += svi.step(x[rows], y[rows]) / steps
        net_now, _ = realized(bnn, guide, "gumbel")
        curve.append((epoch, rmse(net_now, x_test, y_test), kept_fraction(guide, "gumbel"), total))
    return {
        "method": "sparse",
        "rep": rep,
        "epochs": epochs,
        "batch": args.sparse_batch,
        **measures(bnn, guide, x_test, y_test),
        "wall_s": clock.wall,
        "cpu_s": clock.cpu,
        "curve": curve,
    }


def run_gumbel(rep: int, checkpoints: list[int]) -> list[dict]:
    """One Gumbel run (``bench_spike_slab.py``'s), measured after each of ``checkpoints`` epochs."""
    pyro.clear_param_store()
    pyro.set_rng_seed(rep)
    x, y, x_test, y_test = sparse_regression_data(N_TRAIN, N_TEST, P, seed=rep)
    bnn, guide, elbo = build("gumbel", x, y)
    optimizer = torch.optim.Adam(guide.parameters(), lr=5e-3)
    clock, curve, results = Clock(), [], []
    last = max(checkpoints)
    for epoch in tqdm(range(1, last + 1), desc=f"gumbel rep {rep}", leave=False):
        total = 0.0
        with clock:
            for rows in minibatches(BATCH):
                loss = elbo.differentiable_loss(bnn, guide, x[rows], y[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += loss.item() * len(rows) / N_TRAIN
        if epoch in checkpoints or epoch % 10 == 0:
            net_now, _ = realized(bnn, guide, "gumbel")
            curve.append(
                (epoch, rmse(net_now, x_test, y_test), kept_fraction(guide, "gumbel"), total)
            )
        if epoch in checkpoints:
            results.append(
                {
                    "method": "gumbel",
                    "rep": rep,
                    "epochs": epoch,
                    "batch": BATCH,
                    **measures(bnn, guide, x_test, y_test),
                    "wall_s": clock.wall,
                    "cpu_s": clock.cpu,
                    "curve": list(curve),
                }
            )
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| method | rep | epochs | test RMSE (sparse net) | test RMSE (BMA, 32 draws) "
        "| exact zeros | FPR | FNR | true inputs selected | noise inputs selected | CPU (s) "
        "| wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        true = ", ".join(f"x{i + 1}" for i in r["selected"] if i < TRUE_INPUTS)
        noise = round(r["fpr"] * (P - TRUE_INPUTS))
        lines.append(
            f"| {r['method']} | {r['rep']} | {r['epochs']} | {r['rmse']:.3f} | "
            f"{r['rmse_bma']:.3f} | {100 * r['zeros']:.2f}% | {r['fpr']:.3f} | {r['fnr']:.1f} | "
            f"{true} | {noise} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Test RMSE and exact zeros against epochs and against CPU time: the Gumbel runs as curves
    (their checkpoints marked), each sparsifying-QNVB run as one point at its end (its number of
    epochs fixes its schedule) and, for the longest, its per-epoch curve of the rounded network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"gumbel": "C0", "sparse": "C3"}
    final_gumbel = {}
    for r in results:
        if r["method"] == "gumbel":
            if r["epochs"] >= final_gumbel.get(r["rep"], {"epochs": 0})["epochs"]:
                final_gumbel[r["rep"]] = r
    for rep, r in final_gumbel.items():
        epochs, rmses, kept, _ = zip(*r["curve"])
        label = "gumbel (Adam), per epoch" if rep == min(final_gumbel) else None
        axes[0].plot(epochs, rmses, color=colors["gumbel"], alpha=0.6, label=label)
        axes[1].plot(epochs, [100 * (1 - k) for k in kept], color=colors["gumbel"], alpha=0.6)
    longest = max((r["epochs"] for r in results if r["method"] == "sparse"), default=None)
    for r in results:
        c = colors[r["method"]]
        marker = "o" if r["method"] == "sparse" else "s"
        label = None
        if r["rep"] == min(x["rep"] for x in results) and r["method"] == "sparse":
            label = f"sparse QNVB, {r['epochs']} epochs (end)"
        axes[0].scatter(r["epochs"], r["rmse"], color=c, marker=marker, zorder=3, label=label)
        axes[1].scatter(r["epochs"], 100 * r["zeros"], color=c, marker=marker, zorder=3)
        axes[2].scatter(r["cpu_s"], r["rmse"], color=c, marker=marker, zorder=3)
        if r["method"] == "sparse" and r["epochs"] == longest:
            epochs, rmses, kept, _ = zip(*r["curve"])
            axes[0].plot(epochs, rmses, color=c, ls="--", alpha=0.6)
            axes[1].plot(epochs, [100 * (1 - k) for k in kept], color=c, ls="--", alpha=0.6)
    axes[0].axhline(1.0, color="k", lw=0.8, ls=":", label="noise floor")
    axes[0].set(xlabel="epoch", ylabel="test RMSE (realized network)", xscale="log", ylim=(0.9, 4))
    axes[1].set(xlabel="epoch", ylabel="exact zeros (%)", xscale="log", ylim=(0, 100))
    axes[2].set(xlabel="CPU seconds (training loop)", ylabel="test RMSE (realized network)",
                xscale="log", ylim=(0.9, 4))  # fmt: skip
    axes[2].scatter([], [], color=colors["gumbel"], marker="s", label="gumbel checkpoints")
    axes[2].scatter([], [], color=colors["sparse"], marker="o", label="sparse QNVB runs")
    for ax in (axes[0], axes[2]):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--first-rep", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=["sparse", "gumbel"])
    parser.add_argument("--sparse-epochs", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--sparse-batch", type=int, default=32)
    parser.add_argument("--target-sparsity", type=float, default=0.9)
    parser.add_argument("--target-free", type=float, default=0.05)
    parser.add_argument("--tau-max", type=float, default=0.05)
    parser.add_argument(
        "--gumbel-epochs", type=int, nargs="+", default=[5, 10, 20, 50, 100, 200, 400, 800]
    )
    parser.add_argument("--json", default=None, help="append results (JSON lines) to this file")
    parser.add_argument("--plot", default=None, help="figure from every line of --json's file")
    args = parser.parse_args(argv)
    if min(args.sparse_epochs) < 3:
        parser.error(
            f"--sparse-epochs must be >= 3 (the sieve's schedule), got {args.sparse_epochs}"
        )
    torch.set_num_threads(1)
    results = []
    for rep in range(args.first_rep, args.first_rep + args.reps):
        runs = []
        if "sparse" in args.methods:
            runs += [run_sparse(rep, epochs, args) for epochs in args.sparse_epochs]
        if "gumbel" in args.methods:
            runs += run_gumbel(rep, sorted(args.gumbel_epochs))
        report(runs, results, args.json, table)
    summarize(results, args.json, args.plot, table, plot)
    return results


if __name__ == "__main__":
    main()
