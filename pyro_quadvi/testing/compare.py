"""Bit-for-bit comparison of nested results (states, param stores, ranks' outcomes)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["bit_patterns", "equal_nested"]


def bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """The floating tensor ``t``'s bit patterns, flat (``torch.equal`` holds ``-0.0 == 0.0`` and
    ``nan != nan``; the patterns tell them apart and match a NaN with itself)."""
    return t.reshape(-1).view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def equal_nested(a: Any, b: Any, bits: bool = False) -> bool:
    """Whether ``a`` and ``b`` are equal, bit for bit: tensors by ``torch.equal`` (with ``bits``,
    the same dtype and shape and, for floating tensors, the same `bit_patterns`), dicts key by
    key (the same keys), lists and tuples item by item (the same length), anything else by
    ``==``."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return False
        if not bits:
            return torch.equal(a, b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point() and a.dtype in (torch.float32, torch.float64):
            return torch.equal(bit_patterns(a), bit_patterns(b))
        return torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(equal_nested(a[k], b[k], bits) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(equal_nested(x, y, bits) for x, y in zip(a, b))
        )
    return a == b
