"""Ranks that would drift apart while reporting the same loss (user trial t19), on two gloo
processes, one spawn for all the scenarios (a few seconds):

* ``NodeParallelQNVBOptimizer`` with other settings (``lr``, ``likelihood_weight``) or other
  parameters (loaded on rank 0 only after the optimizer was built) on each rank: every rank took
  its own step from the same summed moments. Now every rank refuses the step, naming what
  differs, and nothing changes.
* ``QNVBOptimizer`` under ``DistributedDataParallel`` with shards of 7 + 6 rows: DDP averages the
  ranks' mean gradients, which weights the rows unequally; the closure's loss times
  ``W * B_r / B`` (docs/scaling.md) gives the fit of one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pyro_quadvi.distributed import NodeParallelQNVBOptimizer, shard, world
from pyro_quadvi.optim import QNVBOptimizer, module_loss
from pyro_quadvi.testing.ranks import outcome

ROWS = 13
TIMEOUT_S = 60


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    return x, y + 0.3 * torch.randn(ROWS, 1, generator=g, dtype=torch.float64)


def _net(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()


def _node_parallel(case: str) -> dict:
    """Two one-pass steps of NodeParallelQNVBOptimizer (a random rule, with a generator) where
    rank 1 differs from rank 0 by ``case``; what the refusal left behind."""
    rank = world()[0]
    net = _net()
    optimizer = NodeParallelQNVBOptimizer(
        net.named_parameters(),
        likelihood_weight=ROWS * (1 + rank if case == "weight" else 1),
        lr=0.5 if case == "lr" and rank == 1 else 1.0,
        generator=torch.Generator().manual_seed(11),
    )
    if case == "loaded" and rank == 0:  # "pretrained" weights on rank 0 only, after the build
        net.load_state_dict(_net(seed=42).state_dict())
    loss_fn = module_loss(net, torch.nn.functional.mse_loss)
    before = [p.detach().clone() for p in net.parameters()]
    generator = optimizer.generator.get_state()
    result = outcome(lambda: float(optimizer.step(loss_fn=loss_fn, batch=_data())))
    return {
        "result": result,
        "unchanged": all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
        and torch.equal(optimizer.generator.get_state(), generator)
        and optimizer.num_steps == 0,
    }


def _scheduled() -> list[tuple[float, float]]:
    """Four one-pass steps of NodeParallelQNVBOptimizer with a cosine schedule stepping ``lr``
    alike on every rank: ``(loss, lr)`` after each."""
    net = _net()
    optimizer = NodeParallelQNVBOptimizer(
        net.named_parameters(), likelihood_weight=ROWS, generator=torch.Generator().manual_seed(11)
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
    loss_fn = module_loss(net, torch.nn.functional.mse_loss)
    out = []
    for _ in range(4):
        loss = float(optimizer.step(loss_fn=loss_fn, batch=_data()))
        schedule.step()
        out.append((loss, optimizer.param_groups[0]["lr"]))
    return out


def _ddp_fit(weighted: bool, steps: int = 4) -> list[torch.Tensor]:
    """docs/scaling.md's DDP block on this rank's shard of 13 rows (7 + 6 on two ranks), the
    closure's loss times ``W * B_r / B`` where ``weighted``; the means after ``steps`` steps."""
    size = world()[1]
    x, y = _data()
    net = _net()
    if size > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = QNVBOptimizer(
        net.parameters(), likelihood_weight=ROWS, quadrature="hadamard", num_eval=4
    )
    rows = shard(len(x))
    factor = size * len(x[rows]) / len(x) if weighted else 1.0

    def closure():
        loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows]) * factor
        loss.backward()
        return loss

    for _ in range(steps):
        optimizer.step(closure)
    return [optimizer.state[p]["mu"].clone() for p in net.parameters()]


def _scenarios(outdir: Path) -> dict:
    out = {case: _node_parallel(case) for case in ("lr", "weight", "loaded")}
    out["ddp"] = _ddp_fit(weighted=False)
    out["ddp_weighted"] = _ddp_fit(weighted=True)
    out["scheduled"] = outcome(_scheduled)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("drift"), timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "lr",
            "NodeParallelQNVBOptimizer: the ranks differ in lr of parameter group 0: [1.0, 0.5] "
            "on ranks 0..1; every rank must build NodeParallelQNVBOptimizer with the same "
            "settings",
        ),
        (
            "weight",
            "the ranks differ in likelihood_weight of the optimizer: [13.0, 26.0] on ranks 0..1",
        ),
        (
            "loaded",
            "the ranks disagree on the parameters' means (entry 0: from ",
        ),
    ],
)
def test_node_parallel_ranks_that_differ_refused(ranks, case, message):
    """Every rank raises, naming what differs and the fix; the parameters, the step count and
    the generator are as before the step."""
    for rank in ranks:
        kind, text = rank[case]["result"]
        assert kind == "RuntimeError", text
        assert message in text
        assert "nothing was evaluated or changed by this step" in text
        assert rank[case]["unchanged"]


def test_node_parallel_settings_changed_alike_on_every_rank_step_on(ranks):
    """The settings checksum is of the values now: a scheduler stepping ``lr`` on every rank
    alike is no difference (each rank a refusal-free run, the same losses and rates)."""
    assert ranks[0]["scheduled"] == ranks[1]["scheduled"]
    kind, steps = ranks[0]["scheduled"]
    assert kind == "ok", steps
    assert [lr for _, lr in steps] == pytest.approx([0.8535534, 0.5, 0.1464466, 0.0], abs=1e-7)


def test_ddp_unequal_shards_weighted_equal_one_process(ranks):
    """7 + 6 rows: the docs' factor ``W * B_r / B`` gives one process's means (1e-10); without
    it, the ranks agree with each other but not with one process."""
    single = _ddp_fit(weighted=True)
    assert all(map(torch.equal, single, _ddp_fit(weighted=False)))  # W = 1: the factor is 1
    for a, b, s in zip(ranks[0]["ddp_weighted"], ranks[1]["ddp_weighted"], single):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, s, rtol=0, atol=1e-10)
    plain = torch.cat([m.flatten() for m in ranks[0]["ddp"]])
    assert (plain - torch.cat([s.flatten() for s in single])).abs().max() > 1e-2
