"""QNVB's step cap on Bayesian networks: candidate defaults against the current one (issue 11).

Runs ``SVI(bnn, guide, QNVB(**candidate), QuadratureELBO())`` on regression cells of
``bench_bnn_quality.py`` (same networks, prior, likelihood, initialization, splits and scores;
its ``run``), one candidate per row, and prints per cell: the worst mean test NLL over the
evaluation grid (the first-step blow-up), the mean test NLL after about 100 evaluations, and the
final mean test NLL ± sd over the splits, in original units. The Pyro suite half of the
comparison is ``bench_qnvb.py --ablate`` with the candidates of its ``ABLATIONS``.

Usage::

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_qnvb_lr.py \
        --cells diabetes/1x50 boston/2x128 concrete/2x128 --splits 3 \
        --candidates lr-1 lr-0.1 lr-0.3

Runs are cached in ``benchmarks/results/qnvb_lr.json`` (by candidate, cell and split).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import pyro
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyro_quadvi

from bench_bnn_quality import eval_grid, regression_net, regression_task, run
from bench_qnvb import ABLATIONS

RESULTS = Path(__file__).parent / "results" / "qnvb_lr.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["diabetes/1x50"], help="data/net")
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--evals", type=int, default=1000)
    parser.add_argument("--draws", type=int, default=32)
    parser.add_argument("--candidates", nargs="+", default=["none"], choices=sorted(ABLATIONS))
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="the run cache (default: the recorded one)"
    )
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    results = options.results
    cache = json.loads(results.read_text()) if results.exists() else {}
    grid = eval_grid(options.evals, 12)
    bar = tqdm(total=len(options.cells) * options.splits * len(options.candidates))
    rows = []
    for cell in options.cells:
        name, net_name = cell.split("/")
        for candidate in options.candidates:
            curves = []
            for split in range(options.splits):
                key = f"{candidate}/{cell}/evals{options.evals}/split{split}"
                bar.set_description(key)
                if key not in cache:
                    task = regression_task(name, split)
                    make = partial(regression_net, task.x_train.shape[1], net_name)
                    args = ("qnvb", task, make, None, grid, options.draws)
                    qnvb_args = dict(ABLATIONS[candidate])
                    cache[key] = run(*args, seed=split, qnvb_args=qnvb_args)
                    results.parent.mkdir(parents=True, exist_ok=True)
                    results.write_text(json.dumps(cache, indent=1, sort_keys=True))
                bar.update()
                curves.append(cache[key]["curve"])
            evals = curves[0]["evals"]
            mean = [statistics.fmean(c["nll"][i] for c in curves) for i in range(len(evals))]
            at100 = min(range(len(evals)), key=lambda i: abs(evals[i] - 100))
            finals = [c["nll"][-1] for c in curves]
            sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
            worst = max(range(len(evals)), key=mean.__getitem__)
            rows.append(
                f"| {name} | {net_name} | {candidate} | {mean[worst]:.4g} ({evals[worst]}) "
                f"| {mean[at100]:.3f} ({evals[at100]}) "
                f"| {statistics.fmean(finals):.3f} ± {sd:.3f} |"
            )
    bar.close()
    print(f"\n{options.splits} splits, {options.evals} evaluations, mean test NLL (original units)")
    print("| data | net | candidate | worst (at evals) | near 100 evals | final ± sd |")
    print("|---|---|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
