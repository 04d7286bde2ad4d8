"""What a Gaussian mean-field guide exposes to the quadrature ELBO and to QNVB.

A guide that implements :class:`MeanFieldGuide` (``AutoMeanFieldNormal`` does) reports, after each
run, one :class:`MeanFieldSite` per latent site: the loc and scale it used (only the rows of a
subsampled plate that were seen), where they live in Pyro's param store, the transform to the site's
support, and the minibatch scale of the site. :func:`mean_field_sites_from_trace` builds the same
records from the trace of any guide laid out like Pyro's ``AutoNormal``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from pyro.distributions.transforms import Transform
from pyro.distributions.util import is_identically_one
from pyro.infer.autoguide import AutoNormal
from pyro.poutine import Trace
from torch.distributions import Independent, biject_to
from torch.distributions.constraints import Constraint

__all__ = [
    "MeanFieldGuide",
    "MeanFieldSite",
    "live_mean_field_guides",
    "mean_field_sites_from_trace",
    "register_mean_field_guide",
]


@dataclass
class MeanFieldSite:
    """One latent site of a Gaussian mean-field guide, as used in one run of the guide.

    Attributes:
        name: the model's sample site.
        loc: unconstrained means used in the run, shape ``shape`` (rows of subsampled plates only);
            differentiable with respect to the guide's parameters.
        scale: standard deviations, same shape, positive.
        transform: maps the unconstrained value to the site's support (``biject_to(support)``).
        event_dim: number of rightmost dims of ``loc`` that are event dims.
        scale_factor: the site's minibatch scale in this run (``full size / batch size`` of its
            subsampled plates; 1 without subsampling).
        loc_param, scale_param: names of the full parameters in Pyro's param store (``None`` if the
            guide keeps them elsewhere).
        rows: for each subsampled plate, ``param dim -> indices`` of the rows of the full parameters
            that were used in this run; empty without subsampling.
        constraint: the site's support, which ``transform`` maps onto.
    """

    name: str
    loc: torch.Tensor
    scale: torch.Tensor
    transform: Transform
    event_dim: int
    scale_factor: float = 1.0
    loc_param: str | None = None
    scale_param: str | None = None
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    constraint: Constraint | None = None

    @property
    def shape(self) -> torch.Size:
        """The unconstrained shape of the site in this run (batch + event)."""
        return self.loc.shape


@runtime_checkable
class MeanFieldGuide(Protocol):
    """A guide whose posterior is a Gaussian mean field over the unconstrained latents."""

    def mean_field_sites(self) -> list[MeanFieldSite]:
        """The sites of the most recent run of the guide."""
        ...


_LIVE_GUIDES: weakref.WeakSet = weakref.WeakSet()


def register_mean_field_guide(guide: MeanFieldGuide) -> None:
    """Make ``guide`` discoverable by optimizers that pair loc and scale (QNVB)."""
    _LIVE_GUIDES.add(guide)


def live_mean_field_guides() -> Iterator[MeanFieldGuide]:
    """The registered mean-field guides that are still alive."""
    return iter(list(_LIVE_GUIDES))


def _param_name(guide: AutoNormal, kind: str, site: str) -> str:
    return f"{guide._pyro_name}.{kind}.{site}"


def mean_field_sites_from_trace(guide: AutoNormal, trace: Trace) -> list[MeanFieldSite]:
    """The :class:`MeanFieldSite` records of one run of an ``AutoNormal``-like guide.

    Reads the auxiliary ``{site}_unconstrained`` Normal sites of the trace (their loc and scale are
    the subsampled, differentiable parameters) and the ``_Subsample`` sites of its plates.
    """
    sites = []
    for name, proto in guide.prototype_trace.iter_stochastic_nodes():
        aux = trace.nodes[name + "_unconstrained"]
        event_dim = aux["fn"].event_dim
        normal = aux["fn"]  # Normal(loc, scale), possibly .to_event()
        while isinstance(normal, Independent):
            normal = normal.base_dist
        rows = {}
        for frame in aux["cond_indep_stack"]:
            if frame.vectorized and frame.full_size is not None and frame.full_size != frame.size:
                rows[frame.dim - event_dim] = trace.nodes[frame.name]["value"]
        scale = aux["scale"]
        sites.append(
            MeanFieldSite(
                name=name,
                loc=normal.loc,
                scale=normal.scale,
                transform=biject_to(proto["fn"].support),
                event_dim=event_dim,
                scale_factor=1.0 if is_identically_one(scale) else float(scale),
                loc_param=_param_name(guide, "locs", name),
                scale_param=_param_name(guide, "scales", name),
                rows=rows,
                constraint=proto["fn"].support,
            )
        )
    return sites
