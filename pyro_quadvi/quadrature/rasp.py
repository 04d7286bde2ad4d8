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

import itertools
import math
from typing import Any

import torch

from .base import (
    DEFAULT_MAX_BYTES,
    NodeSet,
    QuadratureRule,
    as_index,
    check_num_points,
    draw_device,
    equal_weights,
)

__all__ = ["BlockedSimplexRule", "RASPRule", "cross_reference", "simplex_reference"]


def _check_r(owner: str, r: object) -> int:
    """``r`` as an ``int``: an integer (numpy's, a 0-d integer tensor; not a bool) ``>= 1``, else
    a ``ValueError`` naming ``owner`` (a float or a string failed deep in torch or Python)."""
    index = as_index(r)
    if index is None or index < 1:
        raise ValueError(
            f"{owner}: r must be an integer >= 1 (the number of dimensions), got {r!r} "
            f"({type(r).__name__})"
        )
    return index


def simplex_reference(r: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Simplex vertices as an ``(r, r + 1)`` matrix, each column a node of weight ``1 / (r + 1)``.

    rasp paper, Algorithm 1: ``R = [alpha I - beta 1 1^T, -1]`` with ``alpha = sqrt(r + 1)`` and
    ``beta = 1 / (1 + alpha)``. The nodes have zero mean and identity second moment, so every
    polynomial of total degree <= 2 in ``r`` variables is integrated exactly against ``N(0, I_r)``.
    """
    r = _check_r("simplex_reference", r)
    alpha = math.sqrt(r + 1)
    beta = 1.0 / (1.0 + alpha)
    first = alpha * torch.eye(r, dtype=dtype) - beta * torch.ones(r, r, dtype=dtype)
    return torch.cat([first, -torch.ones(r, 1, dtype=dtype)], dim=1)


def cross_reference(r: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Cross-polytope vertices as an ``(r, 2r)`` matrix, each column of weight ``1 / (2r)``.

    rasp paper, Algorithm 2: ``R = sqrt(r) [I, -I]``. Symmetric, so every odd moment vanishes and
    the rule is exact to degree 3 (degree 5 in one variable when ``r = 3``).
    """
    r = _check_r("cross_reference", r)
    eye = math.sqrt(r) * torch.eye(r, dtype=dtype)
    return torch.cat([eye, -eye], dim=1)


_GATHER_CHUNK = 1 << 20
"""Coordinates gathered per pass in `_gather`: the small integers are widened to int32 (as
``index_select`` needs) one chunk at a time, never all ``dim`` at once."""


def _index_dtype(num_values: int) -> torch.dtype:
    """The smallest signed integer dtype that holds ``0 .. num_values - 1``."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if num_values - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def _gather(tables: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[k, i] = tables[k, index[i]]`` for every ``k``: one ``index_select`` per table, the
    small integers of ``index`` widened to int32 (as ``index_select`` needs) one chunk of
    `_GATHER_CHUNK` at a time and shared by the ``K`` tables."""
    for start in range(0, index.shape[0], _GATHER_CHUNK):
        stop = min(start + _GATHER_CHUNK, index.shape[0])
        rows = index[start:stop].int()
        for table, target in zip(tables, out):
            torch.index_select(table, 0, rows, out=target[start:stop])
    return out


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
        k = self._check_index(k)
        out = torch.empty(1, self.dim, dtype=self.table.dtype, device=self.table.device)
        return _gather(self.table.T[k : k + 1], self.index, out)[0]

    def _matrix(self) -> torch.Tensor:
        # row by row from the K columns of the table (a copy of 2r K numbers): one widening of
        # the integers per chunk, no (dim,) int64 index and no gather across a strided table
        out = torch.empty(len(self), self.dim, dtype=self.table.dtype, device=self.table.device)
        return _gather(self.table.T.contiguous(), self.index, out)


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
        num_points = check_num_points(num_points)
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
        dim, step, dtype = self.check_draw(dim, step, generator, dtype, device)
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


_CODED_MAX_POINTS = 6
"""Up to this ``K`` the blocked rule codes each block's permutation as one small integer, found by
comparing the ``K`` keys pairwise (``K (K - 1) / 2`` elementwise passes), and gathers its nodes
from a table of every permutation (``K! K r`` numbers, 21,600 for ``K = 6``); above it the keys
are argsorted and the permutations kept, ``K`` integers per block."""

_KEY_DTYPE = torch.float32
"""The dtype of the blocked rule's random keys, whatever torch's default dtype: the nodes are a
function of the generator state alone (keys drawn in the default dtype gave other nodes under a
float64 default). float32, torch's own default, keeps the nodes every figure was measured with."""

_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_words(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` of shape ``(..., r)`` seen as one integer word per block where ``r * itemsize``
    is 2, 4 or 8 bytes (the same bytes: a gather moves them unchanged, in one move per block),
    else ``blocks`` itself."""
    word = _WORDS.get(blocks.shape[-1] * blocks.element_size())
    return blocks if word is None else blocks.view(word)


def _block_codes(keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The order of each row of ``keys`` as one integer in ``[0, K!)``, by pairwise comparisons.

    Row ``b`` sorted ascending, ties by index (a stable sort, and torch's CPU ``argsort`` of rows
    of at most 16 keys), puts key ``j`` before key ``i < j`` exactly when
    ``keys[b, i] > keys[b, j]``. Digit ``i`` counts the later keys that go before key ``i``
    (``0 .. K - 1 - i``: the Lehmer code of the row's ranks), and
    ``out[b] = sum_{i<j} [keys[b, i] > keys[b, j]] (K - 1 - i)!`` gives each of the ``K!``
    orders its own code: ``O(K^2)`` elementwise work in place of a sort.
    """
    num_keys = keys.shape[1]
    out.zero_()
    for i in range(num_keys - 1):
        weight = math.factorial(num_keys - 1 - i)
        for j in range(i + 1, num_keys):
            # the bools seen as int8 (the same bytes): added without a conversion
            out.add_(torch.gt(keys[:, i], keys[:, j]).view(torch.int8), alpha=weight)
    return out


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


class _CodedBlockNodes(NodeSet):
    """The blocked rule's nodes from one code per block (`_block_codes`, ``K`` up to
    `_CODED_MAX_POINTS`): ``tables[k, c]`` is node ``k`` of a block whose permutation has
    code ``c`` (negated for ``c >= K!``), so node ``k`` is one gather ``tables[k, code]``."""

    def __init__(
        self,
        tables: torch.Tensor,
        code: torch.Tensor,
        perm_table: torch.Tensor,
        dim: int,
        weights: torch.Tensor,
        **limits: Any,
    ):
        super().__init__(dim, weights, **limits)
        self.tables = tables  # (K, K! or 2 K!, r), in the nodes' dtype
        self.code = code  # (num_blocks,) small integers: K! + code for a negated block
        self.perm_table = perm_table  # (K!, K) int8: the permutation of each code

    @property
    def perms(self) -> torch.Tensor:
        """``(num_blocks, K)`` int8: block ``b`` uses simplex column ``perms[b, k]`` as node
        ``k``."""
        return self.perm_table[self.code.long() % self.perm_table.shape[0]]

    @property
    def signs(self) -> torch.Tensor | None:
        """``(num_blocks,)`` int8 of +-1, or ``None`` for the unsigned rule."""
        if self.tables.shape[1] == self.perm_table.shape[0]:
            return None
        return 1 - 2 * (self.code >= self.perm_table.shape[0]).to(torch.int8)

    def _blocks(self, tables: torch.Tensor) -> torch.Tensor:
        out = torch.empty(
            tables.shape[0],
            self.code.shape[0],
            tables.shape[2],
            dtype=self.dtype,
            device=self.device,
        )
        _gather(_as_words(tables), self.code, _as_words(out))
        return out.reshape(tables.shape[0], -1)[:, : self.dim]

    def node(self, k: int) -> torch.Tensor:
        k = self._check_index(k)
        return self._blocks(self.tables[k : k + 1])[0]

    def _matrix(self) -> torch.Tensor:
        return self._blocks(self.tables)


class BlockedSimplexRule(QuadratureRule):
    """Stochastic blocked mean-field quadrature (sequence paper, Section 3.1).

    Coordinates are split into consecutive blocks of ``r = K - 1`` (the last block may be shorter);
    each block carries the ``r + 1`` simplex sigma points of `simplex_reference`, their order
    permuted uniformly at random and independently per block. Every polynomial of total degree <= 2
    within a block is exact (Section 3.1), and by Theorem 3.1 the expectation over the permutations
    of any product of such functions across blocks equals the tensor-product cubature.

    With ``random_signs=True`` each block's points are also multiplied by an independent random
    sign, one per block and draw. The unsigned rule (``random_signs=False``, the default)
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
            ``False``, the default, is the sequence paper's blocked rule (Section 3.1) on
            `simplex_reference`'s points, the rasp paper's Algorithm 1; the sequence paper's
            experiments take Uhlmann's sigma points (its Algorithm A.1), as exact on quadratics
            within a block but with other odd moments (third moments 0.707 and 0 in a block's
            two coordinates at ``K = 3``, against 0.5 in both here). The signs are
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
        num_points = check_num_points(num_points)
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
        self._perm_table = None  # (K!, K) int8: row c is the permutation of code c
        if num_points <= _CODED_MAX_POINTS:
            # every order of K distinct keys, coded as a draw codes its keys
            keys = torch.tensor(list(itertools.permutations(range(num_points))), dtype=torch.int64)
            codes = _block_codes(keys, torch.empty(keys.shape[0], dtype=torch.int64))
            self._perm_table = torch.empty_like(keys, dtype=torch.int8)
            self._perm_table[codes] = keys.argsort(dim=1).to(torch.int8)

    def draw(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NodeSet:
        dim, step, dtype = self.check_draw(dim, step, generator, dtype, device)
        num_blocks = -(-dim // self.block_size)
        # drawn where the generator lives (a CPU generator serves any device), then moved
        at = draw_device(generator, device)
        coded = self._perm_table is not None
        if coded:  # one code per block, K! more for a negated block
            num_perms = self._perm_table.shape[0]
            shape, num_values = (num_blocks,), num_perms * (1 + self.random_signs)
        else:
            shape, num_values = (num_blocks, self.num_points), self.num_points
        order = torch.empty(shape, dtype=_index_dtype(num_values), device=at)
        # Random keys ordered per block, a chunk of blocks at a time: O(chunk) scratch memory.
        for start in range(0, num_blocks, _GATHER_CHUNK):
            stop = min(start + _GATHER_CHUNK, num_blocks)
            keys = torch.rand(
                stop - start, self.num_points, generator=generator, dtype=_KEY_DTYPE, device=at
            )
            if not coded:
                order[start:stop] = keys.argsort(dim=1)
                continue
            if keys.device.type != "cpu":
                # argsort orders tied keys by index on the CPU, as the codes do; elsewhere its
                # order of ties is its own, and its ranks (all distinct) code that order
                keys = keys.argsort(dim=1).argsort(dim=1)
            _block_codes(keys, order[start:stop])
        signs = None
        if self.random_signs:
            # after the permutations: the same generator state gives the unsigned rule's nodes,
            # block by block times these signs
            signs = torch.randint(
                0, 2, (num_blocks,), generator=generator, dtype=torch.int8, device=at
            )
            if coded:
                order.add_(signs.eq(0), alpha=num_perms)
            else:
                signs = signs.mul_(2).sub_(1).to(device)
        order = order.to(device)
        weights = equal_weights(self.num_points, dtype, device)
        reference = self._reference.to(dtype=weights.dtype, device=weights.device)
        if not coded:
            return _BlockedNodes(
                reference, order, signs, dim, weights, name=self.name, max_bytes=self.max_bytes
            )
        perm_table = self._perm_table.to(device)
        tables = reference.T[perm_table.T.long()]  # (K, K!, r): node k under every permutation
        if self.random_signs:
            tables = torch.cat([tables, -tables], dim=1)
        return _CodedBlockNodes(
            tables, order, perm_table, dim, weights, name=self.name, max_bytes=self.max_bytes
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
