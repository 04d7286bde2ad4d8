"""Findings of a user trial of distributed training (session 13): a data plate sized to the rank's
shard, a restored store under Trace_ELBO + QNVB, unequal shards and per-rank scales under Pyro's
ELBOs, the JIT refusal's message. The distributed scenarios run in one spawn of two gloo ranks."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pyro
import pyro.distributions as pdist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributed import (
    DistributedOptimizer,
    DistributedQuadratureELBO,
    load_checkpoint,
    save_checkpoint,
    shard,
    world,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.testing.ranks import outcome

N = 40
ROWS = 12
TIMEOUT_S = 90


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, generator=g, dtype=torch.float64)
    return x, 2 * x + 1 + torch.randn(N, generator=g, dtype=torch.float64)


X, Y = _xy()


def regression(idx: torch.Tensor) -> None:
    w = pyro.sample("w", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    b = pyro.sample("b", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with pyro.plate("data", N, subsample=idx):
        pyro.sample("obs", pdist.Normal(w * X[idx] + b, 1.0), obs=Y[idx])


def shard_sized(x: torch.Tensor, y: torch.Tensor) -> None:
    """The trial's plain model: the data plate is the rows given, a local latent per row."""
    w = pyro.sample("w", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with pyro.plate("data", len(x)):
        z = pyro.sample("z", pdist.Normal(w * x, 1.0))
        pyro.sample("obs", pdist.Normal(z, 0.5), obs=y)


def with_global_observation(idx: torch.Tensor) -> None:
    """A correct model with an observed site outside every plate (the same on every rank)."""
    w = pyro.sample("w", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    pyro.sample("anchor", pdist.Normal(w, 1.0), obs=torch.tensor(1.5, dtype=torch.float64))
    with pyro.plate("data", N, subsample=idx):
        pyro.sample("obs", pdist.Normal(w * X[idx], 1.0), obs=Y[idx])


def features_in_data_plate(idx: torch.Tensor) -> None:
    """A correct model with a full plate of features inside the subsampled data plate (review):
    the data plate scales the site by N / B, so the features plate's full size is no shard."""
    w = pyro.sample("w", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64)
    with pyro.plate("data", N, subsample=idx, dim=-2), pyro.plate("features", 2, dim=-1):
        pyro.sample("obs", pdist.Normal(w * X[idx, None] * signs, 1.0), obs=Y[idx, None] * signs)


def local_rows_with_features(x: torch.Tensor, y: torch.Tensor) -> None:
    """The shard's rows indexed from 0 (``subsample=arange(B_r)``, as a ``BayesianModule``'s
    likelihood does) around a full plate of features (last trial): the same indices on every
    rank, and the data plate scales the rows by ``N / B_r``."""
    w = pyro.sample("w", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64)
    with pyro.plate("data", N, subsample=torch.arange(len(x)), dim=-2):
        with pyro.plate("features", 2, dim=-1):
            pyro.sample("obs", pdist.Normal(w * x[:, None] * signs, 1.0), obs=y[:, None] * signs)


def scaled_by_hand(x: torch.Tensor, y: torch.Tensor) -> None:
    """A shard-sized data plate under ``poutine.scale(N / B_r)``, Pyro's minibatch by hand."""
    w = pyro.sample("w", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with poutine.scale(scale=N / len(x)), pyro.plate("data", len(x)):
        pyro.sample("obs", pdist.Normal(w * x, 1.0), obs=y)


def groups_then_data(idx: torch.Tensor) -> None:
    """An observed site in a subsampled plate of 5 groups before the data's (review): the
    rank's shard is the data plate's minibatch, not the first observed site's."""
    w = pyro.sample("w", pdist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with pyro.plate("groups", 50, subsample=torch.arange(5)):
        pyro.sample("group_obs", pdist.Normal(w, 1.0), obs=torch.zeros(5, dtype=torch.float64))
    with pyro.plate("data", N, subsample=idx):
        pyro.sample("obs", pdist.Normal(w * X[idx], 1.0), obs=Y[idx])


def regression_with_setting(setting: torch.Tensor, idx: torch.Tensor) -> None:
    """``regression`` with a first tensor argument that is no data: its rows say nothing of the
    shard (trial: a setting, or this rank's group ids)."""
    regression(idx)


def _batches(rows: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randperm(N, generator=g)[:rows] for _ in range(steps)]


def _store() -> dict[str, torch.Tensor]:
    store = pyro.get_param_store()
    return {name: store[name].detach().clone() for name in sorted(store.keys())}


def _quadrature_fit(case: str, distributed: bool) -> dict[str, torch.Tensor]:
    """Four QNVB steps with QuadratureELBO (distributed: this rank's shard of each batch)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    if case == "bnn":  # the trial's BayesianModule: no dataset_size
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(1, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3)
        ).double()
        model = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical())
        xs = X[:ROWS, None]
        ys = (Y[:ROWS] > 1).long() + (Y[:ROWS] > 3).long()
    else:
        model = {
            "plain": shard_sized,
            "global": with_global_observation,
            "features": features_in_data_plate,
            "local_rows": local_rows_with_features,
            "by_hand": scaled_by_hand,
            "groups": groups_then_data,
        }[case]
    guide = AutoMeanFieldNormal(model)
    elbo = (
        DistributedQuadratureELBO("hadamard", 4) if distributed else QuadratureELBO("hadamard", 4)
    )
    svi = SVI(model, guide, DistributedOptimizer(QNVB()) if distributed else QNVB(), elbo)
    for idx in _batches(ROWS, 4):
        part = shard(ROWS) if distributed else slice(None)
        if case == "bnn":
            svi.step(xs[part], ys[part])
        elif case in ("plain", "local_rows", "by_hand"):
            svi.step(X[:ROWS][part], Y[:ROWS][part])
        else:
            svi.step(idx[part])
    return _store()


def _trace_fit(
    guide_class: type, rows: int, steps: int, scale: float = 1.0, distributed: bool = True
) -> dict[str, torch.Tensor]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = guide_class(regression)
    optim = DistributedOptimizer(QNVB()) if distributed else QNVB()
    model, run = poutine.scale(regression, scale), poutine.scale(guide, scale)
    svi = SVI(model, run, optim, Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for idx in _batches(rows, steps):
            svi.step(idx[shard(rows)] if distributed else idx)
    return _store()


def _setting_fit(rows: int, ragged: bool) -> dict[str, torch.Tensor]:
    """Two DistributedQuadratureELBO steps of ``regression_with_setting`` on ``rows`` rows split
    across the ranks; the setting's length is 1 on rank 0 and 2 on rank 1 when ``ragged``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(regression_with_setting)
    svi = SVI(
        regression_with_setting,
        guide,
        DistributedOptimizer(QNVB()),
        DistributedQuadratureELBO("hadamard", 4),
    )
    setting = torch.ones(world()[0] + 1 if ragged else 3)
    for idx in _batches(rows, 2):
        svi.step(setting, idx[shard(rows)])
    return _store()


def _groups_fit() -> dict[str, torch.Tensor]:
    """DistributedQuadratureELBO steps of ``groups_then_data`` on 13 rows split 7 + 6."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(groups_then_data)
    elbo = DistributedQuadratureELBO("hadamard", 4)
    svi = SVI(groups_then_data, guide, DistributedOptimizer(QNVB()), elbo)
    for idx in _batches(13, 2):
        svi.step(idx[shard(13)])
    return _store()


def _fit_bnn(distributed: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``nn.fit`` over four minibatches of 12 rows of a regression ``BayesianModule`` (the
    likelihood scaled to the 24 rows by ``dataset_size``): on two ranks each step takes this
    rank's 6 rows of the batch, with an ELBO metric evaluated on every rank."""
    from pyro_quadvi.nn import fit

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    bnn = BayesianModule(
        net.double(), priors.Normal(1.0), likelihoods.Gaussian(dataset_size=24, scale=0.5)
    )
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    elbo = (
        DistributedQuadratureELBO("hadamard", 4) if distributed else QuadratureELBO("hadamard", 4)
    )
    svi = SVI(bnn, guide, DistributedOptimizer(QNVB()) if distributed else QNVB(), elbo)
    batches = []
    for start in (0, 12, 0, 12):
        rows = slice(start, start + 12)
        x, y = X[rows, None], Y[rows, None]
        part = shard(12) if distributed else slice(None)
        batches.append((x[part], y[part]))
    metric = {"elbo": lambda: elbo.loss(bnn, guide, *batches[0])}
    history = fit(svi, batches, 4, metrics=metric, every=2, progress=False)
    return history.loss, _store()


def _checkpointed(path: Path) -> tuple[list[float], list[float], dict, dict]:
    """AutoDiagonalNormal under Trace_ELBO + DistributedOptimizer(QNVB): six steps with a
    checkpoint after the third, then a new guide restored from it and the last three again."""

    def build():
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoDiagonalNormal(regression)
        optim = DistributedOptimizer(QNVB())
        return guide, optim, SVI(regression, guide, optim, Trace_ELBO())

    batches = [idx[shard(ROWS)] for idx in _batches(ROWS, 6)]
    guide, optim, svi = build()
    full = []
    for step, idx in enumerate(batches):
        full.append(svi.step(idx))
        if step == 2:
            save_checkpoint(path, optim)
            rng = torch.get_rng_state()
    store = _store()
    guide, optim, svi = build()
    with torch.no_grad():
        guide(batches[0])  # its parameters exist
    load_checkpoint(path, optim)
    torch.set_rng_state(rng)
    resumed = [svi.step(idx) for idx in batches[3:]]
    return full[3:], resumed, store, _store()


def _scenarios(outdir: Path) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        return {
            "bnn": outcome(lambda: _quadrature_fit("bnn", True)),
            "plain": outcome(lambda: _quadrature_fit("plain", True)),
            "global": outcome(lambda: _quadrature_fit("global", True)),
            "features": outcome(lambda: _quadrature_fit("features", True)),
            "local_rows": outcome(lambda: _quadrature_fit("local_rows", True)),
            "by_hand": outcome(lambda: _quadrature_fit("by_hand", True)),
            "groups": outcome(lambda: _groups_fit()),
            "checkpoint": outcome(lambda: _checkpointed(outdir / "adn.pt")),
            "fit": outcome(lambda: _fit_bnn(True)),
            "unequal": outcome(lambda: _trace_fit(AutoNormal, 13, 2)),
            "equal": outcome(lambda: _trace_fit(AutoNormal, ROWS, 3)),
            "setting_unequal": outcome(lambda: _setting_fit(13, False)),
            "setting_ragged": outcome(lambda: _setting_fit(ROWS, True)),
            "rankscale": outcome(
                lambda: _trace_fit(AutoNormal, ROWS, 2, scale=0.5 if world()[0] == 0 else 0.25)
            ),
        }
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def ranks(spawn_ranks, tmp_path_factory) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("s13dist"), timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case", ["bnn", "plain"])
def test_a_data_plate_sized_to_the_shard_is_refused_on_every_rank(ranks, case):
    for result in ranks:
        kind, message = result[case]
        assert kind == "ValueError"
        assert "'obs'" in message and "'data'" in message
        assert "subsample=idx" in message and "dataset_size=N" in message


@pytest.mark.parametrize("case", ["global", "features"])
def test_correct_plates_are_allowed_and_match_one_process(ranks, case):
    # an observation outside every plate; a full features plate inside the subsampled data plate
    torch.set_default_dtype(torch.float64)
    try:
        one = _quadrature_fit(case, False)
    finally:
        torch.set_default_dtype(torch.float32)
    for result in ranks:
        kind, store = result[case]
        assert kind == "ok"
        for name, value in one.items():
            torch.testing.assert_close(store[name], value, rtol=0, atol=1e-12)


def test_fit_on_two_ranks_matches_one_process(ranks):
    # docs/scaling.md, "fit on several ranks": the same losses and parameters as one process
    torch.set_default_dtype(torch.float64)
    try:
        losses, one = _fit_bnn(False)
    finally:
        torch.set_default_dtype(torch.float32)
    for result in ranks:
        kind, (rank_losses, store) = result["fit"]
        assert kind == "ok"
        assert rank_losses == pytest.approx(losses, rel=1e-12)
        for name, value in one.items():
            torch.testing.assert_close(store[name], value, rtol=0, atol=1e-12)


def test_a_distributed_checkpoint_of_autodiagonalnormal_resumes_bit_for_bit(ranks):
    for result in ranks:
        kind, (full, resumed, store, again) = result["checkpoint"]
        assert kind == "ok"
        assert resumed == full
        assert store.keys() == again.keys()
        for name in store:
            assert torch.equal(store[name], again[name]), name


def test_unequal_shards_under_trace_elbo_are_refused_at_the_first_step(ranks):
    for result in ranks:
        kind, message = result["unequal"]
        assert kind == "ValueError"
        assert "[7, 6] rows" in message and "share" in message


def test_equal_shards_under_trace_elbo_still_match_one_process(ranks):
    torch.set_default_dtype(torch.float64)
    try:
        one = _trace_fit(AutoNormal, ROWS, 3, distributed=False)
    finally:
        torch.set_default_dtype(torch.float32)
    for result in ranks:
        kind, store = result["equal"]
        assert kind == "ok"
        for name, value in one.items():
            torch.testing.assert_close(store[name], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["local_rows", "by_hand"])
def test_rows_scaled_by_a_local_subsample_or_by_hand_are_allowed(ranks, case):
    # last trial: equal local indices arange(B_r) around a features plate, and a minibatch
    # scaled by poutine.scale, were refused; both scale each rank's rows by N / B_r
    for result in ranks:
        kind, _ = result[case]
        assert kind == "ok"
    for name, value in ranks[0][case][1].items():
        assert torch.equal(ranks[1][case][1][name], value), name


def test_the_shard_is_the_largest_minibatch_of_an_observed_site(ranks):
    # review: the first observed site's 5 groups hid the data plate's 7 + 6 rows
    for result in ranks:
        kind, message = result["groups"]
        assert kind == "ValueError" and "([7, 6]" in message


def test_the_elbo_reads_the_shard_from_the_data_plate_not_the_first_argument(ranks):
    # trial: a first tensor argument that is no data hid 7 + 6 rows, and a ragged one (1 and 2
    # entries) refused equal shards; the rows are now the model's subsampled plate's minibatch
    for result in ranks:
        kind, message = result["setting_unequal"]
        assert kind == "ValueError" and "([7, 6]" in message
        kind, _ = result["setting_ragged"]
        assert kind == "ok"
    assert torch.equal(
        ranks[0]["setting_ragged"][1]["AutoMeanFieldNormal.locs.w"],
        ranks[1]["setting_ragged"][1]["AutoMeanFieldNormal.locs.w"],
    )


def test_a_different_scale_per_rank_is_refused_at_the_first_step_naming_it(ranks):
    for result in ranks:
        kind, message = result["rankscale"]
        assert kind == "RuntimeError"
        assert "poutine.scale" in message and "from 0.25 to 0.5" in message
        assert "seed" not in message


# ----------------------------------------------------------------------------- one process
def _adn_trace_run(steps: list[torch.Tensor], restore: tuple | None = None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDiagonalNormal(regression)
    optim = QNVB()
    svi = SVI(regression, guide, optim, Trace_ELBO())
    if restore is not None:
        store_state, optim_state, rng = restore
        with torch.no_grad():
            guide(steps[0])  # its parameters exist, then the store is restored over them
        pyro.get_param_store().set_state(copy.deepcopy(store_state))
        optim.set_state(copy.deepcopy(optim_state))
        torch.set_rng_state(rng)
    losses = [svi.step(idx) for idx in steps]
    return losses, guide, optim


def test_a_restored_store_under_trace_elbo_and_qnvb_resumes_bit_for_bit():
    torch.set_default_dtype(torch.float64)
    try:
        batches = _batches(ROWS, 6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the 'nothing paired' warning would be an error
            _, _, optim = _adn_trace_run(batches[:3])
            saved = (
                copy.deepcopy(pyro.get_param_store().get_state()),
                copy.deepcopy(optim.get_state()),
                torch.get_rng_state(),
            )
            full, _, _ = _adn_trace_run(batches)
            expected = _store()
            rest, guide, _ = _adn_trace_run(batches[3:], restore=saved)
        assert rest == full[3:]
        again = _store()
        for name in expected:
            assert torch.equal(again[name], expected[name]), name
        assert pyro.get_param_store()["AutoDiagonalNormal.loc"] is guide.loc
    finally:
        torch.set_default_dtype(torch.float32)


def test_nothing_paired_names_parameters_cut_off_by_a_restore():
    torch.set_default_dtype(torch.float64)
    try:
        _, guide, _ = _adn_trace_run(_batches(ROWS, 1))  # (the guide kept alive: it is live)
        store = pyro.get_param_store()
        store.set_state(copy.deepcopy(store.get_state()))  # new tensors; the guide has not run
        assert store["AutoDiagonalNormal.loc"] is not guide.loc
        params = [p for _, p in store.named_parameters()]
        for p in params:
            p.grad = torch.ones_like(p)
        with pytest.warns(RuntimeWarning, match=r"follow_param_store") as caught:
            QNVB()(params)
        assert "'AutoDiagonalNormal.loc'" in str(caught[0].message)
    finally:
        torch.set_default_dtype(torch.float32)


def _subsampling_model() -> None:
    w = pyro.sample("w", pdist.Normal(0.0, 1.0))
    with pyro.plate("data", N, subsample_size=6) as idx:
        z = pyro.sample("z", pdist.Normal(w * X[idx].float(), 1.0))
        pyro.sample("obs", pdist.Normal(z, 0.5), obs=Y[idx].float())


def test_the_outside_rows_refusal_names_jit_elbos():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(
        _subsampling_model, create_plates=lambda: pyro.plate("data", N, subsample_size=6)
    )
    svi = SVI(_subsampling_model, guide, QNVB(), JitTrace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"outside the minibatch") as caught:
            for _ in range(3):
                svi.step()
    assert "JitTrace_ELBO" in str(caught.value) and "Trace_ELBO instead" in str(caught.value)
