"""Peak memory and time of ``BayesianModule.predict`` on many rows, whole and in pieces
(``batch_size``; issue 11's ``predict``).

    OMP_NUM_THREADS=1 python benchmarks/bench_predict_memory.py [--rows 20000] [--draws 64]
        [--batch-sizes 0 2000 500] [--repeats 3]

A 20-256-256-10 ReLU network (categorical likelihood) with an ``AutoMeanFieldNormal`` guide set up
on 100 generated rows predicts ``--rows`` generated rows at ``--draws`` random draws, vectorized;
``--batch-sizes`` lists the ``batch_size`` values (``0``: none, one pass). Peak memory: the most
bytes held beyond what was allocated before the call, from ``torch.profiler``'s CPU allocations
(``peak_bytes`` of ``bench_bnn_speed.py``, least of its tries); time: the median of ``--repeats``
calls (``time.process_time``, one thread).
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from bench_bnn_speed import peak_bytes
from torch import nn

from pyro_quadvi import AutoMeanFieldNormal
from pyro_quadvi.nn import BayesianModule, likelihoods, priors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--draws", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[0, 2000, 500])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(1000))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(torch.randn(100, 20), torch.randint(0, 10, (100,)))
    x = torch.randn(args.rows, 20)
    print(
        f"torch {torch.__version__}, pyro {pyro.__version__}; {args.rows:,} rows, {args.draws} "
        f"draws, 20-256-256-10\n\n| batch_size | peak MiB | seconds (median of {args.repeats}) |"
        "\n|---|---:|---:|"
    )
    for size in args.batch_sizes:
        batch_size = size or None

        def call(batch_size=batch_size):
            pyro.set_rng_seed(0)
            return bnn.predict(
                guide, x, num_samples=args.draws, vectorize=True, batch_size=batch_size
            )

        peak = peak_bytes(call, tries=1) / 2**20
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            call()
            times.append(time.process_time() - start)
        print(
            f"| {batch_size or 'none'} | {peak:,.0f} | {statistics.median(times):.2f} |", flush=True
        )


if __name__ == "__main__":
    main()
