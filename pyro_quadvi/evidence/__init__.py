"""Model evidence: OPQA, the orthogonal-polynomials quadrature algorithm, with a centred weight."""

from .opqa import OPQAResult, opqa_evidence
from .posterior import Marginal, OPQAPosterior

__all__ = ["Marginal", "OPQAPosterior", "OPQAResult", "opqa_evidence"]
