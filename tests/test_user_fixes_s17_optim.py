"""Fixes of faults the session 17 trial found in QNVB's front door for Pyro users: the
two-argument ``optim_args`` callable Pyro accepts, Pyro's learning-rate schedulers handed QNVB,
and checkpoints that ``torch.load`` reads with its default ``weights_only=True``."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_quadvi import QNVB, QuadratureELBO
from pyro_quadvi.optim.qnvb import _optim_args_names


def _model():
    b = pyro.sample("b", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    pyro.sample("y", dist.Normal(b.sum(-1), 1.0), obs=torch.tensor(1.0))


def _fit(optim, steps=5) -> torch.Tensor:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(_model)
    svi = SVI(_model, guide, optim, QuadratureELBO())
    for _ in range(steps):
        svi.step()
    return torch.cat([guide.locs.b.detach(), guide.scales.b.detach()])


# ------------------------------------------------------------------ Pyro's two-argument callable
def test_a_two_argument_callable_is_called_as_pyro_calls_it(fresh_param_store):
    """Pyro's deprecated ``lambda module_name, param_name: {...}`` failed with a bare "missing 1
    required positional argument"; it gets the names Pyro's own optimizers give it, and its
    settings apply."""
    qnvb_calls, adam_calls = [], []
    fitted = _fit(QNVB(lambda module, name: qnvb_calls.append((module, name)) or {"lr": 0.3}))
    assert fitted.tolist() == _fit(QNVB({"lr": 0.3})).tolist()
    assert fitted.tolist() != _fit(QNVB()).tolist()  # lr = 0.3 took effect
    assert qnvb_calls == [("AutoNormal.locs.b", "AutoNormal.locs.b")]

    pyro.clear_param_store()
    svi = SVI(
        _model,
        AutoNormal(_model),
        pyro.optim.Adam(lambda module, name: adam_calls.append((module, name)) or {"lr": 0.1}),
        Trace_ELBO(),
    )
    svi.step()
    assert qnvb_calls[0] in adam_calls  # the loc's names, as Pyro's Adam got them

    # lr = 0 holds the means exactly: the two-argument form's value is the one used
    held = _fit(QNVB(lambda module, name: {"lr": 0.0}))
    assert held[:3].tolist() == [0.0, 0.0, 0.0]


def test_the_callable_gets_the_names_pyro_gives_a_module_parameter(fresh_param_store):
    """A ``pyro.module`` parameter's store name holds Pyro's ``$$$``: the one-argument form gets
    it with a dot, the two-argument form split in two, as Pyro's optimizers give them."""
    net = torch.nn.Linear(1, 1)
    ones, twos = [], []

    def model():
        pyro.module("net", net)
        pyro.sample("y", dist.Normal(net.bias[0], 1.0), obs=torch.tensor(1.0))

    def one(name):
        ones.append(name)
        return {}

    def two(module, name):
        twos.append((module, name))
        return {}

    for optim_args in (one, two):
        pyro.clear_param_store()
        SVI(model, lambda: None, pyro.optim.Adam(optim_args), Trace_ELBO()).step()
    store_names = sorted(pyro.get_param_store().keys())
    assert store_names == ["net$$$bias", "net$$$weight"]
    assert sorted(_optim_args_names(n, 1)[0] for n in store_names) == sorted(ones)
    assert sorted(_optim_args_names(n, 2) for n in store_names) == sorted(twos)
    assert sorted(ones) == ["net.bias", "net.weight"]


@pytest.mark.parametrize(
    "optim_args, signature",
    [(lambda: {}, "()"), (lambda module, name, which: {}, "(module, name, which)")],
)
def test_a_callable_pyro_could_not_call_is_refused_when_built(optim_args, signature):
    with pytest.raises(TypeError) as error:
        QNVB(optim_args)
    message = str(error.value)
    assert "with the parameter's name (lambda name: {...})" in message
    assert "Pyro's deprecated form" in message
    assert message.endswith(f"takes {signature}")


# ------------------------------------------------------------------ Pyro's schedulers
def test_a_pyro_scheduler_wrapping_qnvb_is_refused_saying_what_to_use(fresh_param_store):
    """``pyro.optim.ExponentialLR({"optimizer": QNVB, ...})`` builds ``QNVB([param], ...)`` at the
    first step, which said "first argument is a dict ... got [Parameter ...]"."""
    scheduler = pyro.optim.ExponentialLR(
        {"optimizer": QNVB, "optim_args": {"lr": 0.5}, "gamma": 0.99}
    )
    svi = SVI(_model, AutoNormal(_model), scheduler, Trace_ELBO())
    with pytest.raises(TypeError) as error:
        svi.step()
    message = str(error.value)
    assert message.startswith(
        "QNVB got a list of 1 parameter(s) as its first argument, the way a torch optimizer is "
        "built."
    )
    assert "Pyro's learning-rate schedulers" in message
    assert "cannot wrap QNVB" in message
    assert "QNVB(annealing=geometric_annealing(0.01, num_steps=500))" in message
    assert "'Hyperparameters' and 'Annealing the likelihood' in docs/qnvb.md" in message


def test_a_torch_style_parameter_iterator_is_refused_naming_qnvb_optimizer():
    with pytest.raises(TypeError, match=r"QNVB got an iterator \(generator\)") as error:
        QNVB(torch.nn.Linear(2, 1).parameters())
    assert "QNVBOptimizer(net.parameters(), ...) is QNVB's torch optimizer" in str(error.value)
