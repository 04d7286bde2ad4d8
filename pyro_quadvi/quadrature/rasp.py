"""Random-affinity sigma points (RASP) and stochastic blocked sigma points.

* `simplex_reference`, `cross_reference`: the small reference quadratures of the rasp
  paper, Algorithms 1 and 2.
* `RASPRule`: each coordinate picks one signed reference dimension at random (Algorithm 3,
  eq. 13), stored as one small integer per coordinate.
* `BlockedSimplexRule`: simplex sigma points on blocks of consecutive coordinates, with the
  nodes permuted independently per block (sequence paper, Section 3.1, Theorem 3.1) and, with
  ``random_signs=True``, multiplied by a random sign per block.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import DEFAULT_MAX_BYTES, NodeSet, QuadratureRule, draw_device, equal_weights

__all__ = ["BlockedSimplexRule", "RASPRule", "cross_reference", "simplex_reference"]


def simplex_reference(r: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Simplex vertices as an ``(r, r + 1)`` matrix, each column a node of weight ``1 / (r + 1)``.

    rasp paper, Algorithm 1: ``R = [alpha I - beta 1 1^T, -1]`` with ``alpha = sqrt(r + 1)`` and
    ``beta = 1 / (1 + alpha)``. The nodes have zero mean and identity second moment, so every
    polynomial of total degree <= 2 in ``r`` variables is integrated exactly against ``N(0, I_r)``.
    """
    if r < 1:
        raise ValueError(f"the simplex reference needs r >= 1 dimensions, got {r}")
    alpha = math.sqrt(r + 1)
    beta = 1.0 / (1.0 + alpha)
    first = alpha * torch.eye(r, dtype=dtype) - beta * torch.ones(r, r, dtype=dtype)
    return torch.cat([first, -torch.ones(r, 1, dtype=dtype)], dim=1)


def cross_reference(r: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Cross-polytope vertices as an ``(r, 2r)`` matrix, each column of weight ``1 / (2r)``.

    rasp paper, Algorithm 2: ``R = sqrt(r) [I, -I]``. Symmetric, so every odd moment vanishes and
    the rule is exact to degree 3 (degree 5 in one variable when ``r = 3``).
    """
    if r < 1:
        raise ValueError(f"the cross-polytope reference needs r >= 1 dimensions, got {r}")
    eye = math.sqrt(r) * torch.eye(r, dtype=dtype)
    return torch.cat([eye, -eye], dim=1)


_GATHER_CHUNK = 1 << 20
"""Coordinates gathered per pass in `_AffinityNodes.node`: the small integers are widened
to int32 (as ``index_select`` needs) one chunk at a time, never all ``dim`` at once."""


def _index_dtype(num_values: int) -> torch.dtype:
    """The smallest signed integer dtype that holds ``0 .. num_values - 1``."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if num_values - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


class _AffinityNodes(NodeSet):
    """Nodes ``X[k, i] = table[index[i], k]``: a gather from a small table by one integer each."""

    def __init__(
        self,
        table: torch.Tensor,
        index: torch.Tensor,
        dim: int,
        weights: torch.Tensor,
        **limits: Any,
    ):
        super().__init__(dim, weights, **limits)
        self.table = table  # (num_rows, K), in the nodes' dtype
        self.index = index  # (dim,) small integers

    def node(self, k: int) -> torch.Tensor:
        column = self.table[:, self._check_index(k)]
        out = torch.empty(self.dim, dtype=column.dtype, device=column.device)
        for start in range(0, self.dim, _GATHER_CHUNK):
            stop = min(start + _GATHER_CHUNK, self.dim)
            torch.index_select(column, 0, self.index[start:stop].int(), out=out[start:stop])
        return out

    def _matrix(self) -> torch.Tensor:
        return self.table.T[:, self.index.long()]


class RASPRule(QuadratureRule):
    """Random-affinity sigma points (rasp paper, Algorithm 3 and eq. 13).

    Each coordinate ``i`` draws ``j_i`` uniformly from the ``2r`` signed reference dimensions
    ``S = [R; -R]`` and node ``k`` is ``X[k, i] = S[j_i, k]``. One integer of at most one byte per
    coordinate (for ``r <= 63``) is all the state one quadrature needs.

    Args:
        num_points: number of nodes ``K``. ``reference="simplex"``: ``K = r + 1 >= 2``;
            ``reference="cross"``: ``K = 2r``, even and ``>= 2``.
        reference: ``"simplex"`` (Algorithm 1) or ``"cross"`` (Algorithm 2).
        max_bytes: the largest array the rule allocates; its tables hold ``3 r K`` float64
            entries (the reference and its signed copy), so ``K`` is at most about 6,700
            (simplex) or 9,400 (cross) under the default of 1 GiB.

    Properties (rasp paper, Theorems 3.1-3.4): every univariate polynomial of degree <= 2 (simplex),
    <= 3 (cross; <= 5 when ``K = 6``) is exact; a pair of coordinates is integrated like the
    reference (exactly to total degree 2, resp. 3) with probability ``1 - 1/r``, and otherwise the
    cross moment is off by ``+-1`` with mean zero; with the symmetric cross reference every odd
    total-degree monomial is exact.
    """

    is_random = True
    exact_coordinate_quadratics = True

    def __init__(
        self, num_points: int, reference: str = "simplex", max_bytes: int = DEFAULT_MAX_BYTES
    ):
        if reference == "simplex":
            if num_points < 2:
                raise ValueError(
                    f"rasp_simplex needs num_points >= 2 (K = r + 1 nodes), got {num_points}"
                )
            self.r = num_points - 1
        elif reference == "cross":
            if num_points < 2 or num_points % 2:
                raise ValueError(
                    f"rasp_cross needs an even num_points >= 2 (K = 2r nodes), got {num_points}"
                )
            self.r = num_points // 2
        else:
            raise ValueError(f"reference must be 'simplex' or 'cross', got {reference!r}")
        self.reference = reference
        self.name = f"rasp_{reference}"
        super().__init__(num_points, max_bytes=max_bytes)
        build = simplex_reference if reference == "simplex" else cross_reference
        self._reference = build(self.r)
        self._signed = torch.cat([self._reference, -self._reference], dim=0)  # (2r, K)

    def draw(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NodeSet:
        dim, step, dtype = self.check_draw(dim, step, generator, dtype)
        num_rows = 2 * self.r
        # drawn where the generator lives (a CPU generator serves any device), then moved
        index = torch.randint(
            0,
            num_rows,
            (dim,),
            generator=generator,
            dtype=_index_dtype(num_rows),
            device=draw_device(generator, device),
        ).to(device)
        weights = equal_weights(self.num_points, dtype, device)
        table = self._signed.to(dtype=weights.dtype, device=weights.device)
        return _AffinityNodes(table, index, dim, weights, name=self.name, max_bytes=self.max_bytes)

    def table_bytes(self) -> int:
        """The reference ``(r, K)`` and its signed copy ``(2r, K)``, in float64."""
        return 3 * self.r * self.num_points * 8

    def _table_description(self) -> str:
        return (
            f"reference tables of 3 r K float64 entries (r = {self.r}, K = {self.num_points}): "
            f"3 * {self.r} * {self.num_points} * 8"
        )

    def __repr__(self) -> str:
        return f"RASPRule(num_points={self.num_points}, reference={self.reference!r})"


class _BlockedNodes(NodeSet):
    """Simplex nodes on consecutive blocks, columns permuted per block, times a sign per block."""

    def __init__(
        self,
        reference,
        perms: torch.Tensor,
        signs: torch.Tensor | None,
        dim: int,
        weights: torch.Tensor,
        **limits: Any,
    ):
        super().__init__(dim, weights, **limits)
        self.reference_t = reference.T.contiguous()  # (K, r): row k is node k of one block
        self.perms = perms  # (num_blocks, K) small integers: block b uses column perms[b, k]
        self.signs = signs  # (num_blocks,) int8 of +-1, or None for the unsigned rule

    def node(self, k: int) -> torch.Tensor:
        rows = self.perms[:, self._check_index(k)].long()
        blocks = self.reference_t[rows]  # (num_blocks, r), a fresh tensor
        if self.signs is not None:
            blocks.mul_(self.signs[:, None])
        return blocks.reshape(-1)[: self.dim]

    def _matrix(self) -> torch.Tensor:
        blocks = self.reference_t[self.perms.T.long()]  # (K, num_blocks, r)
        if self.signs is not None:
            blocks.mul_(self.signs[None, :, None])
        return blocks.reshape(len(self), -1)[:, : self.dim]


class BlockedSimplexRule(QuadratureRule):
    """Stochastic blocked mean-field quadrature (sequence paper, Section 3.1).

    Coordinates are split into consecutive blocks of ``r = K - 1`` (the last block may be shorter);
    each block carries the ``r + 1`` simplex sigma points of `simplex_reference`, their order
    permuted uniformly at random and independently per block. Every polynomial of total degree <= 2
    within a block is exact (Section 3.1), and by Theorem 3.1 the expectation over the permutations
    of any product of such functions across blocks equals the tensor-product cubature.

    With ``random_signs=True`` each block's points are also multiplied by an independent random
    sign, one per block and draw. The paper's rule (``random_signs=False``, the default)
    gives every coordinate the same offsets at every step, whose third moment is not zero
    (``+0.5`` for ``K = 3``: the offsets are ``{1.366, -1, -0.366}``); any cubic part of the
    negative log density then pushes a fit the same way at every step, and the fit settles off the
    optimum (``z ~ Beta(2, 2)``: ``loc = 0.050`` in logit space where the best Gaussian has 0). The
    simplex negated is still a simplex with zero mean and identity second moment, so every
    polynomial of total degree <= 2 within a block stays exact draw by draw, Theorem 3.1 holds with
    the expectation over permutations and signs (the two node sets are both exact for quadratics),
    and the expectation over the draws of every odd-degree monomial within a block is zero, the
    Gaussian's value (the rasp paper's symmetric half ``[R; -R]`` does the same for RASP).

    Args:
        num_points: the number of nodes ``K >= 2``; blocks of ``r = K - 1`` coordinates.
        random_signs: multiply each block's points by a random sign per draw (see above).
            ``False``, the default, is the sequence paper's rule as published. The signs are
            not the default because on hierarchical models (eight schools) the unsigned rule's
            +0.5 third moment cancels part of its fourth moment's error on the
            ``exp``-transformed scales, and the signed rule ends as far from the optimum as
            ``rasp_simplex`` (``docs/benchmarks.md``, "Random signs for the blocked rule").
        max_bytes: the largest array the rule allocates; its table holds the ``r K`` float64
            entries of the simplex. The signs are one ``int8`` per block in each draw.
    """

    name = "blocked_simplex"
    is_random = True
    exact_coordinate_quadratics = True

    def __init__(
        self, num_points: int, random_signs: bool = False, max_bytes: int = DEFAULT_MAX_BYTES
    ):
        if num_points < 2:
            raise ValueError(
                f"blocked_simplex needs num_points >= 2 (blocks of num_points - 1 coordinates), "
                f"got {num_points}"
            )
        if not isinstance(random_signs, bool):
            raise ValueError(
                f"blocked_simplex: random_signs must be True or False, got {random_signs!r}"
            )
        self.block_size = num_points - 1
        self.random_signs = random_signs
        super().__init__(num_points, max_bytes=max_bytes)
        self._reference = simplex_reference(self.block_size)

    def draw(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NodeSet:
        dim, step, dtype = self.check_draw(dim, step, generator, dtype)
        num_blocks = -(-dim // self.block_size)
        # drawn where the generator lives (a CPU generator serves any device), then moved
        at = draw_device(generator, device)
        perms = torch.empty(
            num_blocks, self.num_points, dtype=_index_dtype(self.num_points), device=at
        )
        # Random keys sorted per block, a chunk of blocks at a time: O(chunk) scratch memory.
        for start in range(0, num_blocks, _GATHER_CHUNK):
            stop = min(start + _GATHER_CHUNK, num_blocks)
            keys = torch.rand(stop - start, self.num_points, generator=generator, device=at)
            perms[start:stop] = keys.argsort(dim=1)
        perms = perms.to(device)
        signs = None
        if self.random_signs:
            # after the permutations: the same generator state gives the unsigned rule's nodes,
            # block by block times these signs
            signs = torch.randint(
                0, 2, (num_blocks,), generator=generator, dtype=torch.int8, device=at
            )
            signs = signs.mul_(2).sub_(1).to(device)
        weights = equal_weights(self.num_points, dtype, device)
        reference = self._reference.to(dtype=weights.dtype, device=weights.device)
        return _BlockedNodes(
            reference, perms, signs, dim, weights, name=self.name, max_bytes=self.max_bytes
        )

    def table_bytes(self) -> int:
        """The simplex reference ``(r, K)`` with ``r = K - 1``, in float64."""
        return self.block_size * self.num_points * 8

    def _table_description(self) -> str:
        return (
            f"a simplex table of r K float64 entries (r = {self.block_size}, "
            f"K = {self.num_points}): {self.block_size} * {self.num_points} * 8"
        )

    def __repr__(self) -> str:
        return f"BlockedSimplexRule(num_points={self.num_points}, random_signs={self.random_signs})"
