"""Cases for the tests of the flat QNVB update (`qnvb_update_many`): tensor sizes around a vector
and a chunk, hyperparameters that reach every rule's path, moments with every hazard of the
guard, and a small network."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..optim.qnvb_functional import QNVBHyperparameters, init_qnvb_state

__all__ = ["HYPERPARAMETERS", "SIZES", "hazard_moments", "small_net", "update_inputs"]

#: a single coordinate, below and above a vector and a chunk of 64, several chunks, empty tensors
#: first, inside and last
SIZES = [0, 1, 7, 63, 65, 4097, 0, 130, 64, 1, 0]

#: settings that between them take every path of the rules
HYPERPARAMETERS = {
    "default": QNVBHyperparameters(),
    "trust region, significance, beta1, window": QNVBHyperparameters(
        lr=0.3, betas=(0.9, 0.99), significance=1.5, recent_fraction=0.5, trust_region=0.5
    ),
    "rms, no damping, no forgetting": QNVBHyperparameters(
        curvature="rms", damping=False, drift_forgetting=0.0
    ),
    "forgetting 2, recovery 1, eps": QNVBHyperparameters(
        drift_forgetting=2.0, damping_recovery=1.0, eps=1e-3
    ),
    "lr 0": QNVBHyperparameters(lr=0.0),
    "divisor may vanish": QNVBHyperparameters(eps=0.0, lr=math.inf, curvature="rms"),
}


def hazard_moments(
    dtype: torch.dtype, generator: torch.Generator, step: int, within: int | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients and curvatures of the `SIZES` with every hazard of the guard (NaN, infinities,
    a ``g`` whose square overflows, ``h <= 0``), one of each kind per tensor of more than 3
    coordinates, placed by ``step`` among its first ``within`` coordinates (all of them by
    default; ``within=64`` leaves the later chunks of the larger tensors free of hazards)."""
    big = torch.finfo(dtype).max ** 0.75
    gs, hs = [], []
    for n in SIZES:
        g = torch.randn(n, generator=generator, dtype=dtype) * 3
        h = torch.randn(n, generator=generator, dtype=dtype) + 0.5
        if n > 3:
            span = n if within is None else min(n, within)
            g[(7 * step + n) % span] = (math.nan, math.inf, big, -big)[step % 4]
            h[(5 * step + 1) % span] = (-math.inf, 1e30, math.nan, 0.0)[step % 4]
        gs.append(g)
        hs.append(h)
    return gs, hs


def small_net() -> nn.Module:
    """A 3-40-30-2 ReLU/tanh network (1,452 weights), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 40), nn.ReLU(), nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 2)
    )


def update_inputs(n: int = 3, dtype: torch.dtype = torch.float64) -> dict:
    """Valid arguments of `qnvb_update` for ``n`` coordinates (``mu``, ``sigma``, ``g``, ``h``
    and a fresh ``state``), for tests that spoil one of them."""
    mu = torch.linspace(-1.0, 1.0, n, dtype=dtype)
    return {
        "mu": mu,
        "sigma": torch.full((n,), 0.1, dtype=dtype),
        "g": torch.linspace(0.5, 2.0, n, dtype=dtype),
        "h": torch.linspace(1.0, 3.0, n, dtype=dtype),
        "state": init_qnvb_state(mu),
    }
