"""The model's log joint density at points of the unconstrained latent space.

Both the quadrature ELBO and the OPQA evidence evaluate

    log p(x, T(z)) + log |det dT/dz|

at a batch of flat unconstrained points ``z`` of shape ``(K, dim)``: the latent sites laid end to
end, each pushed through ``T = biject_to(support)``. `LogJoint` does this either in one pass
of the model under a particle plate (``vectorize=True``) or node by node.

**Closed-form sites.** A site listed in ``closed_form`` contributes ``-KL(q_site || prior)`` in
place of its prior's log density at the point, the KL computed by the guide from the prior the
model builds at that point (so a prior whose parameters are other latents is still integrated
over them). A spike-and-slab guide meets a spike-and-slab prior this way (sequence paper, eq.
4.3-4.4; the sparse-VI paper's eq. 1): the prior's point mass never shows at a node, and the
guide's entropy of those sites is inside the KL, not added by the ELBO. Weighted as Pyro weighs
them (``Trace_ELBO``: the model's log density times the model site's scale and mask, the guide's
times the guide site's), the term is

    -c_m CE + c_g H  =  -c_m KL + (c_g - c_m) H,        CE = -E_q[log prior],  H = entropy,

per batch element, with ``c_m`` the model site's scale and mask and ``c_g`` the guide site's (in
the ``replay_trace``); the second part is added only where the two differ (a ``poutine.scale``
or ``poutine.mask`` on the model alone or on the guide alone).

**Priors integrated by the caller.** A site listed in ``expected_log_priors`` whose prior is an
`IidNormal` (the Normal priors of `pyro_quadvi.nn`), on
the real line and unmasked, contributes nothing here: its log density is not evaluated at the
points, and its ``(loc, scale, site scale)`` is recorded in `LogJoint.closed_priors` for
the caller, which integrates it in closed form (`QuadratureELBO`). Any
other prior at such a site is evaluated at the points as usual.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import pyro
import torch
from pyro import poutine
from pyro.distributions import (
    Delta,
    ExpandedDistribution,
    ImproperUniform,
    MaskedDistribution,
    constraints,
)
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.distributions.transforms import Transform
from pyro.distributions.util import scale_and_mask, sum_rightmost
from pyro.poutine import Trace
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch.distributions import Independent, biject_to
from torch.distributions.transforms import ComposeTransform, IndependentTransform

from ..distributions.iid_normal import IidNormal
from .batched import (
    BatchMismatch,
    below_float64,
    check_vectorize,
    first_line,
    is_broadcast_error,
    sum_is_finite,
)
from .normal_density import NodeByNodeNormal

__all__ = [
    "GuideShapeMismatch",
    "LatentSite",
    "LogJoint",
    "PlateCollision",
    "RandomState",
    "check_max_plate_nesting",
    "check_observed_not_nan",
    "cuda_devices",
    "first_observed_by_the_model",
    "is_data_site",
    "latent_sites_of_model",
    "model_max_plate_nesting",
    "observed_by_the_model",
    "total_of",
]

_NODE_PLATE = "_quadvi_nodes"


@dataclass(frozen=True)
class LatentSite:
    """A latent site laid out in the flat unconstrained vector.

    Attributes:
        name: the model's sample site.
        shape: its unconstrained shape in one run of the model (batch + event).
        event_dim: number of rightmost dims of ``shape`` that are event dims.
        transform: ``biject_to(support)``, unconstrained to constrained.
        improper: whether its prior is an ``ImproperUniform`` (a density without a sampler).
    """

    name: str
    shape: torch.Size
    event_dim: int
    transform: Transform
    improper: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def check_latent_site(site: dict) -> None:
    """Refuse what quadrature cannot integrate: discrete or enumerated latents, point masses.

    A prior without ``rsample`` (``LKJCholesky``, say) is accepted: quadrature evaluates the
    prior's density at its own nodes and never samples it.
    """
    name = site["name"]
    if site["infer"].get("enumerate"):
        raise ValueError(
            f"latent site {name!r} is marked for enumeration; quadrature integrates continuous "
            "latents only: marginalize it out in the model, or fit with Pyro's "
            "TraceEnum_ELBO(max_plate_nesting=...) and a guide of the other latents, built on "
            "the model with every enumerated site hidden: AutoMeanFieldNormal(poutine.block("
            "model, hide_fn=lambda msg: bool(msg['infer'].get('enumerate')))), which QNVB "
            "updates from the gradients (AutoMeanFieldNormal(poutine.block(model, hide=["
            f"{name!r}])) would hide this site only, and the model may enumerate others; "
            "docs/guides.md, 'Discrete latents: enumeration')"
        )
    if site["fn"].support.is_discrete:
        raise ValueError(
            f"latent site {name!r} is discrete ({type(site['fn']).__name__}); quadrature "
            "integrates continuous latents only: marginalize it out in the model"
        )
    if isinstance(_innermost(site["fn"]), Delta):
        raise ValueError(
            f"latent site {name!r} is a Delta distribution, a point mass: its density is -inf "
            "everywhere but at its value, so there is nothing to integrate. If it is a function "
            f"of other latents, write pyro.deterministic({name!r}, value); if it is data, observe "
            "it (obs=...)"
        )


def unconstraining_bijection(site: dict) -> Transform:
    """``biject_to`` of a latent site's support, where quadrature places its nodes; a support
    without one is refused naming the site, its support and the way out, as Pyro's AutoGuides
    name them (torch's own error names neither): a reparameterizer of ``pyro.infer.reparam``
    (``ProjectedNormalReparam`` for the sphere, ``TransformReparam`` for a
    ``TransformedDistribution``, onto ``lower_cholesky`` say), or, for a ``Wishart`` or another
    positive definite matrix, for which Pyro has none, the model written another way."""
    support = site["fn"].support
    try:
        return biject_to(support)
    except NotImplementedError:
        name = site["name"]
        head = (
            f"latent site {name!r} ({type(site['fn']).__name__}) has the support {support!r}, "
            "which no bijection maps to the real space where quadrature places its nodes"
        )
        layers = list(_layers(site["fn"]))  # (a TransformedDistribution is a layer too)
        if any(isinstance(fn, torch.distributions.TransformedDistribution) for fn in layers):
            way = (
                f"poutine.reparam(model, config={{{name!r}: TransformReparam()}}) (from "
                f"pyro.infer.reparam), which draws the base distribution's latent "
                f"{name + '_base'!r} and makes {name!r} its transform"
            )
        elif any(isinstance(fn, torch.distributions.Wishart) for fn in layers) or isinstance(
            support, type(constraints.positive_definite) | type(constraints.positive_semidefinite)
        ):
            raise ValueError(
                f"{head}, and pyro.infer.reparam has no reparameterizer for it. Write the model "
                "another way: a covariance as an LKJCholesky times scales (L_corr ~ "
                "LKJCholesky(d, eta), scale ~ HalfNormal(s).expand([d]).to_event(1), L = "
                "scale.unsqueeze(-1) * L_corr, which is diag(scale) @ L_corr, and the covariance "
                "L @ L.T; MultivariateNormal(loc, scale_tril=L)), or a Wishart(df, "
                "scale_tril=S) by its Bartlett decomposition (a lower triangular A with A[i, i] "
                "= sqrt(c_i), c_i ~ Chi2(df - i), i = 0..d-1, and A[i, j] ~ Normal(0, 1) below "
                "the diagonal; the matrix is S @ A @ A.T @ S.T)"
            ) from None
        elif isinstance(support, type(constraints.sphere)):
            way = (
                f"poutine.reparam(model, config={{{name!r}: ProjectedNormalReparam()}}) (from "
                f"pyro.infer.reparam), which draws a real latent {name + '_normal'!r} and makes "
                f"{name!r} its direction"
            )
        else:
            way = (
                f"poutine.reparam(model, config={{{name!r}: ...}}) with a reparameterizer of "
                "pyro.infer.reparam that draws latents of a real (or bijectively constrained) "
                "support"
            )
        raise ValueError(
            f"{head}. Reparameterize it: fit {way}, and build the guide from the wrapped model"
        ) from None


def is_data_site(msg: dict) -> bool:
    """Whether a sample site (a trace node or a message) holds data: an observed site whose log
    density is a likelihood term ``p(x | theta)``, the term annealing tempers, the rows check
    follows and the distributed ELBO compares across ranks.

    Not one is a site whose distribution is a ``Delta``: Pyro's reparameterizers leave one at the
    latent they replace (``LocScaleReparam``, ``TransformReparam``: masked off, density 0;
    ``HaarReparam``, ``UnitJacobianReparam``: density 0; ``SplitReparam``, ``NeuTraReparam``,
    ``StructuredReparam``, ``ConjugateReparam``: a ``log_density`` that is the latent's prior,
    with its Jacobian), and so does ``pyro.deterministic``. A ``Delta`` observation the user
    writes has no likelihood to temper either: its log density is 0 (or its ``log_density``) at
    its value and ``-inf`` elsewhere, which a factor ``a > 0`` leaves as it is. ``pyro.factor``
    sites (``Unit``) are tempered, as a likelihood written by hand.
    """
    return (
        msg["is_observed"]
        and not site_is_subsample(msg)
        and not isinstance(_innermost(msg["fn"]), Delta)
    )


def check_observed_not_nan(node: dict, before: str, *, masked_infinity: bool = False) -> None:
    """Refuse an observed site of a trace whose data hold NaN, naming the site and the first index
    (a ``pyro.deterministic`` site, a value of the model's, is not data: it is left alone).

    Under a mask (``poutine.mask``, or ``obs_mask``'s ``{site}_observed``) a NaN entry counts 0
    in the log density but still makes its gradient NaN (``0 * NaN``), and with Pyro's validation
    off nothing else says so: the message then asks for a finite fill of the masked entries.
    ``masked_infinity`` refuses an infinite entry too, which under a mask does the same
    (``0 * inf``); unmasked, an infinity is left to the log density (``-inf``, refused by name by
    the log joint's check of its total). A distribution masked with ``mask(False)`` never reads
    its data (Pyro's ``MaskedDistribution`` returns zeros): it is left alone.

    Args:
        node: a sample site of a Pyro trace.
        before: what the rows must be dropped or imputed before, for the message.
        masked_infinity: refuse infinities as well as NaN (for a masked site).
    """
    value = node["value"]
    if not node["is_observed"] or node["infer"].get("_deterministic"):
        return
    if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return
    if any(isinstance(fn, MaskedDistribution) and fn._mask is False for fn in _layers(node["fn"])):
        return
    # one reduction first, not a mask of the data's size (0.1 ms on 10^6 float32 entries, where
    # isnan(value).any() takes 2 ms): a sum is NaN where an entry is (or +inf meets -inf), not
    # finite where an entry is not (or the sum overflows: the entries then tell)
    if masked_infinity:
        bad, what = (lambda t: ~torch.isfinite(t)), "NaN or an infinity"
        suspect = not bool(sum_is_finite(value))
    else:
        bad, what = torch.isnan, "NaN"
        suspect = bool(value.sum().isnan())
    if suspect and bool(bad(value).any()):
        index = bad(value).nonzero()[0].tolist()
        masked = ""
        if _is_masked(node):
            masked = (
                ". A masked entry (poutine.mask, obs_mask) counts 0 in the log likelihood, but "
                f"{what} there still makes the gradients NaN: fill the masked entries with any "
                "finite value (0, say)"
            )
        raise ValueError(
            f"the observed data of site {node['name']!r} hold {what} (first at index {index} of "
            "its value in the model): its log likelihood is undefined there. Drop or impute "
            f"those rows before {before}{masked}"
        )


def _is_masked(node: dict) -> bool:
    """Whether a sample site carries a mask: ``poutine.mask``'s, or a ``MaskedDistribution``
    among its distribution's wrappers (``Distribution.mask``, ``obs_mask``'s
    ``{site}_observed``)."""
    return node["mask"] is not None or any(
        isinstance(fn, MaskedDistribution) for fn in _layers(node["fn"])
    )


def _layers(fn):
    """``fn`` and the distributions inside its wrappers (Independent, masks, expansions)."""
    yield fn
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
        yield fn


def _innermost(fn):
    """The distribution inside Pyro's and torch's wrappers (Independent, masks, expansions)."""
    *_, innermost = _layers(fn)
    return innermost


def check_callable(owner: str, name: str, value: object, what: str) -> None:
    """Refuse a ``value`` that is not callable, naming ``owner``'s argument ``name`` and
    ``what`` it takes (``"a callable Pyro model"``): Pyro's own refusal ("1 is not callable,
    did you mean to pass it as a keyword arg?", or a ``TypeError`` of ``Messenger.__call__``
    for ``None``) came from deep in a handler and named neither."""
    if not callable(value):
        raise TypeError(f"{owner}: {name} must be {what}, got {value!r} ({type(value).__name__})")


def latent_sites_of_model(model: Callable, *args, **kwargs) -> list[LatentSite]:
    """The continuous latent sites of one run of ``model``, in order, in unconstrained space.

    The run draws its values from the prior and only finds the sites: without Pyro's
    validation, since nothing scores these values (a ``pyro.factor`` that is not finite somewhere
    in the prior's range is the model's own business until a point lands there, where
    `LogJoint` names the site and the point). A prior that cannot be sampled (``ImproperUniform``)
    gets a point of its support instead (`FeasibleImproper`), as quadrature never samples it.
    """
    check_callable("latent_sites_of_model", "model", model, "a callable Pyro model")
    like = next((t for t in tensors_in(args, kwargs) if t.is_floating_point()), None)
    feasible = FeasibleImproper(
        torch.get_default_dtype() if like is None else like.dtype,
        torch.device("cpu") if like is None else like.device,
    )
    blocked = feasible(poutine.block(model, hide_types=["param"]))
    with pyro.validation_enabled(False):
        trace = poutine.trace(blocked).get_trace(*args, **kwargs)
    sites = []
    for name, site in latent_nodes(trace):
        check_latent_site(site)
        transform = unconstraining_bijection(site)
        unconstrained = transform.inv(site["value"].detach())
        event_dim = site["fn"].event_dim + unconstrained.dim() - site["value"].dim()
        improper = is_improper(site["fn"])
        sites.append(LatentSite(name, unconstrained.shape, event_dim, transform, improper))
    return sites


def is_improper(fn) -> bool:
    """Whether a site's distribution is Pyro's ``ImproperUniform`` (in any wrapper), a density
    without a sampler."""
    return isinstance(_innermost(fn), ImproperUniform)


class FeasibleImproper(Messenger):
    """Gives each latent ``ImproperUniform`` site, which cannot be sampled, the point of its
    support at 0 in unconstrained space (as Pyro's ``init_to_feasible``, which samples first and
    so fails there). Every other site draws from its prior as before, from the same random state.
    The point takes the floating dtype and the device of the model's first floating tensor
    argument (the default dtype on the CPU without one): an ``ImproperUniform`` has no parameters
    of its own to take them from.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dtype, self.device = dtype, device

    def _pyro_sample(self, msg) -> None:
        if msg["value"] is None and not msg["is_observed"] and is_improper(msg["fn"]):
            transform = biject_to(msg["fn"].support)
            shape = transform.inverse_shape(msg["fn"].shape())
            msg["value"] = transform(torch.zeros(shape, dtype=self.dtype, device=self.device))


class GuideShapeMismatch(ValueError):
    """A latent site's value from the guide has another shape than the model's distribution
    there (`_GuideShapes`)."""


class _GuideShapes(Messenger):
    """Refuse a latent site whose value from the guide has another shape than the model's
    distribution there, broadcast over its plates, before the model reads the value.

    An autoguide fixes its sites' shapes on its first run; run again on data of another width
    (``Normal(0, 1).expand([x.shape[1]])``), the model got the old shape: torch's bare size
    error, or a silent wrong answer where the old shape broadcasts (one weight for every
    column, its prior counted once per column). A replayed site is not broadcast by its plates
    (Pyro's replay marks it done), so the plates' broadcast is done here as Pyro's
    ``BroadcastMessenger`` does it; in the vectorized pass (``vectorized``) both shapes lead
    with the points' plate and the padding to the model's plates.

    The plates' shape is worked out here rather than by calling Pyro's
    ``BroadcastMessenger._pyro_sample`` on a copy of the message marked undone: that builds an
    expanded distribution to read its shape, 20 µs a site against 2.5 µs for this loop
    (session 25), paid at every latent site of every evaluation."""

    def __init__(self, values: Mapping[str, torch.Tensor], vectorized: bool) -> None:
        super().__init__()
        self.values = values
        self.vectorized = vectorized

    def _pyro_post_sample(self, msg) -> None:
        fn = msg["fn"]
        if msg["name"] not in self.values or msg["is_observed"]:
            return
        if not isinstance(fn, TorchDistributionMixin):  # Pyro broadcasts only its own
            return
        batch = list(fn.batch_shape)
        for frame in msg["cond_indep_stack"]:
            if frame.dim is None or frame.size == -1:
                continue
            batch = [1] * (-frame.dim - len(batch)) + batch
            if batch[frame.dim] == 1:
                batch[frame.dim] = frame.size
        given, wanted = tuple(msg["value"].shape), (*batch, *fn.event_shape)
        if given == wanted:
            return
        if self.vectorized and len(given) == len(wanted):  # the points' plate is no site's
            given, wanted = given[1:], wanted[1:]
            while given and given[0] == 1 and wanted and wanted[0] == 1:  # the padding
                given, wanted = given[1:], wanted[1:]
        raise GuideShapeMismatch(
            f"latent site {msg['name']!r}: the guide gives it shape {given}, but the model's "
            f"distribution there has shape {wanted}. The guide fixed its sites' shapes on its "
            "first run, with other data (of another width?) or another model; build a new "
            "guide for this model and data, or run the model on data of the guide's shapes"
        )


def observed_by_the_model(name: str) -> ValueError:
    """The refusal of a guide that samples ``name``, a site the model observes."""
    return ValueError(
        f"the guide samples {name!r}, which the model observes: the guide was built from a run "
        "of the model without its observations (an AutoGuide builds itself on its first call: "
        "guide(x), or a BayesianModule's predict, before any training). Build it with the "
        "data, guide(x, y) or a first svi.step(x, y), on a new guide"
    )


def first_observed_by_the_model(
    model: Callable, names: Iterable[str], args: tuple, kwargs: dict
) -> str | None:
    """The first of ``names`` that one run of ``model`` (from a fork of the random state)
    observes; ``None`` where none is, or where the run fails (the caller's error stands)."""
    try:
        with torch.random.fork_rng(devices=cuda_devices(model, args, kwargs)):
            trace = poutine.trace(model).get_trace(*args, **kwargs)
    except Exception:  # a question asked on the way to another error: that error stands
        return None
    return next(
        (
            name
            for name in names
            if name in trace.nodes
            and trace.nodes[name]["type"] == "sample"
            and trace.nodes[name]["is_observed"]
        ),
        None,
    )


def latent_nodes(trace: Trace):
    """The unobserved sample sites of a trace, without plates' subsample sites."""
    for name, site in trace.iter_stochastic_nodes():
        if not site_is_subsample(site):
            yield name, site


def model_max_plate_nesting(trace: Trace) -> int:
    """The deepest vectorized plate of a trace (0 without plates)."""
    if not isinstance(trace, Trace):
        raise TypeError(
            "model_max_plate_nesting: trace must be a pyro.poutine.Trace (poutine.trace(model)"
            f".get_trace(*args)), got {trace!r} ({type(trace).__name__})"
        )
    return deepest_plate(trace)[0]


def deepest_plate(trace: Trace) -> tuple[int, str | None]:
    """The nesting (``-dim``) and the name of a trace's deepest vectorized plate
    (``(0, None)`` without plates)."""
    plates = [
        (-frame.dim, frame.name)
        for site in trace.nodes.values()
        if site["type"] == "sample"
        for frame in site["cond_indep_stack"]
        if frame.vectorized
    ]
    return max(plates, default=(0, None))


# Pyro's message when two plates claim one dim (pyro.poutine.runtime)
_COLLISION = re.compile(r'at plates "(.*)" and "(.*)", collide at dim=(-?\d+)')


class PlateCollision(ValueError):
    """A plate of the model at the dim of the points' plate: the model nests its plates deeper
    than the ``max_plate_nesting`` the vectorized pass placed the points' plate left of (a plate
    that appears only on some calls of the model, or a given value too small).

    Attributes:
        plate: the model's plate.
        dim: its dim.
    """

    def __init__(self, plate: str, dim: int, max_plate_nesting: int):
        super().__init__(
            f"the model's plate {plate!r} at dim={dim} collides with the quadrature points' "
            f"plate, placed left of max_plate_nesting={max_plate_nesting} plates: the model "
            f"nests its plates deeper on this call. Pass max_plate_nesting= at least the "
            f"model's deepest nesting ({-dim} or more)"
        )
        self.plate = plate
        self.dim = dim


def check_max_plate_nesting(owner: str, value: object, find: float | None) -> None:
    """Refuse a ``max_plate_nesting`` other than an int ``>= 0`` or ``find``, the value by which
    ``owner`` finds it from a run of the model (``math.inf`` for the ELBOs, as Pyro's; ``None``
    for `LogJoint`), naming the argument: a float would be cut to an int (or fail to be, NaN,
    ``1e300``) far from the call.

    Raises:
        TypeError: for a value that is not a number (``None`` where ``find`` is ``inf``, a string).
        ValueError: for a negative number or a float other than ``find``.
    """
    if value is find or (find is not None and isinstance(value, float) and value == find):
        return
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return
    expected = (
        f"an int >= 0 (how many plates the model nests, e.g. 1 for one pyro.plate) or {find!r} "
        "(found from a run of the model)"
    )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner}: max_plate_nesting must be {expected}, got {value!r} ({type(value).__name__})"
        )
    whole = isinstance(value, float) and value.is_integer() and 0 <= value < 2**31
    fix = f"; pass {int(value)}" if whole else ""
    raise ValueError(f"{owner}: max_plate_nesting must be {expected}, got {value!r}{fix}")


def _check_arguments(sites: object, closed_form: object, expected_log_priors: object) -> None:
    """Refuse `LogJoint`'s ``sites`` other than a list of `LatentSite` (`LogJoint` makes one of
    any iterable), ``closed_form``
    other than a mapping (or ``None``) and ``expected_log_priors`` other than a collection of
    site names, naming the argument: Python's "'NoneType' object is not iterable" or "'int'
    object has no attribute 'numel'" named none."""
    wrong: tuple[object, str] | None = (sites, "")
    if isinstance(sites, list):
        others = (site for site in sites if not isinstance(site, LatentSite))
        wrong = next(((site, " in it") for site in others), None)
    if wrong is not None:
        value, where = wrong
        raise TypeError(
            "LogJoint: sites must be an iterable of LatentSite, in the order of the points' "
            f"coordinates (latent_sites_of_model(model, *args) gives them), got {value!r} "
            f"({type(value).__name__}){where}"
        )
    if closed_form is not None and not isinstance(closed_form, Mapping):
        raise TypeError(
            "LogJoint: closed_form must be a mapping site name -> the guide's block there, or "
            f"None, got {closed_form!r} ({type(closed_form).__name__})"
        )
    names = expected_log_priors
    if (
        not isinstance(names, Collection)
        or isinstance(names, (str, Mapping))
        or not all(isinstance(name, str) for name in names)
    ):
        raise TypeError(
            "LogJoint: expected_log_priors must be a collection of site names (str), e.g. () or "
            f"{{'w'}}, got {names!r} ({type(names).__name__})"
        )


def total_of(terms: Mapping[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """The log joint at the points ``z`` from its terms per site (`LogJoint`'s ``by_site``),
    summed in their order onto zeros of ``z``'s dtype and device."""
    return sum(terms.values(), torch.zeros(z.shape[0], dtype=z.dtype, device=z.device))


class LogJoint:
    """Evaluates ``log p(x, T(z)) + log|J_T(z)|`` at flat unconstrained points ``z``.

    Args:
        model: the Pyro model.
        sites: the latent sites, in the order they are laid out in ``z``.
        max_plate_nesting: plates the model nests, an int ``>= 0`` (the node plate goes left of
            them); ``None`` finds it from a first, looped run of the model.
        closed_form: site -> the guide's block there (`ClosedFormSite`, e.g. a
            `MeanFieldSite` of a spike-and-slab guide);
            those sites contribute ``-KL`` (times their minibatch scale) instead of their log
            density, plus the entropy where the guide's site is weighted otherwise than the
            model's (see the module).
        expected_log_priors: sites whose prior, if an iid Normal, the caller integrates in
            closed form: they contribute nothing, and each run records their priors in
            `closed_priors` (see the module).
        node_by_node: evaluate the log density of each latent site whose prior is a ``Normal``
            with constant parameters (torch's, or an `IidNormal` evaluated at the points) a slice
            of the points at a time (`NodeByNodeNormal`): the same value and gradient, bit for
            bit, without the intermediates of all points at once; a backward that builds a
            graph (``create_graph=True``) is refused (``QuadratureELBO`` sets it).
        after_steps: whether the points come from a guide that steps of an optimizer have moved,
            for the advice of a log density that is not finite: ``False`` gives that for a
            guide's start (start inside the support, a smaller ``init_scale``), ``True`` that for
            a fit that diverged (smaller steps), ``None`` (not known) both. ``QuadratureELBO``
            passes ``True`` past its sequence position 0 and ``None`` at it (a guide fitted by
            another ELBO has moved too); the OPQA evidence, ``None``.

    One minibatch per object: the first run of the model records the subsample indices of the
    plates that the ``replay_trace`` does not supply (plates only the model has, such as
    ``pyro.plate("data", N, subsample_size=B)`` around global latents), and every later run,
    vectorized or node by node, replays them. So all nodes evaluated through one ``LogJoint`` see
    the same rows of the data; make a new ``LogJoint`` for each optimization step.

    Points are evaluated in their own dtype: float64 points give float64 log densities if the
    model's arguments allow it.
    """

    def __init__(
        self,
        model: Callable,
        sites: Iterable[LatentSite],
        max_plate_nesting: int | None = None,
        closed_form: Mapping[str, ClosedFormSite] | None = None,
        expected_log_priors: Collection[str] = (),
        node_by_node: bool = False,
        after_steps: bool | None = None,
    ):
        check_callable("LogJoint", "model", model, "a callable Pyro model")
        check_max_plate_nesting("LogJoint", max_plate_nesting, None)
        if isinstance(sites, Iterable) and not isinstance(sites, (str, Mapping)):
            sites = list(sites)  # (a generator is read once, here)
        _check_arguments(sites, closed_form, expected_log_priors)
        self.model = model
        self.node_by_node = node_by_node
        self.after_steps = after_steps
        self.sites = sites
        self.closed_form = dict(closed_form or {})
        self.expected_log_priors = frozenset(expected_log_priors)
        self.closed_priors: dict[str, tuple[float, float, float]] = {}
        """site -> ``(loc, scale, site scale)`` of the priors left to the caller, last run."""
        self.dim = sum(site.numel for site in self.sites)
        self.max_plate_nesting = max_plate_nesting
        self._subsample: dict[str, dict] | None = None  # recorded by the first run

    def split(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cut flat points ``(..., dim)`` into per-site tensors ``(..., *site.shape)``."""
        self._check_width(z)
        # one split, not a slice per site: its backward places every site's gradient into one
        # new tensor, where a slice's backward makes a zero tensor of all points for each site;
        # none for one site (its backward would copy the gradient of all points once more)
        if len(self.sites) == 1:
            chunks = (z,)
        else:
            chunks = z.split([site.numel for site in self.sites], dim=-1)
        return {
            site.name: chunk.reshape(z.shape[:-1] + site.shape)
            for site, chunk in zip(self.sites, chunks)
        }

    def _check_width(self, z: torch.Tensor) -> None:
        """Refuse a ``z`` that is not a tensor of ``dim`` coordinates along its last axis."""
        if not isinstance(z, torch.Tensor) or z.dim() == 0:
            what = "a 0-d tensor" if isinstance(z, torch.Tensor) else type(z).__name__
            raise TypeError(
                f"LogJoint: z must be a tensor of points (K, {self.dim}), got {z!r} ({what})"
            )
        if z.shape[-1] != self.dim:
            raise ValueError(
                f"expected points with {self.dim} unconstrained coordinates "
                f"({', '.join(s.name for s in self.sites)}), got shape {tuple(z.shape)}"
            )

    def _check_points(self, z: torch.Tensor) -> None:
        """Refuse points ``z`` of more than 2 dims, or of none (``(0, dim)``), naming ``z``: the
        first ended in a broadcast error inside the model, the second in torch's IndexError."""
        if not isinstance(z, torch.Tensor) or z.dim() < 2:
            return  # (`split` names a 0-d tensor or another type)
        shape = tuple(z.shape)
        expected = f"LogJoint: z must be points (K, {self.dim}) or one point ({self.dim},)"
        if z.dim() > 2:
            raise ValueError(
                f"{expected}, got shape {shape}: lay the points along one axis, "
                f"z.reshape(-1, {self.dim}), and reshape the result back (to {shape[:-1]})"
            )
        if z.shape[0] == 0:
            raise ValueError(f"{expected}, got shape {shape}: no point to evaluate")

    def __call__(
        self,
        z: torch.Tensor,
        args: tuple = (),
        kwargs: dict | None = None,
        replay_trace: Trace | None = None,
        vectorize: bool = True,
        by_site: bool = False,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Log joint plus log-Jacobian at each of the ``K`` points ``z`` (shape ``(K, dim)``);
        with ``by_site``, its terms, one ``(K,)`` tensor per site (`total_of` sums them as the
        log joint is summed: the same bits).

        One point may be passed as it is, of shape ``(dim,)``: the result is then that of
        ``z[None]`` without the points' axis (a 0-d tensor; with ``by_site``, a 0-d tensor per
        site), as a distribution's ``log_prob`` takes one value or a batch of them.

        ``vectorize=True`` runs the model once under a particle plate of size ``K``; ``False``
        runs it once per point (`evaluate_batch` chooses between
        them). ``replay_trace`` supplies the subsample indices of the model's plates (the guide's
        trace); the other subsampled plates keep the rows of this object's first run. Site
        scales (minibatch factors) apply to the log density and to the Jacobian alike.

        Raises:
            ValueError: naming the site and the point where the log density is not finite (a
                pyro.factor, NaN data, a point mass), a latent site the points do not cover, or a
                site of the points that the model does not sample; on the first run, naming the
                site and the index, observed data with NaN under a mask (`check_observed_not_nan`:
                counted 0 in the total, they would make its gradients NaN unseen).
            BatchMismatch: (vectorized) a site with batch dims outside of the model's plates.
            TypeError, ValueError: for a ``z`` that is not a tensor of one point ``(dim,)`` or of
                points ``(K, dim)``, ``K >= 1``, naming ``z``, its shape and the fix.
            ValueError: for a ``vectorize`` other than ``True`` or ``False`` (``None``, ``1``).
        """
        check_vectorize(vectorize, "LogJoint: ", allow_none=False)
        if isinstance(z, torch.Tensor) and z.dim() == 1:  # one point, without the points' axis
            self._check_width(z)
            value = self(z[None], args, kwargs, replay_trace, vectorize, by_site)
            return {name: term[0] for name, term in value.items()} if by_site else value[0]
        self._check_points(z)
        kwargs = kwargs or {}
        unconstrained = self.split(z)
        if self.max_plate_nesting is None:
            self.max_plate_nesting = self._find_plate_nesting(
                unconstrained, args, kwargs, replay_trace, functools.partial(_where, z, 0)
            )[0]
        single_traces = None  # the loop's trace at each point
        if vectorize:
            terms, trace = self._vectorized(unconstrained, z, args, kwargs, replay_trace)
        else:
            rows = []
            for k in range(z.shape[0]):
                values = {name: value[k] for name, value in unconstrained.items()}
                # (the place is written only for a message: no copy to the host per node)
                where = functools.partial(_where, z, k)
                rows.append(self._single(values, args, kwargs, replay_trace, where))
            terms = {name: torch.stack([row[0][name] for row in rows]) for name in rows[0][0]}
            single_traces = [row[1] for row in rows]
            trace = single_traces[-1]
        # (a model whose every term is left to the caller has none)
        total = total_of(terms, z)
        if bool(torch.isfinite(total).all()):  # then so is every term: one check, not one a site
            return terms if by_site else total
        for name, term in terms.items():
            bad = ~torch.isfinite(term)
            if bad.any():
                k = int(bad.nonzero()[0, 0])
                at_k = None if single_traces is None else single_traces[k]
                overflow = self._overflow(name, unconstrained, k, args, kwargs, replay_trace, at_k)
                node, value = trace.nodes[name], term[k].item()
                raise ValueError(
                    _not_finite(
                        node, value, _where(z, k), overflow=overflow, after_steps=self.after_steps
                    )
                )
        k = int((~torch.isfinite(total)).nonzero()[0, 0])
        largest = max(terms, key=lambda name: terms[name][k].abs().item())
        fix = (
            "run the model in float64 (torch.set_default_dtype and float64 data), or rescale "
            "the data"
            if below_float64(total.dtype)
            else "rescale the data"
        )
        raise ValueError(
            f"the log joint overflows {total.dtype} at {_where(z, k)}: every site's log density "
            f"is finite (the largest in size: {largest!r}, {terms[largest][k].item():.4g}) but "
            f"their sum is not; {fix}"
        )

    def _overflow(
        self,
        name: str,
        unconstrained: Mapping[str, torch.Tensor],
        k: int,
        args: tuple,
        kwargs: dict,
        replay_trace: Trace | None,
        trace_at_k: Trace | None,
    ) -> str | None:
        """Why the log density of site ``name`` is not finite at point ``k``, where a value
        overflowed (read on the error path only): a latent whose constrained value is not finite
        (its transform overflowed at a point a step too large reached), else a parameter of the
        site's distribution that is not finite while every latent is (the model's arithmetic
        overflowed: inputs on a large scale); ``None`` for neither. ``trace_at_k``: the model's
        run at that point, where the loop made one; else the model runs once more there (from a
        fork of torch's random state, without validation, so that it reaches the site). The
        model's inputs are read first for an observed site or a factor: NaN or an infinity there
        is named (`_nonfinite_input`); a latent site's log density is its prior's, at the guide's
        point, which the inputs rarely explain (a model may replace a NaN input, or hold an
        infinite censoring time on purpose)."""
        if all(site.name != name for site in self.sites):
            inputs = _nonfinite_input(self.model, args, kwargs)
            if inputs is not None:
                return inputs
        values = {site: value[k].detach() for site, value in unconstrained.items()}
        with torch.no_grad():
            constrained, _ = self._constrain(values)
        for site in self.sites:
            if not bool(torch.isfinite(constrained[site.name]).all()):
                return _latent_overflow(site.name, constrained[site.name], values[site.name])
        if trace_at_k is None:
            devices = cuda_devices(values, args, kwargs)
            try:
                with torch.random.fork_rng(devices=devices), pyro.validation_enabled(False):
                    with torch.no_grad():
                        trace_at_k = self._trace(constrained, args, kwargs, replay_trace)
            except Exception:  # (the caller's message stands)
                return None
        node = trace_at_k.nodes.get(name)
        return None if node is None else _parameter_overflow(node)

    def check_plate_nesting(
        self, z: torch.Tensor, args=(), kwargs=None, replay_trace: Trace | None = None
    ) -> None:
        """Refuse a given ``max_plate_nesting`` below the model's plates (one run of the model
        at ``z[0]``): under it the points' plate would collide with the model's own.

        Raises:
            ValueError: naming both numbers, the deepest plate and the fix.
        """
        if self.max_plate_nesting is None:
            return
        if isinstance(z, torch.Tensor) and z.dim() == 1:
            z = z[None]
        self._check_points(z)
        where = functools.partial(_where, z, 0)
        found, plate = self._find_plate_nesting(
            self.split(z), args, kwargs or {}, replay_trace, where
        )
        self._refuse_shallow(found, plate)

    def _refuse_shallow(self, found: int, plate: str | None) -> None:
        """`check_plate_nesting`'s refusal, where the model nests ``found`` plates (the deepest:
        ``plate``) and more than ``max_plate_nesting``."""
        if found > self.max_plate_nesting:
            raise ValueError(
                f"max_plate_nesting={self.max_plate_nesting}, but the model nests its plates "
                f"{found} deep (plate {plate!r} at dim -{found}): the quadrature points' plate "
                f"goes left of the model's. Pass max_plate_nesting={found} (or more), or leave "
                "it out to have it found from a run of the model"
            )

    def _find_plate_nesting(
        self, unconstrained, args, kwargs, replay_trace, where
    ) -> tuple[int, str | None]:
        constrained, _ = self._constrain({name: value[0] for name, value in unconstrained.items()})
        trace = self._trace(constrained, args, kwargs, replay_trace, where=where)
        return deepest_plate(trace)

    def _trace(
        self,
        values,
        args,
        kwargs,
        replay_trace,
        points: torch.Tensor | None = None,
        where: Callable[[], str] = lambda: "the vectorized pass",
    ) -> Trace:
        conditioned = Trace()
        if replay_trace is not None:
            for name, node in replay_trace.nodes.items():
                if node["type"] == "sample" and site_is_subsample(node):
                    conditioned.add_node(name, **node)
        for name, node in (self._subsample or {}).items():
            if name not in conditioned.nodes:
                conditioned.add_node(name, **node)
        for name, value in values.items():
            conditioned.add_node(
                name, type="sample", name=name, value=value, is_observed=False, infer={}
            )
        model = _GuideShapes(values, points is not None)(
            poutine.replay(self.model, trace=conditioned)
        )
        locate = None
        if points is not None:  # one pass over all points, under a plate of them
            particle_dims = self.max_plate_nesting + 1
            model = _in_plate(model, len(points), -particle_dims, points.device)

            def locate(bad: torch.Tensor) -> str:  # the first point where a site is not finite
                per_point = _sum_but_particles(bad.to(points.dtype), len(points), particle_dims)
                return _where(points, int(per_point.nonzero()[0, 0]))

        try:
            trace = poutine.trace(model).get_trace(*args, **kwargs)
        except ValueError as error:
            if isinstance(error.__cause__, GuideShapeMismatch):  # without Pyro's shape dump
                raise error.__cause__ from None
            collision = _COLLISION.search(str(error))
            if points is not None and collision and _NODE_PLATE in collision.groups()[:2]:
                plate = next(name for name in collision.groups()[:2] if name != _NODE_PLATE)
                dim = int(collision.group(3))
                raise PlateCollision(plate, dim, self.max_plate_nesting) from error
            if is_broadcast_error(error):
                raise
            _name_the_invalid_site(
                model, args, kwargs, error, where, locate, after_steps=self.after_steps
            )
            raise
        for name, site in latent_nodes(trace):
            check_latent_site(site)
            if name not in values:
                raise ValueError(
                    f"latent site {name!r} of the model is not covered by the guide; "
                    "every continuous latent needs a (loc, scale) in the guide"
                )
        for name in values:
            if name not in trace.nodes or trace.nodes[name]["type"] != "sample":
                raise ValueError(
                    f"the guide has a latent site {name!r} that the model does not sample (the "
                    f"model's sample sites: {', '.join(_sample_sites(trace)) or 'none'}); build "
                    "the guide from this model, or rename the site to match the model's"
                )
            if trace.nodes[name]["is_observed"]:
                raise observed_by_the_model(name)
        if self._subsample is None:  # the first run: its data are every run's
            # NaN data under a mask count 0 in the log joint, so its check of the total cannot
            # see them, but make the gradients NaN: refused here, by site and index (unmasked
            # ones make the total NaN, and that check names them)
            for node in trace.nodes.values():
                if node["type"] == "sample" and node["is_observed"] and _is_masked(node):
                    check_observed_not_nan(node, before="the fit", masked_infinity=True)
            self._subsample = {
                name: node
                for name, node in trace.nodes.items()
                if node["type"] == "sample"
                and site_is_subsample(node)
                and name not in conditioned.nodes
            }
        return trace

    def _constrain(self, values: dict[str, torch.Tensor]):
        """Constrained values and the (unscaled) log-Jacobian of each site; a site of the real
        line (an identity transform) has none: its log-Jacobian is zero."""
        constrained, log_jac = {}, {}
        for site in self.sites:
            z = values[site.name]
            if _is_identity(site.transform):
                constrained[site.name] = z
                continue
            theta = site.transform(z)
            ladj = site.transform.log_abs_det_jacobian(z, theta)
            ladj = sum_rightmost(ladj, ladj.dim() - (z.dim() - site.event_dim))
            constrained[site.name] = theta
            log_jac[site.name] = ladj
        return constrained, log_jac

    def _compute_log_prob(self, trace: Trace) -> None:
        """The log densities of the trace's sites but those left to the caller
        (`closed_priors`, recorded here) and the plates' subsample sites: theirs is a zero
        that Pyro makes on the CPU, whatever the device of the model."""
        self.closed_priors = {}
        for site in self.sites:
            if site.name in self.expected_log_priors and _is_identity(site.transform):
                node = trace.nodes[site.name]
                prior = _iid_normal(node["fn"])
                scale = node["scale"]
                if prior is not None and node["mask"] is None and isinstance(scale, float | int):
                    self.closed_priors[site.name] = (*prior, float(scale))
        wrapped = {}
        if self.node_by_node:
            for site in self.sites:
                node = trace.nodes[site.name]
                lean = NodeByNodeNormal.of(node["fn"], node["value"])
                if site.name not in self.closed_priors and lean is not None:
                    wrapped[site.name], node["fn"] = node["fn"], lean
        try:
            trace.compute_log_prob(
                lambda name, site: name not in self.closed_priors and not site_is_subsample(site)
            )
        except ValueError as error:
            self._refuse_moved_support(trace, error)
            raise
        finally:
            for name, fn in wrapped.items():
                trace.nodes[name]["fn"] = fn

    def _refuse_moved_support(self, trace: Trace, error: ValueError) -> None:
        """Name a latent site whose values lie outside the support the model gives it now
        though they are finite and not rounded onto the bound of the guide's transform: the
        transform maps onto the support the site had when the guide was set up, so the support
        moved (``Uniform(lo, lo + 1)`` with ``lo`` sampled), where Pyro's validation error names
        only the values."""
        for site in self.sites:
            node = trace.nodes.get(site.name)
            if node is None:
                continue
            value = node["value"].detach()
            with torch.no_grad():
                outside = ~node["fn"].support.check(value)
                # a value the transform rounded onto its bound (exp(-200) = 0 in float32) has
                # no finite preimage: the support did not move
                rounded = not bool(site.transform.inv(value).isfinite().all())
            if not bool(outside.any()) or not bool(value.isfinite().all()) or rounded:
                continue
            raise ValueError(
                f"site {site.name!r}: {int(outside.sum())} of the guide's values lie outside the "
                "support the model gives the site now; the guide's transform maps onto the "
                "support the site had when the guide was set up: a support that depends on "
                "another latent (say `Uniform(lo, lo + 1)` with `lo` sampled) cannot be followed "
                "by the guide's fixed transform. Write the site with a fixed support instead, "
                "e.g. `u = pyro.sample('u', dist.Uniform(0.0, 1.0))` and `x = lo + u`"
            ) from error

    def _single(self, values, args, kwargs, replay_trace, where: Callable[[], str]):
        constrained, log_jac = self._constrain(values)
        trace = self._trace(constrained, args, kwargs, replay_trace, where=where)
        self._compute_log_prob(trace)
        terms = {}
        for name, site in trace.nodes.items():
            if site["type"] == "sample" and "log_prob_sum" in site:
                terms[name] = site["log_prob_sum"]
        for name, closed in self.closed_form.items():
            terms[name] = _closed_form_term(closed, name, trace, replay_trace).sum()
        for name, ladj in log_jac.items():
            terms[name] = terms[name] + _jacobian_term(ladj, name, trace, replay_trace).sum()
        return terms, trace

    def _vectorized(self, unconstrained, z, args, kwargs, replay_trace):
        K, mpn = z.shape[0], self.max_plate_nesting
        padded = {}
        for site in self.sites:
            value = unconstrained[site.name]  # (K, *shape)
            batch = len(site.shape) - site.event_dim
            pad = mpn - batch
            if pad < 0:
                raise BatchMismatch(
                    f"site {site.name!r} has {batch} batch dims but max_plate_nesting={mpn}"
                )
            padded[site.name] = value.reshape((K,) + (1,) * pad + site.shape)
        constrained, log_jac = self._constrain(padded)
        try:
            trace = self._trace(constrained, args, kwargs, replay_trace, points=z)
            self._compute_log_prob(trace)
        except (RuntimeError, ValueError, IndexError) as error:
            if is_broadcast_error(error):
                self._refuse_shallow_after(unconstrained, z, args, kwargs, replay_trace)
            raise
        terms = {}
        for name, site in trace.nodes.items():
            if site["type"] == "sample" and "log_prob" in site:
                cause = functools.partial(self._vector_in_a_plate, site, padded)
                terms[name] = _per_particle(name, site["log_prob"], K, mpn, cause)
        for name, closed in self.closed_form.items():
            term = _closed_form_term(closed, name, trace, replay_trace)
            terms[name] = _per_particle(name, term, K, mpn)
        for name, ladj in log_jac.items():
            term = _jacobian_term(ladj, name, trace, replay_trace)
            terms[name] = terms[name] + _per_particle(name, term, K, mpn)
        return terms, trace

    def _refuse_shallow_after(self, unconstrained, z, args, kwargs, replay_trace) -> None:
        """After shapes that did not broadcast in the vectorized pass, refuse a given
        ``max_plate_nesting`` below the model's plates (`check_plate_nesting`): the points'
        plate then took a dim of the model's, and torch's error ("Value is not broadcastable")
        named neither. One looped run at the first point, from a fork of torch's random state
        and without recording its subsample; where that run fails too, the original error
        stands."""
        subsample = self._subsample
        try:
            with torch.random.fork_rng(devices=cuda_devices(z, args, kwargs)):
                where = functools.partial(_where, z, 0)
                found = self._find_plate_nesting(unconstrained, args, kwargs, replay_trace, where)
        except Exception:  # (the caller raises the broadcast error)
            return
        finally:
            self._subsample = subsample
        self._refuse_shallow(*found)

    def _vector_in_a_plate(self, node: dict, padded: Mapping[str, torch.Tensor]) -> str | None:
        """Why the log density of ``node`` has dims left of the points' dim, where a vector latent
        outside every plate (a ``GaussianRandomWalk`` of event shape ``(T,)``) is read inside a
        plate of its last event dim's size, as a batch of its entries: the pass holds the
        vector as ``(K, 1, ..., T)``, the plate's dims of ones included, and the observed
        site's density broadcasts the points' dim against them (``None``: another cause)."""
        sizes = {frame.size for frame in node["cond_indep_stack"] if frame.vectorized}
        for site in self.sites:
            batch = len(site.shape) - site.event_dim
            if (
                site.event_dim == 0
                or batch >= self.max_plate_nesting
                or site.shape[-1] not in sizes
            ):
                continue
            family = type(look_through(node["fn"])).__name__
            held = ("K", *padded[site.name].shape[1:])
            return (
                f"the latent site {site.name!r} is a vector (event shape "
                f"{tuple(site.shape[batch:])}) outside every plate, which the pass holds as "
                f"({', '.join(map(str, held))}): if {node['name']!r} reads its entries inside "
                f"the plate of size {site.shape[-1]}, as that plate's entries, write the "
                f"likelihood without the plate, pyro.sample({node['name']!r}, "
                f"{family}({site.name}, ...).to_event(1), obs=...), or as "
                f"pyro.factor({node['name']!r}, {family}({site.name}, "
                "...).log_prob(data).sum(-1)): both evaluate all points in one pass"
            )
        return None


class ClosedFormSite(Protocol):
    """The guide's block at a closed-form site, as `LogJoint` reads it."""

    def kl_to_prior(self, prior: torch.distributions.Distribution) -> torch.Tensor:
        """``KL(q_site || prior)`` summed over event dims: the site's batch shape, unscaled."""

    def site_entropy(self) -> torch.Tensor:
        """``q_site``'s entropy summed over event dims: its batch shape, unscaled."""


def _closed_form_term(
    closed: ClosedFormSite, name: str, trace: Trace, replay_trace: Trace | None
) -> torch.Tensor:
    """``-c_m CE + c_g H`` of a closed-form site (the module), per batch element: the prior the
    model built at the site (in ``trace``) against the guide's block, the model site's scale and
    mask ``c_m`` on the cross-entropy, the guide site's ``c_g`` (in ``replay_trace``) on the
    entropy. Where the two sites are weighted alike it is ``-c_m KL``, computed as that."""
    site = trace.nodes[name]
    term = -_scaled(closed.kl_to_prior(site["fn"]), site)
    guide_site = site if replay_trace is None else replay_trace.nodes.get(name, site)
    if _weighted_alike(site, guide_site):
        return term
    entropy = closed.site_entropy()
    return term + (_scaled(entropy, guide_site) - _scaled(entropy, site))


def _weighted_alike(a: dict, b: dict) -> bool:
    """Whether two sites carry the same scale and mask (tensors only by identity: comparing
    their values would read them back from their device)."""

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return x is y
        return x == y

    return same(a["scale"], b["scale"]) and same(a["mask"], b["mask"])


def _jacobian_term(
    ladj: torch.Tensor, name: str, trace: Trace, replay_trace: Trace | None
) -> torch.Tensor:
    """A latent's log-Jacobian ``ladj`` under its guide site's scale and mask, as in Pyro's
    ELBOs, where the Jacobian is part of the guide's density (an AutoGuide's ``log_density``).
    They differ from the model site's under a ``poutine.scale`` or ``poutine.mask`` of the model
    alone or of the guide alone; without a guide trace, the model site's scale (no mask)."""
    if replay_trace is not None and name in replay_trace.nodes:
        return _scaled(ladj, replay_trace.nodes[name])
    return trace.nodes[name]["scale"] * ladj


def _is_identity(transform: Transform) -> bool:
    """Whether ``transform`` is the identity (``biject_to`` of the real line, of real vectors):
    ``torch``'s empty ``ComposeTransform``, possibly inside ``IndependentTransform`` s."""
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return isinstance(transform, ComposeTransform) and not transform.parts


def look_through(fn: torch.distributions.Distribution) -> torch.distributions.Distribution:
    """The distribution inside Pyro's ``to_event`` and ``expand`` wrappers (others kept)."""
    while isinstance(fn, Independent | ExpandedDistribution):
        fn = fn.base_dist
    return fn


def _iid_normal(fn) -> tuple[float, float] | None:
    """``(loc, scale)`` of an `IidNormal` seen through ``to_event`` and ``expand``."""
    fn = look_through(fn)
    return fn.iid if isinstance(fn, IidNormal) else None


def _scaled(term: torch.Tensor, site: dict) -> torch.Tensor:
    """A site's term with its minibatch scale and mask applied, as Pyro applies them."""
    return scale_and_mask(term, site["scale"], site["mask"])


def _sample_sites(trace: Trace) -> list[str]:
    return [
        name
        for name, node in trace.nodes.items()
        if node["type"] == "sample" and not site_is_subsample(node) and name != _NODE_PLATE
    ]


#: an unconstrained coordinate this large means a fit that diverged, not a posterior
_DIVERGED = 1e10


def _where(z: torch.Tensor, k: int) -> str:
    """Where in the points a value was found, for messages; a point with a coordinate beyond
    `_DIVERGED` is said to come from a fit that has likely diverged."""
    point = z[k].detach()
    rounded = [round(v, 6) for v in point.tolist()]
    coordinates = f"unconstrained z = {rounded}" if len(point) <= 8 else None
    if len(z) == 1:
        where = f"the point {coordinates}" if coordinates else "the point evaluated"
    else:
        where = f"quadrature node {k}" + (f" ({coordinates})" if coordinates else "")
    largest = float(point.abs().max()) if point.numel() else 0.0
    if largest > _DIVERGED:
        where += (
            f", a coordinate of which is {largest:.3g} in the unconstrained space: the fit has "
            "likely diverged; cap the optimizer's steps (QNVB's trust_region, a smaller lr, "
            "SparseQNVB's tau_max or max_lr, whichever its divergence warning names) or restart "
            "from the last good checkpoint"
        )
    return where


def _latent_overflow(name: str, value: torch.Tensor, unconstrained: torch.Tensor | None) -> str:
    """`_not_finite`'s account of the latent site ``name``, whose constrained ``value`` is not
    finite: its transform overflowed at the guide's point (its initial value, or one that a step
    too large reached). ``unconstrained``:
    its coordinates at the point, where known (``None``: ``value`` holds all points of a pass)."""
    bad = ~torch.isfinite(value)
    first = value[bad].reshape(-1)[0].item()
    entry, place, at = repr(name), "one of the points evaluated", ""
    if unconstrained is not None:
        if value.dim():
            entry += f" (entry {bad.nonzero()[0].tolist()})"
        if unconstrained.shape == value.shape:
            coordinate = unconstrained[bad].reshape(-1)[0].item()
        else:  # (a transform that changes the shape, as a simplex's)
            coordinate = unconstrained.abs().max().item()
        if not math.isfinite(coordinate):
            return (
                f"the latent site {entry} has the unconstrained value {coordinate} at this "
                "point: the fit has diverged; cap the optimizer's steps (QNVB's trust_region, a "
                "smaller lr) or restart from the last good checkpoint"
            )
        place, at = "this point", f", where its unconstrained value is {coordinate:.4g}"
    dtype = str(value.dtype).removeprefix("torch.")
    # (the log joint does not know whether an optimizer has stepped: both sources are named)
    return (
        f"the latent site {entry} is {first} at {place}{at}: its transform to the support "
        f"overflows {dtype}. A value this far out is not from the posterior but from the "
        "guide's point: before any step, its initial value (start it within the prior's "
        "range: init_loc_fn=init_to_value(values={...}) or init_to_median in the guide); after "
        "steps, a step that was too large (a large lr moves every latent by up to lr, those on "
        "a log scale too). Take smaller steps: a smaller lr, a large lr only for the latents on "
        "the data's scale (QNVB(lambda name: {'lr': 1e4} if name.endswith('.mu') else {}) for a "
        "site 'mu'), or QNVB's trust_region (see the page 'QNVB: quasi-Newton variational "
        "Bayes')"
    )


def _model_signature(model: Callable) -> inspect.Signature | None:
    """The signature of the user's function inside Pyro's handlers (``functools.wraps``'s
    ``__wrapped__``, and the partial a ``Messenger`` makes of it), for naming its arguments;
    ``None`` where there is none to read."""
    for _ in range(64):  # (a bound on the wrappers, against a cycle of them)
        if hasattr(model, "__wrapped__"):
            model = model.__wrapped__
        elif isinstance(model, functools.partial) and model.args and callable(model.args[-1]):
            model = model.args[-1]
        else:
            break
    try:
        return inspect.signature(model, follow_wrapped=False)
    except (TypeError, ValueError):
        return None


def _entries(path: str, value: object):
    """``(path, value)`` of ``value`` and of what lists, tuples and dicts hold inside it."""
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _entries(f"{path}[{i}]", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _entries(f"{path}[{key!r}]", item)
    else:
        yield path, value


def _nonfinite_input(model: Callable, args: tuple, kwargs: dict) -> str | None:
    """`_not_finite`'s account of a non-finite log density where the model's own inputs hold
    NaN or an infinity (a tensor among its arguments, or inside their lists, tuples and dicts; a
    float): the argument by name (from ``model``'s signature, else by position) and the first
    index. ``None`` where every input is finite. Read on the error path only."""
    signature = _model_signature(model)
    try:
        named = list(signature.bind(*args, **kwargs).arguments.items())
    except (AttributeError, TypeError):  # (no signature, or one that these do not fit)
        named = [(f"#{i}", arg) for i, arg in enumerate(args)] + list(kwargs.items())
    for name, arg in named:
        for path, value in _entries(name, arg):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                bad = ~torch.isfinite(value)
                if not bool(bad.any()):
                    continue
                first = value[bad].reshape(-1)[0].item()
                at = f" (first at index {bad.nonzero()[0].tolist()})" if value.dim() else ""
            elif isinstance(value, float) and not math.isfinite(value):
                first, at = value, ""
            else:
                continue
            what = "NaN" if math.isnan(first) else first
            return (
                f"the model's argument {path} holds {what}{at}: if the site's value or "
                "parameters are computed from it, drop or impute those rows of the data, or give "
                "the entry a finite value"
            )
    return None


def _parameter_overflow(site: dict) -> str | None:
    """`_not_finite`'s account of a site whose distribution has a parameter that is not finite
    at a point where every latent is finite; ``None`` where every parameter set on the
    distribution (or the wrappers' inner ones) is finite, and for a ``pyro.factor``."""
    for fn in _layers(site["fn"]):
        if type(fn).__name__ == "Unit":  # a pyro.factor: `_not_finite` words it
            return None
        for param in getattr(fn, "arg_constraints", {}):
            value = vars(fn).get(param)  # (set ones only: a lazy one would be computed)
            if not isinstance(value, torch.Tensor) or bool(torch.isfinite(value).all()):
                continue
            first = value[~torch.isfinite(value)].reshape(-1)[0].item()
            how = (
                "gave NaN (inf - inf or 0 * inf after an overflow; or 0/0, the log of a "
                "negative number)"
                if math.isnan(first)
                else "overflowed"
            )
            return (
                f"its {type(fn).__name__} parameter {param!r} is {first} there, while every "
                f"latent is finite: the model's arithmetic {how}. On inputs of a large scale an "
                "exp of a linear predictor overflows near the guide's start (a coefficient of "
                "0.1 times an input of 1e4 under exp is exp(1000)): standardize the inputs "
                "(each column to mean 0 and sd 1) and the data, or start the guide near the "
                "posterior (init_loc_fn=init_to_value(values={...}) in the guide); where this "
                "follows steps that went well, the last step was too large (a smaller lr, or "
                "QNVB's trust_region)"
            )
    return None


def _overflow_in(trace: Trace, site: dict, steps: bool) -> str | None:
    """`LogJoint._overflow` read from a run of the model (all points of a pass, or one): a latent
    whose value is not finite (named where the points come from ``steps`` of an optimizer; at a
    guide's initial values, the general advice stands), else a parameter of ``site``'s
    distribution that is not finite."""
    for name, latent in latent_nodes(trace):
        value = latent["value"]
        if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all()):
            return _latent_overflow(name, value, None) if steps else None
    return _parameter_overflow(site)


def _not_finite(
    site: dict,
    value: float,
    where: str,
    hint: str | None = None,
    overflow: str | None = None,
    after_steps: bool | None = None,
) -> str:
    """Why the log density of ``site`` is ``value`` (not finite), and what to do; ``hint``: the
    model's own account, in place of the general advice; ``overflow``: a value that overflowed
    at the point (`LogJoint._overflow`), the cause, unless the data hold NaN. The general advice
    is for a guide's start where ``after_steps`` is ``False``, for a fit that diverged where it
    is ``True``, and both where it is ``None`` (not known)."""
    name = site["name"]
    head = f"the log density of site {name!r} is not finite ({value}) at {where}"
    if site["is_observed"] and torch.isnan(torch.as_tensor(site["value"])).any():
        index = torch.isnan(torch.as_tensor(site["value"])).nonzero()[0].tolist()
        return (
            f"{head}: the observed data of {name!r} hold NaN (first at index {index}); drop or "
            "impute those rows (a masked entry, poutine.mask / obs_mask, needs a finite value "
            "too: NaN there makes the gradients NaN)"
        )
    factor = site["infer"].get("is_auxiliary") or type(_innermost(site["fn"])).__name__ == "Unit"
    if overflow:
        if factor:
            shown = "NaN" if math.isnan(value) else value
            return f"{head}: the pyro.factor {name!r} is {shown}, computed by the model; {overflow}"
        return f"{head}: {overflow}"
    if factor:
        if math.isnan(value):
            return (
                f"{head}: the pyro.factor {name!r} is NaN, computed by the model from the "
                "latents and the data; look for NaN in the data or arithmetic such as log of a "
                "negative number or 0/0 in the factor"
            )
        return (
            f"{head}: the pyro.factor {name!r} rules this point out; start the guide where the "
            "factor is finite, with a smaller init_scale"
        )
    if hint:
        return f"{head}: {hint}"
    start = (
        "where a latent sets the support of a site (x ~ Uniform(0, theta)), start the guide "
        "inside it (init_loc_fn=init_to_value(values={...}) in the guide), else from a smaller "
        "init_scale"
    )
    diverged = (
        "the fit may have diverged, a positive latent's exp underflowing to 0 or a value pushed "
        "out of the support; look for a loss that grew and for the optimizer's warnings before "
        "this error (sigma pinned at sigma_max, non-finite gradients or updates), and take "
        "smaller steps (a smaller lr, or QNVB's trust_region)"
    )
    head = f"{head}; check the model's support and parameters"
    if after_steps is None:
        return (
            f"{head}. At the guide's start: {start}. After steps of an optimizer (the guide has "
            f"moved): {diverged}"
        )
    if after_steps:
        return f"{head}. The guide has moved from its start by steps of an optimizer: {diverged}"
    return f"{head}. This is the guide's start, before any step: {start}"


def tensors_in(*objects):
    """The tensors among ``objects``, in order: tensors, the parameters and buffers of
    ``torch.nn.Module`` s, and those inside lists, tuples and dicts (a model's arguments)."""
    pending = list(reversed(objects))
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, torch.nn.Module):
            pending.extend(reversed([*item.parameters(), *item.buffers()]))
        elif isinstance(item, list | tuple):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))


def cuda_devices(*objects) -> list[int]:
    """The indices of the CUDA devices that hold the tensors among ``objects`` (`tensors_in`).
    Empty on a machine without CUDA: what ``torch.random.fork_rng(devices=...)`` takes to fork
    the random states a model's run draws from, the CPU's and those of the devices its tensors
    live on."""
    return sorted({t.device.index for t in tensors_in(*objects) if t.device.type == "cuda"})


@dataclass(frozen=True)
class RandomState:
    """torch's random state: the CPU's, and that of each CUDA device in ``cuda`` (index ->
    state), which ``torch.get_rng_state`` leaves out.

    Args:
        cpu: ``torch.get_rng_state()``.
        cuda: ``torch.cuda.get_rng_state(index)`` for each device index.
    """

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]

    @classmethod
    def get(cls, devices: Sequence[int] = ()) -> RandomState:
        """The current states of the CPU and of the CUDA ``devices`` (`cuda_devices`)."""
        return cls(torch.get_rng_state(), {i: torch.cuda.get_rng_state(i) for i in devices})

    def restore(self) -> None:
        """Set the states back, the CPU's and each CUDA device's."""
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda.items():
            torch.cuda.set_rng_state(state, index)


def name_the_invalid_initial_site(
    guide, args, kwargs, error: ValueError, rng_state: RandomState
) -> None:
    """Name the site behind ``error``, which Pyro's validation raised while an AutoGuide set
    itself up: its set-up runs the model at the values of its ``init_loc_fn`` (``guide.model``,
    Pyro's ``InitMessenger`` on the model), drawn from ``rng_state`` (the CPU's and the model's
    CUDA devices'). The same run, from the same
    state, without validation, shows the site (`_name_the_invalid_site`)."""
    initialized = getattr(guide, "model", None)
    if initialized is None:
        return
    from ..guides.interface import unwrap_guide  # (guides import this module)

    # a model that knows its likely cause offers it (BayesianModule.invalid_start_hint)
    hint = getattr(unwrap_guide(initialized), "invalid_start_hint", None)
    blocked = poutine.block(initialized, hide_types=["param"])
    with torch.random.fork_rng(devices=list(rng_state.cuda)):
        rng_state.restore()
        where = "the guide's initial values (from its init_loc_fn)"
        _name_the_invalid_site(
            blocked, args, kwargs, error, lambda: where, hint=hint, steps=False, after_steps=False
        )


def _name_the_invalid_site(
    model,
    args,
    kwargs,
    error: ValueError,
    where: Callable[[], str],
    locate: Callable[[torch.Tensor], str] | None = None,
    hint: Callable[[Trace], str | None] | None = None,
    steps: bool = True,
    after_steps: bool | None = None,
) -> None:
    """Raise a ValueError naming the site whose argument validation raised ``error``, if found.

    Pyro validates a distribution's parameters and observed value where the model builds them
    (``pyro.factor("f", nan)`` raises before the site exists); a run without validation reaches
    the site, and its log density shows which one it is. ``locate`` names the point from the
    site's mask of non-finite entries (a pass over several points), else ``where()`` is the place
    (written only here, on an error: it reads the point back from its device). ``hint``, the
    model's own, reads the run's trace and may name the likely cause and its fix; for an
    observed site or a factor, NaN or an infinity in the model's inputs comes before it
    (`_nonfinite_input`, as in `LogJoint._overflow`); else a value
    that overflowed is named (`_overflow_in`; a latent's only where ``steps`` of an optimizer
    reached the point, not at a guide's initial values). ``after_steps``: `_not_finite`'s.
    """
    with pyro.validation_enabled(False), torch.no_grad():
        try:
            trace = poutine.trace(model).get_trace(*args, **kwargs)
        except Exception:
            return
    for node in trace.nodes.values():
        if node["type"] != "sample" or site_is_subsample(node):
            continue
        log_prob = node["fn"].log_prob(node["value"])
        bad = ~torch.isfinite(log_prob)
        if bad.any():
            value = log_prob[bad].reshape(-1)[0].item()
            at = where() if locate is None else locate(bad)
            inputs = _nonfinite_input(model, args, kwargs) if node["is_observed"] else None
            hinted = None if hint is None or inputs else hint(trace)
            overflow = inputs or (None if hinted else _overflow_in(trace, node, steps))
            why = _not_finite(node, value, at, hinted, overflow=overflow, after_steps=after_steps)
            raise ValueError(f"{why}. ({first_line(error)})") from None


def _per_particle(
    name: str,
    log_prob: torch.Tensor,
    K: int,
    mpn: int,
    cause: Callable[[], str | None] | None = None,
) -> torch.Tensor:
    """Sum a site's log density over every dim but the particle dim ``-(mpn + 1)``, left of the
    model's ``mpn`` plates; shape ``(K,)``.

    Raises:
        BatchMismatch: where the log density has dims left of the particle dim: the model put a
            value onto a dim outside of its plates (``w.unsqueeze(-2)`` on a latent ``w`` that
            the pass holds as ``(K, 1, d)``, or a vector latent read inside a plate: ``cause``
            names it, if it is that), so the particle dim is not where the sum reads it and the
            sum would mix the points.
    """
    particle_dims = mpn + 1
    if log_prob.dim() > particle_dims:
        head = (
            f"site {name!r}: its log density in the vectorized pass has shape "
            f"{tuple(log_prob.shape)}, {log_prob.dim() - particle_dims} dim(s) left of the "
            f"quadrature points' dim {-particle_dims} (left of max_plate_nesting={mpn} plates), "
            "so the points do not line up at one dim"
        )
        loop = (
            "vectorize=False (a loop over the points) or vectorize=None (try the pass, fall back "
            "to the loop)"
        )
        added = (
            "the model adds a dim to a latent that the pass holds with batch dims (e.g. "
            "w.unsqueeze(-2) on a w of shape (K, 1, d))"
        )
        found = None if cause is None else cause()
        if found is not None:  # (a guess by sizes: the other cause is named too)
            raise BatchMismatch(
                f"{head}. Either {found}; or {added}: broadcast from the right ((X * w).sum(-1)). "
                f"Or pass {loop}"
            )
        raise BatchMismatch(
            f"{head}: {added}. Pass {loop}, or broadcast from the right ((X * w).sum(-1))"
        )
    return _sum_but_particles(log_prob, K, particle_dims)


def _sum_but_particles(log_prob: torch.Tensor, K: int, particle_dims: int) -> torch.Tensor:
    """Sum over every dim but the particle dim ``-particle_dims``; shape ``(K,)``."""
    if log_prob.dim() < particle_dims or log_prob.shape[-particle_dims] == 1:
        return log_prob.sum().expand(K)
    moved = log_prob.movedim(-particle_dims, 0)
    return moved.reshape(K, -1).sum(-1)


def _in_plate(fn: Callable, size: int, dim: int, device: torch.device) -> Callable:
    @functools.wraps(fn)  # (the model's signature names its arguments in messages)
    def wrapped(*args, **kwargs):
        with pyro.plate(_NODE_PLATE, size, dim=dim, device=device):
            return fn(*args, **kwargs)

    return wrapped
