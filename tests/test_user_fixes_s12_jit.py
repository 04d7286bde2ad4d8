"""Fixes of a user trial: QNVB under Pyro's JIT ELBOs with a subsampled plate (the guide's
recorded minibatch is that of the traced run, so QNVB refuses it instead of updating the wrong
rows), and QNVB's warning for a guide it cannot describe (a whole guide or a part of an
``AutoGuideList``)."""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    JitTraceMeanField_ELBO,
    Predictive,
    Trace_ELBO,
    TraceMeanField_ELBO,
)
from pyro.infer.autoguide import AutoDelta, AutoGaussian, AutoGuideList, AutoStructured

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides import mean_field

N = 10
Y = torch.arange(1, N + 1, dtype=torch.float64)  # no row at its prior mean: every row moves
BATCHES = [torch.tensor([0, 1]), torch.tensor([5, 6]), torch.tensor([2, 9]), torch.tensor([3, 4])]
LOCS_THETA = "AutoMeanFieldNormal.locs.theta"


def _model(idx):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("N", N, subsample=idx) as rows:
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(theta, 1.0), obs=Y[rows])


def _plates(idx):
    return pyro.plate("N", N, subsample=idx)


def _store() -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in pyro.get_param_store().items()}


def _stale_message(why: str) -> str:
    return (
        f"QNVB: site 'theta' sits in a subsampled plate, and its guide {why}, so the minibatch "
        "rows and scale it recorded are not this step's (QNVB would update those rows and never "
        "the new ones). A JIT ELBO such as Pyro's JitTrace_ELBO replays the guide it traced at "
        "its first step without running it, so the guide cannot record its minibatch. Fit with "
        "Trace_ELBO (or TraceMeanField_ELBO), or with pyro_quadvi's QuadratureELBO, which "
        "publishes the moments; or keep the JIT ELBO and use pyro.optim.Adam"
    )


def _jit_svi():
    guide = AutoMeanFieldNormal(_model, create_plates=_plates)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's own warnings
        svi = SVI(_model, guide, QNVB(), JitTrace_ELBO())
        svi.step(BATCHES[0])  # traced: the guide ran in Python, its rows are this step's
    return svi


# -- Finding 1: JitTrace_ELBO replays the guide, so the recorded rows are the first step's ----


def test_jit_trace_elbo_on_a_subsampled_plate_is_refused_at_its_second_step(float64_store):
    pyro.set_rng_seed(0)
    svi = _jit_svi()
    first = _store()
    # the first (traced) step updated the rows of its minibatch and only those
    moved = (first[LOCS_THETA] != 0).nonzero().flatten().tolist()
    assert moved == [0, 1]
    with pytest.raises(ValueError) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        svi.step(BATCHES[1])
    assert str(caught.value) == _stale_message("has not run in Python since QNVB's previous step")
    # refused before any update: every parameter is as the first step left it
    after = _store()
    assert all(torch.equal(after[name], first[name]) for name in first)


def test_a_run_with_gradients_off_between_jit_steps_is_refused(float64_store):
    """``SVI.evaluate_loss`` runs Pyro's eager ``loss`` (the guide in Python, gradients off) on
    another minibatch: its rows are recorded, and the next JIT step must not read them."""
    pyro.set_rng_seed(0)
    svi = _jit_svi()
    svi.evaluate_loss(BATCHES[3])
    with pytest.raises(ValueError) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        svi.step(BATCHES[1])
    assert str(caught.value) == _stale_message(
        "last ran with gradients off (Predictive or SVI.evaluate_loss, say) and not since"
    )


def _fit(elbo, steps: int, between=None, burn: int = 0) -> list[dict[str, torch.Tensor]]:
    """``steps`` steps of QNVB over ``BATCHES``; ``between(svi, guide, batch)`` after each step
    with the random state restored after it (it then changes nothing but the guide's recorded
    run); ``burn`` eager loss evaluations before each step. The param store after each step."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(_model, create_plates=_plates)
    svi = SVI(_model, guide, QNVB(), elbo)
    stores = []
    for step in range(steps):
        batch = BATCHES[step % len(BATCHES)]
        with torch.no_grad():
            for _ in range(burn):
                elbo.loss(_model, guide, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svi.step(batch)
        stores.append(_store())
        if between is not None:
            state = pyro.util.get_rng_state()
            between(svi, guide, BATCHES[(step + 2) % len(BATCHES)])
            pyro.util.set_rng_state(state)
    return stores


def _evaluate_and_predict(svi, guide, batch):
    svi.evaluate_loss(batch)
    Predictive(_model, guide=guide, num_samples=3)(batch)


@pytest.mark.parametrize("make_elbo", [Trace_ELBO, TraceMeanField_ELBO, QuadratureELBO])
def test_eager_elbos_update_each_steps_rows_and_runs_between_steps_change_nothing(
    float64_store, make_elbo
):
    """The normal paths cannot be refused: each step's guide run records its rows (QNVB moves
    those and only those), and guide runs between steps (``evaluate_loss``, ``Predictive``, on
    other rows, gradients off) leave the fit bit for bit as it is without them."""
    plain = _fit(make_elbo(), 4)
    with_runs = _fit(make_elbo(), 4, between=_evaluate_and_predict)
    for a, b in zip(plain, with_runs):
        assert all(torch.equal(a[name], b[name]) for name in a)
    assert (plain[0][LOCS_THETA] != 0).nonzero().flatten().tolist() == [0, 1]  # the locs start at 0
    for batch, before, store in zip(BATCHES[1:], plain, plain[1:]):
        changed = (store[LOCS_THETA] != before[LOCS_THETA]).nonzero().flatten()
        assert changed.tolist() == sorted(batch.tolist())
        # a scale may keep its value (a step whose curvature read is not > 0), never off the batch
        name = "AutoMeanFieldNormal.scales.theta"
        assert set((store[name] != before[name]).nonzero().flatten().tolist()) <= set(
            changed.tolist()
        )


def test_jit_trace_mean_field_elbo_traces_every_step_so_it_fits_as_the_eager_elbo(float64_store):
    """Pyro 1.9's ``JitTraceMeanField_ELBO`` traces its loss again at every step (it looks for
    its compiled function under another attribute than the one it stores it in), so its guide
    runs in Python with each minibatch: nothing to refuse. Each step evaluates the loss twice in
    Python (the parameter capture, ``torch.jit.trace``) before the compiled graph draws, so
    ``TraceMeanField_ELBO`` with two evaluations before each step draws the same numbers; the
    rest is the same arithmetic, in the graph's float64 rounding (observed: equal to 2e-16)."""
    jit = _fit(JitTraceMeanField_ELBO(), 4)
    eager = _fit(TraceMeanField_ELBO(), 4, burn=2)
    for a, b in zip(jit, eager):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)
    assert (jit[-1][LOCS_THETA] != 0).nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 9]


def _plain_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("N", N):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(theta, 1.0), obs=y)


def _all_rows_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("N", N, subsample=torch.arange(N)):  # a "minibatch" of all rows
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(theta, 1.0), obs=y)


def _list_guide(model):
    guide = AutoGuideList(model)
    guide.append(AutoMeanFieldNormal(poutine.block(model, expose=["mu"])))
    guide.append(AutoMeanFieldNormal(poutine.block(model, expose=["theta"])))
    return guide


@pytest.mark.parametrize(
    "model, make_guide",
    [
        (_plain_model, AutoMeanFieldNormal),
        (
            _all_rows_model,
            lambda m: AutoMeanFieldNormal(
                m, create_plates=lambda y: pyro.plate("N", N, subsample=torch.arange(N))
            ),
        ),
        (_plain_model, _list_guide),
    ],
)
def test_a_full_batch_model_fits_under_jit_trace_elbo_as_under_trace_elbo(
    float64_store, model, make_guide
):
    """Without a minibatch the replayed guide's record is right at every step: QNVB under
    ``JitTrace_ELBO`` goes on as before. Its first call evaluates the loss twice in Python before
    the compiled graph draws; ``Trace_ELBO`` with two evaluations before its first step draws
    the same numbers, and after 100 steps the fits agree to float64 rounding (observed: 1 ulp)."""
    fits = []
    for elbo, burn in [(JitTrace_ELBO(), 0), (Trace_ELBO(), 2)]:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = make_guide(model)
        svi = SVI(model, guide, QNVB(), elbo)
        with torch.no_grad():
            for _ in range(burn):
                elbo.loss(model, guide, Y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(100):
                svi.step(Y)
        fits.append(_store())
    jit, eager = fits
    for name in jit:
        torch.testing.assert_close(jit[name], eager[name], rtol=0, atol=1e-12)
    # a fit, not a standstill: from 0 to near mu's posterior mean sum(y) / 2 / (1 / 100 + N / 2)
    mu = next(value for name, value in jit.items() if name.endswith("locs.mu"))
    assert abs(mu.item() - 27.5 / 5.01) < 0.5


def test_restored_copied_and_pickled_fits_go_on_exactly_and_are_not_refused(
    float64_store, monkeypatch
):
    """Every way of going on from step 2 gives the fit of going on directly, bit for bit: a new
    QNVB restored by ``set_state``, a deep copy of the guide (its recorded run is copied with
    it), and a pickled QNVB loaded where the guide runs are numbered afresh (another process:
    simulated by restarting the numbers so the next run gets the number the pickled QNVB last
    read; QNVB does not pickle the runs it read, so that number is no refusal)."""
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(_model, create_plates=_plates)
    optim = QNVB()
    svi = SVI(_model, guide, optim, Trace_ELBO())
    for batch in BATCHES[:2]:
        svi.step(batch)
    saved = (
        copy.deepcopy(pyro.get_param_store().get_state()),
        optim.get_state(),
        pyro.util.get_rng_state(),
    )
    pickled, read = pickle.dumps(optim), guide._last_run_stamp.number  # the run it read last

    def go_on(guide, optim, restore: bool = True) -> dict[str, torch.Tensor]:
        if restore:
            pyro.get_param_store().set_state(copy.deepcopy(saved[0]))
            pyro.util.set_rng_state(saved[2])
        svi = SVI(_model, guide, optim, Trace_ELBO())
        for batch in BATCHES[2:]:
            svi.step(batch)
        return _store()

    def restored() -> QNVB:
        optim = QNVB()
        optim.set_state(saved[1])
        return optim

    direct = go_on(guide, optim, restore=False)
    copied = copy.deepcopy(guide)
    # another process: its guide runs numbered afresh, the next one as the last one read here
    monkeypatch.setattr(mean_field, "_RUN_NUMBERS", itertools.count(read))
    others = [
        go_on(guide, pickle.loads(pickled)),
        go_on(guide, restored()),
        go_on(copied, restored()),
    ]
    for other in others:
        assert all(torch.equal(other[name], direct[name]) for name in direct)


# -- Finding 7: a guide QNVB cannot describe, whole or a part of an AutoGuideList -------------


def _hier():
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("J", 4):
        theta = pyro.sample("theta", dist.Normal(mu, 5.0))
        pyro.sample("obs", dist.Normal(theta, 2.0), obs=torch.tensor([3.0, -1.0, 2.0, 7.0]))


def _undescribed_warnings(guide, optim) -> tuple[list[str], dict[str, torch.Tensor]]:
    pyro.set_rng_seed(0)
    svi = SVI(_hier, guide, optim, Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            svi.step()
    return [str(w.message) for w in caught if "cannot describe" in str(w.message)], _store()


def _whole(kind: str, name: str) -> str:
    return (
        f"QNVB: the guide {name!r} ({kind}, the whole guide, not a part of an AutoGuideList) is "
        "of a kind QNVB cannot describe, so QNVB updates none of its parameters: they all go "
        "to the fallback optimizer (Adam). Fit it with Pyro's Adam directly (pyro.optim.Adam), "
        "or use a guide QNVB describes (AutoMeanFieldNormal, AutoNormal, AutoDiagonalNormal)."
    )


@pytest.mark.parametrize(
    "make, kind, name",
    [
        (lambda: AutoStructured(_hier, conditionals="normal"), "AutoStructured", "AutoStructured"),
        # its class as built, AutoGaussian, not its dense backend's (AutoGaussianDense), which is
        # the name of its parameters in the store
        (lambda: AutoGaussian(_hier), "AutoGaussian", "AutoGaussianDense"),
    ],
)
def test_a_whole_guide_qnvb_cannot_describe_is_named_and_fitted_as_by_adam(
    float64_store, make, kind, name
):
    messages, with_qnvb = _undescribed_warnings(make(), QNVB())
    assert messages == [_whole(kind, name)]
    # what the message says: QNVB's steps are its fallback's, Pyro's Adam(lr=1e-2), bit for bit
    pyro.clear_param_store()
    _, with_adam = _undescribed_warnings(make(), pyro.optim.Adam({"lr": 1e-2}))
    assert with_qnvb.keys() == with_adam.keys()
    assert all(torch.equal(with_qnvb[name], with_adam[name]) for name in with_adam)


def _list_with(part) -> AutoGuideList:
    guide = AutoGuideList(_hier)
    guide.append(AutoMeanFieldNormal(poutine.block(_hier, expose=["theta"])))
    guide.append(part(poutine.block(_hier, expose=["mu"])))
    return guide


def _part(kind: str, what: str) -> str:
    return (
        f"QNVB: the guide part 'AutoGuideList.1' ({kind}) is of a kind QNVB cannot describe, "
        f"so {what} go to the fallback optimizer (Adam); QNVB updates the parts of the "
        "AutoGuideList 'AutoGuideList' it describes. For QNVB updates of its latents make it a "
        "Gaussian part (AutoMeanFieldNormal, AutoNormal, AutoDiagonalNormal)."
    )


def test_a_part_qnvb_cannot_describe_is_named_as_a_part_of_its_list(float64_store):
    messages, _ = _undescribed_warnings(_list_with(AutoDelta), QNVB())
    assert messages == [_part("AutoDelta", "its point estimates (a MAP fit of its latents)")]
    pyro.clear_param_store()
    structured = lambda model: AutoStructured(model, conditionals="normal")  # noqa: E731
    messages, _ = _undescribed_warnings(_list_with(structured), QNVB())
    assert messages == [_part("AutoStructured", "its parameters")]


# -- several minibatches in one step: Trace_ELBO's particles, each drawing its own subsample ----


def _ten_rows():
    y = torch.arange(10, dtype=torch.float64)
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 10.0))
    with pyro.plate("N", 10, subsample_size=2) as idx:
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(theta, 1.0), obs=y[idx])


def test_gradients_outside_the_recorded_minibatch_are_refused_before_any_update():
    """``Trace_ELBO(num_particles=2)`` unvectorized runs the guide twice, on two subsamples: the
    gradients reach four rows, the guide recorded the last two. QNVB updated those two and
    dropped the others' gradients; it now refuses, changing nothing. With
    ``vectorize_particles=True`` the particles share one subsample and the fit runs."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(_ten_rows)
    guide()
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    svi = SVI(_ten_rows, guide, QNVB(), Trace_ELBO(num_particles=2))
    with pytest.raises(ValueError, match=r"^QNVB: site 'theta' sits in a subsampled plate, and "):
        svi.step()
    after = pyro.get_param_store()
    assert all(torch.equal(after[k].detach(), v) for k, v in before.items())
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(_ten_rows)
    vectorized = Trace_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(_ten_rows, guide, QNVB(), vectorized)
    losses = [svi.step() for _ in range(30)]
    assert all(math.isfinite(v) for v in losses)
    assert pyro.param("AutoMeanFieldNormal.scales.theta").detach().ne(0.1).sum() >= 2
