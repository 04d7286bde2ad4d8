"""Variational guides and the interface they expose to the ELBO and the optimizers."""

from .interface import (
    MeanFieldGuide,
    MeanFieldSite,
    live_mean_field_guides,
    mean_field_sites_from_trace,
    register_mean_field_guide,
)
from .mean_field import AutoMeanFieldNormal

__all__ = [
    "AutoMeanFieldNormal",
    "MeanFieldGuide",
    "MeanFieldSite",
    "live_mean_field_guides",
    "mean_field_sites_from_trace",
    "register_mean_field_guide",
]
