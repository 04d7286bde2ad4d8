"""Model comparison with Bayes factors: OPQA against importance sampling and nested sampling.

Which polynomial degree explains the data? Each degree is a Bayesian linear regression with an
unknown noise precision (a normal-gamma prior), so its evidence has a closed form and every
estimator can be scored against the truth:

- OPQA (``pyro_quadvi.opqa_evidence``, Laplace-centred Gauss-Hermite, a few hundred evaluations);
- Pyro's importance sampling (``vectorized_importance_weights``) with the prior as the proposal
  and with a fitted ``AutoMultivariateNormal`` guide;
- dynesty's nested sampler, if it is installed (``pip install "pyro-quadvi[evidence]"``).

Run::

    python tutorials/evidence_comparison.py                 # full study, writes the plot
    python tutorials/evidence_comparison.py --quick         # reduced, about 20 s (CI runs it)
    python tutorials/evidence_comparison.py --out out.png   # where the error plot goes

The plot goes to ``docs/img/evidence_comparison.png``; ``--quick`` without ``--out`` writes
``evidence_comparison.png`` to the temporary directory (``tempfile.gettempdir()``) and leaves the
committed figure alone.

The log Bayes factor of degree ``k`` against degree ``j`` is ``log p(y | k) - log p(y | j)``; the
data below come from a quadratic, so degree 2 should win: lower degrees miss the curvature,
higher ones pay an Occam penalty for the coefficients they do not need.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal
from scipy import special

from pyro_quadvi import opqa_evidence
from pyro_quadvi.evidence import (
    EvidenceEstimate,
    importance_log_evidence,
    nested_sampling_log_evidence,
    prior_guide,
)

F64 = torch.float64
FIGURE = "docs/img/evidence_comparison.png"  # of the full run
PRIOR = {"concentration": 2.0, "rate": 1.0, "coefficient_precision": 0.25}


# ----------------------------------------------------------------------------- the models


def polynomial_data(n: int = 30, noise: float = 0.3, seed: int = 0):
    """``y = 0.5 - x + 1.5 x^2 + noise`` at ``n`` points of ``[-1, 1]``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.linspace(-1.0, 1.0, n, dtype=F64)
    y = 0.5 - x + 1.5 * x**2 + noise * torch.randn(n, generator=generator, dtype=F64)
    return x, y


def design(x: torch.Tensor, degree: int) -> torch.Tensor:
    """The columns ``1, x, ..., x^degree``."""
    return torch.stack([x**k for k in range(degree + 1)], -1)


def normal_gamma_regression(X: torch.Tensor, y: torch.Tensor) -> None:
    """``tau ~ Gamma(a, b)``, ``beta | tau ~ N(0, I / (lam tau))``, ``y ~ N(X beta, I / tau)``.

    Written to run under Pyro's particle plates (``tau`` may carry batch dimensions on its left).
    """
    tau = pyro.sample(
        "tau",
        dist.Gamma(torch.tensor(PRIOR["concentration"], dtype=F64), PRIOR["rate"]),
    )
    scale = (PRIOR["coefficient_precision"] * tau) ** -0.5
    zeros = torch.zeros(X.shape[1], dtype=F64)
    beta = pyro.sample("beta", dist.Normal(zeros, scale.unsqueeze(-1)).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal((X * beta).sum(-1), tau**-0.5), obs=y)


def normal_gamma_log_evidence(X: torch.Tensor, y: torch.Tensor) -> float:
    """The closed form: ``y`` is multivariate Student-t under the normal-gamma prior."""
    a, b, lam = PRIOR["concentration"], PRIOR["rate"], PRIOR["coefficient_precision"]
    n, p = X.shape
    precision = X.T @ X + lam * torch.eye(p, dtype=F64)
    mean = torch.linalg.solve(precision, X.T @ y)
    a_n = a + 0.5 * n
    b_n = b + 0.5 * float(y @ y - mean @ precision @ mean)
    return (
        -0.5 * n * math.log(2 * math.pi)
        + 0.5 * (p * math.log(lam) - float(torch.logdet(precision)))
        + a * math.log(b)
        - a_n * math.log(b_n)
        + math.lgamma(a_n)
        - math.lgamma(a)
    )


def normal_gamma_nested_sampling_problem(X: torch.Tensor, y: torch.Tensor):
    """dynesty's likelihood and prior transform for the parameters ``(tau, beta)``."""
    a, b, lam = PRIOR["concentration"], PRIOR["rate"], PRIOR["coefficient_precision"]
    Xn, yn = X.numpy(), y.numpy()
    n = len(yn)

    def log_likelihood(theta: np.ndarray) -> float:
        tau, beta = theta[0], theta[1:]
        residual = yn - Xn @ beta
        return 0.5 * n * math.log(tau / (2 * math.pi)) - 0.5 * tau * float(residual @ residual)

    def prior_transform(u: np.ndarray) -> np.ndarray:
        tau = max(special.gammaincinv(a, u[0]) / b, 1e-300)  # the Gamma(a, b) quantile
        return np.concatenate([[tau], special.ndtri(u[1:]) / math.sqrt(lam * tau)])

    return log_likelihood, prior_transform, X.shape[1] + 1


# ----------------------------------------------------------------------------- the estimators


def opqa_estimate(X, y, num_points: int) -> EvidenceEstimate:
    result = opqa_evidence(normal_gamma_regression, X, y, num_points=num_points)
    return EvidenceEstimate(
        result.log_evidence,
        0.0,
        result.num_evaluations,
        result.diagnostics["time_s"],
        {"num_points": num_points},
    )


def fit_guide(X, y, steps: int, seed: int = 0) -> AutoMultivariateNormal:
    """An ``AutoMultivariateNormal`` fitted by SVI (Trace_ELBO, Adam); one evaluation a step."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMultivariateNormal(normal_gamma_regression)
    svi = SVI(normal_gamma_regression, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    for _ in range(steps):
        svi.step(X, y)
    return guide


def importance_estimate(
    X, y, guide: Callable, num_samples: int, extra_evaluations: int = 0, seed: int = 0
) -> EvidenceEstimate:
    pyro.set_rng_seed(seed)
    estimate = importance_log_evidence(
        normal_gamma_regression, guide, X, y, num_samples=num_samples
    )
    estimate.num_evaluations += extra_evaluations
    return estimate


def nested_estimate(X, y, nlive: int, seed: int = 0) -> EvidenceEstimate:
    log_likelihood, prior_transform, ndim = normal_gamma_nested_sampling_problem(X, y)
    return nested_sampling_log_evidence(
        log_likelihood, prior_transform, ndim, nlive=nlive, dlogz=0.01, seed=seed
    )


def dynesty_available() -> bool:
    try:
        import dynesty  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- the study


def compare_degrees(x, y, degrees, settings) -> list[dict]:
    """Every estimator on every degree: one row per (degree, method)."""
    rows = []
    for degree in degrees:
        X = design(x, degree)
        exact = normal_gamma_log_evidence(X, y)
        start = time.perf_counter()
        guide = fit_guide(X, y, settings["svi_steps"])
        fit_time = time.perf_counter() - start
        estimates = {
            "OPQA": opqa_estimate(X, y, settings["num_points"]),
            "IS (prior)": importance_estimate(
                X, y, prior_guide(normal_gamma_regression), settings["num_samples"]
            ),
            "IS (guide)": importance_estimate(
                X, y, guide, settings["num_samples"], settings["svi_steps"]
            ),
        }
        estimates["IS (guide)"].time_s += fit_time
        if settings["nlive"]:
            estimates["dynesty"] = nested_estimate(X, y, settings["nlive"])
        for method, estimate in estimates.items():
            rows.append(
                {
                    "degree": degree,
                    "dim": degree + 2,
                    "method": method,
                    "exact": exact,
                    "log_evidence": estimate.log_evidence,
                    "error": abs(estimate.log_evidence - exact),
                    "evaluations": estimate.num_evaluations,
                    "time_s": estimate.time_s,
                }
            )
    return rows


def convergence(x, y, degree: int, settings) -> dict[str, list[tuple[int, float]]]:
    """(evaluations, error) pairs of each estimator on one model, for the plot."""
    X = design(x, degree)
    exact = normal_gamma_log_evidence(X, y)
    curves: dict[str, list[tuple[int, float]]] = {}
    curves["OPQA"] = [
        (e.num_evaluations, abs(e.log_evidence - exact))
        for e in (opqa_estimate(X, y, m) for m in settings["opqa_points"])
    ]
    prior = prior_guide(normal_gamma_regression)
    curves["IS (prior)"] = [
        (e.num_evaluations, abs(e.log_evidence - exact))
        for e in (importance_estimate(X, y, prior, n) for n in settings["is_samples"])
    ]
    guide = fit_guide(X, y, settings["svi_steps"])
    curves["IS (guide)"] = [
        (e.num_evaluations, abs(e.log_evidence - exact))
        for e in (
            importance_estimate(X, y, guide, n, settings["svi_steps"])
            for n in settings["is_samples"]
        )
    ]
    if settings["nlive_curve"]:
        curves["dynesty"] = [
            (e.num_evaluations, abs(e.log_evidence - exact))
            for e in (nested_estimate(X, y, n) for n in settings["nlive_curve"])
        ]
    return curves


def plot(curves: dict[str, list[tuple[int, float]]], path: str, degree: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    markers = {"OPQA": "o-", "IS (prior)": "s--", "IS (guide)": "^--", "dynesty": "D:"}
    for method, points in curves.items():
        evaluations, errors = zip(*points)
        axes.loglog(evaluations, np.maximum(errors, 1e-16), markers[method], label=method)
    axes.set_xlabel("log-likelihood evaluations")
    axes.set_ylabel("|log evidence error| (nats)")
    axes.set_title(f"Evidence of a degree-{degree} polynomial regression (d = {degree + 2})")
    axes.grid(True, which="major", alpha=0.4)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_table(rows: list[dict]) -> None:
    print("| degree | d | method | log evidence | error (nats) | evaluations | time (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['degree']} | {row['dim']} | {row['method']} | {row['log_evidence']:.6f} | "
            f"{row['error']:.1e} | {row['evaluations']} | {row['time_s']:.2f} |"
        )


def bayes_factors(rows: list[dict], method: str) -> dict[int, float]:
    """log Bayes factor of each degree against the best one, by ``method`` (or the exact)."""
    source = "OPQA" if method == "exact" else method  # any method's rows carry the exact value
    values = {
        row["degree"]: row["exact"] if method == "exact" else row["log_evidence"]
        for row in rows
        if row["method"] == source
    }
    best = max(values.values())
    return {degree: value - best for degree, value in values.items()}


SETTINGS = {
    "full": {
        "num_points": 10,
        "num_samples": 100_000,
        "svi_steps": 2000,
        "nlive": 500,
        "opqa_points": [2, 3, 4, 5, 6, 8, 10, 12],
        "is_samples": [100, 1000, 10_000, 100_000, 1_000_000],
        "nlive_curve": [50, 100, 250, 500, 1000],
    },
    "quick": {
        "num_points": 6,
        "num_samples": 2000,
        "svi_steps": 150,
        "nlive": 40,
        "opqa_points": [2, 4, 6],
        "is_samples": [100, 1000],
        "nlive_curve": [],
    },
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (CI)")
    parser.add_argument(
        "--out", help=f"the plot's path (default: {FIGURE}; the temporary dir if --quick)"
    )
    parser.add_argument("--no-dynesty", action="store_true", help="skip the nested sampler")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # small models: more threads only add synchronization overhead
    settings = dict(SETTINGS["quick" if options.quick else "full"])
    if options.no_dynesty or not dynesty_available():
        print("dynesty is not installed (or --no-dynesty): the nested sampler is skipped\n")
        settings["nlive"], settings["nlive_curve"] = 0, []

    x, y = polynomial_data()
    degrees = [0, 1, 2, 3]
    rows = compare_degrees(x, y, degrees, settings)
    print_table(rows)
    print()
    exact_factors = bayes_factors(rows, "exact")
    opqa_factors = bayes_factors(rows, "OPQA")
    print("| degree | log BF vs best (exact) | log BF vs best (OPQA) |")
    print("|---|---|---|")
    for degree in degrees:
        print(f"| {degree} | {exact_factors[degree]:.4f} | {opqa_factors[degree]:.4f} |")
    chosen = max(opqa_factors, key=opqa_factors.get)
    print(f"\nOPQA picks degree {chosen} (the data are quadratic).\n")

    curves = convergence(x, y, 2, settings)
    default = (
        os.path.join(tempfile.gettempdir(), "evidence_comparison.png") if options.quick else FIGURE
    )
    out = options.out or default
    plot(curves, out, 2)
    print(f"error against evaluations (degree 2) saved to {out}")
    return {
        "out": out,
        "rows": rows,
        "chosen": chosen,
        "curves": curves,
        "bayes_factors": opqa_factors,
    }


if __name__ == "__main__":
    main()
