"""``pyro_quadvi.distributed`` on a GPU: NCCL's device rules, on the one GPU a test machine has.

NCCL refuses a CPU tensor in a collective ("Tensors must be CUDA"), and refuses two ranks on one
GPU ("Duplicate GPU detected"). So two parts:

* **A world of one NCCL rank** (the test process: ``init_process_group("nccl")`` on GPU 0). With
  one rank the package communicates nothing (every helper returns early at world size 1), so this
  checks that the wrappers run on CUDA under an NCCL default group and change nothing: each run
  equals the plain run (``QuadratureELBO`` + ``QNVB``, ``QNVBOptimizer``) **bit for bit**, since
  the same operations run in the same order. And that ``collective_device`` is the GPU, where
  NCCL really refuses a CPU tensor.
* **Two ranks on the one GPU** (spawned gloo processes, each on ``cuda:0``), where every
  collective the package makes is real. NCCL's rule is enforced there by hand: the package's
  ``dist.all_reduce`` / ``broadcast`` / ``all_gather`` refuse a tensor off the GPU as NCCL does
  (then gloo carries a host copy), and ``dist.get_backend`` answers ``"nccl"``, so
  ``collective_device`` puts its tensors where NCCL needs them. The runs are compared with one
  process on the GPU: to ``atol=1e-10`` in float64 where the ranks split a sum (two shards' terms,
  or two halves of the nodes, added in another order: rounding, about 1e-16 relative per step,
  amplified by QNVB's curvature read over ``sigma = 0.05``; ``tests/test_distributed.py`` holds
  gloo on the CPU to the same), bit for bit where they do not (every rank's mean of equal terms,
  a sharded update, a resumed run).

The rule is the deterministic ``hadamard`` with 4 nodes: nodes ``{0, 2}`` and ``{1, 3}`` with two
ranks. Without CUDA or NCCL the module is skipped (CI has neither).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pyro
import pyro.distributions as pdist
import pytest
import torch
import torch.distributed as dist
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    NodeParallelQNVBOptimizer,
    all_reduce_mean_,
    broadcast_generator,
    check_agreement,
    load_checkpoint,
    save_checkpoint,
    shard,
    world,
)
from pyro_quadvi.distributed.comm import collective_device
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer
from pyro_quadvi.testing.compare import equal_nested
from pyro_quadvi.testing.ranks import outcome
from pyro_quadvi.testing.steps import mse_steps

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(),
    reason="needs a CUDA device and NCCL",
)

BACKEND = "nccl"
DEVICE = torch.device("cuda", 0)
OFF_DEVICE = torch.device("cpu")  # where NCCL refuses a tensor
F64 = torch.float64
ROWS = 16
STEPS = 4
TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def _fresh():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def _host(value):
    """Nested dicts, lists and tuples with every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host(v) for v in value)
    return value


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-10, msg=key)


def _store() -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in pyro.get_param_store().items()}


# ------------------------------------------------------------------------------- the problems
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """CPU-made data on the GPU (the same numbers in every process)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 3, generator=g, dtype=F64)
    y = torch.sin(x.sum(-1, keepdim=True)) + 0.1 * torch.randn(ROWS, 1, generator=g, dtype=F64)
    return x.to(DEVICE), y.to(DEVICE)


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DEVICE, F64)


def _bnn_fit(
    parallel: str | None,
    *,
    shard_update: bool = False,
    steps: int = STEPS,
    save: Path | None = None,
    resume: Path | None = None,
) -> dict:
    """QNVB on a 3-4-1 BayesianModule on the GPU; ``parallel=None``: the plain QuadratureELBO and
    QNVB on all rows, else the distributed wrappers on this rank's part."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    if parallel == "data":
        part = shard(ROWS)
        x, y = x[part], y[part]
    bnn = BayesianModule(_net(), priors.Normal(1.0), likelihoods.Gaussian(ROWS, scale=0.3))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=0.05)
    if parallel is None:
        elbo, optim = QuadratureELBO("hadamard", 4, vectorize=True), QNVB(lr=0.5)
    else:
        elbo = DistributedQuadratureELBO("hadamard", 4, vectorize=True, parallel=parallel)
        optim = DistributedOptimizer(QNVB(lr=0.5), shard_update=shard_update)
    svi = SVI(bnn, guide, optim, elbo)
    if resume is not None:
        guide(x, y)  # the guide's parameters exist; the checkpoint then overwrites them
        load_checkpoint(resume, optim)
    losses = []
    for step in range(steps):
        losses.append(svi.step(x, y))
        if save is not None and step == steps // 2 - 1:
            save_checkpoint(save, optim)
    for name, value in pyro.get_param_store().items():
        # the ELBO's position in its rule's sequence is a host counter, on the CPU by design
        assert value.device == (torch.device("cpu") if name.endswith(".step") else DEVICE), name
    return {
        "losses": torch.tensor(losses, dtype=F64),
        "params": _store(),
        "qnvb": _host(optim.get_state()["qnvb"]["pairs"]),
    }


def _local_model(x, y, index):
    """A global ``w`` and a local ``z`` per row, in a plate subsampled by CUDA indices."""
    zero = torch.zeros((), dtype=F64, device=x.device)
    w = pyro.sample("w", pdist.Normal(zero.expand(3), 1.0).to_event(1))
    with pyro.plate("data", ROWS, subsample=index):
        z = pyro.sample("z", pdist.Normal(zero, 1.0))
        mean = (x[index] * w).sum(-1) + z  # w: (3,), or (K, 1, 3) under the nodes' plate
        pyro.sample("obs", pdist.Normal(mean, 0.5), obs=y[index, 0])


def _local_plates(x, y, index):
    return pyro.plate("data", ROWS, subsample=index)


def _local_fit(kind: str, *, distributed: bool) -> dict:
    """Four steps on 8 of the 16 rows (the same rows on every rank): ``kind`` "quadrature"
    (node parallel when ``distributed``: moments published, rows in the fingerprint) or "trace"
    (Trace_ELBO: no moments, QNVB reads the gradients; the guide's recorded rows are compared)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    g = torch.Generator().manual_seed(2)
    indices = [torch.randperm(ROWS, generator=g)[:8].to(DEVICE) for _ in range(STEPS)]
    guide = AutoMeanFieldNormal(_local_model, create_plates=_local_plates, init_scale=0.05)
    if kind == "trace":
        elbo = Trace_ELBO()
    elif distributed:
        elbo = DistributedQuadratureELBO("hadamard", 4, vectorize=True, parallel="nodes")
    else:
        elbo = QuadratureELBO("hadamard", 4, vectorize=True)
    optim = DistributedOptimizer(QNVB(lr=0.5)) if distributed else QNVB(lr=0.5)
    svi = SVI(_local_model, guide, optim, elbo)
    losses = [svi.step(x, y, index) for index in indices]
    return {"losses": torch.tensor(losses, dtype=F64), "params": _store()}


def _torch_optimizer(cls: type, net: nn.Module) -> QNVBOptimizer:
    """``QNVBOptimizer`` or ``NodeParallelQNVBOptimizer`` over ``net``, Hadamard nodes."""
    return cls(
        net.named_parameters(),
        likelihood_weight=ROWS,
        init_sigma=0.05,
        prior_precision=1.0,
        quadrature="hadamard",
        num_eval=4,
    )


def _torch_fit(closure: bool, *, distributed: bool) -> dict:
    """The plain-torch optimizer on the GPU, Hadamard nodes; the distributed ranks start from
    different weights (the constructor broadcasts rank 0's)."""
    x, y = _data()
    net = _net()
    with torch.no_grad():
        for p in net.parameters():
            p += world()[0]
    optimizer = _torch_optimizer(NodeParallelQNVBOptimizer if distributed else QNVBOptimizer, net)
    losses = mse_steps(optimizer, net, x, y, STEPS, closure=closure, vectorize=True)
    params = dict(net.named_parameters())
    assert all(optimizer.state[p]["mu"].device == DEVICE for p in params.values())
    return _host(
        {
            "losses": losses,
            "mu": {n: optimizer.state[p]["mu"] for n, p in params.items()},
            "sigma": {n: optimizer.state[p]["sigma"] for n, p in params.items()},
            "net": params,
        }
    )


def _helpers() -> dict:
    """The plain helpers on GPU tensors; rank ``r`` starts from values that differ by rank."""
    rank, _ = world()
    torch.manual_seed(rank)
    torch.rand(1, device=DEVICE)  # CUDA's generator started, and apart on the ranks
    broadcast_generator()
    draw = torch.rand(4, dtype=F64, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(11 + rank)
    broadcast_generator(generator)
    generated = torch.rand(4, dtype=F64, device=DEVICE, generator=generator)
    tensors = [
        torch.tensor([1.0, 2.0], dtype=F64, device=DEVICE) * (rank + 1),
        torch.tensor([[3.0]], dtype=torch.float32, device=DEVICE) * (rank + 1),
    ]
    all_reduce_mean_(tensors)
    check_agreement(torch.tensor([0.25, 4.0], device=DEVICE), "equal values")
    try:
        check_agreement(torch.tensor([0.25, float(rank)], device=DEVICE), "values by rank")
        refused = None
    except RuntimeError as error:
        refused = str(error)
    part = shard(5)
    return _host(
        {
            "draw": draw,
            "generated": generated,
            "mean": tensors,
            "refused": refused,
            "shard": (part.start, part.stop),
        }
    )


def _refused_step() -> dict:
    """``NodeParallelQNVBOptimizer`` on the GPU whose closure raises on rank 1 at the second step:
    the failure travels in a flag inside the step's all-reduce, which NCCL takes only on the
    GPU; then one more step."""
    x, y = _data()
    net = _net()
    optimizer = _torch_optimizer(NodeParallelQNVBOptimizer, net)

    def closure(failing: bool = False):
        if failing:
            raise RuntimeError("a bad row")
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    before = copy.deepcopy(optimizer.state_dict())
    refused = outcome(lambda: optimizer.step(lambda: closure(world()[0] == 1)))
    after = copy.deepcopy(optimizer.state_dict())
    optimizer.step(closure)
    return _host(
        {
            "refused": refused,
            "before": before,
            "after": after,
            "net": dict(net.named_parameters()),
        }
    )


# ------------------------------------------------------------------ two ranks on the one GPU
def _loaded_onto_own_device(path: Path) -> dict:
    """Rank 0 saves a param store of CUDA tensors; every rank loads it into a cleared store:
    each value's device, this rank's current device, and the values."""
    pyro.clear_param_store()
    pyro.param("w", torch.arange(3.0, dtype=F64, device=DEVICE))
    optim = pyro.optim.Adam({"lr": 0.1})
    save_checkpoint(path, optim)
    pyro.clear_param_store()
    load_checkpoint(path, optim)
    store = pyro.get_param_store()
    return {
        "current": torch.cuda.current_device(),
        "devices": {name: store[name].device for name in store.keys()},
        "w": store["w"].detach().cpu(),
    }


def _refuse_off_device(tensors: list[torch.Tensor], name: str) -> None:
    for t in tensors:
        if t.device.type != DEVICE.type:
            raise RuntimeError(f"{name}: Tensors must be CUDA and dense (got one on {t.device})")


def _as_nccl() -> None:
    """In a spawned gloo rank: the package's tensor collectives refuse a tensor off the GPU as
    NCCL does, then gloo carries a host copy; ``dist.get_backend`` answers NCCL's name. Torch's
    own (``all_gather_object``, ``broadcast_object_list``, ``barrier``) call theirs directly."""
    real_all_reduce, real_broadcast, real_all_gather = (
        dist.all_reduce,
        dist.broadcast,
        dist.all_gather,
    )

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _refuse_off_device([tensor], "all_reduce")
        host = tensor.cpu()
        real_all_reduce(host, op=op, group=group)
        tensor.copy_(host)

    def broadcast(tensor, src, group=None, async_op=False):
        _refuse_off_device([tensor], "broadcast")
        host = tensor.cpu()
        real_broadcast(host, src=src, group=group)
        tensor.copy_(host)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        _refuse_off_device([*tensor_list, tensor], "all_gather")
        hosts = [t.cpu() for t in tensor_list]
        real_all_gather(hosts, tensor.cpu(), group=group)
        for t, host in zip(tensor_list, hosts):
            t.copy_(host)

    dist.all_reduce, dist.broadcast, dist.all_gather = all_reduce, broadcast, all_gather
    dist.get_backend = lambda group=None: BACKEND


def _scenarios(outdir: Path) -> dict:
    torch.cuda.set_device(DEVICE)
    _as_nccl()
    rank = world()[0]
    out = {
        "probe": outcome(lambda: dist.all_reduce(torch.ones(1, device=OFF_DEVICE))),
        "collective_device": str(collective_device()),
        "data": _bnn_fit("data"),
        "nodes": _bnn_fit("nodes"),
        "data_sharded": _bnn_fit("data", shard_update=True),
        "nodes_sharded": _bnn_fit("nodes", shard_update=True),
        "local_nodes": outcome(lambda: _local_fit("quadrature", distributed=True)),
        "local_trace": outcome(lambda: _local_fit("trace", distributed=True)),
        "torch_closure": _torch_fit(True, distributed=True),
        "torch_one_pass": _torch_fit(False, distributed=True),
        "helpers": _helpers(),
        "uninterrupted": _bnn_fit("data", shard_update=True, save=outdir / "ckpt.pt"),
    }
    out["resumed"] = _bnn_fit(
        "data", shard_update=True, steps=STEPS - STEPS // 2, resume=outdir / "ckpt.pt"
    )

    out["loaded"] = outcome(lambda: _loaded_onto_own_device(outdir / "cuda_store.pt"))

    def disagree():  # a random rule seeded apart: every rank raises, none hangs
        pyro.clear_param_store()
        x, y = _data()
        bnn = BayesianModule(_net(), priors.Normal(1.0), likelihoods.Gaussian(ROWS, scale=0.3))
        pyro.set_rng_seed(100 + rank)
        guide = AutoMeanFieldNormal(bnn)
        elbo = DistributedQuadratureELBO("blocked_simplex", parallel="nodes")
        SVI(bnn, guide, DistributedOptimizer(QNVB()), elbo).step(x, y)

    out["disagree"] = outcome(disagree)
    out["refused_step"] = _refused_step()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    """What each of two ranks on GPU 0 returned (one spawn for every scenario)."""
    outdir = tmp_path_factory.mktemp("nccl_ranks")
    return spawn_ranks(_scenarios, outdir, world_size=2, timeout_s=TIMEOUT_S)


def test_ranks_refuse_host_tensors_as_nccl_does(ranks):
    """The simulation is on: a CPU tensor in the package's all_reduce is refused; the package's
    own collective tensors go to the GPU."""
    for rank in ranks:
        kind, message = rank["probe"]
        assert kind == "RuntimeError" and "Tensors must be CUDA" in message
        assert rank["collective_device"] == str(DEVICE)


@pytest.mark.parametrize("mode", ["data", "nodes"])
def test_two_ranks_equal_one_process(ranks, mode):
    """Shards of 8 + 8 rows, or nodes {0, 2} and {1, 3}: the ranks agree bit for bit and equal
    the plain QuadratureELBO + QNVB on all 16 rows on the GPU to 1e-10; sharding the update
    changes no bit."""
    assert equal_nested(ranks[0][mode], ranks[1][mode])
    single = _bnn_fit(None)
    _assert_close(ranks[0][mode]["params"], single["params"])
    torch.testing.assert_close(ranks[0][mode]["losses"], single["losses"], rtol=1e-12, atol=0)
    assert (
        single["params"]["AutoMeanFieldNormal.locs.0.weight"] - _net()[0].weight.cpu()
    ).abs().max() > 1e-3  # the fit moved
    for rank in ranks:
        assert equal_nested(rank[f"{mode}_sharded"], rank[mode])


@pytest.mark.parametrize("kind", ["quadrature", "trace"])
def test_subsample_indices_on_the_gpu(ranks, kind):
    """A plate subsampled by CUDA indices, the same rows on both ranks: node parallel (moments
    published) or Trace_ELBO (QNVB reads the averaged gradients; the recorded rows are compared
    across ranks). Raised a device mismatch in the rows fingerprint before it stayed on the
    indices' device. Every rank's terms are equal (Trace_ELBO: the same draws), or the nodes
    are split: 1e-10."""
    case = f"local_{'nodes' if kind == 'quadrature' else 'trace'}"
    for rank in ranks:
        assert rank[case][0] == "ok", rank[case][1]
    assert equal_nested(ranks[0][case][1], ranks[1][case][1])
    single = _local_fit(kind, distributed=False)
    _assert_close(ranks[0][case][1]["params"], single["params"])


@pytest.mark.parametrize("case", ["torch_closure", "torch_one_pass"])
def test_node_parallel_qnvb_optimizer_two_ranks(ranks, case):
    """Ranks started apart: the constructor's broadcast gives both rank 0's weights, and the
    step's sums of nodes {0, 2} and {1, 3} equal QNVBOptimizer's four nodes to 1e-10."""
    assert equal_nested(ranks[0][case], ranks[1][case])
    single = _torch_fit(case == "torch_closure", distributed=False)
    for key in ("mu", "sigma", "net"):
        _assert_close(ranks[0][case][key], single[key])
    torch.testing.assert_close(ranks[0][case]["losses"], single["losses"], rtol=1e-12, atol=0)


def test_helpers_on_gpu_tensors(ranks):
    """``broadcast_generator`` sends rank 0's CUDA state (global, and of a CUDA generator);
    ``all_reduce_mean_`` of (1, 2) and (2, 4), float64, and 3 and 6, float32, is (1.5, 3) and
    4.5; ``check_agreement`` passes equal values and refuses others on both ranks."""
    torch.manual_seed(0)
    torch.rand(1, device=DEVICE)
    expected = torch.rand(4, dtype=F64, device=DEVICE).cpu()
    generator = torch.Generator(device=DEVICE).manual_seed(11)
    generated = torch.rand(4, dtype=F64, device=DEVICE, generator=generator).cpu()
    for rank, part in zip(ranks, [(0, 3), (3, 5)]):
        helpers = rank["helpers"]
        assert torch.equal(helpers["draw"], expected)
        assert torch.equal(helpers["generated"], generated)
        assert helpers["mean"][0].tolist() == [1.5, 3.0]
        assert helpers["mean"][1].dtype == torch.float32 and helpers["mean"][1].item() == 4.5
        assert (
            "the ranks disagree on values by rank (entry 1: from 0.0 to 1.0" in (helpers["refused"])
        )
        assert helpers["shard"] == part


def test_checkpoint_resumes_exactly_two_ranks(ranks):
    """Saved after 2 steps (shard_update: QNVB's states gathered from their owners), restored
    into a fresh fit: the next 2 steps equal the run that never stopped, bit for bit."""
    for rank in ranks:
        assert equal_nested(rank["resumed"]["params"], rank["uninterrupted"]["params"])
        assert equal_nested(rank["resumed"]["qnvb"], rank["uninterrupted"]["qnvb"])
        assert torch.equal(rank["resumed"]["losses"], rank["uninterrupted"]["losses"][STEPS // 2 :])
    assert equal_nested(ranks[0]["uninterrupted"], ranks[0]["data_sharded"])


def test_checkpoint_of_cuda_tensors_loads_onto_each_ranks_current_device(ranks):
    """The map_location path on real CUDA storages: after load, the param store's tensors are on
    each rank's ``torch.cuda.current_device()`` with the saved values. (Both ranks share GPU 0
    here, so rank 0's device and rank 1's own cannot differ.)"""
    for rank in ranks:
        kind, loaded = rank["loaded"]
        assert kind == "ok", loaded
        assert loaded["devices"] == {"w": torch.device("cuda", loaded["current"])}
        assert loaded["w"].tolist() == [0.0, 1.0, 2.0]


def test_ranks_that_draw_different_nodes_all_raise(ranks):
    for rank in ranks:
        kind, message = rank["disagree"]
        assert kind == "RuntimeError" and "disagree on the quadrature nodes" in message, message


def test_a_closure_raising_on_one_rank_raises_on_every_rank_on_the_gpu(ranks):
    """Rank 1 raises its own error, rank 0 one naming rank 1 and its message (at once: a wait
    for the timeout would fail the fixture); every rank's state dict is unchanged bit for bit,
    and after one more step the ranks still agree."""
    step = "NodeParallelQNVBOptimizer.step: evaluating the loss (the closure or loss_fn)"
    assert ranks[1]["refused_step"]["refused"] == ("RuntimeError", "a bad row")
    assert ranks[0]["refused_step"]["refused"] == (
        "RuntimeError",
        f"{step} raised on rank(s) [1]; rank 1: a bad row",
    )
    for rank in ranks:
        assert equal_nested(rank["refused_step"]["before"], rank["refused_step"]["after"])
    assert equal_nested(ranks[0]["refused_step"]["net"], ranks[1]["refused_step"]["net"])


# ------------------------------------------------------------------- a world of one NCCL rank
@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    """A process group of one NCCL rank on GPU 0, destroyed after the module's tests."""
    torch.cuda.set_device(DEVICE)
    store = tmp_path_factory.mktemp("nccl_world") / "store"
    dist.init_process_group(BACKEND, init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_world_of_one_collective_device(nccl_world):
    """The helpers see one rank; their collectives' device is the GPU, where NCCL itself (not a
    simulation) refuses a CPU tensor even with one rank."""
    assert dist.get_backend() == BACKEND
    assert world() == (0, 1)
    assert collective_device() == DEVICE
    with pytest.raises((RuntimeError, ValueError), match=r"CUDA|device type cpu"):
        dist.all_reduce(torch.ones(1, device=OFF_DEVICE))
    values = torch.tensor([1.0, 2.0], dtype=F64, device=DEVICE)
    all_reduce_mean_([values])
    assert values.tolist() == [1.0, 2.0]
    check_agreement(values, "one rank's values")
    assert shard(5) == slice(0, 5)
    generator = torch.Generator(device=DEVICE).manual_seed(5)
    state = generator.get_state()
    broadcast_generator(generator)
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize(
    "mode, shard_update",
    [("data", False), ("nodes", False), ("data", True), ("nodes", True)],
)
def test_world_of_one_equals_the_plain_run(nccl_world, mode, shard_update):
    """With one rank the mean over ranks is the rank's value: the same run, bit for bit."""
    got = _bnn_fit(mode, shard_update=shard_update)
    assert equal_nested(got, _bnn_fit(None))


@pytest.mark.parametrize("kind", ["quadrature", "trace"])
def test_world_of_one_subsampled_plate(nccl_world, kind):
    got = _local_fit(kind, distributed=True)
    expected = _local_fit(kind, distributed=False)
    assert equal_nested(got, expected)
    assert expected["params"]["AutoMeanFieldNormal.locs.z"].abs().max() > 1e-3  # moved


@pytest.mark.parametrize("closure", [True, False], ids=["closure", "one-pass"])
def test_world_of_one_node_parallel_qnvb_optimizer(nccl_world, closure):
    distributed = _torch_fit(closure, distributed=True)
    assert equal_nested(distributed, _torch_fit(closure, distributed=False))


def test_world_of_one_checkpoint_resumes_exactly(nccl_world, tmp_path):
    """save_checkpoint / load_checkpoint of a GPU fit (CUDA's random state included) under NCCL:
    the resumed half equals the uninterrupted run bit for bit."""
    straight = _bnn_fit("data", shard_update=True, save=tmp_path / "ckpt.pt")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["cuda_rng"] is not None
    resumed = _bnn_fit(
        "data", shard_update=True, steps=STEPS - STEPS // 2, resume=tmp_path / "ckpt.pt"
    )
    assert equal_nested(resumed["params"], straight["params"])
    assert equal_nested(resumed["qnvb"], straight["qnvb"])
    assert torch.equal(resumed["losses"], straight["losses"][STEPS // 2 :])
