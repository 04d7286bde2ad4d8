"""Time of ``to_inference_data`` against baselines measured in the same run.

- eight schools, batched: against ``Predictive(model, guide, parallel=True)``, which draws the
  posterior predictive alone (the export also draws the log likelihood and checks the batch);
- a ``PyroModule`` regression, looped: against ``Predictive(..., parallel=False)``;
- a subsampled plate swept in chunks: against the same model without subsampling (one pass).

Prints a markdown table (median of ``--repeats`` runs, seconds, and the ratio to the baseline):

    python benchmarks/arviz_export.py --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
from models import EIGHT_SCHOOLS_SIGMA, EIGHT_SCHOOLS_Y
from models import eight_schools_centred as eight_schools
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_quadvi import to_inference_data

SIGMA, Y = EIGHT_SCHOOLS_SIGMA, EIGHT_SCHOOLS_Y


class Regression(PyroModule):
    def __init__(self, features: int):
        super().__init__()
        self.fc = PyroModule[nn.Linear](features, 1)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, features]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        mean = self.fc(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)


def local_model(subsample_size):
    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
        with pyro.plate("data", len(y), subsample_size=subsample_size) as rows:
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("obs", dist.Normal(z, 0.5), obs=y[rows])

    return model


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    logging.getLogger("pyro_quadvi").setLevel(logging.WARNING)
    pyro.set_rng_seed(0)
    rows = []

    pyro.clear_param_store()
    guide = AutoNormal(eight_schools)
    guide(SIGMA, Y)
    for S in (1000, 10000):
        ours = median_time(
            lambda S=S: to_inference_data(
                eight_schools, guide, SIGMA, Y, num_samples=S, prior=False
            ),
            options.repeats,
        )
        base = median_time(
            lambda S=S: Predictive(eight_schools, guide=guide, num_samples=S, parallel=True)(SIGMA),
            options.repeats,
        )
        rows.append((f"eight schools, batched, S={S}", "Predictive(parallel=True)", ours, base))

    pyro.clear_param_store()
    x = torch.randn(100, 5)
    net = Regression(5)
    guide = AutoNormal(net)
    guide(x, torch.randn(100))
    y = torch.randn(100)
    S = 200
    ours = median_time(
        lambda: to_inference_data(net, guide, x, y, num_samples=S, prior=False), options.repeats
    )
    base = median_time(
        lambda: Predictive(net, guide=guide, num_samples=S, parallel=False)(x), options.repeats
    )
    rows.append((f"PyroModule regression, looped, S={S}", "Predictive(parallel=False)", ours, base))

    y = torch.randn(10000)
    S = 200
    times = {}
    for subsample_size in (100, None):
        pyro.clear_param_store()
        model = local_model(subsample_size)
        guide = AutoNormal(model)
        guide(y)
        times[subsample_size] = median_time(
            lambda model=model, guide=guide: to_inference_data(
                model, guide, y, num_samples=S, prior=False
            ),
            options.repeats,
        )
    rows.append(
        (
            f"N=10000 in 100 chunks of 100, S={S}",
            "same model, no subsampling",
            times[100],
            times[None],
        )
    )

    print("| case | baseline | export (s) | baseline (s) | ratio |")
    print("|---|---|---|---|---|")
    for case, baseline, ours, base in rows:
        print(f"| {case} | {baseline} | {ours:.3f} | {base:.3f} | {ours / base:.1f} |")


if __name__ == "__main__":
    main()
