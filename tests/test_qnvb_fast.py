"""The flat (and compiled) QNVB update equals the per-tensor reference :func:`qnvb_update`, and
``QNVB`` updating blocks together equals updating them one by one."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.optim import qnvb as qnvb_module
from pyro_quadvi.optim import qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    COUNT_KINDS,
    QNVBHyperparameters,
    QNVBResult,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)

SHAPES = [(3, 5), (7,), (2, 2, 2), (1,)]
HYPERPARAMETERS = [
    QNVBHyperparameters(),
    QNVBHyperparameters(lr=0.3, betas=(0.9, 0.99), significance=1.5, recent_fraction=0.5),
    QNVBHyperparameters(curvature="rms", damping=False, drift_forgetting=0.0),
    QNVBHyperparameters(drift_forgetting=2.0, damping_recovery=1.0, eps=1e-3, trust_region=0.5),
]


def _inputs(dtype, generator, step):
    """Gradients and curvatures with every hazard: NaN, infinities, overflowing g^2, h < 0."""
    big = torch.finfo(dtype).max ** 0.75  # finite, but its square overflows
    gs, hs = [], []
    for shape in SHAPES:
        g = torch.randn(shape, generator=generator, dtype=dtype) * 3
        h = torch.randn(shape, generator=generator, dtype=dtype) + 0.5  # some negative
        flat_g, flat_h = g.view(-1), h.view(-1)
        if flat_g.numel() > 4:
            flat_g[step % flat_g.numel()] = (math.nan, math.inf, big, -big)[step % 4]
            flat_h[(step + 2) % flat_h.numel()] = (-math.inf, 1e30, math.nan, 0.0)[step % 4]
        gs.append(g)
        hs.append(h)
    return gs, hs


def _assert_same(fast: QNVBResult, reference: QNVBResult, exact: bool) -> None:
    pairs = [("mu", fast.mu, reference.mu), ("sigma", fast.sigma, reference.sigma)]
    pairs += list(zip(reference.state._fields, fast.state, reference.state))
    for name, got, want in pairs:
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if exact:
            assert torch.equal(got, want), (name, (got - want).abs().max())
        else:
            # fused kernels round exp, rsqrt and divisions their own way; a cancellation (the
            # carried g_avg) can turn an ulp into more of the result
            tolerance = 128 * torch.finfo(got.dtype).eps
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=name)
    for kind in COUNT_KINDS:
        assert int(getattr(fast, kind)) == int(getattr(reference, kind)), kind


def _run(dtype, hp, weight, prior_precision, steps=6, compile=False, exact=None):
    generator = torch.Generator().manual_seed(1)
    mus = [torch.randn(s, generator=generator, dtype=dtype) for s in SHAPES]
    sigmas = [torch.rand(s, generator=generator, dtype=dtype) + 0.05 for s in SHAPES]
    ref = [(m, s, init_qnvb_state(m)) for m, s in zip(mus, sigmas)]
    fast = [(m, s, init_qnvb_state(m)) for m, s in zip(mus, sigmas)]
    totals = dict.fromkeys(COUNT_KINDS, 0)
    for step in range(steps):
        gs, hs = _inputs(dtype, generator, step)
        expected = [
            qnvb_update(m, s, g, h, st, hp, weight, prior_precision)
            for (m, s, st), g, h in zip(ref, gs, hs)
        ]
        before = [t.clone() for m, s, st in fast for t in (m, s, *st)] + [
            t.clone() for t in gs + hs
        ]
        got = qnvb_update_many(
            [m for m, _, _ in fast],
            [s for _, s, _ in fast],
            gs,
            hs,
            [st for _, _, st in fast],
            hp,
            weight,
            prior_precision,
            compile=compile,
        )
        after = [t for m, s, st in fast for t in (m, s, *st)] + gs + hs
        for a, b in zip(after, before):  # the arguments are never written
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        for g_result, e_result in zip(got, expected):
            _assert_same(g_result, e_result, exact=not compile if exact is None else exact)
            for kind in COUNT_KINDS:
                totals[kind] += int(getattr(e_result, kind))
        ref = [(r.mu, r.sigma, r.state) for r in expected]
        fast = [(r.mu, r.sigma, r.state) for r in got]
    return totals


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("hp", HYPERPARAMETERS, ids=["defaults", "averaged", "rms", "drift"])
@pytest.mark.parametrize("weight, prior_precision", [(1.0, 0.0), (250.0, 0.5), (1.0, 2.0)])
def test_the_flat_update_equals_the_reference_value_for_value(dtype, hp, weight, prior_precision):
    totals = _run(dtype, hp, weight, prior_precision)
    # the hazards were met: non-finite inputs and overflows were counted (and agreed)
    assert totals["num_nonfinite"] > 0 and totals["num_overflow"] > 0, totals


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_compiled_update_equals_the_reference_to_rounding(dtype):
    # torch.compile fuses the flat update into one loop; exp and rsqrt may round differently
    totals = _run(dtype, QNVBHyperparameters(), 250.0, 0.5, steps=4, compile=True)
    assert totals["num_nonfinite"] > 0 and totals["num_overflow"] > 0, totals


def _uncompiled(monkeypatch) -> list[int]:
    """``torch.compile`` left out (the function itself runs), recording the size of each call's
    first argument; a fresh cache of compiled updates."""
    calls: list[int] = []

    def compile(fn):
        def run(*args):
            calls.append(args[0].numel())
            return fn(*args)

        return run

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setattr(qnvb_functional, "_COMPILED", {})
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_flat_compiled_update_is_the_reference_on_one_buffer(dtype, monkeypatch):
    """Off the CPU, ``compile=True`` compiles the reference rules and runs them once on one flat
    buffer, counted segment by segment: uncompiled, the reference's values and counts exactly."""
    calls = _uncompiled(monkeypatch)
    monkeypatch.setattr(qnvb_functional, "_PER_TENSOR_DEVICES", frozenset())
    totals = _run(dtype, QNVBHyperparameters(), 250.0, 0.5, steps=4, compile=True, exact=True)
    assert calls == [sum(math.prod(shape) for shape in SHAPES)] * 4
    assert totals["num_nonfinite"] > 0 and totals["num_overflow"] > 0, totals


def test_the_compiled_update_goes_per_tensor_on_the_cpu_and_flat_elsewhere(monkeypatch):
    """On an H100 the per-tensor compiled update was slower than the eager flat one (each call's
    overhead); on one flat buffer it is faster (docs/benchmarks.md): off the CPU, one call."""
    calls = _uncompiled(monkeypatch)
    hp = QNVBHyperparameters()
    for device, expected in (("cpu", [15, 7, 8, 1]), ("meta", [31])):
        calls.clear()
        mus = [torch.zeros(shape, device=device) for shape in SHAPES]
        states = [init_qnvb_state(mu) for mu in mus]
        results = qnvb_update_many(mus, mus, mus, mus, states, hp, 2.0, 0.5, compile=True)
        assert calls == expected, device
        assert [r.mu.shape for r in results] == [mu.shape for mu in mus]
        assert all(r.mu.device.type == device for r in results)


def test_lists_of_different_lengths_are_refused():
    mu = torch.zeros(2)
    with pytest.raises(ValueError, match="as many sigmas, gs, hs and states as mus"):
        qnvb_update_many([mu], [mu], [mu, mu], [mu], [init_qnvb_state(mu)], QNVBHyperparameters())


@pytest.mark.usefixtures("fresh_param_store")
@pytest.mark.parametrize("guide_class", ["AutoMeanFieldNormal", "AutoNormal"])
def test_qnvb_updating_blocks_together_equals_updating_them_one_by_one(guide_class, monkeypatch):
    # the same SVI run twice: blocks on one flat buffer (the default), and block by block through
    # the reference qnvb_update (no batched family update); equal value for value, state too
    x = torch.linspace(-1, 1, 12, dtype=torch.float64)
    y = 0.3 + 0.8 * x - 0.4 * x**2 + 0.1 * torch.sin(7 * x)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=x.dtype), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=x.dtype), 2.0))
        s = pyro.sample("s", dist.LogNormal(torch.zeros((), dtype=x.dtype), 1.0))
        mean = b + w[..., 0] * x + w[..., 1] * x**2 + w[..., 2] * x**3
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(mean, s), obs=y)

    def run(batched: bool):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        if not batched:
            monkeypatch.setattr(qnvb_module, "_FAMILY_BATCH_UPDATES", {})
        guide = {"AutoMeanFieldNormal": AutoMeanFieldNormal, "AutoNormal": AutoNormal}
        guide = guide[guide_class](model)
        loss = QuadratureELBO("hadamard", num_points=4)
        if guide_class == "AutoNormal":
            loss = Trace_ELBO(num_particles=4, vectorize_particles=True)
        optim = QNVB()
        svi = SVI(model, guide, optim, loss)
        losses = [svi.step() for _ in range(6)]
        monkeypatch.undo()
        params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        return losses, params, optim.get_state()["qnvb"]["pairs"]

    losses_a, params_a, state_a = run(batched=True)
    losses_b, params_b, state_b = run(batched=False)
    assert losses_a == losses_b
    assert params_a.keys() == params_b.keys() and len(state_a) == 3
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    for block in state_a:
        for key in state_a[block]:
            assert torch.equal(state_a[block][key], state_b[block][key]), (block, key)
