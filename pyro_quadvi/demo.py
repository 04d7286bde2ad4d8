"""The main demo: ``python -m pyro_quadvi.demo``.

Prints the exactness table of the quadrature rules: the fraction of the mixed quadratic basis
functions ``x_i x_j`` that each rule integrates exactly, per number of evaluations.
"""

from __future__ import annotations

import argparse

import torch

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
    Fig. 1, sequence paper Fig. 2), as counted by :func:`quadratic_exactness`.

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
    """A markdown table of ``table[rule][K][key]`` (see :func:`exactness_table`)."""
    header = "| rule | " + " | ".join(f"K={K}" for K in evaluations) + " |"
    lines = [header, "|---" * (len(evaluations) + 1) + "|"]
    for name, row in table.items():
        cells = [f"{row[K][key]:.3f}" if K in row else "-" for K in evaluations]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args(argv)
    evaluations = list(range(2, 17))
    print(f"Fraction of the {args.dim * (args.dim - 1) // 2} mixed quadratic terms x_i x_j "
          f"integrated exactly, d = {args.dim} (mean over {args.trials} steps; fresh draws for "
          "the random rules)\n")
    print(format_table(exactness_table(args.dim, evaluations, args.trials), evaluations))


if __name__ == "__main__":
    main()
