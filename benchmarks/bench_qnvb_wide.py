"""Issue 11: making QNVB optimize the ELBO of the wide MNIST MLP (784-400-400-10, ReLU).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_qnvb_wide.py --part short --data-dir D
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_qnvb_wide.py --part full --data-dir D
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_qnvb_wide.py --part full --seed 1 --rows R
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_qnvb_wide.py --part regression
    python benchmarks/bench_qnvb_wide.py --report   # docs/benchmarks.md's tables, the figure

The data, network, minibatches (128), scoring and methods are those of ``bench_bnn_quality.py``'s
MNIST part (seed 0 unless ``--seed``, the 8,000 / 2,000 split, 8 posterior draws for the test
scores); a row is a method and its settings (:data:`ROWS`): a QNVB configuration a user can set
(the guide's ``init_scale``; ``QNVB``'s ``lr``, ``trust_region``, ``scale_max``, ``sigma_max``,
``significance``, ``recent_fraction``; a fan-in prior; likelihood annealing), or the Adam +
``Trace_ELBO`` (or IVON) baseline at its tuned learning rate.

``--part short``: the rows of :data:`SHORT_ROWS` for 3 epochs (186 gradient evaluations; QNVB: 62
steps of K = 3), scored at :data:`SHORT_GRID` by the test scores and by the model's ``-ELBO`` of
the guide (:func:`bench_bnn_quality.objective`: the expected log likelihood of the 8,000 training
images by :data:`CURVE_DRAWS` Monte Carlo draws, common to every row, plus the KL in closed form;
the rasp paper's eq. 1). ``--part full``: the rows of :data:`FULL_ROWS` for 10 epochs (620
evaluations, the grid of the full-length MNIST table), with the final ``-ELBO`` by
:data:`FINAL_DRAWS` draws and the seed of that table's objective (``--part objective-mnist``), so
the rows compare with its Adam, IVON and map rows, which are read from
``bnn_quality_mnist10.json`` and not rerun. ``--part regression``: the settings of
:data:`REGRESSION_SETTINGS` on the 2x128 regression cells, against ``bnn_quality_e3000.json``.
Every run is cached in ``benchmarks/results/bnn_quality_qnvb_wide.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pyro
import torch
from bench_bnn_quality import (
    SETTINGS,
    Cache,
    Trainer,
    eval_grid,
    mnist_net,
    mnist_task,
    objective,
    posterior_of,
    regression_net,
    regression_task,
    run,
)
from tqdm.auto import tqdm

from pyro_quadvi.nn import priors
from pyro_quadvi.optim.annealing import geometric_annealing

RESULTS = Path(__file__).parent / "results" / "bnn_quality_qnvb_wide.json"
MNIST10 = Path(__file__).parent / "results" / "bnn_quality_mnist10.json"
IMG = Path(__file__).parent.parent / "docs" / "img"
BATCH = 128
DRAWS = 8  # posterior draws for the test scores, as the MNIST table
SHORT_GRID = [3, 6, 15, 31, 62, 124, 186]  # 3 epochs of 62 minibatches
FULL_EVALS = 620  # 10 epochs
FULL_GRID_POINTS = 8
CURVE_DRAWS = 8  # draws of the expected log likelihood along the curves
FINAL_DRAWS = 16  # as --part objective-mnist
OBJECTIVE_SEED = 1000  # as --part objective-mnist
ADAM_LR = 3e-3  # tuned on the validation split of the 10-epoch runs (MNIST_LR_GRID["adam"])
IVON_LR = 1.0  # likewise (MNIST_LR_GRID["ivon"])
STEPS_PER_EPOCH = 62 // 3  # QNVB steps (K = 3) in one epoch

#: label -> (method, learning rate, the arguments of ``bench_bnn_quality.make_trainer``)
ROWS: dict[str, tuple[str, float | None, dict]] = {
    "adam": ("adam", ADAM_LR, {}),
    "qnvb": ("qnvb", None, {}),
    "qnvb trust 1": ("qnvb", None, {"qnvb_args": {"trust_region": 1.0}}),
    "qnvb trust 0.3": ("qnvb", None, {"qnvb_args": {"trust_region": 0.3}}),
    "qnvb init 0.03": ("qnvb", None, {"init_scale": 0.03}),
    "qnvb init 0.01": ("qnvb", None, {"init_scale": 0.01}),
    "qnvb init 0.01, trust 1": (
        "qnvb",
        None,
        {"init_scale": 0.01, "qnvb_args": {"trust_region": 1.0}},
    ),
    "qnvb trust 0.1": ("qnvb", None, {"qnvb_args": {"trust_region": 0.1}}),
    "qnvb init 0.03, trust 0.3": (
        "qnvb",
        None,
        {"init_scale": 0.03, "qnvb_args": {"trust_region": 0.3}},
    ),
    "qnvb init 0.01, trust 0.3": (
        "qnvb",
        None,
        {"init_scale": 0.01, "qnvb_args": {"trust_region": 0.3}},
    ),
    "qnvb trust 0.3, annealing 0.01 over 1 epoch": (
        "qnvb",
        None,
        {
            "anneal": True,
            "qnvb_args": {
                "trust_region": 0.3,
                "annealing": geometric_annealing(0.01, num_steps=STEPS_PER_EPOCH),
            },
        },
    ),
    "qnvb trust 0.3, sigma_max 0.3": (
        "qnvb",
        None,
        {"qnvb_args": {"trust_region": 0.3, "sigma_max": 0.3}},
    ),
    "qnvb trust 0.3, sigma_max 0.1": (
        "qnvb",
        None,
        {"qnvb_args": {"trust_region": 0.3, "sigma_max": 0.1}},
    ),
    "qnvb trust 0.3, scale_max 2": (
        "qnvb",
        None,
        {"qnvb_args": {"trust_region": 0.3, "scale_max": 2.0}},
    ),
    "qnvb init 0.03, trust 0.3, scale_max 2": (
        "qnvb",
        None,
        {"init_scale": 0.03, "qnvb_args": {"trust_region": 0.3, "scale_max": 2.0}},
    ),
    "qnvb trust 1, scale_max 2": (
        "qnvb",
        None,
        {"qnvb_args": {"trust_region": 1.0, "scale_max": 2.0}},
    ),
    "qnvb trust 0.3, scale_max 2, significance 1": (
        "qnvb",
        None,
        {"qnvb_args": {"trust_region": 0.3, "scale_max": 2.0, "significance": 1.0}},
    ),
    "qnvb init 0.03, trust 0.3, scale_max 2, significance 1": (
        "qnvb",
        None,
        {
            "init_scale": 0.03,
            "qnvb_args": {"trust_region": 0.3, "scale_max": 2.0, "significance": 1.0},
        },
    ),
    "qnvb trust 0.3, recent_fraction 0.5": (
        "qnvb",
        None,
        {"qnvb_args": {"trust_region": 0.3, "recent_fraction": 0.5}},
    ),
    "qnvb trust 0.3, significance 1": (
        "qnvb",
        None,
        {"qnvb_args": {"trust_region": 0.3, "significance": 1.0}},
    ),
    "qnvb lr 0.03": ("qnvb", None, {"qnvb_args": {"lr": 0.03}}),
    "qnvb lr 0.01": ("qnvb", None, {"qnvb_args": {"lr": 0.01}}),
    "qnvb lr 0.003": ("qnvb", None, {"qnvb_args": {"lr": 0.003}}),
    "qnvb trust 1, annealing 0.01 over 1 epoch": (
        "qnvb",
        None,
        {
            "anneal": True,
            "qnvb_args": {
                "trust_region": 1.0,
                "annealing": geometric_annealing(0.01, num_steps=STEPS_PER_EPOCH),
            },
        },
    ),
    "qnvb trust 1, radford prior": (
        "qnvb",
        None,
        {"prior": priors.LayerwiseNormal("radford"), "qnvb_args": {"trust_region": 1.0}},
    ),
    "qnvb trust 1, kaiming prior": (
        "qnvb",
        None,
        {"prior": priors.LayerwiseNormal("kaiming"), "qnvb_args": {"trust_region": 1.0}},
    ),
    "adam, radford prior": ("adam", ADAM_LR, {"prior": priors.LayerwiseNormal("radford")}),
    "adam, kaiming prior": ("adam", ADAM_LR, {"prior": priors.LayerwiseNormal("kaiming")}),
    "ivon": ("ivon", IVON_LR, {}),
    "ivon, radford prior": ("ivon", IVON_LR, {"prior": priors.LayerwiseNormal("radford")}),
}


#: the rows of ``--part short`` (default): the candidates
SHORT_ROWS = [
    "adam",
    "qnvb",
    "qnvb trust 1",
    "qnvb trust 0.3",
    "qnvb init 0.03",
    "qnvb init 0.01",
    "qnvb init 0.01, trust 1",
    "qnvb trust 0.1",
    "qnvb init 0.03, trust 0.3",
    "qnvb init 0.01, trust 0.3",
    "qnvb trust 0.3, annealing 0.01 over 1 epoch",
    "qnvb trust 0.3, scale_max 2",
    "qnvb trust 0.3, scale_max 2, significance 1",
    "qnvb lr 0.03",
    "qnvb lr 0.01",
    "qnvb lr 0.003",
    "qnvb trust 1, annealing 0.01 over 1 epoch",
    "qnvb trust 1, radford prior",
    "qnvb trust 1, kaiming prior",
    "adam, radford prior",
    "adam, kaiming prior",
    "ivon",
    "ivon, radford prior",
]

#: the rows of ``--part full`` (default): the best of the short runs, and variants against the
#: late rise of the ``-ELBO`` they showed
FULL_ROWS = [
    "adam",
    "qnvb trust 0.3",
    "qnvb trust 0.1",
    "qnvb trust 0.3, annealing 0.01 over 1 epoch",
    "qnvb trust 0.3, sigma_max 0.3",
    "qnvb trust 0.3, sigma_max 0.1",
    "qnvb trust 0.3, scale_max 2",
    "qnvb init 0.03, trust 0.3, scale_max 2",
    "qnvb trust 1, scale_max 2",
    "qnvb trust 0.3, scale_max 2, significance 1",
    "qnvb init 0.03, trust 0.3, scale_max 2, significance 1",
    "qnvb trust 0.3, recent_fraction 0.5",
    "qnvb trust 0.3, significance 1",
]


def neg_elbo(task, prior, draws: int, seed: int) -> Callable[[Trainer], dict[str, float]]:
    """``trainer -> {"neg_elbo", "neg_ell", "kl"}`` of its guide under the row's prior."""

    def score(trainer: Trainer) -> dict[str, float]:
        # the net built here draws its initialization from the global generator: restore it, so
        # that a Monte Carlo method (Adam, IVON) trains as it would without this score
        with torch.random.fork_rng():
            out = objective(
                task, mnist_net("mlp"), posterior_of(trainer), draws, seed, chunk=4, prior=prior
            )
        return {key: out[key] for key in ("neg_elbo", "neg_ell", "kl", "sd_median")}

    return score


def run_row(label: str, task, grid: list[int], final_draws: int | None, seed: int = 0) -> dict:
    """Train row ``label`` to ``grid[-1]`` evaluations from ``seed`` (the net's initialization,
    the minibatches, the Monte Carlo draws), with the ``-ELBO`` at every grid point (and by
    ``final_draws`` draws at the end)."""
    method, lr, extra = ROWS[label]
    extra = dict(extra)
    prior = extra.get("prior")
    keep: list[Trainer] = []
    more = neg_elbo(task, prior, CURVE_DRAWS, OBJECTIVE_SEED)
    result = run(
        method,
        task,
        partial(mnist_net, "mlp"),
        lr,
        grid,
        DRAWS,
        seed=seed,
        keep=keep,
        more_scores=more,
        **extra,
    )
    if final_draws is not None:
        result["objective"] = objective(
            task, mnist_net("mlp"), posterior_of(keep[0]), final_draws, OBJECTIVE_SEED, 4, prior
        )
    return result


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def part(cache: Cache, kind: str, labels: list[str], data_dir: str | None, seed: int = 0) -> None:
    """Run the rows ``labels`` of ``kind`` ("short", "full") from ``seed``; seed 0 under the key
    ``kind/label``, another under ``seed<seed>/kind/label``."""
    task = mnist_task(data_dir, BATCH)
    grid = SHORT_GRID if kind == "short" else eval_grid(FULL_EVALS, FULL_GRID_POINTS)
    bar = tqdm(total=len(labels), desc=kind)
    for label in labels:
        key = f"{kind}/{label}" if seed == 0 else f"seed{seed}/{kind}/{label}"
        if key not in cache.data:
            bar.set_description(key)
            before = load_average()
            final = FINAL_DRAWS if kind == "full" else None
            result = run_row(label, task, grid, final, seed)
            result["load_average"] = [before, load_average()]
            cache.put(key, result)
        bar.update()
    bar.close()


#: ``--part regression``: the recommended settings on the 2x128 regression cells of
#: ``bnn_quality_e3000.json`` (3,000 evaluations, its grid and draws), splits 0-3, against that
#: file's ``qnvb-trust1`` and ``adam`` rows (not rerun)
REGRESSION_SETTINGS = {
    "qnvb-trust0.3-smax2": {"trust_region": 0.3, "scale_max": 2.0},
    "qnvb-trust0.3-smax2-sig1": {"trust_region": 0.3, "scale_max": 2.0, "significance": 1.0},
}
REGRESSION_CELLS = ("diabetes", "boston", "concrete")
REGRESSION_SPLITS = 4
E3000 = Path(__file__).parent / "results" / "bnn_quality_e3000.json"


def part_regression(cache: Cache) -> None:
    s = SETTINGS["full"]
    grid = eval_grid(3000, s["grid_points"])
    total = len(REGRESSION_SETTINGS) * len(REGRESSION_CELLS) * REGRESSION_SPLITS
    bar = tqdm(total=total, desc="regression")
    for name in REGRESSION_CELLS:
        for split in range(REGRESSION_SPLITS):
            task = regression_task(name, split)
            make = partial(regression_net, task.x_train.shape[1], "2x128")
            for label, qnvb_args in REGRESSION_SETTINGS.items():
                key = f"regression/{name}/2x128/{label}/split{split}"
                args = ("qnvb", task, make, None, grid, s["draws"])
                cache.get_or_run(key, bar, run, *args, seed=split, qnvb_args=qnvb_args)
    bar.close()


# ----------------------------------------------------------------------------- the report


def fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1e6 else f"{value:,.0f}"


def report(data: dict) -> str:
    lines = []
    short = {key[6:]: value for key, value in data.items() if key.startswith("short/")}
    if short:
        points = [3, 31, 62, 124, 186]
        head = " | ".join(f"-ELBO at {e}" for e in points)
        lines += [
            f"| row | {head} | test NLL at 186 | peak test NLL (at evals) | accuracy at 186 "
            "| sd median | CPU s | load |",
            "|---|" + "---:|" * (len(points) + 5) + "---|",
        ]
        for label, r in short.items():
            curve = r["curve"]
            at = dict(zip(curve["evals"], curve["neg_elbo"], strict=True))
            # a QNVB step costs 3: the last point at or before each evaluation count
            cells = []
            for e in points:
                done = [x for x in curve["evals"] if x <= e]
                cells.append(fmt(at[done[-1]]) if done else "-")
            peak = max(range(len(curve["nll"])), key=lambda i: curve["nll"][i])
            lines.append(
                f"| {label} | {' | '.join(cells)} | {r['final']['nll']:.3f} "
                f"| {curve['nll'][peak]:.2f} ({curve['evals'][peak]}) "
                f"| {r['final']['accuracy']:.4f} | {r['final']['sd_median']:.3g} "
                f"| {r['cpu_s']:.0f} | {r['load_average'][0]} / {r['load_average'][1]} |"
            )
    full = {key[5:]: value for key, value in data.items() if key.startswith("full/")}
    if full:
        lines += [
            "",
            "| method | lr | evals | accuracy | NLL | ECE | Brier | -ELBO | -E log lik | KL "
            "| best NLL (at evals) | CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        old = json.loads(MNIST10.read_text())
        objective_old = old["objective/mnist/mlp/split0"]
        rows = [
            (f"{m} (`bnn_quality_mnist10.json`)", old[f"mnist/mlp/{m}"], objective_old.get(m))
            for m in ("adam", "ivon", "map", "qnvb", "qnvb-trust1")
        ]
        rows += [(label, r, r["objective"]) for label, r in full.items()]
        for label, r, obj in rows:
            f, curve = r["final"], r["curve"]
            best = min(range(len(curve["nll"])), key=lambda i: curve["nll"][i])
            lr = "-" if r["lr"] is None else f"{r['lr']:g}"
            elbo = (
                " | ".join(fmt(obj[k]) for k in ("neg_elbo", "neg_ell", "kl"))
                if obj
                else "- | - | -"
            )
            lines.append(
                f"| {label} | {lr} | {curve['evals'][-1]} | {f['accuracy']:.4f} | {f['nll']:.4f} "
                f"| {f['ece']:.4f} | {f['brier']:.4f} | {elbo} "
                f"| {curve['nll'][best]:.4f} ({curve['evals'][best]}) | {r['cpu_s']:.0f} |"
            )
    if "adam" in full:
        evals = full["adam"]["curve"]["evals"]
        lines += [
            "",
            "| -ELBO at evaluations (8 draws) | " + " | ".join(str(e) for e in evals) + " |",
            "|---|" + "---:|" * len(evals),
        ]
        for label, r in full.items():
            curve = r["curve"]
            cells = []
            for e in evals:  # QNVB: its last point at or before Adam's (a step costs 3)
                done = [i for i, x in enumerate(curve["evals"]) if x <= e]
                cells.append(fmt(curve["neg_elbo"][done[-1]]) if done else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    seeds = sorted({int(key.split("/")[0][4:]) for key in data if key.startswith("seed")})
    if seeds:
        labels = [key[len(f"seed{seeds[0]}/full/") :] for key in data if key.startswith("seed")]
        labels = list(dict.fromkeys(labels))
        head = " | ".join(f"seed {s}: NLL / ECE / -ELBO" for s in [0, *seeds])
        lines += ["", f"| ten epochs | {head} |", "|---|" + "---:|" * (len(seeds) + 1)]
        for label in labels:
            cells = []
            for s in [0, *seeds]:
                r = data.get(f"full/{label}" if s == 0 else f"seed{s}/full/{label}")
                if r is None:
                    cells.append("-")
                    continue
                cells.append(
                    f"{r['final']['nll']:.4f} / {r['final']['ece']:.4f} "
                    f"/ {fmt(r['objective']['neg_elbo'])}"
                )
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    regression = [key for key in data if key.startswith("regression/")]
    if regression:
        old = json.loads(E3000.read_text())
        lines += [
            "",
            f"| cell (2x128, splits 0-{REGRESSION_SPLITS - 1}) | method | test NLL | -ELBO "
            "| worst test NLL on the way | CPU s |",
            "|---|---|---:|---:|---:|---:|",
        ]
        methods = ("qnvb", "qnvb-trust1", "adam", "ivon", *REGRESSION_SETTINGS)
        for name in REGRESSION_CELLS:
            for method in methods:
                source = data if method in REGRESSION_SETTINGS else old
                runs = [
                    source[f"regression/{name}/2x128/{method}/split{i}"]
                    for i in range(REGRESSION_SPLITS)
                ]
                nll = sum(r["final"]["nll"] for r in runs) / len(runs)
                elbo = [r.get("neg_elbo") for r in runs]
                elbo = "-" if None in elbo else f"{sum(elbo) / len(elbo):,.1f}"
                worst = max(max(r["curve"]["nll"]) for r in runs)
                cpu = sum(r["cpu_s"] for r in runs)
                lines.append(
                    f"| {name} | {method} | {nll:.3f} | {elbo} | {worst:.1f} | {cpu:.0f} |"
                )
    return "\n".join(lines)


def figure(data: dict, path: Path, labels: list[str]) -> None:
    """Test NLL and ``-ELBO`` against gradient evaluations of the 10-epoch runs ``labels``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label in labels:
        curve = data[f"full/{label}"]["curve"]
        for ax, key in zip(axes, ("neg_elbo", "nll"), strict=True):
            ax.plot(curve["evals"], curve[key], marker="o", ms=3, label=label)
    for ax, title in zip(axes, ("-ELBO (8 draws)", "test NLL (8 draws)"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("gradient evaluations")
        ax.set_title(title)
    axes[1].legend(fontsize=7)
    fig.suptitle("MNIST MLP 784-400-400-10, prior N(0, 1), seed 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURE_ROWS = [
    "adam",
    "qnvb trust 0.3",
    "qnvb trust 0.3, scale_max 2",
    "qnvb trust 0.3, scale_max 2, significance 1",
    "qnvb trust 0.3, sigma_max 0.1",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("short", "full", "regression"), default="short")
    parser.add_argument(
        "--rows", nargs="+", choices=sorted(ROWS), help="default: SHORT_ROWS / FULL_ROWS"
    )
    parser.add_argument("--seed", type=int, default=0, help="initialization and minibatches")
    parser.add_argument("--report", action="store_true", help="markdown from the JSON")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--data-dir", help="the MNIST directory (default: $PYRO_QUADVI_DATA/mnist-t10k)"
    )
    options = parser.parse_args(argv)
    cache = Cache(options.results)
    if options.report:
        print(report(cache.data))
        if all(f"full/{label}" in cache.data for label in FIGURE_ROWS):
            figure(cache.data, IMG / "bnn_qnvb_wide.png", FIGURE_ROWS)
        return
    torch.set_num_threads(1)
    pyro.enable_validation(False)  # as bench_bnn_quality.py
    if options.part == "regression":
        part_regression(cache)
        return
    default = SHORT_ROWS if options.part == "short" else FULL_ROWS
    part(cache, options.part, options.rows or default, options.data_dir, options.seed)


if __name__ == "__main__":
    main()
