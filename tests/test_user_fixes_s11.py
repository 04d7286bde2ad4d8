"""Fixes of a user trial on the Pyro path: a guide's plain ``nn.Parameter`` after restoring the
param store (AutoDiagonalNormal's ``loc``), ``fit``'s metric values, float16 probabilities in the
metrics, and the fallback's warning for guide parts QNVB does not update."""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import (
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_quadvi import QNVB, QuadratureELBO
from pyro_quadvi.export import to_inference_data
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.store import follow_param_store

# -- F1: a guide's plain nn.Parameters follow a restored param store ------------------------------


def _logistic_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=generator)
    y = (x @ torch.tensor([1.0, -2.0, 0.5]) > 0).float()
    return x, y


def _logistic(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Bernoulli(logits=(x * w).sum(-1)), obs=y)


_OPTIMS = {"qnvb": QNVB, "adam": lambda: pyro.optim.Adam({"lr": 0.1})}


def _build(guide_class, optim_name):
    guide = guide_class(_logistic)
    optim = _OPTIMS[optim_name]()
    return guide, optim, SVI(_logistic, guide, optim, QuadratureELBO(rule="hadamard"))


def _guide_values(guide) -> dict[str, torch.Tensor]:
    """The guide's parameters as it computes with them (its own tensors, constrained)."""
    return {name: getattr(guide, name).detach().clone() for name, _ in guide.named_parameters()}


def _checkpoint(optim) -> tuple:
    """docs/qnvb.md, "Checkpoints": the store copied, the optimizer's state, the random state."""
    store = copy.deepcopy(pyro.get_param_store().get_state())
    return store, optim.get_state(), pyro.util.get_rng_state()


def _restore(checkpoint: tuple, optim) -> None:
    """The recipe's restore, into a cleared store (and new objects for a new process)."""
    store, optim_state, rng_state = checkpoint
    pyro.get_param_store().set_state(copy.deepcopy(store))
    optim.set_state(optim_state)
    pyro.util.set_rng_state(rng_state)


@pytest.mark.parametrize(
    "guide_class, optim_name, fresh",
    [
        (AutoDiagonalNormal, "qnvb", "memory"),
        (AutoDiagonalNormal, "qnvb", "process"),
        (AutoMultivariateNormal, "adam", "memory"),
        (AutoMultivariateNormal, "adam", "process"),
        (AutoLowRankMultivariateNormal, "adam", "process"),
    ],
)
def test_the_checkpoint_recipe_resumes_a_guide_with_a_plain_loc_bit_for_bit(
    guide_class, optim_name, fresh
):
    x, y = _logistic_data()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, _, svi = _build(guide_class, optim_name)
    expected = [svi.step(x, y) for _ in range(8)]
    expected_values = _guide_values(guide)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, optim, svi = _build(guide_class, optim_name)
    got = [svi.step(x, y) for _ in range(3)]
    checkpoint = _checkpoint(optim)
    pyro.clear_param_store()
    if fresh == "process":  # a new process: everything built again and the guide run once
        guide, optim, svi = _build(guide_class, optim_name)
        guide(x, y)
    _restore(checkpoint, optim)
    got += [svi.step(x, y) for _ in range(5)]

    assert got == expected
    values = _guide_values(guide)
    assert set(values) == set(expected_values) and "loc" in values
    for name, value in expected_values.items():
        assert torch.equal(values[name], value), name
    # the guide's loc is the store's again: one tensor, trained
    assert pyro.get_param_store()[f"{type(guide).__name__}.loc"] is guide.loc


def test_follow_param_store_copies_the_restored_value_once_and_leaves_pyro_params_alone():
    x, y = _logistic_data()
    pyro.clear_param_store()
    guide = AutoDiagonalNormal(_logistic)
    guide(x, y)
    loc, scale_leaf = guide.loc, guide.scale_unconstrained
    saved = copy.deepcopy(pyro.get_param_store().get_state())
    saved["params"]["AutoDiagonalNormal.loc"] = torch.tensor([0.25, -1.5, 2.0])
    pyro.clear_param_store()
    pyro.get_param_store().set_state(saved)
    store = pyro.get_param_store()
    restored_scale = store._params["AutoDiagonalNormal.scale"]

    follow_param_store(guide)
    assert guide.loc is loc  # the guide's own Parameter, holding the restored value
    assert guide.loc.tolist() == [0.25, -1.5, 2.0]
    assert store["AutoDiagonalNormal.loc"] is loc
    # the PyroParam's leaf is left to Pyro, which swaps it in when the guide reads it
    assert store._params["AutoDiagonalNormal.scale"] is restored_scale
    assert guide.scale_unconstrained is scale_leaf
    guide(x, y)
    assert guide.scale_unconstrained is restored_scale
    # a guide that is not a PyroModule, and local mode, are left alone
    follow_param_store(lambda *args: None)
    store["AutoDiagonalNormal.loc"] = torch.zeros(3)
    with pyro.settings.context(module_local_params=True):
        follow_param_store(guide)
    assert guide.loc.tolist() == [0.25, -1.5, 2.0]


def test_a_store_of_another_shape_is_refused_naming_the_parameter():
    x, y = _logistic_data()
    pyro.clear_param_store()
    guide = AutoDiagonalNormal(_logistic)
    guide(x, y)
    pyro.get_param_store()["AutoDiagonalNormal.loc"] = torch.zeros(5)
    svi = SVI(_logistic, guide, pyro.optim.Adam({"lr": 0.1}), QuadratureELBO())
    with pytest.raises(ValueError, match=r"'AutoDiagonalNormal.loc' of shape \(5,\).*\(3,\)"):
        svi.step(x, y)


def _bnn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    return BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(scale=0.1))


def _regression_data():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(24, 2, generator=generator)
    return x, torch.sin(x.sum(-1, keepdim=True))


def _train_and_restore_into_a_new_guide():
    """A guide trained 4 steps, and a new guide of the same model (run once) after the trained
    store was restored: the second must compute with the first's values."""
    x, y = _regression_data()
    bnn = _bnn()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    trained = AutoDiagonalNormal(bnn)
    svi = SVI(bnn, trained, pyro.optim.Adam({"lr": 0.05}), QuadratureELBO())
    for _ in range(4):
        svi.step(x, y)
    saved = copy.deepcopy(pyro.get_param_store().get_state())
    pyro.clear_param_store()
    restored = AutoDiagonalNormal(bnn)
    restored(x, y)
    assert not torch.equal(restored.loc, trained.loc)  # before the restore: its own start
    pyro.get_param_store().set_state(copy.deepcopy(saved))
    return bnn, trained, restored, x, y


def test_predict_right_after_a_restore_uses_the_restored_loc():
    bnn, trained, restored, x, _ = _train_and_restore_into_a_new_guide()
    pyro.set_rng_seed(5)
    expected = bnn.predict(trained, x, num_samples=16)
    pyro.set_rng_seed(5)
    got = bnn.predict(restored, x, num_samples=16)
    assert torch.equal(restored.loc, trained.loc)
    assert torch.equal(got.mean, expected.mean)
    assert torch.equal(got.variance, expected.variance)


def test_the_arviz_export_right_after_a_restore_uses_the_restored_loc():
    bnn, trained, restored, x, y = _train_and_restore_into_a_new_guide()
    exported = {}
    for name, guide in [("trained", trained), ("restored", restored)]:
        pyro.set_rng_seed(5)
        data = to_inference_data(bnn, guide, x, y, num_samples=8, prior=False)
        exported[name] = data.posterior["0.weight"].values
    assert (exported["restored"] == exported["trained"]).all()


def test_an_auto_normal_is_untouched_by_follow_param_store():
    # PyroParams only: nothing to follow, nothing recorded
    from pyro_quadvi.store import _INSTALLED

    x, y = _logistic_data()
    pyro.clear_param_store()
    guide = AutoNormal(_logistic)
    guide(x, y)
    before = dict(pyro.get_param_store()._params)
    pyro.get_param_store().set_state(copy.deepcopy(pyro.get_param_store().get_state()))
    restored = dict(pyro.get_param_store()._params)
    follow_param_store(guide)
    after = pyro.get_param_store()._params
    assert list(after) == list(before)
    assert all(
        after[name] is restored[name] and restored[name] is not before[name] for name in before
    )
    assert guide not in _INSTALLED


def test_fit_resumes_a_plain_loc_under_pyros_own_elbo_after_a_restore():
    # fit hands the guide the restored values whatever the ELBO (here Pyro's Trace_ELBO)
    from pyro.infer import Trace_ELBO

    from pyro_quadvi.nn import fit

    x, y = _logistic_data()

    def build():
        guide = AutoDiagonalNormal(_logistic)
        optim = pyro.optim.Adam({"lr": 0.1})
        return guide, optim, SVI(_logistic, guide, optim, Trace_ELBO())

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, _, svi = build()
    expected = fit(svi, (x, y), 7, progress=False).loss
    expected_loc = guide.loc.detach().clone()

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, optim, svi = build()
    got = fit(svi, (x, y), 3, progress=False).loss
    checkpoint = _checkpoint(optim)
    pyro.clear_param_store()
    _restore(checkpoint, optim)
    got += fit(svi, (x, y), 4, progress=False).loss
    assert got == expected
    assert torch.equal(guide.loc, expected_loc)


class _LinearRegression(PyroModule):
    """Pyro's tutorial style: a PyroModule model whose PyroModule[nn.Linear] has a PyroSample
    weight and a plain nn.Parameter bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.linear = PyroModule[nn.Linear](3, 1)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))

    def forward(self, x, y=None):
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(mean, 0.5), obs=y)


@pytest.mark.parametrize("how", ["quadrature", "fit"])
def test_a_pyro_module_models_plain_bias_resumes_bit_for_bit(how):
    # before: after the restore the store held another tensor than model.bias, which the model
    # kept reading: neither moved again (QuadratureELBO and fit under Trace_ELBO alike)
    from pyro.infer import Trace_ELBO

    from pyro_quadvi.nn import fit

    x, y = _logistic_data()
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.7

    def build():
        model = _LinearRegression()
        guide = AutoNormal(model)
        optim = pyro.optim.Adam({"lr": 0.1})
        elbo = QuadratureELBO(rule="hadamard") if how == "quadrature" else Trace_ELBO()
        return model.linear, optim, SVI(model, guide, optim, elbo)

    def steps(svi, n):
        if how == "fit":
            return fit(svi, (x, y), n, progress=False).loss
        return [svi.step(x, y) for _ in range(n)]

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    module, _, svi = build()
    expected = steps(svi, 7)
    expected_bias = module.bias.detach().clone()

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    module, optim, svi = build()
    got = steps(svi, 3)
    checkpoint = _checkpoint(optim)
    pyro.clear_param_store()
    _restore(checkpoint, optim)
    got += steps(svi, 4)
    assert got == expected
    assert torch.equal(module.bias, expected_bias)
    assert pyro.get_param_store()["linear.bias"] is module.bias


def test_a_compiled_guide_follows_the_store_through_torch_compile():
    # before: unwrap_guide stopped at torch.compile's OptimizedModule, so the guide's loc kept
    # its own value after a restore; and with QNVB's global module hook installed (QNVB()), dynamo
    # traced the hook's WeakSet and raised on the compiled guide's call
    QNVB()
    x, y = _logistic_data()
    pyro.clear_param_store()
    guide = AutoDiagonalNormal(_logistic)
    compiled = torch.compile(guide, backend="eager")
    compiled(x, y)
    saved = copy.deepcopy(pyro.get_param_store().get_state())
    saved["params"]["AutoDiagonalNormal.loc"] = torch.tensor([0.25, -1.5, 2.0])
    pyro.clear_param_store()
    pyro.get_param_store().set_state(saved)
    from pyro_quadvi.guides.interface import unwrap_guide

    assert unwrap_guide(compiled) is guide
    follow_param_store(compiled)  # as the docs say to call it: on the compiled guide itself
    assert guide.loc.tolist() == [0.25, -1.5, 2.0]
    assert pyro.get_param_store()["AutoDiagonalNormal.loc"] is guide.loc

    # a module of the user's that merely holds another in `_orig_mod` is not torch.compile's
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    wrapper = Wrapper(guide)
    assert unwrap_guide(wrapper) is wrapper


def test_a_guide_compiled_in_place_fits_as_the_eager_guide_without_torchs_hook_warning():
    """docs/guides.md: ``guide.compile()`` gives the eager guide's losses bit for bit, and torch
    does not warn; the wrapper ``torch.compile(guide)`` gives them too, with torch's warning that
    a global module hook (QNVB's guide watch) fires an extra time."""
    import warnings

    x, y = _logistic_data()

    def losses(mode: str) -> tuple[list[float], list[str]]:
        pyro.clear_param_store()
        guide = AutoDiagonalNormal(_logistic)
        if mode == "in place":
            guide.compile(backend="eager")
        run = torch.compile(guide, backend="eager") if mode == "wrapper" else guide
        svi = SVI(_logistic, run, QNVB(), QuadratureELBO(rule="hadamard"))
        pyro.set_rng_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = [svi.step(x, y) for _ in range(4)]
        return values, [str(w.message) for w in caught if "global hooks" in str(w.message)]

    eager, none = losses("eager")
    in_place, in_place_warnings = losses("in place")
    wrapped, wrapper_warnings = losses("wrapper")
    assert eager[-1] < eager[0] - 1.0  # the fit moves
    assert in_place == eager and wrapped == eager
    assert none == [] and in_place_warnings == [] and len(wrapper_warnings) >= 1


def test_a_compiled_guide_resumes_bit_for_bit_through_quadrature_elbo():
    x, y = _logistic_data()

    def build():
        guide = AutoDiagonalNormal(_logistic)
        optim = QNVB()
        svi = SVI(_logistic, torch.compile(guide, backend="eager"), optim, QuadratureELBO())
        return guide, optim, svi

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, _, svi = build()
    expected = [svi.step(x, y) for _ in range(6)]
    expected_loc = guide.loc.detach().clone()

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, optim, svi = build()
    got = [svi.step(x, y) for _ in range(3)]
    checkpoint = _checkpoint(optim)
    pyro.clear_param_store()
    guide, optim, svi = build()  # a new process: built again and run once
    svi.guide(x, y)
    _restore(checkpoint, optim)
    got += [svi.step(x, y) for _ in range(3)]
    assert got == expected
    assert torch.equal(guide.loc, expected_loc)


def test_the_arviz_export_right_after_a_restore_uses_a_pyro_module_models_restored_bias():
    # before: to_inference_data followed the guide only; the model's plain bias kept its own value
    x, _ = _logistic_data()
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.7
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    trained_model = _LinearRegression()
    trained_guide = AutoNormal(trained_model)
    svi = SVI(trained_model, trained_guide, pyro.optim.Adam({"lr": 0.1}), QuadratureELBO())
    for _ in range(5):
        svi.step(x, y)
    saved = copy.deepcopy(pyro.get_param_store().get_state())
    pyro.clear_param_store()
    model = _LinearRegression()  # a new process: built again, the guide run once
    guide = AutoNormal(model)
    guide(x, y)
    pyro.get_param_store().set_state(copy.deepcopy(saved))
    exported = []
    for m, g in [(trained_model, trained_guide), (model, guide)]:
        pyro.set_rng_seed(5)
        data = to_inference_data(m, g, x, y, num_samples=8, prior=False)
        exported.append(data.log_likelihood["y"].values)
    assert torch.equal(model.linear.bias, trained_model.linear.bias)
    assert (exported[1] == exported[0]).all()


def test_a_store_of_another_dtype_is_refused_naming_the_dtypes_and_the_fix():
    x, y = _logistic_data()
    pyro.clear_param_store()
    guide = AutoDiagonalNormal(_logistic)
    guide(x, y)
    pyro.get_param_store()["AutoDiagonalNormal.loc"] = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"'AutoDiagonalNormal.loc' as torch.float64, but the module's parameter is "
        r"torch.float32: convert the module \(module.to\(torch.float64\)\)",
    ):
        follow_param_store(guide)


# -- F3: fit's metrics return one number -------------------------------------------------------


@pytest.mark.parametrize(
    "value, what",
    [
        ({"nll": 1.0, "rmse": 2.0}, r"a dict \(keys \['nll', 'rmse'\]\)"),
        (torch.tensor([1.0, 2.0]), r"a torch.float32 tensor of shape \(2,\)"),
        ("0.5", r"the string '0.5'"),
        (None, r"a NoneType"),
    ],
)
def test_a_metric_that_returns_more_than_one_number_is_refused_naming_it(value, what):
    from pyro_quadvi.nn import fit

    x, y = _logistic_data()
    pyro.clear_param_store()
    svi = SVI(_logistic, AutoNormal(_logistic), pyro.optim.Adam({"lr": 0.1}), QuadratureELBO())
    calls = []

    def good():
        calls.append(1)
        return torch.tensor(0.25, dtype=torch.float64)

    with pytest.raises(TypeError, match=rf"fit: the metric 'val' returned {what} after step 2; "):
        fit(svi, (x, y), 4, metrics={"ok": good, "val": lambda: value}, every=2, progress=False)
    assert len(calls) == 1  # taken once, at step 2, before 'val' was refused


def test_numbers_of_every_kind_are_recorded_as_floats():
    import numpy as np

    from pyro_quadvi.nn import fit

    x, y = _logistic_data()
    pyro.clear_param_store()
    svi = SVI(_logistic, AutoNormal(_logistic), pyro.optim.Adam({"lr": 0.1}), QuadratureELBO())
    metrics = {
        "float": lambda: 0.5,
        "int": lambda: 3,
        "tensor": lambda: torch.tensor(0.125),
        "numpy": lambda: np.float32(0.75),
    }
    history = fit(svi, (x, y), 2, metrics=metrics, every=2, progress=False)
    assert history.metrics == {
        "float": [(2, 0.5)],
        "int": [(2, 3.0)],
        "tensor": [(2, 0.125)],
        "numpy": [(2, 0.75)],
    }
    assert all(type(v) is float for values in history.metrics.values() for _, v in values)


# -- F4: low-precision probabilities -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_probabilities_are_accepted_and_logits_still_refused(dtype):
    from pyro_quadvi import metrics

    generator = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(500, 10, generator=generator)
    y = torch.randint(0, 10, (500,), generator=generator)
    exact = torch.softmax(logits.double(), -1)
    probs = torch.softmax(logits, -1).to(dtype)  # rows off by up to half an ulp of 1, and more
    assert (probs.double().sum(-1) - 1).abs().max() > metrics.PROB_SUM_ATOL
    eps = torch.finfo(dtype).eps
    # each metric as in float64, within what the dtype's rounding of the probabilities allows
    assert metrics.accuracy(probs, y).item() == pytest.approx(
        metrics.accuracy(exact, y).item(), abs=eps
    )
    assert metrics.brier_score(probs, y).item() == pytest.approx(
        metrics.brier_score(exact, y).item(), abs=8 * eps
    )
    # clamped in float32, not at the dtype's eps (which would cap each case's cost at 6.9/4.9)
    reference = -exact.gather(1, y[:, None]).clamp(min=torch.finfo(torch.float32).eps).log().mean()
    nll = metrics.categorical_nll(probs, y)
    assert nll.dtype == dtype
    assert nll.item() == pytest.approx(reference.item(), rel=2 * eps)
    ece = metrics.expected_calibration_error(probs, y)
    assert ece.item() == pytest.approx(
        metrics.expected_calibration_error(exact, y).item(), abs=0.02
    )
    # a row of numbers in [0, 1] that are not probabilities is still refused
    bad = probs.clone()
    bad[7] = torch.tensor([0.25, 0.75, 0.5, 0, 0, 0, 0, 0, 0, 0], dtype=dtype)
    within = f"{4 * eps:.3g} for {dtype}"
    off = torch.tensor([[0.5, 0.5625]], dtype=dtype)  # 1.0625: 8 ulps of bfloat16 (64 of float16)
    with pytest.raises(ValueError, match="sum to 1 within"):
        metrics.categorical_nll(off, torch.tensor([0]))
    with pytest.raises(
        ValueError, match=rf"sum to 1 within {within}; the worst row is off by 0.5 "
    ):
        metrics.categorical_nll(bad, y)


# -- F5b: a guide part QNVB cannot describe is named when it goes to the fallback --------------


def _two_site_model(x):
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    s = pyro.sample("s", dist.Normal(0.0, 1.0))
    noise = pyro.param("noise", torch.tensor(1.0), constraint=dist.constraints.positive)
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(z + s, noise), obs=x)


def test_an_auto_delta_beside_an_auto_normal_is_named_once_as_it_goes_to_the_fallback():
    import warnings

    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoDelta, AutoGuideList

    x = torch.randn(20, generator=torch.Generator().manual_seed(0)) + 1.5
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    guide = AutoGuideList(_two_site_model)
    guide.append(AutoNormal(pyro.poutine.block(_two_site_model, expose=["z"])))
    guide.append(AutoDelta(pyro.poutine.block(_two_site_model, expose=["s"])))
    svi = SVI(_two_site_model, guide, QNVB(), Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi.step(x)
        start = pyro.param("AutoGuideList.1.s").item()
        for _ in range(3):
            svi.step(x)
    messages = [str(w.message) for w in caught if "guide part" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith(
        "QNVB: the guide part 'AutoGuideList.1' (AutoDelta) is of a kind QNVB cannot describe"
    )
    assert "fallback optimizer (Adam)" in messages[0]
    # the fallback trains it; the model's own pyro.param 'noise' is not a guide part: no warning
    assert pyro.param("AutoGuideList.1.s").item() != start
    assert not any("noise" in m for m in messages)
