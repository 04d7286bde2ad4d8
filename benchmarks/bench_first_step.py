"""What the first ``svi.step`` of ``QuadratureELBO`` costs on a model of many small sites, against
Pyro's ``Trace_ELBO``, and where its extra goes.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_first_step.py [--sites 1000]
        [--steps 5]

The model: ``z_i ~ N(0, 1)``, ``y_i ~ N(z_i, 0.5)`` observed, ``i < S``, float64 (the model of
``bench_guide_call.py``). Two fits from a fresh param store, the guide not run before the first
step: ``AutoMeanFieldNormal`` + ``QuadratureELBO()`` (``vectorize=None``, the default rule) +
``QNVB()``, and Pyro's ``AutoNormal`` + ``Trace_ELBO()`` + ``Adam(0.01)``. Each row: the first
step, the median of ``--steps`` later steps, and the first step less that median (its one-time
extra). Then the parts of the quadrature fit's first step, each timed by a wrapper around a
package function:

- ``latent_sites_of_model``: the ELBO's check of the model's latents before a guide's set-up
  (one run of the model);
- ``AutoMeanFieldNormal._setup_prototype``: the guide's set-up (Pyro's, one run of the model);
- the vectorization check: its single runs of the model at the probe points (the ``single``
  of ``evaluate_batch``) and ``batched._mixed_points`` (a pass over the probe points alone, a
  backward pass per point: whether the pass mixes the points).

CPU time (``time.process_time``), one thread, one run of each (the first step happens once).
``--quick`` (the test of the scripts): 20 sites, 2 later steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import pyro
import torch
from bench_guide_call import make_model
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer import batched, quadrature_elbo

PARTS: dict[str, float] = {}


def timed_part(name: str, fn: Callable) -> Callable:
    """``fn``, its CPU seconds added to ``PARTS[name]`` at each call."""

    def run(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[name] = PARTS.get(name, 0.0) + time.process_time() - start

    return run


def evaluate_batch(batched_fn, single, *args, **kwargs):
    """`batched.evaluate_batch` with its single runs timed."""
    return EVALUATE_BATCH(batched_fn, timed_part("single", single), *args, **kwargs)


EVALUATE_BATCH = quadrature_elbo.evaluate_batch


def fit(svi: SVI, steps: int) -> tuple[float, float]:
    """The first step's CPU seconds and the median of ``steps`` later ones."""
    start = time.process_time()
    svi.step()
    first = time.process_time() - start
    later = []
    for _ in range(steps):
        start = time.process_time()
        svi.step()
        later.append(time.process_time() - start)
    return first, statistics.median(later)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sites, args.steps = 20, 2
    torch.set_num_threads(1)
    model = make_model(args.sites)
    setup = AutoMeanFieldNormal._setup_prototype
    quadrature_elbo.latent_sites_of_model = timed_part(
        "latents", quadrature_elbo.latent_sites_of_model
    )
    quadrature_elbo.evaluate_batch = evaluate_batch
    batched._mixed_points = timed_part("mixed", batched._mixed_points)
    AutoMeanFieldNormal._setup_prototype = timed_part("setup", setup)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    quad = fit(SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO()), args.steps)
    parts = dict(PARTS)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    pyro_fit = fit(SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO()), args.steps)
    print(f"S = {args.sites} scalar sites\n")
    print("| fit | first step (s) | later step (s) | first less later (s) |")
    print("|---|---:|---:|---:|")
    for label, (first, later) in (("QuadratureELBO + QNVB", quad), ("Trace_ELBO + Adam", pyro_fit)):
        print(f"| {label} | {first:.3f} | {later:.3f} | {first - later:.3f} |")
    print(f"\nfirst steps: {quad[0] / pyro_fit[0]:.2f}x Pyro's\n")
    print("| part of the quadrature fit's first step | s | share of the first step |")
    print("|---|---:|---:|")
    labels = {
        "latents": "latent_sites_of_model",
        "setup": "AutoMeanFieldNormal._setup_prototype",
        "single": "the check's single runs",
        "mixed": "the check's _mixed_points",
    }
    for key, label in labels.items():
        seconds = parts.get(key, 0.0)
        print(f"| {label} | {seconds:.3f} | {seconds / quad[0]:.0%} |")


if __name__ == "__main__":
    main()
