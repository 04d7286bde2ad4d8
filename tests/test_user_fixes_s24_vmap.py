"""Session 24: nets that ``torch.func.vmap`` refuses, under ``vectorize=None``.

A ``BayesianModule`` with an old-style ``torch.autograd.Function`` (no ``setup_context``), an
in-place masked assignment ``h[mask] = ...`` (``index_put_``), ``F.dropout(x, p)`` or
``scaled_dot_product_attention(..., dropout_p=0.5)`` (a random operation) raised vmap's error
under ``QuadratureELBO(vectorize=None)`` instead of falling back to the loop, while
``QNVBOptimizer``'s one pass fell back on any message that named vmap. Both now use one
predicate, ``is_vmap_refusal``.
"""

from __future__ import annotations

import re
import warnings

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer.batched import BatchMismatch, is_broadcast_error, is_vmap_refusal
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss

DTYPE = torch.float64
X = torch.linspace(-1.0, 1.0, 10, dtype=DTYPE).reshape(5, 2)
Y = torch.tensor([0.1, -0.3, 0.4, 0.0, 0.2], dtype=DTYPE)


class _OldRelu(torch.autograd.Function):
    """An old-style Function: forward takes ctx, no setup_context, no vmap rule."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


class _Net(nn.Module):
    def __init__(self, hidden: str) -> None:
        super().__init__()
        self.hidden = hidden
        self.a = nn.Linear(2, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden == "autograd.Function":
            h = _OldRelu.apply(self.a(x))
        elif self.hidden == "masked assignment":
            h = torch.zeros(x.shape[0], 4, dtype=x.dtype)
            mask = x[:, 0] > 0
            h[mask] = self.a(x[mask])  # index_put_ of batched values into an unbatched h
        elif self.hidden == "F.dropout":
            h = F.dropout(self.a(x), 0.5)  # training defaults to True: on in eval mode too
        elif self.hidden == "sdpa dropout_p":
            q = self.a(x).unsqueeze(0)
            h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)[0]
        elif self.hidden == "error":
            raise RuntimeError("solver diverged")  # the net's own error
        else:
            h = torch.tanh(self.a(x))
        return self.b(h)


REFUSALS = {
    "autograd.Function": "must override the setup_context",
    "masked assignment": r"index_put_\(self, \*extra_args\) is not possible",
    "F.dropout": "random operation",
    "sdpa dropout_p": "random operation",
}


def _fit(hidden: str, vectorize: bool | None) -> tuple[list[float], list[str], torch.Tensor]:
    """Three SVI steps from one seed: the losses, the warnings, the guide's locs."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = BayesianModule(_Net(hidden).double(), priors.Normal(1.0), likelihoods.Gaussian(5, 0.3))
    guide = AutoMeanFieldNormal(bnn)
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO("hadamard", vectorize=vectorize))
    torch.manual_seed(1)  # the dropout masks of the loop
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        losses = [svi.step(X, Y) for _ in range(3)]
    locs = torch.cat([p.detach().reshape(-1) for p in guide.parameters()])
    return losses, [str(w.message) for w in record], locs


@pytest.mark.parametrize("hidden", REFUSALS)
def test_a_net_vmap_refuses_falls_back_to_the_loop_under_vectorize_none(hidden):
    losses, messages, locs = _fit(hidden, None)
    looped, quiet, looped_locs = _fit(hidden, False)
    assert quiet == []
    assert losses == looped  # the same loop, bit for bit (the tried pass drew no mask)
    assert torch.equal(locs, looped_locs)
    (message,) = messages  # one warning, with vmap's reason and the way out
    assert re.search(REFUSALS[hidden], message)
    assert "QuadratureELBO: the model does not evaluate all 4 points" in message
    assert "the network _Net cannot run 4 weight draws or nodes" in message
    assert "Pass vectorize=False to skip the vectorized pass" in message
    # only dropout that eval mode leaves on is named as such
    assert ("every evaluation gets its own dropout mask" in message) == ("dropout" in hidden)


def test_a_genuine_error_of_the_net_still_raises_under_vectorize_none():
    # raised by the one pass as it is: not taken for a refusal, no loop tried after it
    calls = []
    bnn = BayesianModule(_Net("plain").double(), priors.Normal(1.0), likelihoods.Gaussian(5, 0.3))
    guide = AutoMeanFieldNormal(bnn)
    guide(X, Y)
    bnn.net.hidden = "error"
    bnn.net.register_forward_pre_hook(lambda *_: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        with pytest.raises(RuntimeError, match=r"^solver diverged\n"):
            QuadratureELBO("hadamard", vectorize=None).loss(bnn, guide, X, Y)
    assert calls == [1]  # the pass only


def _refusal(hidden: str) -> BaseException:
    torch.manual_seed(0)
    net = _Net(hidden).double().eval()
    params = {name: p.detach().expand(3, *p.shape) for name, p in net.named_parameters()}
    try:
        torch.func.vmap(lambda w: torch.func.functional_call(net, w, (X,)))(params)
    except RuntimeError as error:
        return error
    raise AssertionError("vmap ran")


@pytest.mark.parametrize("hidden", REFUSALS)
def test_one_predicate_recognises_each_refusal(hidden):
    error = _refusal(hidden)
    assert is_vmap_refusal(error) and is_broadcast_error(error), str(error)


def test_the_net_s_own_error_is_no_refusal():
    error = _refusal("error")
    assert str(error) == "solver diverged"
    assert not is_vmap_refusal(error) and not is_broadcast_error(error)
    # not even when its message names vmap (QNVBOptimizer's one pass took any such message)
    assert not is_vmap_refusal(RuntimeError("vmap of my solver diverged"))


@pytest.mark.parametrize("hidden", REFUSALS)
def test_qnvb_optimizer_s_one_pass_falls_back_for_the_same_nets(hidden):
    def run(vectorize):
        torch.manual_seed(0)
        net = _Net(hidden).double().eval()
        optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=5)
        loss_fn = module_loss(net, lambda out, y: F.mse_loss(out.squeeze(-1), y))
        torch.manual_seed(1)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            losses = [optimizer.step(loss_fn=loss_fn, batch=(X, Y), vectorize=vectorize)]
        return losses, [str(w.message) for w in record if "QNVBOptimizer" in str(w.message)]

    losses, (message,) = run(None)
    looped, quiet = run(False)
    assert quiet == [] and losses == looped
    assert re.search(REFUSALS[hidden], message)
    with pytest.raises(BatchMismatch, match=r"loss_fn does not run under torch\.func\.vmap"):
        run(True)


def test_qnvb_optimizer_passes_on_a_loss_s_own_error_that_names_vmap():
    # any RuntimeError naming vmap was taken for a refusal of the one pass: under
    # vectorize=True the loss's own error became "loss_fn does not run under torch.func.vmap
    # ... pass vectorize=False", advice that fails the same way
    torch.manual_seed(0)
    net = nn.Linear(2, 1).double()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=5)

    def loss_fn(params, x, y):
        raise RuntimeError("my solver (a vmap over the rows) diverged")

    for vectorize in (True, None, False):
        with pytest.raises(RuntimeError, match=r"^my solver \(a vmap over the rows\) diverged$"):
            optimizer.step(loss_fn=loss_fn, batch=(X, Y), vectorize=vectorize)
    assert optimizer.num_steps == 0
    assert torch.equal(net.weight, optimizer.state[net.weight]["mu"])  # back at the mean


def _slice_assignment(w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(5, dtype=w.dtype)
    out[:] = w  # a batched value into an unbatched tensor: "inplace arithmetic"
    return out


# vmap's refusals that the predicate missed (QNVBOptimizer's one pass took them for any message
# naming vmap before, then raised them): each runs one point at a time
OTHER_REFUSALS = {
    "slice assignment": (_slice_assignment, r"^vmap: inplace arithmetic\(self, \*extra_args\)"),
    "copy_": (lambda w: torch.zeros(5, dtype=w.dtype).copy_(w), r"^vmap: inplace arithmetic"),
    "masked_select": (lambda w: torch.masked_select(w, w > 0), r"^vmap: Attempted to vmap over"),
    "allclose": (lambda w: w * torch.allclose(w, w + 1), r"^vmap over torch\.allclose isn't"),
    "one_hot": (lambda w: F.one_hot((w > 0).long()), r"^When vmap-ing torch\.nn\.functional"),
    ".data": (lambda w: w.data * 2, r"^accessing `data` under vmap transform"),
    "clone(memory_format)": (
        lambda w: w.reshape(1, 5, 1, 1).clone(memory_format=torch.channels_last),
        r"^NYI: Tensor\.clone\(memory_format\) inside vmap",
    ),
}


@pytest.mark.parametrize("operation", OTHER_REFUSALS)
def test_the_predicate_recognises_vmap_s_other_refusals(operation):
    function, message = OTHER_REFUSALS[operation]
    function(torch.ones(5, dtype=DTYPE))  # one point at a time it runs
    with pytest.raises(RuntimeError, match=message) as caught:
        torch.func.vmap(function)(torch.ones(3, 5, dtype=DTYPE))
    assert is_vmap_refusal(caught.value) and is_broadcast_error(caught.value)


def test_qnvb_optimizer_s_one_pass_falls_back_for_a_slice_assignment():
    # out[:] = net(x): vmap's "inplace arithmetic" refusal, raised by the one pass under
    # vectorize=None after its list replaced "any message naming vmap"
    def run(vectorize):
        torch.manual_seed(0)
        net = nn.Linear(2, 1).double()
        optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=5)

        def loss_fn(params, x, y):
            out = torch.zeros(len(y), dtype=y.dtype)
            out[:] = torch.func.functional_call(net, params, (x,)).squeeze(-1)
            return F.mse_loss(out, y)

        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            loss = optimizer.step(loss_fn=loss_fn, batch=(X, Y), vectorize=vectorize)
        return loss, [str(w.message) for w in record], net.weight.detach().clone()

    loss, (message,), weight = run(None)
    looped, quiet, looped_weight = run(False)
    assert quiet == [] and loss == looped and torch.equal(weight, looped_weight)
    assert "vmap: inplace arithmetic(self, *extra_args) is not possible" in message
