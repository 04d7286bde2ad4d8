"""``SparseQNVB``: the sparsifying QNVB for ``AutoSpikeSlab`` guides in Pyro's ``SVI``."""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import AutoSpikeSlab, QuadratureELBO, SparseQNVB
from pyro_quadvi.distributions import SpikeSlab

D, N, BATCHES = 16, 320, 10
SUPPORT = [2, 7, 11]


def _data():
    """Every minibatch of 32 rows is +-e_j (each coordinate twice): its Hessian is diagonal, so
    the quadrature's g and h are exact. Three true nonzeros."""
    generator = torch.Generator().manual_seed(0)
    w = torch.zeros(D)
    w[SUPPORT] = torch.tensor([1.5, -2.0, 0.8])
    x = torch.cat([torch.eye(D), -torch.eye(D)]).repeat(BATCHES, 1)
    y = x @ w + 0.1 * torch.randn(N, generator=generator)
    return w, x, y


def _model(x, y, start):
    w = pyro.sample("w", SpikeSlab(0.5, 0.3).expand([D]).to_event(1))
    rows = slice(start, start + N // BATCHES)
    with pyro.plate("data", N, subsample=torch.arange(rows.start, rows.stop)):
        mean = torch.einsum("nd,...d->...n", x[rows], w)
        pyro.sample("y", dist.Normal(mean, 0.1), obs=y[rows])


def _fit(optim, guide, x, y, steps, first=0):
    svi = SVI(_model, guide, optim, QuadratureELBO(rule="hadamard", num_points=4, vectorize=False))
    for step in range(first, first + steps):
        svi.step(x, y, (step % BATCHES) * (N // BATCHES))


def test_sparse_qnvb_finds_the_support(fresh_param_store):
    w, x, y = _data()
    guide = AutoSpikeSlab(_model)
    optim = SparseQNVB(
        num_epochs=4, steps_per_epoch=BATCHES, target_sparsity=12 / 16, target_free=3 / 16
    )
    _fit(optim, guide, x, y, 4 * BATCHES)
    pattern = optim.pattern()["AutoSpikeSlab.locs.w"]
    assert optim.epoch == 4
    assert torch.equal(pattern != 0, w != 0)
    median = guide.median()["w"]
    assert torch.equal(median != 0, w != 0)  # the guide's median is the sparse network
    torch.testing.assert_close(median[SUPPORT], w[SUPPORT], rtol=0, atol=0.05)


def test_sparse_qnvb_resumes_bit_for_bit(fresh_param_store):
    _, x, y = _data()
    kwargs = dict(num_epochs=4, steps_per_epoch=BATCHES, target_sparsity=0.75)
    guide = AutoSpikeSlab(_model)
    optim = SparseQNVB(**kwargs)
    _fit(optim, guide, x, y, 13)
    store = copy.deepcopy(pyro.get_param_store().get_state())
    saved = copy.deepcopy(optim.get_state())
    _fit(optim, guide, x, y, 9, first=13)
    expected = {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}

    pyro.clear_param_store()
    pyro.get_param_store().set_state(store)
    resumed = SparseQNVB(**kwargs)
    resumed.set_state(saved)
    _fit(resumed, AutoSpikeSlab(_model), x, y, 9, first=13)
    assert {"AutoSpikeSlab.locs.w", "AutoSpikeSlab.scales.w", "AutoSpikeSlab.logits.w"} <= set(
        expected
    )
    for name, value in pyro.get_param_store().named_parameters():
        assert torch.equal(value.detach(), expected[name]), name
    assert resumed.counters == optim.counters


def test_sparse_qnvb_refuses_bad_hyperparameters():
    with pytest.raises(ValueError, match="target_sparsity"):
        SparseQNVB(num_epochs=10, steps_per_epoch=5, target_sparsity=1.5)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        SparseQNVB(num_epochs=10, steps_per_epoch=0)
    with pytest.raises(TypeError, match="steps_per_epoch"):
        SparseQNVB(num_epochs=10)
    with pytest.raises(ValueError, match="num_cases"):
        SparseQNVB(num_epochs=10, steps_per_epoch=5, num_cases=0)
    # the trust region counts cases: 160 cases in 5 steps are 32 per step
    assert SparseQNVB(num_epochs=10, steps_per_epoch=5, num_cases=160).cases_per_step == 32.0
    assert SparseQNVB(num_epochs=10, steps_per_epoch=5).cases_per_step == 1.0


def test_sparse_qnvb_pattern_is_realized_with_the_final_epoch(fresh_param_store):
    """Before the first step of the final epoch the pattern is that of p_nonzero > 1/2; after it,
    the realized one, which the following steps keep."""
    _, x, y = _data()
    guide = AutoSpikeSlab(_model)
    optim = SparseQNVB(num_epochs=3, steps_per_epoch=BATCHES, target_sparsity=0.75)
    _fit(optim, guide, x, y, 2 * BATCHES)
    block = optim.blocks["AutoSpikeSlab.locs.w"]
    expected = (block.p_nonzero > 0.5).float()
    assert int(expected.sum()) <= D - 12  # at t = 2 = n_e - 1 the sieve holds 12 of 16 near zero
    assert torch.equal(block.pattern, torch.ones(D))  # not realized yet
    assert torch.equal(optim.pattern()["AutoSpikeSlab.locs.w"], expected)
    _fit(optim, guide, x, y, BATCHES, first=2 * BATCHES)
    assert torch.equal(optim.pattern()["AutoSpikeSlab.locs.w"], expected)
    assert torch.equal(optim.blocks["AutoSpikeSlab.locs.w"].mu == 0, expected == 0)
