"""Which quadrature rule should ``QuadratureELBO`` use by default? (issue 10)

Every rule is fitted with ``AutoMeanFieldNormal`` and ``QNVB()`` (its defaults) at an EQUAL number
of gradient evaluations: a rule with ``K`` nodes costs ``K`` evaluations per step, so it takes
``budget / K`` steps. Adam (lr 1e-2) with Pyro's ``Trace_ELBO`` (one evaluation per step) is a
reference row. Rules: ``rasp_simplex`` 3, ``rasp_cross`` 4 and 6, ``hadamard`` 4 and 8,
``blocked_simplex`` 3, ``vrmc2`` 3 and ``mc`` 3 (the Monte Carlo baseline).

Problems:

* with the optimal mean field known (``pyro_quadvi.testing``): linear regression (d = 100,
  AR(1) design rho = 0.5), logistic regression (d = 20, n = 500), non-centred eight schools. The
  metric is the exact mean-field ELBO's gap to the optimum (nats), and the distance
  ``max_i max(|mu_i - mu*_i| / sigma*_i, |sigma_i / sigma*_i - 1|)``;
* models of Pyro's examples (``benchmarks/models.py``): eight schools as in
  ``examples/eight_schools/svi.py``, the partially pooled baseball model (Efron-Morris table), the
  Bayesian regression tutorial (generated data of the rugged table's shape: the CSV is a
  download), the Gaussian mixture tutorial with the assignment summed out, and a 1-50-1 Bayesian
  network. The metric is the ELBO of the final guide by ``Trace_ELBO(num_particles=4096,
  vectorize_particles=True)`` under one fixed seed (common random numbers for every row), and its
  gap to the best row of the problem.

Each cell is the mean +- standard deviation over ``--seeds`` seeds (the seed of the fit; the
evaluation draws are the same for all). ``ms/step`` is the median wall time of one SVI step over
the seeds, the ELBO evaluations excluded.

Usage::

    python benchmarks/bench_rules.py                     # everything, 3000 evaluations, 3 seeds
    python benchmarks/bench_rules.py --problems pyro-eight-schools --budget 9000
    python benchmarks/bench_rules.py --problems pyro-eight-schools --first-steps 6 --seeds 1

``--first-steps N`` prints instead the first ``N`` steps of ``QNVB + QuadratureELBO()`` (the
package's defaults, or ``--rule`` and ``--num-points``) in float32, as a user runs Pyro's
examples: the loss and, per latent site, the largest scale and its location. ``--peaks N`` prints
one line: the largest loss of the first ``N`` steps for each seed. The table runs in float64::

    python benchmarks/bench_rules.py --problems pyro-eight-schools --peaks 30 --seeds 10 \
        --rule blocked_simplex --num-points 3
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyro
import pyro.optim
import torch
from pyro.infer import SVI, Trace_ELBO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_qnvb import Method
from models import (
    GMM_DATA,
    BayesianNetwork,
    BayesianRegression,
    baseball_data,
    baseball_partially_pooled,
    eight_schools_pyro,
    eight_schools_pyro_data,
    gmm_marginalized,
    network_data,
    rugged_like_data,
)

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.testing import (
    MeanFieldProblem,
    eight_schools,
    linear_regression,
    logistic_regression,
)

EVAL_PARTICLES = 4096
EVAL_SEED = 20260
RULES = [
    ("rasp_simplex", 3),
    ("rasp_cross", 4),
    ("rasp_cross", 6),
    ("hadamard", 4),
    ("hadamard", 8),
    ("blocked_simplex", 3),
    ("vrmc2", 3),
    ("mc", 3),
]


def methods(scale_max: float | None = None) -> list[Method]:
    """The rows; ``scale_max`` overrides ``QNVB``'s per-step growth bound of the scales."""
    options = {} if scale_max is None else {"scale_max": scale_max}
    out = [
        Method(
            f"QNVB + {rule} {k}",
            lambda: QNVB(**options),
            lambda rule=rule, k=k: QuadratureELBO(rule, num_points=k),
            k,
        )
        for rule, k in RULES
    ]
    out.append(
        Method("Adam(1e-2) + Trace_ELBO", lambda: pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO, 1)
    )
    return out


@dataclass
class Problem:
    """A model with its arguments, and the metric of a fitted guide.

    ``exact`` is the testing problem when the optimal mean field is known, else ``None``.
    """

    name: str
    model: Callable
    args: tuple
    exact: MeanFieldProblem | None = None


def problems() -> dict[str, Callable[[], Problem]]:
    def exact(problem: MeanFieldProblem) -> Problem:
        return Problem(problem.name, problem.model, (), problem)

    return {
        "linear-d100": lambda: exact(linear_regression(100, 0.5)[0]),
        "logistic-d20": lambda: exact(logistic_regression(20, 500)[0]),
        "eight-schools": lambda: exact(eight_schools()),
        "pyro-eight-schools": lambda: Problem(
            "Pyro eight schools", eight_schools_pyro, (eight_schools_pyro_data(),)
        ),
        "baseball": lambda: Problem(
            "baseball (partially pooled)", baseball_partially_pooled, baseball_data()
        ),
        "regression": lambda: Problem(
            "Bayesian regression", BayesianRegression(), rugged_like_data()
        ),
        "mixture": lambda: Problem("Gaussian mixture", gmm_marginalized, (torch.tensor(GMM_DATA),)),
        "network": lambda: Problem("1-50-1 network", BayesianNetwork(), network_data()),
    }


def flat_mean_field(guide, problem: MeanFieldProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """The guide's ``(loc, scale)`` laid end to end in the order of the problem's sites."""
    locs, scales = [], []
    for name, _ in problem.sites:
        locs.append(getattr(guide.locs, name).detach().reshape(-1))
        scales.append(getattr(guide.scales, name).detach().reshape(-1))
    return torch.cat(locs), torch.cat(scales)


def score(problem: Problem, guide) -> dict[str, float]:
    """``gap`` (nats above the optimum; for models without one, the negative ELBO) and, for the
    exact problems, ``distance`` to the optimal mean field."""
    if problem.exact is not None:
        mu, sigma = flat_mean_field(guide, problem.exact)
        best = float(problem.exact.neg_elbo(problem.exact.mu, problem.exact.sigma))
        return {
            "gap": float(problem.exact.neg_elbo(mu, sigma)) - best,
            "distance": problem.exact.error(mu, sigma),
        }
    elbo = Trace_ELBO(num_particles=EVAL_PARTICLES, vectorize_particles=True)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        pyro.set_rng_seed(EVAL_SEED)
        return {"gap": elbo.loss(problem.model, guide, *problem.args)}


def fit(problem: Problem, method: Method, budget: int, checks: list[int], seed: int):
    """Fit to ``budget`` evaluations; scores at each evaluation count in ``checks``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(problem.model)
    svi = SVI(problem.model, guide, method.optimizer(), method.loss())
    scores, seconds = {}, 0.0
    steps = budget // method.evals_per_step
    check_steps = {max(1, c // method.evals_per_step): c for c in checks}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        try:
            loss = svi.step(*problem.args)
        except ValueError as error:  # QuadratureELBO refuses a non-finite loss
            print(f"{method.name}, seed {seed}, step {step}: {error}", file=sys.stderr)
            loss = math.nan
        seconds += time.perf_counter() - start
        if not math.isfinite(loss):
            return None, seconds / step
        if step in check_steps:
            scores[check_steps[step]] = score(problem, guide)
    return scores, seconds / steps


def first_steps(problem: Problem, steps: int, seed: int, elbo: QuadratureELBO) -> None:
    """Print the loss of each of the first ``steps`` steps of ``QNVB`` with ``elbo`` and, per
    site, the largest scale of the guide the step evaluated, with its location."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(problem.model)
    svi = SVI(problem.model, guide, QNVB(), elbo)
    guide(*problem.args)
    names = [name.removesuffix("_unconstrained") for name, _ in guide.locs.named_parameters()]
    print(f"seed {seed}: step, loss, then per site max scale (its loc)\n")
    print("| step | loss | " + " | ".join(names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for step in range(steps):
        cells = []
        for name in names:
            loc = getattr(guide.locs, name).detach().reshape(-1)
            scale = getattr(guide.scales, name).detach().reshape(-1)
            i = int(scale.argmax())
            cells.append(f"{scale[i]:.3g} ({loc[i]:.3g})")
        loss = svi.step(*problem.args)
        print(f"| {step} | {loss:.4g} | " + " | ".join(cells) + " |")
    print()


def peak(problem: Problem, steps: int, seed: int, elbo: QuadratureELBO) -> float:
    """The largest loss of the first ``steps`` steps of ``QNVB`` with ``elbo``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(problem.model)
    svi = SVI(problem.model, guide, QNVB(), elbo)
    return max(svi.step(*problem.args) for _ in range(steps))


def cell(values: list[float]) -> str:
    if not values:
        return "diverged"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="*", default=None, help="default: all")
    parser.add_argument("--budget", type=int, default=3000, help="gradient evaluations per fit")
    parser.add_argument("--early", type=int, default=300, help="also score at this many")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-steps", type=int, default=0, help="print the first N steps")
    parser.add_argument("--peaks", type=int, default=0, help="largest loss of the first N steps")
    parser.add_argument("--rule", default=None, help="for --first-steps, --peaks: the rule")
    parser.add_argument("--num-points", type=int, default=None, help="... and its num_points")
    parser.add_argument(
        "--scale-max", type=float, default=None, help="QNVB's scale_max (default: its own, 10)"
    )
    args = parser.parse_args(argv)
    trace = args.first_steps or args.peaks
    if not trace:
        torch.set_default_dtype(torch.float64)
    logging.getLogger("pyro").setLevel(logging.WARNING)  # "Guessed max_plate_nesting" per score
    all_problems = problems()
    checks = [args.early, args.budget]
    scale_max = "" if args.scale_max is None else f", QNVB(scale_max={args.scale_max:g})"
    print(
        f"{args.budget} gradient evaluations per fit (also scored at {args.early}), "
        f"{args.seeds} seeds{scale_max}; torch {torch.__version__}, pyro {pyro.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    for key in args.problems or list(all_problems):
        problem = all_problems[key]()
        if trace:
            for seed in range(args.seeds):
                elbo = (
                    QuadratureELBO()
                    if args.rule is None
                    else QuadratureELBO(args.rule, num_points=args.num_points)
                )
                if args.first_steps:
                    first_steps(problem, args.first_steps, seed, elbo)
                else:
                    print(f"seed {seed}: {peak(problem, args.peaks, seed, elbo):.3g}")
            continue
        rows = {}
        for method in methods(args.scale_max):
            runs = [fit(problem, method, args.budget, checks, seed) for seed in range(args.seeds)]
            rows[method.name] = runs
        exact = problem.exact is not None
        finals = {
            name: [r[0][args.budget]["gap"] for r in runs if r[0] is not None]
            for name, runs in rows.items()
        }
        best = 0.0 if exact else min(statistics.mean(v) for v in finals.values() if v)
        unit = "nats above the optimal mean field" if exact else "nats below the best row"
        print(f"### {problem.name} ({key}; gap in {unit})\n")
        header = f"| method | evals/step | gap at {args.early} | gap at {args.budget} |"
        header += " distance |" if exact else " ELBO |"
        print(header + " ms/step |")
        print("|---|---:|---:|---:|---:|---:|")
        for method in methods(args.scale_max):
            runs = rows[method.name]
            done = [r for r in runs if r[0] is not None]
            early = [r[0][args.early]["gap"] - best for r in done]
            final = [r[0][args.budget]["gap"] - best for r in done]
            if exact:
                extra = cell([r[0][args.budget]["distance"] for r in done])
            else:
                extra = cell([-r[0][args.budget]["gap"] for r in done])
            if len(done) < len(runs):
                extra += f" ({len(runs) - len(done)} diverged)"
            ms = 1e3 * statistics.median(r[1] for r in runs)
            print(
                f"| {method.name} | {method.evals_per_step} | {cell(early)} | {cell(final)} | "
                f"{extra} | {ms:.2f} |"
            )
        print(flush=True)


if __name__ == "__main__":
    main()
