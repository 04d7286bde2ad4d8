"""Session 26 (user trial t20): the blocked rule's nodes do not depend on torch's default dtype,
and the optimizers refuse a step under ``torch.inference_mode()`` / ``torch.no_grad()`` that
would fail with torch's bare error or change nothing, naming the mode and the fix."""

import contextlib
import copy
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.util import zero_grads

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributed import NodeParallelQNVBOptimizer
from pyro_quadvi.infer.quadrature_elbo import inference_parameters_refusal
from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer
from pyro_quadvi.quadrature import make_rule

S = 0.3660254037844386  # the simplex offsets of blocked_simplex 3: 1 + S, -1, -S


def _blocked_nodes(default: torch.dtype, **options) -> torch.Tensor:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        rule = make_rule("blocked_simplex", **options)
        generator = torch.Generator().manual_seed(0)
        return rule.nodes(7, step=3, generator=generator, dtype=torch.float32)[0]
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize(
    "options", [{}, {"random_signs": True}, {"num_points": 8}], ids=["K3", "signed", "K8"]
)
def test_the_blocked_rules_nodes_do_not_depend_on_the_default_dtype(options):
    # a float64 default drew its random keys in float64: other nodes from the same generator
    # state (an all-float32 1-20-1 fit started at 2014.42 against 1645.11)
    assert torch.equal(
        _blocked_nodes(torch.float64, **options), _blocked_nodes(torch.float32, **options)
    )


def test_the_blocked_rules_nodes_under_the_float32_default_are_those_measured():
    # the keys are drawn in float32, the default every benchmark and docs figure was measured under
    first = torch.tensor([-1, -1, 1 + S, -S, -1, -1, -S], dtype=torch.float32)
    torch.testing.assert_close(_blocked_nodes(torch.float32)[0], first, rtol=0, atol=1e-7)
    signed = torch.tensor([1, 1, 1 + S, -S, 1, 1, S], dtype=torch.float32)
    nodes = _blocked_nodes(torch.float32, random_signs=True)
    torch.testing.assert_close(nodes[0], signed, rtol=0, atol=1e-7)


# --- the plain-torch optimizers under torch.inference_mode() (t20, s7_torch.py) ---------------

INFERENCE_REFUSAL = (
    "{owner}.step was called under torch.inference_mode(): the step needs the loss's gradient at "
    "every quadrature node, and inference mode turns gradients off for good (the step turns them "
    "on under torch.no_grad() or torch.set_grad_enabled(False), which are fine around it). Take "
    "the step outside inference_mode; predict inside it. Nothing was evaluated or changed by "
    "this step"
)


def _regression():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, generator=generator)
    y = x @ torch.tensor([1.0, -0.5, 0.25]) + 0.1 * torch.randn(16, generator=generator)
    weight = torch.zeros(3, requires_grad=True)
    return x, y, weight


def _optimizer(kind: str, weight: torch.Tensor):
    generator = torch.Generator().manual_seed(3)
    if kind == "sparse":
        return SparseQNVBOptimizer([weight], num_cases=16, steps_per_epoch=1, generator=generator)
    cls = NodeParallelQNVBOptimizer if kind == "node-parallel" else QNVBOptimizer
    return cls([weight], likelihood_weight=16, generator=generator)


def _closure(optimizer, x, y, weight):
    def closure():
        optimizer.zero_grad()
        loss = 0.5 * ((y - x @ weight) ** 2).mean()
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("kind", ["qnvb", "sparse", "node-parallel"])
def test_a_torch_optimizers_step_under_inference_mode_is_refused_before_anything_changes(kind):
    x, y, weight = _regression()
    optimizer = _optimizer(kind, weight)
    optimizer.step(_closure(optimizer, x, y, weight))
    before = (weight.detach().clone(), copy.deepcopy(optimizer.state_dict()))
    generator_state = optimizer.generator.get_state()
    owner = type(optimizer).__name__
    with torch.inference_mode(), pytest.raises(RuntimeError) as info:
        optimizer.step(_closure(optimizer, x, y, weight))
    assert str(info.value) == INFERENCE_REFUSAL.format(owner=owner)
    assert torch.equal(weight, before[0])
    assert str(optimizer.state_dict()) == str(before[1])
    assert torch.equal(optimizer.generator.get_state(), generator_state)


def test_the_one_pass_step_under_inference_mode_names_it_not_the_loss_fn():
    # it said "loss_fn must use the params it is given"; the refused step changed nothing, so
    # the next one is a fresh optimizer's first
    def loss_fn(params, x, y):
        return 0.5 * ((y - x @ params["w"]) ** 2).mean()

    losses = []
    for refused_first in (True, False):
        x, y, weight = _regression()
        optimizer = QNVBOptimizer(
            [("w", weight)], likelihood_weight=16, generator=torch.Generator().manual_seed(3)
        )
        if refused_first:
            with torch.inference_mode(), pytest.raises(RuntimeError) as info:
                optimizer.step(loss_fn=loss_fn, batch=(x, y))
            assert str(info.value) == INFERENCE_REFUSAL.format(owner="QNVBOptimizer")
        losses.append((optimizer.step(loss_fn=loss_fn, batch=(x, y)).item(), weight.clone()))
    assert losses[0][0] == losses[1][0] and torch.equal(losses[0][1], losses[1][1])


@pytest.mark.parametrize("kind", ["qnvb", "sparse", "node-parallel"])
@pytest.mark.parametrize("context", [torch.no_grad, lambda: torch.set_grad_enabled(False)])
def test_a_torch_optimizers_step_under_no_grad_is_taken_as_without_it(context, kind):
    # the message says so: the step turns gradients on itself
    results = []
    for wrapped in (False, True):
        x, y, weight = _regression()
        optimizer = _optimizer(kind, weight)
        for _ in range(3):
            with context() if wrapped else contextlib.nullcontext():
                loss = optimizer.step(_closure(optimizer, x, y, weight))
        results.append((loss.item(), weight.detach().clone()))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])
    assert results[0][1].abs().min() > 0  # the steps moved every weight from 0


# --- QNVB (Pyro) with Pyro's ELBOs: gradients off, a guide made under inference_mode ----------

Y = torch.tensor([0.5, 1.5, 1.0, 2.0])


def _model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("rows", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _no_grad_words(context) -> str:
    if context is torch.inference_mode:
        return "torch.inference_mode()"
    return "torch.no_grad() (or torch.set_grad_enabled(False))"


def _refusal(caller: str, words: str) -> str:
    return (
        f"{caller} was called under {words}: no gradient and no moments reach the optimizer, so "
        "the step would change nothing. Take the step outside it; for the loss alone call "
        "svi.evaluate_loss(*args) or elbo.loss(model, guide, *args)"
    )


def _set_grad_disabled():
    return torch.set_grad_enabled(False)


CONTEXTS = [torch.no_grad, _set_grad_disabled, torch.inference_mode]


@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO])
@pytest.mark.parametrize("context", CONTEXTS, ids=["no_grad", "set_grad_enabled", "inference"])
def test_qnvb_refuses_a_step_of_pyros_elbos_with_gradients_off(fresh_param_store, elbo, context):
    # 30 such steps left the guide bit-identical, silently; QuadratureELBO refused them
    guide = AutoMeanFieldNormal(_model)
    optim = QNVB()
    svi = SVI(_model, guide, optim, elbo())
    for _ in range(3):
        svi.step(Y)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with context(), pytest.raises(RuntimeError) as info:
        svi.step(Y)
    assert str(info.value) == _refusal("QNVB (svi.step)", _no_grad_words(context))
    after = dict(pyro.get_param_store().items())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert optim.num_steps == 3
    svi.step(Y)  # and steps on outside it
    assert not torch.equal(
        pyro.param("AutoMeanFieldNormal.locs.mu"), before["AutoMeanFieldNormal.locs.mu"]
    )


def test_qnvb_takes_gradients_computed_before_a_call_under_no_grad(fresh_param_store):
    # as a torch optimizer does: only a call that no gradient reached is refused
    locs = []
    for wrapped in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoMeanFieldNormal(_model)
        optim, elbo = QNVB(), Trace_ELBO()
        for _ in range(3):
            with poutine.trace(param_only=True) as capture:
                elbo.loss_and_grads(_model, guide, Y)
            params = {site["value"].unconstrained() for site in capture.trace.nodes.values()}
            with torch.no_grad() if wrapped else contextlib.nullcontext():
                optim(params)
            zero_grads(params)
        locs.append(pyro.param("AutoMeanFieldNormal.locs.mu").detach().clone())
    assert torch.equal(locs[0], locs[1]) and locs[0].item() > 0.5  # from 0 toward 1.25


def test_quadrature_elbo_names_set_grad_enabled_beside_no_grad(fresh_param_store):
    guide = AutoMeanFieldNormal(_model)
    svi = SVI(_model, guide, QNVB(), QuadratureELBO())
    with torch.set_grad_enabled(False), pytest.raises(RuntimeError) as info:
        svi.step(Y)
    words = "torch.no_grad() (or torch.set_grad_enabled(False))"
    assert str(info.value) == _refusal("QuadratureELBO.loss_and_grads (svi.step)", words)


def test_qnvb_with_trace_elbo_names_a_guide_made_under_inference_mode(fresh_param_store):
    # QNVB warned of a gradient on one of loc and scale, then torch failed: "Inplace update to
    # inference tensor outside InferenceMode"
    guide = AutoMeanFieldNormal(_model)
    with torch.inference_mode():
        SVI(_model, guide, QNVB(), QuadratureELBO()).evaluate_loss(Y)
    svi = SVI(_model, guide, QNVB(), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of a half gradient first
        with pytest.raises(RuntimeError) as info:
            svi.step(Y)
    names = ["AutoMeanFieldNormal.locs.mu", "AutoMeanFieldNormal.scales.mu"]
    assert str(info.value) == str(inference_parameters_refusal("QNVB", names))
    assert str(info.value).startswith(f"QNVB: the parameters {names} are inference tensors")
