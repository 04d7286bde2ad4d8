"""Data-parallel shares that do not match the ranks' rows, and ranks whose models differ where the
losses would not show it (a user trial, t19): each is refused on every rank. Two gloo processes,
one spawn for every case (a few seconds)."""

from __future__ import annotations

from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal
from pyro_quadvi.distributed import DistributedOptimizer, DistributedQuadratureELBO, shard, world
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.testing.ranks import outcome

ROWS = 13  # 7 + 6 on two ranks
TIMEOUT_S = 60


def _data(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1, keepdim=True)) + 0.3 * torch.randn(
        rows, 1, generator=g, dtype=torch.float64
    )
    return x, y


def _svi(
    parallel: str = "data",
    *,
    dataset_size: int = ROWS,
    prior_scale: float = 1.0,
    optim: pyro.optim.PyroOptim | None = None,
) -> tuple[SVI, DistributedQuadratureELBO]:
    """A 3-4-1 BayesianModule under the Hadamard rule (4 nodes, the same on every rank)."""
    pyro.clear_param_store()
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    bnn = BayesianModule(
        net.double(), priors.Normal(prior_scale), likelihoods.Gaussian(dataset_size, scale=0.5)
    )
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(bnn, init_scale=0.05)
    elbo = DistributedQuadratureELBO("hadamard", 4, vectorize=True, parallel=parallel)
    return SVI(bnn, guide, DistributedOptimizer(optim or QNVB(lr=0.5)), elbo), elbo


def _steps(
    built: tuple[SVI, DistributedQuadratureELBO], steps: int = 2, share: float | None = None
) -> list[float]:
    svi, elbo = built
    x, y = _data()
    if elbo.parallel == "data":
        rows = shard(ROWS)
        x, y = x[rows], y[rows]
    elbo.share = share
    return [svi.step(x, y) for _ in range(steps)]


def _stale_share() -> dict:
    """A step with the shares of 7 + 6 rows, then a validation loss on 5 + 5 rows with the
    shares left in place (refused) and with None."""
    svi, elbo = built = _svi()
    rows = shard(ROWS)
    trained = _steps(built, 1, share=(rows.stop - rows.start) / ROWS)
    x, y = _data(10)
    rows = shard(10)
    stale = outcome(lambda: elbo.loss(svi.model, svi.guide, x[rows], y[rows]))
    elbo.share = None
    right = elbo.loss(svi.model, svi.guide, x[rows], y[rows])
    return {"trained": trained, "stale": stale, "right": right}


def _scaled_after_a_setting() -> list[float]:
    """A model without a subsampled plate (its likelihood scaled by ``N / B_r`` itself) called
    ``model(c, x, y)``, a tensor setting first, the shares ``B_r / B`` of 7 + 6 rows."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    rows = shard(ROWS)
    c = torch.tensor([1.0, 2.0], dtype=torch.float64)

    def model(c, x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        with pyro.poutine.scale(scale=ROWS / len(x)):
            pyro.sample("y", dist.Normal((x * w).sum(-1), 0.5).to_event(1), obs=y[:, 0])

    elbo = DistributedQuadratureELBO("hadamard", 4, parallel="data")
    svi = SVI(model, AutoMeanFieldNormal(model), DistributedOptimizer(QNVB()), elbo)
    elbo.share = len(x[rows]) / ROWS
    return [svi.step(c, x[rows], y[rows])]


def _scenarios(outdir: Path) -> dict:
    rank = world()[0]
    return {
        "share_half": outcome(lambda: _steps(_svi(), share=0.5)),
        "stale": _stale_share(),
        "dataset_size": outcome(lambda: _steps(_svi(dataset_size=ROWS * (1 + rank)))),
        "dataset_size_nodes": outcome(
            lambda: _steps(_svi("nodes", dataset_size=ROWS * (1 + rank)))
        ),
        "prior": outcome(lambda: _steps(_svi(prior_scale=1.0 + rank))),
        "setting_first": outcome(_scaled_after_a_setting),
        "adam_lr": outcome(
            lambda: _steps(_svi("nodes", optim=pyro.optim.Adam({"lr": 0.01 * (1 + rank)})))
        ),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("share_models"), timeout_s=TIMEOUT_S)


def _both(ranks, case: str, kind: str, *texts: str) -> None:
    for rank in ranks:
        assert rank[case][0] == kind, rank[case]
        for text in texts:
            assert text in rank[case][1], rank[case][1]


def test_shares_that_add_up_to_one_but_not_to_the_rows_are_refused(ranks):
    """7 + 6 rows with share 0.5 on both ranks: the shares add up to 1, and would weight rank 1's
    rows by 7 / 6 of rank 0's (the loss was 194.46 against 189.96 after 6 steps)."""
    _both(
        ranks,
        "share_half",
        "ValueError",
        "the ranks' shares do not match their rows (shares by rank: [0.5, 0.5]; rows by rank: "
        f"[7, 6], so the shares must be {[7 / 13, 6 / 13]})",
        "Set elbo.share = this rank's rows / the minibatch's rows on every rank before each step",
    )


def test_a_stale_share_is_refused_and_none_gives_one_process(ranks):
    """The shares of the 7 + 6 training shards left in place for a loss on 5 + 5 rows."""
    _both(
        [rank["stale"] for rank in ranks],
        "stale",
        "ValueError",
        f"(shares by rank: {[7 / 13, 6 / 13]}; rows by rank: [5, 5], so the shares must be "
        "[0.5, 0.5])",
    )
    svi, elbo = built = _svi()  # no process group: one process on all the rows
    trained = _steps(built, 1, share=1.0)
    x, y = _data(10)
    right = elbo.loss(svi.model, svi.guide, x, y)
    for rank in ranks:
        assert rank["stale"]["trained"] == pytest.approx(trained, rel=1e-12)
        assert rank["stale"]["right"] == pytest.approx(right, rel=1e-12)


def test_rows_read_from_a_first_argument_that_is_no_data_are_named(ranks):
    """Without a subsampled data plate the rows are dim 0 of svi.step's first tensor argument,
    here a setting of 2 entries on both ranks: the refusal said "rows by rank: [2, 2]" and not
    where they came from; it now names the argument and the fixes (docs/scaling.md)."""
    _both(
        ranks,
        "setting_first",
        "ValueError",
        "rows by rank: [2, 2], so the shares must be [0.5, 0.5]). The model has no subsampled "
        "data plate, so each rank's rows were read from argument 0 of svi.step, its first tensor "
        "argument: pass the data first, or give the model the data plate pyro.plate('data', N, "
        "subsample=idx). A share weights",
    )
    assert "data plate, so" not in ranks[0]["share_half"][1]  # rows from the data plate


def test_a_data_plate_of_another_size_on_a_rank_is_refused(ranks):
    """likelihoods.Gaussian(dataset_size=13) on rank 0 and 26 on rank 1 (both modes ran with
    equal losses on both ranks: 310.0 against about 205 in one process)."""
    for case, low in [("dataset_size", 13.0), ("dataset_size_nodes", 0.0)]:
        _both(
            ranks,
            case,
            "RuntimeError",
            "the ranks disagree on the full sizes of the model's subsampled data plates",
            f"(entry 0: from {low} to 26.0 across ranks); the models differ",
            "likelihoods.X(dataset_size=N) in a BayesianModule",
        )
    assert "this rank's: {'data': 13}" in ranks[0]["dataset_size"][1]
    assert "this rank's: {}" in ranks[0]["dataset_size_nodes"][1]  # all 13 rows: not subsampled
    assert "this rank's: {'data': 26}" in ranks[1]["dataset_size_nodes"][1]


def test_a_prior_of_another_scale_on_a_rank_is_refused(ranks):
    _both(ranks, "prior", "RuntimeError", "the ranks disagree on the Gaussian priors")
    assert (
        "'0.bias': (0.0, 1.0, 1.0), '0.weight': (0.0, 1.0, 1.0) and 2 more" in ranks[0]["prior"][1]
    )
    assert "'0.bias': (0.0, 2.0, 1.0)" in ranks[1]["prior"][1]


def test_an_optimizer_with_other_settings_per_rank_is_named_as_a_cause(ranks):
    """A wrapped Adam with another lr per rank: refused at the second step, naming both causes."""
    _both(
        ranks,
        "adam_lr",
        "RuntimeError",
        "the ranks disagree on the values of the guide's parameters",
        "they agreed at this ELBO's previous step, so the optimizer's step since moved them "
        "differently on the ranks",
        "wrap it, SVI(model, guide, DistributedOptimizer(QNVB()), elbo)",
        "or the wrapped optimizer (or the fallback QNVB hands the blocks without moments) has "
        "other settings on some rank, pyro.optim.Adam({'lr': ...}) with another lr",
    )
