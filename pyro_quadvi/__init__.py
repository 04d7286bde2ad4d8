"""pyro-quadvi: deterministic, quadrature-based variational inference for Pyro."""

from __future__ import annotations

from . import distributions, evidence, quadrature
from .evidence import OPQAResult, opqa_evidence
from .export import to_inference_data
from .guides import AutoMeanFieldNormal, AutoSpikeSlab
from .infer import QuadratureELBO
from .optim import QNVB, SparseQNVB
from .quadrature import make_rule

__version__ = "0.1.0.dev0"

__all__ = [
    "QNVB",
    "AutoMeanFieldNormal",
    "AutoSpikeSlab",
    "OPQAResult",
    "QuadratureELBO",
    "SparseQNVB",
    "__version__",
    "distributions",
    "evidence",
    "make_rule",
    "opqa_evidence",
    "quadrature",
    "to_inference_data",
]
