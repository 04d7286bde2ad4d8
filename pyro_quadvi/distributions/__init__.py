"""Distributions of pyro-quadvi: the spike-and-slab (Dirac-Gauss) mixture."""

from .spike_slab import SpikeSlab

__all__ = ["SpikeSlab"]
