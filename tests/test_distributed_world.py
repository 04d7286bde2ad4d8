"""Ranks that stop being one fit: an optimizer not wrapped in ``DistributedOptimizer`` (each rank
steps on its own gradients), and a process group destroyed or replaced between steps (each rank
went on alone), under Pyro and with ``NodeParallelQNVBOptimizer``. Two gloo processes, one spawn,
a few seconds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pyro
import pytest
import torch
import torch.distributed as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import init_to_sample

from pyro_quadvi import QNVB, AutoMeanFieldNormal
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    NodeParallelQNVBOptimizer,
    shard,
    world,
)
from pyro_quadvi.optim import QNVBOptimizer, module_loss
from pyro_quadvi.testing.compare import equal_nested
from pyro_quadvi.testing.ranks import outcome

TIMEOUT_S = 60
ROWS = 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    return x, x.sum(-1) + 0.1 * torch.randn(ROWS, generator=g, dtype=torch.float64)


def _model(rows: torch.Tensor) -> None:
    x, y = _data()
    zero = torch.zeros(3, dtype=torch.float64)
    w = pyro.sample("w", pyro.distributions.Normal(zero, 1.0).to_event(1))
    with pyro.plate("data", ROWS, subsample=rows):
        pyro.sample("obs", pyro.distributions.Normal((x[rows] * w).sum(-1), 0.5), obs=y[rows])


def _svi(wrapped: bool, elbo=None) -> SVI:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(_model, init_loc_fn=init_to_sample)
    optim = DistributedOptimizer(QNVB(lr=0.5)) if wrapped else QNVB(lr=0.5)
    return SVI(_model, guide, optim, elbo or DistributedQuadratureELBO(vectorize=True))


def _fit(wrapped: bool, steps: int = 4) -> dict:
    """Data parallel: each rank steps on its shard of the 8 rows (all of them in one process)."""
    svi, rows = _svi(wrapped), torch.arange(ROWS)[shard(ROWS)]
    out: dict = {"losses": [], "error": None}
    for _ in range(steps):
        try:
            out["losses"].append(svi.step(rows))
        except RuntimeError as error:
            out["error"] = str(error)
            break
    out["params"] = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return out


def _params() -> dict:
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def _torch_optimizer(cls: type = NodeParallelQNVBOptimizer) -> tuple:
    """``cls`` over a 3-1 linear net (Hadamard, 4 nodes) and its one-pass step on all 8 rows."""
    torch.manual_seed(3)
    net = torch.nn.Linear(3, 1).double()
    optimizer = cls(
        net.named_parameters(), likelihood_weight=ROWS, quadrature="hadamard", num_eval=4
    )
    x, y = _data()
    loss_fn = module_loss(net, torch.nn.functional.mse_loss)
    return optimizer, lambda: optimizer.step(loss_fn=loss_fn, batch=(x, y[:, None]))


def _torch_state(optimizer: QNVBOptimizer) -> dict:
    """The parameters' values and the optimizer's state dict (copies)."""
    params = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
    return {"params": params, "state": copy.deepcopy(optimizer.state_dict())}


def _world_lost(outdir: Path) -> dict:
    """A step in the world of two, then steps with no process group, then in a world of one rank
    (each rank its own): the ELBO, the optimizer (under Pyro's Trace_ELBO) and
    NodeParallelQNVBOptimizer refuse them. The latter's state dict after one step of two ranks,
    restored in one process (no process group), takes the step the two ranks took next."""
    rank = world()[0]
    rows = torch.arange(ROWS)[shard(ROWS)]
    svi, plain = _svi(True), _svi(True, Trace_ELBO())
    svi.step(rows), plain.step(rows)
    nodes, node_step = _torch_optimizer()
    start = _torch_state(nodes)["params"]
    node_step()
    saved = copy.deepcopy(nodes.state_dict())
    node_step()
    out = {"node_start": start, "node_two_ranks": _torch_state(nodes)}
    dist.destroy_process_group()
    out["before"] = _params()
    out["gone"] = outcome(lambda: svi.step(rows))
    out["gone_optim"] = outcome(lambda: plain.step(rows))
    out["after"] = _params()
    out["node_gone"] = outcome(node_step)
    out["node_after"] = _torch_state(nodes)
    for cls in (NodeParallelQNVBOptimizer, QNVBOptimizer):
        restored, restored_step = _torch_optimizer(cls)
        restored.load_state_dict(saved)
        restored_step()
        out[f"restored {cls.__name__}"] = _torch_state(restored)
    dist.init_process_group(
        "gloo", init_method=f"file://{outdir / f'.solo{rank}'}", rank=0, world_size=1
    )
    out["changed"] = outcome(lambda: svi.step(rows))
    out["node_changed"] = outcome(node_step)
    return out


def _scenarios(outdir: Path) -> dict:
    out = {"unwrapped": _fit(False), "wrapped": _fit(True)}
    out.update(_world_lost(outdir))  # (last: it destroys the process group)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("world"), timeout_s=TIMEOUT_S)


def test_an_unwrapped_optimizer_is_refused_at_the_next_step_on_every_rank(ranks):
    """Plain QNVB: the first step (same start) runs; each rank then steps on its own shard's
    gradients, and the second step's collective finds the guide's parameters apart."""
    for rank in ranks:
        assert len(rank["unwrapped"]["losses"]) == 1
        message = rank["unwrapped"]["error"]
        assert message.startswith("the ranks disagree on the values of the guide's parameters")
        assert (
            "they agreed at this ELBO's previous step, so the optimizer's step since moved them "
            "differently on the ranks. Either it is not wrapped, and each rank stepped on its own "
            "gradients: wrap it, SVI(model, guide, DistributedOptimizer(QNVB()), elbo), so that "
            "every rank takes the same step from the means over the ranks" in message
        )


def test_a_wrapped_optimizer_still_equals_one_process(ranks):
    for rank in ranks:
        assert rank["wrapped"]["error"] is None
    single = _fit(True)
    for key, value in single["params"].items():
        torch.testing.assert_close(ranks[0]["wrapped"]["params"][key], value, rtol=0, atol=1e-10)
        assert torch.equal(ranks[1]["wrapped"]["params"][key], ranks[0]["wrapped"]["params"][key])
    torch.testing.assert_close(
        torch.tensor(ranks[0]["wrapped"]["losses"]),
        torch.tensor(single["losses"]),
        rtol=1e-12,
        atol=0,
    )


def test_steps_after_the_process_group_is_destroyed_are_refused(ranks):
    for rank in ranks:
        assert rank["gone"] == (
            "RuntimeError",
            "DistributedQuadratureELBO was first used in a world of 2 ranks and now finds no "
            "process group (torch.distributed.destroy_process_group() was called); it does not "
            "go on as another world, which would fit another problem. Build a new "
            "DistributedQuadratureELBO (and DistributedOptimizer) after init_process_group; to "
            "evaluate in one process, use a plain QuadratureELBO with the same rule",
        )
        kind, message = rank["gone_optim"]
        assert kind == "RuntimeError"
        assert message.startswith("DistributedOptimizer was first used in a world of 2 ranks")
        assert message.endswith("to step in one process, use the wrapped optimizer itself")
        for key, value in rank["before"].items():  # nothing stepped
            assert torch.equal(rank["after"][key], value), key
        assert rank["changed"][1].startswith(
            "DistributedQuadratureELBO was first used in a world of 2 ranks and now finds a "
            "world of 1 rank(s);"
        )


def test_node_parallel_steps_after_the_process_group_is_destroyed_are_refused(ranks):
    """NodeParallelQNVBOptimizer went on as a QNVBOptimizer of its own on each rank; now it
    refuses, naming the fix, with its parameters and state as they were."""
    for rank in ranks:
        assert rank["node_gone"] == (
            "RuntimeError",
            "NodeParallelQNVBOptimizer was first used in a world of 2 ranks and now finds no "
            "process group (torch.distributed.destroy_process_group() was called); it does not "
            "go on as another world, which would fit another problem. Build a new "
            "NodeParallelQNVBOptimizer after init_process_group; to step in one process, use a "
            "QNVBOptimizer (either takes this one's state_dict())",
        )
        assert rank["node_changed"][1].startswith(
            "NodeParallelQNVBOptimizer was first used in a world of 2 ranks and now finds a "
            "world of 1 rank(s);"
        )
        before, after = rank["node_two_ranks"], rank["node_after"]
        for p, q in zip(before["params"], after["params"], strict=True):
            assert torch.equal(p, q)
        assert equal_nested(before["state"], after["state"])


def test_a_node_parallel_state_dict_resumes_in_one_process(ranks):
    """The state dict of two ranks after one step, loaded into a NodeParallelQNVBOptimizer or a
    QNVBOptimizer built with no process group: their step equals the one the two ranks took
    next, to the rounding of the other order of the node sums."""
    two_ranks = ranks[0]["node_two_ranks"]
    for rank in ranks:
        plain = rank["restored QNVBOptimizer"]
        node = rank["restored NodeParallelQNVBOptimizer"]
        assert equal_nested(node, plain)
        for p, q, start in zip(
            plain["params"], two_ranks["params"], rank["node_start"], strict=True
        ):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
            assert (p - start).abs().max() > 1e-3  # (a step from the start, not the start)
