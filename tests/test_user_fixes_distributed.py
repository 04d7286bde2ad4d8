"""Mistakes users made with the distributed classes: each one now raises on every rank, together
(two gloo processes, one spawn for all the scenarios, a few seconds)."""

from __future__ import annotations

from pathlib import Path

import pyro
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import init_to_sample

from pyro_quadvi import QNVB, AutoMeanFieldNormal
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    NodeParallelQNVBOptimizer,
    shard,
    world,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import module_loss
from pyro_quadvi.testing.ranks import outcome

ROWS = 12
TIMEOUT_S = 60


def _data(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1, keepdim=True)) + 0.1 * torch.randn(
        rows, 1, generator=g, dtype=torch.float64
    )
    return x, y


def _net(hidden: int = 4) -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    ).double()


def _fit(
    parallel: str = "data",
    *,
    rows: int = ROWS,
    part: slice | None = None,
    seed: int = 0,
    hidden: int = 4,
    share: float | None = None,
    nan_at: int | None = None,
    catch: bool = False,
    steps: int = 4,
) -> dict:
    """QNVB on a 3-hidden-1 BayesianModule with the deterministic Hadamard rule (4 nodes).

    ``part``: this rank's rows (default: its shard in data mode, all rows in node mode).
    ``nan_at``: the step at which this rank's first target is NaN. ``catch``: catch a step's
    ValueError and go on, as the user did.
    """
    pyro.clear_param_store()
    x, y = _data(rows)
    if part is None and parallel == "data":
        part = shard(rows)
    if part is not None:
        x, y = x[part], y[part]
    bnn = BayesianModule(_net(hidden), priors.Normal(1.0), likelihoods.Gaussian(ROWS, scale=0.3))
    pyro.set_rng_seed(seed)  # after _net, which seeds torch itself
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample, init_scale=0.05)
    elbo = DistributedQuadratureELBO("hadamard", 4, vectorize=True, parallel=parallel)
    elbo.share = share
    svi = SVI(bnn, guide, DistributedOptimizer(QNVB(lr=0.5)), elbo)
    losses, skipped = [], []
    for step in range(steps):
        target = y.clone()
        if step == nan_at:
            target[0, 0] = float("nan")
        try:
            losses.append(svi.step(x, target))
        except ValueError as error:
            if not catch:
                raise
            skipped.append(str(error))
    return {
        "losses": losses,
        "skipped": skipped,
        "params": {k: v.detach().clone() for k, v in pyro.get_param_store().items()},
    }


def _node_parallel(*, hidden: int = 4, extra_layer: bool = False, rows: slice = slice(None)):
    """Three one-pass steps of NodeParallelQNVBOptimizer on this rank's ``rows`` of the data."""
    x, y = _data()
    x, y = x[rows], y[rows]
    net = _net(hidden)
    if extra_layer:  # the same shapes as the others' and one weight more
        net = torch.nn.Sequential(net, torch.nn.Linear(1, 1, bias=False).double())
    optimizer = NodeParallelQNVBOptimizer(
        net.named_parameters(),
        likelihood_weight=ROWS,
        quadrature="hadamard",
        num_eval=4,
        generator=torch.Generator().manual_seed(11),
    )
    loss_fn = module_loss(net, torch.nn.functional.mse_loss)
    return [float(optimizer.step(loss_fn=loss_fn, batch=(x, y))) for _ in range(3)]


def _scenarios(outdir: Path) -> dict:
    rank = world()[0]
    return {
        "seeds": outcome(lambda: _fit(seed=rank)),
        "nodes_batches": outcome(lambda: _fit("nodes", part=shard(ROWS))),
        "torch_batches": outcome(lambda: _node_parallel(rows=shard(ROWS))),
        "share": outcome(lambda: _fit(rows=11, share=[6 / 12, 5 / 12][rank])),
        "unequal": outcome(lambda: _fit(rows=11)),  # shards of 6 and 5 rows, no share
        "unequal_shared": outcome(lambda: _fit(rows=11, share=[6 / 11, 5 / 11][rank])),
        "nan": outcome(lambda: _fit(nan_at=2 if rank == 1 else None, catch=True, steps=5)),
        "hidden": outcome(lambda: _fit(hidden=4 + rank)),
        "torch_hidden": outcome(lambda: _node_parallel(extra_layer=rank == 1)),
        "empty": outcome(lambda: _fit(part=[slice(0, ROWS), slice(ROWS, ROWS)][rank])),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("fixes"), timeout_s=TIMEOUT_S)


def _both(ranks, case: str, kind: str, text: str) -> None:
    for rank in ranks:
        assert rank[case][0] == kind, rank[case]
        assert text in rank[case][1], rank[case][1]


def test_ranks_seeded_differently_refused(ranks):
    """The Hadamard rule's nodes are the same on every rank; the parameters were not: the ELBO's
    collective finds them apart at the first step."""
    _both(ranks, "seeds", "RuntimeError", "disagree on the values of the guide's parameters")
    _both(ranks, "seeds", "RuntimeError", "every rank must start from the same values")


def test_different_batches_in_node_parallel_refused(ranks):
    _both(ranks, "nodes_batches", "RuntimeError", "disagree on the minibatch")
    _both(ranks, "torch_batches", "RuntimeError", "disagree on the batch of step(loss_fn=")


def test_shares_that_do_not_add_up_to_one_refused(ranks):
    _both(ranks, "share", "ValueError", f"shares add up to {6 / 12 + 5 / 12!r}, not 1")


def test_unequal_shards_without_shares_refused(ranks):
    """6 and 5 rows with no share: the plain mean would weight the ranks' rows wrongly."""
    _both(ranks, "unequal", "ValueError", "shards hold different numbers of rows ([6, 5]")
    # with the shares set, the run is one process's on the 11 rows, to rounding
    alone = _fit(rows=11, part=slice(None))
    for rank in ranks:
        assert rank["unequal_shared"][0] == "ok", rank["unequal_shared"]
        for name, value in alone["params"].items():
            got = rank["unequal_shared"][1]["params"][name]
            torch.testing.assert_close(got, value, rtol=0, atol=1e-10)


def test_error_on_one_rank_skips_the_step_on_every_rank(ranks):
    """Rank 1's NaN target at step 2: both ranks skip it; the four steps taken equal four steps of
    one process on all the rows."""
    outcomes = [rank["nan"] for rank in ranks]
    assert [o[0] for o in outcomes] == ["ok", "ok"]
    assert "raised on rank(s) [1]" in outcomes[0][1]["skipped"][0]
    # the likelihood's own check of the data (it was Pyro's "Expected value argument")
    assert (
        "Gaussian likelihood (site 'obs'): y must hold finite numbers"
        in outcomes[1][1]["skipped"][0]
    )
    assert len(outcomes[0][1]["losses"]) == len(outcomes[1][1]["losses"]) == 4
    alone = _fit(steps=4)
    assert outcomes[0][1]["losses"] == outcomes[1][1]["losses"]
    for name, value in alone["params"].items():
        for _, result in outcomes:
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=1e-10)


def test_different_models_refused_as_such(ranks):
    _both(ranks, "hidden", "RuntimeError", "the dimension of the latent space")
    _both(ranks, "hidden", "RuntimeError", "the models differ")
    _both(ranks, "torch_hidden", "RuntimeError", "the models differ")
    assert "entry 0: from 4.0 to 5.0" in ranks[0]["torch_hidden"][1]  # the number of parameters


def test_empty_shard_refused_by_name(ranks):
    assert ranks[0]["empty"][0] == "ValueError"
    assert "raised on rank(s) [1]" in ranks[0]["empty"][1]
    assert ranks[1]["empty"] == (
        "ValueError",
        "DistributedQuadratureELBO(parallel='data'): this rank's shard is empty (argument 0 of "
        "svi.step has 0 rows); give every rank at least one row (shard(num_rows) does) and set "
        "share to its fraction of the rows",
    )


def test_only_the_data_argument_counts_as_the_shard():
    """An optional empty tensor beside the data is not an empty shard; empty data is."""
    elbo = DistributedQuadratureELBO("hadamard", 4, parallel="data")
    x, y = _data()
    elbo._refuse_empty((x, y), {"covariates": torch.empty(0)})
    with pytest.raises(ValueError, match=r"shard is empty \(argument 0 of svi.step has 0 rows\)"):
        elbo._refuse_empty((x[:0], y[:0]), {})
