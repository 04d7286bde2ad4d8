"""Session 15's sparse-QNVB trial: a 50-400-200-1 ReLU regression on which ``tau_max`` decides
whether SparseQNVB diverges, stalls or learns (``docs/sparse_qnvb.md``, 'Limits').

``y = x_1 + x_2 + x_3 + 0.1 eps`` on 50 standard normal inputs, 200 training cases. Shared by
``benchmarks/bench_sparse_qnvb_trial.py`` and the tests of session 16.
"""

from __future__ import annotations

import torch
from pyro.infer.autoguide import init_to_uniform
from torch import nn

from ..guides.spike_slab import AutoSpikeSlab
from ..nn import BayesianModule, likelihoods, priors

__all__ = ["TRIAL_CASES", "TRIAL_INPUTS", "trial_data", "trial_model", "trial_net"]

TRIAL_CASES = 200
"""The training cases."""

TRIAL_INPUTS = 50
"""The inputs, of which the first three matter."""


def trial_data(seed: int = 0, num_test: int = 0) -> tuple[torch.Tensor, ...]:
    """``(x, y)`` of the `TRIAL_CASES` training cases, then ``(x_test, y_test)`` of ``num_test``
    cases of the same law when ``num_test > 0``, drawn from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, TRIAL_INPUTS, generator=generator)
        return x, x[:, :3].sum(-1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=generator)

    return (*draw(TRIAL_CASES), *draw(num_test)) if num_test > 0 else draw(TRIAL_CASES)


def trial_net(init: str = "uniform", seed: int = 0) -> nn.Sequential:
    """The 50-400-200-1 ReLU network, after ``torch.manual_seed(seed)``: weights and biases
    uniform in +-0.05 (``"uniform"``, the trial's start), or Kaiming normal weights and zero
    biases (``"kaiming"``)."""
    if init not in ("uniform", "kaiming"):
        raise ValueError(f"init must be 'uniform' or 'kaiming', got {init!r}")
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(TRIAL_INPUTS, 400), nn.ReLU(), nn.Linear(400, 200), nn.ReLU(), nn.Linear(200, 1)
    )
    with torch.no_grad():
        for layer in net:
            if isinstance(layer, nn.Linear):
                if init == "uniform":
                    layer.weight.uniform_(-0.05, 0.05)
                    layer.bias.uniform_(-0.05, 0.05)
                else:
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                    layer.bias.zero_()
    return net


def trial_model(net: nn.Module) -> tuple[BayesianModule, AutoSpikeSlab]:
    """The trial's spike-and-slab model of ``net`` (slab scale 1.3, inclusion prior 0.5, known
    noise scale 1 over `TRIAL_CASES` cases) and its guide at Table 1's start (``initial_lr =
    1e-5`` as the slabs' scale, every weight nonzero, means uniform in +-0.05)."""
    bnn = BayesianModule(
        net,
        priors.SpikeSlab(0.5, slab_scale=1.3),
        likelihoods.Gaussian(dataset_size=TRIAL_CASES, scale=1.0),
    )
    guide = AutoSpikeSlab(
        bnn,
        init_loc_fn=init_to_uniform(radius=0.05),
        init_scale=1e-5**0.5,
        init_inclusion=1 - 1e-9,
    )
    return bnn, guide
