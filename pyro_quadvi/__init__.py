"""pyro-quadvi: deterministic, quadrature-based variational inference for Pyro."""

from __future__ import annotations

from . import quadrature
from .export import to_inference_data
from .guides import AutoMeanFieldNormal
from .infer import QuadratureELBO
from .quadrature import make_rule

__version__ = "0.1.0.dev0"

__all__ = [
    "AutoMeanFieldNormal",
    "QuadratureELBO",
    "__version__",
    "make_rule",
    "quadrature",
    "to_inference_data",
]
