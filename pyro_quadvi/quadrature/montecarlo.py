"""Monte Carlo baselines: plain, mean-matched (VRMC-1) and mean-and-variance-matched (VRMC-2).

rasp paper, Section 4: VRMC-1 translates the samples so that their mean is exactly ``mu``;
VRMC-2 also scales them so that their per-coordinate variance is exactly ``sigma^2``.

Each node is drawn from its own generator on the rule's device, seeded from one number drawn
from the caller's generator, so node ``k`` can be regenerated alone (on CUDA the numbers differ
from the CPU's: another generator; on ``meta`` nothing is drawn). VRMC needs the sample mean
(and spread) of all ``K`` draws: they are accumulated once per quadrature, at the first node
asked for, streaming over the nodes, in O(dim) memory.

The draws, their mean and spread, and the standardized nodes are computed in float64 whatever the
dtype asked for, and only the node is rounded to it: standardized in float16 or bfloat16, nearly
equal draws cancelled (a ``vrmc2`` second moment off by 0.37 in bfloat16 at ``K = 3``; at
``K = 2`` coordinates with both nodes at 0, where ``+-1`` are exact), and float32 lost ``1e-4`` at
``dim = 1e7``. So one generator state gives the same nodes in every dtype, up to that rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import DEFAULT_MAX_BYTES, NodeSet, QuadratureRule, check_num_points, equal_weights

__all__ = ["MonteCarloRule"]

_MODES = {"mc": 0, "vrmc1": 1, "vrmc2": 2}

_WORK_DTYPE = torch.float64
"""The dtype of the draws, their moments and the standardization; nodes are rounded from it."""


class _MonteCarloNodes(NodeSet):
    def __init__(self, dim: int, seed: int, moments: int, weights: torch.Tensor, **limits: Any):
        super().__init__(dim, weights, **limits)
        self.seed = seed
        self.moments = moments
        self.shift = None
        self.scale = None
        self._matched = moments == 0  # VRMC's moments are taken at the first node asked for

    def _match_moments(self) -> None:
        """VRMC's sample mean (and spread) of the ``K`` draws, once, streaming over the nodes:
        at the first node asked for, so that ``matrix()`` refuses a matrix over ``max_bytes``
        before this ``O(K dim)`` pass (it took seconds at ``dim = 1e8``). Marked done only once
        both are set: an error on the way leaves it to be done again."""
        # Welford's streaming update: numerically stable even when the K draws of a coordinate
        # nearly coincide (the textbook E[z^2] - E[z]^2 cancels to zero there).
        mean = torch.zeros(self.dim, dtype=_WORK_DTYPE, device=self.device)
        sum_sq = torch.zeros_like(mean) if self.moments == 2 else None
        for k in range(len(self)):
            z = self._raw(k)
            delta = z - mean
            mean.add_(delta, alpha=1.0 / (k + 1))
            if self.moments == 2:
                sum_sq.addcmul_(delta, z.sub_(mean))
        if self.moments == 2:
            scale = (sum_sq / len(self)).sqrt_()
            # All K float64 draws equal (vanishingly rare: 53-bit draws): the centred offsets
            # are exactly zero there; divide by 1 rather than produce 0 / 0.
            self.scale = scale.masked_fill_(scale == 0, 1.0)
        self.shift = mean
        self._matched = True

    def _raw(self, k: int) -> torch.Tensor:
        if self.device.type == "meta":  # shapes only; torch has no generator on meta
            return torch.empty(self.dim, dtype=_WORK_DTYPE, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.seed + k)
        return torch.randn(self.dim, generator=generator, dtype=_WORK_DTYPE, device=self.device)

    def node(self, k: int) -> torch.Tensor:
        k = self._check_index(k)
        if not self._matched:
            self._match_moments()
        z = self._raw(k)
        if self.shift is not None:
            z.sub_(self.shift)
        if self.scale is not None:
            z.div_(self.scale)
        return z.to(self.dtype)


class MonteCarloRule(QuadratureRule):
    """Monte Carlo with ``K = num_points`` standard normal draws of equal weight.

    Args:
        num_points: number of draws ``K`` (``>= 1``; ``>= 2`` for ``vrmc1`` and ``vrmc2``).
        moments: 0 for plain Monte Carlo (``mc``), 1 to match the mean (``vrmc1``: univariate
            linear functions exact), 2 to match mean and variance (``vrmc2``: univariate quadratics
            exact).
        max_bytes: the largest node matrix (``K * dim * itemsize`` bytes) the rule builds.

    One draw (``mc`` with ``num_points=1``) integrates without bias but cannot fit a scale
    (`check_sees_curvature`).
    """

    is_random = True

    def __init__(self, num_points: int, moments: int = 0, max_bytes: int = DEFAULT_MAX_BYTES):
        if moments not in (0, 1, 2):
            raise ValueError(f"moments must be 0, 1 or 2, got {moments}")
        name = {v: k for k, v in _MODES.items()}[moments]
        least = 1 if moments == 0 else 2
        num_points = check_num_points(num_points)
        if num_points < least:
            raise ValueError(f"{name} needs num_points >= {least}, got {num_points}")
        self.moments = moments
        self.exact_coordinate_quadratics = moments == 2
        self.name = name
        super().__init__(num_points, max_bytes=max_bytes)

    def draw(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NodeSet:
        dim, step, dtype = self.check_draw(dim, step, generator, dtype, device)
        seed_device = generator.device if generator is not None else None
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=seed_device).item())
        weights = equal_weights(self.num_points, dtype, device)
        return _MonteCarloNodes(
            dim, seed, self.moments, weights, name=self.name, max_bytes=self.max_bytes
        )

    def __repr__(self) -> str:
        return f"MonteCarloRule(num_points={self.num_points}, moments={self.moments})"
