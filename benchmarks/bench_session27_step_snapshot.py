"""Cost of QNVB's copies for an undoable step (`QNVB._all_or_nothing`) against one SVI step.

    OMP_NUM_THREADS=1 python benchmarks/bench_session27_step_snapshot.py [cpu|cuda]

``BayesianModule`` MLPs (784-400-400-10 at batch 256, 1024-1800-1800-10 at batch 128) fitted by
``SVI(bnn, AutoMeanFieldNormal(bnn), QNVB(), QuadratureELBO("hadamard", num_points=4))``: the
median over 15 steps (after 3) of the step's time and of the time its copies take (entering
the context manager, timed by a wrapper).
"""

import contextlib
import itertools
import statistics
import sys
import time

import pyro
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors

DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
ORIGINAL = QNVB._all_or_nothing
SPENT: list[float] = []


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(self, params, prepared):
    sync()
    start = time.perf_counter()
    with ORIGINAL(self, params, prepared):
        sync()
        SPENT.append(time.perf_counter() - start)
        yield


def main() -> None:
    QNVB._all_or_nothing = timed
    for sizes, batch in (([784, 400, 400, 10], 256), ([1024, 1800, 1800, 10], 128)):
        pyro.clear_param_store()
        torch.manual_seed(0)
        layers = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.Tanh()]
        net = nn.Sequential(*layers[:-1]).to(DEVICE)
        x = torch.randn(batch, sizes[0], device=DEVICE)
        y = torch.randint(0, sizes[-1], (batch,), device=DEVICE)
        with pyro.settings.context(module_local_params=True):
            likelihood = likelihoods.Categorical(dataset_size=60000)
            bnn = BayesianModule(net, priors.Normal(1.0), likelihood)
            svi = SVI(bnn, AutoMeanFieldNormal(bnn), QNVB(), QuadratureELBO("hadamard", 4))
            for _ in range(3):
                svi.step(x, y)
            steps = []
            SPENT.clear()
            for _ in range(15):
                sync()
                start = time.perf_counter()
                svi.step(x, y)
                sync()
                steps.append(time.perf_counter() - start)
        n = sum(p.numel() for p in net.parameters())
        step, spent = statistics.median(steps), statistics.median(SPENT)
        print(
            f"{'-'.join(map(str, sizes))} ({n} weights, batch {batch}, {DEVICE}): step "
            f"{step * 1e3:.2f} ms, copies {spent * 1e3:.3f} ms = {100 * spent / step:.2f}%"
        )


if __name__ == "__main__":
    main()
