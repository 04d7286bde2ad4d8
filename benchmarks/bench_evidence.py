"""Evidence accuracy against likelihood evaluations: OPQA, importance sampling, dynesty.

Models (data generated with fixed seeds, n = 50 observations):

- ``linreg-gauss`` (d = 2, 5): Bayesian linear regression with known noise and correlated
  features; the posterior is Gaussian and the evidence closed-form.
- ``linreg-normal-gamma`` (d = 2, 5): the same with an unknown noise precision under a
  normal-gamma prior (``d - 1`` coefficients and ``log tau``); closed-form evidence, non-Gaussian
  posterior in Pyro's unconstrained space.
- ``logistic`` (d = 2, 3): logistic regression with N(0, 1) priors; the reference is OPQA on a
  very fine centred Gauss-Hermite grid (64 points per coordinate in 2-D, 40 in 3-D), checked
  against a grid a quarter coarser.

Methods: OPQA (Laplace-centred, ``num_points`` per coordinate; the MAP search is counted);
Pyro's importance sampling with the prior and with a fitted ``AutoMultivariateNormal`` as the
proposal (the 2000 SVI steps are counted); dynesty's static nested sampler (``dlogz = 0.01``).
Random methods: median over repeats of |error| and of the evaluations.

Run from the repository root (single-threaded torch; a few minutes)::

    PYTHONPATH=. python benchmarks/bench_evidence.py [--quick]

It prints markdown tables: error against evaluations per model, then the goals.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal
from scipy import special

from pyro_quadvi import opqa_evidence
from pyro_quadvi.evidence import importance_log_evidence, nested_sampling_log_evidence, prior_guide

F64 = torch.float64
NUM_DATA = 50
PRIOR_SCALE, NOISE = 1.5, 0.4


def _tutorial():
    path = Path(__file__).resolve().parent.parent / "tutorials" / "evidence_comparison.py"
    spec = importlib.util.spec_from_file_location("evidence_comparison", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- models


def correlated_features(dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(NUM_DATA, 1, generator=generator, dtype=F64)
    return common + 0.5 * torch.randn(NUM_DATA, dim, generator=generator, dtype=F64)


def gauss_regression(X, y):
    beta = pyro.sample(
        "beta", dist.Normal(torch.zeros(X.shape[1], dtype=F64), PRIOR_SCALE).to_event(1)
    )
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal((X * beta).sum(-1), NOISE), obs=y)


def logistic_regression(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=F64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=(X * w).sum(-1)), obs=y)


def gauss_problem(dim: int, seed: int = 0) -> dict:
    X = correlated_features(dim, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    y = X @ torch.linspace(1.0, -1.0, dim, dtype=F64) + NOISE * torch.randn(
        NUM_DATA, generator=generator, dtype=F64
    )
    covariance = PRIOR_SCALE**2 * X @ X.T + NOISE**2 * torch.eye(NUM_DATA, dtype=F64)
    exact = float(dist.MultivariateNormal(torch.zeros(NUM_DATA, dtype=F64), covariance).log_prob(y))
    Xn, yn = X.numpy(), y.numpy()

    def log_likelihood(theta):
        residual = yn - Xn @ theta
        return -0.5 * float(residual @ residual) / NOISE**2 - NUM_DATA * math.log(
            NOISE * math.sqrt(2 * math.pi)
        )

    def prior_transform(u):
        return PRIOR_SCALE * special.ndtri(u)

    return {
        "model": gauss_regression,
        "args": (X, y),
        "exact": exact,
        "dim": dim,
        "nested": (log_likelihood, prior_transform),
    }


def normal_gamma_problem(dim: int, tutorial, seed: int = 0) -> dict:
    X = torch.cat([torch.ones(NUM_DATA, 1, dtype=F64), correlated_features(dim - 2, seed)], 1)
    generator = torch.Generator().manual_seed(seed + 200)
    beta = torch.linspace(0.5, -1.0, dim - 1, dtype=F64)
    y = X @ beta + 0.5 * torch.randn(NUM_DATA, generator=generator, dtype=F64)
    log_likelihood, prior_transform, _ = tutorial.normal_gamma_nested_sampling_problem(X, y)
    return {
        "model": tutorial.normal_gamma_regression,
        "args": (X, y),
        "exact": tutorial.normal_gamma_log_evidence(X, y),
        "dim": dim,
        "nested": (log_likelihood, prior_transform),
    }


def logistic_problem(dim: int, reference_points: tuple[int, int], seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed + 300)
    X = torch.randn(NUM_DATA, dim, generator=generator, dtype=F64)
    w = torch.tensor([1.0, -2.0, 0.5][:dim], dtype=F64)
    y = torch.bernoulli(torch.sigmoid(X @ w), generator=generator)
    fine, coarse = (
        opqa_evidence(logistic_regression, X, y, num_points=m, chunk_size=8192).log_evidence
        for m in reference_points
    )
    Xn, yn = X.numpy(), y.numpy()

    def log_likelihood(theta):
        logits = Xn @ theta
        return float(-np.sum(np.logaddexp(0.0, np.where(yn > 0, -logits, logits))))

    return {
        "model": logistic_regression,
        "args": (X, y),
        "exact": fine,
        "dim": dim,
        "nested": (log_likelihood, special.ndtri),
        "reference": f"GH {reference_points[0]}^{dim}, "
        f"{abs(fine - coarse):.0e} from {reference_points[1]}^{dim}",
    }


# ----------------------------------------------------------------------------- runs


def run_opqa(problem, num_points) -> list[dict]:
    rows = []
    for m in num_points:
        result = opqa_evidence(problem["model"], *problem["args"], num_points=m, chunk_size=8192)
        rows.append(
            {
                "method": "OPQA",
                "setting": f"{m} points",
                "evaluations": result.num_evaluations,
                "error": abs(result.log_evidence - problem["exact"]),
                "time_s": result.diagnostics["time_s"],
            }
        )
    return rows


def run_importance(problem, label, guide, samples, repeats, extra=0, extra_time=0.0):
    rows = []
    for n in samples:
        errors, times = [], []
        for seed in range(repeats):
            pyro.set_rng_seed(seed)
            estimate = importance_log_evidence(
                problem["model"], guide, *problem["args"], num_samples=n
            )
            errors.append(abs(estimate.log_evidence - problem["exact"]))
            times.append(estimate.time_s)
        rows.append(
            {
                "method": label,
                "setting": f"{n} samples",
                "evaluations": n + extra,
                "error": statistics.median(errors),
                "time_s": statistics.median(times) + extra_time,
            }
        )
    return rows


def fit_guide(problem, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(problem["model"])
    svi = SVI(problem["model"], guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(*problem["args"])
    return guide, time.perf_counter() - start


def run_dynesty(problem, nlives, repeats) -> list[dict]:
    log_likelihood, prior_transform = problem["nested"]
    rows = []
    for nlive in nlives:
        estimates = [
            nested_sampling_log_evidence(
                log_likelihood, prior_transform, problem["dim"], nlive=nlive, dlogz=0.01, seed=seed
            )
            for seed in range(repeats)
        ]
        rows.append(
            {
                "method": "dynesty",
                "setting": f"nlive {nlive}",
                "evaluations": int(statistics.median(e.num_evaluations for e in estimates)),
                "error": statistics.median(
                    abs(e.log_evidence - problem["exact"]) for e in estimates
                ),
                "time_s": statistics.median(e.time_s for e in estimates),
            }
        )
    return rows


def goals(name, problem, rows) -> list[str]:
    opqa = [row for row in rows if row["method"] == "OPQA"]
    lines = []
    best = min(row["error"] for row in opqa)
    if name.startswith("linreg"):
        hit = [row for row in opqa if row["error"] < 1e-8]
        first = min(hit, key=lambda row: row["evaluations"]) if hit else None
        lines.append(
            f"| {name} | < 1e-8 nats | "
            + (
                f"met: {first['error']:.1e} with {first['setting']} ({first['evaluations']} "
                f"evaluations) |"
                if first
                else f"missed: best {best:.1e} |"
            )
        )
    else:
        budget = 20 ** problem["dim"]
        within = [row for row in opqa if row["evaluations"] <= budget]
        top = min(within, key=lambda row: row["error"])
        verdict = "met" if top["error"] < 1e-6 else "missed"
        lines.append(
            f"| {name} | < 1e-6 nats within 20^d = {budget} evaluations | {verdict}: "
            f"{top['error']:.1e} with {top['setting']} ({top['evaluations']}) |"
        )
    for row in (r for r in rows if r["method"] == "dynesty"):
        cheap = [r for r in opqa if r["evaluations"] <= row["evaluations"] / 10]
        if not cheap:
            lines.append(
                f"| {name} | 100x dynesty {row['setting']} at 1/10 of its "
                f"{row['evaluations']} evaluations | missed: no OPQA run that cheap |"
            )
            continue
        top = min(cheap, key=lambda r: r["error"])
        ratio = row["error"] / max(top["error"], 1e-16)
        verdict = "met" if ratio >= 100 else "missed"
        lines.append(
            f"| {name} | 100x dynesty {row['setting']} ({row['error']:.1e}, "
            f"{row['evaluations']} evaluations) at 1/10 of its evaluations | {verdict}: "
            f"OPQA {top['setting']} {top['error']:.1e} ({top['evaluations']}), "
            f"{ratio:.0e}x |"
        )
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="OPQA evidence benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer settings and repeats")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    tutorial = _tutorial()
    quick = options.quick
    repeats = 2 if quick else 5
    nested_repeats = 1 if quick else 3
    svi_steps = 300 if quick else 2000
    problems = {
        "linreg-gauss d=2": gauss_problem(2),
        "linreg-gauss d=5": gauss_problem(5),
        "linreg-normal-gamma d=2": normal_gamma_problem(2, tutorial),
        "linreg-normal-gamma d=5": normal_gamma_problem(5, tutorial),
        "logistic d=2": logistic_problem(2, (24, 18) if quick else (64, 48)),
        "logistic d=3": logistic_problem(3, (16, 12) if quick else (40, 30)),
    }
    points = {
        2: [1, 2, 4, 6, 8, 10, 12, 14, 16, 19, 24],
        3: [1, 2, 4, 6, 8, 10, 12, 14, 16, 19],
        5: [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16],
    }
    samples = [100, 1000, 10_000, 100_000] + ([] if quick else [1_000_000])
    nlives = [100, 500] if quick else [100, 250, 500, 1000]
    all_goals = []
    for name, problem in problems.items():
        m_list = [m for m in points[problem["dim"]] if not quick or m <= 8]
        rows = run_opqa(problem, m_list)
        rows += run_importance(
            problem, "IS (prior)", prior_guide(problem["model"]), samples, repeats
        )
        guide, fit_time = fit_guide(problem, svi_steps)
        rows += run_importance(problem, "IS (guide)", guide, samples, repeats, svi_steps, fit_time)
        rows += run_dynesty(problem, nlives, nested_repeats)
        print(
            f"\n### {name}: exact log evidence {problem['exact']:.10f}"
            + (f" (reference: {problem['reference']})" if "reference" in problem else "")
            + "\n"
        )
        print("| method | setting | evaluations | abs. error (nats) | time (s) |")
        print("|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['method']} | {row['setting']} | {row['evaluations']} | "
                f"{row['error']:.1e} | {row['time_s']:.2f} |"
            )
        all_goals += goals(name, problem, rows)
    print("\n### Goals\n")
    print("| model | goal | result |")
    print("|---|---|---|")
    print("\n".join(all_goals))


if __name__ == "__main__":
    main()
