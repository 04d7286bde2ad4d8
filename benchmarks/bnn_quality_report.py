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
_CELL_ORDER = {"diabetes": 0, "boston": 1, "concrete": 2}
LABELS = {
    "qnvb": "QNVB + QuadratureELBO (defaults)",
    "adam": "Adam + Trace_ELBO (tuned lr)",
    "ivon": "IVON (tuned lr)",
    "map": "deterministic net, Adam",
    "qnvb-lr0.1": "QNVB lr=0.1 (else defaults) + QuadratureELBO",
    "qnvb-trust1": "QNVB trust_region=1 (else defaults) + QuadratureELBO",
    "qnvb-trust1-kl0.1": "QNVB trust_region=1 + QuadratureELBO, KL weight 0.1",
    "qnvb-wide": "QNVB trust_region=0.3, scale_max=2, significance=1 + QuadratureELBO",
}
#: QNVB variants run beside the defaults, and their name in the goal tables
EXTRAS = {
    "qnvb-trust1": "trust_region 1",
    "qnvb-trust1-kl0.1": "trust_region 1, KL weight 0.1",
    "qnvb-lr0.1": "lr 0.1",
    "qnvb-wide": "trust_region 0.3, scale_max 2, significance 1",
}
QNVB_ROWS = {"qnvb": "defaults", **EXTRAS}


def _runs(data: dict, prefix: str) -> list[dict]:
    """The runs ``prefix/split0``, ``prefix/split1``, ... in split order."""
    runs, split = [], 0
    while f"{prefix}/split{split}" in data:
        runs.append(data[f"{prefix}/split{split}"])
        split += 1
    return runs


def _mean_sd(values: list[float], digits: int = 3) -> str:
    a = np.asarray(values, dtype=float)
    if len(a) == 1:
        return f"{a[0]:.{digits}f}"
    return f"{a.mean():.{digits}f} ± {a.std(ddof=1):.{digits}f}"


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
        runs = {m: _runs(data, f"regression/{name}/{net}/{m}") for m in (*METHODS, *EXTRAS)}
        for extra in EXTRAS:
            if len(runs[extra]) != len(runs["qnvb"]):
                del runs[extra]
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
        for qnvb, row_name in QNVB_ROWS.items():
            if qnvb not in runs:
                continue
            g = goal_row(runs, qnvb)
            reach = "never" if g["qnvb_reach"] is None else str(g["qnvb_reach"])
            goals.append(
                f"| {name} | {net} | {row_name} | "
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
        runs = {m: data.get(f"mnist/{net}/{m}") for m in (*METHODS, "map", *EXTRAS)}
        runs = {m: r for m, r in runs.items() if r is not None or m not in EXTRAS}
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
        for qnvb, row_name in QNVB_ROWS.items():
            if qnvb not in runs:
                continue
            g = goal_row({m: [runs[m]] for m in runs}, qnvb)
            reach = "never" if g["qnvb_reach"] is None else str(g["qnvb_reach"])
            goals.append(
                f"| {net} | {row_name} | "
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


#: Seed-0 runs recorded by another script under another key: ``bench_qnvb_wide.py``'s ten-epoch
#: row of the same setting as the ``qnvb-wide`` variant (the same ``run``, seed, data and scoring;
#: its ``-ELBO`` score restores the random generator, so the training is the same)
SEED0_ALIASES = {"mnist/mlp/qnvb-wide": "full/qnvb trust 0.3, scale_max 2, significance 1"}
MNIST_SCORES = ("accuracy", "nll", "ece", "brier")


def seed0_runs(files: list[dict]) -> dict:
    """The seed-0 MNIST runs ``mnist/<net>/<method>`` of the recorded JSONs ``files`` (each one's
    data), with :data:`SEED0_ALIASES` resolved; a key found in two files is an error."""
    out: dict = {}
    for data in files:
        found = {k: v for k, v in data.items() if k.startswith("mnist/")}
        found.update({k: data[a] for k, a in SEED0_ALIASES.items() if a in data})
        clash = sorted(set(found) & set(out))
        if clash:
            raise ValueError(
                f"the seed-0 runs {clash} are in two of the --seed0-results files: pass one "
                "network's files at a time (the CNN's default and Kaiming runs share keys)"
            )
        out.update(found)
    return out


def mnist_seeds_tables(data: dict, seed0: dict) -> list[str]:
    """MNIST over seeds: every method run from seeds ``k >= 1`` (``seed<k>/mnist/<net>/<method>``
    in ``data``) beside its seed-0 run (``mnist/<net>/<method>`` in ``seed0``, or in ``data``):
    one row per seed, then the mean ± sd (ddof 1) over the seeds found."""
    seeds = sorted({int(k.split("/")[0][4:]) for k in data if k.startswith("seed")})
    seed0 = {**{k: v for k, v in data.items() if k.startswith("mnist/")}, **seed0}
    rows = [
        "| net | method | lr | seed | accuracy | NLL | ECE | Brier | QNVB reaches Adam's best NLL "
        "at (Adam's, at evals) | CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    means = [
        "| net | method | seeds | accuracy | NLL | ECE | Brier |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for net in ("mlp", "cnn"):
        methods = [
            m for m in (*METHODS, "map", *EXTRAS) if f"seed{seeds[0]}/mnist/{net}/{m}" in data
        ]
        by_seed = {
            seed: {
                m: (seed0 if seed == 0 else data).get(
                    f"mnist/{net}/{m}" if seed == 0 else f"seed{seed}/mnist/{net}/{m}"
                )
                for m in methods
            }
            for seed in (0, *seeds)
        }
        for method in methods:
            done = []
            for seed, runs in by_seed.items():
                r = runs[method]
                if r is None:
                    rows.append(f"| {net} | {method} | | {seed} | - | - | - | - | | - |")
                    continue
                done.append(seed)
                f = r["final"]
                reach = ""
                if method.startswith("qnvb") and runs.get("adam") and runs.get("ivon"):
                    g = goal_row({m: [v] for m, v in runs.items() if v is not None}, method)
                    at = "never" if g["qnvb_reach"] is None else str(g["qnvb_reach"])
                    reach = f"{at} ({g['adam_best']:.4f}, {g['adam_at']})"
                lr = r["lr"]
                rows.append(
                    f"| {net} | {method} | {'-' if lr is None else f'{lr:g}'} | {seed} | "
                    + " | ".join(f"{f[key]:.4f}" for key in MNIST_SCORES)
                    + f" | {reach} | {r['cpu_s']:.0f} |"
                )
            cells = [
                _mean_sd([by_seed[seed][method]["final"][key] for seed in done], 4)
                for key in MNIST_SCORES
            ]
            seeds_done = ", ".join(str(seed) for seed in done)
            means.append(f"| {net} | {method} | {seeds_done} | " + " | ".join(cells) + " |")
    return ["Mean ± sd over the seeds:", "", *means, "", "Per seed:", "", *rows]


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


#: Rows of the objective tables: the fitted posteriors, the swaps, the remedies
OBJECTIVE_ROWS = (
    "qnvb",
    "qnvb-trust1",
    "adam",
    "ivon",
    "qnvb means, ivon sd",
    "ivon means, qnvb sd",
    "adam means, ivon sd",
    "ivon means, adam sd",
    "qnvb-kl0.1",
    "qnvb-trust1-kl0.1",
)


def objective_tables(data: dict) -> list[str]:
    """Per cell, the mean over splits of every posterior's ``-ELBO`` and its parts, its test NLL
    (model average and at the means), and IVON's spread check; then the long QNVB runs."""
    cells: dict[tuple, list[dict]] = {}
    for key in sorted(data):
        if key.startswith("objective/") and not key.startswith("objective/mnist/"):
            _, name, net, _ = key.split("/")
            cells.setdefault((name, net), []).append(data[key])
    order = {"diabetes": 0, "boston": 1, "concrete": 2}
    lines = [
        "| data | net | posterior | -ELBO | -E log lik | KL | test NLL | test NLL at the means | "
        "test RMSE | weight sd median | noise |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    spread = []
    for (name, net), outs in sorted(cells.items(), key=lambda c: (order.get(c[0][0], 9), c[0])):
        for row in OBJECTIVE_ROWS:
            if not all(row in out for out in outs):
                continue

            def mean(key: str, row: str = row, outs: list = outs) -> float:
                return float(np.mean([out[row][key] for out in outs]))

            lines.append(
                f"| {name} | {net} | {row} | {mean('neg_elbo'):.1f} | {mean('neg_ell'):.1f} | "
                f"{mean('kl'):.1f} | {mean('test_nll'):.3f} | {mean('point_nll'):.3f} | "
                f"{mean('test_rmse'):.2f} | {mean('sd_median'):.3f} | {mean('noise'):.3f} |"
            )
        ratios = [out["ivon spread"] for out in outs]
        spread.append(
            f"{name} {net}: median {min(r['spread_ratio_q50'] for r in ratios):.3f} to "
            f"{max(r['spread_ratio_q50'] for r in ratios):.3f}, 1% quantile >= "
            f"{min(r['spread_ratio_q1'] for r in ratios):.3f}, 99% quantile <= "
            f"{max(r['spread_ratio_q99'] for r in ratios):.3f}"
        )
    splits = max((len(outs) for outs in cells.values()), default=0)
    head = [f"Mean over {splits} splits (the -ELBO in standardized units, test scores original):"]
    lines = [*head, "", *lines, "", "IVON's own draws (sample sd / formula sd, per entry): "]
    lines += ["; ".join(spread) + ".", "", *long_table(data)]
    return lines


def figure_objective(data: dict, path: Path) -> None:
    """Test NLL against -ELBO of every posterior of the objective runs, one panel per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in sorted(data) if k.startswith("objective/") and "/mnist/" not in k]
    cells = sorted({tuple(k.split("/")[1:3]) for k in keys}, key=lambda c: _CELL_ORDER[c[0]])
    figure, axes = plt.subplots(1, len(cells), figsize=(4.6 * len(cells), 3.8), squeeze=False)
    markers = dict(zip(OBJECTIVE_ROWS, "os^vDd<>Px", strict=True))
    for ax, (name, net) in zip(axes[0], cells, strict=True):
        outs = [data[k] for k in keys if k.split("/")[1:3] == [name, net]]
        for row in OBJECTIVE_ROWS:
            x = [out[row]["neg_elbo"] for out in outs if row in out]
            y = [out[row]["test_nll"] for out in outs if row in out]
            ax.scatter(x, y, marker=markers[row], label=row, alpha=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{name}, {net} (splits 0-{len(outs) - 1})", fontsize=9)
        ax.set_xlabel("-ELBO of the posterior (training set)")
        ax.set_ylabel("test NLL (model average)")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def mnist_objective_table(data: dict) -> list[str]:
    """The MNIST MLP's posteriors under its ELBO, with their test scores."""
    out = data["objective/mnist/mlp/split0"]
    lines = [
        "| posterior | -ELBO | -E log lik | KL | test NLL | accuracy | ECE | test NLL at the "
        "means | weight sd median |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in OBJECTIVE_ROWS:
        if row in out:
            r = out[row]
            lines.append(
                f"| {row} | {r['neg_elbo']:.0f} | {r['neg_ell']:.0f} | {r['kl']:.0f} | "
                f"{r['test_nll']:.4f} | {r['test_accuracy']:.4f} | {r['test_ece']:.4f} | "
                f"{r['point_nll']:.4f} | {r['sd_median']:.4f} |"
            )
    reruns = [
        f"{k[6:]} {v['nll']:.4f} / {v['cached_nll']:.4f}"
        for k, v in out.items()
        if k.startswith("rerun ")
    ]
    q = [out["ivon spread"][f"spread_ratio_q{p}"] for p in (50, 1, 99)]
    lines += [
        "",
        "Final test NLL of the rerun / of the table's run (8 draws each): "
        + "; ".join(reruns)
        + f". IVON's own draws (64): sample sd / formula sd median {q[0]:.3f}, 1% / 99% "
        f"quantiles {q[1]:.3f} / {q[2]:.3f}.",
    ]
    return lines


def long_table(data: dict) -> list[str]:
    """QNVB (defaults) run long: mean ``-ELBO``, KL and test NLL at points of the grid."""
    cells = sorted({tuple(k.split("/")[1:3]) for k in data if k.startswith("long/")})
    order = {"diabetes": 0, "boston": 1, "concrete": 2}
    cells.sort(key=lambda c: (order.get(c[0], 9), c[1]))
    lines = [
        "| data | net | evals | -ELBO (64 draws) | KL | test NLL | test RMSE |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, net in cells:
        runs = _runs(data, f"long/{name}/{net}/qnvb")
        evals = np.asarray(runs[0]["curve"]["evals"])
        values = {k: mean_curve(runs, k)[1] for k in ("neg_elbo", "kl", "nll", "rmse")}
        for i in np.nonzero(evals >= 500)[0]:
            lines.append(
                f"| {name} | {net} | {evals[i]} | {values['neg_elbo'][i]:.1f} | "
                f"{values['kl'][i]:.1f} | {values['nll'][i]:.3f} | {values['rmse'][i]:.2f} |"
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
            style = "--" if method in EXTRAS else "-"
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

    widest = max(range(len(curves)), key=lambda column: len(curves[column][1]))
    ncol = min(2, len(curves))
    legend_height = 0.22 * math.ceil(len(curves[widest][1]) / ncol)  # inches, below the panels
    figure, axes = plt.subplots(
        2, len(curves), figsize=(4.5 * len(curves), 6.0 + legend_height), squeeze=False
    )
    for column, (net, runs) in enumerate(curves):
        for row, key in enumerate(("nll", "ece")):
            ax = axes[row][column]
            for method, r in runs.items():
                style = "--" if method in EXTRAS else "-"
                curve = r["curve"]
                ax.plot(curve["evals"], curve[key], style, marker=".", label=LABELS[method])
            ax.set_xscale("log")
            ax.set_yscale("log" if key == "nll" else "linear")
            ax.set_title(f"MNIST 8k/2k, {net}", fontsize=9)
            ax.set_xlabel("gradient evaluations")
            ax.set_ylabel(f"test {key.upper()}")
    handles, names = axes[0][widest].get_legend_handles_labels()
    figure.legend(handles, names, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, legend_height / (6.0 + legend_height), 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report(
    data: dict, settings: dict, img: Path, stem: str = "bnn_quality", seed0: dict | None = None
) -> str:
    """The markdown of the docs section (tables) and the figures ``img/<stem>_*.png``; where
    ``data`` holds runs from other seeds, their table with the seed-0 runs of ``seed0`` (the
    ``mnist/<net>/<method>`` runs of :func:`seed0_runs`)."""
    out: list[str] = []
    if any(k.startswith("seed") for k in data):
        out += ["### MNIST on several seeds", "", *mnist_seeds_tables(data, seed0 or {}), ""]
    table, curves = regression_tables(data)
    if curves:
        figure_regression(curves, img / f"{stem}_regression.png")
        out += ["### Regression", "", *table, "", "Learning-rate tuning (split 0, validation):"]
        out += ["", *tuning_table({k: v for k, v in data.items() if "/mnist/" not in k}), ""]
    table, curves = mnist_table(data)
    if curves:
        figure_mnist(curves, img / f"{stem}_mnist.png")
        out += ["### MNIST", "", *table, "", "Learning-rate tuning (validation):", ""]
        out += [*tuning_table({k: v for k, v in data.items() if "/mnist/" in k}), ""]
    if any(k.startswith("objective/") and "/mnist/" not in k for k in data):
        figure_objective(data, img / f"{stem}_objective.png")
        out += ["### The objective", "", *objective_tables(data), ""]
    if "objective/mnist/mlp/split0" in data:
        out += ["### The objective, MNIST MLP", "", *mnist_objective_table(data), ""]
    if any(k.startswith("diagnose/") for k in data):
        out += ["### Diabetes: the controlled runs", "", *diagnose_table(data), ""]
    return "\n".join(out)
