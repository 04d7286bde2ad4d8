"""Cross-polytope vertices in the Hadamard basis: a quasirandom sequence of antithetic pairs.

Sequence paper, Algorithm 3.1: iterate ``q`` gives the sign vector ``s_i = (-1)^parity(i AND q)``
and the antithetic pair ``mu +- sigma * s``. Lemma 3.2 and Theorem 3.3: averaged over ``2^b``
consecutive iterates starting at a multiple of ``2^b``, every pair of coordinates whose indices
first differ in bit ``b - 1`` (counting from 0) sees the 4-node tensor-product cubature, so its
cross moments are exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import DEFAULT_MAX_BYTES, NodeSet, QuadratureRule, check_dim, equal_weights

__all__ = ["MAX_HADAMARD_DIM", "HadamardRule", "hadamard_signs"]

MAX_HADAMARD_DIM = 2**31
"""Coordinates are indexed by 32-bit integers: the sequence supports ``dim <= 2^31``."""

_INDEX_MASK = MAX_HADAMARD_DIM - 1
_LOW_BITS = 16


def _parity(bits: torch.Tensor) -> torch.Tensor:
    """Parity (popcount mod 2) of non-negative integers below ``2^32``, by xor-folding."""
    for shift in (16, 8, 4, 2, 1):
        bits = bits ^ (bits >> shift)
    return bits & 1


def hadamard_signs(
    index: torch.Tensor, iterate: int | torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Signs ``(-1)^parity(index AND iterate)``: entry ``(iterate, index)`` of a Sylvester-Hadamard
    matrix, by bit operations alone (sequence paper, Algorithm 3.1).

    Args:
        index: integer tensor of coordinate indices in ``[0, 2^31)``.
        iterate: the sequence position ``q >= 0`` (an int, or an integer tensor broadcasting with
            ``index``). Only its low 31 bits matter for indices below ``2^31``.
        dtype: floating dtype of the result (default dtype when ``None``).
    """
    if isinstance(iterate, int):
        iterate = torch.tensor(iterate & _INDEX_MASK, dtype=index.dtype, device=index.device)
    else:
        iterate = iterate & _INDEX_MASK
    parity = _parity(index & iterate)
    return (1 - 2 * parity).to(dtype or torch.get_default_dtype())


class _HadamardNodes(NodeSet):
    """Nodes ``2j`` and ``2j + 1`` are ``+s`` and ``-s`` for iterate ``first_iterate + j``."""

    def __init__(self, dim: int, first_iterate: int, weights: torch.Tensor, **limits: Any):
        super().__init__(dim, weights, **limits)
        self.first_iterate = first_iterate

    def _index(self) -> torch.Tensor:
        return torch.arange(self.dim, dtype=torch.int32, device=self.device)

    def node(self, k: int) -> torch.Tensor:
        """Signs for iterate ``q``, as the Kronecker product of the Sylvester-Hadamard rows of the
        high and low 16 index bits: ``parity(i & q) = parity(i_hi & q_hi) xor parity(i_lo & q_lo)``
        so the ``dim`` signs take one pass over memory after two short bit computations."""
        k = self._check_index(k)
        q = (self.first_iterate + k // 2) & _INDEX_MASK
        low_size = min(self.dim, 1 << _LOW_BITS)
        high_size = -(-self.dim // low_size)
        index = torch.arange(low_size, dtype=torch.int32, device=self.device)
        low = hadamard_signs(index, q & ((1 << _LOW_BITS) - 1), dtype=self.dtype)
        high = hadamard_signs(index[:high_size], q >> _LOW_BITS, dtype=self.dtype)
        if k % 2:
            high = -high
        return torch.outer(high, low).reshape(-1)[: self.dim]

    def _matrix(self) -> torch.Tensor:
        # one Kronecker row per pair (see node): a pass over memory instead of bit operations on
        # every (pair, coordinate) entry
        signs = torch.stack([self.node(2 * j) for j in range(len(self) // 2)])
        return torch.stack([signs, -signs], dim=1).reshape(len(self), self.dim)


class HadamardRule(QuadratureRule):
    """The Hadamard cross-polytope antithetic sequence (sequence paper, Algorithm 3.1).

    One quadrature holds ``K / 2`` antithetic pairs, the iterates ``q = step * K/2, ...,
    (step + 1) * K/2 - 1``; ``step`` advances the sequence by ``K / 2`` iterates. Deterministic.

    Properties: every univariate quadratic (and, since each pair is symmetric, every univariate
    cubic) is exact at every step. When ``K / 2 = 2^m``, every pair of coordinates whose indices
    differ in one of the ``m`` lowest bits is exact to total degree 2 at every step (Theorem 3.3); a
    window of ``2^b`` consecutive pairs makes every pair whose lowest differing bit is below ``b``
    exact, and ``period(dim)`` steps make all pairs exact.
    """

    name = "hadamard"

    def __init__(self, num_points: int, max_bytes: int = DEFAULT_MAX_BYTES):
        if num_points < 2 or num_points % 2:
            raise ValueError(
                f"hadamard needs an even num_points >= 2 (K / 2 antithetic pairs), got {num_points}"
            )
        super().__init__(num_points, max_bytes=max_bytes)

    @staticmethod
    def sequence_length(dim: int) -> int:
        """Number of distinct iterates for ``dim`` coordinates: ``2^ceil(log2(dim))``."""
        check_dim(dim)
        return 1 << max(dim - 1, 0).bit_length()

    def period(self, dim: int) -> int:
        """Steps after which the quadratures repeat; averaged over them, every pair is exact."""
        length = self.sequence_length(dim)
        return length // math.gcd(length, self.num_points // 2)

    def draw(self, dim, step=0, generator=None, dtype=None, device=None) -> NodeSet:
        dim = check_dim(dim)
        if dim > MAX_HADAMARD_DIM:
            raise ValueError(f"hadamard supports dim <= 2^31, got {dim}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        weights = equal_weights(self.num_points, dtype, device)
        return _HadamardNodes(
            dim, step * (self.num_points // 2), weights, name=self.name, max_bytes=self.max_bytes
        )
