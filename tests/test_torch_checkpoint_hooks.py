"""The shared checkpoint machinery of the plain-torch optimizers (``CheckpointHooks``), the
marks left by ``sampled_params``, and the check for trainable parameters outside the optimizer
across steps."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer, module_loss
from pyro_quadvi.testing.checkpoints import rename_back, renamed_entry
from pyro_quadvi.testing.compare import equal_nested


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 3, generator=generator, dtype=torch.float64)
    return x, torch.tanh(x).sum(-1, keepdim=True)


def _params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randn(3, 4, generator=generator, dtype=torch.float64, requires_grad=True),
        torch.randn(4, generator=generator, dtype=torch.float64, requires_grad=True),
        torch.randn(4, 1, generator=generator, dtype=torch.float64, requires_grad=True),
    ]


def _closure(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """The mean squared error of a one-hidden-layer tanh net given by its parameters."""

    def closure() -> torch.Tensor:
        w1, b1, w2 = params
        loss = ((torch.tanh(x @ w1 + b1) @ w2 - y) ** 2).mean()
        loss.backward()
        return loss

    return closure


def _optimizer(kind: str, params: list[torch.Tensor]):
    generator = torch.Generator().manual_seed(4)
    if kind == "qnvb":
        return QNVBOptimizer(params, likelihood_weight=32, generator=generator)
    return SparseQNVBOptimizer(
        params, num_cases=32, steps_per_epoch=2, num_epochs=3, generator=generator
    )


def _entry(optimizer) -> str:
    return "qnvb" if isinstance(optimizer, QNVBOptimizer) else "sparse_qnvb"


def _own_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_a_copy_made_before_the_checkpoint_hooks_gets_them(kind):
    """An optimizer pickled by an earlier version has no ``_checkpoint_hooks`` (nor
    ``_loaded``): unpickled, it registers the hooks, whose entry, load check (kept after a
    user's migration) and restore work, and it steps as the original bit for bit."""
    x, y = _data()
    optimizer = _optimizer(kind, _params())
    for _ in range(2):
        optimizer.step(_closure(_own_params(optimizer), x, y))
    state = optimizer.__getstate__()
    del state["_checkpoint_hooks"], state["_loaded"]
    old = type(optimizer).__new__(type(optimizer))
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    saved = old.state_dict()
    assert equal_nested(saved[_entry(optimizer)], optimizer.state_dict()[_entry(optimizer)])

    renamed = renamed_entry(saved, _entry(optimizer))
    fresh = _optimizer(kind, _params())
    # prepended: still before the check
    fresh.register_load_state_dict_pre_hook(rename_back(_entry(optimizer)), prepend=True)
    fresh.load_state_dict(renamed)
    for _ in range(3):
        want = optimizer.step(_closure(_own_params(optimizer), x, y))
        assert torch.equal(old.step(_closure(_own_params(old), x, y)), want)
        assert torch.equal(fresh.step(_closure(_own_params(fresh), x, y)), want)
    for a, b, c in zip(_own_params(optimizer), _own_params(old), _own_params(fresh)):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("kind", ["qnvb", "sparse"])
def test_sampled_params_leaves_the_means_as_written(kind):
    """After ``sampled_params`` the parameters hold the means again and count as written: the
    state's means are not taken anew (the same tensors), the next step equals that of a twin
    that drew nothing bit for bit, and a change made after the block is still taken."""
    x, y = _data()
    optimizer, twin = _optimizer(kind, _params()), _optimizer(kind, _params())
    for o in (optimizer, twin):
        o.step(_closure(_own_params(o), x, y))
    w = _own_params(optimizer)[0]
    mu = optimizer.state[w]["mu"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the sparse sieve has not finished
        with optimizer.sampled_params(generator=torch.Generator().manual_seed(7)):
            assert not torch.equal(w, mu)
    optimizer.state_dict()  # its pre-hook takes the parameters changed since they were written
    assert optimizer.state[w]["mu"] is mu and torch.equal(w, mu)
    for o in (optimizer, twin):
        o.step(_closure(_own_params(o), x, y))
    for a, b in zip(_own_params(optimizer), _own_params(twin)):
        assert torch.equal(a, b)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with optimizer.sampled_params(generator=torch.Generator().manual_seed(8)):
            pass
    with torch.no_grad():
        w[0, 0] = 0.25
    optimizer.state_dict()
    assert optimizer.state[w]["mu"][0, 0].item() == 0.25


def test_a_parameter_unfrozen_after_a_quiet_check_is_named():
    """Steps that found no trainable parameter outside the optimizer do not silence the check:
    a parameter outside unfrozen after them is named at the next step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x, y = _data()
    net[2].requires_grad_(False)
    optimizer = QNVBOptimizer(net[0].named_parameters(prefix="0"), likelihood_weight=32)
    loss_fn = module_loss(net, nn.functional.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            optimizer.step(loss_fn=loss_fn, batch=(x, y))
    net[2].weight.requires_grad_(True)
    with pytest.warns(RuntimeWarning, match=r"has 1 trainable parameters .*\('2.weight'\)"):
        optimizer.step(loss_fn=loss_fn, batch=(x, y))
