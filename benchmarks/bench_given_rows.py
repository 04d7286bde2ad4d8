"""What the ELBO's check of the rows a model gives its plates costs a ``QuadratureELBO`` step.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_given_rows.py [--repeats 40]

At every step ``PointsELBO`` scans the guide's trace for subsample sites; where it finds one (the
guide has a subsampled plate, whose rows the log joint replays into the model) the model runs
inside `GivenRows` (``pyro_quadvi.guides.rows``), which compares the rows a plate is given by
the model (``subsample=idx``) with those it ends up with. After its first call the ELBO runs the
model once a step, so the check costs a step the scan plus the difference between one run of the
model in `GivenRows` and one without, both under a replay of the guide's trace as the log joint
runs it. Every sized plate has a subsample site (of all its rows where it does not subsample),
so a guide with any plate runs the model in `GivenRows`. Four models, each fitted with
``QNVB()``:

* ``demo``: the demo's linear regression (6 features, 400 rows, no subsampling),
  ``AutoMeanFieldNormal``, ``QuadratureELBO("hadamard")``, as ``python -m pyro_quadvi.demo``
  (no plate in the guide: the scan only);
* ``eight schools``: ``pyro_quadvi.testing.problems.eight_schools``, ``AutoMeanFieldNormal``,
  ``QuadratureELBO()`` (a plate of all 8 schools around a local latent, no subsampling: the
  model runs in `GivenRows` all the same);
* ``rows, same tensor``: 20 local latents ``z_i``, ``pyro.plate("rows", 20, subsample=idx)``
  with 5 rows a step, the guide built with ``create_plates`` returning the model's plate (the
  check finds the same tensor);
* ``rows, equal copy``: the same, ``create_plates`` passing a copy of ``idx`` (the check
  compares the values).

CPU time (``time.process_time``), one thread: the step is the median of ``20 * repeats`` steps;
the runs alternate in blocks of 100 (``repeats`` blocks each), the table gives the medians per
run; the scan is the median of ``repeats`` blocks of 1,000.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import SVI
from pyro.poutine.util import site_is_subsample

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.demo import linear_regression
from pyro_quadvi.guides.interface import trace_for_description
from pyro_quadvi.guides.rows import GivenRows
from pyro_quadvi.testing.problems import eight_schools

N, B = 20, 5


def rows_model(idx, y):
    with pyro.plate("rows", N, subsample=idx):
        z = pyro.sample("z", dist.Normal(0.0, 10.0))
        pyro.sample("y", dist.Normal(z, 1.0), obs=y[idx])


def demo_case():
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(400, 6, generator=generator)
    y = X @ torch.linspace(-1, 1, 6) + 0.5 * torch.randn(400, generator=generator)
    guide = AutoMeanFieldNormal(linear_regression)
    return linear_regression, guide, QuadratureELBO("hadamard"), lambda k: (X, y)


def eight_schools_case():
    problem = eight_schools()
    guide = AutoMeanFieldNormal(problem.model)
    return problem.model, guide, QuadratureELBO(), lambda k: ()


def rows_case(copy: bool):
    y = torch.arange(N, dtype=torch.float)
    batches = torch.randperm(N, generator=torch.Generator().manual_seed(0)).reshape(N // B, B)

    def plates(idx, y):
        return pyro.plate("rows", N, subsample=idx.clone() if copy else idx)

    guide = AutoMeanFieldNormal(rows_model, create_plates=plates)
    return rows_model, guide, QuadratureELBO(), lambda k: (batches[k % len(batches)], y)


def per_call(fn, calls: int) -> float:
    """CPU microseconds per call of ``fn``, over ``calls`` calls."""
    start = time.process_time()
    for _ in range(calls):
        fn()
    return 1e6 * (time.process_time() - start) / calls


def measure(make, repeats: int) -> str:
    """One row of the table: the case ``make`` builds, measured."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide, elbo, data = make()
    svi = SVI(model, guide, QNVB(), elbo)
    svi.step(*data(0))  # the first call's set-up and probes
    steps = [per_call(lambda k=k: svi.step(*data(k)), 1) for k in range(1, 20 * repeats + 1)]
    step = statistics.median(steps)
    trace = trace_for_description(guide, *data(0))

    def scan() -> bool:
        return any(site_is_subsample(node) for node in trace.nodes.values())

    scanned = statistics.median(per_call(scan, 1000) for _ in range(repeats))
    if not scan():
        return f"{step:.0f} | {scanned:.1f} | - | - | {scanned:.1f} | {scanned / step:.2%}"
    runs = {"plain": [], "checked": []}
    for repeat in range(repeats):
        for kind in ("plain", "checked") if repeat % 2 else ("checked", "plain"):
            run = GivenRows(guide, trace)(model) if kind == "checked" else model
            replayed = poutine.trace(poutine.replay(run, trace=trace)).get_trace
            runs[kind].append(per_call(functools.partial(replayed, *data(0)), 100))
    plain, checked = (statistics.median(runs[kind]) for kind in ("plain", "checked"))
    cost = scanned + checked - plain
    return (
        f"{step:.0f} | {scanned:.1f} | {plain:.0f} | {checked:.0f} | {cost:.1f} | {cost / step:.2%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {
        "demo": demo_case,
        "eight schools": eight_schools_case,
        "rows, same tensor": functools.partial(rows_case, copy=False),
        "rows, equal copy": functools.partial(rows_case, copy=True),
    }
    print(
        "| model | step (us) | scan (us) | model run (us) | run in GivenRows (us) "
        "| check per step (us) | share of the step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, make in cases.items():
        print(f"| {name} | {measure(make, args.repeats)} |")


if __name__ == "__main__":
    main()
