"""Session 27, reviewer r8: regressions of the session's merged changes found by trying them."""

from __future__ import annotations

import threading

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from torch import nn
from torch.utils.checkpoint import checkpoint

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.optim import QNVBOptimizer


class _ForwardInAnotherThread(torch.autograd.Function):
    """The identity, whose backward waits for ``net``'s forward run by another thread (a net
    trained beside the fit, or served, while QuadratureELBO's backward runs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, net: nn.Module, errors: list) -> torch.Tensor:
        ctx.net, ctx.errors = net, errors
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        def other() -> None:
            try:
                ctx.net(torch.ones(2, 3)).sum().backward()
            except RuntimeError as error:
                ctx.errors.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        return grad, None, None


def test_another_threads_forward_runs_while_quadrature_elbo_backwards():
    """The checkpoint refusal is a process-wide forward pre-hook while the backward runs: it
    refused any trainable layer's forward in any thread (a Linear trained in another thread
    raised RecomputedForward, blaming a checkpoint it did not have). Only a forward run by the
    backward itself is refused now; the other thread's net gets its gradient."""
    pyro.clear_param_store()
    net, errors = nn.Linear(3, 1), []

    def model() -> None:
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        z = _ForwardInAnotherThread.apply(z, net, errors)
        pyro.sample("y", dist.Normal(z, 1.0), obs=torch.tensor(0.5))

    guide = AutoMeanFieldNormal(model)
    SVI(model, guide, QNVB(), QuadratureELBO(vectorize=False)).step()
    assert errors == []
    # one backward of the Function per node (the default rule's 3 at one coordinate), each
    # adding 2 (two rows of ones) to every weight's gradient
    assert net.weight.grad.tolist() == [[6.0, 6.0, 6.0]]


@pytest.mark.parametrize(
    ("name", "valid", "bad"), [("lr", 1.0, True), ("betas", (0.0, 0.5), (False, 0.5))]
)
def test_qnvb_optimizer_refuses_a_bool_setting_after_the_number_it_equals(name, valid, bad):
    """QNVBOptimizer keeps its checked group settings while they are the same; ``True == 1.0``
    (and ``(False, 0.5) == (0.0, 0.5)``), so a bool set in place of a valid number after a step
    was taken unchecked, where a first step refuses it."""
    net = nn.Linear(2, 1)
    opt = QNVBOptimizer(net.parameters(), likelihood_weight=4.0, **{name: valid})
    x, y = torch.ones(4, 2), torch.zeros(4, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).sum() / 2
        loss.backward()
        return loss

    opt.step(closure)
    opt.param_groups[0][name] = bad
    with pytest.raises(TypeError, match=r"parameter group 0: .* must be a real number .* \(bool\)"):
        opt.step(closure)


def _log_normal_site() -> None:
    pyro.sample("s", dist.LogNormal(0.0, 1.0))
    pyro.sample("y", dist.Normal(0.0, 1.0), obs=torch.tensor(0.3))


def test_a_value_rounded_onto_the_support_bound_is_not_called_a_moved_support():
    """A LogNormal site whose guide sits at ``loc = -200``: exp rounds every node to 0.0 in
    float32, outside ``(0, inf)``. The support did not move, so Pyro's own error (the site and
    the values) is raised, not the advice to rewrite a support that depends on another latent."""
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_log_normal_site)
    guide()
    with torch.no_grad():
        pyro.param("AutoMeanFieldNormal.locs.s").unconstrained().fill_(-200.0)
    with pytest.raises(ValueError, match="Error while computing log_prob at site 's'") as info:
        with pyro.validation_enabled():
            QuadratureELBO().loss(_log_normal_site, guide)
    assert "depends on another latent" not in str(info.value)


def _encoder_fit(checkpointed: bool) -> tuple[float, torch.Tensor]:
    """Three steps of a model whose point-estimated encoder (``pyro.module``) feeds a latent
    head, the encoder run under ``checkpoint(..., use_reentrant=False)`` or not: the last loss
    and the encoder's weight's change."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    start = encoder[0].weight.detach().clone()
    x, y = torch.randn(16, 4), torch.randn(16)

    def model() -> None:
        pyro.module("encoder", encoder)
        h = checkpoint(encoder, x, use_reentrant=False) if checkpointed else encoder(x)
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("n", 16):
            pyro.sample("y", dist.Normal((h * w.unsqueeze(-2)).sum(-1), 0.5), obs=y)

    svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO("gauss_hermite", 2))
    losses = [svi.step() for _ in range(3)]
    return losses[-1], encoder[0].weight.detach() - start


def test_a_checkpointed_module_of_the_model_itself_trains_under_quadrature_elbo():
    """The checkpoint refusal is for a BayesianModule's net, whose nodes functional_call puts in
    it only while its forward runs. A model's own module recomputes at its own parameters, as
    its forward ran: it was refused too (RecomputedForward naming its Linear layer); it now
    fits as without the checkpoint."""
    (loss, moved), (plain_loss, plain_moved) = _encoder_fit(True), _encoder_fit(False)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    torch.testing.assert_close(moved, plain_moved)
    assert moved.abs().min() > 0  # (the fallback stepped the encoder)


def _head_fit(checkpointed: bool) -> torch.Tensor:
    """Two one-pass QNVBOptimizer steps on a linear layer read out by a fixed-by-choice
    ``readout`` (its parameters require grad, another optimizer's), run under ``checkpoint``
    or not: the layer's weight."""
    torch.manual_seed(0)
    layer, readout = nn.Linear(4, 3), nn.Sequential(nn.Tanh(), nn.Linear(3, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    opt = QNVBOptimizer(layer.named_parameters(), likelihood_weight=16.0)

    def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.func.functional_call(layer, params, (x,))
        out = checkpoint(readout, h, use_reentrant=False) if checkpointed else readout(h)
        return ((out - y) ** 2).mean() / 2

    for _ in range(2):
        opt.step(loss_fn=loss_fn, batch=(x, y), vectorize=False)
    return layer.weight.detach().clone()


def test_qnvb_optimizer_takes_a_checkpointed_module_it_does_not_step():
    """step(loss_fn=...) refuses a recomputed layer whose parameters it swapped for the nodes;
    a readout it does not hold recomputes at its own parameters, as its forward ran, and was
    refused too (RecomputedForward naming its Linear layer). The fit of the loop over the
    nodes equals the one without the checkpoint (the vmap pass's backward cannot recompute)."""
    torch.testing.assert_close(_head_fit(True), _head_fit(False))
