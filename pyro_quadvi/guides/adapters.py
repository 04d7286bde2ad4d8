"""Descriptions of Pyro's own Gaussian guides, registered by class (the one place they are known).

* ``AutoNormal`` (and so ``AutoMeanFieldNormal``): one ``"gaussian"`` block per latent site.
* ``AutoNormalMessenger``: the same, read from the trace of its run (not its subclasses that
  change the posterior, such as ``AutoHierarchicalNormalMessenger``).
* ``AutoDiagonalNormal``: one ``"gaussian"`` block over all latents (its ``loc`` and ``scale``).
* ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``: a joint Gaussian (``"mvn"``).

Leaves are read from the guide module itself (``_parameters``, without the side effects of
``PyroModule.__getattr__``); after a run they are the tensors Pyro's ``SVI`` hands its optimizer,
with the global param store or with ``module_local_params``.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter

import pyro.distributions as dist
import torch
from pyro.distributions.util import is_identically_one
from pyro.infer.autoguide import (
    AutoContinuous,
    AutoDiagonalNormal,
    AutoGuide,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
    AutoNormalMessenger,
)
from pyro.poutine import Trace
from torch.distributions import Distribution, Independent, biject_to, constraints, transform_to
from torch.distributions.constraints import Constraint

from ..infer.log_joint import LatentSite, latent_nodes
from .interface import (
    GuideDescription,
    JointGaussian,
    MeanFieldSite,
    _transformed_normal,
    check_traced,
    mask_tensor,
    masked_sum,
    register_adapter,
    run_mask,
    run_scale,
)

__all__ = [
    "check_draws_traced",
    "check_no_subsampled_latents",
    "check_set_up",
    "continuous_latent_sites",
    "describe_auto_normal",
    "describe_auto_normal_messenger",
    "scale_factor",
    "site_mask",
    "subsample_rows",
]


def _leaf(module, dotted: str) -> tuple[torch.Tensor, object, str]:
    """The leaf tensor, its constraint and its full name for a (Pyro)Param ``module.dotted``."""
    *path, attr = dotted.split(".")
    owner = attrgetter(".".join(path))(module) if path else module
    if attr in owner._pyro_params:
        constraint = owner._pyro_params[attr][0]
        leaf = owner._parameters[attr + "_unconstrained"]
    else:
        constraint = constraints.real
        leaf = owner._parameters[attr]
    return leaf, constraint, owner._pyro_get_fullname(attr)


def subsample_rows(
    site: dict, trace: Trace, event_dim: int, plates: Mapping[str, object] | None = None
) -> dict[int, torch.Tensor]:
    """``param dim -> indices`` of the subsampled plates a traced guide site sits in.

    A plate made outside ``trace`` (an ``AutoGuideList`` makes its parts' plates, so a part's
    own trace lacks their subsample sites) is read from ``plates``, its plate objects by name.
    """
    rows = {}
    for frame in site["cond_indep_stack"]:
        if frame.vectorized and frame.full_size is not None and frame.full_size != frame.size:
            node = trace.nodes.get(frame.name)
            indices = node["value"] if node is not None else plates[frame.name].indices
            rows[frame.dim - event_dim] = indices
    return rows


def scale_factor(site: dict) -> float:
    """The scale of a traced site: its minibatch scale times that of any ``poutine.scale``
    around it (1 without either).

    Raises:
        ValueError: for a scale that is a tensor of several elements (a ``poutine.scale`` by a
            tensor), which no one number divides out.
    """
    scale = site["scale"]
    if is_identically_one(scale):
        return 1.0
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        raise ValueError(
            f"site {site['name']!r} of the guide has a scale of shape {tuple(scale.shape)} (a "
            "poutine.scale by a tensor), which scales its entries unevenly: a description takes "
            "one number. Scale the guide by one number, or weight the data in the model only"
        )
    return float(scale)


def site_mask(site: dict) -> torch.Tensor | None:
    """The mask of a traced guide site (a ``poutine.mask`` around the guide), as a bool tensor;
    ``None`` without one or under ``mask=True``, which masks nothing."""
    return mask_tensor(site["mask"])


def _select(t: torch.Tensor, rows: dict[int, torch.Tensor] | None) -> torch.Tensor:
    for dim, index in (rows or {}).items():
        t = t.index_select(dim, index)
    return t


def site_run(
    name: str,
    event_dim: int,
    trace: Trace | None,
    last_run: dict[str, tuple[float, dict[int, torch.Tensor]]] | None,
) -> tuple[Distribution | None, float, dict[int, torch.Tensor] | None, torch.Tensor | None]:
    """What one run of an ``AutoNormal``-like guide did at site ``name``.

    With a ``trace``: the distribution of its ``{name}_unconstrained`` draw (``Independent``
    unwrapped), its minibatch scale, the rows used and its mask (`site_mask`). Without one:
    ``None``, and the scale, rows and mask of the guide's last run where it keeps them
    (``last_run``: ``(scale, rows)`` or ``(scale, rows, mask)``), else ``(1.0, None)``, no mask.
    """
    if trace is None:
        # (a record without a mask, of describe_auto_normal or a guide pickled before: None)
        factor, rows, mask = (*(last_run or {}).get(name, (1.0, None)), None)[:3]
        return None, factor, rows, mask
    aux = trace.nodes[name + "_unconstrained"]
    fn = aux["fn"]
    while isinstance(fn, Independent):
        fn = fn.base_dist
    return fn, scale_factor(aux), subsample_rows(aux, trace, event_dim), site_mask(aux)


def describe_auto_normal(
    guide: AutoNormal,
    trace: Trace | None,
    last_run: dict[str, tuple[float, dict[int, torch.Tensor]]] | None = None,
) -> GuideDescription:
    """An ``AutoNormal``-like guide: a ``"gaussian"`` block per site.

    Args:
        guide: the guide (set up: it has run once).
        trace: a trace of one run; ``None`` describes the current parameters.
        last_run: without a trace, ``site -> (scale factor, rows, mask)`` of the guide's last
            run where the guide keeps it (``AutoMeanFieldNormal``); otherwise rows are unknown
            (``None``) and each site's scale factor and mask are the handlers' around the
            guide's last run (`run_scale`: a ``poutine.scale``; the minibatch scale of the
            plates the guide opens is not known then; `run_mask`: a ``poutine.mask``).
    """
    check_set_up(guide)
    check_draws_traced(guide, trace)
    if trace is None and last_run is None:
        factor = run_scale(guide)
        mask = run_mask(guide)
        last_run = {name: (factor, None, mask) for name in guide._event_dims}
    sites, latent = [], []
    for name, proto in guide.prototype_trace.iter_stochastic_nodes():
        site, latent_site = gaussian_block(guide, name, proto, trace, last_run)
        sites.append(site)
        latent.append(latent_site)
    return GuideDescription(guide._pyro_name, latent, sites=sites)


def check_draws_traced(guide: AutoNormal, trace: Trace | None) -> None:
    """Refuse a ``trace`` that lacks a ``"{site}_unconstrained"`` draw of an ``AutoNormal``-like
    guide, which a ``poutine.block`` around the guide hid (`check_traced`)."""
    if trace is not None:
        check_traced(trace, {f"{name}_unconstrained": (name,) for name in guide._event_dims})


def gaussian_block(
    guide, name: str, proto: dict, trace: Trace | None, last_run: dict | None
) -> tuple[MeanFieldSite, LatentSite]:
    """The ``"gaussian"`` block of one site of a guide holding ``locs`` and ``scales`` modules as
    ``AutoNormal`` does (the run's rows and scale factor from ``trace``, else ``last_run``), and
    its latent site."""
    event_dim = guide._event_dims[name]
    normal, factor, rows, mask = site_run(name, event_dim, trace, last_run)
    hints = site_hints(name, proto)
    return gaussian_site(
        guide, name, proto["fn"].support, hints, event_dim, normal, factor, rows, mask
    )


def gaussian_site(
    guide,
    name: str,
    support: Constraint,
    hints: dict,
    event_dim: int,
    normal: Distribution | None,
    factor: float,
    rows: dict[int, torch.Tensor] | None,
    mask: torch.Tensor | None = None,
) -> tuple[MeanFieldSite, LatentSite]:
    """The ``"gaussian"`` block of site ``name`` (support ``support``) of a guide holding its
    ``loc`` and ``scale`` in ``locs`` and ``scales`` modules, and its latent site (``mask``: the
    guide site's, `site_mask`).

    ``normal`` is the site's Normal in a traced run (its ``loc`` and ``scale``, differentiable);
    ``None`` reads the current parameters at ``rows``.
    """
    loc_leaf, _, loc_name = _leaf(guide.locs, name)
    scale_leaf, scale_constraint, scale_name = _leaf(guide.scales, name)
    if normal is not None:
        loc, scale = normal.loc, normal.scale
    else:
        loc = _select(loc_leaf, rows)
        scale = _select(transform_to(scale_constraint)(scale_leaf), rows)
    transform = biject_to(support)
    site = MeanFieldSite(
        name=name,
        family="gaussian",
        loc=loc,
        scale=scale,
        params={"loc": loc_leaf, "scale": scale_leaf},
        param_constraints={"loc": constraints.real, "scale": scale_constraint},
        param_names={"loc": loc_name, "scale": scale_name},
        transform=transform,
        event_dim=event_dim,
        scale_factor=factor,
        rows=rows,
        constraint=support,
        mask=mask,
        hints=hints,
    )
    return site, LatentSite(name, loc.shape, event_dim, transform)


def site_hints(name: str, site: dict) -> dict:
    """A model site's QNVB settings (``infer={"qnvb": {...}}``), a dict (``{}`` without any).

    Raises:
        TypeError: for hints that are not a dict of settings, naming the site.
    """
    hints = site["infer"].get("qnvb", {})
    if not isinstance(hints, Mapping):
        raise TypeError(
            f"site {name!r} has infer={{'qnvb': {hints!r}}}: QNVB's settings of a site are a "
            "dict of setting names and values, e.g. infer={'qnvb': {'lr': 0.1}}"
        )
    return dict(hints)


register_adapter(AutoNormal)(describe_auto_normal)


def _changes_the_normal(cls: type) -> str | None:
    """Why a subclass of ``AutoNormalMessenger`` is not read: it overrides how a site's
    posterior is made, so the posterior need not be the Normal of the site's own parameters."""
    for method in ("get_posterior", "_get_params"):
        if getattr(cls, method) is not getattr(AutoNormalMessenger, method):
            return (
                f"{cls.__name__} overrides AutoNormalMessenger.{method}, so its posterior at a "
                "site need not be a Normal of that site's own loc and scale "
                "(AutoHierarchicalNormalMessenger's loc moves with the prior's mean, that is "
                "with the values of the sites upstream)"
            )
    return None


@register_adapter(AutoNormalMessenger, refuses=_changes_the_normal)
def describe_auto_normal_messenger(
    guide: AutoNormalMessenger, trace: Trace | None
) -> GuideDescription:
    """``AutoNormalMessenger``: a ``"gaussian"`` block per site, as ``AutoNormal``'s.

    The guide runs the model and replaces each latent site's prior by a Normal of the site's
    ``locs`` and ``scales`` (its scale an exp, ``constraints.positive``) pushed to the support;
    it keeps the prior in the site's ``infer["prior"]`` and a trace of its last run
    (``guide.trace``: it is a ``TraceMessenger``). The sites are those of that run; their Normals,
    minibatch scale and rows are read from ``trace``, or without one from that run, with the
    current parameters. Subclasses that override ``get_posterior`` or ``_get_params``
    (``AutoHierarchicalNormalMessenger``) are not read (`register_adapter`'s ``refuses``).

    Raises:
        ValueError: for ``amortized_plates``, whose parameters a plate's rows share.
        RuntimeError: if the guide has not run yet (an ELBO's run sets it up).
    """
    if guide.amortized_plates:
        raise ValueError(
            f"AutoNormalMessenger with amortized_plates={guide.amortized_plates!r} shares each "
            "site's loc and scale over those plates' rows, which no per-coordinate Gaussian "
            "block describes: make it with amortized_plates=() (AutoNormalMessenger(model), a "
            "loc and scale per row, subsampled plates included), or fit it with Pyro's "
            "Trace_ELBO and Adam"
        )
    own = getattr(guide, "trace", None)  # (a pickled GuideMessenger drops it)
    names = [
        name
        for name, node in (own.nodes.items() if own is not None else ())
        if node["type"] == "sample" and "prior" in node["infer"]
    ]
    if not names:
        raise RuntimeError(
            f"{type(guide).__name__} has not been run yet: call it (or svi.step) with the "
            "model's arguments first"
        )
    if trace is not None:
        check_traced(trace, {name: (name,) for name in names})
    run = own if trace is None else trace
    sites, latent = [], []
    for name in names:
        node = run.nodes[name]
        support = node["infer"]["prior"].support
        event_dim = biject_to(support).domain.event_dim
        normal = _transformed_normal(node["fn"]) if trace is not None else None
        rows = subsample_rows(node, run, event_dim)
        hints = site_hints(name, node)
        site, latent_site = gaussian_site(
            guide,
            name,
            support,
            hints,
            event_dim,
            normal,
            scale_factor(node),
            rows,
            site_mask(node) if trace is not None else None,
        )
        sites.append(site)
        latent.append(latent_site)
    # (an AutoNormalMessenger's _pyro_name is empty: its class names it, as GuideDescription asks)
    return GuideDescription(guide._pyro_name or type(guide).__name__, latent, sites=sites)


def continuous_latent_sites(guide: AutoContinuous) -> list[LatentSite]:
    """The model sites an ``AutoContinuous`` guide lays end to end, in its order."""
    latent = []
    for name, site in latent_nodes(guide.prototype_trace):
        shape = guide._unconstrained_shapes[name]
        event_dim = site["fn"].event_dim + len(shape) - site["value"].dim()
        latent.append(LatentSite(name, shape, event_dim, biject_to(site["fn"].support)))
    return latent


def check_set_up(guide: AutoGuide) -> None:
    """Refuse an AutoGuide that has not run yet (it has no parameters to describe)."""
    if guide.prototype_trace is None:
        raise RuntimeError(
            f"{type(guide).__name__} has not been run yet: call it (or svi.step) with the "
            "model's arguments first"
        )


def check_no_subsampled_latents(guide: AutoContinuous) -> None:
    """Refuse an ``AutoContinuous`` guide (``AutoDiagonalNormal``, ...) over a latent site in a
    subsampled plate: its latent vector holds the entries of the first run's minibatch only, and
    every later minibatch's rows take those same entries, so each entry would be fitted to other
    rows at each step (Pyro's AutoContinuous guides size their vector by their first run).

    Raises:
        ValueError: naming the guide, the site, the plate and its sizes, and the guides to use.
    """
    for name, site in latent_nodes(guide.prototype_trace):
        for frame in site["cond_indep_stack"]:
            if frame.full_size is not None and frame.size != frame.full_size:
                cls = type(guide).__name__
                raise ValueError(
                    f"{cls} cannot fit site {name!r} in the subsampled plate {frame.name!r} "
                    f"({frame.size} of {frame.full_size} rows a step): its latent vector holds "
                    f"the {frame.size} rows of its first run's minibatch, and every later "
                    "minibatch's rows take those same entries, so each would be fitted to "
                    "other rows at each step (Pyro's AutoContinuous guides take no "
                    "create_plates and size their vector by their first run). Use "
                    "AutoMeanFieldNormal (or AutoNormal), which "
                    "keeps a loc and a scale for each of the plate's rows (where the model "
                    "picks its rows, subsample=idx, with create_plates returning the model's "
                    "plate), or take all rows at each step"
                )


def _posterior(
    guide: AutoContinuous, trace: Trace | None
) -> tuple[object, float, torch.Tensor | None]:
    """The guide's posterior over its latent vector, that site's scale (a ``poutine.scale``
    around the guide) and its mask (`site_mask`), from ``trace`` or, without one, from its
    current parameters and the handlers around its last run (`run_scale`, `run_mask`); refused for
    a subsampled local latent (`check_no_subsampled_latents`)."""
    check_no_subsampled_latents(guide)
    if trace is not None:
        latent = f"_{guide._pyro_name}_latent"
        check_traced(trace, {latent: tuple(guide._unconstrained_shapes)})
        node = trace.nodes[latent]
        return node["fn"], scale_factor(node), site_mask(node)
    return guide.get_posterior(), run_scale(guide), run_mask(guide)


@register_adapter(AutoDiagonalNormal)
def _describe_diagonal(guide: AutoDiagonalNormal, trace: Trace | None) -> GuideDescription:
    check_set_up(guide)
    posterior, site_scale, mask = _posterior(guide, trace)
    loc_leaf, _, loc_name = _leaf(guide, "loc")
    scale_leaf, scale_constraint, scale_name = _leaf(guide, "scale")
    # one block over every site: the QNVB settings the sites declare, if they all declare the same
    declared = [site_hints(name, site) for name, site in latent_nodes(guide.prototype_trace)]
    hints = dict(declared[0]) if declared and all(d == declared[0] for d in declared) else {}
    block = MeanFieldSite(
        name=f"_{guide._pyro_name}_latent",
        family="gaussian",
        loc=posterior.mean,
        scale=posterior.stddev,
        params={"loc": loc_leaf, "scale": scale_leaf},
        param_constraints={"loc": constraints.real, "scale": scale_constraint},
        param_names={"loc": loc_name, "scale": scale_name},
        transform=dist.transforms.identity_transform,
        event_dim=1,
        scale_factor=site_scale,
        mask=mask,
        hints=hints,
    )
    return GuideDescription(guide._pyro_name, continuous_latent_sites(guide), sites=[block])


@register_adapter(AutoMultivariateNormal)
def _describe_full_rank(guide: AutoMultivariateNormal, trace: Trace | None) -> GuideDescription:
    check_set_up(guide)
    posterior, site_scale, mask = _posterior(guide, trace)
    loc, tril = posterior.loc, posterior.scale_tril
    joint = JointGaussian(
        dim=loc.numel(),
        loc=loc,
        affine=lambda x: loc + x @ tril.T,
        covariance=posterior.covariance_matrix,
        entropy=site_scale * masked_sum(posterior.entropy(), mask),
        params=dict(guide.named_parameters()),
    )
    return GuideDescription(guide._pyro_name, continuous_latent_sites(guide), joint=joint)


@register_adapter(AutoLowRankMultivariateNormal)
def _describe_low_rank(
    guide: AutoLowRankMultivariateNormal, trace: Trace | None
) -> GuideDescription:
    check_set_up(guide)
    posterior, site_scale, mask = _posterior(guide, trace)
    # z = loc + W x_1 + sqrt(D) x_2 with (x_1, x_2) ~ N(0, I_{r + d}): covariance W W^T + D.
    loc, factor = posterior.loc, posterior.cov_factor
    root_diag = posterior.cov_diag.sqrt()
    rank = factor.shape[-1]

    def affine(x: torch.Tensor) -> torch.Tensor:
        return loc + x[..., :rank] @ factor.T + root_diag * x[..., rank:]

    joint = JointGaussian(
        dim=rank + loc.numel(),
        loc=loc,
        affine=affine,
        covariance=posterior.covariance_matrix,
        entropy=site_scale * masked_sum(posterior.entropy(), mask),
        params=dict(guide.named_parameters()),
    )
    return GuideDescription(guide._pyro_name, continuous_latent_sites(guide), joint=joint)
