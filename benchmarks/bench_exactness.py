"""The exactness table of the papers (rasp paper Fig. 1, sequence paper Fig. 2).

For every sigma-point rule and number of evaluations ``K``, the fraction of the quadratic basis
functions ``1, x_i, x_i^2 - 1, x_i x_j`` (``1 + 2d + d(d-1)/2`` in all) integrated exactly under
``N(0, I_d)``, and separately the fraction of the ``d(d-1)/2`` mixed terms ``x_i x_j``. Random
rules: mean over ``--trials`` draws; the Hadamard sequence: mean over as many consecutive steps.

    python benchmarks/bench_exactness.py --dim 1024 --trials 10

prints two markdown tables and saves the plot ``docs/img/exactness.png`` (``--plot`` to change).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pyro_quadvi.demo import exactness_table, format_table

DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "exactness.png"


def plot(table: dict, dim: int, trials: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharex=True)
    titles = {
        "cross": f"mixed terms $x_i x_j$ ({dim * (dim - 1) // 2})",
        "total": f"all quadratic basis functions ({1 + 2 * dim + dim * (dim - 1) // 2})",
    }
    for ax, key in zip(axes, ("cross", "total")):
        for name, row in table.items():
            ks = sorted(row)
            ax.plot(ks, [row[K][key] for K in ks], marker="o", markersize=3, label=name)
        ax.set_title(f"Fraction exact: {titles[key]}", fontsize=10)
        ax.set_xlabel("evaluations K")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction integrated exactly")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle(f"Quadratic exactness at d = {dim} (mean of {trials} draws / steps)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--min-k", type=int, default=2)
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=str(DEFAULT_PLOT), help="PNG path ('' for none)")
    args = parser.parse_args(argv)
    evaluations = list(range(args.min_k, args.max_k + 1))
    start = time.perf_counter()
    table = exactness_table(args.dim, evaluations, args.trials, seed=args.seed)
    elapsed = time.perf_counter() - start
    pairs = args.dim * (args.dim - 1) // 2
    print(
        f"d = {args.dim}, mean over {args.trials} draws (random rules) or steps (hadamard), "
        f"seed {args.seed}; {elapsed:.0f} s\n"
    )
    print(f"Fraction of the {pairs} mixed terms x_i x_j integrated exactly:\n")
    print(format_table(table, evaluations, key="cross"))
    print(
        f"\nFraction of all {1 + 2 * args.dim + pairs} quadratic basis functions "
        "integrated exactly:\n"
    )
    print(format_table(table, evaluations, key="total"))
    if args.plot:
        plot(table, args.dim, args.trials, Path(args.plot))


if __name__ == "__main__":
    main()
