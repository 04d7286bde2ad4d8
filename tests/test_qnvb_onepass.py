"""``QNVBOptimizer.step(loss_fn=..., batch=...)``: all quadrature nodes in one vectorized pass."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyro_quadvi.infer.batched import BatchMismatch
from pyro_quadvi.optim import QNVBOptimizer, module_loss

DTYPE = torch.float64


def _problem(seed=0, n=32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator, dtype=DTYPE)
    y = torch.sin(2 * x[:, :1]) + 0.1 * torch.randn(n, 1, generator=generator, dtype=DTYPE)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    return net, x, y


def _optimizer(net, quadrature="hadamard", num_eval=4, seed=3, **kwargs):
    return QNVBOptimizer(
        net.named_parameters(),
        likelihood_weight=32,
        prior_precision=1.0,
        quadrature=quadrature,
        num_eval=num_eval,
        init_sigma=0.05,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )


def _closure(net, x, y):
    def closure():
        loss = F.mse_loss(net(x), y)
        loss.backward()
        return loss

    return closure


def _snapshot(optimizer):
    return {
        key: torch.cat([optimizer.state[p][key].reshape(-1) for p in group["params"]])
        for group in optimizer.param_groups
        for key in ("mu", "sigma", "s_avg", "h_avg", "damping", "curvature_count")
    }


@pytest.mark.parametrize("quadrature, num_eval", [("hadamard", 4), ("rasp_simplex", None)])
def test_one_pass_steps_equal_the_closure_loop_to_rounding(quadrature, num_eval):
    net_a, x, y = _problem()
    net_b = copy.deepcopy(net_a)
    start = torch.cat([p.detach().reshape(-1) for p in net_a.parameters()])
    opt_a = _optimizer(net_a, quadrature, num_eval)
    opt_b = _optimizer(net_b, quadrature, num_eval)
    loss_fn = module_loss(net_b, F.mse_loss)
    for _ in range(8):
        loss_a = opt_a.step(_closure(net_a, x, y))
        loss_b = opt_b.step(loss_fn=loss_fn, batch=(x, y))
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=0)
    a, b = _snapshot(opt_a), _snapshot(opt_b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-9, atol=1e-12, msg=key)
    # the means moved (the comparison is not of two unchanged states) and sit in the parameters
    assert (a["mu"] - start).abs().max() > 0.1
    for p_a, p_b in zip(net_a.parameters(), net_b.parameters()):
        torch.testing.assert_close(p_b, p_a, rtol=1e-9, atol=1e-12)
        assert p_b.grad is None


def test_the_means_move_and_the_parameters_hold_them():
    net, x, y = _problem()
    start = [p.detach().clone() for p in net.parameters()]
    optimizer = _optimizer(net)
    with torch.no_grad():
        first = F.mse_loss(net(x), y)
    for _ in range(20):
        optimizer.step(loss_fn=module_loss(net, F.mse_loss), batch=(x, y))
    with torch.no_grad():
        last = F.mse_loss(net(x), y)  # the fit at the mean
    assert float(last) < 0.6 * float(first), (float(first), float(last))
    for p, p0 in zip(net.parameters(), start):
        assert not torch.equal(p, p0)
        assert torch.equal(p.detach(), optimizer.state[p]["mu"])


def test_vectorize_true_false_and_none_agree():
    losses, states = [], []
    for vectorize in (True, False, None):
        net, x, y = _problem()
        optimizer = _optimizer(net)
        loss_fn = module_loss(net, F.mse_loss)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # None decides on the pass without a warning
            losses.append(
                [
                    optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=vectorize)
                    for _ in range(4)
                ]
            )
        states.append(_snapshot(optimizer))
    for other_losses, other in zip(losses[1:], states[1:]):
        torch.testing.assert_close(
            torch.stack(other_losses), torch.stack(losses[0]), rtol=1e-12, atol=0
        )
        for key in other:
            torch.testing.assert_close(other[key], states[0][key], rtol=1e-10, atol=1e-14)


def _unbatchable_loss(net):
    def loss_fn(params, x, y):
        out = torch.func.functional_call(net, params, (x,))
        if params["2.bias"].sum() > 100:  # data-dependent control flow: not under vmap
            out = out * 2
        return F.mse_loss(out, y)

    return loss_fn


def test_a_loss_that_cannot_run_under_vmap_falls_back_under_none_and_errors_under_true():
    net, x, y = _problem()
    reference = copy.deepcopy(net)
    loss_fn = _unbatchable_loss(net)
    optimizer = _optimizer(net)
    with pytest.warns(UserWarning, match="evaluating them one by one"):
        optimizer.step(loss_fn=loss_fn, batch=(x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: the second step loops without a warning
        optimizer.step(loss_fn=loss_fn, batch=(x, y))
    looped = _optimizer(reference)
    for _ in range(2):
        looped.step(loss_fn=module_loss(reference, F.mse_loss), batch=(x, y), vectorize=False)
    for key, value in _snapshot(looped).items():
        torch.testing.assert_close(_snapshot(optimizer)[key], value, rtol=1e-12, atol=0)

    net, x, y = _problem()
    optimizer = _optimizer(net)
    with pytest.raises(
        BatchMismatch, match=r"does not run under torch\.func\.vmap.*vectorize=False"
    ):
        optimizer.step(loss_fn=_unbatchable_loss(net), batch=(x, y), vectorize=True)
    assert optimizer.num_steps == 0  # nothing moved: the means are the parameters
    mu = torch.cat([optimizer.state[p]["mu"].reshape(-1) for p in net.parameters()])
    assert torch.equal(mu, torch.cat([p.detach().reshape(-1) for p in net.parameters()]))


def test_state_dict_round_trip_continues_the_one_pass_run_bit_for_bit():
    net, x, y = _problem()
    optimizer = _optimizer(net, quadrature="rasp_simplex", num_eval=None)
    loss_fn = module_loss(net, F.mse_loss)
    for _ in range(3):
        optimizer.step(loss_fn=loss_fn, batch=(x, y))
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved_net = copy.deepcopy(net.state_dict())
    for _ in range(4):
        optimizer.step(loss_fn=loss_fn, batch=(x, y))
    expected = _snapshot(optimizer)

    net2, _, _ = _problem(seed=5)
    net2.load_state_dict(saved_net)
    restored = _optimizer(net2, quadrature="rasp_simplex", num_eval=None, seed=99)
    restored.load_state_dict(saved_state)
    loss_fn2 = module_loss(net2, F.mse_loss)
    for _ in range(4):
        restored.step(loss_fn=loss_fn2, batch=(x, y))
    got = _snapshot(restored)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_an_unused_parameter_takes_a_zero_data_term_as_with_a_closure():
    """A parameter the loss does not read (no gradient) is stepped on the prior alone, the same
    in both forms: its curvature average holds zeros and its mean moves towards the prior's 0
    (before session 25 the step skipped it, its state untouched)."""
    net, x, y = _problem()
    looped = copy.deepcopy(net)
    optimizer, reference = _optimizer(net), _optimizer(looped)

    def loss_fn(params, x, y):  # the last layer's bias is left out of the loss
        hidden = torch.tanh(x @ params["0.weight"].T + params["0.bias"])
        return F.mse_loss(hidden @ params["2.weight"].T, y)

    def closure():
        loss = F.mse_loss(torch.tanh(looped[0](x)) @ looped[2].weight.T, y)
        loss.backward()
        return loss

    bias = net[2].bias.item()
    for _ in range(3):
        optimizer.step(loss_fn=loss_fn, batch=(x, y))
        reference.step(closure)
    state, expected = optimizer.state[net[2].bias], reference.state[looped[2].bias]
    assert float(state["count"]) == 3.0 and float(state["h_avg"]) == 0.0
    assert 0 < float(state["mu"]) / bias < 1  # towards the prior mean
    for key in ("mu", "sigma", "h_avg", "count"):
        torch.testing.assert_close(state[key], expected[key], rtol=1e-12, atol=0)


def test_wrong_calls_are_refused_clearly():
    net, x, y = _problem()
    optimizer = _optimizer(net)
    loss_fn = module_loss(net, F.mse_loss)
    with pytest.raises(TypeError, match="exactly one of them"):
        optimizer.step(_closure(net, x, y), loss_fn=loss_fn, batch=(x, y))
    with pytest.raises(TypeError, match="exactly one of them"):
        optimizer.step()
    for extra in ({"batch": (x, y)}, {"vectorize": False}):
        with pytest.raises(TypeError, match="belong to the one-pass form"):
            optimizer.step(_closure(net, x, y), **extra)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        optimizer.step(loss_fn=3.0, batch=(x, y))
    with pytest.raises(ValueError, match="vectorize must be True, False or None"):
        optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize="yes")
    with pytest.raises(TypeError, match="loss_fn must return the scalar loss"):
        optimizer.step(
            loss_fn=lambda p, x, y: F.mse_loss(
                torch.func.functional_call(net, p, (x,)), y, reduction="none"
            ),
            batch=(x, y),
            vectorize=False,
        )
    unnamed = QNVBOptimizer(net.parameters())
    with pytest.raises(ValueError, match=r"build the optimizer from net\.named_parameters"):
        unnamed.step(loss_fn=loss_fn, batch=(x, y))
    with pytest.raises(RuntimeError, match="does not depend on any parameter"):
        optimizer.step(loss_fn=lambda p, x, y: (y**2).mean(), batch=(x, y), vectorize=False)
    assert optimizer.num_steps == 0


@pytest.mark.slow
def test_the_compiled_update_follows_the_eager_one_pass_run_to_rounding():
    net_a, x, y = _problem()
    net_b = copy.deepcopy(net_a)
    eager, compiled = _optimizer(net_a), _optimizer(net_b, compile=True)
    for _ in range(5):
        eager.step(loss_fn=module_loss(net_a, F.mse_loss), batch=(x, y))
        compiled.step(loss_fn=module_loss(net_b, F.mse_loss), batch=(x, y))
    a, b = _snapshot(eager), _snapshot(compiled)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-12, atol=1e-14, msg=key)
