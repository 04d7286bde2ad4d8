"""Cost of one SVI step: QuadratureELBO with K nodes against Trace_ELBO with K particles.

    python benchmarks/bench_elbo_cost.py [--repeats 7] [--steps 20]

Same model, guide and optimizer (Pyro's Adam); the only difference is the ELBO. Trace_ELBO uses
``num_particles=K, vectorize_particles=True`` on the models that vectorize, and the loop of
particles (``vectorize_particles=False``) on the PyroModule network, like QuadratureELBO's loop.
Blocks of steps are timed alternately for the two ELBOs; the table shows the median time per step
and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from models import (
    BayesianMLP,
    eight_schools,
    logistic_data,
    logistic_regression,
    mlp_data,
)
from pyro.infer import SVI, Trace_ELBO

from pyro_quadvi import AutoMeanFieldNormal, QuadratureELBO


def time_steps(svi: SVI, args, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(*args)
    return (time.perf_counter() - start) / steps


def compare(name, model, args, K, rule, vectorize, mpn, repeats, steps):
    results = {}
    svis = {}
    for label, elbo in (
        (
            "quadrature",
            QuadratureELBO(rule, num_points=K, vectorize=vectorize, max_plate_nesting=mpn),
        ),
        (
            "trace",
            Trace_ELBO(num_particles=K, vectorize_particles=vectorize, max_plate_nesting=mpn),
        ),
    ):
        pyro.clear_param_store()
        guide = AutoMeanFieldNormal(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), elbo)
        svi.step(*args)  # set up guide, parameters, vectorization choice
        svis[label] = (svi, pyro.get_param_store().get_state())
        results[label] = []
    for _ in range(repeats):
        for label, (svi, state) in svis.items():
            pyro.get_param_store().set_state(state)
            results[label].append(time_steps(svi, args, steps))
    quad = statistics.median(results["quadrature"])
    trace = statistics.median(results["trace"])
    return f"| {name} | {rule} | {K} | {quad * 1e3:.2f} | {trace * 1e3:.2f} | {quad / trace:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y = logistic_data(10_000, 100)
    Xn, yn = mlp_data()
    net = BayesianMLP()
    logistic = "logistic regression d=100, N=10k"
    cases = [
        ("eight schools", eight_schools, (), 3, "blocked_simplex", True, 1),
        ("eight schools", eight_schools, (), 3, "rasp_simplex", True, 1),
        ("eight schools", eight_schools, (), 4, "hadamard", True, 1),
        (logistic, logistic_regression, (X, y), 3, "blocked_simplex", True, 1),
        (logistic, logistic_regression, (X, y), 3, "rasp_simplex", True, 1),
        (logistic, logistic_regression, (X, y), 4, "hadamard", True, 1),
        ("PyroModule MLP (loop)", net, (Xn, yn), 3, "blocked_simplex", False, 1),
        ("PyroModule MLP (loop)", net, (Xn, yn), 3, "rasp_simplex", False, 1),
        ("PyroModule MLP (loop)", net, (Xn, yn), 4, "hadamard", False, 1),
    ]
    print("| model | rule | K | QuadratureELBO ms/step | Trace_ELBO ms/step | ratio |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        print(compare(*case, repeats=args.repeats, steps=args.steps), flush=True)


if __name__ == "__main__":
    main()
