"""Session 25, helper f11: `QNVBOptimizer` and `SparseQNVBOptimizer` in training workflows,
against the closed-form mean-field optimum of a small linear-Gaussian regression
(noise variance 1, ``sigma_i = A_ii^(-1/2)``, ``A = X'X + lam I``): a head whose ``.grad`` is
``None`` on some steps, a layer frozen when the sparse pattern is realized, and the one-pass
form under a parametrization whose vectorized backward fails."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from pyro_quadvi.infer.batched import BatchMismatch
from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer, module_loss

N, LAM = 32, 1.0
_g = torch.Generator().manual_seed(0)
X = torch.randn(N, 2, generator=_g, dtype=torch.float64)
GROUP = torch.arange(N) >= N // 2  # the first half takes head a, the second head b
Y = torch.where(GROUP, X @ torch.tensor([1.0, -1.0], dtype=torch.float64), X[:, 0] * 2.0)
Y = Y + torch.randn(N, generator=_g, dtype=torch.float64)


def exact_sigma(rows: torch.Tensor) -> torch.Tensor:
    """The mean-field optimum's ``sigma`` of a head fitted to ``X[rows]``."""
    A = X[rows].T @ X[rows] + LAM * torch.eye(2, dtype=torch.float64)
    return A.diagonal().rsqrt()


class TwoHeads(nn.Module):
    """A head per group, picked by an ``if``: the head a batch does not use gets no ``.grad``;
    ``shared`` is frozen and multiplies both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.shared = nn.Parameter(torch.tensor(1.0, dtype=torch.float64), requires_grad=False)

    def forward(self, x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        head = self.b if bool(group.all()) else self.a
        return self.shared * (x @ head)


def half_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((prediction - target) ** 2).mean()


@pytest.mark.parametrize("form", ["closure", "loss_fn"])
def test_a_head_without_grad_on_some_steps_gets_the_exact_sigma(form):
    """Batches alternate between the groups (all cases of one group each), so every head gets
    ``.grad = None`` on half the steps. Such a step is a zero data term: leaving it out gave
    sigma / exact = 1/sqrt(2) (0.701 / 0.717 in the trial's run); the frozen ``shared`` stays
    bit for bit and gets no state."""
    net = TwoHeads()
    optimizer = QNVBOptimizer(
        net.named_parameters(), likelihood_weight=N, prior_precision=LAM, quadrature="hadamard"
    )

    def loss_fn(params, x, group, y):
        return half_loss(torch.func.functional_call(net, params, (x, group)), y)

    for t in range(400):
        rows = GROUP if t % 2 else ~GROUP
        if form == "closure":

            def closure(rows=rows):
                loss = half_loss(net(X[rows], GROUP[rows]), Y[rows])
                loss.backward()
                return loss

            optimizer.step(closure)
        else:
            optimizer.step(loss_fn=loss_fn, batch=(X[rows], GROUP[rows], Y[rows]))
    ratio_a = optimizer.state[net.a]["sigma"] / exact_sigma(~GROUP)
    ratio_b = optimizer.state[net.b]["sigma"] / exact_sigma(GROUP)
    torch.testing.assert_close(ratio_a, torch.ones(2, dtype=torch.float64), rtol=0.02, atol=0)
    torch.testing.assert_close(ratio_b, torch.ones(2, dtype=torch.float64), rtol=0.02, atol=0)
    assert net.shared.item() == 1.0 and net.shared not in optimizer.state


def _left_after_30_steps(prior_precision: float, sigma_max: float) -> tuple[list, list]:
    """Two weights ``b`` the loss uses for 30 steps, then 200 steps without them (``.grad``
    None): ``b``'s sigma after each step, and the warnings."""
    x = X.clone()
    y = x @ torch.tensor([1.0, -1.0], dtype=torch.float64)
    a = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    b = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer = QNVBOptimizer(
        [a, b],
        likelihood_weight=N,
        prior_precision=prior_precision,
        sigma_max=sigma_max,
        quadrature="hadamard",
    )
    sigmas = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(230):

            def closure(t=t):
                loss = half_loss(x @ a, y) + (half_loss(x @ b, y) if t < 30 else 0.0)
                loss.backward()
                return loss

            optimizer.step(closure)
            sigmas.append(optimizer.state[b]["sigma"].clone())
    return sigmas, [str(w.message) for w in caught]


def test_a_head_left_widens_to_the_prior_or_under_a_flat_prior_to_sigma_max_with_a_warning():
    """docs/qnvb_torch.md's figures: left unused, the head's curvature average decays (an
    arithmetic mean over the first 1 / (1 - beta2) steps, so sigma grows as the square root of
    the steps, 30 -> 230: x2.77) towards the prior's sigma, 4^(-1/2); a flat prior's sigma_max
    holds it, with the warning."""
    sigmas, caught = _left_after_30_steps(0.0, 100.0)
    assert sigmas[29].tolist() == pytest.approx([0.159, 0.156], abs=1e-3)
    assert sigmas[229].tolist() == pytest.approx([0.454, 0.445], abs=1e-3)
    assert not caught
    sigmas, caught = _left_after_30_steps(0.0, 0.4)
    assert sigmas[-1].tolist() == [0.4, 0.4]
    assert len(caught) == 1 and caught[0].startswith("QNVBOptimizer: sigma pinned at sigma_max=0.4")
    sigmas, _ = _left_after_30_steps(4.0, 100.0)
    assert sigmas[-1].tolist() == pytest.approx([0.5, 0.5], rel=0.01)


def _sparse_run(freeze_at: int, names: bool = True):
    """Two 3-weight layers, 3 epochs of 2 steps: the pattern is realized at step 5 (index 4)."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(3, 1, bias=False), "b": nn.Linear(3, 1, bias=False)})
    net.double()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = x[:, :1] * 2.0
    params = net.named_parameters() if names else net.parameters()
    optimizer = SparseQNVBOptimizer(
        params, num_cases=16, steps_per_epoch=2, num_epochs=3, target_sparsity=0.5
    )

    def closure():
        loss = 0.5 * ((net["a"](x[:, :3]) + net["b"](x[:, 3:]) - y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(freeze_at):
        optimizer.step(closure)
    net["a"].weight.requires_grad_(False)
    return net, optimizer, closure


def test_a_layer_frozen_at_the_realization_step_is_refused_by_name_and_nothing_changes():
    """The trial's layer frozen for the final epoch kept its mixture means (0.433 = p_nonzero
    0.416 times nu) while `finished` was true and `sparsity()` counted the other layer only."""
    net, optimizer, closure = _sparse_run(freeze_at=4)
    before = copy.deepcopy(optimizer.state_dict())
    values = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"step 5 = \(num_epochs - 1\) \* steps_per_epoch \+ 1"):
        optimizer.step(closure)
    with pytest.raises(ValueError, match=r"frozen: parameter 0 \('a.weight'\)\. Unfreeze them"):
        optimizer.step(closure)
    assert not optimizer.finished and optimizer.counters.step == 4
    for p, v in zip(net.parameters(), values):
        assert torch.equal(p, v)
    after = optimizer.state_dict()["state"]
    for key, state in before["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(after[key][name]), torch.as_tensor(value)), name
    # unfrozen for the realization step, then frozen again: every zero is exact and stays
    net["a"].weight.requires_grad_(True)
    optimizer.step(closure)
    net["a"].weight.requires_grad_(False)
    optimizer.step(closure)
    assert optimizer.finished
    for p in net.parameters():
        state = optimizer.state[p]
        assert torch.equal(p == 0, state["pattern"] == 0)
    # 2 of a's 3 weights and all of b's realized as zeros; the frozen layer is counted
    assert optimizer.sparsity() == 5 / 6


def test_a_layer_frozen_before_or_after_the_realization_step_is_not_refused():
    net, optimizer, closure = _sparse_run(freeze_at=3, names=False)
    optimizer.step(closure)  # step 4: not the realization
    net["a"].weight.requires_grad_(True)
    optimizer.step(closure)  # the realization, every layer unfrozen
    net["a"].weight.requires_grad_(False)
    zeros = net["a"].weight.detach().clone()
    optimizer.step(closure)
    assert optimizer.finished and torch.equal(net["a"].weight, zeros)


def _orthogonal_net() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 2)).double()


def _orthogonal_steps(vectorize, steps: int = 2):
    net = _orthogonal_net()
    optimizer = QNVBOptimizer(
        net.named_parameters(), likelihood_weight=32, quadrature="hadamard", init_sigma=0.05
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g, dtype=torch.float64)
    y = torch.randn(32, 2, generator=g, dtype=torch.float64)
    loss_fn = module_loss(net, half_loss)
    for _ in range(steps):
        optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=vectorize)
    return net, optimizer, loss_fn, (x, y)


def test_a_vectorized_backward_that_fails_falls_back_to_the_loop_once():
    """torch's orthogonal parametrization runs under vmap and agrees with the probes, but the
    backward of the pass raised torch's bare in-place RuntimeError; now the loop takes over with
    the usual warning, once, and the steps equal those of vectorize=False."""
    with pytest.warns(UserWarning, match=r"its backward raised RuntimeError: one of the var") as w:
        net, optimizer, _, _ = _orthogonal_steps(None)
    assert sum("vectorized pass" in str(r.message) for r in w) == 1
    looped, reference, _, _ = _orthogonal_steps(False)
    for (name, p), q in zip(net.named_parameters(), looped.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0, msg=name)
        torch.testing.assert_close(optimizer.state[p]["sigma"], reference.state[q]["sigma"])


def test_a_vectorized_backward_that_fails_under_vectorize_true_is_refused_unchanged():
    net, optimizer, loss_fn, batch = _orthogonal_steps(False, steps=1)
    values = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(BatchMismatch, match=r"backward raised RuntimeError.*Pass vectorize=False"):
        optimizer.step(loss_fn=loss_fn, batch=batch, vectorize=True)
    assert optimizer.num_steps == 1
    for p, v in zip(net.parameters(), values):
        assert torch.equal(p, v) and p.grad is None
