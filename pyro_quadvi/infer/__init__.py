"""Inference: the model's log joint at unconstrained points, and the quadrature ELBO."""

from .batched import BatchDecision, DecisionCache, evaluate_batch, is_broadcast_error
from .log_joint import LatentSite, LogJoint, latent_sites_of_model, model_max_plate_nesting
from .quadrature_elbo import QuadratureELBO

__all__ = [
    "BatchDecision",
    "DecisionCache",
    "LatentSite",
    "LogJoint",
    "QuadratureELBO",
    "evaluate_batch",
    "is_broadcast_error",
    "latent_sites_of_model",
    "model_max_plate_nesting",
]
