"""The distributed API on a process group that leaves out global rank 0.

A collective's ``src`` is a global rank: ``src=0`` in a group of global ranks 1 and 2 names a
process outside it, and torch refuses the broadcast. Three gloo ranks; the group is ranks 1 and 2,
rank 0 only builds it (every rank must call ``new_group``). Each scenario must equal the same
one run in the group of global ranks 0 and 1, by rank in the group.
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

ROWS = 12


def _fit(group, outdir, name):
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
            save_checkpoint(outdir / f"{name}.pt", optim, group=group)
            load_checkpoint(outdir / f"{name}.pt", optim, group=group)
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def _in_group(group, members, outdir, name):
    if dist.get_rank() not in members:
        return None
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    broadcast_generator(generator, group=group)
    torch.manual_seed(dist.get_rank())  # the networks differ until the optimizer's broadcast
    net = nn.Linear(2, 1)
    NodeParallelQNVBOptimizer(net.parameters(), group=group)
    return {
        "generator": generator.get_state(),
        "weight": net.weight.detach().clone(),
        "fit": _fit(group, outdir, name),
    }


def _scenarios(outdir):
    """The group of global ranks 1 and 2, then the group of ranks 0 and 1 (every rank builds
    both); each member's results, by its rank in the group."""
    results = {}
    for name, members in (("without_0", [1, 2]), ("with_0", [0, 1])):
        group = dist.new_group(members)
        results[name] = _in_group(group, members, outdir, name)
    dist.barrier()  # rank 0 holds the rendezvous store: it waits for the others
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("groups"), world_size=3, timeout_s=90)


def test_a_group_without_global_rank_0_broadcasts_from_its_own_first_rank(ranks):
    """Global rank 1, the group's first, sends its generator (seed 11) and network (seed 1)."""
    assert ranks[0]["without_0"] is None
    torch.manual_seed(1)
    first = nn.Linear(2, 1).weight.detach()
    for rank in (1, 2):
        got = ranks[rank]["without_0"]
        assert torch.equal(got["generator"], torch.Generator().manual_seed(11).get_state())
        assert torch.equal(got["weight"], first)


def test_a_sharded_fit_with_a_checkpoint_in_the_group_equals_one_with_global_rank_0(ranks):
    """Shard owners broadcast their blocks (an owner is a group rank); the group's first rank
    writes and reads the checkpoint: the fit equals the group of ranks 0 and 1's, bit for bit."""
    for group_rank in (0, 1):
        got = ranks[group_rank + 1]["without_0"]["fit"]
        want = ranks[group_rank]["with_0"]["fit"]
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
