"""Gauss-Hermite quadrature for the standard normal weight, and orthonormal Hermite polynomials.

The one place in the package where Hermite nodes, weights and polynomial values are computed; the
tensor Gauss-Hermite rule and the OPQA evidence both use it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import (
    DEFAULT_MAX_BYTES,
    NodeSet,
    QuadratureRule,
    as_index,
    check_dim,
    check_dtype,
    check_max_bytes,
    check_num_points,
    format_bytes,
)

__all__ = ["GaussHermiteRule", "gauss_hermite", "gauss_hermite_bytes", "orthonormal_hermite"]

_JACOBI_DESCRIPTION = "an m x m float64 Jacobi matrix (and an m x m table of Hermite values)"


def gauss_hermite_bytes(num_points: int) -> int:
    """Bytes of the largest array `gauss_hermite` builds: the ``m x m`` float64 Jacobi
    matrix (the ``m x m`` table of Hermite values at the nodes is as large)."""
    return num_points * num_points * 8


def gauss_hermite(
    num_points: int, dtype: torch.dtype = torch.float64, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights of the ``num_points``-point Gauss-Hermite rule for ``N(0, 1)``.

    Golub-Welsch: the nodes are the eigenvalues of the Jacobi matrix of the probabilists' Hermite
    polynomials (off-diagonal ``sqrt(1), ..., sqrt(m - 1)``). The weights are the Christoffel
    numbers ``w_k = 1 / sum_{n < m} psi_n(x_k)^2`` (`orthonormal_hermite`): a sum of positive
    terms, accurate to rounding relative to each weight even in the tails, where the squared
    eigenvector components would only be accurate to about ``1e-16`` absolute (their tail weights
    were off by a factor of ``10^2`` at ``m = 60``). Exact for polynomials of degree
    ``<= 2m - 1``; the weights sum to 1. Computed in float64 and cast to ``dtype``.

    The Jacobi matrix and the table of Hermite values are dense ``m x m`` (``8 m^2`` bytes each,
    `gauss_hermite_bytes`): an ``m`` above ``max_bytes`` (about 11,585 under the default
    1 GiB) is refused before allocating. The eigenvalues take ``O(m^3)`` time, so such an ``m``
    would not finish anyway. ``max_bytes`` is checked as the rules check theirs.
    """
    num_points = check_num_points(num_points)
    max_bytes = check_max_bytes(max_bytes)
    if dtype is not None:  # (None: float64, as computed)
        check_dtype("gauss_hermite", dtype)
    if num_points < 1:
        raise ValueError(f"Gauss-Hermite needs num_points >= 1, got {num_points}")
    needed = gauss_hermite_bytes(num_points)
    if needed > max_bytes:
        raise ValueError(
            f"Gauss-Hermite with num_points={num_points} needs {_JACOBI_DESCRIPTION} "
            f"(m = {num_points}): {num_points} * {num_points} * 8 = {format_bytes(needed)}, more "
            f"than max_bytes={format_bytes(max_bytes)}; use fewer points (a few dozen integrate "
            "any smooth integrand to rounding), or pass a larger max_bytes"
        )
    off = torch.arange(1, num_points, dtype=torch.float64).sqrt()
    jacobi = torch.diag(off, 1) + torch.diag(off, -1)
    nodes = torch.linalg.eigvalsh(jacobi)
    # Symmetrize: the exact rule is symmetric about 0, eigvalsh is only accurate to rounding.
    nodes = 0.5 * (nodes - nodes.flip(0))
    weights = orthonormal_hermite(nodes, num_points - 1).square().sum(dim=-1).reciprocal()
    weights = 0.5 * (weights + weights.flip(0))
    weights = weights / weights.sum()
    return nodes.to(dtype), weights.to(dtype)


def orthonormal_hermite(x: torch.Tensor, degree: int) -> torch.Tensor:
    """Orthonormal probabilists' Hermite polynomials ``psi_0 .. psi_degree`` at ``x``.

    ``psi_n = He_n / sqrt(n!)``, orthonormal under ``N(0, 1)``, by the three-term recurrence
    ``psi_{n+1} = (x psi_n - sqrt(n) psi_{n-1}) / sqrt(n + 1)``: no factorials, stable to high
    degree.
    Returns a tensor of shape ``x.shape + (degree + 1,)``.

    Raises:
        ValueError: naming the argument, for an ``x`` that is not a tensor or a ``degree`` that
            is not an integer ``>= 0`` (``None`` or ``2.5`` failed in Python's comparison or
            ``range``).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"orthonormal_hermite: x must be a tensor of points, got {x!r} ({type(x).__name__})"
        )
    index = as_index(degree)
    if index is None or index < 0:
        raise ValueError(f"orthonormal_hermite: degree must be >= 0 (an integer), got {degree!r}")
    degree = index
    values = [torch.ones_like(x)]
    if degree >= 1:
        values.append(x.clone())
    for n in range(1, degree):
        values.append((x * values[n] - math.sqrt(n) * values[n - 1]) / math.sqrt(n + 1))
    return torch.stack(values, dim=-1)


class _TensorGridNodes(NodeSet):
    """Tensor-product nodes; node ``k`` has base-``m`` digits ``k = sum_i a_i m^(dim - 1 - i)``."""

    def __init__(self, points: torch.Tensor, point_weights: torch.Tensor, dim: int, **limits: Any):
        m = points.shape[0]
        powers = m ** torch.arange(dim - 1, -1, -1, dtype=torch.int64, device=points.device)
        self._powers = powers
        self._points = points
        weights = point_weights
        for _ in range(dim - 1):
            weights = torch.outer(weights, point_weights).reshape(-1)
        super().__init__(dim, weights, **limits)

    def node(self, k: int) -> torch.Tensor:
        # k's base-m digits: a Python int against the device's powers, no copy of k to the device
        digits = torch.floor_divide(self._check_index(k), self._powers) % self._points.shape[0]
        return self._points[digits]

    def _matrix(self) -> torch.Tensor:
        grids = [self._points] * self.dim
        return torch.cartesian_prod(*grids).reshape(len(self), self.dim)


class GaussHermiteRule(QuadratureRule):
    """Tensor-product Gauss-Hermite: ``m = num_points`` points per dimension, ``K = m^dim`` nodes.

    Exact for every polynomial of degree ``<= 2m - 1`` in each coordinate (so for every product of
    such univariate polynomials). Deterministic; ``step`` is ignored. Refuses ``m^dim > max_nodes``.
    One point per dimension (the mean alone) integrates, but cannot fit a scale
    (`check_sees_curvature`).
    """

    name = "gauss_hermite"

    def __init__(self, num_points: int, max_nodes: int = 2**20, max_bytes: int = DEFAULT_MAX_BYTES):
        num_points = check_num_points(num_points)
        if num_points < 1:
            raise ValueError(f"gauss_hermite needs num_points >= 1 per dimension, got {num_points}")
        super().__init__(num_points, max_bytes=max_bytes)
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"gauss_hermite: max_nodes must be an integer >= 1, got {max_nodes!r}")
        self.max_nodes = max_nodes
        self.exact_coordinate_quadratics = num_points >= 2  # one point: x = 0, so E[x^2] = 0

    def table_bytes(self) -> int:
        """The ``m x m`` Jacobi matrix of `gauss_hermite` (`gauss_hermite_bytes`)."""
        return gauss_hermite_bytes(self.num_points)

    def _table_description(self) -> str:
        return (
            f"{_JACOBI_DESCRIPTION} (m = {self.num_points}): "
            f"{self.num_points} * {self.num_points} * 8"
        )

    def num_nodes(self, dim: int) -> int:
        return self.num_points ** check_dim(dim)

    def draw(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NodeSet:
        dim = check_dim(dim)
        # m^dim for a large dim has thousands of digits (Python refuses to print an int of more
        # than 4,300): compared and shown through its logarithm there
        digits = dim * math.log10(self.num_points)
        if digits < 300:
            too_many = self.num_nodes(dim) > self.max_nodes
        else:
            too_many = digits > math.log10(self.max_nodes)
        if too_many:
            size = f"{self.num_nodes(dim)}" if digits < 15 else f"about 10^{digits:.0f}"
            raise ValueError(
                f"gauss_hermite with {self.num_points} points per dimension in {dim} dimensions "
                f"needs {self.num_points}^{dim} = {size} nodes, "
                f"more than max_nodes={self.max_nodes}; "
                "use fewer points per dimension, raise max_nodes, or a sigma-point rule "
                "(rasp_simplex, hadamard) for many dimensions"
            )
        dim, step, dtype = self.check_draw(dim, step, generator, dtype, device)
        points, weights = gauss_hermite(self.num_points, max_bytes=self.max_bytes)
        return _TensorGridNodes(
            points.to(dtype=dtype, device=device),
            weights.to(dtype=dtype, device=device),
            dim,
            name=self.name,
            max_bytes=self.max_bytes,
        )

    def __repr__(self) -> str:
        return f"GaussHermiteRule(num_points={self.num_points}, max_nodes={self.max_nodes})"
