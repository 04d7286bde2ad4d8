"""What a user trial of the distributed API found, on two gloo ranks (one spawn for every case).

* A closure (or ``loss_fn``) of ``NodeParallelQNVBOptimizer`` that raised on one rank only left
  the other waiting in the step's all-reduce until the process group's timeout; afterwards the
  ranks' parameters differed.
* A rank outside a process group got ``world(g) == (-1, -1)`` and computed with it.
* ``all_reduce_mean_`` of tensors given in different orders on the ranks added unlike tensors.
* ``load_checkpoint`` overwrote the param store with another model's fit.
* ``load_checkpoint`` took one generator, while a run has a rule's and a minibatch generator.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pyro
import pytest
import torch
import torch.distributed as dist
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.optim import Adam

from pyro_quadvi import QNVB, AutoMeanFieldNormal
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    NodeParallelQNVBOptimizer,
    all_reduce_mean_,
    broadcast_generator,
    load_checkpoint,
    save_checkpoint,
    shard,
    world,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import module_loss
from pyro_quadvi.testing.compare import equal_nested
from pyro_quadvi.testing.ranks import outcome

TIMEOUT_S = 40  # a rank left waiting in a collective fails the test at this timeout
ROWS = 12


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(-1, keepdim=True))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()


def _node_parallel(fail_rank: int | None, one_pass: bool, steps: int = 3) -> dict:
    """``steps`` steps of ``NodeParallelQNVBOptimizer`` (a random rule, with a generator); at the
    second, the loss raises on ``fail_rank`` (``None``: nowhere), and the error is caught."""
    x, y = _data()
    net = _net()
    optimizer = NodeParallelQNVBOptimizer(
        net.named_parameters(),
        likelihood_weight=ROWS,
        quadrature="blocked_simplex",
        generator=torch.Generator().manual_seed(2),
    )
    rank = world()[0]
    criterion = torch.nn.MSELoss()
    loss_fn = module_loss(net, criterion)
    out: dict = {}
    for step in range(steps):
        failing = step == 1 and rank == fail_rank

        def closure(failing=failing):
            if failing:
                raise RuntimeError("a bad row")
            loss = criterion(net(x), y)
            loss.backward()
            return loss

        def failing_loss(params, xb, yb):
            raise ValueError("a bad row")

        if one_pass:
            chosen = failing_loss if failing else loss_fn
            run = lambda chosen=chosen: optimizer.step(loss_fn=chosen, batch=(x, y))  # noqa: E731
        else:
            run = lambda: optimizer.step(closure)  # noqa: E731
        if step == 1 and fail_rank is not None:
            out["before"] = copy.deepcopy(optimizer.state_dict())
            out["refused"] = outcome(run)
            out["after"] = copy.deepcopy(optimizer.state_dict())
            out["params_after"] = [p.detach().clone() for p in net.parameters()]
            out["means"] = [optimizer.state[p]["mu"].clone() for p in net.parameters()]
        else:
            run()
    out["final"] = [p.detach().clone() for p in net.parameters()]
    return out


NOT_A_MEMBER = (
    "RuntimeError",
    "global rank 0 is not a member of this process group; make these calls only on its ranks",
)


def _outside(outdir: Path) -> dict:
    """Every public entry point, called by global rank 0 with a group of rank 1 only."""
    only_1 = dist.new_group([1])  # (every rank makes new_group)
    if world()[0] == 1:
        return {"world": world(only_1), "shard": shard(ROWS, group=only_1)}
    optim = Adam({"lr": 0.1})
    calls = {
        "world": lambda: world(only_1),
        "shard": lambda: shard(ROWS, group=only_1),
        "broadcast_generator": lambda: broadcast_generator(torch.Generator(), group=only_1),
        "all_reduce_mean_": lambda: all_reduce_mean_([torch.ones(2)], group=only_1),
        "save_checkpoint": lambda: save_checkpoint(outdir / "nm.pt", optim, group=only_1),
        "load_checkpoint": lambda: load_checkpoint(outdir / "nm.pt", optim, group=only_1),
        "DistributedOptimizer": lambda: DistributedOptimizer(QNVB(), group=only_1),
        "DistributedQuadratureELBO": lambda: DistributedQuadratureELBO(group=only_1),
        "NodeParallelQNVBOptimizer": lambda: NodeParallelQNVBOptimizer(
            _net().named_parameters(), likelihood_weight=ROWS, group=only_1
        ),
    }
    out = {name: outcome(call) for name, call in calls.items()}
    out["written"] = (outdir / "nm.pt").exists()
    return out


def _orders() -> dict:
    """``all_reduce_mean_`` of a (2,) and a (3,) tensor: in the same order on both ranks, and in
    opposite orders."""
    rank = world()[0]
    a, b = torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank)
    same = outcome(lambda: all_reduce_mean_([a, b]))
    swapped = outcome(lambda: all_reduce_mean_([a, b] if rank == 0 else [b, a]))
    return {"same": same, "a": a.tolist(), "b": b.tolist(), "swapped": swapped}


def _other_model(outdir: Path) -> dict:
    """A checkpoint of ``w`` (2,) and ``v`` (3,) loaded into stores of other models, then into a
    fresh store."""
    pyro.clear_param_store()
    pyro.param("w", torch.full((2,), 3.0))
    pyro.param("v", torch.zeros(3))
    optim = Adam({"lr": 0.1})
    path = outdir / "model.pt"
    save_checkpoint(path, optim)
    out = {"path": str(path)}
    for case, live in [("shape", {"w": torch.ones(3)}), ("name", {"u": torch.ones(2)})]:
        pyro.clear_param_store()
        for name, value in live.items():
            pyro.param(name, value)
        out[case] = outcome(lambda: load_checkpoint(path, optim))
        out[f"{case}_kept"] = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.clear_param_store()
    pyro.param("w", torch.ones(2))  # a store the same model filled: loads
    out["same_model"] = outcome(lambda: load_checkpoint(path, optim))
    out["restored"] = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return out


def _bnn_fit(steps: int, save: Path | None = None, resume: Path | None = None) -> tuple:
    """QNVB with a random rule drawing from ``rule`` and minibatches of 6 drawn by ``batches``,
    data parallel; saved with both generators, or resumed with both (from other states)."""
    x, y = _data()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    bnn = BayesianModule(_net(), priors.Normal(1.0), likelihoods.Gaussian(ROWS, scale=0.3))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample, init_scale=0.05)
    rule, batches = torch.Generator().manual_seed(3), torch.Generator().manual_seed(1)
    elbo = DistributedQuadratureELBO("blocked_simplex", generator=rule, parallel="data")
    optim = DistributedOptimizer(QNVB(lr=0.5))
    svi = SVI(bnn, guide, optim, elbo)
    refused = None
    if resume is not None:
        guide(x[:2], y[:2])  # the parameters, as a resumed run makes them
        rule.manual_seed(99)
        batches.manual_seed(98)
        refused = outcome(lambda: load_checkpoint(resume, optim, generator=rule))
        load_checkpoint(resume, optim, generator=[rule, batches])
    losses = []
    for _ in range(steps):
        rows = torch.randperm(ROWS, generator=batches)[:6]
        rows = rows[shard(len(rows))]
        losses.append(svi.step(x[rows], y[rows]))
    if save is not None:
        save_checkpoint(save, optim, generator=(rule, batches))
    store = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return losses, store, refused


def _scenarios(outdir: Path) -> dict:
    out = {
        "closure": _node_parallel(fail_rank=1, one_pass=False),
        "one_pass": _node_parallel(fail_rank=0, one_pass=True),
        "clean_closure": _node_parallel(fail_rank=None, one_pass=False, steps=2),
        "clean_one_pass": _node_parallel(fail_rank=None, one_pass=True, steps=2),
        "outside": _outside(outdir),
        "orders": _orders(),
        "other_model": _other_model(outdir),
        "full": _bnn_fit(4),
    }
    _bnn_fit(2, save=outdir / "fit.pt")
    out["resumed"] = _bnn_fit(2, resume=outdir / "fit.pt")
    out["dir"] = str(outdir)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("user_fixes"), timeout_s=TIMEOUT_S)


STEP = "NodeParallelQNVBOptimizer.step: evaluating the loss (the closure or loss_fn)"


def test_a_closure_raising_on_one_rank_raises_on_every_rank(ranks):
    """Rank 1's closure raises: rank 1 raises its error, rank 0 one of its type naming rank 1 and
    its message, at once (not after the timeout, which would fail the fixture)."""
    assert ranks[1]["closure"]["refused"] == ("RuntimeError", "a bad row")
    assert ranks[0]["closure"]["refused"] == (
        "RuntimeError",
        f"{STEP} raised on rank(s) [1]; rank 1: a bad row",
    )


def test_a_loss_fn_raising_on_one_rank_raises_on_every_rank(ranks):
    """The one-pass ``loss_fn`` raises ValueError on rank 0 only: both ranks raise a ValueError."""
    assert ranks[0]["one_pass"]["refused"] == ("ValueError", "a bad row")
    assert ranks[1]["one_pass"]["refused"] == (
        "ValueError",
        f"{STEP} raised on rank(s) [0]; rank 0: a bad row",
    )


@pytest.mark.parametrize("case", ["closure", "one_pass"])
def test_a_refused_step_leaves_the_optimizer_as_it_was_and_the_ranks_in_step(ranks, case):
    """After the refusal every rank's state dict (QNVB state, step count, generator) equals the
    one before it bit for bit and the parameters are their means; with one more step both ranks
    equal a run of two steps that never met the error, bit for bit (the refused step drew no
    nodes: the random rule's next nodes are the same)."""
    for rank in ranks:
        run = rank[case]
        assert equal_nested(run["before"], run["after"])
        assert equal_nested(run["params_after"], run["means"])
        assert equal_nested(run["final"], rank[f"clean_{case}"]["final"])
    assert equal_nested(ranks[0][case]["final"], ranks[1][case]["final"])


@pytest.mark.parametrize(
    "entry",
    [
        "world",
        "shard",
        "broadcast_generator",
        "all_reduce_mean_",
        "save_checkpoint",
        "load_checkpoint",
        "DistributedOptimizer",
        "DistributedQuadratureELBO",
        "NodeParallelQNVBOptimizer",
    ],
)
def test_a_rank_outside_the_group_is_refused(ranks, entry):
    """Global rank 0 calls every public entry point with a group of rank 1 only: a RuntimeError
    naming it; rank 1, a member, gets rank 0 of 1 and all 12 rows."""
    assert ranks[0]["outside"][entry] == NOT_A_MEMBER
    assert ranks[1]["outside"] == {"world": (0, 1), "shard": slice(0, ROWS)}


def test_a_refused_save_outside_the_group_writes_nothing(ranks):
    assert ranks[0]["outside"]["written"] is False


def test_reductions_in_different_orders_are_refused(ranks):
    """[a (2,), b (3,)] on rank 0 and [b, a] on rank 1 have equal sizes (5): the all-reduce alone
    would add a to b. The shapes' check refuses it on both ranks; in the same order the means are
    (0 + 1) / 2 and (10 + 11) / 2."""
    for rank in ranks:
        orders = rank["orders"]
        assert orders["same"] == ("ok", None)
        assert orders["a"] == [0.5, 0.5] and orders["b"] == [10.5, 10.5, 10.5]
        kind, message = orders["swapped"]
        assert kind == "RuntimeError", message
        assert message.startswith(
            "the ranks disagree on the number and shapes of the tensors to reduce (in order)"
        )
        assert "sort them by a name every rank shares" in message, message


@pytest.mark.parametrize(
    ("case", "found"),
    [
        ("shape", "'w' of the live param store has shape (2,) in the checkpoint and (3,) here"),
        ("name", "'u' of the live param store is not in the checkpoint"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(ranks, case, found):
    for rank in ranks:
        out = rank["other_model"]
        assert out[case] == (
            "ValueError",
            f"load_checkpoint: {out['path']!r} is the fit of another model: the parameter "
            f"{found}; build the model and guide of the saved fit (or load into a fresh param "
            "store, pyro.clear_param_store())",
        )
        live = {"shape": {"w": [1.0, 1.0, 1.0]}, "name": {"u": [1.0, 1.0]}}[case]
        assert {k: v.tolist() for k, v in out[f"{case}_kept"].items()} == live


def test_a_checkpoint_loads_into_a_store_of_the_same_model(ranks):
    for rank in ranks:
        out = rank["other_model"]
        assert out["same_model"] == ("ok", {"world_size": 2})
        assert {k: v.tolist() for k, v in out["restored"].items()} == {
            "w": [3.0, 3.0],
            "v": [0.0, 0.0, 0.0],
        }


def test_resume_with_a_rule_and_a_minibatch_generator_is_bit_for_bit(ranks):
    """2 steps, a checkpoint with both generators, 2 more steps from it (the generators re-seeded
    before the load) equal 4 uninterrupted steps bit for bit, on both ranks."""
    for rank in ranks:
        full_losses, full_store, _ = rank["full"]
        losses, store, _ = rank["resumed"]
        assert losses == full_losses[2:]
        assert equal_nested(store, full_store)


def test_resume_with_fewer_generators_than_saved_is_refused(ranks):
    for rank in ranks:
        path = str(Path(rank["dir"], "fit.pt"))
        assert rank["resumed"][2] == (
            "ValueError",
            f"load_checkpoint: {path!r} holds the states of 2 generator(s), and generator= gives "
            "1; pass load_checkpoint the generators passed to save_checkpoint, in the same order "
            "(the ELBO's or optimizer's generator, your minibatch generator, ...)",
        )


def test_the_shapes_layout_holds_the_whole_checksum():
    # the reductions' shape check compares (count, CRC-32 of the shapes) across ranks; in float32
    # the checksum lost its low 8 bits, so layouts agreeing in the top 24 passed as equal
    import zlib

    from pyro_quadvi.distributed.comm import shapes_layout

    tensors = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(2, 2, 2)]
    crc = zlib.crc32(repr([(3, 4), (5,), (2, 2, 2)]).encode())
    assert crc >= 2**24  # a checksum float32 cannot hold exactly
    layout = shapes_layout(tensors)
    assert layout.dtype == torch.float64
    assert int(layout[0]) == 3 and int(layout[1]) == crc
