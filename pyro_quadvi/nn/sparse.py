"""The realized sparse network of a spike-and-slab fit: exact zeros, one deterministic module.

After fitting a `BayesianModule` with
`AutoSpikeSlab`, `sparse_network` reads off the point estimate the
sparse-VI paper evaluates: every weight whose inclusion probability exceeds a threshold takes its
slab mean, every other weight is exactly zero, in a copy of the network that runs without Pyro.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ..guides.spike_slab import AutoSpikeSlab
from .module import BayesianModule

__all__ = ["SparseNetwork", "sparse_network"]


@dataclass
class SparseNetwork:
    """A deterministic network with exact zeros, and what was kept.

    Attributes:
        net: a copy of the Bayesian module's net holding the point estimate (eval mode,
            ``requires_grad`` off); hidden (deterministic) parameters keep their fitted values.
        nonzeros: parameter name -> how many of its entries are nonzero (latent parameters only).
        sizes: parameter name -> its number of entries (latent parameters only).
    """

    net: nn.Module
    nonzeros: dict[str, int]
    sizes: dict[str, int]

    @property
    def kept_fraction(self) -> float:
        """The fraction of the latent parameters' entries that are nonzero."""
        total = sum(self.sizes.values())
        return sum(self.nonzeros.values()) / total if total else 0.0

    def per_layer(self) -> dict[str, tuple[int, int]]:
        """Module path (``"0"`` for ``"0.weight"`` and ``"0.bias"``) -> ``(nonzero, total)``."""
        layers: dict[str, tuple[int, int]] = {}
        for name, count in self.nonzeros.items():
            layer = name.rpartition(".")[0]
            kept, total = layers.get(layer, (0, 0))
            layers[layer] = (kept + count, total + self.sizes[name])
        return layers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.net(x)


def sparse_network(
    bnn: BayesianModule, guide: AutoSpikeSlab, threshold: float = 0.5
) -> SparseNetwork:
    """The sparse point-estimate network of ``bnn`` under a fitted spike-and-slab ``guide``.

    Args:
        bnn: the Bayesian module the guide was fitted to.
        guide: its `AutoSpikeSlab` (after training).
        threshold: a weight is kept where its inclusion probability exceeds this
            (`sparse_point_estimate`).

    Raises:
        TypeError: for a guide that is not an ``AutoSpikeSlab``, a ``threshold`` that is not
            a number.
        ValueError: if the guide does not cover every latent parameter of ``bnn``.
    """
    if not isinstance(guide, AutoSpikeSlab):
        raise TypeError(
            f"sparse_network needs an AutoSpikeSlab guide (exact zeros), got {type(guide).__name__}"
        )
    one_number = isinstance(threshold, torch.Tensor) and threshold.numel() == 1
    if not one_number and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
        raise TypeError(
            f"sparse_network: threshold must be a number in [0, 1) (an inclusion probability), "
            f"got {threshold!r} ({type(threshold).__name__})"
        )
    estimate = guide.sparse_point_estimate(threshold)
    latent = bnn.latent_parameters()
    missing = sorted(set(latent) - set(estimate))
    if missing:
        raise ValueError(f"the guide has no sites for the latent parameters {missing} of the net")
    with torch.no_grad():
        hidden = {name: value.detach().clone() for name, value in bnn.hidden_values().items()}
        net = copy.deepcopy(bnn._net)
        params = dict(net.named_parameters())
        for name in latent:
            params[name].copy_(estimate[name].reshape(params[name].shape))
        for name, value in hidden.items():
            params[name].copy_(value)
    net.requires_grad_(False).eval()
    nonzeros = {name: int((estimate[name] != 0).sum()) for name in latent}
    sizes = {name: param.numel() for name, param in latent.items()}
    return SparseNetwork(net, nonzeros, sizes)
