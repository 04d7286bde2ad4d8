"""Count which quadratic basis functions a quadrature integrates exactly.

The basis of the Gaussian mean-field updates and its mixed terms (rasp paper Fig. 1, sequence paper
Fig. 2): ``1``, ``x_i``, ``x_i^2 - 1`` and ``x_i x_j`` (``i < j``) under ``N(0, I)``, in all
``1 + 2d + d(d - 1)/2`` functions.
"""

from __future__ import annotations

import math
import numbers
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

    A function ``f`` is exact when the quadrature's value differs from the Gaussian integral by at
    most ``atol``: by default ``1e-9`` plus what rounding in the nodes' dtype allows in that sum,
    8 units in the last place of ``sum_k |w_k| |f(x_k)|`` (a fixed ``1e-9`` counted every term of
    float32 nodes inexact). The sums are taken in float64. The bound is on the nodes as given:
    ``vrmc*`` nodes made in float32 are differences of nearly equal draws at ``K = 2``, rounded
    before they are given, and a few of their terms can count inexact that float64 counts exact.

    Raises:
        ValueError: for nodes or weights in float16 or bfloat16, whose rounding (about 1e-3 and
            1e-2 of a moment) is not told apart from inexactness; compute them in float32 or
            float64.
        TypeError, ValueError: naming the argument, for an ``X`` that is not a ``(K, d)``
            tensor, a ``w`` that is not a ``(K,)`` tensor of as many weights (torch's "mat1 and
            mat2 shapes cannot be multiplied" named neither), or an ``atol`` that is not
            ``None`` or a finite number ``>= 0`` (a NaN or negative one changed the counts
            silently).
    """
    atol = _check_arguments(X, w, atol)
    low = [t.dtype for t in (X, w) if t.dtype in (torch.float16, torch.bfloat16)]
    if low:
        raise ValueError(
            f"quadratic_exactness counts exact terms to the rounding of the nodes' dtype, and "
            f"{low[0]} rounds a moment by about 1e-3 or more: compute the nodes and weights in "
            "float32 or float64 (rule.nodes(dim, dtype=torch.float64))"
        )
    eps = max((torch.finfo(t.dtype).eps for t in (X, w) if t.is_floating_point()), default=0.0)
    X = X.to(torch.float64)
    w = w.to(torch.float64)
    dim = X.shape[1]
    mean = w @ X
    second = (X * w[:, None]).T @ X
    upper = torch.triu(torch.ones(dim, dim, dtype=torch.bool, device=X.device), diagonal=1)
    if atol is None:
        size, absolute = w.abs(), X.abs()
        tol_constant = 1e-9 + 8 * eps * size.sum()
        tol_mean = 1e-9 + 8 * eps * (size @ absolute)
        tol_second = 1e-9 + 8 * eps * ((absolute * size[:, None]).T @ absolute)
    else:
        tol_constant = tol_mean = atol
        tol_second = torch.full_like(second, atol)
    return QuadraticExactness(
        dim=dim,
        constant=int((w.sum() - 1).abs() <= tol_constant),
        linear=int((mean.abs() <= tol_mean).sum()),
        square=int(((second.diagonal() - 1).abs() <= tol_second.diagonal()).sum()),
        cross=int((second.abs()[upper] <= tol_second[upper]).sum()),
    )


def _check_arguments(X: object, w: object, atol: object) -> float | None:
    """`quadratic_exactness`'s refusals of its arguments; ``atol`` as a float (a one-element
    tensor read back) or ``None``."""
    for name, value, dims, shape in (("X", X, 2, "(K, d)"), ("w", w, 1, "(K,)")):
        if not isinstance(value, torch.Tensor) or value.dim() != dims:
            what = (
                f"shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else f"{value!r} ({type(value).__name__})"
            )
            raise TypeError(f"quadratic_exactness: {name} must be a {shape} tensor, got {what}")
    if w.shape[0] != X.shape[0]:
        raise ValueError(
            f"quadratic_exactness: w must hold one weight per node of X, {X.shape[0]}, got "
            f"{w.shape[0]}"
        )
    if atol is None:
        return None
    # a one-element real tensor, integer ones included (as ``atol=0``), read back; a bool one is
    # no tolerance
    if isinstance(atol, torch.Tensor) and atol.numel() == 1:
        if atol.dtype != torch.bool and not atol.is_complex():
            atol = atol.item()
    if isinstance(atol, bool) or not isinstance(atol, numbers.Real):
        raise TypeError(
            f"quadratic_exactness: atol must be None or a number >= 0, got {atol!r} "
            f"({type(atol).__name__})"
        )
    if not 0 <= atol < math.inf:
        raise ValueError(f"quadratic_exactness: atol must be finite and >= 0, got {atol!r}")
    return float(atol)
