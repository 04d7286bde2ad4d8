"""Bit-for-bit comparison of nested results (states, param stores, ranks' outcomes)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["equal_nested"]


def equal_nested(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are equal, bit for bit: tensors by ``torch.equal``, dicts key by
    key (the same keys), lists and tuples item by item (the same length), anything else by
    ``==``."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(equal_nested(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(equal_nested(x, y) for x, y in zip(a, b))
        )
    return a == b
