"""Inference: the model's log joint at unconstrained points, and the quadrature ELBO."""

from .log_joint import LatentSite, LogJoint, latent_sites_of_model, model_max_plate_nesting
from .quadrature_elbo import QuadratureELBO

__all__ = [
    "LatentSite",
    "LogJoint",
    "QuadratureELBO",
    "latent_sites_of_model",
    "model_max_plate_nesting",
]
