"""Inference: the model's log joint at unconstrained points, and the quadrature ELBO."""

from .gaussian_view import SUPPORTED_GUIDES, GaussianView, gaussian_view
from .log_joint import LatentSite, LogJoint, latent_sites_of_model, model_max_plate_nesting
from .quadrature_elbo import QuadratureELBO

__all__ = [
    "SUPPORTED_GUIDES",
    "GaussianView",
    "LatentSite",
    "LogJoint",
    "QuadratureELBO",
    "gaussian_view",
    "latent_sites_of_model",
    "model_max_plate_nesting",
]
