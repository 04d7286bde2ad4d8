"""Cross-polytope vertices in the Hadamard basis: a quasirandom sequence of antithetic pairs.

Sequence paper, Algorithm 3.1: iterate ``q`` gives the sign vector ``s_i = (-1)^parity(i AND q)``
and the antithetic pair ``mu +- sigma * s`` (the algorithm's step 4 takes ``s = 2p - 1``, the
negation: the same pair, its two nodes in the other order). Lemma 3.2 and Theorem 3.3: averaged over
``2^b`` consecutive iterates starting at a multiple of ``2^b``, every pair of coordinates whose
indices first differ in bit ``b - 1`` (counting from 0) sees the 4-node tensor-product cubature, so
its cross moments are exact.

The fast Walsh-Hadamard transform `fwht` (the product with the Sylvester-Hadamard matrix,
whose entries are `hadamard_signs`) lives here too: it is the one implementation in the
package (re-exported as `pyro_quadvi.linalg.fwht`).
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
    check_num_points,
    equal_weights,
)

__all__ = ["MAX_HADAMARD_DIM", "HadamardRule", "fwht", "hadamard_signs"]

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
    matrix, by bit operations alone (sequence paper, Algorithm 3.1, whose ``2p - 1`` is their
    negation; the antithetic pair ``mu +- sigma * s`` is the same).

    Args:
        index: integer tensor of coordinate indices in ``[0, 2^31)`` (an unsigned one is widened
            to int64 first).
        iterate: the sequence position ``q >= 0`` (an int, or an integer tensor broadcasting with
            ``index``). Only its low 31 bits matter for indices below ``2^31`` (a uint64 one
            from ``2^63`` on included, which int64 would read as negative).
        dtype: floating dtype of the result (default dtype when ``None``).

    Raises:
        ValueError: naming the argument, for an ``index`` that is not an integer tensor or holds
            an entry outside ``[0, 2^31)``, an ``iterate`` that is neither an integer nor an
            integer tensor or is negative, or a ``dtype`` that is not floating (Python's
            "unsupported operand type(s) for &" named none; a uint8 ``index`` gave 255 for -1, a
            negative ``iterate`` was read as its low 31 bits).
    """
    if not _is_integer_tensor(index):
        raise ValueError(
            "hadamard_signs: index must be an integer tensor of coordinate indices, got "
            + _described(index)
        )
    if not _is_integer_tensor(iterate) and as_index(iterate) is None:
        raise ValueError(
            "hadamard_signs: iterate must be an int >= 0 or an integer tensor, got "
            + _described(iterate)
        )
    dtype = check_dtype("hadamard_signs", dtype or torch.get_default_dtype())
    wide = index.dtype == torch.uint64
    index = _signed(index)
    bad = _first_outside(index, MAX_HADAMARD_DIM)
    if bad is not None:
        # a uint64 entry from 2^63 on reads as negative in int64: show the entry given
        shown = bad + 2**64 if wide and bad < 0 else bad
        raise ValueError(
            f"hadamard_signs: index must hold coordinate indices in [0, 2^31), got an entry {shown}"
        )
    if isinstance(iterate, torch.Tensor) and iterate.dtype == torch.uint64:
        # every uint64 is >= 0 and only the low 31 bits matter, which int64 keeps
        iterate, negative = _signed(iterate) & _INDEX_MASK, None
    elif isinstance(iterate, torch.Tensor):
        iterate = _signed(iterate)
        negative = _first_outside(iterate, None)
    else:
        iterate = as_index(iterate)  # numpy's integers too
        negative = iterate if iterate < 0 else None
    if negative is not None:
        raise ValueError(f"hadamard_signs: iterate must be >= 0, got {negative}")
    return _signs(index, iterate, dtype)


def _signs(index: torch.Tensor, iterate: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`hadamard_signs` of checked arguments: a signed ``index`` in ``[0, 2^31)``, ``iterate >=
    0``."""
    # a Python int stays one: an operand of the bit operations, never copied to index's device
    iterate = iterate & _INDEX_MASK
    parity = _parity(index & iterate)
    return (1 - 2 * parity).to(dtype)


def _signed(value: torch.Tensor) -> torch.Tensor:
    """An integer tensor as a signed one: unsigned ones widened to int64 (``1 - 2 * parity``
    wrapped to 255 in uint8, and torch has no shifts for uint16 to uint64)."""
    return value if value.dtype.is_signed else value.to(torch.int64)


def _first_outside(value: torch.Tensor, end: int | None) -> int | None:
    """The first entry of ``value`` below 0 or (``end`` given) at least ``end``; ``None`` if none
    (or on ``meta``, which holds no values)."""
    if value.device.type == "meta":
        return None
    outside = value < 0
    if end is not None and torch.iinfo(value.dtype).max >= end:  # int8 would wrap ``end``
        outside |= value >= end
    found = outside.flatten().nonzero()
    return int(value.flatten()[found[0, 0]]) if found.numel() else None


def _is_integer_tensor(value: object) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {value.dtype}"
    return f"{value!r} ({type(value).__name__})"


# -- the fast Walsh-Hadamard transform --------------------------------------------------------

FWHT_RADIX = 32
"""Size of the dense Hadamard blocks `fwht` multiplies by (one matrix product per block of
index bits): ``H_D = H_m (x) ... (x) H_m``, so ``ceil(log2(D) / 5)`` products of ``O(32 D)`` each.
On a CPU a 32 x 32 product runs near the peak of the BLAS, much faster per element than the 5
radix-2 passes over memory it replaces."""

_SYLVESTER: dict[tuple[int, float, torch.dtype, torch.device], torch.Tensor] = {}


def _sylvester(
    size: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0
) -> torch.Tensor:
    """``scale`` times the ``size x size`` Sylvester-Hadamard matrix (entries `hadamard_signs`),
    cached."""
    key = (size, scale, dtype, device)
    if key not in _SYLVESTER:
        index = torch.arange(size, dtype=torch.int32, device=device)
        signs = _signs(index.unsqueeze(0), index.unsqueeze(1), dtype)
        _SYLVESTER[key] = signs * scale if scale != 1.0 else signs
    return _SYLVESTER[key]


def _transform(x: torch.Tensor, normalized: bool) -> torch.Tensor:
    """``x H`` (``normalized``: ``D^(-1/2) x H``) over the last dim by the Kronecker
    factorization of ``H`` (no autograd).

    The normalization is spread over the stages as exact powers of two (``2^(-floor(b / 2))``
    after the stages that did ``b`` index bits; an odd ``log2 D`` leaves a ``2^(-1/2)``, applied
    at the end), so every intermediate is at most ``sqrt(2)`` times the norm of its vector and
    nothing overflows that the result does not: scaling once at the end overflowed float16 from
    ``|x| = 20`` at ``D = 4096``, where the result is 1280."""
    size = x.shape[-1]
    bits = size.bit_length() - 1
    rows = x.numel() // size if size else 0
    radix_bits = FWHT_RADIX.bit_length() - 1
    out, stride, done, halvings = x, 1, 0, 0
    while done < bits:
        block_bits = min(radix_bits, bits - done)
        block = 1 << block_bits
        scale = 1.0
        if normalized:  # 2^(-floor(bits done / 2)) after this stage: exact
            target = (done + block_bits) // 2
            scale, halvings = 2.0 ** (halvings - target), target
        factor = _sylvester(block, x.dtype, x.device, scale)
        if stride == 1:  # the lowest index bits: a plain (rows * size / block, block) product
            out = out.reshape(rows * size // block, block) @ factor
        else:  # index bits above ``stride``: H_block acts on the middle axis
            out = torch.matmul(factor, out.reshape(rows * size // (block * stride), block, stride))
        stride *= block
        done += block_bits
    if normalized and bits % 2:  # the 2^(-1/2) left of D^(-1/2), rounded once
        out = out * 2.0**-0.5
    elif bits == 0:  # size 1: H = [1]; a new tensor all the same, as for every other size
        out = out.clone()
    return out.reshape(x.shape)


class _FWHT(torch.autograd.Function):
    """``y = x H`` (``normalized``: times ``D^(-1/2)``); ``H`` is symmetric, so the backward (and
    the forward-mode tangent) is the same transform of the incoming gradient. Nothing is saved for
    the backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, normalized: bool) -> torch.Tensor:
        return _transform(x, normalized)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.normalized = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _FWHT.apply(grad, ctx.normalized), None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, _normalized):
        return _FWHT.apply(tangent, ctx.normalized)


def fwht(x: torch.Tensor, normalized: bool = False) -> torch.Tensor:
    """The fast Walsh-Hadamard transform of ``x`` over its last dim: ``x @ H_D``.

    ``H_D`` is the Sylvester-Hadamard matrix of WHVI paper Section 2.1 (``H_2 = [[1, 1], [1,
    -1]]``, ``H_2D = [[H_D, H_D], [H_D, -H_D]]``; entry ``(i, j)`` is
    ``(-1)^parity(i AND j)``, `hadamard_signs`), symmetric, so ``x @ H = (H x^T)^T``: every
    vector along the last dim is multiplied by ``H``. ``O(D log D)`` per vector (the paper's
    FWHT): ``H_D`` is the Kronecker power of a 32 x 32 block, applied block of index bits by block
    (`FWHT_RADIX`).

    Args:
        x: a tensor of any floating dtype (float16 and bfloat16 too) and any batch shape whose
            last dim ``D`` is a power of two (``1, 2, 4, ...``).
        normalized: multiply by ``D^(-1/2)``, making the transform orthonormal (and its own
            inverse). The factor is spread over the stages, so the transform overflows only
            where its result does (float16 of 20s at ``D = 4096``: 1280, not ``inf``).

    Differentiable (a custom autograd function whose backward is the same transform of the
    gradient, with forward mode too) and usable under ``torch.func.vmap``.

    Raises:
        TypeError: for a tensor that is not floating point.
        ValueError: for a 0-dim tensor or a last dim that is not a power of two.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fwht: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"fwht: x must have a floating dtype (e.g. x.float()), got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("fwht: x must have at least one dim (the transformed last dim)")
    size = x.shape[-1]
    if size == 0:
        raise ValueError(
            f"fwht: the last dim of x is empty (shape {tuple(x.shape)}); it must hold a power of "
            "two >= 1 of entries"
        )
    if size & (size - 1):
        raise ValueError(
            f"fwht: the last dim of x must be a power of two, got {size}; pad it with zeros to "
            f"{1 << max(size - 1, 0).bit_length()}"
        )
    return _FWHT.apply(x, bool(normalized))


_SIGN_TABLES: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _sign_table(
    size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices ``0 .. n - 1`` and their signs ``(-1)^parity(i)`` (`_signs` of ``i`` and
    ``n - 1``), ``n`` the power of two at least ``size``, cached per dtype and device and grown
    to the largest size asked: at most ``2^16`` entries, 512 KiB of int64 indices and 512 KiB
    of float64 signs. Since ``i & q <= i``, entry ``i & q`` of the table is
    ``hadamard_signs(i, q)`` for every ``i < n``: a node's row is one gather, where the bit
    operations took a dozen passes (a pair of nodes at ``dim = 151``: 220 to 48 us)."""
    key = (dtype, device)
    cached = _SIGN_TABLES.get(key)
    if cached is None or cached[0].numel() < size:
        length = 1 << max(size - 1, 0).bit_length()
        index = torch.arange(length, device=device)
        cached = _SIGN_TABLES[key] = (index, _signs(index, length - 1, dtype))
    return cached


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
        return self._write(k, torch.empty(self.dim, dtype=self.dtype, device=self.device))

    def _write(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """Node ``k`` (see `node`) written into ``out`` of shape ``(dim,)``: the outer
        product of the high and low rows straight into ``out``, the rows that fit whole and then
        the part of the last one. Each row is read from the table of parities (`_sign_table`):
        ``parity(i & q)`` for ``i & q`` below ``2^16``."""
        q = (self.first_iterate + k // 2) & _INDEX_MASK
        low_size = min(self.dim, 1 << _LOW_BITS)
        high_size = -(-self.dim // low_size)
        index, table = _sign_table(low_size, self.dtype, self.device)
        low = table.index_select(0, index[:low_size] & (q & ((1 << _LOW_BITS) - 1)))
        high = table.index_select(0, index[:high_size] & (q >> _LOW_BITS))
        if k % 2:
            high = -high
        whole, rest = divmod(self.dim, low_size)
        torch.mul(high[:whole, None], low, out=out[: whole * low_size].view(whole, low_size))
        if rest:
            torch.mul(high[whole], low[:rest], out=out[whole * low_size :])
        return out

    def _matrix(self) -> torch.Tensor:
        # one Kronecker row per pair (see node), each written once into the matrix, and its
        # negation beside it: two passes over memory per pair, no stacking copies
        out = torch.empty(len(self), self.dim, dtype=self.dtype, device=self.device)
        for j in range(len(self) // 2):
            self._write(2 * j, out[2 * j])
            torch.neg(out[2 * j], out=out[2 * j + 1])
        return out


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
    exact_coordinate_quadratics = True

    def __init__(self, num_points: int, max_bytes: int = DEFAULT_MAX_BYTES):
        num_points = check_num_points(num_points)
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

    def draw(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NodeSet:
        dim, step, dtype = self.check_draw(dim, step, generator, dtype, device)
        if dim > MAX_HADAMARD_DIM:
            raise ValueError(f"hadamard supports dim <= 2^31, got {dim}")
        weights = equal_weights(self.num_points, dtype, device)
        return _HadamardNodes(
            dim, step * (self.num_points // 2), weights, name=self.name, max_bytes=self.max_bytes
        )
