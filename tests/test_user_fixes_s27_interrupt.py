"""An interrupted step (a Ctrl-C, or any error) is taken whole or not at all (session 27, t34).

QNVB's step used to leave half a step when the interrupt landed in its fallback's step: the
guide's blocks stepped, the fallback's parameter not, the step count not advanced (200 steps
later a fallback parameter 3.5e-4 off the uninterrupted run's, the loss 0.93). A step of
``QNVBOptimizer(generator=g)`` or ``QuadratureELBO(generator=g)`` interrupted at a node put the
parameters back but left the generator advanced (the continuation 0.13 and 0.46 off).
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from pyro.optim import PyroOptim
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO, SparseQNVB
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.optim import QNVBOptimizer, module_loss


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 6, generator=g)
    y = (x * torch.randn(6, generator=g)).sum(-1) + 0.5 * torch.randn(60, generator=g)
    return x, y


def _model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([6]).to_event(1))
    s = pyro.param("s", torch.tensor(1.0), constraint=dist.constraints.positive)
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal((x * w).sum(-1), s), obs=y)


def _same(a, b) -> bool:
    """Nested dicts, lists and tensors equal bit for bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _store():
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def _fit(model, elbo, steps, interrupt=None):
    """``steps`` steps of ``SVI(model, guide, QNVB(), elbo)``; before the 4th, ``interrupt()``
    is called (it runs an interrupted step and undoes what the step is allowed to leave)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    qnvb = QNVB()
    svi = SVI(model, AutoMeanFieldNormal(model), qnvb, elbo)
    x, y = _data()
    losses = []
    for t in range(steps):
        if t == 3 and interrupt is not None:
            interrupt(svi, qnvb, x, y)
        losses.append(svi.step(x, y))
    return losses, _store()


@pytest.mark.parametrize(
    "where, undone",
    [
        ((QNVB, "_guarded_fallback"), True),  # the fallback's step (first), before it stepped
        ((PyroOptim, "__call__"), True),  # the fallback's step, once it stepped
        ((QNVB, "_update_prepared"), True),  # the blocks' update, the fallback stepped
        ((QNVB, "_warn_if_not_annealed"), False),  # a warning of the step, which is whole
    ],
)
def test_an_interrupted_qnvb_step_is_taken_whole_or_not_at_all(monkeypatch, where, undone):
    """A Ctrl-C in QNVB's step. Before the blocks' update (the fallback's step comes first):
    the fallback's parameter and its Adam state are put back, the blocks untouched, the step
    count not advanced, the gradients zeroed (as SVI zeroes them after a step); only the ELBO's
    position moved, as for a refused step (docs/qnvb.md), and with it put back the run goes on
    bit for bit as one without the interrupted step. In a warning after the update (an error
    under -W error): the step is whole, counted, and the run goes on bit for bit as is."""
    seen = {}
    owner, name = where

    def interrupt(svi, qnvb, x, y):
        before, state = _store(), qnvb.get_state()
        original = getattr(owner, name)

        def boom(self, *args, **kwargs):
            if owner is PyroOptim:
                original(self, *args, **kwargs)
                seen["fallback moved"] = not torch.equal(pyro.param("s"), before["s"])
            seen["blocks moved"] = not torch.equal(
                pyro.param("AutoMeanFieldNormal.locs.w"), before["AutoMeanFieldNormal.locs.w"]
            )
            raise KeyboardInterrupt

        monkeypatch.setattr(owner, name, boom)
        with pytest.raises(KeyboardInterrupt):
            svi.step(x, y)
        monkeypatch.setattr(owner, name, original)
        after = _store()
        (key,) = [k for k in after if k.endswith(".step")]
        seen["moved"] = [k for k in before if not torch.equal(before[k], after[k])]
        seen["position"] = (before[key].item(), after[key].item())
        seen["state kept"] = _same(state, qnvb.get_state())
        seen["steps"] = qnvb.num_steps
        store = pyro.get_param_store()
        seen["gradients"] = [
            k
            for k, v in store.items()
            if v.unconstrained().grad is not None and bool(v.unconstrained().grad.any())
        ]
        if undone:
            del store[key]
            store[key] = before[key]

    clean_losses, clean = _fit(_model, QuadratureELBO(rule="hadamard", num_points=4), 8)
    losses, after = _fit(_model, QuadratureELBO(rule="hadamard", num_points=4), 8, interrupt)
    assert seen["blocks moved"] is not undone
    assert seen.get("fallback moved", True)  # the interrupt came after the fallback's step
    assert seen["position"] == (3.0, 4.0)
    assert seen["gradients"] == []
    if undone:
        assert seen["moved"] == ["QuadratureELBO.AutoMeanFieldNormal.w.step"]
        assert seen["state kept"] and seen["steps"] == 3  # block states, the fallback's Adam
    else:
        assert not seen["state kept"] and seen["steps"] == 4
        assert losses[3:7] == clean_losses[4:8]  # the interrupted step was the clean run's 4th
    if undone:
        assert losses == clean_losses
        assert _same(after, clean)


class _InterruptAt:
    """A forward hook raising ``KeyboardInterrupt`` at the ``at``-th forward once armed."""

    def __init__(self):
        self.count, self.at = 0, None

    def __call__(self, module, inputs, output):
        self.count += 1
        if self.at is not None and self.count == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("form", ["closure", "loop"])
def test_an_interrupted_qnvb_optimizer_step_leaves_its_generator(form):
    """``QNVBOptimizer(generator=g)`` interrupted at the 3rd node: the parameters at their means
    (as before) and ``g`` as it was, so the next step draws the nodes the interrupted one drew
    and the run goes on bit for bit as one without it (0.13 off before)."""
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > x[:, 1]).long()

    def run(interrupt: bool):
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        hook = _InterruptAt()
        net[0].register_forward_hook(hook)
        generator = torch.Generator().manual_seed(3)
        opt = QNVBOptimizer(net.named_parameters(), likelihood_weight=32.0, generator=generator)
        loss_fn = module_loss(net, F.cross_entropy)

        def step():
            if form == "loop":
                return opt.step(loss_fn=loss_fn, batch=(x, y), vectorize=False)

            def closure():
                loss = F.cross_entropy(net(x), y)
                loss.backward()
                return loss

            return opt.step(closure)

        losses = [float(step()) for _ in range(3)]
        if interrupt:
            drawn = generator.get_state()
            hook.count, hook.at = 0, 3
            with pytest.raises(KeyboardInterrupt):
                step()
            hook.at = None
            assert torch.equal(generator.get_state(), drawn)
        losses += [float(step()) for _ in range(3)]
        return losses, [p.detach().clone() for p in net.parameters()]

    clean_losses, clean = run(False)
    losses, params = run(True)
    assert losses == clean_losses
    assert all(torch.equal(a, b) for a, b in zip(params, clean))


def test_an_interrupted_quadrature_elbo_step_leaves_its_generator():
    """``QuadratureELBO(generator=g)`` (a random rule) interrupted in the model at the 3rd node:
    ``g`` as it was, the run going on bit for bit as one without the step (0.46 off before)."""
    calls = {"count": 0, "at": None}

    def model(x, y):
        calls["count"] += 1
        if calls["at"] is not None and calls["count"] == calls["at"]:
            raise KeyboardInterrupt
        _model(x, y)

    generators = []

    def make_elbo():
        generators.append(torch.Generator().manual_seed(7))
        return QuadratureELBO(vectorize=False, generator=generators[-1])

    def interrupt(svi, qnvb, x, y):
        generator = generators[-1]
        drawn = generator.get_state()
        calls["count"], calls["at"] = 0, 3
        with pytest.raises(KeyboardInterrupt):
            svi.step(x, y)
        calls["at"] = None
        assert torch.equal(generator.get_state(), drawn)

    clean_losses, clean = _fit(model, make_elbo(), 6)
    losses, after = _fit(model, make_elbo(), 6, interrupt)
    assert losses == clean_losses
    assert _same(after, clean)


def test_an_interrupt_in_sparse_qnvbs_fallback_leaves_no_half_step(monkeypatch):
    """`SparseQNVB` updated its spike-and-slab blocks, then stepped the fallback: a Ctrl-C in
    the fallback's step left the blocks stepped and the rest not. The fallback now steps first
    and is undone where the blocks' update raises, so nothing of the step is left."""
    x, y = _data()

    def model(x, y):
        w = pyro.sample("w", SpikeSlab(0.3, 2.0).expand([6]).to_event(1))
        s = pyro.param("s", torch.tensor(1.0), constraint=dist.constraints.positive)
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal((x * w).sum(-1), s), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    optim = SparseQNVB(num_epochs=4, steps_per_epoch=5)
    svi = SVI(model, AutoSpikeSlab(model), optim, QuadratureELBO())
    for _ in range(3):
        svi.step(x, y)
    before, state = _store(), optim.get_state()
    original = PyroOptim.__call__

    def boom(self, *args, **kwargs):
        original(self, *args, **kwargs)  # the fallback stepped
        raise KeyboardInterrupt

    monkeypatch.setattr(PyroOptim, "__call__", boom)
    with pytest.raises(KeyboardInterrupt):
        svi.step(x, y)
    after = _store()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert all(k.endswith(".step") for k in moved), moved  # only the ELBO's position
    assert _same(state, optim.get_state()) and optim.num_steps == 3
