"""What the guide watch's walk over a guide's parameters costs against an SVI step.

Once a ``QNVB`` exists, the global module pre-hook by which it finds the guides that run calls
``pyro_quadvi.store.follow_param_store`` on every describable guide before each of its runs (so a
restored param store reaches Pyro's ``AutoDiagonalNormal`` & co under any ELBO). This times that
call alone on the ``AutoMeanFieldNormal`` of a deep, narrow ``BayesianModule`` (many small
sites, the walk's worst case per unit of work), against one ``QuadratureELBO`` + ``QNVB`` step
of the same model and against one ``Trace_ELBO`` + ``QNVB`` step.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_guide_hook.py [--depth 20]
        [--width 16] [--batch 64] [--repeats 5]

CPU time (``time.process_time``, one torch thread): the median of ``--repeats`` blocks (2,000
calls of the walk, 20 steps per block).
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.store import follow_param_store


def per_call(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` blocks of the CPU seconds per call of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=20, help="hidden layers of --width units")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = []
    for _ in range(args.depth):
        hidden += [nn.Linear(args.width, args.width), nn.Tanh()]
    net = nn.Sequential(nn.Linear(4, args.width), nn.Tanh(), *hidden, nn.Linear(args.width, 1))
    x, y = torch.randn(args.batch, 4), torch.randn(args.batch, 1)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(256, scale=0.5))

    rows = []
    for name, elbo in (("QuadratureELBO", QuadratureELBO()), ("Trace_ELBO", Trace_ELBO())):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
        svi = SVI(bnn, guide, QNVB(), elbo)
        for _ in range(3):  # set-up and warm-up
            svi.step(x, y)
        walk = per_call(lambda guide=guide: follow_param_store(guide), args.calls, args.repeats)
        step = per_call(lambda svi=svi: svi.step(x, y), args.steps, args.repeats)
        rows.append((name, len(list(guide.parameters())), walk, step))

    print(
        f"torch {torch.__version__}, pyro {pyro.__version__}; {args.depth + 2} Linear layers, "
        f"width {args.width}, batch {args.batch}; CPU time, median of {args.repeats} blocks\n\n"
        "| ELBO | guide leaves | walk us / call | step ms | walk / step |\n"
        "|---|---:|---:|---:|---:|"
    )
    for name, leaves, walk, step in rows:
        print(f"| {name} | {leaves} | {walk * 1e6:.1f} | {step * 1e3:.2f} | {walk / step:.2%} |")


if __name__ == "__main__":
    main()
