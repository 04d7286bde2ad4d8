"""Session 24: the public API under bad input (trial t3).

A scale ``<= 0`` given to the pure QNVB updates was raised to ``sigma_min`` without a word, while a
non-finite one was refused; a guide started far below ``sigma_min`` got an idle-step refusal that
blamed the data; and several functions failed with a bare torch or Pyro error, or accepted a
string for a flag or a class. Each is now refused, naming the argument and the fix.
"""

from __future__ import annotations

import math

import pytest
import torch

from pyro_quadvi.optim import qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)

DTYPE = torch.float64
HP = QNVBHyperparameters()


def _inputs(n: int) -> dict:
    mu = torch.linspace(-1.0, 1.0, n, dtype=DTYPE)
    return {
        "mu": mu,
        "sigma": torch.full((n,), 0.1, dtype=DTYPE),
        "g": torch.linspace(0.5, 2.0, n, dtype=DTYPE),
        "h": torch.linspace(1.0, 3.0, n, dtype=DTYPE),
        "state": init_qnvb_state(mu),
    }


@pytest.mark.parametrize("value", [-1.0, 0.0, -0.0])
@pytest.mark.parametrize("many", [False, True])
def test_a_scale_at_or_below_zero_is_refused_with_its_count(value, many):
    # before: the rate limit and the bounds set such a scale to sigma_min (1e-6), no error
    args = _inputs(5)
    args["sigma"][[1, 3]] = value
    if many:
        call = lambda: qnvb_update_many(*([args[k]] for k in args), HP)  # noqa: E731
        name = r"sigmas\[0\]"
    else:
        call = lambda: qnvb_update(*args.values(), HP)  # noqa: E731
        name = "sigma"
    with pytest.raises(ValueError, match=rf"{name} is <= 0 at 2 of 5 coordinates.*scales > 0"):
        call()


def test_the_flat_update_refuses_a_scale_at_zero_in_a_later_chunk(monkeypatch):
    # every result of the chunk is finite (the guard does not act): the scale's least value is read
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 64)
    first, second = _inputs(100), _inputs(200)
    second["sigma"][150] = -0.5
    lists = [[first[k], second[k]] for k in ("mu", "sigma", "g", "h", "state")]
    with pytest.raises(ValueError, match=r"sigmas\[1\] is <= 0 at 1 of 200 coordinates"):
        qnvb_update_many(*lists, HP)


def test_a_positive_scale_still_updates_as_before():
    args = _inputs(3)
    args["sigma"][:] = 1.0
    args["g"][:] = 1.0
    args["h"][:] = 1.0
    result = qnvb_update(*args.values(), HP)
    # the step is g / max(h, |g| + eps) = 1 / (1 + 1e-8), the cap of an Adam step of size lr = 1
    assert result.mu.tolist() == pytest.approx([-2.0, -1.0, 0.0], abs=2e-8)
    assert result.sigma.tolist() == [1.0] * 3
    assert math.isclose(float(qnvb_update_many(*([args[k]] for k in args), HP)[0].sigma[0]), 1.0)
