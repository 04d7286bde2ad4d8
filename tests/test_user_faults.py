"""Faults found by trying the package as users would (issue 10), each with the number it gets wrong.

The faults of the log joint, OPQA and the export are in their own test files; the update rules'
in ``test_qnvb_functional.py`` and ``test_qnvb_torch.py``.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.testing import TinyNet, linear_regression

DTYPE = torch.float64
DATA = torch.tensor([0.9, 0.1, 1.4, 0.6, 0.3, 1.1, 0.2, 0.8], dtype=DTYPE)
PRECISION = 0.25 + len(DATA)
POSTERIOR_MEAN = (DATA.sum() / PRECISION).item()


pytestmark = pytest.mark.usefixtures("fresh_param_store")


def conjugate_model(data=DATA):
    z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 2.0))
    with pyro.plate("data", len(data)):
        pyro.sample("x", dist.Normal(z, 1.0), obs=data)


def _mean_field(guide, name="z"):
    loc = pyro.param(f"{guide._pyro_name}.locs.{name}").detach()
    scale = pyro.param(f"{guide._pyro_name}.scales.{name}").detach()
    return loc, scale


# ---------------------------------------------------------------- fault 1: fallback NaN
def shifted_model():
    shift = pyro.param("shift", torch.tensor(0.5, dtype=DTYPE))
    z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 2.0))
    with pyro.plate("data", len(DATA)):
        pyro.sample("x", dist.Normal(z + shift, 1.0), obs=DATA)


def test_a_nan_gradient_never_reaches_a_fallback_parameter():
    elbo = QuadratureELBO("gauss_hermite")

    def loss_with_a_nan_shift_gradient(model, guide):
        loss = elbo.differentiable_loss(model, guide)
        return loss + pyro.param("shift") * torch.tensor(math.nan, dtype=DTYPE).detach() * 0

    guide = AutoMeanFieldNormal(shifted_model)
    svi = SVI(shifted_model, guide, QNVB(), loss_with_a_nan_shift_gradient)
    with pytest.warns(RuntimeWarning, match="fallback optimizer met a non-finite .* 'shift'"):
        svi.step()
    assert pyro.param("shift").item() == 0.5  # kept, not NaN
    loc, scale = _mean_field(guide)
    # the mean field still took its exact step: posterior of z given the data shifted by 0.5
    assert abs(loc.item() - (DATA - 0.5).sum().item() / PRECISION) < 1e-12
    assert abs(scale.item() - PRECISION**-0.5) < 1e-12


# ------------------------------------------------------ fault 2: one sequence per guide
def _second_model():
    # eight latents: the Hadamard sequence changes from step to step (in two it would not)
    y = torch.tensor([2.0, 1.5, 2.5], dtype=DTYPE)
    a = pyro.sample("a", dist.Normal(torch.zeros(8, dtype=DTYPE), 1.0).to_event(1))
    with pyro.plate("obs", 3):
        pyro.sample("y", dist.Normal((a**3).sum(-1, keepdim=True), 0.7), obs=y)


def _hadamard_fit(model, guide, steps, other=None):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), QuadratureELBO("hadamard"))
    for _ in range(steps):
        svi.step()
        if other is not None:
            other.step()


def test_two_elbos_fitted_side_by_side_each_follow_their_own_sequence():
    alone = AutoMeanFieldNormal(_second_model)
    _hadamard_fit(_second_model, alone, 6)
    expected = pyro.param("AutoMeanFieldNormal.scales.a").detach().clone()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    first = AutoMeanFieldNormal(conjugate_model)  # the same default name as the second
    other = SVI(conjugate_model, first, pyro.optim.Adam({"lr": 0.05}), QuadratureELBO("hadamard"))
    second = AutoMeanFieldNormal(_second_model)
    _hadamard_fit(_second_model, second, 6, other=other)
    assert torch.equal(pyro.param("AutoMeanFieldNormal.scales.a").detach(), expected)


# ------------------------------------------------- fault 3: an ELBO reused for a model
def node_mixing_model():
    # sums z over every axis: under a particle plate it mixes the nodes
    z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))
    pyro.sample("x", dist.Normal(z.sum(), 1.0), obs=torch.tensor(0.5, dtype=DTYPE))


def test_an_elbo_reused_for_another_model_decides_again():
    elbo = QuadratureELBO("gauss_hermite")
    first = AutoMeanFieldNormal(conjugate_model)
    elbo.loss(conjugate_model, first)
    assert elbo.vectorized(conjugate_model, first) is True
    pyro.clear_param_store()  # the two guides share their default name
    guide = AutoMeanFieldNormal(node_mixing_model, init_scale=0.5)
    with pytest.warns(UserWarning, match="one by one"):
        loss = elbo.loss(node_mixing_model, guide)
    # closed form: z ~ N(0, 1) prior, x | z ~ N(z, 1), q = N(0, 0.5^2)
    expected = (
        0.5 * math.log(2 * math.pi) + 0.5 * 0.25
        + 0.5 * math.log(2 * math.pi) + 0.5 * (0.25 + 0.25)
        - (math.log(0.5) + 0.5 * math.log(2 * math.pi * math.e))
    )  # fmt: skip
    assert abs(loss - expected) < 1e-12
    assert elbo.vectorized(node_mixing_model, guide) is False


def test_an_elbo_reused_for_a_deeper_model_finds_its_plate_nesting():
    elbo = QuadratureELBO("gauss_hermite")
    elbo.loss(conjugate_model, AutoMeanFieldNormal(conjugate_model))  # one plate

    def nested():
        z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))
        with pyro.plate("a", 2, dim=-2), pyro.plate("b", 3, dim=-1):
            pyro.sample("x", dist.Normal(z, 1.0), obs=torch.zeros(2, 3, dtype=DTYPE))

    guide = pyro.infer.autoguide.AutoNormal(nested, init_scale=0.5)
    fresh = QuadratureELBO("gauss_hermite").loss(nested, guide)
    assert elbo.loss(nested, guide) == fresh
    expected = (
        0.5 * math.log(2 * math.pi) + 0.5 * 0.25
        + 6 * (0.5 * math.log(2 * math.pi) + 0.5 * 0.25)
        - (math.log(0.5) + 0.5 * math.log(2 * math.pi * math.e))
    )  # fmt: skip
    assert abs(fresh - expected) < 1e-12


# ------------------------------------------------- fault 5: float64 data, float32 latents
@pytest.mark.parametrize("rule", ["rasp_simplex", "rasp_cross", "hadamard", "gauss_hermite"])
def test_float64_data_with_float32_latents(rule):
    data = torch.tensor(np.array([0.9, 0.1, 1.4, 0.6]))  # float64, from numpy

    def model():
        z = pyro.sample("z", dist.Normal(0.0, 2.0))  # float32 prior
        with pyro.plate("data", len(data)):
            pyro.sample("x", dist.Normal(z, 1.0), obs=data)

    guide = AutoMeanFieldNormal(model, init_scale=0.5)
    loss = QuadratureELBO(rule).loss(model, guide)
    # every rule here integrates this quadratic exactly; guide at loc 0, scale 0.5
    s2 = 0.25
    expected = (
        math.log(2.0) + 0.5 * math.log(2 * math.pi) + s2 / 8
        + sum(0.5 * math.log(2 * math.pi) + 0.5 * (x**2 + s2) for x in data.tolist())
        - (math.log(0.5) + 0.5 * math.log(2 * math.pi * math.e))
    )  # fmt: skip
    assert abs(loss - expected) < 1e-5 * abs(expected)
    svi = SVI(model, guide, QNVB(), QuadratureELBO(rule))
    svi.step()
    loc = pyro.param("AutoMeanFieldNormal.locs.z")
    assert loc.dtype == torch.float32
    # one exact step lands on the posterior mean sum(x) / (1/4 + n), as in float64
    assert abs(loc.item() - sum(data.tolist()) / (0.25 + len(data))) < 1e-6


# ----------------------------------------------------------- fault 8: save, copy, pickle
def test_the_guide_pickles_deep_copies_and_saves_and_a_copy_stays_paired():
    guide = AutoMeanFieldNormal(conjugate_model)
    for before_or_after in range(2):  # pickling before the first run keeps the guide usable
        pickle.loads(pickle.dumps(guide))
        torch.save(guide, io.BytesIO())
        copied = copy.deepcopy(guide)
        if before_or_after == 0:
            svi = SVI(conjugate_model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
            svi.step()
    pyro.clear_param_store()
    svi = SVI(conjugate_model, copied, QNVB(), QuadratureELBO("gauss_hermite"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "pairs nothing"
        svi.step()
    loc, scale = _mean_field(copied)
    assert abs(loc.item() - POSTERIOR_MEAN) < 1e-12
    assert abs(scale.item() - PRECISION**-0.5) < 1e-12


# ------------------------------------------------------------- fault 10: clear errors
def test_a_model_without_latents_is_refused_with_a_reason():
    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0), obs=torch.tensor(0.3))

    with pytest.raises(ValueError, match="no latent sample site"):
        QuadratureELBO().loss(model, AutoMeanFieldNormal(model))


def test_a_schedule_that_is_not_callable_is_refused_at_construction():
    with pytest.raises(TypeError, match="annealing must be a callable"):
        QNVB(annealing=0.5)


# ------------------------------------------- fault 11: an in-memory checkpoint rolls back
def test_the_documented_in_memory_checkpoint_rolls_back_exactly():
    guide = AutoMeanFieldNormal(shifted_model)
    qnvb = QNVB()
    svi = SVI(shifted_model, guide, qnvb, QuadratureELBO("rasp_simplex"))
    for _ in range(3):
        svi.step()
    # the recipe of docs/qnvb.md
    store_state = copy.deepcopy(pyro.get_param_store().get_state())
    optim_state = qnvb.get_state()
    rng_state = pyro.util.get_rng_state()
    for _ in range(3):
        svi.step()
    reached = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.get_param_store().set_state(copy.deepcopy(store_state))
    qnvb.set_state(optim_state)
    pyro.util.set_rng_state(rng_state)
    for _ in range(3):
        svi.step()
    again = {k: v.detach() for k, v in pyro.get_param_store().items()}
    assert reached.keys() == again.keys()
    for name in reached:
        assert torch.equal(reached[name], again[name]), name


# ------------------------------------------------- fault 13: Pyro's optimizer convention
def test_qnvb_takes_a_dict_of_arguments_like_pyro_optimizers():
    far = DATA + 100.0

    def far_model():
        conjugate_model(far)

    guide = AutoMeanFieldNormal(far_model, init_loc_fn=lambda site: torch.tensor(0.0, dtype=DTYPE))
    svi = SVI(far_model, guide, QNVB({"lr": 0.01}), QuadratureELBO("gauss_hermite"))
    svi.step()
    # the first step is capped by an Adam-sized step of lr (the quasi-Newton step is ~100)
    loc, _ = _mean_field(guide)
    assert abs(loc.item() - 0.01) < 1e-9


def test_qnvb_takes_a_callable_of_the_parameter_name():
    problem, _, _ = linear_regression(2, 0.0)
    names = []

    def per_site(name):
        names.append(name)
        return {"lr": 0.01}

    guide = AutoMeanFieldNormal(problem.model)
    svi = SVI(problem.model, guide, QNVB(per_site), QuadratureELBO("gauss_hermite"))
    svi.step()
    svi.step()
    assert names == ["AutoMeanFieldNormal.locs.b"]  # asked once per block
    loc, _ = _mean_field(guide, "b")
    assert loc.abs().max().item() <= 0.02 + 1e-12


def test_qnvb_refuses_arguments_it_does_not_know():
    with pytest.raises(TypeError, match="unknown hyperparameters \\['learning_rate'\\]"):
        QNVB({"learning_rate": 0.1})
    with pytest.raises(TypeError, match="dict of hyperparameters or a callable"):
        QNVB(0.1)


# ------------------------------------------------------ a network model stays unmodified
def test_a_trace_elbo_fit_of_a_network_pairs_every_weight():
    x = torch.randn(6, 2)
    y = x @ torch.tensor([1.0, -1.0]) + 0.2
    net = TinyNet()
    qnvb = QNVB()
    svi = SVI(net, AutoMeanFieldNormal(net), qnvb, Trace_ELBO())
    svi.step(x, y)
    assert set(qnvb.get_state()["qnvb"]["pairs"]) == {
        "AutoMeanFieldNormal.locs.fc.weight",
        "AutoMeanFieldNormal.locs.fc.bias",
    }


# -------------------------------- fault 9: a pinned sigma and an overflow say what happened
def test_a_sigma_pinned_at_sigma_min_is_reported_with_its_site():
    def model():
        z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))
        pyro.sample("x", dist.Normal(z, 1e-9), obs=torch.tensor(0.3, dtype=DTYPE))

    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
    with pytest.warns(RuntimeWarning, match=r"sigma pinned at sigma_min=1e-06 .*site 'z'"):
        for _ in range(8):  # sigma shrinks tenfold a step from 0.1: at 1e-6 after five
            svi.step()
    _, scale = _mean_field(guide)
    assert abs(scale.item() - 1e-6) < 1e-15


def test_an_overflow_with_a_finite_gradient_is_not_called_a_non_finite_gradient():
    def model():  # float32: g = 1e20 is finite, g^2 = 1e40 is not
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0))  # updated: a step updating nothing is refused
        pyro.sample("x", dist.Normal(z, 1e-10), obs=torch.tensor(1.0))
        pyro.sample("v", dist.Normal(w, 1.0), obs=torch.tensor(1.0))

    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi.step()
    messages = [str(w.message) for w in caught]
    assert any("overflowed while the gradient was finite" in m and "'z'" in m for m in messages)
    assert not any("non-finite gradient" in m for m in messages)
    loc, scale = _mean_field(guide)
    assert loc.item() == 0.0 and abs(scale.item() - 0.1) < 1e-7  # frozen, not NaN
