"""Session 15: the QNVB update writes its results in place, with fewer operator calls.

``qnvb_update_many(..., donate=("mu", "sigma", "state"))`` writes each chunk's results over the
donated inputs once it has read the chunk, and returns them: its memory is a chunk's scratch
(and the results of what is not donated) instead of ten new buffers of P floats. ``QNVB`` donates
each block's loc (the parameter's memory, which it wrote anyway) and state; ``QNVBOptimizer`` its
state where the tensors are its own (not handed out by ``state_dict`` or taken in by
``load_state_dict``: torch's state dict holds the state's tensors, not copies). The eager rules
make fewer operator calls, with the same bits: the reference ``qnvb_update`` (each rule as
written, unchanged) is the package before the change, value for value.
"""

from __future__ import annotations

import copy

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss, qnvb, qnvb_functional, torch_qnvb
from pyro_quadvi.optim.qnvb_functional import (
    COUNT_KINDS,
    QNVBHyperparameters,
    QNVBResult,
    QNVBState,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)
from pyro_quadvi.testing.compare import bit_patterns, equal_nested
from pyro_quadvi.testing.memory import cpu_peak_bytes
from pyro_quadvi.testing.meta import FakeSync
from pyro_quadvi.testing.update_cases import HYPERPARAMETERS, SIZES, hazard_moments, small_net

ALL = ("mu", "sigma", "state")


def _fields(result: QNVBResult) -> tuple[torch.Tensor, ...]:
    return (result.mu, result.sigma, *result.state)


def _snapshot(result: QNVBResult) -> tuple[list[torch.Tensor], list[int]]:
    """A result's ten fields (cloned: a donated one is written again by the next step) and its
    counts."""
    return [t.clone() for t in _fields(result)], [int(getattr(result, k)) for k in COUNT_KINDS]


def _run(dtype, hp, weight, prior_precision, donate, chunk, monkeypatch, steps=4):
    """``steps`` updates at ``chunk``, each fed the last's results (the first reads separate
    tensors, the next ones consecutive pieces, or, donated, the same tensors again); per step
    the inputs (cloned) and the results' `_snapshot`."""
    monkeypatch.setattr(qnvb_functional, "_CHUNK", chunk)
    generator = torch.Generator().manual_seed(5)
    mus = [torch.randn(n, generator=generator, dtype=dtype) for n in SIZES]
    sigmas = [torch.rand(n, generator=generator, dtype=dtype) * 0.5 + 1e-3 for n in SIZES]
    states = [init_qnvb_state(m) for m in mus]
    history = []
    for step in range(steps):
        gs, hs = hazard_moments(dtype, generator, step, within=64)
        inputs = [[t.clone() for t in field] for field in (mus, sigmas, gs, hs)]
        inputs.append([QNVBState(*(t.clone() for t in s)) for s in states])
        results = qnvb_update_many(
            mus, sigmas, gs, hs, states, hp, weight, prior_precision, donate=donate
        )
        for i, r in enumerate(results):  # a donated argument is the result, another is not
            assert (r.mu is mus[i]) == ("mu" in donate)
            assert (r.sigma is sigmas[i]) == ("sigma" in donate)
            assert all((a is b) == ("state" in donate) for a, b in zip(r.state, states[i]))
        history.append((inputs, [_snapshot(r) for r in results]))
        mus, sigmas = [r.mu for r in results], [r.sigma for r in results]
        states = [r.state for r in results]
    return history


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hp", HYPERPARAMETERS.values(), ids=HYPERPARAMETERS.keys())
@pytest.mark.parametrize(("weight", "prior_precision"), [(1.0, 0.0), (50.0, 0.7), (0.3, 0.0)])
def test_in_place_results_are_the_pure_ones_bit_for_bit(
    dtype, hp, weight, prior_precision, monkeypatch
):
    pure = _run(dtype, hp, weight, prior_precision, (), 2**40, monkeypatch)
    guarded = 0
    # chunks inside a tensor, tensors straddling chunks of 64 and 192, 4097 straddling 4096
    for chunk, donate in ((64, ALL), (192, ("mu", "state")), (4096, ALL)):
        donated = _run(dtype, hp, weight, prior_precision, donate, chunk, monkeypatch)
        for (_, want), (_, got) in zip(pure, donated):
            for (x_fields, x_counts), (y_fields, y_counts), n in zip(want, got, SIZES):
                assert y_fields[0].shape == (n,)
                for x, y in zip(x_fields, y_fields):
                    assert x.dtype == y.dtype == dtype
                    assert torch.equal(bit_patterns(x), bit_patterns(y)), (chunk, donate)
                assert x_counts == y_counts
                guarded += y_counts[0] + y_counts[1]
    assert guarded > 0  # the guard kept coordinates, in some chunks and not in others


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hp", HYPERPARAMETERS.values(), ids=HYPERPARAMETERS.keys())
def test_in_place_results_are_the_reference_rules_bit_for_bit(dtype, hp, monkeypatch):
    """Against `qnvb_update` tensor by tensor (each rule as written, the reference the eager
    rules' fused operations must reproduce), the guard's counts included."""
    for weight, prior_precision in ((1.0, 0.0), (50.0, 0.7)):
        history = _run(dtype, hp, weight, prior_precision, ALL, 64, monkeypatch)
        for inputs, results in history:
            for args, (fields, counts) in zip(zip(*inputs), results):
                want = qnvb_update(*args, hp, weight, prior_precision)
                for x, y in zip(_fields(want), fields):
                    assert torch.equal(bit_patterns(x), bit_patterns(y))
                assert [int(getattr(want, k)) for k in COUNT_KINDS] == counts


def test_a_donated_argument_that_shares_memory_is_refused():
    mu = torch.randn(10)
    sigma, state = torch.full_like(mu, 0.1), init_qnvb_state(mu)
    hp = QNVBHyperparameters()
    with pytest.raises(ValueError, match=r"mus\[0\] and gs\[0\] share memory"):
        qnvb_update_many([mu], [sigma], [mu], [sigma], [state], hp, donate=("mu",))
    overlapping = torch.randn(20)  # two pieces that overlap by 5 coordinates
    with pytest.raises(ValueError, match=r"sigmas\[0\] and sigmas\[1\] share memory"):
        qnvb_update_many(
            [mu, mu.clone()],
            [overlapping[:10], overlapping[5:15]],
            [sigma, sigma],
            [sigma, sigma],
            [state, init_qnvb_state(mu)],
            hp,
            donate=("sigma",),
        )
    with pytest.raises(ValueError, match=r"the donated states\[0\].g_avg is not contiguous"):
        strided = state._replace(g_avg=torch.zeros(20)[::2])
        qnvb_update_many([mu], [sigma], [mu], [sigma], [strided], hp, donate=("state",))
    with pytest.raises(ValueError, match="donate must be a tuple of names from"):
        qnvb_update_many([mu], [sigma], [mu], [sigma], [state], hp, donate="mu")
    # the same memory, none of it donated: pure, as before (positive: it is a scale too)
    same = mu.abs() + 0.5
    (result,) = qnvb_update_many([same], [same], [same], [same], [init_qnvb_state(same)], hp)
    assert result.mu is not same


def test_off_the_cpu_the_in_place_update_reads_nothing_back(monkeypatch):
    """Donated, the old values are gone once a chunk is written, so the guard's selection is
    made in every chunk: no host sync at all (the pure update reads one flag per call); ``meta``
    stands in for the GPU."""
    monkeypatch.setattr(qnvb_functional, "_DEVICE_CHUNK", 64)
    meta = torch.device("meta")
    mus = [torch.empty(n, device=meta) for n in (300, 5, 130)]  # 7 chunks
    sigmas = [torch.empty_like(m) for m in mus]
    with FakeSync() as syncs:
        results = qnvb_update_many(
            mus,
            sigmas,
            [torch.empty_like(m) for m in mus],
            [torch.empty_like(m) for m in mus],
            [init_qnvb_state(m) for m in mus],
            QNVBHyperparameters(),
            donate=ALL,
        )
    assert syncs.total == 0, syncs.counts
    assert [r.mu is m for r, m in zip(results, mus)] == [True] * 3


#: a bound on the update's scratch, in floats per coordinate of a chunk: `_flat_update` holds
#: about 25 chunk-sized temporaries at once (every input's chunk read as a view, none copied
#: where the tensors are consecutive), and the counts' masks are bytes
SCRATCH_FLOATS = 32


def test_the_in_place_update_holds_a_chunks_scratch_and_the_results_not_donated(monkeypatch):
    """Pure: ten results of P floats (mean, scale, eight state fields) beside the scratch.
    Donated: the results are the arguments, so only what is not donated is new (the scale for
    QNVB: 1 P), and a chunk's scratch, here 32 x 4,096 floats against P = 400,000."""
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 4096)
    torch.manual_seed(0)
    sizes = (250_000, 1800, 148_193, 7)
    total = sum(sizes)
    scratch = SCRATCH_FLOATS * 4 * qnvb_functional._CHUNK
    assert scratch < 4 * total / 3  # the bound below tells the cases apart
    hp = QNVBHyperparameters()
    gs = [torch.randn(n) for n in sizes]
    hs = [torch.rand(n) * 1e-3 for n in sizes]
    for donate, results_floats in (((), 10), (("mu", "state"), 1), (ALL, 0)):
        mus = [torch.randn(n) for n in sizes]
        sigmas = [torch.full_like(m, 0.01) for m in mus]
        states = [init_qnvb_state(m) for m in mus]
        first = qnvb_update_many(mus, sigmas, gs, hs, states, hp, donate=donate)  # consecutive
        peak = cpu_peak_bytes(
            lambda first=first, donate=donate: qnvb_update_many(
                [r.mu for r in first],
                [r.sigma for r in first],
                gs,
                hs,
                [r.state for r in first],
                hp,
                1e4,
                1.0,
                donate=donate,
            )
        )
        results_bytes = results_floats * 4 * total
        assert results_bytes <= peak <= results_bytes + scratch, (donate, peak / (4 * total))


def _reference_many(mus, sigmas, gs, hs, states, hp, weight=1.0, prior_precision=0.0, **_):
    """The update as the package made it before the change, value for value: `qnvb_update`
    tensor by tensor (pure: every result a new tensor; ``donate`` ignored)."""
    return [
        qnvb_update(*args, hp, weight, prior_precision) for args in zip(mus, sigmas, gs, hs, states)
    ]


def _measured(module, peaks: list, monkeypatch):
    """``module.qnvb_update_many`` run under `_peak_bytes`, its peaks appended to ``peaks``."""
    update = module.qnvb_update_many

    def measured(*args, **kwargs):
        out = []
        peaks.append(cpu_peak_bytes(lambda: out.append(update(*args, **kwargs))))
        return out[0]

    monkeypatch.setattr(module, "qnvb_update_many", measured)


def _svi_fit(steps: int = 20):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    bnn = BayesianModule(small_net(), priors.Normal(1.0), likelihoods.Categorical(100))
    guide = AutoMeanFieldNormal(bnn)
    optim = QNVB()
    svi = SVI(bnn, guide, optim, QuadratureELBO("hadamard", num_points=4))
    store = pyro.get_param_store()
    locs = {n: store._params[n] for n in store.keys() if ".locs." in n}
    addresses = []
    losses = []
    for _ in range(steps):
        losses.append(svi.step(x, y))
        addresses.append(
            {name: state["g_avg"].data_ptr() for name, (_, state) in optim._bound.items()}
        )
    params = {name: value.detach().clone() for name, value in store.items()}
    versions = {name: loc._version for name, loc in locs.items()}
    return losses, params, optim.get_state(), versions, addresses


def test_a_qnvb_fit_is_the_pure_fit_bit_for_bit_in_place(monkeypatch):
    """A seeded 20-step SVI fit: the param store, the losses, QNVB's state and the loc
    parameters' version counters (the update writes the loc through ``.data``, as the write-back
    did) equal those of the pure reference update; the states stay in their buffers from the
    second step on (they moved to new ones at every step before), and the update holds the new
    scale, 1 P, beside a chunk's scratch."""
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 64)
    with monkeypatch.context() as patched:
        patched.setattr(qnvb, "qnvb_update_many", _reference_many)
        *want, _ = _svi_fit()
    peaks = []
    _measured(qnvb, peaks, monkeypatch)
    *got, addresses = _svi_fit()
    assert equal_nested(want, got, bits=True)
    assert all(a == addresses[1] for a in addresses[1:])  # in place after the first step
    count = sum(p.numel() for p in small_net().parameters())  # 1,452: 23 chunks of 64
    scratch = SCRATCH_FLOATS * 4 * qnvb_functional._CHUNK
    assert 4 * count <= max(peaks[1:]) <= 4 * count + scratch < 10 * 4 * count


def _torch_fit(steps: int = 20, reload_at: int | None = None):
    x, y = torch.randn(16, 3, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 2
    net = small_net()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=100.0, prior_precision=1)
    loss_fn = module_loss(net, F.cross_entropy)
    losses = []
    for step in range(steps):
        if step == reload_at:  # through a saved state dict: the next step writes new tensors
            optimizer.load_state_dict(optimizer.state_dict())
        losses.append(float(optimizer.step(loss_fn=loss_fn, batch=(x, y))))
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}, optimizer


def test_a_torch_optimizer_fit_is_the_pure_fit_bit_for_bit_in_place(monkeypatch):
    """A seeded 20-step ``QNVBOptimizer`` fit (likelihood weight and prior: the scaled paths),
    reloaded from its state dict halfway: losses, network and optimizer state equal those of
    the pure reference update; the state is written in place, and the update allocates no
    result, only a chunk's scratch (the pure steps: 10 P of results more)."""
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 64)
    with monkeypatch.context() as patched:
        patched.setattr(torch_qnvb, "qnvb_update_many", _reference_many)
        *want, want_optimizer = _torch_fit(reload_at=10)
    peaks = []
    _measured(torch_qnvb, peaks, monkeypatch)
    *got, optimizer = _torch_fit(reload_at=10)
    assert equal_nested(want, got, bits=True)
    assert equal_nested(want_optimizer.state_dict(), optimizer.state_dict(), bits=True)
    count = sum(p.numel() for p in small_net().parameters())  # 1,452: 23 chunks of 64
    in_place = peaks[1:10] + peaks[11:]  # the first step and the one after the reload are pure
    scratch = SCRATCH_FLOATS * 4 * qnvb_functional._CHUNK
    assert max(in_place) <= scratch < 10 * 4 * count <= min(peaks[0], peaks[10])


def test_an_earlier_state_dict_keeps_its_values_through_later_steps():
    """Torch's state dict holds the state's own tensors (``optimizer.state`` is live, as for
    torch's optimizers): the tensors read from one keep their values through later steps, as
    when every step made new ones, and a state dict loaded twice resumes the same run twice."""
    x, y = torch.randn(16, 3, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 2
    net = small_net()
    optimizer = QNVBOptimizer(
        net.named_parameters(),
        likelihood_weight=100.0,
        prior_precision=1,
        generator=torch.Generator().manual_seed(2),  # its nodes' state is saved too
    )
    loss_fn = module_loss(net, F.cross_entropy)

    def steps(n: int) -> list[float]:
        return [float(optimizer.step(loss_fn=loss_fn, batch=(x, y))) for _ in range(n)]

    steps(3)  # in place from the second step on
    saved = optimizer.state_dict()
    live = optimizer.state[net[0].weight]
    assert all(saved["state"][0][k] is v for k, v in live.items())  # references, not copies
    held = {**saved, "state": {i: dict(entry) for i, entry in saved["state"].items()}}
    copies = {i: {k: v.clone() for k, v in entry.items()} for i, entry in held["state"].items()}
    continued = steps(4)
    assert equal_nested(held["state"], copies, bits=True)
    resumed = []
    for _ in range(2):
        optimizer.load_state_dict(held)
        resumed.append(steps(4))
        assert equal_nested(held["state"], copies, bits=True)
    assert resumed == [continued, continued]


def test_a_qnvb_fit_on_a_non_contiguous_loc_is_the_contiguous_fit(fresh_param_store):
    # a loc a user set to a transposed tensor cannot take the update's results through a flat
    # view: QNVB leaves it undonated and writes it back (a first version raised a ValueError)
    import pyro.distributions as dist
    from pyro.infer.autoguide import AutoNormal

    def model():
        pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))

    start = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).T
    runs = []
    for loc in (start, start.contiguous()):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(model)
        guide()
        with torch.no_grad():
            guide.locs.w_unconstrained.data = loc.clone(memory_format=torch.preserve_format)
        assert guide.locs.w_unconstrained.is_contiguous() == (loc is not start)
        svi = SVI(model, guide, QNVB(), QuadratureELBO())
        losses = [svi.step() for _ in range(4)]
        runs.append((losses, guide.locs.w_unconstrained.detach().clone()))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][1], start)  # the means moved


@pytest.mark.parametrize("how", ["expanded", "shared", "kept"])
def test_a_sigma_a_user_assigns_into_the_state_is_not_written_over(how):
    # a user resetting optimizer.state[p]["sigma"] between steps (torch's habit) got a ValueError
    # naming `donate` for an expanded or shared tensor, and a kept tensor was written over
    torch.manual_seed(0)
    net = nn.Linear(3, 4)
    x, y = torch.randn(16, 3), torch.randn(16, 4)
    opt = QNVBOptimizer(net.parameters(), likelihood_weight=16)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    w, b = net.weight, net.bias
    if how == "expanded":
        assigned = {b: torch.tensor(0.01).expand_as(b)}
    elif how == "shared":
        s = torch.full((4,), 0.01)
        assigned = {b: s, w: s.view(1, 4).expand(3, 4).t()}  # one memory for both
    else:
        assigned = {b: torch.full_like(b, 0.01)}
    kept = {p: t.clone() for p, t in assigned.items()}
    for p, t in assigned.items():
        opt.state[p]["sigma"] = t
    before = {p: opt.state[p]["sigma"] for p in assigned}
    reference = copy.deepcopy((net, opt))
    torch.manual_seed(5)  # the nodes' draw, the same for the reference's step
    opt.step(closure)
    ref_net, ref_opt = reference
    for p, t in assigned.items():
        assert torch.equal(t, kept[p])  # the user's tensor is untouched
        assert opt.state[p]["sigma"] is not before[p]
    # and the step is the one a fresh copy of the same state takes
    torch.manual_seed(5)
    ref_opt.step(lambda: _closure_for(ref_net, ref_opt, x, y))
    for p, q in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["sigma"], ref_opt.state[q]["sigma"])
    opt.step(closure)  # the step after writes in place again, on tensors it made
    assert all(opt._owns(p) for p in net.parameters())


def _closure_for(net, opt, x, y):
    opt.zero_grad()
    loss = F.mse_loss(net(x), y)
    loss.backward()
    return loss


def test_bit_for_bit_comparison_tells_signed_zeros_apart_and_matches_nans():
    nan, zero = torch.tensor([float("nan"), 0.0]), torch.tensor([float("nan"), -0.0])
    assert not equal_nested(nan, nan) and equal_nested(nan, nan, bits=True)
    assert equal_nested(zero[1:], nan[1:]) and not equal_nested(
        {"a": [zero]}, {"a": [nan]}, bits=True
    )
    assert not equal_nested(nan, nan.double(), bits=True)  # dtypes differ
