"""``GuideDelta``: the point at which a guide puts a site's constrained value, with the KL that
keeps its density.

Pyro's ``AutoNormal`` draws a site's unconstrained value ``u`` at an auxiliary site and samples the
site itself as ``Delta(T(u), log_density=log|dT^-1/dv|)``: the density of the draw in the
constrained space is the auxiliary site's times that Jacobian. ``TraceMeanField_ELBO`` takes each
site's term as ``kl_divergence(guide_fn, prior)``, and Pyro's ``kl_divergence(Delta, p)`` is
``-p.log_prob(v)``, which leaves ``log_density`` out. For a constrained site the loss then misses
its change of variables (a ``Gamma`` site's loss is ``Trace_ELBO``'s minus its loc, unbounded
below). ``GuideDelta`` is a ``Delta`` whose KL to any distribution is the single-draw

    KL = log q(v) - log p(v) = log_density - p.log_prob(v),

so ``TraceMeanField_ELBO``'s loss of the guide is ``Trace_ELBO``'s. (NumPyro made the same change to
its own ``kl_divergence(Delta, ...)``.)
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
from torch.distributions import Distribution
from torch.distributions.kl import register_kl

__all__ = ["GuideDelta"]


class GuideDelta(dist.Delta):
    """A ``Delta`` whose ``kl_divergence`` to any distribution counts its ``log_density``."""


@register_kl(GuideDelta, dist.Distribution)  # Pyro's (Delta, Distribution) names its own base
@register_kl(GuideDelta, Distribution)
def _kl_guide_delta(q: GuideDelta, p: Distribution) -> torch.Tensor:
    return q.log_density - p.log_prob(q.v)
