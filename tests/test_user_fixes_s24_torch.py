"""Session 24, helper h1: the plain-torch optimizers (`QNVBOptimizer`, `SparseQNVBOptimizer`)
against a user's trial: ``torch.amp.GradScaler``, complex and duplicate parameters, an error in
the middle of a step, a closure whose loss misses the optimizer's tensors, sparse gradients, and a
learning rate set by hand in a `SparseQNVBOptimizer` group."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer, module_loss

X = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))
Y = X @ torch.tensor([1.0, -2.0, 0.5])


def make(kind: str, params):
    if kind == "qnvb":
        return QNVBOptimizer(params, likelihood_weight=32)
    return SparseQNVBOptimizer(params, num_cases=32, steps_per_epoch=4)


def closure_of(net: nn.Module):
    def closure():
        loss = F.mse_loss(net(X).squeeze(-1), Y)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_grad_scaler_step_is_refused_by_name_and_changes_nothing(kind):
    net = nn.Linear(3, 1)
    optimizer = make(kind, net.parameters())
    closure = closure_of(net)
    optimizer.step(closure)
    before = [p.detach().clone() for p in net.parameters()]
    steps = dict(vars(optimizer))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.mse_loss(net(X).squeeze(-1), Y)).backward()
    name = type(optimizer).__name__
    with pytest.raises(RuntimeError, match=rf"{name}.step was called by torch.amp.GradScaler") as e:
        scaler.step(optimizer, closure)
    assert "Drop the scaler" in str(e.value) and "dtype=torch.bfloat16" in str(e.value)
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)
    # the scaler's attributes are gone, the counters as they were, and a plain step goes on
    assert "grad_scale" not in vars(optimizer) and "found_inf" not in vars(optimizer)
    assert getattr(optimizer, "num_steps", None) == steps.get("num_steps")
    assert getattr(optimizer, "counters", None) == steps.get("counters")
    optimizer.step(closure)


def test_a_scaled_loss_in_the_closure_shrinks_sigma_by_the_root_of_the_scale():
    """What the docs say of a scaler used inside the closure (which no step can see): in a
    one-weight linear-Gaussian fit, sigma comes out 1 / sqrt(65536) = 1 / 256 of the exact
    1 / sqrt(sum x^2), the mean as exact."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100, dtype=torch.float64, generator=gen)
    y = 0.7 * x + torch.randn(100, dtype=torch.float64, generator=gen)
    exact = float((x**2).sum()) ** -0.5
    fits = []
    for scale in (1.0, 65536.0):
        w = torch.zeros((), dtype=torch.float64, requires_grad=True)
        optimizer = QNVBOptimizer([w], likelihood_weight=100, quadrature="hadamard")

        def closure(w=w, scale=scale):
            loss = 0.5 * ((y - w * x) ** 2).mean()
            (scale * loss).backward()
            return loss

        for _ in range(100):
            optimizer.step(closure)
        fits.append((float(optimizer.state[w]["sigma"]) / exact, float(w.detach())))
    assert fits[0][0] == pytest.approx(1.0, rel=1e-6)
    assert fits[1][0] == pytest.approx(1 / 256, rel=1e-6)
    assert fits[1][1] == pytest.approx(fits[0][1], rel=1e-9)


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_a_complex_parameter_is_refused_at_construction_by_position_shape_and_dtype(kind):
    real = nn.Parameter(torch.zeros(2))
    z = nn.Parameter(torch.zeros(4, 2, dtype=torch.complex64))
    name = type(make(kind, [real])).__name__
    with pytest.raises(
        ValueError, match=rf"{name}: parameter 1 of shape \(4, 2\) is torch.complex64"
    ):
        make(kind, [real, z])
    with pytest.raises(
        ValueError, match=r"parameter 1 \('z'\) of shape \(4, 2\) is torch.complex64"
    ):
        make(kind, [("real", real), ("z", z)])


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_an_error_in_the_update_leaves_the_parameters_at_their_means(kind):
    """A state tensor of the wrong shape, set by hand, fails in the update, after the nodes were
    evaluated: the parameters were left at the last node before."""
    net = nn.Linear(3, 1)
    optimizer = make(kind, net.parameters())
    closure = closure_of(net)
    optimizer.step(closure)
    means = [p.detach().clone() for p in net.parameters()]
    optimizer.state[net.weight]["h_avg" if kind == "qnvb" else "h0"] = torch.zeros(5)
    with pytest.raises((ValueError, RuntimeError), match="5"):
        optimizer.step(closure)
    for p, mean in zip(net.parameters(), means):
        assert torch.equal(p, mean) and p.grad is None


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_an_error_in_the_closure_at_the_second_node_leaves_the_parameters_at_their_means(kind):
    net = nn.Linear(3, 1)
    optimizer = make(kind, net.parameters())
    optimizer.step(closure_of(net))
    means = [p.detach().clone() for p in net.parameters()]
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("node 2")
        return closure_of(net)()

    with pytest.raises(KeyError, match="node 2"):
        optimizer.step(failing)
    assert len(calls) == 2
    for p, mean in zip(net.parameters(), means):
        assert torch.equal(p, mean) and p.grad is None


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_a_parameter_given_twice_is_refused_at_construction_naming_both_positions(kind):
    net = nn.Linear(3, 1)
    w, b = net.weight, net.bias
    name = type(make(kind, [w])).__name__
    with pytest.raises(
        ValueError,
        match=rf"{name}: parameter 0 and parameter 2 are the same tensor \(shape \(1, 3\)\)",
    ):
        make(kind, [w, b, w])
    with pytest.raises(ValueError, match=r"parameter 1 \('b'\) and parameter 2 \('b2'\)"):
        make(kind, [("w", w), ("b", b), ("b2", b)])
    # in another group, as torch refuses it
    optimizer = make(kind, [w])
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_param_group({"params": [w]})
    assert len(optimizer.param_groups) == 1


def test_a_closure_over_other_tensors_than_the_optimizers_says_the_module_was_moved():
    """The optimizer built before the net went from the meta device to the CPU (``to_empty``
    makes new tensors), and a copy of the optimizer stepped with the original net: the message
    says which tensors got no gradient and why that may be."""
    with torch.device("meta"):
        net = nn.Linear(3, 1)
    optimizer = QNVBOptimizer(net.parameters())
    net.to_empty(device="cpu")
    net.reset_parameters()
    moved = (
        r"QNVBOptimizer: none of the 2 parameters this optimizer holds received a gradient\. .*"
        r"did you rebuild or move the module after creating the optimizer \(net\.to_empty\(\)"
    )
    with pytest.raises(RuntimeError, match=moved):
        optimizer.step(closure_of(net))
    net = nn.Linear(3, 1)
    optimizer = SparseQNVBOptimizer(net.parameters(), num_cases=32, steps_per_epoch=4)
    with pytest.raises(RuntimeError, match=r"none of the 2 .* a copy\.deepcopy of the optimizer"):
        copy.deepcopy(optimizer).step(closure_of(net))


def embedding_net(sparse: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Flatten(), nn.Linear(8, 1)).double()


IDX = torch.randint(0, 10, (16, 2), generator=torch.Generator().manual_seed(0))
T = torch.randn(16, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("vectorize", [None, True, False])
def test_the_one_pass_step_refuses_sparse_gradients_by_name(vectorize):
    net = embedding_net(sparse=True)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer = QNVBOptimizer(net.named_parameters())
    with pytest.raises(
        RuntimeError,
        match=r"QNVBOptimizer: the one-pass backward failed on a sparse gradient \(.*\): .*"
        r"nn\.Embedding\(\.\.\., sparse=False\).* step\(closure\), which takes sparse gradients",
    ):
        optimizer.step(loss_fn=module_loss(net, F.mse_loss), batch=(IDX, T), vectorize=vectorize)
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)
    assert optimizer.num_steps == 0


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_the_closure_form_takes_sparse_gradients_as_dense_ones(kind):
    """nn.Embedding(sparse=True) with a closure: three float64 steps equal the dense layer's."""
    fits = []
    for sparse in (True, False):
        net = embedding_net(sparse)
        if kind == "qnvb":
            optimizer = QNVBOptimizer(net.parameters(), likelihood_weight=16, quadrature="hadamard")
        else:
            optimizer = SparseQNVBOptimizer(net.parameters(), num_cases=16, steps_per_epoch=1)

        def closure(net=net):
            loss = F.mse_loss(net(IDX), T)
            loss.backward()
            return loss

        for _ in range(3):
            optimizer.step(closure)
        fits.append(
            [optimizer.state[p]["sigma"] for p in net.parameters()] + list(net.parameters())
        )
    assert fits[0][0].shape == (10, 4)
    for a, b in zip(*fits):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_learning_rate_set_by_hand_in_a_sparse_group_is_refused_not_ignored():
    """The step ignored it before (the weights moved as much under a hand-set lr of 0)."""
    net = nn.Linear(3, 1)
    optimizer = SparseQNVBOptimizer(net.parameters(), num_cases=32, steps_per_epoch=4)
    closure = closure_of(net)
    optimizer.step(closure)
    before = [p.detach().clone() for p in net.parameters()]
    counters = optimizer.counters
    optimizer.param_groups[0]["lr"] = 0.0
    with pytest.raises(
        ValueError,
        match=r"SparseQNVBOptimizer: parameter group 0 holds \['lr'\], set after it was added, "
        r"which this optimizer does not read: .*\(del optimizer.param_groups\[0\]\['lr'\]\)",
    ):
        optimizer.step(closure)
    assert optimizer.counters == counters
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)
    del optimizer.param_groups[0]["lr"]
    optimizer.step(closure)
    assert optimizer.counters.step == 2


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_grad_scaler_step_without_a_closure_is_refused_and_leaves_no_attribute(kind):
    # scaler.step(optimizer) as in torch's AMP recipe: SparseQNVBOptimizer.step, whose closure
    # had no default, raised a TypeError of a missing argument and left the scaler's
    # grad_scale and found_inf on the optimizer, so that every later plain step was refused
    # as called by the scaler
    net = nn.Linear(3, 1)
    optimizer = make(kind, net.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.mse_loss(net(X).squeeze(-1), Y)).backward()
    name = type(optimizer).__name__
    with pytest.raises(RuntimeError, match=rf"^{name}.step was called by torch.amp.GradScaler"):
        scaler.step(optimizer)
    assert "grad_scale" not in vars(optimizer) and "found_inf" not in vars(optimizer)
    optimizer.zero_grad()
    assert torch.isfinite(optimizer.step(closure_of(net)))
    with pytest.raises(
        TypeError, match=rf"^{name}.step takes (either )?a closure \(step\(closure\)\)"
    ):
        optimizer.step()


def test_keys_left_by_a_refused_scheduler_are_named_with_a_deletion_of_each():
    # OneCycleLR writes initial_lr, max_lr and min_lr into the group before it reads the
    # missing 'lr'; the step's refusal told to delete the first key only
    net = nn.Linear(3, 1)
    optimizer = make("sparse", net.parameters())
    with pytest.raises(KeyError, match="hold no 'lr'"):
        torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=4, cycle_momentum=False)
    keys = ["initial_lr", "max_lr", "min_lr"]
    fix = f"for key in {keys}: del optimizer.param_groups[0][key]"
    with pytest.raises(
        ValueError, match=r"group 0 holds \['initial_lr', 'max_lr', 'min_lr'\]"
    ) as e:
        optimizer.step(closure_of(net))
    assert f"Delete them ({fix})" in str(e.value)
    exec(fix, {"optimizer": optimizer})  # what the message says, as written
    assert torch.isfinite(optimizer.step(closure_of(net)))


@pytest.mark.parametrize("vectorize", [True, False])
def test_the_one_pass_step_keeps_a_module_used_twice_and_equals_the_closure_form(vectorize):
    # review r3: torch's functional_call(tie_weights=True) swaps a module used at two paths in
    # twice and leaves the given tensor in it (pytorch#164759): after one step of
    # module_loss the shared Linear held a plain tensor and dropped out of named_parameters()
    torch.manual_seed(0)
    shared = nn.Linear(3, 3).double()
    net = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(3, 1).double())
    twin = copy.deepcopy(net)
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    names = [name for name, _ in net.named_parameters()]
    one_pass = QNVBOptimizer(net.named_parameters(), quadrature="hadamard")
    loop = QNVBOptimizer(twin.parameters(), quadrature="hadamard")

    def closure():
        loss = F.mse_loss(twin(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        one_pass.step(loss_fn=module_loss(net, F.mse_loss), batch=(x, y), vectorize=vectorize)
        loop.step(closure)
    assert [name for name, _ in net.named_parameters()] == names
    assert type(net[0].weight) is nn.Parameter and net[2] is net[0]
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
