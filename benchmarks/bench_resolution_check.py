"""Cost of rule 12 of the QNVB update, the count of nodes the dtype rounds back to the mean.

    OMP_NUM_THREADS=1 python benchmarks/bench_resolution_check.py [--repeats 15] [--steps 20]
        [--widths 784-200-10 784-400-400-10]

For each MLP (float32, tanh, a categorical likelihood on 128 generated cases), one SVI step of
``SVI(BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(128)),
AutoMeanFieldNormal, QNVB(), QuadratureELBO("hadamard", num_points=4))`` and, apart, the update
alone (``qnvb_update_many`` on every weight tensor of the net), each timed with the count (as
shipped) and without it (``qnvb_functional._unresolved`` replaced by a cached all-False mask,
which costs nothing). Blocks of ``--steps`` steps alternate between the two ``--repeats`` times;
the table shows the median time per step and the ratio with / without.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import pyro
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update_many,
)

_SHIPPED = qnvb_functional._unresolved
_NONE: dict[tuple, torch.Tensor] = {}


def _no_count(mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    key = (mu.shape, mu.device)
    if key not in _NONE:
        _NONE[key] = torch.zeros(mu.shape, dtype=torch.bool, device=mu.device)
    return _NONE[key]


def _mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _svi_step(widths: list[int]):
    torch.manual_seed(0)
    pyro.clear_param_store()
    x, y = torch.randn(128, widths[0]), torch.randint(widths[-1], (128,))
    bnn = BayesianModule(_mlp(widths), priors.Normal(1.0), likelihoods.Categorical(128))
    guide = AutoMeanFieldNormal(bnn)
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO("hadamard", num_points=4))
    svi.step(x, y)
    return lambda: svi.step(x, y)


def _update(widths: list[int]):
    torch.manual_seed(0)
    mus = [p.detach().clone() for p in _mlp(widths).parameters()]
    sigmas = [torch.full_like(m, 1e-3) for m in mus]
    gs, hs = [torch.randn_like(m) for m in mus], [torch.rand_like(m) for m in mus]
    states = [init_qnvb_state(m) for m in mus]
    hp = QNVBHyperparameters()

    def step() -> None:
        results = qnvb_update_many(mus, sigmas, gs, hs, states, hp, donate=("state",))
        states[:] = [r.state for r in results]

    return step


def _time(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--widths", nargs="+", default=["784-200-10", "784-400-400-10"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| net | weights | what | without (ms) | with (ms) | ratio |")
    print("|---|---:|---|---:|---:|---:|")
    for spec in args.widths:
        widths = [int(w) for w in spec.split("-")]
        weights = sum(a * b + b for a, b in itertools.pairwise(widths))
        for what, make in (("SVI step", _svi_step), ("update", _update)):
            step = make(widths)
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeats):
                for counted in (False, True):
                    qnvb_functional._unresolved = _SHIPPED if counted else _no_count
                    times[counted].append(_time(step, args.steps))
            qnvb_functional._unresolved = _SHIPPED
            off, on = (statistics.median(times[c]) * 1e3 for c in (False, True))
            print(f"| {spec} | {weights} | {what} | {off:.3f} | {on:.3f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
