"""Optimizer state restore: what a trial reader found loaded silently or half-way.

``QNVB.set_state`` refuses a block state of another shape and other hyperparameters (naming the
block, the setting and both values), and still loads a state written before the hyperparameters
were recorded; ``QNVBOptimizer.load_state_dict`` refuses other run settings, a generator state
without a generator and a parameter of another shape, each before it loads anything.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from dataclasses import asdict

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.optim import QNVBOptimizer
from pyro_quadvi.optim.annealing import geometric_annealing
from pyro_quadvi.optim.qnvb_functional import QNVBHyperparameters
from pyro_quadvi.testing.compare import equal_nested

BLOCK = "AutoMeanFieldNormal.locs.w"


def _data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=generator)
    y = x.sum(-1) + 0.3 * torch.randn(30, generator=generator)
    return x, y


def _model(d=3, hints=None):
    def model(x, y=None):
        infer = {} if hints is None else {"qnvb": hints}
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1), infer=infer)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal((x[..., :d] * w).sum(-1), 0.5), obs=y)

    return model


def _fit(model, qnvb, steps, guide=None):
    """``steps`` Hadamard steps from a cleared store; the guide, its store state and the losses."""
    x, y = _data()
    if guide is None:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, qnvb, QuadratureELBO("hadamard"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        losses = [svi.step(x, y) for _ in range(steps)]
    return guide, losses


def _params() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


# ---------------------------------------------------------------------------------- QNVB (Pyro)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_qnvb_mid_fit_goes_on_as_the_original_bit_for_bit(how):
    # each block's state stays with the copy (bound again by name at its next use); before,
    # a deepcopy restarted every block from a fresh state and pickle raised on a weak reference
    model = _model()
    _, reference = _fit(model, QNVB(), 6)
    expected = _params()
    qnvb = QNVB()
    guide, first = _fit(model, qnvb, 3)
    copied = copy.deepcopy(qnvb) if how == "deepcopy" else pickle.loads(pickle.dumps(qnvb))
    _, rest = _fit(model, copied, 3, guide=guide)
    assert first + rest == reference
    assert equal_nested(_params(), expected)


def test_qnvb_refuses_a_block_state_of_another_shape_and_keeps_it():
    qnvb = QNVB(lr=0.5)
    _fit(_model(3), qnvb, 4)
    state = qnvb.get_state()

    model = _model(2)  # the site w is now (2,)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    guide(*_data())
    restored = QNVB(lr=0.5)
    restored.set_state(state)
    before = _params()
    with pytest.raises(ValueError, match=r"'AutoMeanFieldNormal\.locs\.w' has shape \(3,\)") as e:
        _fit(model, restored, 1, guide)
    assert "now has shape (2,)" in str(e.value) and "new QNVB" in str(e.value)
    after = _params()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was updated
    kept = restored.get_state()["qnvb"]["pairs"][BLOCK]
    assert torch.equal(kept["h_avg"], state["qnvb"]["pairs"][BLOCK]["h_avg"])  # not re-initialised


def test_qnvb_records_each_block_hyperparameters_and_refuses_others():
    qnvb = QNVB(lr=0.5)
    _fit(_model(), qnvb, 3)
    state = qnvb.get_state()
    record = state["qnvb"]["settings"][BLOCK]
    assert record == {"hyperparameters": asdict(QNVBHyperparameters(lr=0.5)), "hints": {}}

    other = QNVB(lr=0.1)
    with pytest.raises(ValueError) as e:
        other.set_state(state)
    message = str(e.value)
    assert f"block {BLOCK!r}" in message and "lr=0.5 (this optimizer: 0.1)" in message
    assert "construct the optimizer with the saved settings" in message
    assert other.num_steps == 0 and other.get_state()["qnvb"]["pairs"] == {}  # nothing restored

    with pytest.raises(
        ValueError, match=r"betas=\(0\.0, 0\.999\) \(this optimizer: \(0\.5, 0\.9\)\)"
    ):
        QNVB(lr=0.5, betas=(0.5, 0.9)).set_state(state)


def test_qnvb_checks_hyperparameters_under_the_model_hints():
    """A block's hyperparameters come from its model's hints under QNVB's settings: the record
    holds the hints, so the same QNVB is accepted and one that overrides them is refused."""
    hints = {"lr": 0.3}
    qnvb = QNVB()
    _fit(_model(hints=hints), qnvb, 2)
    state = qnvb.get_state()
    assert state["qnvb"]["settings"][BLOCK]["hyperparameters"]["lr"] == 0.3
    same = QNVB()
    same.set_state(state)
    assert same.get_state()["qnvb"]["settings"] == state["qnvb"]["settings"]
    with pytest.raises(ValueError, match=r"lr=0\.3 \(this optimizer: 0\.2\)"):
        QNVB(lr=0.2).set_state(state)  # QNVB's keyword arguments override the model's hints


def test_qnvb_state_in_the_old_layout_loads_and_resumes_exactly():
    """A state written before the record (``{"qnvb": {"num_steps", "pairs"}, "fallback"}``)
    loads, and the run continues bit for bit."""
    model = _model()
    _, full_losses = _fit(model, QNVB(lr=0.5), 6)
    full = _params()

    qnvb = QNVB(lr=0.5)
    guide, _ = _fit(model, qnvb, 3)
    state = qnvb.get_state()
    old = {
        "qnvb": {"num_steps": state["qnvb"]["num_steps"], "pairs": state["qnvb"]["pairs"]},
        "fallback": state["fallback"],
    }
    store = copy.deepcopy(pyro.get_param_store().get_state())
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model)
    guide(*_data())
    pyro.get_param_store().set_state(store)
    resumed = QNVB(lr=0.5)
    resumed.set_state(old)
    _, losses = _fit(model, resumed, 3, guide)
    assert losses == full_losses[3:]
    after = _params()
    assert all(torch.equal(full[k], after[k]) for k in full)
    # the blocks updated since are recorded again
    assert resumed.get_state()["qnvb"]["settings"][BLOCK]["hyperparameters"]["lr"] == 0.5


def test_qnvb_keeps_the_states_and_records_of_blocks_not_seen():
    qnvb = QNVB(lr=0.5)
    _fit(_model(), qnvb, 2)
    state = qnvb.get_state()
    other = QNVB(lr=0.5)
    other.set_state(state)
    pyro.clear_param_store()
    guide = pyro.infer.autoguide.AutoNormal(_model())  # another guide name: w is not seen
    _fit(_model(), other, 1, guide)
    again = other.get_state()["qnvb"]
    assert set(again["pairs"]) == {BLOCK, "AutoNormal.locs.w"}
    assert torch.equal(again["pairs"][BLOCK]["g_avg"], state["qnvb"]["pairs"][BLOCK]["g_avg"])
    assert again["settings"][BLOCK] == state["qnvb"]["settings"][BLOCK]


# ------------------------------------------------------------------------------ QNVBOptimizer
def _net(out=1):
    torch.manual_seed(0)
    return torch.nn.Linear(4, out)


def _run(net, optimizer, steps):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, net.out_features, generator=torch.Generator().manual_seed(2))

    def closure():
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(steps):
            optimizer.step(closure)


def _saved(**kwargs):
    net = _net()
    optimizer = QNVBOptimizer(net.parameters(), **kwargs)
    _run(net, optimizer, 3)
    return optimizer.state_dict()


def test_torch_state_dict_records_the_run_settings():
    state = _saved(likelihood_weight=32, quadrature="hadamard", prior_precision=2.0)
    assert state["qnvb"]["settings"] == {
        "quadrature": "hadamard",
        "num_eval": 4,
        "likelihood_weight": 32.0,
        "prior_precision": 2.0,
        "annealing": False,
    }


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (
            dict(likelihood_weight=1000, quadrature="rasp_simplex"),
            [
                "likelihood_weight=32.0 (this optimizer: 1000.0)",
                "num_eval=4 (this optimizer: 3)",
                "quadrature='hadamard' (this optimizer: 'rasp_simplex')",
            ],
        ),
        (dict(likelihood_weight=32, quadrature="hadamard", num_eval=8), ["num_eval=4"]),
        (
            dict(likelihood_weight=32, quadrature="hadamard", prior_precision=1.0),
            ["prior_precision=0.0 (this optimizer: 1.0)"],
        ),
        (
            dict(
                likelihood_weight=32, quadrature="hadamard", annealing=geometric_annealing(0.1, 9)
            ),
            ["annealing=False (this optimizer: True)"],
        ),
    ],
)
def test_torch_load_refuses_other_run_settings(kwargs, expected):
    saved = _saved(likelihood_weight=32, quadrature="hadamard", lr=0.5)
    net = _net()
    optimizer = QNVBOptimizer(net.parameters(), generator=torch.Generator(), lr=0.1, **kwargs)
    with pytest.raises(ValueError) as e:
        optimizer.load_state_dict(saved)
    assert all(part in str(e.value) for part in expected), str(e.value)
    assert "construct the optimizer with the saved settings" in str(e.value)
    assert optimizer.num_steps == 0 and optimizer.param_groups[0]["lr"] == 0.1
    assert len(optimizer.state) == 0


def test_torch_load_takes_the_saved_per_group_values():
    """``lr`` and the other per-group values follow torch's convention: the loaded ones win."""
    saved = _saved(likelihood_weight=32, quadrature="hadamard", lr=0.5)
    optimizer = QNVBOptimizer(_net().parameters(), likelihood_weight=32, quadrature="hadamard")
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["lr"] == 0.5 and optimizer.num_steps == 3


def test_torch_refused_load_leaves_the_optimizer_exactly_as_it_was():
    """A generator state into an optimizer without one is refused before anything is loaded (a
    random rule: a deterministic one draws nothing, and either loads)."""
    rule = "blocked_simplex"
    saved = _saved(likelihood_weight=32, quadrature=rule, generator=torch.Generator(), lr=0.5)
    net = _net()
    optimizer = QNVBOptimizer(net.parameters(), likelihood_weight=32, quadrature=rule)
    _run(net, optimizer, 2)
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match="construct the optimizer with a generator"):
        optimizer.load_state_dict(saved)
    assert equal_nested(optimizer.state_dict(), before)
    assert optimizer.num_steps == 2 and optimizer.param_groups[0]["lr"] == 1.0
    deterministic = QNVBOptimizer(_net().parameters(), likelihood_weight=32, quadrature="hadamard")
    deterministic.load_state_dict(
        _saved(likelihood_weight=32, quadrature="hadamard", generator=torch.Generator())
    )
    assert deterministic.generator is None


@pytest.mark.parametrize("named", [False, True])
def test_torch_load_refuses_a_parameter_of_another_shape(named):
    saved = _saved(likelihood_weight=32)
    net = _net(out=2)  # weight (2, 4) and bias (2,) where the state has (1, 4) and (1,)
    params = net.named_parameters() if named else net.parameters()
    optimizer = QNVBOptimizer(params, likelihood_weight=32)
    label = "parameter 0 ('weight')" if named else "parameter 0"
    with pytest.raises(ValueError) as e:
        optimizer.load_state_dict(saved)
    assert f"saved state of {label} has shape (1, 4), but the parameter has shape (2, 4)" in str(
        e.value
    )
    assert len(optimizer.state) == 0 and optimizer.num_steps == 0


def test_torch_state_dict_in_the_old_layout_loads_and_resumes_exactly():
    """A state dict written before the settings were saved loads (unchecked), and the run goes
    on as the uninterrupted one."""
    kwargs = dict(likelihood_weight=32, quadrature="hadamard")
    net = _net()
    optimizer = QNVBOptimizer(net.parameters(), **kwargs)
    _run(net, optimizer, 5)
    full = copy.deepcopy(net.state_dict())

    net = _net()
    optimizer = QNVBOptimizer(net.parameters(), **kwargs)
    _run(net, optimizer, 2)
    state = copy.deepcopy(optimizer.state_dict())
    del state["qnvb"]["settings"]
    weights = copy.deepcopy(net.state_dict())
    net = _net()
    net.load_state_dict(weights)
    resumed = QNVBOptimizer(net.parameters(), **kwargs)
    resumed.load_state_dict(state)
    _run(net, resumed, 3)
    assert all(torch.equal(full[k], v) for k, v in net.state_dict().items())
