"""Session 24: the public API under bad input (trial t3).

A scale ``<= 0`` given to the pure QNVB updates was raised to ``sigma_min`` without a word, while a
non-finite one was refused; a guide started far below ``sigma_min`` got an idle-step refusal that
blamed the data; and several functions failed with a bare torch or Pyro error, or accepted a
string for a flag or a class. Each is now refused, naming the argument and the fix.
"""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributed import save_checkpoint
from pyro_quadvi.evidence import opqa_evidence
from pyro_quadvi.export import to_inference_data
from pyro_quadvi.optim import QNVBOptimizer, qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    qnvb_update,
    qnvb_update_many,
)
from pyro_quadvi.quadrature import cross_reference, simplex_reference
from pyro_quadvi.testing.update_cases import update_inputs

DTYPE = torch.float64
HP = QNVBHyperparameters()


@pytest.mark.parametrize("value", [-1.0, 0.0, -0.0])
@pytest.mark.parametrize("many", [False, True])
def test_a_scale_at_or_below_zero_is_refused_with_its_count(value, many):
    # before: the rate limit and the bounds set such a scale to sigma_min (1e-6), no error
    args = update_inputs(5)
    args["sigma"][[1, 3]] = value
    if many:
        call = lambda: qnvb_update_many(*([args[k]] for k in args), HP)  # noqa: E731
        name = r"sigmas\[0\]"
    else:
        call = lambda: qnvb_update(*args.values(), HP)  # noqa: E731
        name = "sigma"
    with pytest.raises(ValueError, match=rf"{name} is <= 0 at 2 of 5 coordinates.*scales > 0"):
        call()


def test_the_flat_update_refuses_a_scale_at_zero_in_a_later_chunk(monkeypatch):
    # every result of the chunk is finite (the guard does not act): the scale's least value is read
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 64)
    first, second = update_inputs(100), update_inputs(200)
    second["sigma"][150] = -0.5
    lists = [[first[k], second[k]] for k in ("mu", "sigma", "g", "h", "state")]
    with pytest.raises(ValueError, match=r"sigmas\[1\] is <= 0 at 1 of 200 coordinates"):
        qnvb_update_many(*lists, HP)


def test_a_positive_scale_still_updates_as_before():
    args = update_inputs(3)
    args["sigma"][:] = 1.0
    args["g"][:] = 1.0
    args["h"][:] = 1.0
    result = qnvb_update(*args.values(), HP)
    # the step is g / max(h, |g| + eps) = 1 / (1 + 1e-8), the cap of an Adam step of size lr = 1
    assert result.mu.tolist() == pytest.approx([-2.0, -1.0, 0.0], abs=2e-8)
    assert result.sigma.tolist() == [1.0] * 3
    assert math.isclose(float(qnvb_update_many(*([args[k]] for k in args), HP)[0].sigma[0]), 1.0)


def _normal_model(y):
    theta = pyro.sample("th", dist.Normal(0.0, 1.0))
    with pyro.plate("d", y.shape[-1]):
        pyro.sample("y", dist.Normal(theta, 1.0), obs=y)


def test_a_guide_started_far_below_sigma_min_is_named_as_the_cause_not_the_data():
    # before: "Likely causes: data on scales far from 1 ... standardize the inputs"
    pyro.clear_param_store()
    y = torch.randn(20, generator=torch.Generator().manual_seed(0)) + 1.0  # the trial's data
    guide = AutoMeanFieldNormal(_normal_model, init_scale=1e-20)
    svi = SVI(_normal_model, guide, QNVB(), QuadratureELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the update's overflow, once
        svi.step(y)
        svi.step(y)
        with pytest.raises(ValueError) as error:
            svi.step(y)
    message = str(error.value)
    assert "the smallest, 1e-20 (site 'th'), is below sigma_min=1e-06" in message
    assert "1 / sigma^2 there, 1e+40, overflows float32" in message
    assert "start from scales >= sigma_min (a guide's init_scale" in message
    assert "data on scales far from 1" not in message


def test_qnvb_optimizer_started_below_sigma_min_names_init_sigma():
    p = torch.zeros(3, requires_grad=True)
    optimizer = QNVBOptimizer([p], init_sigma=1e-20)

    def closure():
        optimizer.zero_grad()
        loss = ((p - 1.0) ** 2).sum()
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        optimizer.step(closure)
        optimizer.step(closure)
        with pytest.raises(
            ValueError,
            match=r"1e-20 \(a parameter of shape \(3,\)\), is below "
            r"sigma_min=1e-06.*QNVBOptimizer's init_sigma",
        ):
            optimizer.step(closure)


@pytest.mark.parametrize("function", [simplex_reference, cross_reference])
@pytest.mark.parametrize("r", [2.5, "3", None])
def test_a_reference_of_a_non_integer_r_is_refused_naming_r(function, r):
    # before: torch's "eye() received an invalid combination", or "'<' not supported"
    with pytest.raises(ValueError, match=rf"{function.__name__}: r must be an integer >= 1"):
        function(r)


@pytest.mark.parametrize("init_loc_fn", [None, "median"])
def test_auto_mean_field_normal_refuses_an_init_loc_fn_that_is_not_callable(init_loc_fn):
    # before: "'NoneType' object is not callable" at the first step
    with pytest.raises(TypeError, match=r"init_loc_fn must be a callable .*init_to_median"):
        AutoMeanFieldNormal(_normal_model, init_loc_fn=init_loc_fn)


def test_export_and_checkpoint_refuse_none_for_the_guide_or_the_optimizer(tmp_path):
    y = torch.zeros(3)
    with pytest.raises(TypeError, match="to_inference_data: guide must be the fitted guide"):
        to_inference_data(_normal_model, None, y)
    with pytest.raises(TypeError, match="to_inference_data: prior must be True or False"):
        to_inference_data(_normal_model, AutoMeanFieldNormal(_normal_model), y, prior="yes")
    with pytest.raises(TypeError, match="save_checkpoint: optim must be the Pyro optimizer"):
        save_checkpoint(tmp_path / "c.pt", None)
    assert not (tmp_path / "c.pt").exists()


def test_opqa_evidence_names_a_list_given_for_a_tensor_and_refuses_a_string_progress():
    y = torch.linspace(-1.0, 3.0, 5, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"with a list as its argument 0: pass a tensor"):
        opqa_evidence(_vector_model, y.tolist())
    with pytest.raises(TypeError, match="progress must be None, True or False, got 'yes'"):
        opqa_evidence(_vector_model, y, progress="yes")


def _vector_model(y):
    theta = pyro.sample("th", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(theta, 1.0).expand([5]).to_event(1), obs=y)


def test_register_adapter_refuses_a_name_in_place_of_a_class():
    # trial t3: register_adapter("x") failed later with "'str' object has no attribute
    # '_pyro_quadvi_adapter'", at decoration, without naming the argument
    from pyro_quadvi.guides import register_adapter

    with pytest.raises(
        TypeError, match=r"register_adapter takes the guide's class, got 'x' of type str"
    ):
        register_adapter("x")
