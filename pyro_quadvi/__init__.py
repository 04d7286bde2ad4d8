"""pyro-quadvi: deterministic, quadrature-based variational inference for Pyro."""

from __future__ import annotations

from . import quadrature
from .optim import QNVB
from .quadrature import make_rule

__version__ = "0.1.0.dev0"

__all__ = ["QNVB", "__version__", "make_rule", "quadrature"]
