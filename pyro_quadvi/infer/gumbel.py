"""``GumbelSpikeSlabELBO``: the sparse-VI paper's Monte Carlo estimator for spike-and-slab guides.

The negative ELBO of the sparse-VI paper (Bai, Song and Cheng, eq. 1),

    loss = -(n / m) (1 / K) sum_i sum_k log p(D_i | theta_k) + KL(q || pi),

with ``theta_k = gamma_k * (nu + tau eps_k)`` per coordinate, ``eps_k ~ N(0, 1)`` and the Bernoulli
choice ``gamma ~ Bern(phi)`` relaxed by Gumbel-softmax (its "Implementation" section):

    eta = logit(phi) + log(u / (1 - u)),  u ~ U(0, 1),   gamma~ = sigmoid(eta / temperature).

As in its Algorithm 1 the forward pass uses the hard choice ``gamma = 1[eta > 0]`` (exactly 0 or
1, a Bernoulli(phi) draw) and the backward pass the relaxed one (`straight_through_gate`).
``KL(q || pi)`` between the spike-and-slab guide and a
`SpikeSlab` prior is closed form
(`kl_spike_slab`); the likelihood carries the
minibatch scale ``n / m`` of the model's subsampled plates. Gaussian sites of the same guide (if
any) are reparameterized and keep their analytic entropy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..guides.interface import GuideDescription
from .quadrature_elbo import PointsELBO

__all__ = ["GumbelSpikeSlabELBO", "straight_through_gate"]


def straight_through_gate(
    inclusion_logits: torch.Tensor, temperature: float, u: torch.Tensor
) -> torch.Tensor:
    """A Bernoulli choice with the value of the hard draw and the gradient of its relaxation.

    Args:
        inclusion_logits: ``logit(phi)``, ``phi`` the probability of a one (a nonzero weight).
        temperature: the Gumbel-softmax temperature ``tau > 0``.
        u: uniform draws in ``(0, 1)``, broadcastable against the logits.

    Returns:
        ``hard + (relaxed - relaxed.detach())``: forward exactly ``1[eta > 0]``, i.e. 1 with
        probability ``phi``; gradient that of ``relaxed = sigmoid(eta / temperature)``.
    """
    eta = inclusion_logits + torch.log(u) - torch.log1p(-u)
    relaxed = torch.sigmoid(eta / temperature)
    hard = (eta > 0).to(relaxed.dtype)
    return hard + (relaxed - relaxed.detach())


class GumbelSpikeSlabELBO(PointsELBO):
    """The sparse-VI paper's estimator (its eq. 1 and Algorithm 1) as a Pyro ``ELBO``.

    For `AutoSpikeSlab` (or any guide describing ``"dirac_gauss"``
    sites) over a model whose sites carry `SpikeSlab` priors:

        svi = SVI(model, guide, Adam({"lr": 5e-3}), GumbelSpikeSlabELBO(temperature=0.5))

    Args:
        temperature: the Gumbel-softmax temperature ``tau`` of the relaxed Bernoulli; the paper
            asks only ``tau > 0``; default 0.5.
        num_particles: ``K``, the Monte Carlo draws per step, averaged.
        vectorize: ``True`` evaluates the ``K`` draws in one pass of the model under a particle
            plate, ``False`` one by one, ``None`` tries the pass and falls back once, as
            `QuadratureELBO` does.
        max_plate_nesting: as in Pyro's ELBOs; ``inf`` finds it from a run of the model.
        vectorize_particles: ``True`` is refused (a ``TypeError``): Pyro's
            ``vectorize_particles=True`` is ``vectorize=True`` here; ``False`` changes nothing.

    Draws come from torch's global generator (``pyro.set_rng_seed`` makes runs reproducible).

    Raises:
        ValueError: for a temperature that is not a positive finite number (a bool included),
            or (when run) a site whose prior has no point mass: its KL against a spike is
            infinite (the message names ``SpikeSlab``).
    """

    def __init__(
        self,
        temperature: float = 0.5,
        num_particles: int = 1,
        vectorize: bool | None = None,
        max_plate_nesting: float = float("inf"),
        *,
        vectorize_particles: bool | None = None,
    ):
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not 0 < temperature < math.inf
        ):
            raise ValueError(
                f"temperature must be a positive finite number (not a bool), got {temperature!r}"
            )
        if (
            isinstance(num_particles, bool)
            or not isinstance(num_particles, int)
            or num_particles < 1
        ):
            raise ValueError(
                f"num_particles must be a positive integer (not a bool), got {num_particles!r}"
            )
        super().__init__(
            num_particles, vectorize, max_plate_nesting, vectorize_particles=vectorize_particles
        )
        self.temperature = float(temperature)

    def draw(self, description: GuideDescription) -> torch.Tensor:
        """``K`` points ``(K, dim)``: straight-through spike-and-slab draws of ``"dirac_gauss"``
        sites, reparameterized Gaussian draws of ``"gaussian"`` sites."""
        if description.joint is not None:
            raise TypeError(
                f"GumbelSpikeSlabELBO: {description.guide} is a joint Gaussian ("
                f"{description.joint.family}); use a mean-field guide such as AutoSpikeSlab"
            )
        K = self.num_particles
        pieces = []
        for site in description.sites:
            shape = (K, *site.shape)
            dtype, device = site.loc.dtype, site.loc.device
            eps = torch.randn(shape, dtype=dtype, device=device)
            if site.family == "dirac_gauss":
                tiny = torch.finfo(dtype).tiny
                u = torch.rand(shape, dtype=dtype, device=device).clamp(tiny, 1 - 1e-7)
                values = site.values
                gate = straight_through_gate(-values["logit"], self.temperature, u)
                point = gate * (values["loc"] + values["scale"] * eps)
            else:
                point = site.loc + site.scale * eps
            pieces.append(point.reshape(K, -1))
        return torch.cat(pieces, dim=-1)

    def _gumbel_loss(self, model: Callable, guide: Callable, args, kwargs) -> torch.Tensor:
        guide_trace, description = self._described_run(model, guide, args, kwargs)
        z = self.draw(description)
        log_joint, _ = self._log_joint(model, guide, description, z, args, kwargs, guide_trace)
        loss = -log_joint.mean() - description.entropy_outside_kl()
        if not torch.isfinite(loss):
            raise ValueError(f"GumbelSpikeSlabELBO: the loss is not finite ({loss.item()})")
        return loss

    def loss(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """A draw of the negative ELBO, without gradients."""
        with torch.no_grad():
            return self._gumbel_loss(model, guide, args, kwargs).item()

    def differentiable_loss(
        self, model: Callable, guide: Callable, *args, **kwargs
    ) -> torch.Tensor:
        """A draw of the negative ELBO, differentiable through the straight-through draws."""
        return self._gumbel_loss(model, guide, args, kwargs)

    def loss_and_grads(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """A draw of the negative ELBO; accumulates its gradients."""
        loss = self._gumbel_loss(model, guide, args, kwargs)
        if loss.requires_grad:
            loss.backward()
        return loss.item()

    def __repr__(self) -> str:
        return (
            f"GumbelSpikeSlabELBO(temperature={self.temperature}, "
            f"num_particles={self.num_particles})"
        )
