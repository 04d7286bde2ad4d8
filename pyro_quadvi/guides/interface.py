"""How a guide tells the quadrature ELBO, OPQA and QNVB what it is.

One hook: a guide describes its posterior in a `GuideDescription`, either by implementing
`QuadratureGuide` (a method ``quadrature_description(trace=None)``, the way Pyro's
``AutoContinuous`` exposes ``get_posterior``) or through an adapter registered for its class with
`register_adapter` (Pyro's own guides, in `pyro_quadvi.guides.adapters`).
`describe_guide` finds whichever applies; ``QuadratureELBO``,
``opqa_evidence(center="guide")`` and ``QNVB`` all go through it.

A description lays the model's latent sites end to end in one flat unconstrained vector ``z`` and
says how the guide's posterior covers it:

* **elementwise families** (one `MeanFieldSite` per block of coordinates, in layout order):
  ``"gaussian"`` is ``z = loc + scale * x`` with ``x ~ N(0, I)``; the block names the leaf tensors
  holding its parameters by role (``"loc"``, ``"scale"``), so an optimizer pairs them by identity,
  never by name; ``"dirac_gauss"`` is the spike-and-slab factor of the sequence paper's eq. 4.1
  (a point mass at zero with probability ``q(z)``, ``N(nu, tau^2)`` otherwise), whose nodes are
  ``mean + sd * x`` at the mixture's moments (eq. 4.2), with parameters ``"loc"`` (``nu``),
  ``"scale"`` (``tau``) and ``"logit"`` (``zeta``, the logit of a zero); it meets a
  `SpikeSlab` prior in their closed-form KL
  (`MeanFieldSite.kl_to_prior`) instead of through the prior's density at the nodes;
* a **joint Gaussian** (`JointGaussian`, family ``"mvn"``): ``z = loc + A x`` for a dense or
  low-rank ``A`` (``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``), which quadrature
  integrates but QNVB does not update.

With a ``trace`` of one run of the guide the description is that run's: differentiable locs and
scales of the rows a subsampled plate used, and each site's minibatch scale. Without one it
describes the current parameters (at the rows of the guide's last run, where the guide knows them).

The ELBO hands the optimizer the moments it integrated through `publish_moments` (expected
gradient ``g`` and Hessian diagonal ``h`` per block, minibatch scale removed); the optimizer takes
them back with `published_moments`.
"""

from __future__ import annotations

import functools
import itertools
import math
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Protocol, runtime_checkable

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.contrib.easyguide import EasyGuide
from pyro.distributions.transforms import Transform
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import (
    AutoDelta,
    AutoGaussian,
    AutoGuide,
    AutoGuideList,
    AutoLaplaceApproximation,
    AutoMessenger,
    AutoNormalizingFlow,
)
from pyro.poutine import Trace
from pyro.poutine.condition_messenger import ConditionMessenger
from pyro.poutine.mask_messenger import MaskMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.scale_messenger import ScaleMessenger
from pyro.poutine.subsample_messenger import SubsampleMessenger
from torch.distributions import (
    Distribution,
    TransformedDistribution,
    constraints,
    kl_divergence,
    transform_to,
)
from torch.distributions.constraints import Constraint
from torch.distributions.transforms import ComposeTransform, IndependentTransform
from torch.utils.weak import WeakIdKeyDictionary

from ..distributions import SpikeSlab
from ..distributions.spike_slab import HALF_LOG_2PI_E
from ..infer.log_joint import LatentSite, look_through
from ..store import compiled_original, follow_param_store

__all__ = [
    "CLOSED_FORM_FAMILIES",
    "ELEMENTWISE_FAMILIES",
    "GuideDescription",
    "JointGaussian",
    "MeanFieldSite",
    "PublishedMoments",
    "QuadratureGuide",
    "check_declaration",
    "check_model_samples",
    "check_traced",
    "describe_guide",
    "describe_live_guides",
    "first_rows",
    "handlers_around",
    "live_guides",
    "mask_tensor",
    "masked_sum",
    "publish_moments",
    "published_moments",
    "register_adapter",
    "register_guide",
    "run_mask",
    "run_rows",
    "run_scale",
    "supported_guides",
    "trace_for_description",
    "unwrap_guide",
    "watch_guides",
]

ELEMENTWISE_FAMILIES = ("gaussian", "dirac_gauss")
"""Families whose nodes are ``loc + scale * x`` coordinate by coordinate."""

CLOSED_FORM_FAMILIES = ("dirac_gauss",)
"""Elementwise families whose prior term is a closed-form KL (`MeanFieldSite.kl_to_prior`)
rather than the prior's log density integrated at the nodes plus the guide's entropy."""


@dataclass
class MeanFieldSite:
    """One block of an elementwise (mean-field) family, as used in one run of the guide.

    Attributes:
        name: the block's name: the model's sample site, or the guide's own latent site for a guide
            that keeps all sites in one vector (``AutoDiagonalNormal``).
        family: ``"gaussian"`` or ``"dirac_gauss"`` (`ELEMENTWISE_FAMILIES`).
        loc: where the quadrature nodes are centred, unconstrained, in the run's shape (rows of
            subsampled plates only); differentiable with respect to the guide's parameters. For a
            mixture family, its mean (``dirac_gauss``: ``q(not z) nu``, eq. 4.2).
        scale: the nodes' standard deviations, same shape, positive (for a mixture, its standard
            deviation: ``dirac_gauss``: ``sqrt(q(z) q(not z) nu^2 + q(not z) tau^2)``, eq. 4.2).
        params: role -> the leaf tensor holding that parameter in full, as an optimizer receives it
            (for ``"gaussian"``: ``"loc"`` and ``"scale"``, the latter unconstrained; for
            ``"dirac_gauss"`` also ``"logit"``, the logit of a zero).
        param_constraints: role -> the constraint that maps the leaf to the parameter's value
            (``transform_to(constraint)(leaf)``), e.g. ``softplus_positive`` for a scale.
        param_names: role -> a stable name (the param store's), used in messages and saved states.
        transform: maps the block's unconstrained value to the model site's support (identity for a
            block spanning several sites: the description's latent sites carry their own).
        event_dim: number of rightmost dims of ``loc`` that are event dims.
        scale_factor: the block's minibatch scale in this run (``full size / batch size`` of its
            subsampled plates; 1 without subsampling).
        rows: for each subsampled plate, ``param dim -> indices`` of the rows of the leaves used in
            this run; empty without subsampling; ``None`` where the guide cannot tell (an optimizer
            then updates the entries that received a gradient).
        constraint: the model site's support, which ``transform`` maps onto.
        values: role -> the parameter's constrained value in this run (rows used, differentiable),
            for a family whose nodes' ``loc`` and ``scale`` are moments of its parameters rather
            than the parameters (``dirac_gauss``: ``"loc"`` nu, ``"scale"`` tau, ``"logit"``
            zeta); empty for ``"gaussian"``.
        mask: the guide site's mask in this run (a ``poutine.mask`` around the guide), a bool
            tensor that broadcasts against the block's batch shape as Pyro's ``scale_and_mask``
            does: a masked entry's entropy counts 0 (`entropy`); ``None`` without one.
        hints: optimizer settings the model declares for this block (its sample site's
            ``infer["qnvb"]``, e.g. a `BayesianModule`'s
            ``qnvb_settings``): `QNVB` takes them in place of its own
            defaults; the settings a user passes to it override them. A block over several
            sites (``AutoDiagonalNormal``) carries them when every site declares the same.
    """

    name: str
    family: str
    loc: torch.Tensor
    scale: torch.Tensor
    params: dict[str, torch.Tensor]
    param_constraints: dict[str, Constraint]
    param_names: dict[str, str]
    transform: Transform
    event_dim: int
    scale_factor: float = 1.0
    rows: dict[int, torch.Tensor] | None = field(default_factory=dict)
    constraint: Constraint | None = None
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    mask: torch.Tensor | None = None
    hints: dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        self.check_hints()

    def check_hints(self) -> None:
        """Refuse ``hints`` that are not a mapping (a ``TypeError`` naming the site)."""
        if not isinstance(self.hints, Mapping):
            raise TypeError(
                f"site {self.name!r}: hints={self.hints!r} is not a mapping; a block's hints "
                "are QNVB's settings by name, e.g. hints={'lr': 0.5}, or {} for none"
            )

    @property
    def shape(self) -> torch.Size:
        """The unconstrained shape of the block in this run (batch + event)."""
        return self.loc.shape

    def mixture(self) -> SpikeSlab:
        """A ``dirac_gauss`` block's factor ``q`` as a `SpikeSlab` (eq. 4.1).

        Raises:
            TypeError: for another family.
        """
        if self.family != "dirac_gauss":
            raise TypeError(f"site {self.name!r} is {self.family!r}, not a Dirac-Gauss mixture")
        return SpikeSlab(
            zero_logits=self.values["logit"],
            slab_scale=self.values["scale"],
            slab_loc=self.values["loc"],
            validate_args=False,
        )

    def entropy(self) -> torch.Tensor:
        """The block's entropy in the unconstrained space, times its minibatch scale, its
        masked entries (`mask`) left out.

        For ``dirac_gauss`` under the measure of `SpikeSlab`'s ``log_prob`` (Lebesgue
        plus a unit mass at zero): ``H(Bernoulli) + q(not z) H(N(nu, tau^2))`` per coordinate.
        """
        if self.family == "dirac_gauss":
            per_coordinate = self.mixture().entropy()
        elif self.mask is None:
            return self.scale_factor * (
                self.scale.log().sum() + HALF_LOG_2PI_E * self.scale.numel()
            )
        else:
            per_coordinate = self.scale.log() + HALF_LOG_2PI_E
        batch = sum_rightmost(per_coordinate, self.event_dim)
        return self.scale_factor * masked_sum(batch, self.mask)

    def kl_to_prior(self, prior: Distribution) -> torch.Tensor:
        """``KL(q_site || prior)`` summed over event dims: the site's batch shape, unscaled.

        ``prior`` is the model's distribution at the site in one run (Pyro's wrappers such as
        ``to_event`` and ``expand`` are looked through; its batch shape may carry the node
        plate's dim, the result then carries it too). Closed form for a ``dirac_gauss`` block
        against a `SpikeSlab` (the sparse-VI paper's KL; sequence paper, eq. 4.3-4.4).

        Raises:
            ValueError: if the prior has no point mass at zero: a spike against a density has an
                infinite KL, so the message names `SpikeSlab` as the prior to use.
        """
        base = look_through(prior)
        if not isinstance(base, SpikeSlab):
            raise ValueError(no_point_mass_message(self.name, base, f"({self.family})"))
        kl = kl_divergence(self.mixture(), base)
        return kl.sum(tuple(range(-self.event_dim, 0))) if self.event_dim else kl

    def site_entropy(self) -> torch.Tensor:
        """The block's entropy summed over event dims: its batch shape, unscaled, as
        `kl_to_prior` (whose KL holds it: ``KL = -E_q[log prior] - entropy``).

        A ``dirac_gauss`` block under `SpikeSlab`'s measure: ``H(Bernoulli) + q(not z)
        H(N(nu, tau^2))`` per coordinate (sequence paper, eq. 4.4). The ELBO needs it beside
        the KL where the guide's site is weighted otherwise than the model's (Pyro's rule: the
        model's log density times the model site's scale and mask, the guide's times the guide
        site's; `LogJoint`).

        Raises:
            TypeError: for another family.
        """
        entropy = self.mixture().entropy()
        return entropy.sum(tuple(range(-self.event_dim, 0))) if self.event_dim else entropy


def masked_sum(term: torch.Tensor, mask: torch.Tensor | bool | None) -> torch.Tensor:
    """The sum of a site's ``term`` (its batch shape) under a guide site's ``mask`` as Pyro
    weighs a log density (``scale_and_mask``): masked entries count 0, and a mask wider than the
    term broadcasts it (each of its true entries counts the term once)."""
    if mask is None:
        return term.sum()
    return torch.where(torch.as_tensor(mask, device=term.device), term, 0.0).sum()


def no_point_mass_message(name: str, prior, family: str = "") -> str:
    """Why a site whose guide factor has a point mass at zero cannot take ``prior``, which has
    none (``family``: a note after "zero", e.g. ``"(dirac_gauss)"``)."""
    note = f" {family}" if family else ""
    return (
        f"site {name!r}: the guide's factor has a point mass at zero{note} "
        f"but the model's prior {type(look_through(prior)).__name__} has none, so KL(q || prior) "
        "is infinite. Give the site a spike-and-slab prior, "
        "pyro_quadvi.distributions.SpikeSlab(inclusion, slab_scale), or fit it with a Gaussian "
        "guide (AutoMeanFieldNormal)"
    )


@dataclass
class JointGaussian:
    """A Gaussian over all latents at once: ``z = loc + A x``, ``x ~ N(0, I_dim)``, family "mvn".

    Attributes:
        dim: the number of standard normal coordinates ``x``.
        loc: the mean, flat, differentiable.
        affine: maps offsets ``(K, dim)`` to points ``(K, loc.numel())``, differentiably.
        covariance: ``A A^T``, dense.
        entropy: analytic, in the unconstrained space.
        params: role -> leaf tensor (for messages and optimizers: QNVB leaves them to its fallback).
    """

    dim: int
    loc: torch.Tensor
    affine: Callable[[torch.Tensor], torch.Tensor]
    covariance: torch.Tensor
    entropy: torch.Tensor
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    family: str = "mvn"


@dataclass
class GuideDescription:
    """What a guide's posterior is, over the model's latents laid end to end.

    Attributes:
        guide: the guide's name (``guide._pyro_name`` or its class name), for messages.
        latent_sites: the model's latent sites in the order of the flat vector ``z``.
        sites: the elementwise blocks, in the same order; their flattened locs concatenated are
            ``z``'s centre. Empty for a joint Gaussian.
        joint: the joint Gaussian, for a guide that is not elementwise (``None`` otherwise).
    """

    guide: str
    latent_sites: list[LatentSite]
    sites: list[MeanFieldSite] = field(default_factory=list)
    joint: JointGaussian | None = None

    def __post_init__(self):
        if self.joint is not None and self.sites:
            raise ValueError(
                f"the description of {self.guide} has elementwise sites and a joint Gaussian: "
                "give one or the other"
            )
        self.check_layout()

    def check_layout(self) -> None:
        """Refuse ``sites`` out of the order of ``latent_sites``, or of another size (a
        ``ValueError`` naming the guide and the sites)."""
        latent = {site.name: (i, site) for i, site in enumerate(self.latent_sites)}
        named = [(latent[s.name], s) for s in self.sites if s.name in latent]
        for ((i, _), before), ((j, _), after) in itertools.pairwise(named):
            if j < i:
                order = [site.name for site in self.latent_sites]
                raise ValueError(
                    f"the description of {self.guide} lists site {after.name!r} after "
                    f"{before.name!r}, but its latent_sites lay them out in the order {order}: "
                    "give `sites` in the order of `latent_sites` (the flat vector z is their "
                    "locs end to end)"
                )
        for (_, model_site), site in named:
            if site.loc.numel() != model_site.numel:
                raise ValueError(
                    f"the description of {self.guide}: site {site.name!r} has "
                    f"{site.loc.numel()} coordinates (loc of shape {tuple(site.loc.shape)}) but "
                    f"its latent site has {model_site.numel} (shape {tuple(model_site.shape)})"
                )

    def leaves(self) -> list[torch.Tensor]:
        """Every parameter tensor the description holds: its sites' (``params``, in layout
        order) and its joint Gaussian's; the leaves themselves, for pairing by identity."""
        leaves = [leaf for site in self.sites for leaf in site.params.values()]
        if self.joint is not None:
            leaves.extend(self.joint.params.values())
        return leaves

    @property
    def dim(self) -> int:
        """The number of standard normal coordinates the quadrature spans."""
        if self.joint is not None:
            return self.joint.dim
        return sum(site.loc.numel() for site in self.sites)

    @property
    def loc(self) -> torch.Tensor:
        """The centre of the nodes, flat."""
        if self.joint is not None:
            return self.joint.loc
        return _flat([site.loc for site in self.sites])

    @property
    def scale(self) -> torch.Tensor:
        """The nodes' standard deviations, flat (elementwise families only)."""
        if self.joint is not None:
            raise TypeError(f"{self.guide} is a joint Gaussian: it has a covariance, not scales")
        return _flat([site.scale for site in self.sites])

    def affine(self, x: torch.Tensor) -> torch.Tensor:
        """Points ``z`` of shape ``(K, latent dim)`` from standard offsets ``x`` ``(K, dim)``."""
        if self.joint is not None:
            return self.joint.affine(x)
        return self.loc + self.scale * x

    def entropy(self) -> torch.Tensor:
        """The posterior's entropy in the unconstrained space (minibatch-scaled), analytic."""
        if self.joint is not None:
            return self.joint.entropy
        return sum(site.entropy() for site in self.sites)

    def entropy_outside_kl(self) -> torch.Tensor:
        """`entropy` without the sites whose entropy is inside their closed-form KL
        (`CLOSED_FORM_FAMILIES`): what an ELBO adds to ``E_q[log p]`` besides those KLs."""
        if self.joint is not None:
            return self.joint.entropy
        # the dtype of self.loc, without concatenating every loc for it
        dtype = functools.reduce(torch.promote_types, (s.loc.dtype for s in self.sites))
        entropy = torch.zeros((), dtype=dtype, device=self.sites[0].loc.device)
        for site in self.sites:
            if site.family not in CLOSED_FORM_FAMILIES:
                entropy = entropy + site.entropy()
        return entropy

    def closed_form_sites(self) -> dict[str, MeanFieldSite]:
        """Site -> its block, for the `CLOSED_FORM_FAMILIES` sites (the ``closed_form`` of
        `LogJoint`, which reads `MeanFieldSite.kl_to_prior` and
        `MeanFieldSite.site_entropy`)."""
        return {s.name: s for s in self.sites if s.family in CLOSED_FORM_FAMILIES}

    def covariance(self) -> torch.Tensor:
        """The covariance of ``z``, dense (for OPQA's weight)."""
        if self.joint is not None:
            return self.joint.covariance
        return torch.diag(self.scale**2)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and laid end to end; one tensor is flattened without a copy (a
    ``torch.cat`` of one would copy it: one more tensor of the latent vector's size)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


@runtime_checkable
class QuadratureGuide(Protocol):
    """A guide that describes its own posterior (the one hook a third-party guide implements)."""

    def quadrature_description(self, trace: Trace | None = None) -> GuideDescription:
        """The posterior as used in the run recorded by ``trace`` (or its current parameters)."""
        ...


# ------------------------------------------------------------------------------ the adapters
_ADAPTERS: dict[type, Callable[[object, Trace | None], GuideDescription]] = {}
_REFUSALS: dict[type, Callable[[type], str | None]] = {}


def register_adapter(cls: type, *, refuses: Callable[[type], str | None] | None = None) -> Callable:
    """Decorator: ``fn(guide, trace)`` describes guides of class ``cls`` (and its subclasses).

    The adapter of the nearest class in the guide's method resolution order applies; a guide that
    implements `QuadratureGuide` itself wins over any adapter. ``refuses(subclass)`` says why
    the adapter does not describe a subclass of ``cls`` (one that changes its family), ``None``
    where it does: such a subclass has no adapter, and `describe_guide`'s refusal gives the
    reason.

    Raises:
        TypeError: where ``cls`` is not a class (``register_adapter(AutoNormal)``, not an
            instance or a name).
    """
    if not isinstance(cls, type):
        raise TypeError(
            f"register_adapter takes the guide's class, got {cls!r} of type "
            f"{type(cls).__name__}: pass the class itself, e.g. @register_adapter(AutoNormal)"
        )

    def decorate(fn: Callable[[object, Trace | None], GuideDescription]) -> Callable:
        _ADAPTERS[cls] = fn
        if refuses is None:
            _REFUSALS.pop(cls, None)
        else:
            _REFUSALS[cls] = refuses
        # marked on the class, which compiled code reads (`_may_be_guide`): a guard on the
        # registry would recompile every compiled network at each registration
        cls._pyro_quadvi_adapter = True
        _DESCRIBABLE.clear()
        _PASSIVE.clear()
        return fn

    return decorate


def supported_guides() -> list[str]:
    """The class names with a registered adapter (for error messages)."""
    _load_adapters()
    return sorted(cls.__name__ for cls in _ADAPTERS)


def _load_adapters() -> None:
    from . import adapters  # noqa: F401  (registers Pyro's guides on import)


def _adapter(cls: type) -> Callable | None:
    _load_adapters()
    for base in cls.__mro__:
        if base in _ADAPTERS:
            return None if _refusal(cls, base) else _ADAPTERS[base]
    return None


def _refusal(cls: type, base: type | None = None) -> str | None:
    """Why the adapter registered for ``base`` (by default the nearest in ``cls``'s method
    resolution order) does not describe ``cls``; ``None`` where it does or there is none."""
    _load_adapters()
    if base is None:
        base = next((b for b in cls.__mro__ if b in _ADAPTERS), None)
    refuses = _REFUSALS.get(base)
    return refuses(cls) if refuses is not None else None


def unwrap_guide(guide: Callable) -> Callable:
    """The guide object behind ``functools.partial``, Pyro handler wrappers (``poutine.scale``)
    and ``torch.compile`` (its ``OptimizedModule``'s ``_orig_mod``).

    A trace of the wrapper still records what the wrapper changed (a ``poutine.scale`` factor is in
    each site's scale), so a description read from that trace stays right.
    """
    return _unwrap(guide)[0]


def handlers_around(fn: Callable) -> list[Messenger]:
    """The Pyro handlers ``fn`` is wrapped in (``pyro.condition(model, data)``'s
    ``ConditionMessenger``, say), outermost first, as `unwrap_guide` looks through them."""
    return _unwrap(fn)[1]


def _unwrap(fn: Callable) -> tuple[Callable, list[Messenger]]:
    """The callable behind ``fn``'s wrappers (see `unwrap_guide`), and the Pyro handlers among
    them."""
    handlers = []
    seen = 0
    while seen < 32:
        seen += 1
        original = compiled_original(fn)
        if original is not None:
            fn = original
            continue
        if isinstance(fn, functools.partial):
            # Pyro wraps handlers as partial(_context_wrap, messenger, fn)
            inner = fn.func
            if getattr(inner, "__name__", "") == "_context_wrap" and len(fn.args) >= 2:
                handlers.append(fn.args[0])
                fn = fn.args[1]
            else:
                fn = inner
            continue
        break
    return fn, handlers


def check_model_samples(model: Callable, description: GuideDescription) -> None:
    """Refuse a model wrapped in ``pyro.condition`` on latent sites of the guide's description:
    the guide was built from the model without the condition, so it would draw a site the model
    observes.

    Raises:
        ValueError: naming the conditioned sites and the way out.
    """
    conditioned = set()
    for handler in handlers_around(model):
        if isinstance(handler, ConditionMessenger):
            data = handler.data
            if isinstance(data, Trace):
                data = {n for n, node in data.nodes.items() if node["type"] == "sample"}
            conditioned.update(data)
    sites = [site.name for site in description.latent_sites if site.name in conditioned]
    if sites:
        names = ", ".join(map(repr, sites))
        raise ValueError(
            f"the model given to SVI conditions {names}: build the guide from that model "
            f"(e.g. AutoMeanFieldNormal(pyro.condition(model, data=...)), the model SVI is "
            f"given). The guide {description.guide!r} was built from a model that samples "
            f"{names}, so it would draw what the model observes"
        )


#: Auxiliary draws that `_UnreadDraws` replaces by their (finite) means.
_MEAN_DRAWN = (dist.Normal, dist.MultivariateNormal, dist.LowRankMultivariateNormal, SpikeSlab)


class _UnreadDraws(Messenger):
    """Gives each auxiliary draw of the package's families (the ``"..._unconstrained"`` sites of
    AutoNormal's kind, the ``"_..._latent"`` site of an AutoContinuous) its mean instead of a
    random draw, and each draw of ``AutoNormalMessenger`` (a Normal pushed to the site's
    support) the image of its mean."""

    def _pyro_sample(self, msg) -> None:
        if msg["value"] is not None or msg["is_observed"]:
            return
        fn = msg["fn"]
        if msg["infer"].get("is_auxiliary"):
            base = fn.base_dist if isinstance(fn, dist.Independent) else fn
            if type(base) in _MEAN_DRAWN:
                msg["value"] = fn.mean.detach()
        elif "prior" in msg["infer"] and _transformed_normal(fn) is not None:
            # a GuideMessenger's posterior (it keeps the prior): AutoNormalMessenger's
            pushed = look_through(fn)
            with torch.no_grad():
                value = pushed.base_dist.mean
                for transform in pushed.transforms:
                    value = transform(value)
            msg["value"] = value.expand(fn.shape())


def _transformed_normal(fn: Distribution) -> dist.Normal | None:
    """The Normal inside a Normal pushed through transforms (``AutoNormalMessenger``'s
    posterior), through ``to_event`` and ``expand``; ``None`` for another distribution."""
    fn = look_through(fn)
    if not isinstance(fn, TransformedDistribution):
        return None
    base = look_through(fn.base_dist)
    return base if type(base) is dist.Normal else None


def trace_for_description(guide: Callable, *args, **kwargs) -> Trace:
    """A traced run of ``guide`` for `describe_guide`: its parameters, plates and
    minibatch, with each auxiliary draw given its mean.

    A description reads a guide's parameters, never the values its run draws, and the package's
    ELBOs and ``predict`` evaluate the model at their own points. Skipping the draws saves the
    random numbers (one per coordinate, 2.6 of a 478,000-weight guide's 6.9 ms run) and leaves
    torch's random state as it was, so that a deterministic rule's loss draws nothing at all.
    """
    return poutine.trace(_UnreadDraws()(guide)).get_trace(*args, **kwargs)


def describe_guide(guide: Callable, trace: Trace | None = None) -> GuideDescription:
    """The `GuideDescription` of ``guide`` (through its hook or its class's adapter).

    Raises:
        TypeError: for a guide with neither; the message lists the supported guides and the hook.
    """
    target = unwrap_guide(guide)
    if isinstance(target, QuadratureGuide):
        description = target.quadrature_description(trace)
    else:
        description = _adapter_or_refusal(target)(target, trace)
    if trace is not None:
        check_traced(trace, {site.name: (site.name,) for site in description.latent_sites})
    if isinstance(target, QuadratureGuide) and not _is_own(target):
        check_declaration(description, trace, owner=target)
    return description


def _is_own(guide: object) -> bool:
    """Whether ``guide``'s hook is one of the package's own (built consistently, not checked)."""
    module = getattr(type(guide).quadrature_description, "__module__", "") or ""
    return module.split(".")[0] == __name__.split(".")[0]


def _mismatch(found: torch.Tensor, declared: torch.Tensor) -> bool:
    """Whether ``found`` differs from ``declared`` beyond rounding (or in size)."""
    if found.numel() != declared.numel():
        return True
    found = found.detach().reshape(declared.shape).to(declared.dtype)
    return not torch.allclose(found, declared.detach(), rtol=1e-5, atol=1e-6)


def _maps_onto(site: MeanFieldSite) -> bool:
    """Whether ``site.transform`` maps the block's unconstrained nodes into its support: its
    codomain is the support, or its images of ``loc`` and ``loc +- 6 scale`` lie in it (a
    composed transform's codomain does not always say, e.g. Pyro's ``biject_to(positive)``)."""
    codomain, support = site.transform.codomain, site.constraint
    while isinstance(codomain, constraints.independent):
        codomain = codomain.base_constraint
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    if type(codomain) is type(support) and repr(codomain) == repr(support):
        return True
    with torch.no_grad():
        loc, scale = site.loc.detach(), site.scale.detach()
        nodes = torch.stack([loc - 6 * scale, loc, loc + 6 * scale])
        return bool(site.constraint.check(site.transform(nodes)).all())


def check_declaration(
    description: GuideDescription, trace: Trace | None = None, *, owner: object | None = None
) -> None:
    """Refuse a hand-written guide's description that disagrees with itself or with its run.

    Per ``"gaussian"`` block: ``loc`` is ``params["loc"]`` and ``scale`` is
    ``transform_to(param_constraints["scale"])(params["scale"])`` (at the run's ``rows``), the
    ``transform``'s codomain is the site's ``constraint``, the ``hints`` are QNVB's settings;
    with a ``trace``, the guide's draw at the site has the log density of ``Normal(loc, scale)``
    pushed through ``transform``. O(parameters) tensor operations, no gradient.

    With ``owner``, the guide described (`describe_guide` passes it), that full check runs at
    the owner's first description (and first traced one) and again whenever the description's
    structure changes: its sites, families, shapes, transforms, constraints, hints, the dims and
    lengths of its rows or the tensors it declares as parameters. Between, a read checks the
    layout and, per block, ``loc`` and ``scale`` against their parameters at 16 fixed
    coordinates (a description cached from an earlier step is refused as in the full check).
    What the full check learnt lives on the owner, in an attribute that a copy or an unpickled
    owner does not take over (it is checked in full at its first read).

    Raises:
        ValueError: naming the guide, the site, the role and the fix.
        TypeError: for unknown ``hints``.
    """
    checks = _declaration_checks(owner)
    if checks is None:
        _check_in_full(description, trace)
        return
    structure = _structure(description)
    learnt = checks.learnt.get(trace is not None)
    if learnt is not None and learnt.matches(description, structure):
        description.check_layout()
        learnt.check(description)
        return
    _check_in_full(description, trace)
    checks.learnt[trace is not None] = _Learnt.of(description, structure)


def _check_in_full(description: GuideDescription, trace: Trace | None) -> None:
    """`check_declaration`'s full check of ``description`` (and of ``trace``'s draws)."""
    from ..optim.qnvb_functional import QNVBHyperparameters  # optim imports this module

    settings = [f.name for f in fields(QNVBHyperparameters)]

    guide = description.guide
    description.check_layout()
    for site in description.sites:
        where = f"the description of {guide}, site {site.name!r}"
        site.check_hints()
        unknown = sorted(set(site.hints) - set(settings))
        if unknown:
            raise TypeError(
                f"{where} declares (its hints) unknown QNVB settings {unknown}; QNVB takes "
                f"{settings}"
            )
        if site.constraint is not None and not _maps_onto(site):
            raise ValueError(
                f"{where}: its transform {type(site.transform).__name__} does not map the "
                f"block's nodes (loc +- 6 scale) into the site's support {site.constraint}: "
                "give transform=torch.distributions.biject_to(constraint), the map the guide "
                "samples through"
            )
        if site.family != "gaussian" or site.rows is None:
            continue
        with torch.no_grad():
            for role in ("loc", "scale"):
                leaf = site.params[role]
                for dim, index in site.rows.items():
                    leaf = leaf.index_select(dim, index.to(leaf.device))
                if _mismatch(_declared_value(site, role, leaf), getattr(site, role)):
                    raise ValueError(_undeclared_message(guide, site, role))
            node = trace.nodes.get(site.name) if trace is not None else None
            if node is None or isinstance(look_through(node["fn"]), dist.Delta):
                continue  # a Delta at the site (AutoNormal's way) carries no density to compare
            normal = dist.Normal(site.loc, site.scale).to_event(site.event_dim)
            declared = dist.TransformedDistribution(normal, [site.transform])
            found = node["fn"].log_prob(node["value"]).sum()
            expected = declared.log_prob(node["value"]).sum()
            if not torch.allclose(found.to(expected.dtype), expected, rtol=1e-4, atol=1e-3):
                raise ValueError(
                    f"{where}: the guide's run samples {site.name!r} from "
                    f"{type(node['fn']).__name__} with log density {float(found):.6g} at its "
                    "draw, not from the declared Normal(loc, scale) pushed through transform "
                    f"({float(expected):.6g}): declare every parameter the draw depends on and "
                    "the map it goes through (transform)"
                )


def _declared_value(site: MeanFieldSite, role: str, leaf: torch.Tensor) -> torch.Tensor:
    """The value of ``role`` that entries ``leaf`` of its parameter declare."""
    return transform_to(site.param_constraints.get(role, constraints.real))(leaf)


def _undeclared_message(guide: str, site: MeanFieldSite, role: str) -> str:
    """Why ``site``'s ``role`` (``"loc"`` or ``"scale"``) is refused: its parameter does not
    give it."""
    return (
        f"the description of {guide}, site {site.name!r}: its {role} is not what "
        f"params[{role!r}] gives (transform_to(param_constraints[{role!r}])(params[{role!r}]) at "
        f"the run's rows): params[{role!r}] must be the leaf whose image is {role} (roles "
        f"swapped?), param_constraints[{role!r}] a constraint whose transform_to is the guide's "
        "own map (for scale = exp(raw / 2), a constraint of your own registered with "
        "transform_to), and the description that of the guide's current parameters (not a "
        "cached one)"
    )


#: Coordinates per block and role that `check_declaration` compares at a read after the first.
_SAMPLED = 16


class _DeclarationChecks:
    """What `check_declaration` learnt of one guide's descriptions: the `_Learnt` of its last
    fully checked description without a trace (key ``False``) and with one (``True``).

    Kept on the guide; a copy or a pickle of the guide takes an empty one (the copy's
    parameters are other tensors, checked in full at its first read)."""

    def __init__(self) -> None:
        self.learnt: dict[bool, _Learnt] = {}

    def __reduce__(self) -> tuple:
        return _DeclarationChecks, ()


def _declaration_checks(owner: object | None) -> _DeclarationChecks | None:
    """``owner``'s `_DeclarationChecks`, made at its first read; ``None`` without an owner or
    for one without a ``__dict__`` (its descriptions are checked in full at every read)."""
    if owner is None:
        return None
    try:
        state = vars(owner)
    except TypeError:
        return None
    checks = state.get("_pyro_quadvi_declaration_checks")
    if checks is None:
        checks = state["_pyro_quadvi_declaration_checks"] = _DeclarationChecks()
    return checks


def _structure(description: GuideDescription) -> tuple:
    """What must stay the same for `_Learnt`'s sampled check to stand in for the full one
    (besides the declared tensors, which `_Learnt` holds by weak reference)."""
    latent = tuple((site.name, site.shape) for site in description.latent_sites)
    sites = tuple(
        (
            s.name,
            s.family,
            s.loc.shape,
            s.scale.shape,
            s.event_dim,
            tuple((role, leaf.shape) for role, leaf in s.params.items()),
            tuple((role, type(c), repr(c)) for role, c in s.param_constraints.items()),
            _transform_key(s.transform),
            type(s.constraint),
            repr(s.constraint),
            None if s.rows is None else tuple((d, len(i)) for d, i in s.rows.items()),
            repr(s.hints),
        )
        for s in description.sites
    )
    return description.guide, latent, sites


def _transform_key(transform: Transform) -> object:
    """``transform`` for comparison by ``==``: composed and independent transforms by their
    parts (torch compares ``IndependentTransform`` s, which ``biject_to`` builds anew at each
    call, by identity), others by their own ``__eq__`` (by value for torch's)."""
    if isinstance(transform, ComposeTransform):
        return ComposeTransform, tuple(_transform_key(part) for part in transform.parts)
    if isinstance(transform, IndependentTransform):
        base = _transform_key(transform.base_transform)
        return IndependentTransform, base, transform.reinterpreted_batch_ndims
    return transform


@dataclass
class _Learnt:
    """A fully checked description's structure, its declared tensors (weakly) and, per block
    and role, where its later reads compare the value with its parameter: ``(site index, role,
    at)``, ``at`` the flat indices of the value's sampled coordinates and, for a block with
    rows, their coordinates in the parameter at the run's rows; ``at`` is ``None`` where the
    role is compared whole (its constraint's map is not elementwise)."""

    structure: tuple
    leaves: list[weakref.ref]
    picks: list[tuple[int, str, tuple | None]]

    @classmethod
    def of(cls, description: GuideDescription, structure: tuple) -> _Learnt:
        """What a read of ``description``'s structure needs (after its full check passed)."""
        leaves = [weakref.ref(leaf) for leaf in description.leaves()]
        learnt = cls(structure, leaves, [])
        for i, site in enumerate(description.sites):
            if site.family != "gaussian" or site.rows is None:
                continue
            for role in ("loc", "scale"):
                value, leaf = getattr(site, role), site.params[role]
                n = value.numel()
                flat = torch.linspace(0, n - 1, min(n, _SAMPLED), dtype=torch.float64)
                flat = flat.round().long().to(value.device)
                at_leaf = None
                if site.rows:
                    shape = list(leaf.shape)
                    for dim, index in site.rows.items():
                        shape[dim] = len(index)
                    at_leaf = torch.unravel_index(flat.to(leaf.device), tuple(shape))
                pick = (i, role, (flat, at_leaf))
                try:  # the full check passed: only a map that is not elementwise fails here
                    elementwise = not _mismatch(*_Learnt.sampled(site, pick))
                except (RuntimeError, ValueError, IndexError):
                    elementwise = False
                learnt.picks.append(pick if elementwise else (i, role, None))
        return learnt

    def matches(self, description: GuideDescription, structure: tuple) -> bool:
        """Whether ``description`` has the structure and declares the tensors learnt."""
        leaves = description.leaves()
        if len(leaves) != len(self.leaves) or any(
            ref() is not leaf for ref, leaf in zip(self.leaves, leaves, strict=True)
        ):
            return False
        try:
            return bool(structure == self.structure)
        except (RuntimeError, TypeError, ValueError):  # a transform's __eq__ on tensors
            return False

    def check(self, description: GuideDescription) -> None:
        """Compare each block's ``loc`` and ``scale`` with their parameters at the learnt
        coordinates (whole, where learnt so), all at once per device; a ``ValueError`` as the
        full check's."""
        with torch.no_grad():
            by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for pick in self.picks:
                found, declared = self.sampled(description.sites[pick[0]], pick)
                by_device.setdefault(declared.device, []).append((found, declared))
            if not any(_mismatch(*map(torch.cat, zip(*pairs))) for pairs in by_device.values()):
                return
            for pick in self.picks:  # which one
                site = description.sites[pick[0]]
                if _mismatch(*self.sampled(site, pick)):
                    raise ValueError(_undeclared_message(description.guide, site, pick[1]))

    @staticmethod
    def sampled(site: MeanFieldSite, pick: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """``site``'s value of ``pick``'s role and the value its parameter declares, flat, at
        ``pick``'s coordinates."""
        _, role, at = pick
        value, leaf = getattr(site, role), site.params[role]
        if at is None:
            for dim, index in site.rows.items():
                leaf = leaf.index_select(dim, index.to(leaf.device))
            return value.reshape(-1), _declared_value(site, role, leaf).reshape(-1)
        flat, at_leaf = at
        if at_leaf is None:
            entries = leaf.take(flat.to(leaf.device))
        else:
            at_leaf = list(at_leaf)
            for dim, index in site.rows.items():
                at_leaf[dim] = index.to(leaf.device)[at_leaf[dim]]
            entries = leaf[tuple(at_leaf)]
        return value.take(flat), _declared_value(site, role, entries)


def _adapter_or_refusal(target: object) -> Callable[[object, Trace | None], GuideDescription]:
    """The adapter of ``target``'s class; a ``TypeError`` naming the guide, why it is not read
    and what to use instead, when there is none."""
    adapter = _adapter(type(target))
    if adapter is None:
        what, aside = _not_read(target)
        raise TypeError(
            f"pyro-quadvi cannot read the posterior of {what}: quadrature needs a Gaussian guide "
            f"(pyro_quadvi's AutoMeanFieldNormal, or Pyro's {', '.join(supported_guides())}) or "
            "a guide implementing quadrature_description(trace) (see the page 'Writing a guide "
            f"for QuadratureELBO and QNVB').{aside}"
        )
    return adapter


_HAND_WRITTEN = (
    " A hand-written or amortized guide (an encoder network) trains with Pyro's Trace_ELBO; "
    "QNVB() then hands all its parameters to its fallback optimizer."
)
_SAME_SITES = (
    " For a mean field over the same sites, which quadrature and QNVB read, use AutoNormal or "
    "AutoMeanFieldNormal; or fit this guide with Pyro's Trace_ELBO and Adam (pyro.optim.Adam)."
)


#: Why an AutoGuide of these classes is not read (`_not_read`).
_WHY_NOT = {
    AutoNormalizingFlow: "its posterior is a Normal pushed through learned transforms (a "
    "normalizing flow), which a Gaussian quadrature does not integrate",
    AutoLaplaceApproximation: "it fits a point (MAP), and its Gaussian comes after, from "
    "laplace_approximation(), an AutoMultivariateNormal that is read",
    AutoGaussian: "its Gaussian factors along the model's dependencies, which no adapter reads",
    AutoDelta: "it fits points (MAP): there is no distribution to integrate",
}


def guide_class_name(guide: object) -> str:
    """The name of ``guide``'s class as its user wrote it: ``AutoGaussian`` for Pyro's
    ``AutoGaussian``, which turns into its backend's class (``AutoGaussianDense``) when built."""
    return "AutoGaussian" if isinstance(guide, AutoGaussian) else type(guide).__name__


def _not_read(target: object) -> tuple[str, str]:
    """A guide no adapter reads: its name for a message, and a sentence (with a leading space)
    on why, and what to use instead."""
    if isinstance(target, types.FunctionType | types.MethodType):
        kind = "method" if isinstance(target, types.MethodType) else "function"
        what = f"the guide {kind} {target.__qualname__!r} (its pyro.param sites)"
        owner = type(getattr(target, "__self__", None))
        if owner.__module__.startswith("pyro.contrib.gp."):  # a GP's own guide, gpr.guide
            return what, (
                f" For a {owner.__name__} gpr, fit guide = AutoMeanFieldNormal(gpr.model) "
                "instead: SVI(gpr.model, guide, QNVB(), QuadratureELBO()), or in gp.util.train "
                "loss_fn=lambda model, _: elbo.differentiable_loss(model, guide); then predict "
                "at the fitted hyperparameters (the page 'Writing a guide for QuadratureELBO "
                "and QNVB', section 'Gaussian processes from pyro.contrib.gp')."
            )
        return what, _HAND_WRITTEN
    if isinstance(target, EasyGuide):
        return f"the easy_guide {type(target).__name__!r} (its pyro.param sites)", _HAND_WRITTEN
    name = guide_class_name(target)
    if isinstance(target, AutoGuideList):
        return name, (
            " An AutoGuideList is not read part by part: use one guide over all the latents "
            "(AutoMeanFieldNormal or AutoNormal give each site its own block), or, to keep a "
            "part that is amortized or hand-written (an encoder of local latents), fit the list "
            "with Pyro's Trace_ELBO and QNVB(): QNVB updates its AutoMeanFieldNormal, AutoNormal "
            "and AutoDiagonalNormal parts and trains the rest with its fallback optimizer."
        )
    reason = _refusal(type(target))
    if reason is not None:
        return name, f" {reason}.{_SAME_SITES}"
    if isinstance(target, AutoMessenger):
        return name, (
            f" {name}'s posterior at a site is made from the prior given the values upstream, "
            f"not a Normal of the site's own parameters.{_SAME_SITES}"
        )
    if not isinstance(target, AutoGuide):
        return name, ""
    reason = next((text for cls, text in _WHY_NOT.items() if isinstance(target, cls)), None)
    because = f" {reason[0].upper()}{reason[1:]}." if reason else ""
    return name, f"{because} Fit {name} with Pyro's Trace_ELBO and Adam (pyro.optim.Adam)."


def check_traced(trace: Trace, draws: dict[str, tuple[str, ...]]) -> None:
    """Refuse a trace of a guide's run that lacks draws a description reads: ``draws`` maps
    each draw (a model site, or a guide's own site such as ``AutoNormal``'s
    ``"{site}_unconstrained"``) to the model sites it carries.

    A ``poutine.block`` around the guide hides its sites from the trace. The description is read
    from the guide itself, so without this check a hidden model site is fitted all the same (a
    Monte Carlo ELBO would leave it to the model's prior instead), and a hidden draw of the
    guide's own is a bare ``KeyError``.

    Raises:
        ValueError: naming the hidden draws and sites, and the ways out.
    """
    hidden = {draw: sites for draw, sites in draws.items() if draw not in trace.nodes}
    if not hidden:
        return
    sites = list(dict.fromkeys(site for carried in hidden.values() for site in carried))
    names = ", ".join(map(repr, sites))
    what = ", ".join(
        repr(draw)
        if carried == (draw,)
        else f"{draw!r} (its draw of {', '.join(map(repr, carried))})"
        for draw, carried in hidden.items()
    )
    them = "them" if len(hidden) > 1 else "it"
    own = "them guides of their own" if len(sites) > 1 else "it a guide of its own"
    raise ValueError(
        f"the trace of the guide's run lacks {what}: a poutine.block around the guide hid "
        f"{them}, or the guide's run never samples {them} (a guide's quadrature_description "
        "describes sites its run samples). pyro-quadvi reads the posterior of every latent "
        f"site from the guide itself, so it would fit {names} all the same (a site hidden from "
        f"the guide is not left to the model's prior here). To fix {names} at a value, "
        "condition the model, pyro.condition(model, data={...}), and build the guide from that "
        f"model; to draw {names} from the prior or give {own}, build the guide on "
        f"poutine.block(model, hide=[{names}]) (or use an AutoGuideList) and fit with Pyro's "
        "Trace_ELBO"
    )


def is_describable(guide: object) -> bool:
    """Whether `describe_guide` knows ``guide``'s kind (without describing it)."""
    target = unwrap_guide(guide)
    return isinstance(target, QuadratureGuide) or _adapter(type(target)) is not None


# ------------------------------------------------------------- finding the guides that run
_LIVE_GUIDES: weakref.WeakSet = weakref.WeakSet()
_UNDESCRIBED_GUIDES: weakref.WeakSet = weakref.WeakSet()
_DESCRIBABLE: dict[type, bool] = {}
_PASSIVE: dict[type, bool] = {}  # class -> nothing to note at its calls (_on_module_call)
_WATCH_HANDLE = None


def register_guide(guide: Callable) -> None:
    """Make ``guide`` known to optimizers (QNVB) that update guides by their description.

    Guides that are ``torch.nn.Module`` s (every AutoGuide) are found by themselves when they run,
    by a hook on ``nn.Module.__call__``; a guide that is a plain callable object, or a module
    with a ``__call__`` of its own (``AutoNormalMessenger``), calls this once.
    """
    if not is_describable(guide):
        describe_guide(guide)  # raises the TypeError that says what is missing
    _LIVE_GUIDES.add(unwrap_guide(guide))


def live_guides() -> Iterator:
    """The registered or seen guides that are still alive."""
    return iter(list(_LIVE_GUIDES))


def undescribed_guides() -> Iterator[AutoGuide]:
    """The AutoGuides seen running (`watch_guides`) of a kind no adapter describes (an
    ``AutoDelta``, say), still alive: their parameters go to a fallback optimizer. Containers
    (``AutoGuideList``) are not among them; their parts are."""
    return iter(list(_UNDESCRIBED_GUIDES))


def describe_live_guides(params: Iterable[torch.Tensor]) -> list[tuple[Callable, GuideDescription]]:
    """Each live guide (`live_guides`) that may hold one of ``params``, with its description
    (`describe_guide`, of its current parameters): what an optimizer pairs ``params`` with,
    by identity.

    A guide module holding parameters of its own, none of them among ``params``, is skipped
    undescribed: it is a guide of another model, or a stale one whose parameters left the param
    store (its description would look them up and fail). A module holding none of its own (its
    ``pyro.param`` sites live in the store) and a guide that is not a module are described. A
    guide that has not run yet (its description raises ``RuntimeError``) is skipped.
    """
    received = {id(p) for p in params}
    described = []
    for guide in live_guides():
        held = list(guide.parameters()) if isinstance(guide, torch.nn.Module) else []
        if held and not any(id(p) in received for p in held):
            continue
        try:
            described.append((guide, describe_guide(guide)))
        except RuntimeError:  # not run yet
            continue
    return described


# guide -> the handler scale around its last run under autograd (`run_scale`)
_RUN_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _handler_scale() -> float | torch.Tensor:
    """The factor Pyro's live handlers put on a site's log density: the product of the scales of
    the active ``poutine.scale`` s and of ``full size / batch size`` of the active subsampled
    plates, the only handlers that touch a site's ``scale``."""
    scale = 1.0
    for messenger in _PYRO_STACK:
        if isinstance(messenger, ScaleMessenger):
            factor = messenger.scale
            if isinstance(factor, torch.Tensor):
                factor = float(factor) if factor.numel() == 1 else factor.detach()
            scale = factor * scale
        elif isinstance(messenger, SubsampleMessenger):
            scale = float(messenger.size) / messenger.subsample_size * scale
    return scale


# guide -> the handler mask around its last run under autograd (`run_mask`)
_RUN_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _handler_mask() -> bool | torch.Tensor | None:
    """The mask Pyro's live ``poutine.mask`` s put on a site (their ``&``); ``None`` without."""
    mask = None
    for messenger in _PYRO_STACK:
        if isinstance(messenger, MaskMessenger):
            mask = messenger.mask if mask is None else mask & messenger.mask
    return mask


def run_mask(guide: torch.nn.Module) -> torch.Tensor | None:
    """The mask ``poutine.mask`` handlers put on ``guide``'s sites in its last run under autograd,
    as a bool tensor; ``None`` without one, under ``mask=True`` or for a guide not seen running:
    what a description without a trace of an adapter-described guide takes as its blocks'
    ``mask``, as `run_scale` gives their scale."""
    return mask_tensor(_RUN_MASKS.get(guide))


def mask_tensor(mask: bool | torch.Tensor | None) -> torch.Tensor | None:
    """A site's or handler's ``mask`` as a bool tensor; ``None`` for ``None`` or ``True``, which
    mask nothing."""
    if mask is None or mask is True:
        return None
    return torch.as_tensor(mask, dtype=torch.bool)


def run_scale(guide: torch.nn.Module) -> float:
    """The scale ``poutine.scale`` handlers (and subsampled plates) around ``guide``'s last run
    under autograd put on each of its sites: what the gradients of its parameters carry besides
    the minibatch scale of the plates the guide opens itself. 1.0 for a guide not seen running
    (`watch_guides` records the runs).

    The last run wins, as for ``AutoMeanFieldNormal``'s own record of its minibatch: in a step the
    guide's run inside the loss comes last, after any evaluation between steps (Pyro's
    ``Trace_ELBO.loss`` runs the guide with gradients on too). A loss that runs the guide twice
    at two scales is read at the second.

    A description without a trace of an adapter-described guide (``AutoNormal``,
    ``AutoDiagonalNormal``) takes it as its blocks' ``scale_factor``; ``AutoMeanFieldNormal``
    records each site's whole scale itself.

    Raises:
        ValueError: if the scale is a tensor of several elements (it scales the sites unevenly):
            no one number reads the gradients.
    """
    scale = _RUN_SCALES.get(guide, 1.0)
    if isinstance(scale, torch.Tensor):
        name = f"{type(guide).__name__} {getattr(guide, '_pyro_name', '')!r}"
        raise ValueError(
            f"the guide {name} runs under a poutine.scale by a tensor of shape "
            f"{tuple(scale.shape)}, which scales its sites unevenly, so QNVB cannot divide "
            "it out of the gradients of the guide's parameters. Scale the guide by one number "
            "(poutine.scale(guide, scale=s)), or weight the data in the model only"
        )
    return scale


def first_rows(args: tuple, kwargs: dict) -> tuple[int | str | None, float]:
    """Where the first tensor argument with a dim is (its position, else its keyword) and its
    number of rows (dim 0): the minibatch a data-parallel rank was given, for a model called
    with its data first; ``(None, nan)`` without one."""
    for where, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor) and value.dim():
            return where, float(value.shape[0])
    return None, math.nan


def run_rows(guide: torch.nn.Module) -> float:
    """The rows (`first_rows`) of the positional arguments of ``guide``'s last run under
    autograd, as Pyro's ELBOs call it with the model's arguments. NaN for a guide not seen
    running (`watch_guides`), or called with its data by keyword only: torch's global
    forward pre-hook, by which the runs are seen, is not given keyword arguments."""
    return _RUN_ROWS.get(guide, math.nan)


# guide -> the rows of the first tensor argument of its last run under autograd (`run_rows`)
_RUN_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _on_module_call(module: torch.nn.Module, args) -> None:
    """The guide watch, at every module call. A class already known to need nothing (neither a
    guide QNVB can pair with nor an AutoGuide) returns at once; so does, inside a network that
    dynamo compiles, any module that cannot be a guide, in plain Python that dynamo traces: the
    compiled network keeps its graph (with a bookkeeping call there, the graph breaks and
    dynamo ran every module of a compiled network eagerly once a QNVB existed). The
    bookkeeping runs eagerly, for guides, and once per class to learn which it is."""
    cls = type(module)
    if torch.compiler.is_compiling():  # (_PASSIVE is not read there: dynamo would guard on it
        if not _may_be_guide(cls):  # and recompile at each class the watch learns)
            return
    elif _PASSIVE.get(cls, False):
        return
    _note_module_call(module, args)


def _may_be_guide(cls: type) -> bool:
    """Whether a module of class ``cls`` may be a guide to note: an AutoGuide, a class that
    describes itself (`QuadratureGuide`) or one with a registered adapter."""
    return (
        issubclass(cls, AutoGuide)
        or hasattr(cls, "quadrature_description")
        or hasattr(cls, "_pyro_quadvi_adapter")
    )


@torch.compiler.disable  # bookkeeping, run eagerly: dynamo must not trace the WeakSet
def _note_module_call(module: torch.nn.Module, args) -> None:
    if compiled_original(module) is not None:
        return  # a torch.compile wrapper: the module it holds is noted at its own call
    cls = type(module)
    known = _DESCRIBABLE.get(cls)
    if known is None:
        known = _DESCRIBABLE[cls] = is_describable(module)
        _PASSIVE[cls] = not known and not _is_undescribed_guide(cls)
    if known:
        _LIVE_GUIDES.add(module)
        # a restored param store holds other tensors than the guide's plain nn.Parameters
        # (AutoDiagonalNormal's loc): they take the store's values and go back into it, so any
        # ELBO's run uses and trains the store's tensors
        follow_param_store(module)
        if torch.is_grad_enabled():  # (module is the guide itself: wrappers returned above)
            _RUN_SCALES[module] = _handler_scale()
            _RUN_MASKS[module] = _handler_mask()
            _RUN_ROWS[module] = first_rows(args, {})[1]
    elif _is_undescribed_guide(cls):
        _UNDESCRIBED_GUIDES.add(module)


def _is_undescribed_guide(cls: type) -> bool:
    return issubclass(cls, AutoGuide) and not issubclass(cls, AutoGuideList)


def watch_guides() -> None:
    """Note every describable ``nn.Module`` guide when it runs (installed once, by QNVB): its
    run scale and rows (`run_scale`, `run_rows`), and, first,
    `follow_param_store` on it, so that a guide run after the param
    store was restored computes with, and trains, the store's tensors.

    A global forward pre-hook of torch: one dictionary look-up per module call, and for a
    describable guide a walk over its ``PyroModule`` s' parameters (see ``docs/guides.md`` for
    its cost).
    """
    global _WATCH_HANDLE
    if _WATCH_HANDLE is None:
        _WATCH_HANDLE = torch.nn.modules.module.register_module_forward_pre_hook(_on_module_call)


# ----------------------------------------------------------- moments the ELBO hands over
@dataclass
class PublishedMoments:
    """The expected gradient and Hessian diagonal a quadrature integrated for one block.

    Attributes:
        site: the block, as described in the run that was integrated.
        g: ``E_q[dU/dz]`` with ``U`` the negative log joint, per coordinate of ``site.loc``,
            minibatch scale removed (rasp paper, eq. 7 and 11).
        h: ``E_q[d^2U/dz^2]`` by Stein's identity ``sum_k w_k dU/dz_k x_k / scale`` (eq. 8 and 11).
        version: the loc leaf's in-place version counter when the moments were taken; moments of
            a leaf changed since are stale.
        loss: the loss whose backward pass published them, detached, on its device (``None``:
            not given); an optimizer that reads it (``SparseQNVB``'s divergence check) pays the
            read from the device, one that does not, nothing.
    """

    site: MeanFieldSite
    g: torch.Tensor
    h: torch.Tensor
    version: int
    loss: torch.Tensor | None = None


@dataclass
class _Publication:
    """What is kept until the optimizer takes it: no strong reference to a parameter, so
    moments nobody takes (a first-order optimizer) never keep a fit's parameters alive."""

    site: MeanFieldSite  # loc and scale detached, params empty
    leaves: dict[str, weakref.ref]
    g: torch.Tensor | None  # None: two terms of one loss disagreed on the rows (see below)
    h: torch.Tensor | None
    version: int
    loss: torch.Tensor | None


_PUBLISHED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def publish_moments(moments: PublishedMoments) -> None:
    """Hand ``moments`` to the optimizer that updates the block's parameters next.

    Moments published again for the same leaf before it changed (a loss with two quadrature
    terms, or two backward passes before one step) add up, as gradients do (their losses too,
    where both carry one); if the two disagree on
    the rows of a subsampled plate they are withdrawn, and the optimizer falls back to the
    gradients of the parameters. The sum carries the backward pass's factor and the number of
    terms, which ``QNVB`` reads from the gradients of the scale and divides out.
    """
    site = moments.site
    leaf = site.params["loc"]
    earlier = _PUBLISHED.get(leaf)
    if earlier is not None and earlier.version == moments.version:
        same_rows = earlier.g is not None and _same_rows(earlier.site.rows, site.rows)
        earlier.g = earlier.g + moments.g if same_rows else None
        earlier.h = earlier.h + moments.h if same_rows else None
        both = earlier.loss is not None and moments.loss is not None
        earlier.loss = earlier.loss + moments.loss if both else None
        return
    kept = replace(site, loc=site.loc.detach(), scale=site.scale.detach(), params={})
    leaves = {role: weakref.ref(tensor) for role, tensor in site.params.items()}
    _PUBLISHED[leaf] = _Publication(
        kept, leaves, moments.g, moments.h, moments.version, moments.loss
    )


def _same_rows(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None or a.keys() != b.keys():
        return a == b
    return all(torch.equal(a[dim], b[dim]) for dim in a)


def published_moments(loc_leaf: torch.Tensor) -> PublishedMoments | None:
    """Take the current moments published for the block whose loc leaf is ``loc_leaf``.

    ``None`` when there are none, when they are stale (the leaf changed in place since, as its
    ``_version`` counter tells: a write through ``.data`` does not count, which is why they are
    taken once) or when they were withdrawn.
    """
    publication = _PUBLISHED.pop(loc_leaf, None)
    if publication is None or publication.version != loc_leaf._version or publication.g is None:
        return None
    params = {role: ref() for role, ref in publication.leaves.items()}
    if any(tensor is None for tensor in params.values()):
        return None
    site = replace(publication.site, params=params)
    return PublishedMoments(
        site, publication.g, publication.h, publication.version, publication.loss
    )
