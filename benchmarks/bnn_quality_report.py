"""Tables and figures of ``bench_bnn_quality.py`` from its JSON (``--report``).

Only reads the cached runs: nothing here trains. The markdown goes to stdout (pasted into
``docs/benchmarks.md``), the figures to ``docs/img/bnn_quality_*.png``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pyro_quadvi.testing.datasets import regression_split

METHODS = ("qnvb", "adam", "ivon")
LABELS = {
    "qnvb": "QNVB + QuadratureELBO (defaults)",
    "adam": "Adam + Trace_ELBO (tuned lr)",
    "ivon": "IVON (tuned lr)",
    "map": "deterministic net, Adam",
    "qnvb-lr0.1": "QNVB lr=0.1 (else defaults) + QuadratureELBO",
}
PROPOSED = "qnvb-lr0.1"


def _runs(data: dict, prefix: str) -> list[dict]:
    """The runs ``prefix/split0``, ``prefix/split1``, ... in split order."""
    runs, split = [], 0
    while f"{prefix}/split{split}" in data:
        runs.append(data[f"{prefix}/split{split}"])
        split += 1
    return runs


def _mean_sd(values: list[float]) -> str:
    a = np.asarray(values, dtype=float)
    if len(a) == 1:
        return f"{a[0]:.3f}"
    return f"{a.mean():.3f} ± {a.std(ddof=1):.3f}"


def mean_curve(runs: list[dict], key: str = "nll") -> tuple[np.ndarray, np.ndarray]:
    """Evaluation counts and the mean over runs of a score (runs share the grid)."""
    evals = np.asarray(runs[0]["curve"]["evals"])
    values = np.mean([run["curve"][key] for run in runs], axis=0)
    return evals, values


def first_reaching(evals: np.ndarray, values: np.ndarray, target: float) -> int | None:
    """The first evaluation count whose value is at most ``target`` (None: never)."""
    hit = np.nonzero(values <= target + 1e-12)[0]
    return int(evals[hit[0]]) if len(hit) else None


def goal_row(runs: dict[str, list[dict]], qnvb: str = "qnvb") -> dict:
    """Issue 11's goal on the mean test-NLL curves: QNVB at Adam's best NLL in <= 1/3 of its
    evaluations, and QNVB's final NLL and ECE (where scored) no worse than IVON's."""
    e_adam, nll_adam = mean_curve(runs["adam"])
    best = int(np.argmin(nll_adam))
    e_qnvb, nll_qnvb = mean_curve(runs[qnvb])
    reach = first_reaching(e_qnvb, nll_qnvb, nll_adam[best])
    final = {m: float(np.mean([r["final"]["nll"] for r in runs[m]])) for m in runs}
    row = {
        "adam_best": float(nll_adam[best]),
        "adam_at": int(e_adam[best]),
        "qnvb_reach": reach,
        "speed_met": reach is not None and reach <= e_adam[best] / 3,
        "nll_met": final[qnvb] <= final["ivon"],
        "final": final,
    }
    if "ece" in runs[qnvb][0]["final"]:
        ece = {m: float(np.mean([r["final"]["ece"] for r in runs[m]])) for m in runs}
        row["ece_met"] = ece[qnvb] <= ece["ivon"]
    return row


def _yes(flag: bool) -> str:
    return "met" if flag else "**missed**"


def regression_tables(data: dict) -> tuple[list[str], list[tuple]]:
    cells = sorted({tuple(k.split("/")[1:3]) for k in data if k.startswith("regression/")})
    order = {"diabetes": 0, "boston": 1, "concrete": 2}
    cells.sort(key=lambda c: (order.get(c[0], 9), c[1]))
    lines = [
        "| data | net | method | lr | test RMSE | test NLL | best mean NLL (at evals) | "
        "CPU s/run |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    goals = [
        "| data | net | QNVB | Adam's best mean NLL (at evals) | QNVB reaches it at | <= 1/3? | "
        "final NLL QNVB / IVON | QNVB NLL <= IVON? |",
        "|---|---|---|---:|---:|---|---:|---|",
    ]
    curves = []
    for name, net in cells:
        runs = {m: _runs(data, f"regression/{name}/{net}/{m}") for m in (*METHODS, PROPOSED)}
        if not runs[PROPOSED]:
            del runs[PROPOSED]
        if not all(runs.values()):
            continue
        for method in runs:
            rs = runs[method]
            e, v = mean_curve(rs)
            b = int(np.argmin(v))
            lr = rs[0]["lr"]
            lines.append(
                f"| {name} | {net} | {method} | {'-' if lr is None else f'{lr:g}'} | "
                f"{_mean_sd([r['final']['rmse'] for r in rs])} | "
                f"{_mean_sd([r['final']['nll'] for r in rs])} | {v[b]:.3f} ({e[b]}) | "
                f"{np.mean([r['cpu_s'] for r in rs]):.1f} |"
            )
        for qnvb in ("qnvb", PROPOSED):
            if qnvb not in runs:
                continue
            g = goal_row(runs, qnvb)
            reach = "never" if g["qnvb_reach"] is None else str(g["qnvb_reach"])
            goals.append(
                f"| {name} | {net} | {'defaults' if qnvb == 'qnvb' else 'lr 0.1'} | "
                f"{g['adam_best']:.3f} ({g['adam_at']}) | {reach} | {_yes(g['speed_met'])} | "
                f"{g['final'][qnvb]:.3f} / {g['final']['ivon']:.3f} | {_yes(g['nll_met'])} |"
            )
        curves.append((name, net, runs))
    splits = len(curves[0][2]["qnvb"]) if curves else 0
    head = [f"Mean ± sd over {splits} splits, scores after the whole budget:", ""]
    return head + lines + ["", "The goal, on the mean test-NLL curves:", ""] + goals, curves


def tuning_table(data: dict) -> list[str]:
    keys = sorted(k for k in data if k.startswith("tune/"))
    cells: dict[tuple, dict] = {}
    for key in keys:
        _, name, net, method, lr = key.split("/")
        cells.setdefault((name, net, method), {})[float(lr[3:])] = data[key]["final"]["nll"]
    lines = [
        "| data | net | method | validation NLL at each lr (chosen in bold) |",
        "|---|---|---|---|",
    ]
    for (name, net, method), by_lr in cells.items():
        best = min(by_lr, key=lambda lr: by_lr[lr] if math.isfinite(by_lr[lr]) else math.inf)
        parts = [
            (f"**{lr:g}: {v:.3f}**" if lr == best else f"{lr:g}: {v:.3f}")
            for lr, v in sorted(by_lr.items())
        ]
        lines.append(f"| {name} | {net} | {method} | {', '.join(parts)} |")
    return lines


def mnist_table(data: dict) -> tuple[list[str], list[tuple]]:
    lines = [
        "| net | method | lr | evals | accuracy | NLL | ECE | Brier | best NLL (at evals) | "
        "CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    goals, curves = [], []
    for net in ("mlp", "cnn"):
        runs = {m: data.get(f"mnist/{net}/{m}") for m in (*METHODS, "map", PROPOSED)}
        if runs[PROPOSED] is None:
            del runs[PROPOSED]
        if not all(runs.values()):
            continue
        for method, r in runs.items():
            f, c = r["final"], r["curve"]
            b = int(np.argmin(c["nll"]))
            lr = r["lr"]
            lines.append(
                f"| {net} | {method} | {'-' if lr is None else f'{lr:g}'} | {c['evals'][-1]} | "
                f"{f['accuracy']:.4f} | {f['nll']:.4f} | {f['ece']:.4f} | {f['brier']:.4f} | "
                f"{c['nll'][b]:.4f} ({c['evals'][b]}) | {r['cpu_s']:.0f} |"
            )
        for qnvb in ("qnvb", PROPOSED):
            if qnvb not in runs:
                continue
            g = goal_row({m: [runs[m]] for m in runs}, qnvb)
            reach = "never" if g["qnvb_reach"] is None else str(g["qnvb_reach"])
            goals.append(
                f"| {net} | {'defaults' if qnvb == 'qnvb' else 'lr 0.1'} | "
                f"{g['adam_best']:.4f} ({g['adam_at']}) | {reach} | {_yes(g['speed_met'])} | "
                f"{_yes(g['nll_met'])} | {_yes(g['ece_met'])} |"
            )
        curves.append((net, runs))
    goals = [
        "| net | QNVB | Adam's best NLL (at evals) | QNVB reaches it at | <= 1/3? | "
        "NLL <= IVON? | ECE <= IVON? |",
        "|---|---|---:|---:|---|---|---|",
        *goals,
    ]
    return [*lines, "", *goals], curves


def _column(runs: list[dict], key: str) -> str:
    """Mean ± sd of a recorded diagnostic, or "-" where the runs did not record it."""
    values = [run[key] for run in runs if key in run]
    return _mean_sd(values) if len(values) == len(runs) else "-"


def diagnose_table(data: dict) -> list[str]:
    labels = []
    for key in data:
        if key.startswith("diagnose/"):
            label = key.split("/")[1]
            if label not in labels:
                labels.append(label)
    lines = [
        "| run (diabetes, 1x50) | splits | test NLL | test NLL, standardized | best mean NLL "
        "(at evals) | worst mean NLL (at evals) | first at <= adam tuned's best | -ELBO (64 "
        "draws) | noise median | weight sd median | train RMSE (std.) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {
        "qnvb (main table, 1,000 evals)": "regression/diabetes/1x50/qnvb",
        "adam tuned (main table, 1,000 evals)": "regression/diabetes/1x50/adam",
    }
    rows = [(label, _runs(data, prefix)) for label, prefix in base.items()]
    rows += [(label, _runs(data, f"diagnose/{label}")) for label in labels]
    # every row over the same splits: those all the controlled runs have
    num = min((len(runs) for label, runs in rows if label in labels and runs), default=0)
    rows = [(label, runs[:num]) for label, runs in rows if runs]
    target = min(mean_curve(runs)[1].min() for label, runs in rows if label == "adam tuned")
    for label, runs in rows:
        if not runs:
            continue
        e, v = mean_curve(runs)
        b, w = int(np.argmin(v)), int(np.argmax(v))
        nll = [r["final"]["nll"] for r in runs]
        standardized = [
            n - math.log(regression_split("diabetes", i).y_std) for i, n in enumerate(nll)
        ]
        lines.append(
            f"| {label} | {len(runs)} | {_mean_sd(nll)} | "
            f"{_mean_sd(standardized)} | "
            f"{v[b]:.3f} ({e[b]}) | {v[w]:.1f} ({e[w]}) | "
            f"{first_reaching(e, v, target) or 'never'} | {_column(runs, 'neg_elbo')} | "
            f"{_column(runs, 'noise_median')} | {_column(runs, 'weight_scale_median')} | "
            f"{_column(runs, 'train_rmse_std')} |"
        )
    return lines


def figure_regression(curves: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({c[0] for c in curves}, key=["diabetes", "boston", "concrete"].index)
    nets = sorted({c[1] for c in curves})
    figure, axes = plt.subplots(
        len(nets), len(names), figsize=(4.2 * len(names), 3.2 * len(nets)), squeeze=False
    )
    for name, net, runs in curves:
        ax = axes[nets.index(net)][names.index(name)]
        for method in runs:
            e, v = mean_curve(runs[method])
            style = "--" if method == PROPOSED else "-"
            ax.plot(e, v, style, marker=".", label=LABELS[method])
        finals = [mean_curve(runs[m])[1][-1] for m in METHODS]
        ax.set_ylim(min(finals) - 0.3, max(finals) + 1.0)
        ax.set_xscale("log")
        ax.set_title(f"{name}, {net}", fontsize=9)
        ax.set_xlabel("gradient evaluations")
        ax.set_ylabel("test NLL (mean over splits)")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def figure_mnist(curves: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(curves), figsize=(4.5 * len(curves), 6.0), squeeze=False)
    for column, (net, runs) in enumerate(curves):
        for row, key in enumerate(("nll", "ece")):
            ax = axes[row][column]
            for method, r in runs.items():
                style = "--" if method == PROPOSED else "-"
                curve = r["curve"]
                ax.plot(curve["evals"], curve[key], style, marker=".", label=LABELS[method])
            ax.set_xscale("log")
            ax.set_yscale("log" if key == "nll" else "linear")
            ax.set_title(f"MNIST 8k/2k, {net}", fontsize=9)
            ax.set_xlabel("gradient evaluations")
            ax.set_ylabel(f"test {key.upper()}")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report(data: dict, settings: dict, img: Path) -> str:
    """The markdown of the docs section (tables) and the figures."""
    out: list[str] = []
    table, curves = regression_tables(data)
    if curves:
        figure_regression(curves, img / "bnn_quality_regression.png")
        out += ["### Regression", "", *table, "", "Learning-rate tuning (split 0, validation):"]
        out += ["", *tuning_table({k: v for k, v in data.items() if "/mnist/" not in k}), ""]
    table, curves = mnist_table(data)
    if curves:
        figure_mnist(curves, img / "bnn_quality_mnist.png")
        out += ["### MNIST", "", *table, "", "Learning-rate tuning (validation):", ""]
        out += [*tuning_table({k: v for k, v in data.items() if "/mnist/" in k}), ""]
    if any(k.startswith("diagnose/") for k in data):
        out += ["### Diabetes: the controlled runs", "", *diagnose_table(data), ""]
    return "\n".join(out)
