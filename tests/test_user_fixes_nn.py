"""Fixes of what a trial reader found in ``pyro_quadvi.nn``: attention layers under ``vmap``,
chunked ``predict``, a custom likelihood, and the messages of misuse."""

from __future__ import annotations

import copy

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer.batched import vmap_safe_attention
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss

# -- 1. attention layers in a vectorized pass ---------------------------------------------------


class _Encoder(nn.Module):
    """Tokens -> a TransformerEncoderLayer -> mean over positions -> two logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens):
        return self.out(self.enc(self.emb(tokens)).mean(1))


class _Attention(nn.Module):
    """Features -> self-attention (nn.MultiheadAttention) -> mean over positions -> two logits."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.att(x, x, x, need_weights=False)[0].mean(1))


def _attention_problem(kind):
    torch.manual_seed(0)
    if kind == "transformer":
        net, x = _Encoder(), torch.randint(0, 7, (6, 5))
    else:
        net, x = _Attention(), torch.randn(6, 5, 4)
    return net, x, torch.randint(0, 2, (6,))


@pytest.fixture(params=[True, False], ids=["fastpath-on", "fastpath-off"])
def fastpath(request):
    """Runs the test with the global fast-path flag set to each value, and checks that the test
    left it as it found it."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(request.param)
    try:
        yield request.param
        assert torch.backends.mha.get_fastpath_enabled() is request.param
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _elbo_loss_and_grads(bnn, guide, x, y, vectorize):
    pyro.set_rng_seed(5)
    for p in guide.parameters():
        p.grad = None
    loss = QuadratureELBO(vectorize=vectorize).differentiable_loss(bnn, guide, x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in guide.parameters()]


@pytest.mark.parametrize("kind", ["transformer", "attention"])
def test_attention_nets_run_the_vectorized_elbo_as_the_loop(kind, fastpath):
    pyro.clear_param_store()
    net, x, y = _attention_problem(kind)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(30))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(x, y)
    loss_v, grads_v = _elbo_loss_and_grads(bnn, guide, x, y, True)
    loss_l, grads_l = _elbo_loss_and_grads(bnn, guide, x, y, False)
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=0)
    assert len(grads_v) == len(grads_l) > 0
    for g_v, g_l in zip(grads_v, grads_l):
        torch.testing.assert_close(g_v, g_l, rtol=1e-5, atol=1e-5 * g_l.abs().max().item())
    # one QNVB step through SVI's vectorized pass moves the guide
    locs = [p.detach().clone() for p in guide.parameters()]
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO(vectorize=True))
    assert torch.isfinite(torch.tensor(svi.step(x, y)))
    assert any(not torch.equal(p, q) for p, q in zip(guide.parameters(), locs))


@pytest.mark.parametrize("kind", ["transformer", "attention"])
def test_attention_nets_run_the_optimizer_vectorized_as_the_loop(kind, fastpath):
    net, x, y = _attention_problem(kind)
    net = net.double().eval()  # eval: no dropout, and the mode in which the fast path is taken
    x = x if kind == "transformer" else x.double()
    runs = []
    for vectorize in (True, False):
        copy_ = copy.deepcopy(net)
        optimizer = QNVBOptimizer(
            copy_.named_parameters(),
            likelihood_weight=6,
            quadrature="hadamard",
            init_sigma=0.05,
            generator=torch.Generator().manual_seed(3),
        )
        loss = optimizer.step(
            loss_fn=module_loss(copy_, F.cross_entropy), batch=(x, y), vectorize=vectorize
        )
        runs.append((loss, [p.detach().clone() for p in copy_.parameters()]))
    (loss_v, params_v), (loss_l, params_l) = runs
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=0)
    moved = False
    for p_v, p_l, p0 in zip(params_v, params_l, net.parameters()):
        torch.testing.assert_close(p_v, p_l, rtol=1e-5, atol=1e-8)
        moved = moved or not torch.equal(p_l, p0.detach())
    assert moved


@pytest.mark.parametrize("before", [True, False])
def test_the_fast_path_flag_is_restored_after_an_error(before):
    saved = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(before)
    try:
        with pytest.raises(ZeroDivisionError), vmap_safe_attention():
            assert torch.backends.mha.get_fastpath_enabled() is False
            raise ZeroDivisionError("inside the pass")
        assert torch.backends.mha.get_fastpath_enabled() is before
    finally:
        torch.backends.mha.set_fastpath_enabled(saved)
