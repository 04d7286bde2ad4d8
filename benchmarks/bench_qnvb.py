"""QNVB against Adam: gradient evaluations and wall time to reach the optimal mean field.

Suite (issue 4): Bayesian linear regression (d = 10, 100, 1000; AR(1) designs with rho = 0, 0.5,
0.9), logistic regression (d = 20, 100), eight schools, a small Bayesian network. Methods:
QNVB + QuadratureELBO (rasp_simplex 3, hadamard 4), QNVB + Trace_ELBO, Adam + QuadratureELBO and
Adam + Trace_ELBO at lr 1e-3, 1e-2, 1e-1, all with ``AutoMeanFieldNormal`` and default settings.

Target: within 5% of the optimal sigma (``max_i |mu_i - mu*_i| / sigma*_i`` and
``|sigma_i / sigma*_i - 1|``) for linear regression, where the optimum is known in closed form;
the exact mean-field ELBO within 0.1 nats of the tightly converged reference for logistic
regression and eight schools; and, for the network, a fixed-draw Monte Carlo ELBO within 0.1 nats
of the best ELBO any method reached. A run *reaches* the target at the first evaluation count
after which it stays within it until the end of the run; a run stops at ``--max-evals`` or once it
has stayed within the target for as long again as it took to get there (at least 100 steps).
Gradient evaluations count one per node (QuadratureELBO: 3 or 4 per step) or per particle
(Trace_ELBO: 1 per step). Wall time counts the SVI steps only, not the error checks.

Usage::

    python benchmarks/bench_qnvb.py                      # the whole suite
    python benchmarks/bench_qnvb.py --problems linear-d10-rho0.9 eight-schools --max-evals 5000
    python benchmarks/bench_qnvb.py --methods "QNVB + Trace_ELBO" "Adam(1e-02) + Trace_ELBO"
    python benchmarks/bench_qnvb.py --problems network --max-evals 100000 --check-every 2500 \
        --history                                    # every checked value, not only the last
    python benchmarks/bench_qnvb.py --ablate none damping drift-forgetting \
        --methods "QNVB + QuadratureELBO(hadamard 4)"   # QNVB with one rule switched off per row

``--ablate`` runs the QNVB methods only, once per named ablation (``none``: the defaults), each
switching one rule of :func:`~pyro_quadvi.optim.qnvb_functional.qnvb_update` off through its
hyperparameters (see ``ABLATIONS``); ``--methods`` then names the QNVB methods without the suffix.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import pyro
import pyro.optim
import torch
from pyro.infer import SVI, Trace_ELBO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyro_quadvi import QNVB, QuadratureELBO
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.testing import (
    MeanFieldProblem,
    eight_schools,
    linear_regression,
    logistic_regression,
    small_network,
)

TOLERANCE_SIGMA = 0.05
TOLERANCE_NATS = 0.1

ABLATIONS: dict[str, dict] = {
    "none": {},
    "rms-curvature": {"curvature": "rms"},  # the reference's sqrt(mean(h^2)), no test
    "damping": {"damping": False},
    "damping-recovery-1": {"damping_recovery": 1.0},  # the symmetric rule
    # a recovery above 1: k shrinks unless more than r / (1 + r) of the steps flip the sign (noise:
    # half of them; an oscillation: all)
    "damping-recovery-1.5": {"damping_recovery": 1.5},
    "damping-recovery-2": {"damping_recovery": 2.0},
    "drift-forgetting": {"drift_forgetting": 0.0},
    "lr-cap": {"lr": math.inf},  # the full quasi-Newton step
    "scale-limit": {"scale_min": 1e-100, "scale_max": math.inf},
    "sigma-bounds": {"sigma_min": 1e-100, "sigma_max": 1e100},
    "beta1": {"betas": (0.9, 0.999)},  # switched on: the reference's gradient average
    "recent-fraction-0.5": {"recent_fraction": 0.5},  # switched on: a window of t / 2 at most
    "recent-fraction-0.1": {"recent_fraction": 0.1},  # the annealing default: t / 10 at most
    "significance-1": {"significance": 1.0},  # switched on: one standard error
    # candidate step caps (issue 11, "QNVB step cap default"), named by their values
    "lr-1": {"lr": 1.0},
    "lr-0.3": {"lr": 0.3},
    "lr-0.1": {"lr": 0.1},
    "trust-1": {"trust_region": 1.0},
    "trust-3": {"trust_region": 3.0},
    # the wide-network setting of docs/nn.md (issue 11, "Wide MLP: making QNVB optimize")
    "wide": {"trust_region": 0.3, "scale_max": 2.0},
    "wide-significance-1": {"trust_region": 0.3, "scale_max": 2.0, "significance": 1.0},
}
"""Each ablation's hyperparameters: one rule of the update switched off (or, for ``beta1``,
``recent-fraction-0.5`` and ``significance-1``, on: they are off by default)."""


@dataclass
class Method:
    name: str
    optimizer: Callable[[], object]
    loss: Callable[[], object]
    evals_per_step: int


def qnvb_methods(ablation: str = "none") -> list[Method]:
    """The QNVB methods, with the hyperparameters of ``ABLATIONS[ablation]``."""

    def make() -> QNVB:
        return QNVB(**ABLATIONS[ablation])

    suffix = "" if ablation == "none" else f" [ablate {ablation}]"
    return [
        Method(
            "QNVB + QuadratureELBO(rasp_simplex 3)" + suffix,
            make,
            lambda: QuadratureELBO(rule="rasp_simplex"),
            3,
        ),
        Method(
            "QNVB + QuadratureELBO(hadamard 4)" + suffix,
            make,
            lambda: QuadratureELBO(rule="hadamard"),
            4,
        ),
        Method("QNVB + Trace_ELBO" + suffix, make, Trace_ELBO, 1),
    ]


def methods() -> list[Method]:
    out = qnvb_methods()
    for lr in (1e-3, 1e-2, 1e-1):
        out.append(
            Method(
                f"Adam({lr:.0e}) + QuadratureELBO(rasp_simplex 3)",
                lambda lr=lr: pyro.optim.Adam({"lr": lr}),
                lambda: QuadratureELBO(rule="rasp_simplex"),
                3,
            )
        )
    for lr in (1e-3, 1e-2, 1e-1):
        out.append(
            Method(
                f"Adam({lr:.0e}) + Trace_ELBO",
                lambda lr=lr: pyro.optim.Adam({"lr": lr}),
                Trace_ELBO,
                1,
            )
        )
    return out


def problems() -> dict[str, Callable[[], MeanFieldProblem]]:
    out = {}
    for d in (10, 100, 1000):
        for rho in (0.0, 0.5, 0.9):
            out[f"linear-d{d}-rho{rho:g}"] = lambda d=d, rho=rho: linear_regression(d, rho)[0]
    out["logistic-d20"] = lambda: logistic_regression(20, 500)[0]
    out["logistic-d100"] = lambda: logistic_regression(100, 1000)[0]
    out["eight-schools"] = eight_schools
    out["network"] = small_network
    return out


def mean_field(guide, problem: MeanFieldProblem) -> tuple[torch.Tensor, torch.Tensor]:
    locs = [attrgetter(name)(guide.locs).detach().reshape(-1) for name, _ in problem.sites]
    scales = [attrgetter(name)(guide.scales).detach().reshape(-1) for name, _ in problem.sites]
    return torch.cat(locs), torch.cat(scales)


def make_metric(problem: MeanFieldProblem) -> tuple[Callable, float, str]:
    """``metric(mu, sigma)``, its tolerance and its unit."""
    if problem.name.startswith("linear"):
        return problem.error, TOLERANCE_SIGMA, "sigma"
    if problem.mu is not None:
        best = float(problem.neg_elbo(problem.mu, problem.sigma))
        return (lambda mu, sigma: float(problem.neg_elbo(mu, sigma)) - best), TOLERANCE_NATS, "nats"
    return (lambda mu, sigma: float(problem.neg_elbo(mu, sigma))), TOLERANCE_NATS, "nats"


@dataclass
class Run:
    evals: list[int]
    seconds: list[float]
    values: list[float]
    finite: bool


def run(problem, method: Method, loss, metric, tol, max_evals: int, check_every: int) -> Run:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(problem.model)
    svi = SVI(problem.model, guide, method.optimizer(), loss)
    evals, seconds, values = [], [], []
    elapsed, last_violation = 0.0, 0
    max_steps = max_evals // method.evals_per_step
    for step in range(1, max_steps + 1):
        start = time.perf_counter()
        try:
            loss_value = svi.step()
        except ValueError as error:  # the ELBO refuses a non-finite log density: diverged
            print(f"{method.name}: step {step}: {error}", file=sys.stderr)
            return Run(evals, seconds, values, False)
        elapsed += time.perf_counter() - start
        if not math.isfinite(loss_value):
            return Run(evals, seconds, values, False)
        if step % check_every and step != max_steps:
            continue
        value = metric(*mean_field(guide, problem))
        if not math.isfinite(value):
            return Run(evals, seconds, values, False)
        evals.append(step * method.evals_per_step)
        seconds.append(elapsed)
        values.append(value)
        if value > tol:
            last_violation = step
        elif step >= max(2 * last_violation, last_violation + 100):
            break
    return Run(evals, seconds, values, True)


def reached(run_: Run, tol: float) -> tuple[int | None, float | None]:
    """First evaluation count (and time) after which every checked value is within ``tol``."""
    index = None
    for i in range(len(run_.values) - 1, -1, -1):
        if run_.values[i] > tol:
            break
        index = i
    if index is None or not run_.finite:
        return None, None
    return run_.evals[index], run_.seconds[index]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="*", default=None, help="default: all")
    parser.add_argument("--methods", nargs="*", default=None, help="default: all")
    parser.add_argument("--max-evals", type=int, default=20000)
    parser.add_argument("--check-every", type=int, default=5, help="steps between error checks")
    parser.add_argument(
        "--history", action="store_true", help="also print every checked value of each run"
    )
    parser.add_argument(
        "--ablate",
        nargs="+",
        default=None,
        choices=sorted(ABLATIONS),
        help="QNVB methods only, once per ablation ('none': the defaults)",
    )
    args = parser.parse_args(argv)
    known = [m.name for m in (qnvb_methods() if args.ablate is not None else methods())]
    unknown = sorted(set(args.methods or ()) - set(known))
    if unknown:
        parser.error(f"unknown --methods {unknown}; known: {known}")
    torch.set_default_dtype(torch.float64)
    all_problems = problems()
    chosen = args.problems or list(all_problems)
    if args.ablate is None:
        chosen_methods = [m for m in methods() if args.methods is None or m.name in args.methods]
    else:
        chosen_methods = [
            m
            for ablation in args.ablate
            for m, base in zip(qnvb_methods(ablation), qnvb_methods())
            if args.methods is None or base.name in args.methods
        ]
    print(
        f"max {args.max_evals} gradient evaluations per run; torch {torch.__version__}, "
        f"pyro {pyro.__version__}, {torch.get_num_threads()} threads\n"
    )
    for key in chosen:
        problem = all_problems[key]()
        metric, tol, unit = make_metric(problem)
        results = {}
        for method in chosen_methods:
            results[method.name] = run(
                problem, method, method.loss(), metric, tol, args.max_evals, args.check_every
            )
        if problem.mu is None:  # the network: relative to the best ELBO reached
            best = min(min(r.values) for r in results.values() if r.values)
            for r in results.values():
                r.values = [v - best for v in r.values]
        print(f"### {key} (target: {tol:g} {unit})\n")
        print("| method | evaluations to target | seconds to target | final | worst |")
        print("|---|---:|---:|---:|---:|")
        for name, r in results.items():
            evals, secs = reached(r, tol)
            final = f"{r.values[-1]:.3g}" if r.values else "-"
            worst = f"{max(r.values):.3g}" if r.values else "-"
            if not r.finite:
                final = "diverged"
            print(
                f"| {name} | {evals if evals is not None else 'not reached'} | "
                f"{f'{secs:.2f}' if secs is not None else '-'} | {final} | {worst} |"
            )
        if args.history:
            for name, r in results.items():
                checks = " ".join(f"{e}:{v:.3g}" for e, v in zip(r.evals, r.values))
                print(f"\n{name} (evaluations:{unit}): {checks}")
        print(flush=True)


if __name__ == "__main__":
    main()
