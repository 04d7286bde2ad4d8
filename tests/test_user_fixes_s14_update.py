"""Session 14 user trial: the QNVB update's scratch memory.

On a 5 M-weight MLP the step's peak was the update's, about 25 times the weights: the eager
``qnvb_update_many`` concatenated every tensor into one flat buffer and ran the rules on all of
it at once, each rule's temporaries the size of every weight. It now runs them on chunks of the
flat coordinates (``qnvb_functional._CHUNK``) and writes the results into preallocated buffers,
so its scratch is a chunk's. The chunks start at multiples of 64 from the flat buffer's start,
where the flat buffer's vectors start: each coordinate keeps its lane, and every result is the
one-buffer result bit for bit.
"""

from __future__ import annotations

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss, qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    COUNT_KINDS,
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)
from pyro_quadvi.testing.compare import bit_patterns, equal_nested
from pyro_quadvi.testing.memory import cpu_peak_bytes
from pyro_quadvi.testing.meta import FakeSync
from pyro_quadvi.testing.update_cases import HYPERPARAMETERS, SIZES, hazard_moments, small_net

ONE_BUFFER = 2**40  # a chunk larger than any test: the rules run once on the whole flat buffer


def _steps(chunk, dtype, hp, weight, prior_precision, monkeypatch, steps=4):
    """``steps`` updates of ``qnvb_update_many`` at ``chunk`` (each fed the last's results, as
    the optimizers do: the first reads separate tensors, the next ones consecutive pieces)."""
    monkeypatch.setattr(qnvb_functional, "_CHUNK", chunk)
    generator = torch.Generator().manual_seed(5)
    mus = [torch.randn(n, generator=generator, dtype=dtype) for n in SIZES]
    sigmas = [torch.rand(n, generator=generator, dtype=dtype) * 0.5 + 1e-3 for n in SIZES]
    states = [init_qnvb_state(m) for m in mus]
    history = []
    for step in range(steps):
        gs, hs = hazard_moments(dtype, generator, step)
        results = qnvb_update_many(mus, sigmas, gs, hs, states, hp, weight, prior_precision)
        history.append(((mus, sigmas, gs, hs, states), results))
        mus, sigmas = [r.mu for r in results], [r.sigma for r in results]
        states = [r.state for r in results]
    return history


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hp", HYPERPARAMETERS.values(), ids=HYPERPARAMETERS.keys())
@pytest.mark.parametrize(("weight", "prior_precision"), [(1.0, 0.0), (50.0, 0.7), (0.3, 0.0)])
def test_chunks_give_the_one_buffer_results_bit_for_bit(
    dtype, hp, weight, prior_precision, monkeypatch
):
    whole = _steps(ONE_BUFFER, dtype, hp, weight, prior_precision, monkeypatch)
    nonfinite = overflow = 0
    for chunk in (64, 192, 4096):  # tensors straddle chunks of 64 and 192; 4097 straddles 4096
        chunked = _steps(chunk, dtype, hp, weight, prior_precision, monkeypatch)
        for (_, want), (_, got) in zip(whole, chunked):
            for a, b, n in zip(want, got, SIZES):
                assert b.mu.shape == (n,) and b.state.damping.shape == (n,)
                for x, y in zip((a.mu, a.sigma, *a.state), (b.mu, b.sigma, *b.state)):
                    assert x.dtype == y.dtype == dtype
                    assert torch.equal(bit_patterns(x), bit_patterns(y)), chunk
                for kind in COUNT_KINDS:
                    assert int(getattr(a, kind)) == int(getattr(b, kind)), kind
                nonfinite += int(b.num_nonfinite)
                overflow += int(b.num_overflow)
    assert nonfinite > 0  # the guard ran on the hazards, in several chunks
    if hp.lr > 0 or weight != 1:
        assert overflow > 0


@pytest.mark.parametrize("hp", HYPERPARAMETERS.values(), ids=HYPERPARAMETERS.keys())
def test_chunks_give_the_reference_update_of_each_tensor(hp, monkeypatch):
    """Against the per-tensor reference (:func:`qnvb_update`, each rule as written): value for
    value, the guard's counts included."""
    for inputs, results in _steps(64, torch.float64, hp, 50.0, 0.7, monkeypatch):
        for args, got in zip(zip(*inputs), results):
            want = qnvb_update(*args, hp, 50.0, 0.7)
            for x, y in zip((want.mu, want.sigma, *want.state), (got.mu, got.sigma, *got.state)):
                assert torch.equal(bit_patterns(x), bit_patterns(y))
            assert [int(getattr(got, k)) for k in COUNT_KINDS] == [
                int(getattr(want, k)) for k in COUNT_KINDS
            ]


def test_results_are_pieces_of_one_buffer_per_field_and_no_argument_is_written(monkeypatch):
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 64)
    mus = [torch.randn(n, dtype=torch.float64) for n in (100, 7, 0, 300)]
    sigmas = [torch.full_like(m, 0.1) for m in mus]
    gs = [torch.randn_like(m) for m in mus]
    hs = [torch.rand_like(m) for m in mus]
    states = [init_qnvb_state(m) for m in mus]
    copies = [t.clone() for t in (*mus, *sigmas, *gs, *hs, *(f for s in states for f in s))]
    results = qnvb_update_many(mus, sigmas, gs, hs, states, QNVBHyperparameters())
    after = (*mus, *sigmas, *gs, *hs, *(f for s in states for f in s))
    assert all(torch.equal(a, b) for a, b in zip(after, copies))
    for field in range(10):
        pieces = [(r.mu, r.sigma, *r.state)[field] for r in results]
        assert qnvb_functional.consecutive_base(pieces) is not None  # the next step reads a view
    assert results[2].mu.shape == (0,) and int(results[2].num_overflow) == 0


def test_no_tensor_with_a_coordinate_is_updated_to_empty_results():
    empty = [torch.zeros(0), torch.zeros(0, 3)]
    results = qnvb_update_many(
        empty,
        [torch.ones_like(t) for t in empty],
        [torch.zeros_like(t) for t in empty],
        [torch.zeros_like(t) for t in empty],
        [init_qnvb_state(t) for t in empty],
        QNVBHyperparameters(),
    )
    assert [r.mu.shape for r in results] == [(0,), (0, 3)]
    assert [int(r.num_nonfinite) for r in results] == [0, 0]


def test_one_host_sync_per_update_however_many_chunks(monkeypatch):
    """On a GPU the update reads one small tensor back, whether the guard kept a coordinate in
    each chunk, once for all the chunks (``meta`` stands in for the GPU)."""
    monkeypatch.setattr(qnvb_functional, "_DEVICE_CHUNK", 64)
    meta = torch.device("meta")
    mus = [torch.empty(n, device=meta) for n in (300, 5, 130)]  # 7 chunks
    like = [torch.empty_like(m) for m in mus]
    with FakeSync() as syncs:
        results = qnvb_update_many(
            mus, like, like, like, [init_qnvb_state(m) for m in mus], QNVBHyperparameters()
        )
    assert syncs.total == 1, syncs.counts
    assert [r.mu.shape for r in results] == [(300,), (5,), (130,)]


def test_off_the_cpu_a_network_of_millions_is_one_chunk(monkeypatch):
    """Each chunk is some hundred kernel launches, which bound a GPU's step: off the CPU a chunk
    holds 2^22 coordinates, so 4 M weights take one pass of the rules (64 on the CPU)."""
    calls = []
    flat_update = qnvb_functional._flat_update

    def counted(*args, **kwargs):
        calls.append(args[0].device.type)
        return flat_update(*args, **kwargs)

    monkeypatch.setattr(qnvb_functional, "_flat_update", counted)
    for device, expected in (("meta", 1), ("cpu", 64)):
        calls.clear()
        mus = [torch.zeros(n, device=device) for n in (2**21, 2**21)]
        like = [torch.ones_like(m) for m in mus]
        with FakeSync():  # meta has no values to read back
            qnvb_update_many(
                mus, like, like, like, [init_qnvb_state(m) for m in mus], QNVBHyperparameters()
            )
        assert calls == [device] * expected


def test_the_update_scratch_is_a_chunks_beyond_its_results():
    """Ten results (mean, scale, eight state fields) of P floats each, and scratch bounded by the
    chunk: the one-buffer update held about 20 P (its temporaries, the concatenated g and h)."""
    torch.manual_seed(0)
    sizes = (600_000, 1800, 400_000, 7)
    total = sum(sizes)
    mus = [torch.randn(n) for n in sizes]
    sigmas = [torch.full_like(m, 0.01) for m in mus]
    states = [init_qnvb_state(m) for m in mus]
    hp = QNVBHyperparameters()
    first = qnvb_update_many(mus, sigmas, mus, sigmas, states, hp)  # steady state: consecutive
    gs = [torch.randn(n) for n in sizes]
    hs = [torch.rand(n) * 1e-3 for n in sizes]
    peak = cpu_peak_bytes(
        lambda: qnvb_update_many(
            [r.mu for r in first],
            [r.sigma for r in first],
            gs,
            hs,
            [r.state for r in first],
            hp,
            1e4,
            1.0,
        )
    )
    results_bytes = 10 * 4 * total
    assert results_bytes <= peak <= results_bytes + 32 * 4 * qnvb_functional._CHUNK, peak / (
        4 * total
    )


def _svi_run(chunk, monkeypatch):
    monkeypatch.setattr(qnvb_functional, "_CHUNK", chunk)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    bnn = BayesianModule(small_net(), priors.Normal(1.0), likelihoods.Categorical(100))
    guide = AutoMeanFieldNormal(bnn)
    optim = QNVB()
    svi = SVI(bnn, guide, optim, QuadratureELBO("hadamard", num_points=4))
    losses = [svi.step(x, y) for _ in range(4)]
    params = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    return losses, params, optim.get_state()


def _torch_run(chunk, monkeypatch):
    monkeypatch.setattr(qnvb_functional, "_CHUNK", chunk)
    x, y = torch.randn(16, 3, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 2
    net = small_net()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=100.0, prior_precision=1)
    loss_fn = module_loss(net, F.cross_entropy)
    losses = [float(optimizer.step(loss_fn=loss_fn, batch=(x, y))) for _ in range(4)]
    return losses, optimizer.state_dict()


def test_qnvb_and_the_torch_optimizer_run_bit_for_bit_in_chunks(monkeypatch):
    """Whole steps (the scales' transform and write-back, the states rebound as pieces of the
    update's buffers) with the update in chunks of 64 and on one buffer: the same bits."""
    assert equal_nested(_svi_run(64, monkeypatch), _svi_run(ONE_BUFFER, monkeypatch), bits=True)
    assert equal_nested(_torch_run(64, monkeypatch), _torch_run(ONE_BUFFER, monkeypatch), bits=True)
