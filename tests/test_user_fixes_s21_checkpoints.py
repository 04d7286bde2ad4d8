"""User trial of session 21: restoring a checkpoint into a changed model or guide.

A store restored into a model whose site changed shape (one that broadcasts) or dtype fitted on
silently or failed inside torch; ``set_weights_only_state`` blamed a set-up guide for a
checkpoint of another model; a renamed site restarted silently under ``QNVB.set_state``; a
resumed ``fit`` numbered its metric steps from 1 again.
"""

from __future__ import annotations

import copy
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.nn import fit
from pyro_quadvi.store import listed_names, set_weights_only_state, shortened, weights_only_state


def _data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(50, 3, generator=generator)
    y = x @ torch.tensor([1.0, 0.0, -2.0]) + 0.3 * torch.randn(50, generator=generator)
    return x.to(dtype), y.to(dtype)


def _model(d: int = 3, name: str = "w", dtype: torch.dtype = torch.float32, prior=None):
    """A regression on the first ``d`` columns; ``w`` enters by broadcasting, so a ``(1,)`` model
    runs on a restored ``(3,)`` tensor without an error of torch's."""

    def regression(x, y):
        zero = torch.tensor(0.0, dtype=dtype)
        w = pyro.sample(name, (prior or dist.Normal(zero, 1.0)).expand([d]).to_event(1))
        s = pyro.sample("s", dist.LogNormal(zero, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal((x[:, :d] * w).sum(-1), s), obs=y)

    return regression


def _fit(model, guide, steps: int, x, y) -> tuple[SVI, QNVB]:
    qnvb = QNVB()
    svi = SVI(model, guide, qnvb, QuadratureELBO())
    for _ in range(steps):
        svi.step(x, y)
    return svi, qnvb


@pytest.fixture
def saved():
    """The param store's state (deep copy), its weights-only state and QNVB's, after five
    steps of the ``(3,)`` float32 model."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    _, qnvb = _fit(_model(), AutoMeanFieldNormal(_model()), 5, x, y)
    state = {
        "store": copy.deepcopy(pyro.get_param_store().get_state()),
        "wo": weights_only_state(),
        "qnvb": qnvb.get_state(),
    }
    pyro.clear_param_store()
    return state


# ---------------------------------------------------------------- 1. shapes and dtypes
def test_a_restored_store_of_another_shape_is_refused_naming_the_site_and_both_shapes(saved):
    x, y = _data()
    model = _model(d=1)
    guide = AutoMeanFieldNormal(model)
    guide(x, y)
    pyro.get_param_store().set_state(copy.deepcopy(saved["store"]))
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    with pytest.raises(ValueError) as error:
        svi.step(x, y)
    message = str(error.value)
    assert "'AutoMeanFieldNormal.locs.w' (site 'w') with shape (3,)" in message
    assert "set the site up with shape (1,)" in message
    assert "checkpoint of another model or guide" in message


def test_a_store_restored_before_the_set_up_is_refused_at_the_first_run(saved):
    # the set-up's pyro.param calls return the restored tensors: the record is of the initial
    # values the guide made, so the first run already refuses them
    x, y = _data()
    pyro.get_param_store().set_state(copy.deepcopy(saved["store"]))
    guide = AutoMeanFieldNormal(_model(d=2))
    with pytest.raises(ValueError, match=r"with shape \(3,\).*set the site up with shape \(2,\)"):
        guide(x, y)


def test_a_float32_store_restored_into_a_float64_model_is_refused_with_the_cast(saved):
    x, y = _data(torch.float64)
    model = _model(dtype=torch.float64)
    guide = AutoMeanFieldNormal(model)
    guide(x, y)
    pyro.get_param_store().set_state(copy.deepcopy(saved["store"]))
    with pytest.raises(ValueError) as error:
        guide(x, y)
    message = str(error.value)
    assert "(3,) and torch.float32, but the guide set the site up with shape (3,) and " in message
    assert "torch.float64" in message
    assert "t.to(torch.float64)" in message


def test_a_resumed_run_of_the_same_model_is_not_refused(saved):
    x, y = _data()
    guide = AutoMeanFieldNormal(_model())
    guide(x, y)
    pyro.get_param_store().set_state(copy.deepcopy(saved["store"]))
    qnvb = QNVB()
    qnvb.set_state(saved["qnvb"])
    svi = SVI(_model(), guide, qnvb, QuadratureELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [svi.step(x, y) for _ in range(3)]
    assert losses[0] < 60.0  # the saved fit's (a fresh one's first loss is above 100)


def test_auto_spike_slab_refuses_a_restored_logit_of_another_shape():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    prior = SpikeSlab(0.1, 2.0)
    guide = AutoSpikeSlab(_model(prior=prior))
    guide(x, y)
    state = copy.deepcopy(pyro.get_param_store().get_state())
    state["params"]["AutoSpikeSlab.logits.w"] = torch.zeros(4)
    pyro.get_param_store().set_state(state)
    with pytest.raises(ValueError, match=r"'AutoSpikeSlab.logits.w' \(site 'w'\) with shape \(4"):
        guide(x, y)


def test_set_weights_only_state_refuses_another_shape_or_dtype_restoring_nothing(saved):
    x, y = _data()
    guide = AutoMeanFieldNormal(_model(d=1))
    guide(x, y)
    before = {name: value.clone() for name, value in pyro.get_param_store().items()}
    with pytest.raises(ValueError, match=r"'AutoMeanFieldNormal.locs.w' has shape \(3,\) and "):
        set_weights_only_state(saved["wo"])
    assert sorted(pyro.get_param_store().keys()) == sorted(before)
    assert pyro.get_param_store()["AutoMeanFieldNormal.locs.w"].shape == (1,)

    pyro.clear_param_store()
    x, y = _data(torch.float64)
    AutoMeanFieldNormal(_model(dtype=torch.float64))(x, y)
    with pytest.raises(ValueError) as error:
        set_weights_only_state(saved["wo"])
    message = str(error.value)
    assert "holds it with shape (3,) and torch.float64" in message
    assert "state['params'] = {k: t.to(torch.float64) ...}" in message


# ---------------------------------------------------------------- 2. the blamed cause
def test_set_weights_only_state_names_another_model_and_lists_what_the_store_holds(saved):
    x, y = _data()
    AutoMeanFieldNormal(_model(name="v"))(x, y)
    with pytest.raises(ValueError) as error:
        set_weights_only_state(saved["wo"])
    message = str(error.value)
    assert "'AutoMeanFieldNormal.scales.w'" in message
    assert "or the checkpoint is of another model or guide" in message
    assert "the store holds 'AutoMeanFieldNormal.locs.v', 'AutoMeanFieldNormal.scales.v'" in message


# ---------------------------------------------------------------- 3. QNVB: saved blocks unbound
@pytest.mark.parametrize("change", ["rename", "guide class"])
def test_qnvb_warns_when_a_block_starts_afresh_while_saved_states_stay_unbound(saved, change):
    x, y = _data()
    model = _model(name="v") if change == "rename" else _model()
    guide = AutoMeanFieldNormal(model) if change == "rename" else AutoNormal(model)
    guide(x, y)
    pyro.get_param_store().set_state(copy.deepcopy(saved["store"]))
    qnvb = QNVB()
    qnvb.set_state(saved["qnvb"])
    svi = SVI(model, guide, qnvb, QuadratureELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi.step(x, y)
        first = len([w for w in caught if "after set_state" in str(w.message)])
        for _ in range(2):
            svi.step(x, y)
    ours = [str(w.message) for w in caught if "after set_state" in str(w.message)]
    assert first == 1  # at the end of the first step after the restore
    assert len(ours) == 1  # once
    fresh = "'AutoMeanFieldNormal.locs.v'" if change == "rename" else "'AutoNormal.locs.w'"
    assert f"the block(s) {fresh}" in ours[0] or f", {fresh}" in ours[0]
    assert "saved state(s) of 'AutoMeanFieldNormal.locs" in ours[0]
    assert "'AutoMeanFieldNormal.locs.w' bound to no parameter" in ours[0]


# ---------------------------------------------------------------- 4. fit resumed
def _fit_run(steps: int, start_step: int = 0, restore: dict | None = None):
    x, y = _data()
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 50, 10)]  # 5 per epoch
    model = _model()
    guide = AutoMeanFieldNormal(model)
    qnvb = QNVB()
    svi = SVI(model, guide, qnvb, QuadratureELBO())
    if restore is not None:
        guide(*batches[0])
        pyro.get_param_store().set_state(copy.deepcopy(restore["store"]))
        qnvb.set_state(restore["qnvb"])
        pyro.util.set_rng_state(restore["rng"])
    metrics = {"loc": lambda: float(guide.median()["w"].sum())}
    history = fit(
        svi, batches, steps, metrics=metrics, every=3, progress=False, start_step=start_step
    )
    state = {
        "store": copy.deepcopy(pyro.get_param_store().get_state()),
        "qnvb": qnvb.get_state(),
        "rng": pyro.util.get_rng_state(),
    }
    return history, state


def test_fit_resumed_at_an_epoch_end_goes_on_bit_for_bit_with_its_metric_steps():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    straight, _ = _fit_run(10)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    first, saved = _fit_run(5)
    pyro.clear_param_store()
    second, _ = _fit_run(5, start_step=5, restore=saved)
    assert first.loss + second.loss == straight.loss
    assert [step for step, _ in second.metrics["loc"]] == [6, 9, 10]
    assert second.metrics["loc"] == straight.metrics["loc"][1:]  # (3, 6, 9, 10): from 6 on
    svi_of_a_new_fit = SVI(_model(), AutoNormal(_model()), QNVB(), QuadratureELBO())
    with pytest.raises(ValueError, match="start_step must be an integer >= 0, got -5"):
        fit(svi_of_a_new_fit, _data(), 1, start_step=-5)


# ---------------------------------------------------------------- 1b. the guide's own conversions
def _fit_then_double(clear: bool) -> tuple[AutoMeanFieldNormal, SVI]:
    """Five float32 steps, then ``guide.double()`` (after ``pyro.clear_param_store()`` if
    ``clear``); returns the guide and the SVI of the float32 fit."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    guide = AutoMeanFieldNormal(_model())
    svi, _ = _fit(_model(), guide, 5, x, y)
    if clear:
        pyro.clear_param_store()
    guide.double()
    return guide, svi


def test_a_guide_converted_by_double_refits_in_float64_on_a_fresh_store():
    # the record of the set-up's dtypes follows the guide's own conversion: a refit in float64
    # with a new SVI and QNVB is no restored checkpoint of another model
    guide, _ = _fit_then_double(clear=True)
    x, y = _data(torch.float64)
    model = _model(dtype=torch.float64)
    _fit(model, guide, 30, x, y)
    assert guide.locs.w.dtype == torch.float64
    assert guide.locs.w.detach().tolist() == pytest.approx([1.0, 0.0, -2.0], abs=0.15)


def test_a_converted_guide_still_refuses_a_restored_store_of_the_old_dtype(saved):
    x, y = _data(torch.float64)
    guide = AutoMeanFieldNormal(_model())
    guide(*_data())
    guide.to(torch.float64)
    pyro.get_param_store().set_state(copy.deepcopy(saved["store"]))
    with pytest.raises(ValueError, match=r"\(3,\) and torch.float32, but the guide set"):
        guide(x, y)


def test_double_in_the_middle_of_a_fit_fails_in_the_update_naming_the_dtypes():
    # the same QNVB holds float32 averages: the update refuses them with both dtypes
    _, svi = _fit_then_double(clear=False)
    x, y = _data(torch.float64)
    with pytest.raises(TypeError, match=r"torch.float32.*torch.float64"):
        svi.step(x, y)


def test_one_helper_shortens_every_list_of_a_message():
    names = [f"p{i}" for i in range(8)]
    assert shortened(names, 8) == ", ".join(names)
    assert shortened(names, 3) == "p0, p1, p2, ... (8 in all)"
    assert shortened(names, 3, "sites") == "p0, p1, p2, ... (8 sites)"
    assert shortened(names, 3, None) == "p0, p1, p2 and 5 more"
    assert listed_names(names, 2) == "'p0', 'p1', ... (8 in all)"
