"""How far QNVB's scales lag the posterior after a likelihood-annealing schedule ends.

    OMP_NUM_THREADS=1 python benchmarks/bench_anneal_lag.py [--minibatch]

A Normal mean with a ``N(0, 10^2)`` prior and 40 observations of ``N(mu, 2^2)`` (float64), fitted by
``SVI(qnvb.anneal(model), AutoMeanFieldNormal, qnvb, QuadratureELBO())`` with
``QNVB(annealing=geometric_annealing(0.01, num_steps=n))``; printed: the fitted scale over the
exact posterior standard deviation at 0, 10, 100, 1000 and 2000 steps after the schedule ends, for
``recent_fraction`` 1 (the plain curvature window) and QNVB's default under a schedule
(``ANNEALED_RECENT_FRACTION``). Deterministic (seed 0).

``--minibatch`` asks what the shorter window costs under minibatch noise: a 1-50-1 tanh
``BayesianModule`` on a noisy sine (256 training rows, minibatches of 32, 256 test rows), the
likelihood annealed from 0.01 over 100 steps, 1,000 steps of QNVB + ``QuadratureELBO("hadamard",
num_points=4)`` for each window and seeds 0, 1, 2; printed: the full-data negative ELBO (the same
Hadamard rule, float64) and the test NLL of a 64-draw model average after the last step.
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.metrics import gaussian_nll
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import geometric_annealing
from pyro_quadvi.optim.qnvb import ANNEALED_RECENT_FRACTION

N = 40
AFTER = (0, 10, 100, 1000, 2000)


def model(x: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 10.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(mu, 2.0), obs=x)


def lag(x: torch.Tensor, num_anneal: int, recent_fraction: float) -> list[float]:
    """The scale over the exact posterior sd at the steps of ``AFTER`` past the schedule's end."""
    exact = (1 / 100 + len(x) / 4.0) ** -0.5
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    qnvb = QNVB(
        annealing=geometric_annealing(0.01, num_steps=num_anneal), recent_fraction=recent_fraction
    )
    guide = AutoMeanFieldNormal(model)
    svi = SVI(qnvb.anneal(model), guide, qnvb, QuadratureELBO())
    ratios = []
    for step in range(num_anneal + max(AFTER) + 1):
        svi.step(x)
        if step - num_anneal in AFTER:
            ratios.append(guide.scales.mu.item() / exact)
    return ratios


def minibatch_run(seed: int, recent_fraction: float) -> tuple[float, float]:
    """Full-data negative ELBO and test NLL after 1,000 annealed minibatch steps."""
    generator = torch.Generator().manual_seed(100)
    x = torch.rand(512, 1, generator=generator) * 6 - 3
    y = torch.sin(x).squeeze(-1) + 0.1 * torch.randn(512, generator=generator)
    x_train, y_train, x_test, y_test = x[:256], y[:256], x[256:], y[256:]
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    net = nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 1))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(256, scale=0.1))
    qnvb = QNVB(annealing=geometric_annealing(0.01, num_steps=100), recent_fraction=recent_fraction)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    elbo = QuadratureELBO("hadamard", num_points=4)
    svi = SVI(qnvb.anneal(bnn), guide, qnvb, elbo)
    order = torch.Generator().manual_seed(seed)
    for _ in range(1000):
        rows = torch.randperm(256, generator=order)[:32]
        svi.step(x_train[rows], y_train[rows])
    neg_elbo = QuadratureELBO("hadamard", num_points=4).loss(bnn, guide, x_train, y_train)
    draws = bnn.predict(guide, x_test, num_samples=64)
    nll = gaussian_nll(draws.mean.squeeze(-1), draws.variance.squeeze(-1).sqrt(), y_test)
    return neg_elbo, float(nll)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatch", action="store_true", help="the minibatch network table")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    if args.minibatch:
        print(
            "| recent_fraction | seed | full-data negative ELBO | test NLL |\n|---|---:|---:|---:|"
        )
        for fraction in (1.0, ANNEALED_RECENT_FRACTION):
            for seed in range(3):
                neg_elbo, nll = minibatch_run(seed, fraction)
                print(f"| {fraction} | {seed} | {neg_elbo:.2f} | {nll:.4f} |", flush=True)
        return
    torch.manual_seed(0)
    x = torch.randn(N) + 3
    print("| schedule | recent_fraction | " + " | ".join(f"+{a}" for a in AFTER) + " |")
    print("|---|---|" + "---:|" * len(AFTER))
    for num_anneal in (20, 200):
        for fraction in (1.0, ANNEALED_RECENT_FRACTION):
            cells = " | ".join(f"{r:.4f}" for r in lag(x, num_anneal, fraction))
            print(f"| {num_anneal} steps | {fraction} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
