"""Steps of the plain-torch optimizer on a network's mean squared error, shared by the tests."""

from __future__ import annotations

import torch
from torch import nn

from ..optim import QNVBOptimizer, module_loss

__all__ = ["mse_steps"]


def mse_steps(
    optimizer: QNVBOptimizer,
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    *,
    closure: bool,
    vectorize: bool | None = None,
) -> torch.Tensor:
    """``steps`` steps of ``optimizer`` on ``mse_loss(net(x), y)``: by a closure (the nodes in
    turn) or in one pass (``step(loss_fn=module_loss(net, mse_loss), batch=(x, y))``); the losses
    the steps returned, stacked."""
    loss_fn = module_loss(net, nn.functional.mse_loss)

    def evaluate() -> torch.Tensor:
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        return loss

    losses = [
        optimizer.step(evaluate)
        if closure
        else optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=vectorize)
        for _ in range(steps)
    ]
    return torch.stack([loss.detach() for loss in losses])
