"""A Bayesian network fitted by QNVB + QuadratureELBO on one or several processes.

    python examples/distributed_bnn.py                                  # one process
    torchrun --nproc_per_node=2 examples/distributed_bnn.py             # data parallel
    torchrun --nproc_per_node=2 examples/distributed_bnn.py --parallel nodes --shard-update
    torchrun --nproc_per_node=2 examples/distributed_bnn.py --checkpoint /tmp/fit.pt --steps 100
    torchrun --nproc_per_node=2 examples/distributed_bnn.py --resume /tmp/fit.pt --steps 100

A 10-16-1 tanh network on the diabetes regression data (split 0, shipped with scikit-learn),
``N(0, 1 / fan_in)`` priors, a Gaussian likelihood with noise 0.7 (targets standardized),
``AutoMeanFieldNormal`` started at a prior draw, minibatches of 64 rows.
Every rank draws the same minibatch indices (the same seeded generator) and, with
``--parallel data``, evaluates its rows of it; with ``--parallel nodes`` the whole minibatch at
every ``W``-th node of a 4-node Hadamard rule. Rank 0 prints the loss and, at the end, the test
RMSE; every rank ends with the same parameters (the script checks it).
"""

from __future__ import annotations

import argparse
import os

import pyro
import torch
import torch.distributed as dist
from pyro.infer import SVI
from pyro.infer.autoguide import init_to_sample

from pyro_quadvi import QNVB, AutoMeanFieldNormal
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    check_agreement,
    load_checkpoint,
    save_checkpoint,
    shard,
    world,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.testing.datasets import regression_split


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parallel", choices=["data", "nodes"], default="data")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--shard-update", action="store_true", help="divide QNVB's update between the ranks"
    )
    parser.add_argument("--checkpoint", help="save the fit here (rank 0) after the last step")
    parser.add_argument("--resume", help="continue from this checkpoint")
    args = parser.parse_args(argv)

    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    rank, size = world()
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)  # the same on every rank: parameters, batches and nodes agree

    data = regression_split("diabetes", 0)
    n = len(data.y_train)
    net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    prior = priors.LayerwiseNormal("radford")  # N(0, 1 / fan_in)
    bnn = BayesianModule(net, prior, likelihoods.Gaussian(n, scale=0.7))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample)
    elbo = DistributedQuadratureELBO("hadamard", 4, vectorize=True, parallel=args.parallel)
    optim = DistributedOptimizer(QNVB(), shard_update=args.shard_update)
    svi = SVI(bnn, guide, optim, elbo)
    batches = torch.Generator().manual_seed(1)  # the minibatches' (Hadamard draws no nodes)

    guide(data.x_train[:2], data.y_train[:2])  # create the parameters
    if args.resume:
        # every generator of the run's own, as saved: here the minibatches' (with a random rule
        # drawing from its own generator, pass both: generator=[rule_generator, batches])
        load_checkpoint(args.resume, optim, generator=batches)
    for step in range(args.steps):
        rows = torch.randperm(n, generator=batches)[: args.batch]
        if args.parallel == "data":
            part = rows[shard(len(rows))]
            elbo.share = len(part) / len(rows)  # shards differ by a row when W does not divide
            rows = part
        loss = svi.step(data.x_train[rows], data.y_train[rows])
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"step {step + 1}: loss {loss:.2f}", flush=True)
    if args.checkpoint:
        save_checkpoint(args.checkpoint, optim, generator=batches)

    values = torch.cat([p.detach().reshape(-1) for p in pyro.get_param_store().values()])
    check_agreement(values, "the fitted parameters")
    mean = bnn.predict(guide, data.x_test, quadrature="hadamard", num_points=4).mean
    rmse = ((mean.squeeze(-1) - data.y_test) ** 2).mean().sqrt().item() * data.y_std
    if rank == 0:
        print(f"{size} process(es), parallel={args.parallel}: test RMSE {rmse:.2f}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return rmse


if __name__ == "__main__":
    main()
