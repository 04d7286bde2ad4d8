"""What the batched Hessian buys `opqa_evidence(center="laplace")` on models with many sites.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_laplace_hessian.py
        [--sites 50 100 200 400] [--repeats 3]

The Laplace centre needs the Hessian of the negative log joint at the mode. Taken one row a
backward pass (``torch.autograd.functional.hessian``'s default), its cost grows as D^2 for a model
whose log joint costs O(D); taken in one batched backward (``vectorize=True``, what
`_hessian_factor` does) it grows about as D. The model: S independent scalar sites
``z_i ~ N(0, 1)``, each observed once, ``y_i ~ N(z_i, 1)`` (the exact log evidence is known, and
printed against both). CPU seconds (``time.process_time``, one thread, the garbage collector off),
medians of ``--repeats`` calls of ``opqa_evidence(model, num_points=1, center="laplace")``, the row
loop forced by calling the Hessian without ``vectorize``.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from unittest import mock

import pyro
import pyro.distributions as dist
import torch
from bench_session24_checks import cpu_time

from pyro_quadvi import opqa_evidence


def sites_model(n: int):
    y = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)

    def model():
        for i in range(n):
            z = pyro.sample(f"z_{i}", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            pyro.sample(f"y_{i}", dist.Normal(z, 1.0), obs=y[i])

    exact = float(dist.Normal(0.0, math.sqrt(2.0)).log_prob(y).sum())
    return model, exact


def row_by_row(function, inputs, **kwargs):
    kwargs.pop("vectorize", None)
    return _hessian(function, inputs, **kwargs)


_hessian = torch.autograd.functional.hessian


def laplace(model, found: dict, key: str) -> None:
    """One Laplace-centred evidence of ``model``, kept in ``found[key]``."""
    found[key] = float(opqa_evidence(model, num_points=1, center="laplace").log_evidence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[50, 100, 200, 400])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| sites | batched (s) | row by row (s) | ratio | log evidence - exact (both) |")
    print("|---|---|---|---|---|")
    for n in args.sites:
        model, exact = sites_model(n)
        found = {}
        batched = statistics.median(
            cpu_time(functools.partial(laplace, model, found, "batched"))
            for _ in range(args.repeats)
        )
        with mock.patch.object(torch.autograd.functional, "hessian", row_by_row):
            looped = statistics.median(
                cpu_time(functools.partial(laplace, model, found, "rows"))
                for _ in range(args.repeats)
            )
        print(
            f"| {n} | {batched:.2f} | {looped:.2f} | {looped / batched:.1f} | "
            f"{found['batched'] - exact:.1e}, {found['rows'] - exact:.1e} |"
        )


if __name__ == "__main__":
    main()
