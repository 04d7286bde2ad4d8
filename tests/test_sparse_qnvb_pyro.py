"""``SparseQNVB``: the sparsifying QNVB for ``AutoSpikeSlab`` guides in Pyro's ``SVI``."""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide.initialization import init_to_value

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


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _guide():
    """The paper's start (Algorithm 5.1, line 5): sigma = initial_lr**0.5, nonzero for sure."""
    return AutoSpikeSlab(_model, init_scale=1e-5**0.5, init_inclusion=1 - 1e-9)


def _fit(optim, guide, x, y, steps, first=0):
    svi = SVI(_model, guide, optim, QuadratureELBO(rule="hadamard", num_points=4, vectorize=False))
    for step in range(first, first + steps):
        svi.step(x, y, (step % BATCHES) * (N // BATCHES))


def test_sparse_qnvb_finds_the_support(fresh_param_store):
    w, x, y = _data()
    guide = _guide()
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
    guide = _guide()
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
    _fit(resumed, _guide(), x, y, 9, first=13)
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
    guide = _guide()
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


def test_sparse_qnvb_starts_where_the_guide_starts(fresh_param_store):
    """Algorithm 5.1, line 5 read backwards: the first term was integrated at the guide's
    mixture, so h0 = 1 / sigma^2 of that mixture (AutoSpikeSlab's defaults: tau = 0.1, inclusion
    0.99, nu = 0 here, so sigma^2 = 0.99 * 0.01), not Table 1's 1 / initial_lr."""
    _, x, y = _data()
    guide = AutoSpikeSlab(_model, init_loc_fn=init_to_value(values={"w": torch.zeros(D)}))
    optim = SparseQNVB(num_epochs=4, steps_per_epoch=BATCHES, num_cases=N)
    _fit(optim, guide, x, y, 1)
    h0 = optim.blocks["AutoSpikeSlab.locs.w"].h0
    torch.testing.assert_close(h0, torch.full((D,), 1 / (0.99 * 0.01)), rtol=1e-5, atol=0)
    with pytest.raises(TypeError, match="initial_lr"):
        SparseQNVB(num_epochs=4, steps_per_epoch=BATCHES, initial_lr=1e-5)


def test_sparse_qnvb_steps_as_the_torch_optimizer(fresh_param_store, float64):
    """On the same problem, from the same start (w = 0, sigma = initial_lr**0.5, p_nonzero = 1),
    the Pyro front end and SparseQNVBOptimizer hold the same state after every step (the
    quadrature is exact here, so their different node offsets do not matter): the same h0 / sigma
    convention, the same terms (n_c / S per-case gradient plus h_p / S), the same trust region.
    In float64: the gradient sums cancel terms of size h0 |nu| ~ 600."""
    from pyro_quadvi.optim import SparseQNVBOptimizer

    _, x, y = _data()
    kwargs = dict(num_epochs=4, steps_per_epoch=BATCHES, target_sparsity=0.75, num_cases=N)
    optim, guide = SparseQNVB(**kwargs), _guide()
    w = torch.nn.Parameter(torch.zeros(D))
    reference = SparseQNVBOptimizer([w], **kwargs)
    rows_per_step = N // BATCHES
    for step in range(BATCHES + 2):
        _fit(optim, guide, x, y, 1, first=step)
        rows = slice((step % BATCHES) * rows_per_step, (step % BATCHES + 1) * rows_per_step)

        def closure(rows=rows):
            loss = (0.5 * ((y[rows] - x[rows] @ w) / 0.1) ** 2).mean()  # per case, as _model
            loss.backward()
            return loss

        reference.step(closure)
        block = optim.blocks["AutoSpikeSlab.locs.w"]
        for field in block._fields:
            expected = reference.state[w][field]
            assert expected.dtype == torch.float64
            torch.testing.assert_close(getattr(block, field), expected, rtol=1e-9, atol=1e-9)
    assert optim.counters == reference.counters
    assert float(block.h0[0]) != 1e5  # the sums were replaced: the comparison went past the start


def test_sparse_qnvb_set_state_refuses_other_settings(fresh_param_store):
    """A state restored into a differently configured optimizer would go on under another
    schedule: each differing setting is named, and nothing is restored."""
    _, x, y = _data()
    kwargs = dict(num_epochs=4, steps_per_epoch=BATCHES, target_sparsity=0.75, num_cases=N)
    optim = SparseQNVB(**kwargs)
    _fit(optim, _guide(), x, y, 3)
    saved = optim.get_state()
    changes = [
        ({"steps_per_epoch": 5}, r"steps_per_epoch=10 \(this optimizer: 5\)"),
        ({"num_cases": None}, r"num_cases=320 \(this optimizer: None\)"),
        ({"prior_precision": 4.0}, r"prior_precision=11\.1.*\(this optimizer: 4\.0\)"),
        ({"target_sparsity": 0.5}, r"target_sparsity=0\.75 \(this optimizer: 0\.5\)"),
        ({"max_lr": 0.2}, r"max_lr=0\.1 \(this optimizer: 0\.2\)"),
        ({"num_epochs": 5}, r"num_epochs=4 \(this optimizer: 5\)"),
    ]
    for change, message in changes:
        other = SparseQNVB(**{**kwargs, **change})
        with pytest.raises(ValueError, match=message):
            other.set_state(saved)
        assert other.counters.step == 0 and not other.blocks
