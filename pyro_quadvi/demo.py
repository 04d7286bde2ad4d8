"""The main demo: ``python -m pyro_quadvi.demo``.

Prints the exactness table of the quadrature rules: the fraction of the mixed quadratic basis
functions ``x_i x_j`` that each rule integrates exactly, per number of evaluations.
"""

from __future__ import annotations

import argparse

import torch

from .quadrature import RULES, make_rule, quadratic_exactness

_SIGMA_POINT_RULES = [name for name in RULES if name != "gauss_hermite"]


def exactness_table(dim: int, evaluations: list[int], trials: int, seed: int = 0) -> dict:
    """Mean fraction of exact mixed quadratic terms, per rule and number of evaluations ``K``.

    Returns ``{rule: {K: fraction}}``; a rule that does not exist for some ``K`` (odd ``K`` for the
    pair rules, ``K = 1``) is left out of that row.
    """
    generator = torch.Generator().manual_seed(seed)
    table: dict[str, dict[int, float]] = {}
    for name in _SIGMA_POINT_RULES:
        row = {}
        for K in evaluations:
            try:
                rule = make_rule(name, num_points=K)
            except ValueError:
                continue
            repeats = trials if rule.is_random else 1
            fractions = []
            for step in range(repeats):
                X, w = rule.nodes(dim, step=step, generator=generator, dtype=torch.float64)
                fractions.append(quadratic_exactness(X, w).cross_fraction)
            row[K] = sum(fractions) / len(fractions)
        table[name] = row
    return table


def format_table(table: dict, evaluations: list[int]) -> str:
    header = "| rule | " + " | ".join(f"K={K}" for K in evaluations) + " |"
    lines = [header, "|---" * (len(evaluations) + 1) + "|"]
    for name, row in table.items():
        cells = [f"{row[K]:.3f}" if K in row else "-" for K in evaluations]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args(argv)
    evaluations = list(range(2, 17))
    print(
        f"Fraction of the {args.dim * (args.dim - 1) // 2} mixed quadratic terms x_i x_j "
        f"integrated exactly, d = {args.dim} (random rules: mean of {args.trials} draws)\n"
    )
    print(format_table(exactness_table(args.dim, evaluations, args.trials), evaluations))


if __name__ == "__main__":
    main()
