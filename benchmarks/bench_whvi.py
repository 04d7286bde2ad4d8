"""Walsh-Hadamard variational inference (issue 14): the transform, the layer, Table 3, the toy.

    OMP_NUM_THREADS=1 python benchmarks/bench_whvi.py fwht [--repeats 7]
    OMP_NUM_THREADS=1 python benchmarks/bench_whvi.py layer [--repeats 5]
    OMP_NUM_THREADS=1 python benchmarks/bench_whvi.py uci [--datasets boston concrete]
        [--splits 8] [--steps 600] [--adam-steps 1800] [--qnvb-lr 0.1]
        [--only boston:WHVI:Adam:3 ...] [--jsonl fits.jsonl]
    OMP_NUM_THREADS=1 python benchmarks/bench_whvi.py uci --summarize fits.jsonl ...
    OMP_NUM_THREADS=1 python benchmarks/bench_whvi.py toy [--steps 2000] [--nuts]

- ``fwht``: ``pyro_quadvi.linalg.fwht`` against ``x @ H`` with the dense Sylvester matrix ``H``
  built beforehand, ``D = 2^6 .. 2^14``, batch 512, float32, one thread; median CPU time
  (``time.process_time``) of ``--repeats`` timings each, alternating the two; the crossover
  (the least ``D`` where the transform is faster) and least-squares slopes of ``log time`` on
  ``log D`` (``D log D`` has slope about 1.1 over this range, ``D^2`` slope 2).
- ``layer``: one ``WHVILinear(D, D)`` against one ``nn.Linear(D, D)`` as the net of a
  ``BayesianModule`` (Gaussian likelihood, batch 64, ``priors.Normal``; the WHVI layer's ``s1``,
  ``s2`` hidden), ``AutoMeanFieldNormal``, ``QNVB()`` + ``QuadratureELBO()``: the variational
  parameter count (entries of the guide's and the hidden parameters), the median step CPU time over
  ``--repeats`` blocks of 3 steps, and the peak memory of one step (``bench_bnn_speed.peak_bytes``).
- ``uci``: the paper's Table 3 setting (Section 3.2): ``regression_split(name, i)`` for 8 random
  90/10 splits, inputs standardized (targets standardized for training, scores in original
  units), a 2 x 128 ReLU network, a learned noise scale (``HalfNormal(1)`` prior on the
  standardized scale); MFG: every layer mean-field (``priors.LayerwiseNormal("radford")``);
  WHVI: ``whvi(net, skip_last=True)`` (the paper's last layer is mean-field), ``g ~ N(0, 1)``.
  Each is trained full batch from a prior draw with ``QNVB(lr=0.1)`` + ``QuadratureELBO()``
  for ``--steps`` steps (``--qnvb-lr``: QNVB's default ``lr = 1`` throws the mean-field network's
  first steps to losses of 1e7-1e11 and it ends at a test RMSE of 80 on Boston), and with
  ``pyro.optim.Adam({"lr": 0.01})`` + ``Trace_ELBO()`` for
  ``--adam-steps`` steps (3 x, so both take the same gradient evaluations: K = 3 nodes a QNVB
  step). Test RMSE of the predictive mean and MNLL ``-log (1/S) sum_s N(y | f_s(x), sigma_s)``
  over ``S = 200`` guide draws (weights and noise), in the targets' units.
- ``toy``: the paper's Fig. 4 problem (``tutorials/bnn_regression.py``'s data): a 1-128-128-1
  cosine network, mean field against WHVI (the hidden 128 x 128 layer WHVI, the first and last
  mean-field, as the paper's parameter count of 1541 implies), QNVB(lr=0.1) + QuadratureELBO;
  ``--nuts`` adds the tutorial's NUTS reference (1-10-1, 300 + 300 draws). Writes
  ``docs/img/whvi_toy.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_sample
from torch import nn
from tqdm.auto import tqdm

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.linalg import fwht
from pyro_quadvi.nn import (
    BayesianModule,
    WHVILinear,
    likelihoods,
    priors,
    whvi,
)
from pyro_quadvi.quadrature import hadamard_signs
from pyro_quadvi.testing.datasets import regression_split

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = {  # Table 3 of the paper: (mean, sd)
    ("boston", "WHVI"): {"rmse": (3.14, 0.71), "mnll": (4.33, 1.80)},
    ("boston", "MFG"): {"rmse": (4.47, 0.85), "mnll": (2.99, 0.41)},
    ("concrete", "WHVI"): {"rmse": (4.70, 0.72), "mnll": (3.17, 0.37)},
    ("concrete", "MFG"): {"rmse": (8.01, 0.41), "mnll": (3.41, 0.05)},
}


def median_time(fn, repeats: int) -> float:
    """Median CPU time of ``fn()`` (``time.process_time``: the machine is shared, so wall-clock
    times of one thread measure the other users as much as the code)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def slope(xs, ys) -> float:
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def load_tutorial(name: str):
    """A tutorial script (``tutorials/<name>.py``) as a module, loaded once."""
    if name not in sys.modules:
        path = ROOT / "tutorials" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


# ----------------------------------------------------------------------------- 1. the transform


def bench_fwht(repeats: int) -> None:
    sizes = [2**k for k in range(6, 15)]
    rows = []
    for size in tqdm(sizes, desc="fwht"):
        x = torch.randn(512, size)
        index = torch.arange(size, dtype=torch.int32)
        dense = hadamard_signs(index.unsqueeze(0), index.unsqueeze(1), dtype=torch.float32)
        fast_times, dense_times = [], []
        for _ in range(repeats):  # alternate the two
            fast_times.append(median_time(lambda x=x: fwht(x), 1))
            dense_times.append(median_time(lambda x=x, dense=dense: x @ dense, 1))
        rows.append((size, statistics.median(fast_times), statistics.median(dense_times)))
    print("| D | fwht (ms) | dense x @ H (ms) | dense / fwht |")
    print("|---|---|---|---|")
    for size, fast, dense in rows:
        print(f"| {size} | {1e3 * fast:.3f} | {1e3 * dense:.3f} | {dense / fast:.1f} |")
    crossover = next((size for size, fast, dense in rows if fast < dense), None)
    print(f"\ncrossover: fwht faster from D = {crossover}")
    sizes = [r[0] for r in rows]
    print(f"log-log slope, fwht: {slope(sizes, [r[1] for r in rows]):.2f}")
    print(f"log-log slope, dense: {slope(sizes, [r[2] for r in rows]):.2f}")
    reference = slope(sizes, [s * math.log2(s) for s in sizes])
    print(f"log-log slope of D log2 D itself: {reference:.2f}")


# ----------------------------------------------------------------------------- 2. the layer


def bench_layer(repeats: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_bnn_speed import peak_bytes

    print("| D | layer | variational parameters | step (ms) | peak memory (MiB) |")
    print("|---|---|---|---|---|")
    for size in tqdm([2**k for k in range(6, 13)], desc="layer"):
        x, y = torch.randn(64, size), torch.randn(64, size)
        for kind in ("mean field", "WHVI"):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            net = nn.Linear(size, size)
            if kind == "WHVI":
                net = whvi(net)  # declares S1, S2 (point estimates) and g ~ N(0, 1)
            likelihood = likelihoods.Gaussian(64, scale=1.0)
            # QNVB's own settings, as recorded (not the network settings a BayesianModule declares)
            bnn = BayesianModule(net, priors.Normal(1.0), likelihood, qnvb_settings={})
            guide = AutoMeanFieldNormal(bnn)
            svi = SVI(bnn, guide, QNVB(), QuadratureELBO())
            svi.step(x, y)
            count = load_tutorial("whvi_regression").count_parameters()

            def steps(svi=svi, x=x, y=y):
                for _ in range(3):
                    svi.step(x, y)

            step = median_time(steps, repeats) / 3
            peak = peak_bytes(lambda svi=svi, x=x, y=y: svi.step(x, y), tries=2)
            print(f"| {size} | {kind} | {count} | {1e3 * step:.2f} | {peak / 2**20:.1f} |")


# ----------------------------------------------------------------------------- 3. Table 3


def fit_uci(
    name: str, split: int, kind: str, method: str, steps: int, qnvb_lr: float, seed: int = 0
) -> dict:
    """One fit of the tutorial's model (``tutorials/whvi_regression.py``) and its test scores."""
    tutorial = load_tutorial("whvi_regression")
    data = regression_split(name, split)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    bnn = tutorial.make_bnn(kind, data.x_train.shape[1], data.x_train.shape[0])
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample)
    if method == "QNVB":
        svi = SVI(bnn, guide, QNVB(lr=qnvb_lr), QuadratureELBO())
    else:
        svi = SVI(bnn, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    start = time.process_time()
    for _ in range(steps):
        svi.step(data.x_train, data.y_train)
    cpu = time.process_time() - start
    pyro.set_rng_seed(seed + 1)
    outputs, sigma = tutorial.predictive_draws(bnn, guide, data.x_test, 200)
    scores = tutorial.scores(outputs, sigma, data.y_test, data.y_mean, data.y_std)
    return {"rmse": scores["rmse"], "mnll": scores["mnll"], "cpu_s": cpu}


UCI_METHODS = [("MFG", "QNVB"), ("MFG", "Adam"), ("WHVI", "QNVB"), ("WHVI", "Adam")]


def bench_uci(
    datasets, splits: int, steps: int, adam_steps: int, qnvb_lr: float, only, jsonl
) -> None:
    """Every (data set, model, training, split) fit, or those of ``only`` (``"boston:WHVI:Adam:3"``
    each, run in that order); each fit's scores go to stdout and, as a JSON line, to ``jsonl``
    (so that fits can run in several processes and be summarized together with ``--summarize``).
    """
    fits = [
        (name, kind, method, split)
        for name in datasets
        for kind, method in UCI_METHODS
        for split in range(splits)
    ]
    if only:  # in the order given
        known = {
            f"{name}:{kind}:{method}:{split}": (name, kind, method, split)
            for name, kind, method, split in fits
        }
        unknown = [item for item in only if item not in known]
        if unknown:
            raise ValueError(f"--only: unknown fits {unknown}; e.g. boston:WHVI:Adam:3")
        fits = [known[item] for item in only]
    records = []
    for name, kind, method, split in tqdm(fits, desc="uci"):
        n = steps if method == "QNVB" else adam_steps
        record = {"data": name, "model": kind, "training": method, "split": split, "steps": n}
        record.update(fit_uci(name, split, kind, method, n, qnvb_lr))
        records.append(record)
        print(json.dumps(record), flush=True)
        if jsonl:
            with open(jsonl, "a") as handle:
                handle.write(json.dumps(record) + "\n")
    summarize_uci(records)


def summarize_uci(records: list[dict]) -> None:
    """The Table 3 rows (mean (sd) over splits) of fit records, and the published rows."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["data"], record["model"], record["training"]), []).append(record)

    def summary(runs, key):
        values = [r[key] for r in runs]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.fmean(values):.2f} ({sd:.2f})"

    print("| data | model | training | splits | test RMSE | test MNLL | CPU s per fit |")
    print("|---|---|---|---|---|---|---|")
    order = {key: i for i, key in enumerate(UCI_METHODS)}
    for key in sorted(groups, key=lambda k: (k[0], order[k[1:]])):
        runs = groups[key]
        timed = [r["cpu_s"] for r in runs if math.isfinite(r["cpu_s"])]
        cpu = f"{statistics.fmean(timed):.1f}" if timed else "n/a"
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(runs)} | {summary(runs, 'rmse')} | "
            f"{summary(runs, 'mnll')} | {cpu} |"
        )
    print("\n| data | training | common splits | WHVI - MFG RMSE | WHVI - MFG MNLL |")
    print("|---|---|---|---|---|")
    for name in sorted({key[0] for key in groups}):
        for method in ("QNVB", "Adam"):
            whvi_runs = {r["split"]: r for r in groups.get((name, "WHVI", method), [])}
            mfg_runs = {r["split"]: r for r in groups.get((name, "MFG", method), [])}
            common = sorted(set(whvi_runs) & set(mfg_runs))
            if common:
                paired = [
                    {k: whvi_runs[i][k] - mfg_runs[i][k] for k in ("rmse", "mnll")} for i in common
                ]
                print(
                    f"| {name} | {method} | {', '.join(map(str, common))} | "
                    f"{summary(paired, 'rmse')} | {summary(paired, 'mnll')} |"
                )
    print()
    for (name, kind), published in PUBLISHED.items():
        if any(key[0] == name for key in groups):
            r, m = published["rmse"], published["mnll"]
            print(f"| {name} | {kind} | published | 8 | {r[0]} ({r[1]}) | {m[0]} ({m[1]}) | |")


# ----------------------------------------------------------------------------- 4. the toy


def bench_toy(steps: int, nuts: bool, out: str, samples: int = 200) -> None:
    tutorial = load_tutorial("bnn_regression")
    x, y = tutorial.toy_data()
    x_test, y_test = tutorial.test_data()
    n = x.shape[0]
    results = {}
    for kind in ("mean field", "WHVI"):
        torch.manual_seed(0)
        bnn = tutorial.make_bnn((128, 128), n)
        if kind == "WHVI":  # the hidden 128 x 128 layer; the first and last stay mean-field
            net = dict(bnn.named_children())["net"]
            net[2] = WHVILinear(128, 128, dtype=net[2].weight.dtype)
            bnn = BayesianModule(net, bnn.prior, bnn.likelihood, qnvb_settings={})
        start = time.perf_counter()
        guide, _ = tutorial.fit_svi(bnn, x, y, QNVB(lr=0.1), QuadratureELBO(), steps, kind)
        elapsed = time.perf_counter() - start
        pyro.set_rng_seed(10)
        prediction = bnn.predict(guide, x_test, num_samples=samples)
        count = load_tutorial("whvi_regression").count_parameters()
        label = f"{kind} ({count:,} parameters)"
        results[label] = tutorial.summarize(prediction.outputs.squeeze(-1), x_test, y_test)
        results[label]["time_s"] = elapsed
    if nuts:
        bnn = tutorial.make_bnn((10,), n)
        start = time.perf_counter()
        draws = tutorial.run_nuts(bnn, x, y, 300, 300)
        elapsed = time.perf_counter() - start
        with torch.no_grad():
            outputs = bnn.evaluate(draws, x_test).squeeze(-1)
        label = "NUTS, 1-10-1 (300 draws)"
        results[label] = tutorial.summarize(outputs, x_test, y_test)
        results[label]["time_s"] = elapsed
    title = (
        f"Fig. 4 toy, 1-128-128-1 cosine network: mean field against WHVI (hidden layer), "
        f"QNVB(lr=0.1) + QuadratureELBO, {steps} steps"
    )
    tutorial.plot(x, y, x_test, results, out, title)
    tutorial.print_table(results)
    print(f"\nfigure saved to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["fwht", "layer", "uci", "toy"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--datasets", nargs="+", default=["boston", "concrete"])
    parser.add_argument("--splits", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600, help="QNVB steps (uci, toy)")
    parser.add_argument("--adam-steps", type=int, default=1800, help="Adam steps (uci)")
    parser.add_argument("--qnvb-lr", type=float, default=0.1, help="QNVB's lr (uci)")
    parser.add_argument("--only", nargs="+", help="uci: fits data:model:training:split")
    parser.add_argument("--jsonl", help="uci: append each fit's record to this file")
    parser.add_argument("--summarize", nargs="+", help="uci: summarize these JSON-lines files")
    parser.add_argument("--nuts", action="store_true", help="toy: add the NUTS reference")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "whvi_toy.png"))
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    if options.part == "fwht":
        bench_fwht(options.repeats)
    elif options.part == "layer":
        bench_layer(options.repeats)
    elif options.part == "uci" and options.summarize:
        records = []
        for path in options.summarize:
            with open(path) as handle:
                records += [json.loads(line) for line in handle if line.strip()]
        summarize_uci(records)
    elif options.part == "uci":
        bench_uci(
            options.datasets,
            options.splits,
            options.steps,
            options.adam_steps,
            options.qnvb_lr,
            options.only,
            options.jsonl,
        )
    else:
        bench_toy(options.steps, options.nuts, options.out)


if __name__ == "__main__":
    main()
