"""What the data checks of session 17 cost a step on an MNIST-sized batch.

The checks: `BayesianModule`'s data check (``x`` finite, a sum, and the likelihood's labels in
its support, a pass over ``y``, read together in one host sync per model run), and
`QNVBOptimizer`'s batch flag (``isfinite(t).all()`` of the batch's floating
tensors, read with the loss in the step's existing sync). Each step is timed with the checks and
with them replaced by no-ops, alternately, after two warm-up steps; the median of ``--repeats``
steps of each and their ratio, in the same run. Also the checks alone (median of 200 calls).

    OMP_NUM_THREADS=1 python benchmarks/bench_data_checks.py --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from unittest import mock

import pyro
import torch
import torch.nn.functional as F
from bench_bnn_speed import make_net
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.nn import module as nn_module
from pyro_quadvi.optim import QNVBOptimizer, module_loss, torch_qnvb

WIDTHS, ROWS = [784, 400, 400, 10], 128


@contextmanager
def without_checks():
    """The model's and the optimizer's data checks as no-ops."""
    with (
        mock.patch.object(nn_module, "_check_data", lambda *args: None),
        mock.patch.object(torch_qnvb, "_batch_finite", lambda *args: None),
    ):
        yield


def timed(step, repeats: int) -> tuple[float, float]:
    """Median seconds of ``step`` with the checks and without, alternating."""
    for _ in range(2):
        step()
        with without_checks():
            step()
    on, off = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        on.append(time.perf_counter() - start)
        with without_checks():
            start = time.perf_counter()
            step()
            off.append(time.perf_counter() - start)
    return statistics.median(on), statistics.median(off)


def svi_step(x: torch.Tensor, y: torch.Tensor):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    bnn = BayesianModule(
        make_net(WIDTHS, nn.ReLU), priors.Normal(1.0), likelihoods.Categorical(60000)
    )
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO("hadamard", 4, vectorize=True))
    return lambda: svi.step(x, y)


def optimizer_step(x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(0)
    net = make_net(WIDTHS, nn.ReLU)
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=60000.0, num_eval=4)
    loss_fn = module_loss(net, F.cross_entropy)
    return lambda: optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=True)


def checks_alone(x: torch.Tensor, y: torch.Tensor) -> float:
    """Median seconds of the model's data check (x and the labels)."""
    likelihood = likelihoods.Categorical(60000)
    outputs = torch.zeros(ROWS, WIDTHS[-1])
    times = []
    for _ in range(200):
        start = time.perf_counter()
        nn_module._check_data(x, y, outputs, likelihood)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(ROWS, WIDTHS[0], generator=gen)
    y = torch.randint(0, WIDTHS[-1], (ROWS,), generator=gen)
    net = "-".join(map(str, WIDTHS))
    print(
        f"checks alone (x {tuple(x.shape)}, y {tuple(y.shape)}): {checks_alone(x, y) * 1e6:.1f} us"
    )
    print("| step | with checks (ms) | without (ms) | ratio |")
    print("|---|---|---|---|")
    for label, make in (
        (f"SVI, QuadratureELBO hadamard 4, {net}, B={ROWS}", svi_step),
        (f"QNVBOptimizer one-pass, 4 nodes, {net}, B={ROWS}", optimizer_step),
    ):
        on, off = timed(make(x, y), args.repeats)
        print(f"| {label} | {on * 1e3:.2f} | {off * 1e3:.2f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
