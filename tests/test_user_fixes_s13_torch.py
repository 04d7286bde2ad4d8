"""User trials of the plain-torch QNVB optimizers (session 13): a bad group setting refused before
the step changes anything, ``lr = 0`` from torch's schedulers, a net cast between steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer, module_loss

FORMS = ["closure", "onepass"]


def _data(dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=generator, dtype=dtype)
    y = torch.randint(0, 3, (16,), generator=generator)
    return x, y


def _net(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


def _two_groups(net, **kwargs):
    return QNVBOptimizer(
        [
            {"params": list(net[0].parameters()), "param_names": ["0.weight", "0.bias"]},
            {"params": list(net[2].parameters()), "param_names": ["2.weight", "2.bias"]},
        ],
        likelihood_weight=16,
        init_sigma=0.1,
        generator=torch.Generator().manual_seed(3),
        **kwargs,
    )


def _step(optimizer, net, form, x, y, calls=None):
    if form == "closure":

        def closure():
            if calls is not None:
                calls.append(1)
            loss = F.cross_entropy(net(x.to(net[0].weight.dtype)), y)
            loss.backward()
            return loss

        return optimizer.step(closure)
    return optimizer.step(
        loss_fn=module_loss(net, F.cross_entropy), batch=(x.to(net[0].weight.dtype), y)
    )


def _snapshot(optimizer, net):
    """Every value a step could change, cloned."""
    states = {
        id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in net.parameters()
    }
    params = [p.detach().clone() for p in net.parameters()]
    return params, states, optimizer.num_steps, optimizer.generator.get_state()


def _assert_same(before, after):
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    assert before[1].keys() == after[1].keys()
    for key, state in before[1].items():
        assert state.keys() == after[1][key].keys()
        for name, value in state.items():
            assert torch.equal(value, after[1][key][name]), name
    assert before[2] == after[2]
    assert torch.equal(before[3], after[3])


# -- 3. a bad group setting is refused before the first evaluation ------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "key, value, error, message",
    [
        ("lr", -1.0, ValueError, "lr must be >= 0, got -1.0"),
        ("betas", (0.9, 1.0), ValueError, "betas[1] must be in [0, 1), got 1.0"),
        ("prior_precision", "1", TypeError, "prior_precision must be a real number >= 0"),
    ],
)
def test_a_bad_group_setting_is_refused_before_the_step_changes_anything(
    form, key, value, error, message
):
    # before: the closure ran, the parameters were left at the last node and group 0's state
    # stepped, while num_steps did not; now nothing is evaluated or changed, and the run goes on
    # as if the refused call had never been made
    x, y = _data()
    net, twin = _net(), _net()
    optimizer, reference = _two_groups(net), _two_groups(twin)
    _step(optimizer, net, form, x, y)
    _step(reference, twin, form, x, y)
    before = _snapshot(optimizer, net)
    good = optimizer.param_groups[1][key]
    optimizer.param_groups[1][key] = value
    calls = []
    with pytest.raises(error) as info:
        _step(optimizer, net, form, x, y, calls)
    assert str(info.value).startswith(f"QNVBOptimizer: parameter group 1: {message}")
    assert calls == []
    _assert_same(before, _snapshot(optimizer, net))
    optimizer.param_groups[1][key] = good
    _step(optimizer, net, form, x, y)
    _step(reference, twin, form, x, y)
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_a_half_precision_parameter_is_refused_before_any_state_is_made():
    # the check ran while the states were made, parameter by parameter: the first parameters got
    # a state before the half-precision one was refused
    net = _net(torch.float32)
    optimizer = QNVBOptimizer(net.parameters(), likelihood_weight=16)
    net[2].half()
    with pytest.raises(TypeError, match=r"parameter 2 is torch\.float16"):
        optimizer.step(lambda: None)
    assert len(optimizer.state) == 0


# -- 4. lr = 0, where torch's schedulers end ----------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_lr_zero_holds_the_means_bit_for_bit_and_updates_sigma_as_any_lr(form):
    x, y = _data()
    results = {}
    for lr in (0.0, 0.05):
        net = _net()
        start = [p.detach().clone() for p in net.parameters()]
        optimizer = _two_groups(net, lr=lr)
        _step(optimizer, net, form, x, y)
        results[lr] = [optimizer.state[p] for p in net.parameters()]
        moved = [not torch.equal(p, s) for p, s in zip(net.parameters(), start)]
        if lr == 0:
            assert not any(moved)
            assert all(torch.equal(s["mu"], p) for s, p in zip(results[lr], start))
        else:
            assert all(moved)
    for held, moving in zip(results[0.0], results[0.05]):
        assert not torch.equal(held["sigma"], torch.full_like(held["sigma"], 0.1))
        for name in ("sigma", "s_avg", "h_avg", "h2_avg", "count", "damping"):
            assert torch.equal(held[name], moving[name]), name


@pytest.mark.parametrize(
    "make",
    [
        lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=0.0),
        lambda o: lr_scheduler.PolynomialLR(o, total_iters=4),
        lambda o: lr_scheduler.LinearLR(o, 1.0, 0.0, 4),
    ],
    ids=["cosine", "polynomial", "linear"],
)
def test_schedulers_down_to_lr_zero_run_to_the_end(make):
    # before: "lr must be > 0, got 0.0" at the step after the schedule reached 0
    x, y = _data()
    net = _net()
    optimizer = _two_groups(net, lr=0.05)
    scheduler = make(optimizer)
    held = 0
    for _ in range(8):
        lr = optimizer.param_groups[0]["lr"]
        before = [p.detach().clone() for p in net.parameters()]
        _step(optimizer, net, "onepass", x, y)
        scheduler.step()
        if lr == 0:
            held += 1
            assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert held >= 1
    assert optimizer.num_steps == 8


# -- 5. a net cast between steps ----------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("to", [torch.float32, torch.float64], ids=["to-float32", "to-float64"])
def test_a_net_cast_between_steps_takes_its_whole_state_along(form, to):
    # before: float64 -> float32 made the one-pass step raise "expected scalar type Double but
    # found Float", and the closure form kept a float64 state driving a float32 net
    start = torch.float64 if to == torch.float32 else torch.float32
    x, y = _data()
    net = _net(start)
    optimizer = _two_groups(net)
    for _ in range(2):
        _step(optimizer, net, form, x, y)
    old = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in net.parameters()}
    net.to(to)
    saved = optimizer.state_dict()  # takes the edit: the state follows the parameters
    for k, p in enumerate(net.parameters()):
        for name, value in saved["state"][k].items():
            assert value.dtype == to, name
            assert torch.equal(value, old[id(p)][name].to(to)), name
        assert torch.equal(optimizer.state[p]["mu"], p.detach())
    _step(optimizer, net, form, x, y)
    for p in net.parameters():
        assert p.dtype == to
        assert all(value.dtype == to for value in optimizer.state[p].values())
        assert torch.equal(optimizer.state[p]["mu"], p.detach())


def test_a_net_cast_between_sparse_steps_takes_its_whole_state_along():
    x, y = _data()
    net = _net()
    optimizer = SparseQNVBOptimizer(net.parameters(), num_cases=16, steps_per_epoch=2)
    for _ in range(2):
        _step(optimizer, net, "closure", x, y)
    old = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in net.parameters()}
    net.float()
    _step(optimizer, net, "closure", x, y)
    for p in net.parameters():
        state = optimizer.state[p]
        assert all(value.dtype == torch.float32 for value in state.values())
        assert torch.equal(state["mu"], p.detach())
        assert not torch.equal(state["mu"], old[id(p)]["mu"].float())  # it stepped


# -- 6c. the owner named in SparseQNVBOptimizer's refusal ---------------------------------------


def test_sparse_load_refusal_names_its_owner():
    net = _net()
    kwargs = dict(num_cases=16, steps_per_epoch=2)
    optimizer = SparseQNVBOptimizer(
        net.parameters(), generator=torch.Generator().manual_seed(0), **kwargs
    )
    saved = copy.deepcopy(optimizer.state_dict())
    other = SparseQNVBOptimizer(_net().parameters(), **kwargs)
    with pytest.raises(ValueError) as info:
        other.load_state_dict(saved)
    assert str(info.value) == (
        "SparseQNVBOptimizer.load_state_dict: the saved state holds a generator state; "
        "construct the optimizer with a generator to restore it"
    )


@pytest.mark.parametrize("vectorize, frames", [(True, 0), (None, 0), (False, 1)])
def test_a_compiled_net_compiles_only_in_the_one_pass_loop(vectorize, frames):
    # docs/qnvb_torch.md: under vmap dynamo compiles no frame of torch.compile(net) (the net runs
    # eagerly); the loop over the nodes compiles it once and reuses the graph at every step
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    counter = CompileCounter()
    compiled = torch.compile(net, backend=counter)
    optimizer = QNVBOptimizer(
        net.named_parameters(), likelihood_weight=32, generator=torch.Generator().manual_seed(0)
    )
    counts = []
    for _ in range(3):
        loss_fn = module_loss(compiled, F.mse_loss)
        optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=vectorize)
        counts.append(counter.frame_count)
    assert counts == [frames] * 3
    torch._dynamo.reset()


def test_a_qnvb_in_the_process_leaves_torch_compile_of_a_network_whole():
    # QNVB's guide watch is a global module pre-hook; run at every submodule call as a
    # compiler-disabled function, it broke dynamo's graph so that a compiled network ran
    # eagerly (0 frames, 0 ops) in any process where a QNVB had been built
    from torch._dynamo.testing import CompileCounter

    from pyro_quadvi import QNVB

    QNVB()  # installs the watch
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    counter = CompileCounter()
    compiled = torch.compile(net, backend=counter)
    x = torch.randn(8, 16)
    outputs = [compiled(x) for _ in range(3)]
    assert (counter.frame_count, counter.op_count) == (1, 3)
    # module classes the watch learns from eager calls (a cache it keeps), and guide classes
    # registered later (trial: a guard on the registry recompiled at each), recompile nothing
    from pyro_quadvi.guides.interface import register_adapter

    for i in range(9):
        type(f"Fresh{i}", (nn.Identity,), {})()(x)
        register_adapter(type(f"FreshGuide{i}", (nn.Module,), {}))(lambda guide, trace: None)
    outputs.append(compiled(x))
    assert (counter.frame_count, counter.op_count) == (1, 3)
    for output in outputs:
        torch.testing.assert_close(output, net(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["in place", "wrapper"])
def test_a_compiled_guide_of_a_registered_class_is_watched(form):
    # review: a guide class with a registered adapter that is no AutoGuide was skipped inside
    # compiled code, and its wrapper was taken as passive after a compiled network's
    from pyro_quadvi import QNVB
    from pyro_quadvi.guides.interface import live_guides, register_adapter, run_rows

    class RegisteredGuide(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(x)

    QNVB()  # installs the watch
    register_adapter(RegisteredGuide)(lambda guide, trace: None)
    torch._dynamo.reset()
    network = torch.compile(nn.Linear(2, 1), backend="eager")
    network(torch.randn(3, 2))  # a compiled network first
    guide = RegisteredGuide()
    if form == "in place":
        guide.compile(backend="eager")
        run = guide
    else:
        run = torch.compile(guide, backend="eager")
    run(torch.randn(3, 2))
    watched = list(live_guides())
    assert sum(g is guide for g in watched) == 1  # not its torch.compile wrapper too
    assert all(type(g) is not type(run) for g in watched if run is not guide)
    assert run_rows(guide) == 3.0
    torch._dynamo.reset()
