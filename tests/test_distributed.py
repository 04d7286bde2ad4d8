"""Data- and node-parallel QuadratureELBO + QNVB on torch.distributed: two gloo processes on the
loopback interface against one process on the full batch (float64).

One spawn of two processes runs every scenario (about 10 s); the single-process references run in
the test process itself, through the same classes with no process group (a world of one rank).
"""

from __future__ import annotations

from pathlib import Path

import pyro
import pytest
import torch
import torch.distributed as dist
from pyro.infer import SVI
from pyro.infer.autoguide import init_to_sample

from pyro_quadvi import QNVB, AutoMeanFieldNormal, SparseQNVB
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    NodeParallelQNVBOptimizer,
    broadcast_generator,
    load_checkpoint,
    save_checkpoint,
    shard,
    world,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss

WORLD = 2
STEPS = 6
TIMEOUT_S = 120


# ------------------------------------------------------------------------------- the problems
def _data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1, keepdim=True)) + 0.1 * torch.randn(
        rows, 1, generator=g, dtype=torch.float64
    )
    return x, y


def _net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()


def _bnn_fit(
    parallel: str,
    rows: int,
    *,
    rule: str = "blocked_simplex",
    num_points=None,
    steps: int = STEPS,
    unequal_share: bool = False,
    shard_update: bool = False,
    adam: bool = False,
    checkpoint: Path | None = None,
    resume: Path | None = None,
) -> dict:
    """``steps`` of QNVB on a 3-4-1 BayesianModule; this rank's part of ``rows`` rows."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data(rows)
    if parallel == "data":
        part = shard(rows)
        x, y = x[part], y[part]
    bnn = BayesianModule(_net(), priors.Normal(1.0), likelihoods.Gaussian(rows, scale=0.3))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample, init_scale=0.05)
    elbo = DistributedQuadratureELBO(rule, num_points, vectorize=True, parallel=parallel)
    if unequal_share:
        elbo.share = len(x) / rows
    inner = pyro.optim.Adam({"lr": 0.05}) if adam else QNVB(lr=0.5)
    optim = DistributedOptimizer(inner, shard_update=shard_update)
    svi = SVI(bnn, guide, optim, elbo)
    if resume is not None:
        guide(x, y)  # the guide's parameters exist; the checkpoint then overwrites them
        load_checkpoint(resume, optim)
    losses = []
    for step in range(steps):
        losses.append(svi.step(x, y))
        if checkpoint is not None and step == steps // 2 - 1:
            save_checkpoint(checkpoint, optim)
    store = pyro.get_param_store()
    return {
        "losses": torch.tensor(losses),
        "params": {k: v.detach().clone() for k, v in store.items()},
        "qnvb": None if adam else optim.get_state()["qnvb"]["pairs"],
    }


class _Poison(torch.autograd.Function):
    """Identity forward; the backward makes the gradient of coordinate 1 NaN (when ``on``)."""

    @staticmethod
    def forward(ctx, w, on):
        ctx.on = on
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.on:
            grad = grad.clone()
            grad[..., 1] = float("nan")
        return grad, None


def _poison_model(x, y, poisoned: bool, rows: int):
    zero = torch.zeros(3, dtype=torch.float64)
    w = pyro.sample("w", pyro.distributions.Normal(zero, 1.0).to_event(1))
    mean = (x * _Poison.apply(w, poisoned)).sum(-1)  # from the right: w is (K, 1, 3) in the pass
    with pyro.plate("data", rows, subsample=torch.arange(len(x)), dim=-1):
        pyro.sample("obs", pyro.distributions.Normal(mean, 0.5), obs=y)


def _local_plate(rows):
    """The data plate at the rows passed (the guide's plate too: the same rows as the model)."""
    return pyro.plate("data", 8, subsample=rows)


def _local_model(rows):
    zero = torch.zeros((), dtype=torch.float64)
    mu = pyro.sample("mu", pyro.distributions.Normal(zero, 1.0))
    with _local_plate(rows):
        z = pyro.sample("z", pyro.distributions.Normal(mu, 1.0))
        pyro.sample("obs", pyro.distributions.Normal(z, 1.0), obs=rows.to(torch.float64))


def _local_fit(parallel: str, steps: int = 3) -> dict:
    """QNVB on a model with a local latent per row: every rank passes all 8 rows."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(
        _local_model, init_loc_fn=init_to_sample, create_plates=_local_plate
    )
    elbo = DistributedQuadratureELBO(vectorize=True, parallel=parallel)
    svi = SVI(_local_model, guide, DistributedOptimizer(QNVB(lr=0.5)), elbo)
    for _ in range(steps):
        svi.step(torch.arange(8))
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def _poison_fit(poisoned: bool, rows: int = 8, steps: int = 3) -> dict:
    """Data parallel with a NaN gradient on one rank only (``poisoned`` there)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data(rows)
    y = y[:, 0]
    part = shard(rows)
    x, y = x[part], y[part]
    guide = AutoMeanFieldNormal(_poison_model, init_loc_fn=init_to_sample)
    elbo = DistributedQuadratureELBO(vectorize=True, parallel="data")
    svi = SVI(_poison_model, guide, DistributedOptimizer(QNVB(lr=0.5)), elbo)
    guide(x, y, poisoned, rows)
    for _ in range(steps):
        svi.step(x, y, poisoned, rows)
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def _ddp_fit(rows: int = 12, steps: int = STEPS) -> dict:
    """Plain torch: QNVBOptimizer stepping a DDP-wrapped net on this rank's shard."""
    x, y = _data(rows)
    part = shard(rows)
    net = _net()
    if world()[1] > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    generator = torch.Generator().manual_seed(11 + world()[0])  # differs until broadcast
    broadcast_generator(generator)
    optimizer = QNVBOptimizer(
        net.parameters(),
        likelihood_weight=rows,
        generator=generator,
        init_sigma=0.05,
        prior_precision=1.0,
    )
    losses = []
    for _ in range(steps):

        def closure():
            loss = torch.nn.functional.mse_loss(net(x[part]), y[part])
            loss.backward()
            return loss

        losses.append(optimizer.step(closure))
    return {
        "losses": torch.stack(losses),
        "mu": [optimizer.state[p]["mu"].clone() for p in net.parameters()],
        "sigma": [optimizer.state[p]["sigma"].clone() for p in net.parameters()],
    }


def _torch_nodes_fit(
    one_pass: bool,
    quadrature: str,
    num_eval=None,
    *,
    steps: int = STEPS,
    distributed: bool = True,
    save: Path | None = None,
    resume: Path | None = None,
) -> dict:
    """Plain torch, node parallel: every rank has all 12 rows and evaluates every W-th node.

    The ranks start from different weights and generator states on purpose: the constructor
    gives every rank rank 0's (which equal one process's). ``distributed=False``: the plain
    ``QNVBOptimizer`` in this process, the reference."""
    rank = world()[0]
    x, y = _data(12)
    net = _net()
    with torch.no_grad():
        for p in net.parameters():
            p += rank
    generator = torch.Generator().manual_seed(11 + rank)
    cls = NodeParallelQNVBOptimizer if distributed else QNVBOptimizer
    optimizer = cls(
        net.named_parameters(),
        likelihood_weight=12,
        generator=generator,
        init_sigma=0.05,
        prior_precision=1.0,
        quadrature=quadrature,
        num_eval=num_eval,
    )
    if resume is not None:
        optimizer.load_state_dict(torch.load(resume, weights_only=False))
    loss_fn = module_loss(net, torch.nn.functional.mse_loss)
    losses = []
    for step in range(steps):
        if one_pass:
            losses.append(optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=True))
        else:

            def closure():
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                return loss

            losses.append(optimizer.step(closure))
        if save is not None and step == steps // 2 - 1 and rank == 0:
            torch.save(optimizer.state_dict(), save)
    if save is not None and world()[1] > 1:
        dist.barrier()
    params = dict(net.named_parameters())
    return {
        "losses": torch.stack(losses),
        "mu": {n: optimizer.state[p]["mu"].clone() for n, p in params.items()},
        "sigma": {n: optimizer.state[p]["sigma"].clone() for n, p in params.items()},
        "net": {n: p.detach().clone() for n, p in params.items()},
    }


def _torch_nodes_refused() -> dict:
    """What every rank raises: fewer nodes than ranks; nodes drawn from unshared global states."""
    out = {}
    rank = world()[0]
    for case, kwargs, seed in (
        ("few", {"quadrature": "mc", "num_eval": 1}, 100),
        ("unshared", {"quadrature": "rasp_simplex"}, 100 + rank),  # torch's global generator
    ):
        net = _net()
        torch.manual_seed(seed)
        optimizer = NodeParallelQNVBOptimizer(net.parameters(), **kwargs)

        def closure(net=net):
            loss = net(torch.ones(1, 3, dtype=torch.float64)).sum()
            loss.backward()
            return loss

        try:
            optimizer.step(closure)
            out[case] = None
        except (ValueError, RuntimeError) as error:
            out[case] = str(error)
    return out


def _scenarios(outdir: Path) -> dict:
    rank = world()[0]
    out = {
        "data": _bnn_fit("data", 12),
        "data_unequal": _bnn_fit("data", 11, unequal_share=True),
        "nodes": _bnn_fit("nodes", 12),
        "nodes_hadamard": _bnn_fit("nodes", 12, rule="hadamard", num_points=4),
        "poison": _poison_fit(poisoned=rank == 1),
        "ddp": _ddp_fit(),
        "torch_closure": _torch_nodes_fit(False, "rasp_simplex"),
        "torch_one_pass": _torch_nodes_fit(True, "blocked_simplex"),
        "torch_hadamard": _torch_nodes_fit(True, "hadamard", 4),
        "torch_uninterrupted": _torch_nodes_fit(False, "rasp_simplex", save=outdir / "torch.pt"),
        "torch_refused": _torch_nodes_refused(),
        "data_adam": _bnn_fit("data", 12, adam=True),
        "data_sharded": _bnn_fit("data", 12, shard_update=True),
        "nodes_sharded": _bnn_fit("nodes", 12, shard_update=True),
        "uninterrupted": _bnn_fit("data", 12, checkpoint=outdir / "ckpt.pt", shard_update=True),
    }
    out["torch_resumed"] = _torch_nodes_fit(
        False, "rasp_simplex", steps=STEPS - STEPS // 2, resume=outdir / "torch.pt"
    )
    out["resumed"] = _bnn_fit(
        "data", 12, steps=STEPS - STEPS // 2, resume=outdir / "ckpt.pt", shard_update=True
    )
    out["local_nodes"] = _local_fit("nodes")
    torch.manual_seed(rank)  # torch's global generator, different on each rank until broadcast
    broadcast_generator()
    out["global_draw"] = torch.rand(4, dtype=torch.float64)
    try:  # data parallel, a local latent's rows differ between ranks: every rank refuses it
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        part = shard(8)
        svi = SVI(
            _local_model,
            AutoMeanFieldNormal(_local_model, create_plates=_local_plate),
            DistributedOptimizer(QNVB()),
            DistributedQuadratureELBO(vectorize=True),
        )
        svi.step(torch.arange(8)[part])
        out["local"] = None
    except RuntimeError as error:
        out["local"] = str(error)
    try:  # ranks that drew different nodes: every rank raises, none hangs
        pyro.clear_param_store()
        x, y = _data(12)
        bnn = BayesianModule(_net(), priors.Normal(1.0), likelihoods.Gaussian(12, scale=0.3))
        pyro.set_rng_seed(100 + rank)  # the random rule's draws differ between the ranks
        guide = AutoMeanFieldNormal(bnn)
        SVI(bnn, guide, DistributedOptimizer(QNVB()), DistributedQuadratureELBO()).step(x, y)
        out["disagree"] = None
    except RuntimeError as error:
        out["disagree"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    """What each of the two ranks returned; the processes end (or are killed) before the tests."""
    outdir = tmp_path_factory.mktemp("distributed")
    results = spawn_ranks(_scenarios, outdir, world_size=WORLD, timeout_s=TIMEOUT_S)
    results[0]["outdir"] = outdir
    return results


def _assert_close(a: dict, b: dict, *, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_identical(a[key], b[key])
        else:
            assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------------------------- the tests
def test_data_parallel_equals_one_process(ranks):
    """Shards of 6 + 6 rows, all nodes on each: the full-batch run of 12 rows, to 1e-10."""
    _assert_identical(ranks[0]["data"]["params"], ranks[1]["data"]["params"])
    single = _bnn_fit("data", 12)
    _assert_close(ranks[0]["data"]["params"], single["params"], atol=1e-10)
    torch.testing.assert_close(ranks[0]["data"]["losses"], single["losses"], rtol=1e-12, atol=0)


def test_unequal_shards_weighted_by_share(ranks):
    """6 + 5 rows with ``share`` set: each rank's plate scale 11 / B_r is undone by its share."""
    _assert_identical(ranks[0]["data_unequal"]["params"], ranks[1]["data_unequal"]["params"])
    single = _bnn_fit("data", 11)
    _assert_close(ranks[0]["data_unequal"]["params"], single["params"], atol=1e-10)


@pytest.mark.parametrize("case", ["nodes", "nodes_hadamard"])
def test_node_parallel_equals_one_process(ranks, case):
    """Nodes {0, 2} and {1} (blocked simplex, 3 nodes) or {0, 2} and {1, 3} (Hadamard, 4)."""
    _assert_identical(ranks[0][case]["params"], ranks[1][case]["params"])
    rule, num_points = ("hadamard", 4) if case == "nodes_hadamard" else ("blocked_simplex", None)
    single = _bnn_fit("nodes", 12, rule=rule, num_points=num_points)
    _assert_close(ranks[0][case]["params"], single["params"], atol=1e-10)
    torch.testing.assert_close(ranks[0][case]["losses"], single["losses"], rtol=1e-12, atol=0)


def test_any_pyro_optimizer_steps_on_averaged_gradients(ranks):
    """Pyro's Adam wrapped: the ranks agree bit for bit and equal one process to 1e-10."""
    _assert_identical(ranks[0]["data_adam"]["params"], ranks[1]["data_adam"]["params"])
    single = _bnn_fit("data", 12, adam=True)
    _assert_close(ranks[0]["data_adam"]["params"], single["params"], atol=1e-10)


@pytest.mark.parametrize("mode", ["data", "nodes"])
def test_sharded_update_is_the_same_update(ranks, mode):
    """QNVB's blocks divided between the ranks (0.weight on rank 0, the other three on rank 1),
    each broadcast by its rank: the same parameters and QNVB states, bit for bit."""
    for rank in ranks:
        _assert_identical(rank[f"{mode}_sharded"]["params"], rank[mode]["params"])
        assert torch.equal(rank[f"{mode}_sharded"]["losses"], rank[mode]["losses"])
    _assert_identical(ranks[0][f"{mode}_sharded"]["qnvb"], ranks[0][mode]["qnvb"])


def test_nonfinite_on_one_rank_is_skipped_on_all(ranks):
    """A NaN gradient of w[1] on rank 1 only: both ranks keep w[1] and update the rest alike."""
    _assert_identical(ranks[0]["poison"], ranks[1]["poison"])
    start = _poison_fit(poisoned=False, steps=0)
    loc, scale = "AutoMeanFieldNormal.locs.w", "AutoMeanFieldNormal.scales.w"
    for key in (loc, scale):
        assert ranks[0]["poison"][key][1] == start[key][1]
        assert (ranks[0]["poison"][key][[0, 2]] != start[key][[0, 2]]).all()
    # one process with the NaN on the whole batch skips w[1] too, and agrees on the rest
    with pytest.warns(RuntimeWarning, match="non-finite gradient or curvature at 1 coord"):
        single = _poison_fit(poisoned=True)
    _assert_close(ranks[0]["poison"], single, atol=1e-10)


def test_ddp_qnvb_optimizer_equals_one_process(ranks):
    """QNVBOptimizer under DistributedDataParallel (gradients averaged by DDP's all-reduce)."""
    for key in ("mu", "sigma"):
        for a, b in zip(ranks[0]["ddp"][key], ranks[1]["ddp"][key]):
            assert torch.equal(a, b)
    single = _ddp_fit()
    for key in ("mu", "sigma"):
        for a, b in zip(ranks[0]["ddp"][key], single[key]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    # each rank's closure returns the mean over its shard: their mean is the full batch's
    mean = (ranks[0]["ddp"]["losses"] + ranks[1]["ddp"]["losses"]) / 2
    torch.testing.assert_close(mean, single["losses"], rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "case, one_pass, quadrature, num_eval",
    [
        ("torch_closure", False, "rasp_simplex", None),
        ("torch_one_pass", True, "blocked_simplex", None),
        ("torch_hadamard", True, "hadamard", 4),
    ],
)
def test_node_parallel_qnvb_optimizer_equals_one_process(
    ranks, case, one_pass, quadrature, num_eval
):
    """Plain torch, nodes {0, 2} and {1} (3 nodes: a closure per node, or one pass) or {0, 2} and
    {1, 3} (Hadamard, one pass), from ranks that started apart: the ranks agree bit for bit, and
    equal the plain QNVBOptimizer in one process to 1e-10."""
    _assert_identical(ranks[0][case], ranks[1][case])
    single = _torch_nodes_fit(one_pass, quadrature, num_eval, distributed=False)
    for key in ("mu", "sigma", "net"):
        _assert_close(ranks[0][case][key], single[key], atol=1e-10)
    # the parameters moved: the comparison is not between two starting points
    assert (ranks[0][case]["mu"]["0.weight"] - _net()[0].weight).abs().max() > 1e-3
    torch.testing.assert_close(ranks[0][case]["losses"], single["losses"], rtol=1e-12, atol=0)


def test_node_parallel_qnvb_optimizer_resumes_exactly(ranks):
    """``state_dict`` saved by rank 0 after 3 steps, loaded by every rank into a fresh optimizer
    (the generator's state included): 3 more steps equal the uninterrupted run bit for bit."""
    for rank in ranks:
        resumed, straight = rank["torch_resumed"], rank["torch_uninterrupted"]
        for key in ("mu", "sigma", "net"):
            _assert_identical(resumed[key], straight[key])
        assert torch.equal(resumed["losses"], straight["losses"][STEPS // 2 :])
    _assert_identical(ranks[0]["torch_uninterrupted"]["mu"], ranks[0]["torch_closure"]["mu"])


def test_node_parallel_qnvb_optimizer_refusals_on_every_rank(ranks):
    for rank in ranks:
        assert "the rule has 1 nodes for 2 ranks" in rank["torch_refused"]["few"]
        assert "disagree on the quadrature nodes" in rank["torch_refused"]["unshared"]
    with pytest.raises(TypeError, match="check_nodes must be True or False"):
        NodeParallelQNVBOptimizer(_net().parameters(), check_nodes="yes")


def test_checkpoint_resumes_exactly(ranks):
    """Saved by rank 0 after 3 steps (QNVB's states gathered from the ranks that own them, with
    ``shard_update``), restored in a fresh fit: 3 more steps equal bit for bit the run that never
    stopped; restored in one process (every block updated there), equal to 1e-10."""
    for rank in ranks:
        _assert_identical(rank["resumed"]["params"], rank["uninterrupted"]["params"])
        _assert_identical(rank["resumed"]["qnvb"], rank["uninterrupted"]["qnvb"])
        assert torch.equal(rank["resumed"]["losses"], rank["uninterrupted"]["losses"][STEPS // 2 :])
    alone = _bnn_fit("data", 12, steps=STEPS - STEPS // 2, resume=ranks[0]["outdir"] / "ckpt.pt")
    _assert_close(alone["params"], ranks[0]["uninterrupted"]["params"], atol=1e-10)


def test_ranks_that_draw_different_nodes_all_raise(ranks):
    for rank in ranks:
        assert rank["disagree"] is not None
        assert "disagree on the quadrature nodes" in rank["disagree"]


def test_example_script_resumes_exactly_in_one_process(load_script, tmp_path):
    """``examples/distributed_bnn.py`` as ``python`` runs it (a world of one rank): 4 steps, a
    checkpoint, 4 more from it give the test RMSE of 8 steps in one go, bit for bit."""
    example = load_script("examples/distributed_bnn.py")
    ckpt = str(tmp_path / "fit.pt")
    straight = example.main(["--steps", "8", "--batch", "16"])
    example.main(["--steps", "4", "--batch", "16", "--checkpoint", ckpt])
    resumed = example.main(["--steps", "4", "--batch", "16", "--resume", ckpt])
    assert resumed == straight
    assert example.main(["--steps", "7", "--batch", "16"]) != straight


def test_local_latents_node_parallel_or_refused_on_every_rank(ranks):
    """Node parallel: all rows on every rank, a local latent is fitted as by one process. Data
    parallel: its rows differ between the ranks, and every rank refuses it."""
    _assert_identical(ranks[0]["local_nodes"], ranks[1]["local_nodes"])
    _assert_close(ranks[0]["local_nodes"], _local_fit("nodes"), atol=1e-10)
    for rank in ranks:
        assert rank["local"] is not None
        assert "the rows of their local latents" in rank["local"]


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="parallel must be one of"):
        DistributedQuadratureELBO(parallel="rows")
    with pytest.raises(TypeError, match="check_nodes must be True or False"):
        DistributedQuadratureELBO(check_nodes=1)
    with pytest.raises(TypeError, match="wraps a pyro optimizer"):
        DistributedOptimizer(torch.optim.SGD)
    with pytest.raises(TypeError, match="shard_update=True divides QNVB"):
        DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), shard_update=True)
    with pytest.raises(TypeError, match="sieve ranks all blocks together"):
        DistributedOptimizer(SparseQNVB(num_epochs=3, steps_per_epoch=3), shard_update=True)

    class TimedQNVB(QNVB):  # a subclass of QNVB (the benchmarks time the update through one)
        pass

    assert DistributedOptimizer(TimedQNVB(), shard_update=True).shard_update
    elbo = DistributedQuadratureELBO()
    elbo.share = 1.5
    with pytest.raises(ValueError, match=r"share must be a number in \(0, 1\]"):
        elbo._factor()
    nodes = DistributedQuadratureELBO(parallel="nodes")
    nodes.share = 0.5
    with pytest.raises(ValueError, match="with parallel='nodes' every rank has all rows"):
        nodes._factor()
    # one process: the whole batch, and the classes are the plain ones
    assert world() == (0, 1)
    assert shard(5) == slice(0, 5)
    with pytest.raises(ValueError, match="num_rows must be an integer >= the world size 1"):
        shard(0)


def test_broadcast_generator_global(ranks):
    """``broadcast_generator()`` gives every rank the state of rank 0's global generator."""
    torch.manual_seed(0)
    expected = torch.rand(4, dtype=torch.float64)
    for rank in ranks:
        assert torch.equal(rank["global_draw"], expected)
