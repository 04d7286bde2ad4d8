"""Fixes of faults a user trial found in ``QuadratureELBO``: a plate that appears only on a later
call, a vectorized pass decided on an earlier call meeting a branch that cannot broadcast, and one
``name`` shared by two guides."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO

FALLBACK = "evaluating them one by one"


pytestmark = pytest.mark.usefixtures("float64_store")


# -- a plate that appears only on a later call --------------------------------------------------


def deep_later(deep=False):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("a", 3, dim=-1):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        if deep:  # a second plate, on some calls only
            with pyro.plate("b", 2, dim=-2):
                pyro.sample("o", dist.Normal(z, 1.0), obs=torch.ones(2, 3))
        else:
            pyro.sample("o", dist.Normal(z, 1.0), obs=torch.ones(3))


def _deep_later_guide():
    guide = AutoNormal(deep_later)
    guide(True)
    return guide


def test_the_found_plate_nesting_is_found_again_when_a_later_call_nests_deeper():
    guide = _deep_later_guide()
    loop = QuadratureELBO("gauss_hermite", num_points=2, vectorize=False)
    shallow, deep = loop.loss(deep_later, guide, False), loop.loss(deep_later, guide, True)
    elbo = QuadratureELBO("gauss_hermite", num_points=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert elbo.loss(deep_later, guide, False) == pytest.approx(shallow, rel=1e-12)
        # was: Pyro's 'at plates "b" and "_quadvi_nodes", collide at dim=-2'
        assert elbo.loss(deep_later, guide, True) == pytest.approx(deep, rel=1e-12)
        assert elbo.loss(deep_later, guide, False) == pytest.approx(shallow, rel=1e-12)
    assert not caught
    assert elbo.vectorized(deep_later, guide) is True
    assert elbo._fit(deep_later, guide).max_plate_nesting == 2


def test_a_given_plate_nesting_below_a_later_calls_plates_is_refused_naming_the_plate():
    guide = _deep_later_guide()
    elbo = QuadratureELBO("gauss_hermite", num_points=2, max_plate_nesting=1)
    elbo.loss(deep_later, guide, False)  # checked on the first call: one plate, fine
    with pytest.raises(ValueError) as raised:
        elbo.loss(deep_later, guide, True)
    message = str(raised.value)
    assert "max_plate_nesting=1" in message and "plate 'b' at dim -2" in message
    assert "Pass max_plate_nesting=2 (or more)" in message
    assert "_quadvi_nodes" not in message


# -- a vectorized pass decided on an earlier call, then a branch that cannot broadcast ---------

N = 6
X_ROWS = torch.linspace(-1.0, 1.0, 2 * N, dtype=torch.float64).reshape(N, 2)
X_OBS = torch.linspace(-1.0, 2.0, N, dtype=torch.float64)


def branching(idx, wide=False, fail=False):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    if fail:
        raise ValueError("the model's own error")
    with pyro.plate("data", N, subsample=idx) as i:
        # the matmul does not broadcast over a node dim; the product and sum do
        mean = X_ROWS[i] @ w if wide else (X_ROWS[i] * w).sum(-1)
        pyro.sample("x", dist.Normal(mean, 0.5), obs=X_OBS[i])


def _branching_guide(idx):
    guide = AutoMeanFieldNormal(
        branching,
        create_plates=lambda idx, wide=False, fail=False: pyro.plate("data", N, subsample=idx),
    )
    guide(idx)
    return guide


def test_a_cached_vectorized_pass_falls_back_to_the_loop_once_on_a_branch_that_cannot_broadcast():
    idx = torch.arange(3)
    guide = _branching_guide(idx)
    loop = QuadratureELBO("hadamard", vectorize=False)
    narrow, wide = loop.loss(branching, guide, idx), loop.loss(branching, guide, idx, True)
    assert wide == pytest.approx(narrow, rel=1e-12)  # one model, two ways of writing it
    elbo = QuadratureELBO("hadamard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert elbo.loss(branching, guide, idx) == pytest.approx(narrow, rel=1e-12)
        assert elbo.vectorized(branching, guide) is True
        assert not caught
        # was: torch's "Expected size for first two dimensions of batch2 tensor"
        assert elbo.loss(branching, guide, idx, True) == pytest.approx(wide, rel=1e-12)
        assert elbo.vectorized(branching, guide) is False  # the new decision, recorded
        assert elbo.loss(branching, guide, idx, True) == pytest.approx(wide, rel=1e-12)
        assert elbo.loss(branching, guide, idx) == pytest.approx(narrow, rel=1e-12)
    fallbacks = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert len(fallbacks) == 1 and "batch2" in fallbacks[0]


def test_a_models_own_error_after_a_cached_vectorized_decision_propagates():
    idx = torch.arange(3)
    guide = _branching_guide(idx)
    elbo = QuadratureELBO("hadamard")
    elbo.loss(branching, guide, idx)
    with pytest.raises(ValueError, match="the model's own error"):
        elbo.loss(branching, guide, idx, False, True)
    assert elbo.vectorized(branching, guide) is True


def test_an_explicit_vectorize_true_keeps_the_error_and_adds_the_hint():
    idx = torch.arange(3)
    guide = _branching_guide(idx)
    elbo = QuadratureELBO("hadamard", vectorize=True)
    with pytest.raises(RuntimeError) as raised:
        elbo.loss(branching, guide, idx, True)
    first = str(raised.value).splitlines()[0]
    assert first.startswith("Expected size for first two dimensions of batch2 tensor")
    assert "pass vectorize=None" in first and "or vectorize=False" in first


# -- one name, two guides ------------------------------------------------------------------------

D = 3
X_DESIGN = torch.tensor(
    [[1.0, 0.5, -0.2], [0.3, -1.0, 0.8], [-0.7, 0.2, 1.1], [0.9, 0.4, 0.1]], dtype=torch.float64
)
Y = torch.tensor([0.5, -1.2, 0.7, 1.0], dtype=torch.float64)


def model_w(y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    pyro.sample("y", dist.Normal(X_DESIGN @ w, 0.5).to_event(1), obs=y)


def model_v(y):
    v = pyro.sample("v", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    pyro.sample("y", dist.Normal(X_DESIGN @ v, 0.5).to_event(1), obs=y)


def test_a_name_shared_by_two_guides_is_refused_naming_both():
    guide_w, guide_v = AutoMeanFieldNormal(model_w), AutoMeanFieldNormal(model_v)
    elbo = QuadratureELBO("hadamard", vectorize=False, name="fit")
    SVI(model_w, guide_w, QNVB(), elbo).step(Y)
    with pytest.raises(ValueError) as raised:
        SVI(model_v, guide_v, QNVB(), elbo).step(Y)
    message = str(raised.value)
    assert "'fit.step'" in message and "of the sites 'w'" in message
    assert "of the sites 'v'" in message and "name=None" in message
    assert elbo.step(guide_w) == 1  # the refused step did not advance the position
    # without a name, each guide keeps its own position
    free = QuadratureELBO("hadamard", vectorize=False)
    SVI(model_w, guide_w, QNVB(), free).step(Y)
    SVI(model_v, guide_v, QNVB(), free).step(Y)
    assert (free.step(guide_w), free.step(guide_v)) == (1, 1)


def test_a_named_position_follows_the_same_guide_made_again_and_restarts_after_a_clear():
    elbo = QuadratureELBO("hadamard", vectorize=False, name="fit")
    guide = AutoMeanFieldNormal(model_w)
    svi = SVI(model_w, guide, QNVB(), elbo)
    for _ in range(3):
        svi.step(Y)
    again = AutoMeanFieldNormal(model_w)  # the same guide, as after restoring the param store
    SVI(model_w, again, QNVB(), elbo).step(Y)
    assert elbo.step(again) == 4
    pyro.clear_param_store()  # the position restarts, and another guide may take the name
    other = AutoMeanFieldNormal(model_v)
    SVI(model_v, other, QNVB(), elbo).step(Y)
    assert elbo.step(other) == 1
