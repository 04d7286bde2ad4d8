"""What the export's trial run (a batched pass on 2 draws before all of them) costs.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_export_trial.py \\
        [--rows 100000] [--chunks 1000 100] [--repeats 3]

`to_inference_data` runs its batched pass first on ``_TRIAL_DRAWS`` = 2 draws and the first
chunk of rows (`pyro_quadvi.export.draws._all_draws`), so that a model broadcasting the draws
against each other fails on ``(2, 2, ...)`` tensors, not on ``(S, S, ...)`` ones. Each export is
timed with the trial ("with") and without it (``_TRIAL_DRAWS`` set past the number of draws),
alternated in one process, median of ``repeats``: non-centred eight schools (200 QNVB steps,
``num_samples=1000``, ``prior=True``), a regression of ``rows`` rows (5 inputs, ``S = 200``,
``prior=True``) and a model of ``rows`` local latents in ``pyro.plate(..., subsample_size=B)``
for each ``B`` of ``chunks`` (the export sweeps ``rows / B`` chunks; ``S = 50``, ``prior=False``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

import pyro_quadvi.export.draws as draws
from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, to_inference_data
from pyro_quadvi.testing.problems import eight_schools


def _with_and_without(export, repeats: int) -> tuple[float, float]:
    """Median seconds of ``export()`` with the trial and without it, alternated, after one
    export that is not timed (the first one imports and builds what the later ones reuse)."""
    export()
    trial = draws._TRIAL_DRAWS
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(repeats):
            for on in (True, False):
                draws._TRIAL_DRAWS = trial if on else 10**9
                start = time.perf_counter()
                export()
                times[on].append(time.perf_counter() - start)
    finally:
        draws._TRIAL_DRAWS = trial
    return statistics.median(times[True]), statistics.median(times[False])


def _schools():
    model = eight_schools().model  # the non-centred eight schools of the shared problems

    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    for _ in range(200):
        svi.step()
    return lambda: to_inference_data(model, guide, num_samples=1000)


def _regression(rows: int):
    x = torch.randn(rows, 5, generator=torch.Generator().manual_seed(0))
    y = x @ torch.ones(5) + torch.randn(rows, generator=torch.Generator().manual_seed(1))

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([5]).to_event(1))
        s = pyro.sample("s", dist.HalfNormal(1.0))
        with pyro.plate("n", len(y)):
            pyro.sample("obs", dist.Normal((x * w).sum(-1), s), obs=y)

    guide = AutoMeanFieldNormal(model)
    guide(x, y)
    return lambda: to_inference_data(model, guide, x, y, num_samples=200)


def _local(rows: int, chunk: int):
    y = torch.randn(rows, generator=torch.Generator().manual_seed(2))

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
        with pyro.plate("data", len(y), subsample_size=chunk) as idx:
            u = pyro.sample("u", dist.Normal(mu, 1.0))
            pyro.sample("obs", dist.Normal(u, 0.5), obs=y[idx])

    guide = AutoMeanFieldNormal(model)
    guide(y)
    return lambda: to_inference_data(model, guide, y, num_samples=50, prior=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1000, 100])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    cases = [("eight schools, S = 1000, prior", _schools)]
    cases.append((f"regression, {args.rows} rows, S = 200, prior", lambda: _regression(args.rows)))
    for chunk in args.chunks:
        label = f"local latents, {args.rows} rows in chunks of {chunk}, S = 50"
        cases.append((label, lambda chunk=chunk: _local(args.rows, chunk)))
    print("| export | with trial (s) | without (s) | ratio |")
    print("|---|---:|---:|---:|")
    for label, build in cases:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        on, off = _with_and_without(build(), args.repeats)
        print(f"| {label} | {on:.3f} | {off:.3f} | {on / off:.2f} |")


if __name__ == "__main__":
    main()
