"""The sparse-VI paper's experiment (issue 12): sparse nonlinear regression with 200 inputs.

    OMP_NUM_THREADS=1 python benchmarks/bench_spike_slab.py --epochs 7000 --reps 5 \
        --json spike_slab.json --plot docs/img/spike_slab_benchmark.png

Data as in Bai, Song and Cheng: ``x ~ U(-1, 1)^200``, ``y = 7 x2 / (1 + x1^2) + 5 sin(x3 x4) +
2 x5 + N(0, 1)``, 3,000 training and 10,000 test rows, drawn anew for each replication (seed =
replication). Network: 200-7-7-7-1 ReLU (1,527 weights and biases, all latent), Gaussian
likelihood with known noise scale 1, minibatches of 512 (an epoch is a reshuffled pass: 5 of 512
and one of 440), Adam at lr 5e-3 over all guide parameters (``torch.optim.Adam`` on the
ELBO's ``differentiable_loss``). Three methods:

- **gumbel**: ``AutoSpikeSlab`` + ``GumbelSpikeSlabELBO(temperature=0.5)`` (the paper's method),
  prior ``priors.SpikeSlab(lambda, 1.3)`` with the theorem's ``lambda``
  (:func:`~pyro_quadvi.nn.priors.theorem_inclusion`, about 1.2e-4);
- **quadrature**: the same guide and prior with ``QuadratureELBO()`` (blocked simplex, 3 nodes);
- **dense**: ``AutoMeanFieldNormal`` with a ``priors.Normal(1.3)`` prior and ``QuadratureELBO()``.

The spike-and-slab guide starts as in the paper: slab means ``U(-0.6, 0.6)``
(``init_to_uniform(radius=0.6)``), slab scales 2.5e-3, inclusion 0.99; the dense guide from the
same means and scales.

Measures, per replication: test RMSE of the realized network (``sparse_network`` at threshold
0.5; for dense, the network at the guide's means) and of the Bayesian model average over 32
guide draws (``bnn.predict``); the fraction of weights kept (inclusion > 0.5); the false-positive
and false-negative rates of input selection on the 5 true inputs (an input is selected if any of
its first-layer weights is kept); wall and CPU time of the training loop (evaluations
included). Every ``--eval-every`` epochs the run records the test RMSE of the realized network,
the kept fraction and the mean training loss (the curves).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import pyro
import torch
from pyro.infer.autoguide import init_to_uniform
from torch import nn
from tqdm.auto import tqdm

from pyro_quadvi import AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.infer import GumbelSpikeSlabELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors, sparse_network
from pyro_quadvi.testing.sparse_regression import TRUE_INPUTS, sparse_regression_data

N_TRAIN, N_TEST, P, WIDTH, HIDDEN, BATCH = 3000, 10_000, 200, 7, 3, 512
SLAB_SCALE, INIT_RADIUS, INIT_SCALE, INIT_INCLUSION, LR = 1.3, 0.6, 2.5e-3, 0.99, 5e-3
METHODS = ("gumbel", "quadrature", "dense")


def make_net() -> nn.Sequential:
    layers, width_in = [], P
    for _ in range(HIDDEN):
        layers += [nn.Linear(width_in, WIDTH), nn.ReLU()]
        width_in = WIDTH
    return nn.Sequential(*layers, nn.Linear(width_in, 1))


def build(method: str, x: torch.Tensor, y: torch.Tensor):
    net = make_net()
    num_params = sum(p.numel() for p in net.parameters())
    likelihood = likelihoods.Gaussian(dataset_size=N_TRAIN, scale=1.0)
    init = init_to_uniform(radius=INIT_RADIUS)
    if method == "dense":
        bnn = BayesianModule(net, priors.Normal(SLAB_SCALE), likelihood)
        guide = AutoMeanFieldNormal(bnn, init_loc_fn=init, init_scale=INIT_SCALE)
        elbo = QuadratureELBO()
    else:
        inclusion = priors.theorem_inclusion(num_params, HIDDEN, WIDTH, N_TRAIN, P)
        bnn = BayesianModule(net, priors.SpikeSlab(inclusion, SLAB_SCALE), likelihood)
        guide = AutoSpikeSlab(
            bnn, init_loc_fn=init, init_scale=INIT_SCALE, init_inclusion=INIT_INCLUSION
        )
        elbo = GumbelSpikeSlabELBO(temperature=0.5) if method == "gumbel" else QuadratureELBO()
    guide(x[:BATCH], y[:BATCH])  # set up the guide's parameters
    return bnn, guide, elbo


def realized(bnn, guide, method: str):
    """The deterministic network and its first-layer keep mask (out x in)."""
    if method == "dense":
        net = make_net()
        medians = guide.median()
        with torch.no_grad():
            for name, param in net.named_parameters():
                param.copy_(medians[name].reshape(param.shape))
        return net.eval(), torch.ones(WIDTH, P, dtype=torch.bool)
    sparse = sparse_network(bnn, guide)
    return sparse.net, guide.inclusion_probs()["0.weight"] > 0.5


def rmse(net, x, y) -> float:
    with torch.no_grad():
        return float(((net(x).squeeze(-1) - y) ** 2).mean().sqrt())


def kept_fraction(guide, method: str) -> float:
    if method == "dense":
        return 1.0
    probs = torch.cat([p.reshape(-1) for p in guide.inclusion_probs().values()])
    return float((probs > 0.5).double().mean())


def run(method: str, rep: int, epochs: int, eval_every: int, progress: bool) -> dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(rep)
    x, y, x_test, y_test = sparse_regression_data(N_TRAIN, N_TEST, P, seed=rep)
    bnn, guide, elbo = build(method, x, y)
    optimizer = torch.optim.Adam(guide.parameters(), lr=LR)
    curve = []
    start, cpu_start = time.perf_counter(), time.process_time()
    bar = tqdm(range(1, epochs + 1), desc=f"{method} rep {rep}", disable=not progress)
    for epoch in bar:
        order = torch.randperm(N_TRAIN)
        total = 0.0
        for i in range(0, N_TRAIN, BATCH):
            rows = order[i : i + BATCH]
            loss = elbo.differentiable_loss(bnn, guide, x[rows], y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(rows) / N_TRAIN
        if epoch % eval_every == 0 or epoch == epochs:
            net, _ = realized(bnn, guide, method)
            point = (epoch, rmse(net, x_test, y_test), kept_fraction(guide, method), total)
            curve.append(point)
            bar.set_postfix(rmse=f"{point[1]:.3f}", kept=f"{point[2]:.4f}", refresh=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    net, first = realized(bnn, guide, method)
    selected = first.any(0)
    bma = bnn.predict(guide, x_test, num_samples=32).mean.squeeze(-1)
    return {
        "method": method,
        "rep": rep,
        "epochs": epochs,
        "rmse": rmse(net, x_test, y_test),
        "rmse_bma": float(((bma - y_test) ** 2).mean().sqrt()),
        "kept": kept_fraction(guide, method),
        "fnr": float((~selected[:TRUE_INPUTS]).double().mean()),
        "fpr": float(selected[TRUE_INPUTS:].double().mean()),
        "selected": selected.nonzero().flatten().tolist()[:20],
        "wall_s": wall,
        "cpu_s": cpu,
        "curve": curve,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| method | rep | epochs | test RMSE (sparse net) | test RMSE (BMA, 32 draws) | kept | FPR "
        "| FNR | true inputs selected | noise inputs selected | CPU (s) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        true = ", ".join(f"x{i + 1}" for i in r["selected"] if i < TRUE_INPUTS)
        noise = round(r["fpr"] * (P - TRUE_INPUTS))
        cpu = f"{r['cpu_s']:.0f}" if "cpu_s" in r else "-"
        lines.append(
            f"| {r['method']} | {r['rep']} | {r['epochs']} | {r['rmse']:.3f} | "
            f"{r['rmse_bma']:.3f} | {100 * r['kept']:.2f}% | {r['fpr']:.3f} | {r['fnr']:.1f} | "
            f"{true} | {noise} | {cpu} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {"gumbel": "C0", "quadrature": "C1", "dense": "C2"}
    for r in results:
        epochs, rmses, kept, losses = zip(*r["curve"])
        label = r["method"] if r["rep"] == 0 else None
        c = colors[r["method"]]
        axes[0].plot(epochs, rmses, color=c, alpha=0.7, label=label)
        axes[1].plot(epochs, [100 * k for k in kept], color=c, alpha=0.7, label=label)
        axes[2].plot(epochs, losses, color=c, alpha=0.7, label=label)
    axes[0].axhline(1.0, color="k", lw=0.8, ls="--", label="noise floor")
    axes[0].set(xlabel="epoch", ylabel="test RMSE (realized network)", ylim=(0.9, 3.0))
    axes[1].set(xlabel="epoch", ylabel="weights kept (%)", yscale="log")
    axes[2].set(xlabel="epoch", ylabel="negative ELBO (epoch mean)", yscale="log")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(
    runs: list[dict], results: list[dict], json_path: str | None, table: Callable[[list[dict]], str]
) -> None:
    """Prints each of ``runs`` as the last row of ``table([run])`` (a benchmark's table), appends
    it to ``json_path`` (JSON lines) when given, and adds it to ``results``."""
    for result in runs:
        print(table([result]).splitlines()[-1], flush=True)
        if json_path:
            with open(json_path, "a") as f:
                f.write(json.dumps(result) + "\n")
    results += runs


def summarize(
    results: list[dict],
    json_path: str | None,
    plot_path: str | None,
    table: Callable[[list[dict]], str],
    plot: Callable[[list[dict], str], None],
) -> None:
    """With ``plot_path`` and ``json_path``: the figure ``plot(runs, plot_path)`` and the table of
    the runs on every line of the JSON file (all so far, not only this call's); otherwise the
    table of ``results``."""
    if plot_path and json_path:
        with open(json_path) as f:
            everything = [json.loads(line) for line in f]
        plot(everything, plot_path)
        print(table(everything))
    elif results:
        print(table(results))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=7000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--first-rep", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--json", default=None, help="append results (JSON lines) to this file")
    parser.add_argument("--plot", default=None, help="figure of the curves, from --json's file")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    methods = [m for m in args.methods.split(",") if m]
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for method in methods:
            if method not in METHODS:
                raise SystemExit(f"unknown method {method!r}; choose from {METHODS}")
            result = run(method, rep, args.epochs, args.eval_every, not args.no_progress)
            report([result], results, args.json, table)
    summarize(results, args.json, args.plot, table, plot)
    return results


if __name__ == "__main__":
    main()
