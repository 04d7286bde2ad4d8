"""The distributed API on a process group that leaves out global rank 0.

A collective's ``src`` is a global rank: ``src=0`` in a group of global ranks 1 and 2 names a
process outside it, and torch refuses the broadcast. Three gloo ranks; the group is ranks 1 and 2,
rank 0 only builds it (every rank must call ``new_group``). Each scenario must equal the same
one run on a world of two ranks (its group's rank 0 is global rank 1 here).
"""

from __future__ import annotations

import pyro
import pytest
import torch
import torch.distributed as dist
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import init_to_sample
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    NodeParallelQNVBOptimizer,
    broadcast_generator,
    load_checkpoint,
    save_checkpoint,
    shard,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.testing.ranks import run_ranks

ROWS = 12


def _fit(group, outdir):
    """QNVB with sharded updates on a 3-4-1 network, data parallel, 4 steps; a checkpoint saved
    after 2 and loaded back at once."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.linspace(-1, 1, ROWS * 3, dtype=torch.float64).reshape(ROWS, 3)
    y = x.sum(-1, keepdim=True).sin()
    part = shard(ROWS, group)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(ROWS, scale=0.3))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample, init_scale=0.05)
    elbo = DistributedQuadratureELBO("hadamard", 4, vectorize=True, parallel="data", group=group)
    optim = DistributedOptimizer(QNVB(lr=0.5), shard_update=True, group=group)
    svi = SVI(bnn, guide, optim, elbo)
    for step in range(4):
        svi.step(x[part], y[part])
        if step == 1:
            save_checkpoint(outdir / f"sub{dist.get_world_size()}.pt", optim, group=group)
            load_checkpoint(outdir / f"sub{dist.get_world_size()}.pt", optim, group=group)
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def _scenarios(outdir):
    world = dist.get_world_size()
    members = [1, 2] if world == 3 else [0, 1]
    group = dist.new_group(members)
    try:
        return _in_group(group, members, outdir)
    finally:
        dist.barrier()  # rank 0 holds the rendezvous store: it waits for the others


def _in_group(group, members, outdir):
    if dist.get_rank() not in members:
        return None
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    broadcast_generator(generator, group=group)
    torch.manual_seed(dist.get_rank())  # the networks differ until the optimizer's broadcast
    net = nn.Linear(2, 1)
    optimizer = NodeParallelQNVBOptimizer(net.parameters(), group=group)
    return {
        "generator": generator.get_state(),
        "broadcast_weight": net.weight.detach().clone(),
        "owner": optimizer.param_groups[0]["params"][0] is net.weight,
        "fit": _fit(group, outdir),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    three = run_ranks(_scenarios, tmp_path_factory.mktemp("three"), world_size=3, timeout_s=90)
    two = run_ranks(_scenarios, tmp_path_factory.mktemp("two"), world_size=2, timeout_s=90)
    return three, two


def test_a_group_without_global_rank_0_broadcasts_from_its_own_first_rank(runs):
    three, _ = runs
    assert three[0] is None
    for rank in (1, 2):
        # global rank 1's generator (seed 11) and network (seed 1) reached global rank 2
        assert torch.equal(three[rank]["generator"], torch.Generator().manual_seed(11).get_state())
        assert torch.equal(three[rank]["broadcast_weight"], three[1]["broadcast_weight"])
    torch.manual_seed(1)
    assert torch.equal(three[2]["broadcast_weight"], nn.Linear(2, 1).weight.detach())


def test_a_sharded_fit_with_a_checkpoint_in_the_group_equals_a_world_of_two(runs):
    """Shard owners broadcast their blocks (an owner is a group rank); the checkpoint is read by
    the group's first rank: the fit equals the one on a world of two ranks, bit for bit."""
    three, two = runs
    for got, want in zip(three[1:], two):
        assert got["fit"].keys() == want["fit"].keys()
        for name in want["fit"]:
            assert torch.equal(got["fit"][name], want["fit"][name]), name
