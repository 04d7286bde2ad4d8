"""Count which quadratic basis functions a quadrature integrates exactly.

The basis of the Gaussian mean-field updates and its mixed terms (rasp paper Fig. 1, sequence paper
Fig. 2): ``1``, ``x_i``, ``x_i^2 - 1`` and ``x_i x_j`` (``i < j``) under ``N(0, I)``, in all
``1 + 2d + d(d - 1)/2`` functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuadraticExactness", "quadratic_exactness"]


@dataclass(frozen=True)
class QuadraticExactness:
    """How many quadratic basis functions a quadrature integrates exactly."""

    dim: int
    constant: int
    linear: int
    square: int
    cross: int

    @property
    def total(self) -> int:
        return self.constant + self.linear + self.square + self.cross

    @property
    def num_basis(self) -> int:
        return 1 + 2 * self.dim + self.dim * (self.dim - 1) // 2

    @property
    def fraction(self) -> float:
        """Fraction of all ``1 + 2d + d(d-1)/2`` quadratic basis functions that are exact."""
        return self.total / self.num_basis

    @property
    def cross_fraction(self) -> float:
        """Fraction of the ``d(d-1)/2`` mixed terms ``x_i x_j`` that are exact."""
        pairs = self.dim * (self.dim - 1) // 2
        return self.cross / pairs if pairs else 1.0


def quadratic_exactness(
    X: torch.Tensor, w: torch.Tensor, atol: float | None = None
) -> QuadraticExactness:
    """Count the exact quadratic basis functions of the quadrature ``(X, w)``, ``X`` (K, d).

    A function is exact when the quadrature's value differs from the Gaussian integral by at most
    ``atol``: by default ``1e-9``, or 100 units in the last place of ``X``'s dtype where that is
    more (``1.2e-5`` for float32 nodes, whose rounding a fixed ``1e-9`` counted as inexact: every
    term of a float32 ``rasp_simplex`` came out inexact). The sums are taken in float64.
    """
    if atol is None:
        atol = max(1e-9, 100 * torch.finfo(X.dtype).eps)
    X = X.to(torch.float64)
    w = w.to(torch.float64)
    dim = X.shape[1]
    mean = w @ X
    second = (X * w[:, None]).T @ X
    upper = torch.triu(torch.ones(dim, dim, dtype=torch.bool, device=X.device), diagonal=1)
    return QuadraticExactness(
        dim=dim,
        constant=int((w.sum() - 1).abs() <= atol),
        linear=int((mean.abs() <= atol).sum()),
        square=int(((second.diagonal() - 1).abs() <= atol).sum()),
        cross=int((second.abs()[upper] <= atol).sum()),
    )
