"""How far QNVB's scales lag the posterior after a likelihood-annealing schedule ends.

    OMP_NUM_THREADS=1 python benchmarks/bench_anneal_lag.py

A Normal mean with a ``N(0, 10^2)`` prior and 40 observations of ``N(mu, 2^2)`` (float64), fitted by
``SVI(qnvb.anneal(model), AutoMeanFieldNormal, qnvb, QuadratureELBO())`` with
``QNVB(annealing=geometric_annealing(0.01, num_steps=n))``; printed: the fitted scale over the
exact posterior standard deviation at 0, 10, 100, 1000 and 2000 steps after the schedule ends, for
``recent_fraction`` 1 (the plain curvature window) and QNVB's default under a schedule
(``ANNEALED_RECENT_FRACTION``). Deterministic (seed 0).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
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


def main() -> None:
    torch.set_default_dtype(torch.float64)
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
