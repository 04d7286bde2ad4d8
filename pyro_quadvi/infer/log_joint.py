"""The model's log joint density at points of the unconstrained latent space.

Both the quadrature ELBO and the OPQA evidence evaluate

    log p(x, T(z)) + log |det dT/dz|

at a batch of flat unconstrained points ``z`` of shape ``(K, dim)``: the latent sites laid end to
end, each pushed through ``T = biject_to(support)``. :class:`LogJoint` does this either in one pass
of the model under a particle plate (``vectorize=True``) or node by node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.distributions.transforms import Transform
from pyro.distributions.util import sum_rightmost
from pyro.poutine import Trace
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to

__all__ = ["LatentSite", "LogJoint", "latent_sites_of_model", "model_max_plate_nesting"]

_NODE_PLATE = "_quadvi_nodes"


@dataclass(frozen=True)
class LatentSite:
    """A latent site laid out in the flat unconstrained vector.

    Attributes:
        name: the model's sample site.
        shape: its unconstrained shape in one run of the model (batch + event).
        event_dim: number of rightmost dims of ``shape`` that are event dims.
        transform: ``biject_to(support)``, unconstrained to constrained.
    """

    name: str
    shape: torch.Size
    event_dim: int
    transform: Transform

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def check_latent_site(site: dict) -> None:
    """Refuse what quadrature cannot integrate: discrete or enumerated latents, no rsample."""
    name = site["name"]
    if site["infer"].get("enumerate"):
        raise ValueError(
            f"latent site {name!r} is marked for enumeration; quadrature integrates continuous "
            "latents only: marginalize it out in the model or use TraceEnum_ELBO"
        )
    if site["fn"].support.is_discrete:
        raise ValueError(
            f"latent site {name!r} is discrete ({type(site['fn']).__name__}); quadrature "
            "integrates continuous latents only: marginalize it out in the model"
        )
    if not site["fn"].has_rsample:
        raise ValueError(
            f"latent site {name!r} ({type(site['fn']).__name__}) has no reparameterized sampler "
            "(rsample); quadrature needs continuous, reparameterizable latents"
        )


def latent_sites_of_model(model: Callable, *args, **kwargs) -> list[LatentSite]:
    """The continuous latent sites of one run of ``model``, in order, in unconstrained space."""
    trace = poutine.trace(poutine.block(model, hide_types=["param"])).get_trace(*args, **kwargs)
    sites = []
    for name, site in latent_nodes(trace):
        check_latent_site(site)
        transform = biject_to(site["fn"].support)
        unconstrained = transform.inv(site["value"].detach())
        event_dim = site["fn"].event_dim + unconstrained.dim() - site["value"].dim()
        sites.append(LatentSite(name, unconstrained.shape, event_dim, transform))
    return sites


def latent_nodes(trace: Trace):
    """The unobserved sample sites of a trace, without plates' subsample sites."""
    for name, site in trace.iter_stochastic_nodes():
        if not site_is_subsample(site):
            yield name, site


def model_max_plate_nesting(trace: Trace) -> int:
    """The deepest vectorized plate of a trace (0 without plates)."""
    dims = [
        -frame.dim
        for site in trace.nodes.values()
        if site["type"] == "sample"
        for frame in site["cond_indep_stack"]
        if frame.vectorized
    ]
    return max(dims, default=0)


class LogJoint:
    """Evaluates ``log p(x, T(z)) + log|J_T(z)|`` at flat unconstrained points ``z``.

    Args:
        model: the Pyro model.
        sites: the latent sites, in the order they are laid out in ``z``.
        max_plate_nesting: plates the model nests (the node plate goes left of them); ``None``
            finds it from a first, looped run of the model.
    """

    def __init__(
        self,
        model: Callable,
        sites: Sequence[LatentSite],
        max_plate_nesting: int | None = None,
    ):
        self.model = model
        self.sites = list(sites)
        self.dim = sum(site.numel for site in self.sites)
        self.max_plate_nesting = max_plate_nesting

    def split(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cut flat points ``(..., dim)`` into per-site tensors ``(..., *site.shape)``."""
        if z.shape[-1] != self.dim:
            raise ValueError(
                f"expected points with {self.dim} unconstrained coordinates "
                f"({', '.join(s.name for s in self.sites)}), got shape {tuple(z.shape)}"
            )
        values, start = {}, 0
        for site in self.sites:
            chunk = z[..., start : start + site.numel]
            values[site.name] = chunk.reshape(z.shape[:-1] + site.shape)
            start += site.numel
        return values

    def __call__(
        self,
        z: torch.Tensor,
        args: tuple = (),
        kwargs: dict | None = None,
        replay_trace: Trace | None = None,
        vectorize: bool = True,
    ) -> torch.Tensor:
        """Log joint plus log-Jacobian at each of the ``K`` points ``z`` (shape ``(K, dim)``).

        ``replay_trace`` supplies the subsample indices of the model's plates (the guide's trace).
        Site scales (minibatch factors) apply to the log density and to the Jacobian alike.

        Raises:
            ValueError: naming the node and the site where the log density is not finite, or a
                latent site the points do not cover.
        """
        kwargs = kwargs or {}
        unconstrained = self.split(z)
        if self.max_plate_nesting is None:
            self.max_plate_nesting = self._find_plate_nesting(
                unconstrained, args, kwargs, replay_trace
            )
        if vectorize:
            terms = self._vectorized(unconstrained, z.shape[0], args, kwargs, replay_trace)
        else:
            rows = []
            for k in range(z.shape[0]):
                values = {name: value[k] for name, value in unconstrained.items()}
                rows.append(self._single(values, args, kwargs, replay_trace))
            terms = {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
        for name, term in terms.items():
            bad = ~torch.isfinite(term)
            if bad.any():
                k = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"the log density of site {name!r} is not finite ({term[k].item()}) at "
                    f"quadrature node {k}; check the model's support and parameters, or start "
                    "the guide from a smaller init_scale"
                )
        return sum(terms.values())

    def _find_plate_nesting(self, unconstrained, args, kwargs, replay_trace) -> int:
        constrained, _ = self._constrain({name: value[0] for name, value in unconstrained.items()})
        trace = self._trace(constrained, args, kwargs, replay_trace)
        return model_max_plate_nesting(trace)

    def _trace(self, values, args, kwargs, replay_trace, particles: int | None = None) -> Trace:
        conditioned = Trace()
        if replay_trace is not None:
            for name, node in replay_trace.nodes.items():
                if node["type"] == "sample" and site_is_subsample(node):
                    conditioned.add_node(name, **node)
        for name, value in values.items():
            conditioned.add_node(
                name, type="sample", name=name, value=value, is_observed=False, infer={}
            )
        model = poutine.replay(self.model, trace=conditioned)
        if particles is not None:
            plate_dim = -self.max_plate_nesting - 1
            model = _in_plate(model, particles, plate_dim)
        trace = poutine.trace(model).get_trace(*args, **kwargs)
        for name, site in latent_nodes(trace):
            if name not in values:
                check_latent_site(site)
                raise ValueError(
                    f"latent site {name!r} of the model is not covered by the guide; "
                    "every continuous latent needs a (loc, scale) in the guide"
                )
        return trace

    def _constrain(self, values: dict[str, torch.Tensor]):
        """Constrained values and the (unscaled) log-Jacobian of each site."""
        constrained, log_jac = {}, {}
        for site in self.sites:
            z = values[site.name]
            theta = site.transform(z)
            ladj = site.transform.log_abs_det_jacobian(z, theta)
            ladj = sum_rightmost(ladj, ladj.dim() - (z.dim() - site.event_dim))
            constrained[site.name] = theta
            log_jac[site.name] = ladj
        return constrained, log_jac

    def _single(self, values, args, kwargs, replay_trace) -> dict[str, torch.Tensor]:
        constrained, log_jac = self._constrain(values)
        trace = self._trace(constrained, args, kwargs, replay_trace)
        trace.compute_log_prob()
        terms = {}
        for name, site in trace.nodes.items():
            if site["type"] == "sample" and "log_prob_sum" in site:
                terms[name] = site["log_prob_sum"]
        for name, ladj in log_jac.items():
            scale = trace.nodes[name]["scale"]
            terms[name] = terms[name] + (scale * ladj).sum()
        return terms

    def _vectorized(self, unconstrained, K, args, kwargs, replay_trace) -> dict[str, torch.Tensor]:
        mpn = self.max_plate_nesting
        padded = {}
        for site in self.sites:
            value = unconstrained[site.name]  # (K, *shape)
            batch = len(site.shape) - site.event_dim
            pad = mpn - batch
            if pad < 0:
                raise ValueError(
                    f"site {site.name!r} has {batch} batch dims but max_plate_nesting={mpn}"
                )
            padded[site.name] = value.reshape((K,) + (1,) * pad + site.shape)
        constrained, log_jac = self._constrain(padded)
        trace = self._trace(constrained, args, kwargs, replay_trace, particles=K)
        trace.compute_log_prob()
        terms = {}
        for name, site in trace.nodes.items():
            if site["type"] == "sample" and "log_prob" in site:
                terms[name] = _per_particle(site["log_prob"], K, mpn + 1)
        for name, ladj in log_jac.items():
            scale = trace.nodes[name]["scale"]
            terms[name] = terms[name] + _per_particle(scale * ladj, K, mpn + 1)
        return terms


def _per_particle(log_prob: torch.Tensor, K: int, particle_dims: int) -> torch.Tensor:
    """Sum a log density over every dim but the particle dim ``-particle_dims``; shape ``(K,)``."""
    if log_prob.dim() < particle_dims or log_prob.shape[-particle_dims] == 1:
        return log_prob.sum().expand(K)
    moved = log_prob.movedim(-particle_dims, 0)
    return moved.reshape(K, -1).sum(-1)


def _in_plate(fn: Callable, size: int, dim: int) -> Callable:
    def wrapped(*args, **kwargs):
        with pyro.plate(_NODE_PLATE, size, dim=dim):
            return fn(*args, **kwargs)

    return wrapped
