"""Variational guides and the interface they expose to the ELBO and the optimizers."""

from .interface import (
    GuideDescription,
    JointGaussian,
    MeanFieldSite,
    PublishedMoments,
    QuadratureGuide,
    describe_guide,
    register_adapter,
    register_guide,
)
from .mean_field import AutoMeanFieldNormal
from .spike_slab import AutoSpikeSlab

__all__ = [
    "AutoMeanFieldNormal",
    "AutoSpikeSlab",
    "GuideDescription",
    "JointGaussian",
    "MeanFieldSite",
    "PublishedMoments",
    "QuadratureGuide",
    "describe_guide",
    "register_adapter",
    "register_guide",
]
