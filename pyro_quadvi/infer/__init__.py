"""Inference: the model's log joint at unconstrained points, the quadrature ELBO and the
Gumbel-softmax spike-and-slab ELBO."""

from .batched import BatchDecision, DecisionCache, evaluate_batch, is_broadcast_error
from .gumbel import GumbelSpikeSlabELBO
from .log_joint import LatentSite, LogJoint, latent_sites_of_model, model_max_plate_nesting
from .quadrature_elbo import PointsELBO, QuadratureELBO

__all__ = [
    "BatchDecision",
    "DecisionCache",
    "GumbelSpikeSlabELBO",
    "LatentSite",
    "LogJoint",
    "PointsELBO",
    "QuadratureELBO",
    "evaluate_batch",
    "is_broadcast_error",
    "latent_sites_of_model",
    "model_max_plate_nesting",
]
