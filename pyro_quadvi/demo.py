"""The main demo: ``python -m pyro_quadvi.demo``.

1. Fits a Bayesian linear regression with ``SVI(model, AutoMeanFieldNormal(model), QNVB(),
   QuadratureELBO())`` and compares the fit with the optimal Gaussian mean field, known in closed
   form (mean: the exact posterior mean; standard deviations: ``1 / sqrt(Lambda_ii)`` for the
   posterior precision ``Lambda``).
2. Prints the exactness table of the quadrature rules: the fraction of the mixed quadratic basis
   functions ``x_i x_j`` that each rule integrates exactly, per number of evaluations (0.000: none
   is exact). ``hadamard`` gets the pairs whose indices first differ in one of the low ``v`` bits,
   ``2^v`` the largest power of two dividing ``K/2`` (sequence paper, Theorem 3.3): none for an
   odd ``K/2`` (K = 6, 10, 14), the same half as ``K = 4`` for ``K = 12``.
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
from tqdm.auto import tqdm

from .guides import AutoMeanFieldNormal
from .infer import QuadratureELBO
from .optim import QNVB
from .quadrature import RULES, make_rule, quadratic_exactness

_SIGMA_POINT_RULES = [name for name in RULES if name != "gauss_hermite"]


def exactness_table(
    dim: int,
    evaluations: list[int],
    trials: int,
    seed: int = 0,
    rules: list[str] | None = None,
) -> dict[str, dict[int, dict[str, float]]]:
    """Mean fractions of exactly integrated quadratic basis functions, per rule and ``K``.

    For each rule and number of evaluations ``K``, the mean over ``trials`` consecutive steps
    (fresh draws for the random rules, successive windows of the Hadamard sequence) of
    ``"cross"``: the fraction of the ``d(d-1)/2`` mixed terms ``x_i x_j`` that are exact, and
    ``"total"``: the fraction of all ``1 + 2d + d(d-1)/2`` quadratic basis functions (rasp paper
    Fig. 1, sequence paper Fig. 2), as counted by `quadratic_exactness`.

    Returns ``{rule: {K: {"cross": fraction, "total": fraction}}}``; a rule that does not exist
    for some ``K`` (odd ``K`` for the pair rules, ``K = 1``) is left out of that row. ``rules``
    defaults to every rule but ``gauss_hermite``.
    """
    generator = torch.Generator().manual_seed(seed)
    table: dict[str, dict[int, dict[str, float]]] = {}
    for name in rules or _SIGMA_POINT_RULES:
        row = {}
        for K in evaluations:
            try:
                rule = make_rule(name, num_points=K)
            except ValueError:
                continue
            counts = []
            for step in range(trials):
                X, w = rule.nodes(dim, step=step, generator=generator, dtype=torch.float64)
                counts.append(quadratic_exactness(X, w))
            row[K] = {
                "cross": sum(c.cross_fraction for c in counts) / trials,
                "total": sum(c.fraction for c in counts) / trials,
            }
        table[name] = row
    return table


def format_table(table: dict, evaluations: list[int], key: str = "cross") -> str:
    """A markdown table of ``table[rule][K][key]`` (see `exactness_table`)."""
    header = "| rule | " + " | ".join(f"K={K}" for K in evaluations) + " |"
    lines = [header, "|---" * (len(evaluations) + 1) + "|"]
    for name, row in table.items():
        cells = [f"{row[K][key]:.3f}" if K in row else "-" for K in evaluations]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


NOISE_SD = 0.5
PRIOR_SD = 1.0


def linear_regression(X, y=None):
    """y ~ N(X w, NOISE_SD^2), w ~ N(0, PRIOR_SD^2 I)."""
    w = pyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([X.shape[-1]]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal((X * w).sum(-1), NOISE_SD), obs=y)


def optimal_mean_field(X, y) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal Gaussian mean field of `linear_regression`: exact mean, 1/sqrt(diag)."""
    precision = X.T @ X / NOISE_SD**2 + torch.eye(X.shape[1]) / PRIOR_SD**2
    mean = torch.linalg.solve(precision, X.T @ y / NOISE_SD**2)
    return mean, precision.diagonal().rsqrt()


def fit_demo(num_steps: int, seed: int = 0) -> None:
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    dim, num_data, rho = 6, 400, 0.5
    cov = rho * torch.ones(dim, dim) + (1 - rho) * torch.eye(dim)
    X = torch.randn(num_data, dim) @ torch.linalg.cholesky(cov).T
    y = X @ torch.linspace(-1, 1, dim) + NOISE_SD * torch.randn(num_data)
    guide = AutoMeanFieldNormal(linear_regression)
    svi = pyro.infer.SVI(linear_regression, guide, QNVB(), QuadratureELBO("hadamard"))
    for _ in tqdm(range(num_steps), desc="SVI: QNVB + QuadratureELBO(hadamard, K=4)"):
        loss = svi.step(X, y)
    mean, sd = optimal_mean_field(X, y)
    loc, scale = guide.locs.w.detach(), guide.scales.w.detach()
    print(
        f"\nBayesian linear regression, d = {dim}, N = {num_data}, feature correlation {rho}: "
        f"final loss {loss:.3f}"
    )
    print("| coordinate | fitted mean | optimal mean | fitted sd | optimal sd |")
    print("|---|---|---|---|---|")
    for i in range(dim):
        print(f"| w[{i}] | {loc[i]:.4f} | {mean[i]:.4f} | {scale[i]:.4f} | {sd[i]:.4f} |")
    print(f"max relative error of the sds: {((scale - sd).abs() / sd).max():.2e}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    fit_demo(args.steps)
    evaluations = list(range(2, 17))
    print(
        f"Fraction of the {args.dim * (args.dim - 1) // 2} mixed quadratic terms x_i x_j "
        f"integrated exactly, d = {args.dim} (mean over {args.trials} steps; fresh draws for "
        "the random rules)\n"
    )
    print(format_table(exactness_table(args.dim, evaluations, args.trials), evaluations))
    print(
        "\nA cell is the fraction exact (0.000: no mixed term exact). hadamard gets the pairs "
        "whose indices first differ in one of the low v bits, 2^v the largest power of two "
        "dividing K/2 (sequence paper, Theorem 3.3): none when K/2 is odd (K = 6, 10, 14), half "
        "at K = 4 and 12."
    )


if __name__ == "__main__":
    main()
