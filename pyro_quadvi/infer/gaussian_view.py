"""Affine Gaussian guides seen as ``z = loc + A x`` with ``x ~ N(0, I)``.

The quadrature ELBO integrates against any guide whose unconstrained posterior is an affine image of
a standard normal: mean fields (``AutoMeanFieldNormal``, Pyro's ``AutoNormal`` and
``AutoDiagonalNormal``) and, since an affine map keeps Gaussian quadrature Gaussian, the full-rank
and low-rank ``AutoMultivariateNormal`` / ``AutoLowRankMultivariateNormal``. Each is read off one
traced run of the guide, so subsampled plates and the differentiable parameters come along.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pyro.distributions as dist
import torch
from pyro.infer.autoguide import (
    AutoContinuous,
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.poutine import Trace
from torch.distributions import biject_to

from ..guides.interface import mean_field_sites_from_trace
from .log_joint import LatentSite, latent_nodes

__all__ = ["SUPPORTED_GUIDES", "GaussianView", "gaussian_view"]

SUPPORTED_GUIDES = (
    AutoNormal,
    AutoDiagonalNormal,
    AutoMultivariateNormal,
    AutoLowRankMultivariateNormal,
)

_HALF_LOG_2PI_E = 0.5 * math.log(2 * math.pi * math.e)


@dataclass
class GaussianView:
    """One run of a Gaussian guide as an affine map of standard normal offsets.

    Attributes:
        sites: the latent sites, laid end to end in the unconstrained vector ``z``.
        dim: the number of standard normal coordinates ``x`` (the quadrature's dimension).
        affine: maps offsets ``x`` of shape ``(K, dim)`` to unconstrained points
            ``(K, latent dim)``.
        entropy: the guide's entropy in the unconstrained space (minibatch-scaled), analytic.
    """

    sites: list[LatentSite]
    dim: int
    affine: Callable[[torch.Tensor], torch.Tensor]
    entropy: torch.Tensor


def gaussian_view(guide, guide_trace: Trace) -> GaussianView:
    """Read the affine Gaussian form of one traced run of ``guide``.

    Raises:
        TypeError: for a guide that is not an affine Gaussian AutoGuide; the message lists the
            supported ones.
    """
    if isinstance(guide, AutoNormal):
        return _mean_field_view(guide, guide_trace)
    if isinstance(guide, SUPPORTED_GUIDES):
        return _continuous_view(guide, guide_trace)
    names = ", ".join(cls.__name__ for cls in SUPPORTED_GUIDES)
    raise TypeError(
        f"QuadratureELBO needs a Gaussian guide: AutoMeanFieldNormal, {names}; "
        f"got {type(guide).__name__}"
    )


def _mean_field_view(guide: AutoNormal, guide_trace: Trace) -> GaussianView:
    mf_sites = mean_field_sites_from_trace(guide, guide_trace)
    loc = torch.cat([site.loc.reshape(-1) for site in mf_sites])
    scale = torch.cat([site.scale.reshape(-1) for site in mf_sites])
    entropy = sum(
        site.scale_factor * (site.scale.log().sum() + _HALF_LOG_2PI_E * site.scale.numel())
        for site in mf_sites
    )
    sites = [LatentSite(s.name, s.loc.shape, s.event_dim, s.transform) for s in mf_sites]
    return GaussianView(sites, loc.numel(), lambda x: loc + scale * x, entropy)


def _continuous_view(guide: AutoContinuous, guide_trace: Trace) -> GaussianView:
    posterior = guide_trace.nodes[f"_{guide._pyro_name}_latent"]["fn"]
    sites = []
    for name, site in latent_nodes(guide.prototype_trace):
        shape = guide._unconstrained_shapes[name]
        event_dim = site["fn"].event_dim + len(shape) - site["value"].dim()
        sites.append(LatentSite(name, shape, event_dim, biject_to(site["fn"].support)))
    if isinstance(posterior, dist.LowRankMultivariateNormal):
        # z = loc + W x_1 + sqrt(D) x_2 with (x_1, x_2) ~ N(0, I_{r + d}): covariance W W^T + D.
        loc, factor = posterior.loc, posterior.cov_factor
        root_diag = posterior.cov_diag.sqrt()
        rank = factor.shape[-1]

        def affine(x):
            return loc + x[..., :rank] @ factor.T + root_diag * x[..., rank:]

        return GaussianView(sites, rank + loc.numel(), affine, posterior.entropy())
    if isinstance(posterior, dist.MultivariateNormal):
        loc, tril = posterior.loc, posterior.scale_tril
        return GaussianView(sites, loc.numel(), lambda x: loc + x @ tril.T, posterior.entropy())
    loc, scale = posterior.mean, posterior.stddev  # Normal(loc, scale).to_event(1)
    return GaussianView(sites, loc.numel(), lambda x: loc + scale * x, posterior.entropy())
