"""Model evidence: OPQA, the orthogonal-polynomials quadrature algorithm, with a centred weight.

`baselines` holds the estimators it is compared with (importance
sampling, nested sampling).
"""

from .baselines import (
    EvidenceEstimate,
    importance_log_evidence,
    nested_sampling_log_evidence,
    prior_guide,
)
from .opqa import OPQAResult, opqa_evidence
from .posterior import Marginal, OPQAPosterior

__all__ = [
    "EvidenceEstimate",
    "Marginal",
    "OPQAPosterior",
    "OPQAResult",
    "importance_log_evidence",
    "nested_sampling_log_evidence",
    "opqa_evidence",
    "prior_guide",
]
