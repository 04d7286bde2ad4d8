"""The default rule with and without its random signs: the skew of the fitted mean field.

``blocked_simplex`` (sequence paper, Section 3.1) as published permutes the simplex points within
each block but never flips them, so every coordinate gets the offsets ``{1.366, -0.366, -1}`` (K =
3) at every step: a third moment of +0.5. A cubic part of ``-log p`` then pushes the fit the same
way at every step. ``BlockedSimplexRule(random_signs=True)`` (an option, not the default)
multiplies each block's points by a random sign per draw. Two parts, both variants in the same
run:

* **skew**: ``AutoMeanFieldNormal`` on skewed posteriors, fitted with Adam (lr 0.02) and with
  ``QNVB()``; the metric is the bias of the fitted ``loc``, averaged over the last steps of the
  fit, against the optimal mean field, in units of its standard deviation ``sigma*`` (largest
  over the coordinates), with the standard error of that average from 10 batch means. Problems:
  ``z ~ Beta(2, 2)`` (logit space, symmetric: ``loc* = 0``), ``z ~ Gamma(2, 1)`` (log space), a
  ``HalfNormal`` scale of three observations (log space), and a logistic regression of ``d = 3``
  coefficients on ``n = 20`` rows (``pyro_quadvi.testing.logistic_regression``, whose optimal
  mean field is known). The 1-d references are the optimal Gaussian by Gauss-Hermite (40 nodes)
  and L-BFGS on the guide's parameters.
* **no regression**: a reduced run of the default-rule suite (``bench_rules.py``: the same
  problems, QNVB, equal evaluations, the same metrics) with the two variants.

Usage::

    python benchmarks/bench_blocked_signs.py                       # both parts
    python benchmarks/bench_blocked_signs.py --part skew --seeds 3
    python benchmarks/bench_blocked_signs.py --part suite --problems eight-schools --budget 6000
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyro
import pyro.distributions as dist
import pyro.optim
import torch
from pyro.infer import SVI
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_qnvb import Method
from bench_rules import cell, fit, problems

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.quadrature import (
    BlockedSimplexRule,
    NodeSet,
    QuadratureRule,
    make_rule,
    simplex_reference,
)
from pyro_quadvi.quadrature.base import equal_weights
from pyro_quadvi.testing import logistic_regression

VARIANTS = {"signed": True, "unsigned (paper, default)": False}
_ROW = simplex_reference(2)[0]  # the offsets of one coordinate of blocked_simplex 3
# skew part: rule rows, and the fixed 1-d offsets whose equal-weight quadrature is the rule's
# loss in expectation over its draws (its "target"): the paper's rule draws the same 3 offsets
# every step; a random sign averages them with their negatives; rasp_simplex 3 in one dimension
# draws the same 6 signed offsets as the signed rule; rasp_cross 6 is {+-sqrt(3), 0, 0, 0, 0}.
SKEW_RULES = {
    "blocked_simplex 3, signed": (
        lambda: BlockedSimplexRule(3, random_signs=True),
        torch.cat([_ROW, -_ROW]),
    ),
    "blocked_simplex 3, unsigned (paper, default)": (
        lambda: BlockedSimplexRule(3, random_signs=False),
        _ROW,
    ),
    "rasp_simplex 3": (lambda: make_rule("rasp_simplex", 3), torch.cat([_ROW, -_ROW])),
    "rasp_cross 6": (
        lambda: make_rule("rasp_cross", 6),
        torch.tensor([3**0.5, -(3**0.5), 0.0, 0.0, 0.0, 0.0], dtype=torch.float64),
    ),
}
HALFNORMAL_Y = torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64)
REFERENCE_NODES = 40


@dataclass
class Skewed:
    """A model with one latent site and its optimal mean field ``(loc*, sigma*)``."""

    name: str
    model: Callable[[], None]
    site: str
    loc: torch.Tensor
    sigma: torch.Tensor


def beta22():
    pyro.sample("z", dist.Beta(2.0, 2.0))


def gamma21():
    pyro.sample("z", dist.Gamma(2.0, 1.0))


def halfnormal_scale():
    s = pyro.sample("s", dist.HalfNormal(1.5))
    with pyro.plate("data", len(HALFNORMAL_Y)):
        pyro.sample("y", dist.Normal(0.0, s), obs=HALFNORMAL_Y)


class _FixedNodes(NodeSet):
    def __init__(self, offsets: torch.Tensor, dim: int, weights: torch.Tensor):
        super().__init__(dim, weights, name="fixed")
        self.offsets = offsets

    def node(self, k: int) -> torch.Tensor:
        return self.offsets[self._check_index(k)].expand(self.dim)


class FixedOffsets(QuadratureRule):
    """The same equal-weight offsets along every coordinate at every step (for 1-d targets)."""

    name = "fixed"
    exact_coordinate_quadratics = True

    def __init__(self, offsets: torch.Tensor):
        super().__init__(len(offsets))
        self.offsets = offsets

    def draw(self, dim, step=0, generator=None, dtype=None, device=None) -> NodeSet:
        dim, step, dtype = self.check_draw(dim, step, generator, dtype)
        weights = equal_weights(len(self.offsets), dtype, device)
        return _FixedNodes(self.offsets.to(weights), dim, weights)


def optimum(
    model: Callable[[], None], site: str, rule: QuadratureRule | None = None
) -> tuple[torch.Tensor, ...]:
    """The minimum of a deterministic quadrature loss of a 1-d model: L-BFGS on the guide's
    unconstrained parameters. ``rule=None``: Gauss-Hermite with ``REFERENCE_NODES`` nodes, the
    optimal mean field."""
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model)
    guide()
    if rule is None:
        elbo = QuadratureELBO("gauss_hermite", num_points=REFERENCE_NODES)
    else:
        elbo = QuadratureELBO(rule)
    params = [p for _, p in pyro.get_param_store().named_parameters()]
    optimizer = torch.optim.LBFGS(
        params,
        max_iter=500,
        tolerance_grad=1e-12,
        tolerance_change=0.0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimizer.zero_grad()
        loss = elbo.differentiable_loss(model, guide)
        loss.backward()
        return loss

    optimizer.step(closure)
    return (
        getattr(guide.locs, site).detach().clone(),
        getattr(guide.scales, site).detach().clone(),
    )


def skewed_problems() -> list[Skewed]:
    out = []
    for name, model, site in [
        ("Beta(2, 2)", beta22, "z"),
        ("Gamma(2, 1)", gamma21, "z"),
        ("HalfNormal scale, 3 obs", halfnormal_scale, "s"),
    ]:
        loc, sigma = optimum(model, site)
        out.append(Skewed(name, model, site, loc.reshape(-1), sigma.reshape(-1)))
    problem = logistic_regression(3, 20)[0]
    out.append(Skewed("logistic d=3 n=20", problem.model, "b", problem.mu, problem.sigma))
    return out


OPTIMIZERS = {
    # name: (optimizer factory, steps, averaged over the last ... steps)
    "Adam(0.02)": (lambda: pyro.optim.Adam({"lr": 0.02}), 1000, 500),
    "QNVB()": (QNVB, 600, 400),
}


def fitted_trace(problem: Skewed, optimizer: Callable, steps: int, last: int, rule, seed):
    """The site's ``loc`` and ``scale`` at each of the last ``last`` of ``steps`` steps,
    ``(last, dim)`` each."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(problem.model)
    svi = SVI(problem.model, guide, optimizer(), QuadratureELBO(rule))
    locs, scales = [], []
    for step in range(steps):
        svi.step()
        if step >= steps - last:
            locs.append(getattr(guide.locs, problem.site).detach().reshape(-1).clone())
            scales.append(getattr(guide.scales, problem.site).detach().reshape(-1).clone())
    return torch.stack(locs), torch.stack(scales)


def skew_part(seeds: int) -> None:
    torch.set_default_dtype(torch.float64)
    cases = skewed_problems()
    print("optimal mean fields (loc*, sigma*):")
    for case in cases:
        print(f"  {case.name}: loc* {case.loc.tolist()}, sigma* {case.sigma.tolist()}")
    print()
    total = len(cases) * len(OPTIMIZERS) * len(SKEW_RULES) * seeds
    bar = tqdm(total=total, desc="skew")
    rows = []
    for case in cases:
        targets = {}
        for rule_name, (_, offsets) in SKEW_RULES.items():
            if case.loc.numel() == 1:
                loc, scale = optimum(case.model, case.site, FixedOffsets(offsets))
                targets[rule_name] = (
                    f"{float((loc - case.loc) / case.sigma):+.4f}, "
                    f"{float(scale / case.sigma - 1):+.4f}"
                )
            else:
                targets[rule_name] = "n/a"
        for opt_name, (optimizer, steps, last) in OPTIMIZERS.items():
            for rule_name, (make, _) in SKEW_RULES.items():
                biases, errors, scale_errors = [], [], []
                start = time.process_time()
                for seed in range(seeds):
                    locs, scales = fitted_trace(case, optimizer, steps, last, make(), seed)
                    # (mean loc - loc*) / sigma*, at the coordinate of largest |bias|
                    bias = (locs.mean(0) - case.loc) / case.sigma
                    i = int(bias.abs().argmax())
                    batches = locs[: last // 10 * 10, i].reshape(10, -1).mean(1)
                    biases.append(float(bias[i]))
                    errors.append(float(batches.std()) / 10**0.5 / float(case.sigma[i]))
                    scale_error = scales.mean(0) / case.sigma - 1
                    scale_errors.append(float(scale_error[scale_error.abs().argmax()]))
                    bar.update()
                cpu = (time.process_time() - start) / seeds
                target = targets[rule_name]
                row = (case.name, opt_name, steps, last, rule_name, biases, errors, scale_errors)
                rows.append((*row, target, cpu))
    bar.close()
    print(
        "\n| posterior | optimizer (steps, averaged over last) | rule | (loc - loc*) / sigma*, "
        f"per seed (± batch SE) | mean over {seeds} seeds | sigma / sigma* - 1 | "
        "target: loc, sigma | CPU s/fit |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|")
    for name, opt_name, steps, last, rule_name, biases, errors, scale_errors, target, cpu in rows:
        per_seed = ", ".join(f"{b:+.4f} (± {e:.4f})" for b, e in zip(biases, errors))
        print(
            f"| {name} | {opt_name} ({steps}, {last}) | {rule_name} | {per_seed} | "
            f"{statistics.mean(biases):+.4f} | {statistics.mean(scale_errors):+.4f} | "
            f"{target} | {cpu:.1f} |"
        )
    print(flush=True)


def suite_part(keys: list[str], budget: int, early: int, seeds: int) -> None:
    """``bench_rules.py``'s table for the two variants of ``blocked_simplex`` 3."""
    torch.set_default_dtype(torch.float64)
    logging.getLogger("pyro").setLevel(logging.WARNING)
    methods = [
        Method(
            f"QNVB + blocked_simplex 3, {variant}",
            QNVB,
            lambda signs=signs: QuadratureELBO(BlockedSimplexRule(3, random_signs=signs)),
            3,
        )
        for variant, signs in VARIANTS.items()
    ]
    all_problems = problems()
    bar = tqdm(total=len(keys) * len(methods) * seeds, desc="suite")
    print(f"{budget} gradient evaluations per fit (also scored at {early}), {seeds} seeds\n")
    print(
        "| problem | rule | gap at early | gap at budget | distance (exact) or ELBO | CPU s/fit |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for key in keys:
        problem = all_problems[key]()
        exact = problem.exact is not None
        results = {}
        for method in methods:
            start = time.process_time()
            runs = []
            for seed in range(seeds):
                runs.append(fit(problem, method, budget, [early, budget], seed)[0])
                bar.update()
            results[method.name] = (runs, (time.process_time() - start) / seeds)
        finals = [
            statistics.mean(r[budget]["gap"] for r in runs if r is not None)
            for runs, _ in results.values()
        ]
        best = 0.0 if exact else min(finals)
        for method in methods:
            runs, cpu = results[method.name]
            done = [r for r in runs if r is not None]
            extra = cell([r[budget]["distance"] if exact else -r[budget]["gap"] for r in done])
            if len(done) < len(runs):
                extra += f" ({len(runs) - len(done)} diverged)"
            early_gap = cell([r[early]["gap"] - best for r in done])
            final_gap = cell([r[budget]["gap"] - best for r in done])
            print(
                f"| {problem.name} | {method.name.split(', ')[1]} | {early_gap} | {final_gap} | "
                f"{extra} | {cpu:.1f} |",
                flush=True,
            )
    bar.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["skew", "suite", "both"], default="both")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--problems",
        nargs="*",
        default=["eight-schools", "logistic-d20", "pyro-eight-schools"],
        help="the suite's problems (bench_rules.py's keys)",
    )
    parser.add_argument("--budget", type=int, default=3000, help="suite: evaluations per fit")
    parser.add_argument("--early", type=int, default=600, help="suite: also scored here")
    args = parser.parse_args(argv)
    print(
        f"torch {torch.__version__}, pyro {pyro.__version__}, {torch.get_num_threads()} threads\n"
    )
    if args.part in ("skew", "both"):
        skew_part(args.seeds)
    if args.part in ("suite", "both"):
        suite_part(args.problems, args.budget, args.early, args.seeds)


if __name__ == "__main__":
    main()
