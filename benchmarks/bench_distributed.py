"""Steps per second and scaling efficiency of data- and node-parallel QNVB (issue 15).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_distributed.py --data-dir DIR \
        [--steps 10] [--repeats 3]

``DIR`` holds the MNIST t10k files (or set ``PYRO_QUADVI_DATA``). For ``W = 1`` and ``W = 2``
processes (spawned by this script: gloo on 127.0.0.1, one thread each), steps of
``SVI(BayesianModule(784-400-400-10 ReLU, Normal(1) prior, Categorical(8000)),
AutoMeanFieldNormal, DistributedOptimizer(QNVB()), DistributedQuadratureELBO("hadamard", 4))`` on
minibatches of 256 MNIST rows (the issue's case) and of 2048 rows (where the network's passes
dominate the step). At ``W = 1`` both modes are the same computation, timed once per batch size.
At ``W = 2``:

- **data**: each rank evaluates the 4 nodes on its ``B / 2`` rows;
- **nodes**: each rank evaluates 2 of the 4 nodes on all ``B`` rows;

each with QNVB's update done in full on every rank, and divided between the ranks
(``DistributedOptimizer(shard_update=True)``; the same update bit for bit).

Per case and world size: 2 warm-up steps, then ``--repeats`` blocks of ``--steps`` steps, each
timed on rank 0 between two barriers; the median block gives the steps per second. Scaling
efficiency is ``rate(W=2) / (2 rate(W=1))``. On a shared machine the wall clock counts the other
processes' turns too, so the CPU time of each rank (``time.process_time``, median block) is
recorded as well: the CPU efficiency ``cpu(W=1) / (2 cpu(busiest rank, W=2))`` is the efficiency
the step would have on idle cores if waiting for a collective cost nothing. The step's shares
spent in the QNVB update and in ``DistributedOptimizer``'s collectives (all-reduces, and the
broadcasts of ``shard_update``) are timed inside the step (subclasses that add up their time), as
fractions of the timed blocks.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pyro
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_bnn_speed import TimedQNVB, make_net
from pyro.infer import SVI
from torch import nn
from tqdm.auto import tqdm

from pyro_quadvi import AutoMeanFieldNormal
from pyro_quadvi.distributed import DistributedOptimizer, DistributedQuadratureELBO, shard, world
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.testing.datasets import mnist_split

WIDTHS = [784, 400, 400, 10]
K = 4
ROWS = (256, 2048)  # minibatch sizes
MODES = ("data", "nodes")
SHARDS = (False, True)  # DistributedOptimizer's shard_update


class TimedDistributed(DistributedOptimizer):
    """DistributedOptimizer that adds the time of each call (reduce + update) to ``elapsed``."""

    elapsed = 0.0

    def __call__(self, params, *args, **kwargs):
        start = time.perf_counter()
        super().__call__(params, *args, **kwargs)
        self.elapsed += time.perf_counter() - start


def run_case(mode: str, rows: int, shard_update: bool, data, steps: int, repeats: int) -> dict:
    rank, size = world()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = data[0][:rows].reshape(rows, -1), data[1][:rows]
    if mode == "data":
        part = shard(rows)
        x, y = x[part], y[part]
    # qnvb_settings={}: QNVB's own defaults, as when these timings were recorded (before a
    # BayesianModule declared the network settings)
    bnn = BayesianModule(
        make_net(WIDTHS, nn.ReLU),
        priors.Normal(1.0),
        likelihoods.Categorical(8000),
        qnvb_settings={},
    )
    guide = AutoMeanFieldNormal(bnn)
    qnvb = TimedQNVB()
    optim = TimedDistributed(qnvb, shard_update=shard_update)
    elbo = DistributedQuadratureELBO("hadamard", K, vectorize=True, parallel=mode)
    svi = SVI(bnn, guide, optim, elbo)
    for _ in range(2):
        svi.step(x, y)
    blocks, update, total = [], 0.0, 0.0
    qnvb.elapsed = optim.elapsed = 0.0
    label = f"{mode}, W={size}" + (", shard_update" if shard_update else "")
    bar = tqdm(total=steps * repeats, desc=label, disable=rank != 0)
    cpu = []
    for _ in range(repeats):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            svi.step(x, y)
            bar.update()
        cpu.append(time.process_time() - start_cpu)
        dist.barrier()
        blocks.append(time.perf_counter() - start)
    bar.close()
    total = sum(blocks)
    update = qnvb.elapsed
    # CPU seconds per step of the busiest rank: what the step would take on idle cores
    busiest = torch.tensor([statistics.median(cpu) / steps], dtype=torch.float64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    return {
        "rate": steps / statistics.median(blocks),
        "cpu": busiest.item(),
        "update": update / total,
        "reduce": (optim.elapsed - update) / total,
    }


def worker(rank: int, size: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=600),
    )
    data = mnist_split(args.data_dir)
    if size == 1:
        plan = [(rows, "data", False) for rows in ROWS]
    else:
        plan = [(rows, mode, split) for rows in ROWS for mode in MODES for split in SHARDS]
    results = {
        case: run_case(case[1], case[0], case[2], data, args.steps, args.repeats) for case in plan
    }
    dist.destroy_process_group()
    if rank == 0:
        torch.save(results, Path(out) / f"w{size}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None, help="MNIST dir (else $PYRO_QUADVI_DATA)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = tempfile.mkdtemp()
    results = {}
    for size in (1, 2):
        mp.start_processes(
            worker, args=(size, free_port(), args, out), nprocs=size, start_method="spawn"
        )
        results[size] = torch.load(Path(out) / f"w{size}.pt")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs")
    print(
        "| case | steps/s W=1 | steps/s W=2 | efficiency | CPU ms/step W=1 | busiest rank's "
        "CPU ms/step W=2 | CPU efficiency | QNVB update W=1 / W=2 | all-reduces W=2 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in ROWS:
        one = results[1][rows, "data", False]
        for mode in MODES:
            for shard_update in SHARDS:
                two = results[2][rows, mode, shard_update]
                label = f"{mode} parallel, B={rows}" + (", shard_update" if shard_update else "")
                print(
                    f"| {label} | {one['rate']:.2f} | {two['rate']:.2f} | "
                    f"{two['rate'] / (2 * one['rate']):.2f} | {1000 * one['cpu']:.0f} | "
                    f"{1000 * two['cpu']:.0f} | {one['cpu'] / (2 * two['cpu']):.2f} | "
                    f"{one['update']:.0%} / {two['update']:.0%} | {two['reduce']:.0%} |"
                )


if __name__ == "__main__":
    main()
