"""Distributions of pyro-quadvi: the spike-and-slab (Dirac-Gauss) mixture, and the iid Normal
prior of `pyro_quadvi.nn`'s priors."""

from .guide_delta import GuideDelta
from .iid_normal import IidNormal
from .spike_slab import SpikeSlab

__all__ = ["GuideDelta", "IidNormal", "SpikeSlab"]
