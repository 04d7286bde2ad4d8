"""``AutoSpikeSlab``: a spike-and-slab (Dirac-Gauss) mean field over the model's latents.

Per unconstrained coordinate ``theta_i`` (sequence paper, Section 4.3, eq. 4.1; the sparse-VI
paper's variational family ``q``)

    q(theta_i) = q(z_i) delta_0(theta_i) + q(not z_i) N(theta_i | nu_i, tau_i^2),

kept as three parameters: the slab mean ``nu`` (``locs``), the slab scale ``tau`` (``scales``,
through a softplus as in the sparse-VI paper's Algorithm 1) and the logit of a zero
``zeta = log(q(z) / q(not z))`` (``logits``). Its moments (eq. 4.2),

    mean = q(not z) nu,    variance = q(z) q(not z) nu^2 + q(not z) tau^2,

are where `QuadratureELBO` places its nodes; its exact draws feed
``Predictive``; `GumbelSpikeSlabELBO` relaxes its Bernoulli choice.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from operator import attrgetter

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.infer.autoguide.utils import deep_setattr
from pyro.nn import PyroModule, PyroParam
from pyro.poutine import Trace
from torch.distributions import biject_to, constraints, transform_to

from ..distributions import GuideDelta, SpikeSlab
from ..infer.log_joint import LatentSite, look_through
from .adapters import _leaf, _select, check_draws_traced, check_set_up, gaussian_block, site_run
from .interface import GuideDescription, MeanFieldSite, no_point_mass_message, unwrap_guide
from .mean_field import AutoMeanFieldNormal, check_probabilities, read_from_store

__all__ = ["AutoSpikeSlab"]


class AutoSpikeSlab(AutoMeanFieldNormal):
    """A Dirac-Gauss mean field over the unconstrained latents: ``(nu, tau, zeta)`` per coordinate.

    Built on Pyro's `AutoNormal` (plates, subsampled local latents,
    ``PyroModule`` models, ``create_plates``), with the Gaussian replaced by the mixture of
    `SpikeSlab`: a draw is exactly zero with probability
    ``q(z)``. The point mass sits at zero of the *unconstrained* space, i.e. at
    ``biject_to(support)(0)`` of a constrained site (1 for a positive one); spike-and-slab
    models put it on real-valued sites. A constrained site (a learned noise scale), which cannot
    carry a `SpikeSlab` prior, gets AutoNormal's Gaussian
    factor (family ``"gaussian"``); a real-valued site whose prior has no point mass at zero is
    refused when the guide is set up (its KL would be infinite), naming the layer that declared
    the prior under a `BayesianModule`.

    Like `AutoMeanFieldNormal` it remembers the rows and minibatch
    scale of its last run for `quadrature_description`, whose family is ``"dirac_gauss"``.

    Args:
        model: a Pyro model with continuous latent sites.
        init_loc_fn: initial slab means (constrained), as in Pyro; the sparse-VI paper draws them
            uniformly in ``(-0.6, 0.6)``: ``init_to_uniform(radius=0.6)``.
        init_scale: the initial slab scale ``tau``.
        init_inclusion: the initial probability of a nonzero, ``q(not z)``, in ``(0, 1)`` (a
            number or a 0-d tensor).
        create_plates: as in Pyro's AutoGuides, to subsample local latents.
    """

    def __init__(
        self,
        model: Callable,
        *,
        init_loc_fn: Callable = init_to_feasible,
        init_scale: float = 0.1,
        init_inclusion: float = 0.99,
        create_plates: Callable | None = None,
    ):
        if isinstance(init_inclusion, torch.Tensor) and init_inclusion.dim() == 0:
            init_inclusion = init_inclusion.item()
        if (
            isinstance(init_inclusion, bool)
            or not isinstance(init_inclusion, numbers.Real)
            or not 0.0 < init_inclusion < 1.0
        ):
            raise ValueError(
                "init_inclusion must be a float in (0, 1) (or a 0-d tensor), the initial "
                f"probability of a nonzero; got {init_inclusion!r}"
            )
        self._init_inclusion = float(init_inclusion)
        self._gaussian_sites: set[str] = set()
        super().__init__(
            model, init_loc_fn=init_loc_fn, init_scale=init_scale, create_plates=create_plates
        )

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        self.logits = PyroModule()
        zero_logit = math.log((1.0 - self._init_inclusion) / self._init_inclusion)
        self._gaussian_sites = set()
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            if not isinstance(look_through(site["fn"]), SpikeSlab):
                if _is_real(site["fn"].support):
                    raise ValueError(self._no_point_mass_message(name, site["fn"]))
                # a constrained site (a learned noise scale) cannot carry a SpikeSlab prior,
                # whose support is the real line: it gets AutoNormal's Gaussian factor
                self._gaussian_sites.add(name)
                continue
            loc = attrgetter(name)(self.locs)
            init = torch.full_like(loc.detach(), zero_logit)
            deep_setattr(
                self.logits, name, PyroParam(init, constraints.real, self._event_dims[name])
            )

    def _no_point_mass_message(self, name: str, prior) -> str:
        """Why a real-valued site whose prior has no point mass at zero cannot be fit, and, for a
        `BayesianModule` whose layer declared that prior, the way out."""
        message = no_point_mass_message(name, prior, "(AutoSpikeSlab)")
        model = unwrap_guide(self.model)  # through Pyro's InitMessenger wrap
        if not isinstance(model, torch.nn.Module):
            return message
        network_prior = getattr(model, "prior", None)
        path, _, local = name.rpartition(".")
        layer = dict(model.named_modules()).get(f"net.{path}" if path else "net")
        declare = getattr(layer, "bayesian_parameters", None)
        if not (callable(network_prior) and callable(declare) and local in declare()):
            return message
        param = dict(layer.named_parameters(recurse=False))[local]
        if isinstance(look_through(network_prior(name, param)), SpikeSlab):
            message += (
                f". The prior of {name!r} is the one its layer, the {type(layer).__name__} at "
                f"{path!r}, declares in bayesian_parameters(), not the network's spike-and-slab "
                "prior: to give every weight the network's prior, build the BayesianModule with "
                f"declarations=False and hide={tuple(getattr(model, 'hide', ()))!r} (the "
                "parameters the layers "
                "declare deterministic)"
            )
        return message

    def _get_mixture(self, name: str) -> SpikeSlab | dist.Normal:
        """The site's factor at its current parameters (rows of the enclosing subsampled plates):
        a Gaussian for a site of `_gaussian_sites`."""
        loc, scale = self._get_loc_and_scale(name)
        if name in self._gaussian_sites:
            return dist.Normal(loc, scale)
        logit = attrgetter(name)(self.logits)
        return SpikeSlab(zero_logits=logit, slab_scale=scale, slab_loc=loc, validate_args=False)

    def _draw(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Draw every latent site from its spike-and-slab factor (exactly: zeros are zeros)."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            transform = biject_to(site["fn"].support)
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                unconstrained = pyro.sample(
                    name + "_unconstrained",
                    self._get_mixture(name).to_event(self._event_dims[name]),
                    infer={"is_auxiliary": True},
                )
                value = transform(unconstrained)
                if poutine.get_mask() is False:
                    log_density = 0.0
                else:
                    log_density = transform.inv.log_abs_det_jacobian(value, unconstrained)
                    log_density = sum_rightmost(
                        log_density, log_density.dim() - value.dim() + site["fn"].event_dim
                    )
                delta = GuideDelta(value, log_density=log_density, event_dim=site["fn"].event_dim)
                result[name] = pyro.sample(name, delta)
        return result

    # -- summaries ---------------------------------------------------------------------------------

    @read_from_store
    @torch.no_grad()
    def quantiles(
        self, quantiles: Sequence[float] | torch.Tensor, *args, **kwargs
    ) -> dict[str, torch.Tensor]:
        """Exact quantiles of each site's mixture (`SpikeSlab.icdf`), constrained.

        Args:
            quantiles: probabilities in ``[0, 1]``; the result has a leading dim of their number.
        """
        check_set_up(self)
        check_probabilities(quantiles)
        results = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            mixture = self._full_mixture(name)
            probs = torch.as_tensor(quantiles, dtype=mixture.mean.dtype)
            probs = probs.reshape((-1,) + (1,) * mixture.mean.dim())
            results[name] = biject_to(site["fn"].support)(mixture.icdf(probs))
        return results

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Each site's exact median: 0 wherever the point mass covers the middle of the mixture."""
        return {name: value[0] for name, value in self.quantiles([0.5]).items()}

    def _full_mixture(
        self, name: str, rows: dict[int, torch.Tensor] | None = None
    ) -> SpikeSlab | dist.Normal:
        """The site's factor over all rows, or over ``rows`` of its subsampled plates."""
        loc = _leaf(self.locs, name)[0]
        scale_leaf, scale_constraint, _ = _leaf(self.scales, name)
        if name in self._gaussian_sites:
            return dist.Normal(loc, transform_to(scale_constraint)(scale_leaf))
        logit = _leaf(self.logits, name)[0]
        return SpikeSlab(
            zero_logits=_select(logit, rows),
            slab_scale=_select(transform_to(scale_constraint)(scale_leaf), rows),
            slab_loc=_select(loc, rows),
            validate_args=False,
        )

    @read_from_store
    @torch.no_grad()
    def inclusion_probs(self) -> dict[str, torch.Tensor]:
        """Per spike-and-slab site, ``q(not z)``: the probability that each coordinate is nonzero
        (a Gaussian site, see `_gaussian_sites`, is never zero and not listed)."""
        check_set_up(self)
        return {
            name: self._full_mixture(name).inclusion
            for name in self._event_dims
            if name not in self._gaussian_sites
        }

    @torch.no_grad()
    def sparsity(self) -> float:
        """The fraction of all coordinates expected to be zero: ``mean_i q(z_i)``."""
        probs = torch.cat([p.reshape(-1) for p in self.inclusion_probs().values()])
        return float(1.0 - probs.mean()) if probs.numel() else 0.0

    @read_from_store
    @torch.no_grad()
    def sparse_point_estimate(self, threshold: float = 0.5) -> dict[str, torch.Tensor]:
        """Per site, the realized sparse point estimate (constrained): the slab mean ``nu`` where
        the inclusion probability exceeds ``threshold``, exactly zero (unconstrained) elsewhere.

        ``nu`` is the value a kept coordinate takes on average (``E[theta | theta != 0]``), the
        natural weight of the network the sparse-VI paper reads off its fit; 0.5 keeps every
        coordinate more likely nonzero than zero (the median model).

        Raises:
            ValueError: for a threshold outside ``[0, 1)``.
        """
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must lie in [0, 1), got {threshold!r}")
        check_set_up(self)
        estimate = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            mixture = self._full_mixture(name)
            if name in self._gaussian_sites:
                estimate[name] = biject_to(site["fn"].support)(mixture.loc)
                continue
            kept = mixture.inclusion > threshold
            value = torch.where(kept, mixture.slab_loc, torch.zeros_like(mixture.slab_loc))
            estimate[name] = biject_to(site["fn"].support)(value)
        return estimate

    # -- the package's guide interface -------------------------------------------------------------

    def quadrature_description(self, trace: Trace | None = None) -> GuideDescription:
        """The guide's ``"dirac_gauss"`` sites: nodes at each mixture's mean and standard deviation
        (eq. 4.2), of the run in ``trace`` or else of the current parameters at the last run's rows.

        Raises:
            RuntimeError: if the guide has not been run yet.
        """
        check_set_up(self)
        check_draws_traced(self, trace)
        sites, latent = [], []
        for name, proto in self.prototype_trace.iter_stochastic_nodes():
            if name in self._gaussian_sites:  # AutoNormal's "gaussian" block
                site, latent_site = gaussian_block(self, name, proto, trace, self._last_run)
                sites.append(site)
                latent.append(latent_site)
                continue
            loc_leaf, _, loc_name = _leaf(self.locs, name)
            scale_leaf, scale_constraint, scale_name = _leaf(self.scales, name)
            event_dim = self._event_dims[name]
            mixture, factor, rows, mask = site_run(name, event_dim, trace, self._last_run)
            if mixture is None:
                mixture = self._full_mixture(name, rows)
            transform = biject_to(proto["fn"].support)
            logit_leaf, _, logit_name = _leaf(self.logits, name)
            sites.append(
                MeanFieldSite(
                    name=name,
                    family="dirac_gauss",
                    loc=mixture.mean,
                    scale=_std(mixture),
                    params={"loc": loc_leaf, "scale": scale_leaf, "logit": logit_leaf},
                    param_constraints={
                        "loc": constraints.real,
                        "scale": scale_constraint,
                        "logit": constraints.real,
                    },
                    param_names={"loc": loc_name, "scale": scale_name, "logit": logit_name},
                    transform=transform,
                    event_dim=event_dim,
                    scale_factor=factor,
                    rows=rows,
                    constraint=proto["fn"].support,
                    mask=mask,
                    values={
                        "loc": mixture.slab_loc,
                        "scale": mixture.slab_scale,
                        "logit": mixture.zero_logits,
                    },
                )
            )
            latent.append(LatentSite(name, mixture.slab_loc.shape, event_dim, transform))
        return GuideDescription(self._pyro_name, latent, sites=sites)


def _is_real(support) -> bool:
    """Whether a site's support is the real line (``to_event`` included)."""
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def _std(mixture: SpikeSlab) -> torch.Tensor:
    """The mixture's standard deviation (eq. 4.2), its variance floored at the dtype's smallest
    normal number: a variance that underflows to 0 (a zero logit above ~104 in float32) would
    give ``sqrt`` an infinite derivative, and the loss NaN gradients."""
    variance = mixture.variance
    return variance.clamp_min(torch.finfo(variance.dtype).tiny).sqrt()
