"""Eight schools, fitted and exported to ArviZ: the example of ``docs/arviz.md``.

Prints ``az.summary`` and ``az.loo`` and saves the posterior predictive check:

    python examples/arviz_eight_schools.py --out docs/img/arviz_ppc.png
"""

from __future__ import annotations

import argparse

import arviz as az
import matplotlib
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, QuadratureELBO, to_inference_data
from pyro_quadvi.guides import AutoMeanFieldNormal

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def model(sigma, y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", len(sigma)):
        eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * eta, event_dim=0)
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/arviz_ppc.png", help="the figure's path")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()

    pyro.set_rng_seed(options.seed)
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    for _ in range(options.steps):
        svi.step(SIGMA, Y)

    idata = to_inference_data(model, guide, SIGMA, Y, num_samples=1000)
    print(idata)
    print(az.summary(idata, var_names=["mu", "tau", "theta"], kind="stats"))
    print(az.loo(idata))

    az.plot_ppc(idata, kind="cumulative", num_pp_samples=200, random_seed=options.seed)
    plt.gcf().set_size_inches(7, 4)
    plt.tight_layout()
    plt.savefig(options.out, dpi=100)
    print(f"saved {options.out}")


if __name__ == "__main__":
    main()
