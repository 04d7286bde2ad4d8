"""Quadrature rules for Gaussian mean fields, in pure torch (no Pyro).

Every rule integrates against the standard normal ``N(0, I_dim)``; a node of
``N(mu, diag(sigma^2))`` is ``mu + sigma * X[k]``:

    from pyro_quadvi.quadrature import make_rule
    rule = make_rule("rasp_simplex", num_points=3)
    X, w = rule.nodes(dim, step=0, generator=None)   # X: (K, dim), w: (K,), sum(w) == 1
    nodes = rule.draw(dim, step=0)                   # compact: nodes.node(k) is one (dim,) node

| name              | K (default)   | property                                                    |
|-------------------|---------------|-------------------------------------------------------------|
| `rasp_simplex`    | r + 1 (3)     | univariate quadratics exact; pairs exact w.p. 1 - 1/r       |
| `rasp_cross`      | 2r (6)        | univariate cubics (quintics for K = 6); odd monomials exact |
| `hadamard`        | even (4)      | antithetic pairs; periodic exactness of pairs (Thm 3.3)     |
| `blocked_simplex` | r + 1 (3)     | quadratics within blocks of r coordinates exact             |
| `gauss_hermite`   | m^dim (m = 3) | tensor product, degree 2m - 1 per coordinate                |
| `mc`              | K (3)         | Monte Carlo                                                 |
| `vrmc1`           | K (3)         | Monte Carlo translated to the exact mean                    |
| `vrmc2`           | K (3)         | ... and scaled to the exact variance                        |
"""

from __future__ import annotations

from typing import Any

from .base import DEFAULT_MAX_BYTES, NodeSet, QuadratureRule
from .exactness import QuadraticExactness, quadratic_exactness
from .hadamard import HadamardRule, hadamard_signs
from .hermite import GaussHermiteRule, gauss_hermite, orthonormal_hermite
from .montecarlo import MonteCarloRule
from .rasp import BlockedSimplexRule, RASPRule, cross_reference, simplex_reference

__all__ = [
    "DEFAULT_MAX_BYTES",
    "RULES",
    "BlockedSimplexRule",
    "GaussHermiteRule",
    "HadamardRule",
    "MonteCarloRule",
    "NodeSet",
    "QuadraticExactness",
    "QuadratureRule",
    "RASPRule",
    "cross_reference",
    "gauss_hermite",
    "hadamard_signs",
    "make_rule",
    "orthonormal_hermite",
    "quadratic_exactness",
    "simplex_reference",
]

# name -> (constructor, default num_points, fixed keyword arguments)
RULES: dict[str, tuple[type[QuadratureRule], int, dict[str, Any]]] = {
    "rasp_simplex": (RASPRule, 3, {"reference": "simplex"}),
    "rasp_cross": (RASPRule, 6, {"reference": "cross"}),
    "hadamard": (HadamardRule, 4, {}),
    "blocked_simplex": (BlockedSimplexRule, 3, {}),
    "gauss_hermite": (GaussHermiteRule, 3, {}),
    "mc": (MonteCarloRule, 3, {"moments": 0}),
    "vrmc1": (MonteCarloRule, 3, {"moments": 1}),
    "vrmc2": (MonteCarloRule, 3, {"moments": 2}),
}


def make_rule(name: str, num_points: int | None = None, **options: Any) -> QuadratureRule:
    """Build a quadrature rule by name.

    Args:
        name: one of ``RULES``: ``rasp_simplex``, ``rasp_cross``, ``hadamard``,
            ``blocked_simplex``, ``gauss_hermite``, ``mc``, ``vrmc1``, ``vrmc2``.
        num_points: the number of nodes ``K`` (for ``gauss_hermite``: points per dimension);
            ``None`` takes the rule's default.
        **options: the rule's own options, e.g. ``max_nodes`` for ``gauss_hermite``, and
            ``max_bytes`` for every rule (the largest array it allocates; default
            `DEFAULT_MAX_BYTES`, 1 GiB).

    Raises:
        ValueError: for an unknown name, a ``num_points`` the rule does not allow, or tables
            larger than ``max_bytes``.

    A rule built here integrates; whether it can also fit the scales of a mean field (at least
    two nodes, none blind along a coordinate) is `QuadratureRule.check_sees_curvature`.
    """
    if not isinstance(name, str):  # (a list, say: `in RULES` would raise "unhashable type")
        raise TypeError(
            f"a quadrature rule's name is a str, one of {sorted(RULES)}; got {name!r} "
            f"({type(name).__name__})"
        )
    if name not in RULES:
        raise ValueError(f"unknown quadrature rule {name!r}; choose one of {sorted(RULES)}")
    cls, default, fixed = RULES[name]
    clash = set(fixed) & set(options)
    if clash:
        raise ValueError(f"rule {name!r} fixes {sorted(clash)}; do not pass them")
    if num_points is None:
        num_points = default
    try:
        return cls(num_points, **fixed, **options)
    except TypeError as error:
        raise ValueError(f"invalid options {sorted(options)} for rule {name!r}: {error}") from None
