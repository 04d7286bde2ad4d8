"""QNVB on a regression with unstandardized features, against its exact mean field.

The problem (`pyro_quadvi.testing.unscaled.unscaled_regression`): features on scales 1e-3, 1,
1e2 and 1e4, outcomes near 3,000, the noise sd known, so the optimal mean field is in closed form.
What the script measures:

* ``leak``: the expected curvature ``h`` the default rule (``blocked_simplex``) gives the
  coefficient ``b[0]`` of the 1e-3 feature at the first step, over ``--draws`` draws of its nodes,
  against that coefficient's exact curvature ``Lambda_00``, and against the prediction
  ``sum_j Lambda_0j (sigma_j / sigma_0) C_0j`` from the draw's cross moments ``C`` (exact for a
  quadratic loss; every ``sigma`` is the guide's ``init_scale`` at the first step).
* ``fits``: ``SVI`` with ``QNVB(lr=..., sigma_max=...)`` and ``QuadratureELBO(rule)`` over
  ``--seeds`` seeds: how many reach the exact mean field (every mean within ``0.1`` exact sd and
  every scale within 10%) after ``--steps`` steps, the median of the largest mean error (in exact
  sds) and of the largest relative scale error, and how many runs warned.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_unscaled.py
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import pyro
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides.interface import published_moments
from pyro_quadvi.quadrature import make_rule
from pyro_quadvi.testing.unscaled import unscaled_regression

# (rule, lr, sigma_max)
SETTINGS = (
    ("blocked_simplex", 1.0, 100.0),
    ("blocked_simplex", 1e4, 100.0),
    ("blocked_simplex", 1e4, 1e5),
    ("hadamard", 1e4, 100.0),
    ("hadamard", 1e4, 1e5),
    ("gauss_hermite", 1e4, 1e5),
)


def _mean_field(guide) -> tuple[torch.Tensor, torch.Tensor]:
    (la, sa), (lb, sb) = guide._get_loc_and_scale("a"), guide._get_loc_and_scale("b")
    return torch.cat([la.reshape(1), lb]).detach(), torch.cat([sa.reshape(1), sb]).detach()


def leak(draws: int) -> None:
    problem, precision = unscaled_regression()
    ratios, worst = [], 0.0
    for seed in range(draws):
        pyro.clear_param_store()
        guide = AutoMeanFieldNormal(problem.model)
        guide()
        generator = torch.Generator().manual_seed(seed)
        twin = torch.Generator().set_state(generator.get_state())
        elbo = QuadratureELBO(generator=generator)
        elbo.differentiable_loss(problem.model, guide).backward()
        h = published_moments(guide.locs.b).h[0].item()
        nodes = make_rule("blocked_simplex").draw(5, step=0, generator=twin, dtype=torch.float64)
        x, w = nodes.matrix(), nodes.weights
        cross = (w * x[:, 1] * x.T).sum(-1)  # C_0j of b[0], coordinate 1 after a
        predicted = (precision[1] * cross).sum().item()
        worst = max(worst, abs(h - predicted) / abs(predicted))
        ratios.append(h / precision[1, 1].item())
    sizes = sorted(abs(r) for r in ratios)
    print(f"### First-step h of b[0] with blocked_simplex, {draws} draws\n")
    print(
        "| Lambda_03 / Lambda_00 | median abs(h) / Lambda_00 | min | max | negative | "
        "max rel. error of the prediction |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {(precision[1, 4] / precision[1, 1]).item():.3g} | {statistics.median(sizes):.3g} | "
        f"{sizes[0]:.3g} | {sizes[-1]:.3g} | {sum(r < 0 for r in ratios)} of {draws} | "
        f"{worst:.1e} |\n"
    )


def fits(seeds: int, steps: int, settings) -> None:
    problem, _ = unscaled_regression()
    print(
        f"### Fits after {steps} steps, {seeds} seeds (exact mean field: b[0] "
        f"{problem.mu[1]:.4g} +- {problem.sigma[1]:.3g})\n"
    )
    print(
        "| rule | lr | sigma_max | reached | median max mean error (sd) | "
        "median max scale error | runs that warned |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rule, lr, sigma_max in settings:
        mean_errors, scale_errors, reached, warned = [], [], 0, 0
        for seed in range(seeds):
            pyro.clear_param_store()
            pyro.set_rng_seed(seed)
            guide = AutoMeanFieldNormal(problem.model)
            svi = SVI(problem.model, guide, QNVB(lr=lr, sigma_max=sigma_max), QuadratureELBO(rule))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    svi.step()
            warned += any(issubclass(c.category, RuntimeWarning) for c in caught)
            mu, sigma = _mean_field(guide)
            mean_error = ((mu - problem.mu).abs() / problem.sigma).max().item()
            scale_error = (sigma / problem.sigma - 1).abs().max().item()
            reached += mean_error < 0.1 and scale_error < 0.1
            mean_errors.append(mean_error)
            scale_errors.append(scale_error)
        print(
            f"| {rule} | {lr:g} | {sigma_max:g} | {reached} of {seeds} | "
            f"{statistics.median(mean_errors):.2g} | {statistics.median(scale_errors):.2g} | "
            f"{warned} |"
        )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["leak", "fits", "all"], default="all")
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rules", nargs="*", default=None, help="only the settings of these rules")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = [s for s in SETTINGS if args.rules is None or s[0] in args.rules]
    if args.part in ("leak", "all"):
        leak(args.draws)
    if args.part in ("fits", "all"):
        fits(args.seeds, args.steps, settings)


if __name__ == "__main__":
    main()
