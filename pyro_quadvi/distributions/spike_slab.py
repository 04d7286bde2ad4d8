"""``SpikeSlab``: a point mass at zero and a Gaussian slab, per coordinate.

The Dirac-Gauss mixture of the sequence paper (Section 4.3, eq. 4.1) and of the sparse-VI paper's
prior and variational family,

    p(theta) = (1 - phi) delta_0(theta) + phi N(theta | nu, tau^2),

with ``phi`` the probability of a nonzero (the *inclusion* probability; the sequence paper's
``q(not z)``) and ``zeta = log((1 - phi) / phi)`` the logit of a zero (its ``zeta_i``).

Densities are taken with respect to the sum of Lebesgue measure and a unit point mass at zero,
the measure the sequence paper reaches as its carve-out ``epsilon -> 0`` (eq. 4.3, 4.4): at exactly
``0`` the log density is ``log(1 - phi)``, anywhere else ``log phi + log N(theta | nu, tau^2)``.
Two spike-and-slab distributions compared under this one measure give the closed-form
`kl_spike_slab`, the quantity the sparse-VI paper's estimator (its eq. 1) needs.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from pyro.distributions import TorchDistribution
from torch.distributions import Normal, constraints
from torch.distributions.kl import kl_divergence, register_kl
from torch.distributions.utils import broadcast_all

__all__ = ["SpikeSlab", "kl_normal_spike_slab", "kl_spike_slab"]

_SCALAR = torch.Size()
HALF_LOG_2PI_E = 0.5 * math.log(2 * math.pi * math.e)
"""``H[N(0, 1)] = log(2 pi e) / 2``: the entropy of a standard normal, in nats."""


class SpikeSlab(TorchDistribution):
    """``(1 - inclusion) delta_0 + inclusion N(slab_loc, slab_scale^2)``, elementwise.

    Args:
        inclusion: the probability of a nonzero, in ``(0, 1]`` (the sparse-VI paper's ``lambda``
            for a prior, ``phi`` for a variational factor). Give this or ``zero_logits``.
        slab_scale: the slab's standard deviation (``sigma_0`` of a prior, ``tau`` of eq. 4.1).
        slab_loc: the slab's mean (``nu`` of eq. 4.1); 0 for a prior.
        zero_logits: ``log(P(zero) / P(nonzero))`` instead of ``inclusion`` (the sequence paper's
            ``zeta``): the variational guide's parameter, exact at inclusions near 1.

    ``log_prob`` is with respect to Lebesgue measure plus a unit mass at zero (see the module),
    so ``log_prob(0) = log(1 - inclusion)``. ``sample`` is exact; there is no ``rsample`` (the
    Bernoulli choice has no reparameterization: `GumbelSpikeSlabELBO`
    relaxes it, `QuadratureELBO` integrates the moments of eq. 4.2).
    """

    arg_constraints: ClassVar[dict] = {
        "zero_logits": constraints.real,
        "slab_loc": constraints.real,
        "slab_scale": constraints.positive,
    }
    support = constraints.real
    has_rsample = False

    def __init__(
        self,
        inclusion: torch.Tensor | float | None = None,
        slab_scale: torch.Tensor | float = 1.0,
        slab_loc: torch.Tensor | float = 0.0,
        *,
        zero_logits: torch.Tensor | float | None = None,
        validate_args: bool | None = None,
    ):
        if (inclusion is None) == (zero_logits is None):
            raise ValueError("SpikeSlab: give exactly one of inclusion and zero_logits")
        if inclusion is not None:
            if not torch.is_tensor(inclusion):
                like = next((t for t in (slab_scale, slab_loc) if torch.is_tensor(t)), None)
                dtype = torch.get_default_dtype() if like is None else like.dtype
                device = None if like is None else like.device
                inclusion = torch.tensor(float(inclusion), dtype=dtype, device=device)
            if validate_args is not False and not bool(((inclusion > 0) & (inclusion <= 1)).all()):
                raise ValueError(
                    "SpikeSlab: inclusion must lie in (0, 1] (the probability of a nonzero), got "
                    f"{inclusion if inclusion.numel() < 8 else 'values outside it'}"
                )
            zero_logits = torch.log1p(-inclusion) - torch.log(inclusion)
        self.zero_logits, self.slab_scale, self.slab_loc = broadcast_all(
            zero_logits, slab_scale, slab_loc
        )
        if validate_args is not False and bool((self.zero_logits == math.inf).any()):
            raise ValueError(  # inclusion 0, which `inclusion` refuses too: no slab at all
                "SpikeSlab: zero_logits must be < +inf (an inclusion probability above 0); a "
                "weight that is always zero is not a spike-and-slab factor"
            )
        super().__init__(self.zero_logits.shape, validate_args=validate_args)

    # -- parameters --------------------------------------------------------------------------------

    @property
    def inclusion(self) -> torch.Tensor:
        """``P(theta != 0)``: the sequence paper's ``q(not z)``, the sparse-VI paper's ``phi``."""
        return _sigmoid(-self.zero_logits)

    @property
    def exclusion(self) -> torch.Tensor:
        """``P(theta = 0) = sigmoid(zeta)``: the sequence paper's ``q(z)``, taken from the logit
        itself (not as ``1 - inclusion``, which is exactly 0 in float32 below ``zeta ~ -17`` and
        has no gradient there)."""
        return _sigmoid(self.zero_logits)

    @property
    def log_inclusion(self) -> torch.Tensor:
        """``log P(theta != 0)``, computed from the logits without cancellation."""
        return F.logsigmoid(-self.zero_logits)

    @property
    def log_exclusion(self) -> torch.Tensor:
        """``log P(theta = 0)`` (``-inf`` for inclusion 1)."""
        return F.logsigmoid(self.zero_logits)

    def expand(
        self,
        batch_shape: torch.Size | list[int] | tuple[int, ...],
        _instance: SpikeSlab | None = None,
    ) -> SpikeSlab:
        new = self._get_checked_instance(SpikeSlab, _instance)
        batch_shape = torch.Size(batch_shape)
        new.zero_logits = self.zero_logits.expand(batch_shape)
        new.slab_scale = self.slab_scale.expand(batch_shape)
        new.slab_loc = self.slab_loc.expand(batch_shape)
        super(SpikeSlab, new).__init__(batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def slab(self) -> Normal:
        """The Gaussian component ``N(slab_loc, slab_scale^2)``."""
        return Normal(self.slab_loc, self.slab_scale, validate_args=False)

    # -- moments (sequence paper, eq. 4.2) -----------------------------------------------------

    @property
    def mean(self) -> torch.Tensor:
        """``q(not z) nu`` (eq. 4.2)."""
        return self.inclusion * self.slab_loc

    @property
    def variance(self) -> torch.Tensor:
        """``q(z) q(not z) nu^2 + q(not z) tau^2`` (eq. 4.2)."""
        phi = self.inclusion
        return phi * self.exclusion * self.slab_loc**2 + phi * self.slab_scale**2

    # -- densities -------------------------------------------------------------------------------

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``log(1 - phi)`` at exactly zero, ``log phi + log N(value | nu, tau^2)`` elsewhere."""
        if self._validate_args:
            self._validate_sample(value)
        slab = self.log_inclusion + self.slab().log_prob(value)
        return torch.where(value == 0, self.log_exclusion.expand_as(slab), slab)

    def sample(self, sample_shape: torch.Size = _SCALAR) -> torch.Tensor:
        """Exact draws: a Bernoulli(inclusion) choice times a slab draw.

        The choice compares a float64 uniform with the inclusion probability: a float32 one is a
        multiple of ``2^-24``, so a zeroed weight (``SparseQNVB`` clamps its logit at 30,
        inclusion ``9.4e-14``) came back at ``6e-8`` a draw, 590,000 times too often."""
        shape = self._extended_shape(sample_shape)
        with torch.no_grad():
            keep = torch.rand(shape, dtype=torch.float64, device=self.slab_loc.device)
            keep = keep < self.inclusion.to(torch.float64).expand(shape)
            slab = self.slab().sample(sample_shape)
            return torch.where(keep, slab, torch.zeros_like(slab))

    def cdf(self, value: torch.Tensor) -> torch.Tensor:
        """``(1 - phi) 1[value >= 0] + phi Phi((value - nu) / tau)``."""
        spike = (value >= 0).to(self.slab_loc.dtype)
        return self.exclusion * spike + self.inclusion * self.slab().cdf(value)

    def icdf(self, value: torch.Tensor) -> torch.Tensor:
        """The quantile function, exact: the slab's below and above the jump at zero, 0 on it.

        With ``a = phi Phi(-nu / tau)`` the slab's mass below zero, the ``p``-quantile is
        ``nu + tau Phi^-1(p / phi)`` for ``p < a``, ``0`` for ``a <= p <= a + 1 - phi`` and
        ``nu + tau Phi^-1((p - 1 + phi) / phi)`` above.
        """
        phi, spike = self.inclusion, self.exclusion
        slab = self.slab()
        below = phi * slab.cdf(torch.zeros_like(self.slab_loc))
        p = torch.as_tensor(value, dtype=phi.dtype, device=phi.device)
        lower = slab.icdf((p / phi).clamp(max=1.0))
        upper = slab.icdf(((p - spike) / phi).clamp(min=0.0, max=1.0))
        zero = torch.zeros_like(lower)
        return torch.where(p < below, lower, torch.where(p <= below + spike, zero, upper))

    def entropy(self) -> torch.Tensor:
        """``H(Bernoulli(phi)) + phi H(N(nu, tau^2))``, under the measure of ``log_prob``."""
        phi, spike = self.inclusion, self.exclusion
        bernoulli = -(phi * self.log_inclusion + spike * _where_mass(spike, self.log_exclusion))
        return bernoulli + phi * (HALF_LOG_2PI_E + self.slab_scale.log())


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` whose derivative keeps its relative accuracy in both tails.

    Torch differentiates ``sigmoid`` as ``y (1 - y)``, which is exactly 0 once ``y`` rounds to 1
    (``x > ~17`` in float32); there ``1 - sigmoid(-x)`` has the same value and the derivative
    ``sigmoid(-x) (1 - sigmoid(-x))``, accurate. Each branch is used where its result is ``>= 1/2``
    (resp. ``< 1/2``), so the forward value is as accurate as ``torch.sigmoid``'s.
    """
    return torch.where(x > 0, 1 - torch.sigmoid(-x), torch.sigmoid(x))


def _where_mass(prob: torch.Tensor, log_term: torch.Tensor) -> torch.Tensor:
    """``log_term`` where ``prob > 0``, else 0: the ``0 log 0 = 0`` convention, with the
    masked value chosen before the product so that neither it nor its gradient is NaN."""
    return torch.where(prob > 0, log_term, torch.zeros_like(log_term))


@register_kl(SpikeSlab, SpikeSlab)
def kl_spike_slab(q: SpikeSlab, p: SpikeSlab) -> torch.Tensor:
    """``KL(q || p)`` per coordinate, closed form (the sparse-VI paper's KL term of its eq. 1).

        phi log(phi / lambda) + (1 - phi) log((1 - phi) / (1 - lambda)) + phi KL(slab_q || slab_p)

    with ``phi``, ``lambda`` the inclusion probabilities of ``q`` and ``p``; ``inf`` where ``q``
    puts mass on zero and ``p`` does not (inclusion 1).
    """
    phi, spike = q.inclusion, q.exclusion
    include = phi * (q.log_inclusion - p.log_inclusion)
    exclude = spike * _where_mass(spike, q.log_exclusion - p.log_exclusion)
    return include + exclude + phi * kl_divergence(q.slab(), p.slab())


@register_kl(Normal, SpikeSlab)
def kl_normal_spike_slab(q: Normal, p: SpikeSlab) -> torch.Tensor:
    """``KL(N || p) = -log lambda + KL(N || slab)``: a Gaussian never puts mass on zero."""
    return -p.log_inclusion + kl_divergence(q, p.slab())
