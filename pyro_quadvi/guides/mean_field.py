"""``AutoMeanFieldNormal``: the Gaussian mean-field AutoGuide of pyro-quadvi."""

from __future__ import annotations

from collections.abc import Callable

from pyro import poutine
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible

from .interface import MeanFieldSite, mean_field_sites_from_trace, register_mean_field_guide

__all__ = ["AutoMeanFieldNormal"]


class AutoMeanFieldNormal(AutoNormal):
    """A Gaussian mean field over the unconstrained latents: one ``(loc, scale)`` pair per site.

    ``q(z) = prod_site N(z_site | loc_site, diag(scale_site^2))`` in Pyro's unconstrained space,
    pushed through ``biject_to(support)`` for constrained sites, exactly like Pyro's
    :class:`~pyro.infer.autoguide.AutoNormal`, from which it inherits ``Predictive`` support,
    ``median()``, ``quantiles()``, plates, subsampling (a local latent's parameters have the full
    plate size and each run uses the rows of its minibatch) and ``PyroModule`` models.

    In addition it implements the :class:`~pyro_quadvi.guides.interface.MeanFieldGuide`
    interface: :meth:`mean_field_sites` reports what its last run used, which the quadrature ELBO
    integrates against and QNVB updates as fixed points of the mean-field problem (rasp paper,
    eq. 4-8).

    Args:
        model: a Pyro model with continuous latent sites.
        init_loc_fn: per-site initialization of the loc (in the constrained space), as in Pyro.
        init_scale: initial standard deviation in the unconstrained space.
        create_plates: as in Pyro's AutoGuides, to subsample local latents.
    """

    def __init__(
        self,
        model: Callable,
        *,
        init_loc_fn: Callable = init_to_feasible,
        init_scale: float = 0.1,
        create_plates: Callable | None = None,
    ):
        super().__init__(
            model, init_loc_fn=init_loc_fn, init_scale=init_scale, create_plates=create_plates
        )
        self._last_trace = None
        register_mean_field_guide(self)

    def forward(self, *args, **kwargs):
        tracer = poutine.trace(super().forward)
        result = tracer(*args, **kwargs)
        self._last_trace = tracer.trace
        return result

    def mean_field_sites(self) -> list[MeanFieldSite]:
        """The :class:`MeanFieldSite` of every latent site, as used in the most recent run.

        Raises:
            RuntimeError: if the guide has not been run yet.
        """
        if self._last_trace is None:
            raise RuntimeError(
                "AutoMeanFieldNormal has not been run yet: call it (or svi.step) with the "
                "model's arguments first"
            )
        return mean_field_sites_from_trace(self, self._last_trace)
