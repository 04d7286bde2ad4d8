"""Settings across ranks and in checkpoints: ``DistributedOptimizer(shard_update=True)`` gathers
every block's settings record from its owner; ranks whose QNVBs give a block other settings, a
checkpoint refused on one rank, and a data-parallel ``AutoNormal`` minibatch QNVB cannot read are
refused on every rank together (two gloo processes, one spawn, a few seconds). A step reading
blocks from gradients describes each live guide once. And ``QNVBOptimizer.load_state_dict``
refuses a generator the saved run did not have."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample
from torch.distributions.constraints import positive

from pyro_quadvi import QNVB, AutoMeanFieldNormal
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    load_checkpoint,
    save_checkpoint,
    shard,
    world,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer
from pyro_quadvi.testing.compare import equal_nested
from pyro_quadvi.testing.ranks import outcome

ROWS = 8
TIMEOUT_S = 60
BLOCKS = [
    f"AutoMeanFieldNormal.locs.{layer}.{kind}" for layer in (0, 2) for kind in ("bias", "weight")
]
RANK1_BLOCK = "AutoMeanFieldNormal.locs.2.weight"  # of 12, 4, 4, 1 entries: rank 1 updates it


def _bnn_fit(
    *,
    shard_update: bool,
    steps: int,
    optim_args=None,
    resume: Path | None = None,
    save=None,
    kept: list | None = None,
) -> dict:
    """QNVB on a 3-4-1 BayesianModule, data parallel, the deterministic Hadamard rule;
    ``kept`` receives whether a refused load left the optimizer's state as it was."""
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1, keepdim=True))
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    bnn = BayesianModule(net.double(), priors.Normal(1.0), likelihoods.Gaussian(ROWS, scale=0.3))
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample, init_scale=0.05)
    elbo = DistributedQuadratureELBO("hadamard", 4, vectorize=True, parallel="data")
    optim = DistributedOptimizer(QNVB(optim_args, lr=0.5), shard_update=shard_update)
    svi = SVI(bnn, guide, optim, elbo)
    part = shard(ROWS)
    if resume is not None:
        guide(x[part], y[part])
        before = copy.deepcopy(optim.get_state())
        try:
            load_checkpoint(resume, optim)
        except ValueError:
            if kept is not None:
                kept.append(equal_nested(before, optim.get_state()))
            raise
    for _ in range(steps):
        svi.step(x[part], y[part])
    if save is not None:
        save_checkpoint(save, optim)
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def _z_model(rows):
    with pyro.plate("data", ROWS, subsample=rows):
        z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        pyro.sample("obs", dist.Normal(z, 0.5), obs=torch.linspace(-1, 1, ROWS)[rows].double())


def _autonormal_fit(
    rows: torch.Tensor, guide_class=AutoNormal, described: list[int] | None = None, **qnvb
) -> list[float]:
    """Three steps of ``guide_class`` under Trace_ELBO with QNVB: Pyro's AutoNormal records no
    minibatch, AutoMeanFieldNormal records it. With ``described`` (AutoMeanFieldNormal), the
    number of times each step describes the guide (every ``describe_guide`` of it, whichever
    module calls it, goes through its ``quadrature_description``) is appended to it."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = guide_class(
        _z_model, create_plates=lambda rows: pyro.plate("data", ROWS, subsample=rows)
    )
    if described is not None:
        describe = guide.quadrature_description

        def counting(trace=None):
            described[-1] += 1
            return describe(trace)

        guide.quadrature_description = counting
    svi = SVI(_z_model, guide, DistributedOptimizer(QNVB(**qnvb)), Trace_ELBO())
    for _ in range(3):
        if described is not None:
            described.append(0)
        svi.step(rows)
    return pyro.param(f"{guide_class.__name__}.scales.z").detach().tolist()


def _noise_model(rows):
    """``_z_model`` with a learned noise: a ``pyro.param`` QuadratureELBO publishes no moments
    for, which QNVB hands to its fallback."""
    noise = pyro.param("noise", torch.tensor(0.5, dtype=torch.float64), constraint=positive)
    with pyro.plate("data", ROWS, subsample=rows):
        z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        pyro.sample("obs", dist.Normal(z, noise), obs=torch.linspace(-1, 1, ROWS)[rows].double())


def _published_minibatch_fit() -> list[float]:
    """Three node-parallel steps of AutoNormal with QuadratureELBO on rows 0-3 of 8: the
    moments of ``z`` are published (their rows from the run's trace), the noise has none."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(
        _noise_model, create_plates=lambda rows: pyro.plate("data", ROWS, subsample=rows)
    )
    elbo = DistributedQuadratureELBO("hadamard", 4, parallel="nodes")
    svi = SVI(_noise_model, guide, DistributedOptimizer(QNVB()), elbo)
    for _ in range(3):
        svi.step(torch.arange(4))
    return [*pyro.param("AutoNormal.scales.z").detach().tolist(), pyro.param("noise").item()]


def _slow(block: str):
    return lambda name: {"lr": 0.1} if name == block else {}


def _scenarios(outdir: Path) -> dict:
    rank = world()[0]
    sharded, plain = outdir / "sharded.pt", outdir / "plain.pt"
    kept: list[bool] = []
    described: list[int] = []
    out = {
        "save_sharded": outcome(lambda: _bnn_fit(shard_update=True, steps=2, save=sharded)),
        "save_plain": outcome(lambda: _bnn_fit(shard_update=False, steps=2, save=plain)),
        # both ranks: lr 0.1 for a block of rank 1's
        "load_other_lr": outcome(
            lambda: _bnn_fit(
                shard_update=True, steps=1, resume=sharded, optim_args=_slow(RANK1_BLOCK)
            )
        ),
        # rank 1 only: lr 0.1 for its own block, in a fresh run
        "fresh_sharded": outcome(
            lambda: _bnn_fit(
                shard_update=True, steps=3, optim_args=_slow(RANK1_BLOCK) if rank == 1 else None
            )
        ),
        "fresh_plain": outcome(
            lambda: _bnn_fit(shard_update=False, steps=3, optim_args={"lr": 0.3} if rank else None)
        ),
        "z_disjoint": outcome(lambda: _autonormal_fit(torch.arange(4) + 4 * rank)),
        "z_rank0_part": outcome(lambda: _autonormal_fit(torch.arange(4 if rank == 0 else ROWS))),
        "z_all": outcome(lambda: _autonormal_fit(torch.arange(ROWS))),
        "z_recorded_other_lr": outcome(
            lambda: _autonormal_fit(
                torch.arange(ROWS), AutoMeanFieldNormal, **({"lr": 0.3} if rank else {})
            )
        ),
        "z_recorded_disjoint": outcome(
            lambda: _autonormal_fit(torch.arange(4) + 4 * rank, AutoMeanFieldNormal)
        ),
        "published_minibatch": outcome(_published_minibatch_fit),
        "z_recorded_all": outcome(
            lambda: _autonormal_fit(torch.arange(ROWS), AutoMeanFieldNormal, described)
        ),
        # rank 1 only: other settings at load (last: a rank left behind would hang the rest)
        "load_rank1_lr": outcome(
            lambda: _bnn_fit(
                shard_update=False,
                steps=1,
                resume=plain,
                optim_args={"lr": 0.3} if rank else None,
                kept=kept,
            )
        ),
    }
    out["kept"] = kept
    out["described"] = described
    out["settings"] = sorted(torch.load(sharded, weights_only=False)["optim"]["qnvb"]["settings"])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("state"), timeout_s=TIMEOUT_S)


def test_sharded_checkpoint_holds_every_blocks_settings(ranks):
    """Rank 0 updates locs.0.weight only; the checkpoint holds the settings of all four blocks,
    so a changed lr for a block of rank 1's is refused at load, on both ranks."""
    assert ranks[0]["save_sharded"][0] == "ok"
    assert ranks[0]["settings"] == sorted(BLOCKS)
    for rank in ranks:
        kind, message = rank["load_other_lr"]
        assert kind == "ValueError", message
        assert f"(block {RANK1_BLOCK!r}): the state was saved with lr=0.5" in message


def test_ranks_with_other_settings_refused_together(ranks):
    """Rank 1's QNVB gives one block lr 0.1: refused at the first step on both ranks, naming
    the block and the setting, with and without shard_update (which trained on silently)."""
    for rank in ranks:
        kind, message = rank["fresh_sharded"]
        assert kind == "RuntimeError", message
        assert f"give the block {RANK1_BLOCK!r} other settings: lr = [0.5, 0.1]" in message
        kind, message = rank["fresh_plain"]
        assert kind == "RuntimeError", message
        assert f"give the block {BLOCKS[0]!r} other settings: lr = [0.5, 0.3]" in message


def test_checkpoint_refused_on_one_rank_raises_on_every_rank(ranks):
    """Rank 1 alone builds QNVB with lr 0.3: its refusal is raised on rank 0 too, in its words."""
    assert ranks[0]["save_plain"][0] == "ok"
    kind, message = ranks[1]["load_rank1_lr"]
    assert kind == "ValueError"
    assert re.fullmatch(
        r"QNVB\.set_state \(block 'AutoMeanFieldNormal\.locs\.[02]\.(weight|bias)'\): the state "
        r"was saved with lr=0\.5 \(this optimizer: 0\.3\); construct the optimizer with the "
        r"saved settings to continue that run",
        message,
    )
    assert ranks[0]["load_rank1_lr"] == (
        "ValueError",
        "load_checkpoint: restoring the optimizer's state raised on rank(s) [1]; rank 1: "
        + message,
    )
    # rank 0 had taken the state: it is back to its own, as rank 1's never changed
    assert ranks[0]["kept"] == ranks[1]["kept"] == [True]


def test_autonormal_minibatch_refused_on_every_rank_data_parallel(ranks):
    """Disjoint rows per rank: the mean gave every entry a gradient, and QNVB read the plate's
    scale 2 as 1. Now QNVB's refusal is made on every rank; with all rows everywhere the run
    equals one process's."""
    refusal = "QNVB: site 'z' was used on part of its entries (a subsampled plate)"
    for rank in ranks:
        assert rank["z_disjoint"][0] == "ValueError"
        assert rank["z_disjoint"][1].startswith(refusal)
    assert ranks[0]["z_rank0_part"][1].startswith(refusal)
    assert ranks[1]["z_rank0_part"][0] == "ValueError"
    assert ranks[1]["z_rank0_part"][1].startswith("QNVB raised on rank(s) [0]; rank 0: " + refusal)
    alone = _autonormal_fit(torch.arange(ROWS))
    for rank in ranks:
        assert rank["z_all"] == ("ok", alone)


def test_recorded_rows_read_from_gradients_are_compared_across_ranks(ranks):
    """AutoMeanFieldNormal under Trace_ELBO (no moments published): each rank updated its own
    rows from the averaged gradients, and the ranks drifted apart until the check of values
    blamed the seeding. Its recorded rows now join the rows compared, refused at the first step."""
    for rank in ranks:
        assert rank["z_recorded_disjoint"][0] == "RuntimeError"
        assert "the rows of their local latents" in rank["z_recorded_disjoint"][1]


def test_settings_of_blocks_read_from_gradients_are_compared_across_ranks(ranks):
    """Under Trace_ELBO (no moments) the settings fingerprint covered nothing, and ranks with
    another lr drifted apart until the values check blamed the seeding."""
    for rank in ranks:
        kind, message = rank["z_recorded_other_lr"]
        assert kind == "RuntimeError"
        assert "AutoMeanFieldNormal.locs.z" in message and "lr = [1.0, 0.3]" in message


def test_a_step_reading_gradients_describes_each_guide_once(ranks):
    """Under Trace_ELBO (no moments) the wrapper describes the live guides for its checks and
    hands the descriptions to QNVB's step, which described them a second time before. The fit
    is the one process's (every row on every rank), which describes the guide once a step too."""
    alone_described: list[int] = []
    alone = _autonormal_fit(torch.arange(ROWS), AutoMeanFieldNormal, alone_described)
    assert alone_described == [1, 1, 1]
    for rank in ranks:
        assert rank["described"] == [1, 1, 1]
        assert rank["z_recorded_all"] == ("ok", alone)


def test_blocks_with_moments_are_not_read_as_gradient_blocks(ranks):
    """A parameter without moments (the noise) made the wrapper take every described block for
    one read from gradients, AutoNormal's ``z`` too, whose description (no trace) knows no rows:
    its minibatch was refused, though QuadratureELBO published its moments. Now it fits as one
    process does: the four rows of the minibatch move, the other four keep their 0.1."""
    alone = _published_minibatch_fit()
    assert all(abs(s - 0.1) < 1e-15 for s in alone[4:8])
    assert all(abs(s - 0.1) > 0.1 for s in alone[:4])
    for rank in ranks:
        kind, fitted = rank["published_minibatch"]
        assert kind == "ok", fitted
        assert torch.allclose(torch.tensor(fitted), torch.tensor(alone), rtol=1e-12, atol=0)


def test_state_without_generator_refused_by_an_optimizer_with_one():
    net = torch.nn.Linear(2, 1).double()
    kwargs = {"likelihood_weight": 4, "quadrature": "blocked_simplex"}
    saved = QNVBOptimizer(net.parameters(), **kwargs).state_dict()
    generator = torch.Generator().manual_seed(5)
    loading = QNVBOptimizer(net.parameters(), generator=generator, **kwargs)
    before = generator.get_state()
    with pytest.raises(ValueError, match=r"holds no generator state .* without a generator"):
        loading.load_state_dict(saved)
    assert torch.equal(generator.get_state(), before)
