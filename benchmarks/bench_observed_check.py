"""What the log joint's check of masked observed data for NaN costs a ``QuadratureELBO`` step.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_observed_check.py [--rows 10000 100000
        1000000] [--repeats 7]

The model: a linear regression with 10 features, ``N`` generated float32 rows, its likelihood
under ``poutine.mask`` (every row observed), so the first run of each step's `LogJoint` checks
its data (``check_observed_not_nan``: one sum of the data, and a scan for the index only where the
sum is NaN). ``SVI(model, AutoMeanFieldNormal, QNVB(), QuadratureELBO())``, the default rule's 3
nodes in one vectorized pass. Each repeat times one step with the check and one with it replaced
by a no-op, in alternating order; the table gives the medians, their ratio, and the check alone
on the same data (median of 21 calls). CPU time (``time.process_time``), one thread.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer import log_joint

FEATURES = 10


def model(X, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([FEATURES]).to_event(1))
    with pyro.plate("data", X.shape[0]), poutine.mask(mask=torch.ones((), dtype=torch.bool)):
        pyro.sample("y", dist.Normal((X * w).sum(-1), 1.0), obs=y)


def unchecked(node: dict, before: str, *, masked_infinity: bool = False) -> None:
    """The check replaced by nothing (its signature, ``check_observed_not_nan``'s)."""


def timed(step) -> float:
    start = time.process_time()
    step()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    checked = log_joint.check_observed_not_nan
    print("| rows | step, checked (ms) | step, unchecked (ms) | ratio | check alone (ms) |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        generator = torch.Generator().manual_seed(0)
        X = torch.randn(rows, FEATURES, generator=generator)
        y = X.sum(-1) + torch.randn(rows, generator=generator)
        pyro.clear_param_store()
        svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO())
        step = functools.partial(svi.step, X, y)
        step()  # the first call's set-up and probes
        with_check, without = [], []
        try:
            for repeat in range(args.repeats):
                for check in (True, False) if repeat % 2 else (False, True):
                    log_joint.check_observed_not_nan = checked if check else unchecked
                    (with_check if check else without).append(timed(step))
        finally:
            log_joint.check_observed_not_nan = checked
        node = {
            "name": "y",
            "value": y,
            "is_observed": True,
            "infer": {},
            "mask": True,
            "fn": dist.Normal(0.0, 1.0),
        }
        one_check = functools.partial(checked, node, "the fit", masked_infinity=True)
        alone = statistics.median(timed(one_check) for _ in range(21))
        a, b = statistics.median(with_check), statistics.median(without)
        print(f"| {rows} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f} | {alone * 1e3:.3f} |")


if __name__ == "__main__":
    main()
