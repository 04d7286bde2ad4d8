"""The sparse-regression tutorial in its quick mode, and the paper's data it uses."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_quadvi.testing.sparse_regression import sparse_regression_data, sparse_regression_target


def test_the_papers_target_at_a_hand_computed_point():
    x = torch.tensor([[0.5, 1.0, 0.2, 0.3, -0.5, 0.9]])
    # 7 * 1 / (1 + 0.25) + 5 sin(0.06) + 2 * (-0.5)
    expected = 5.6 + 5 * math.sin(0.06) - 1.0
    assert sparse_regression_target(x).item() == pytest.approx(expected, rel=1e-6)
    x, y, x_test, y_test = sparse_regression_data(50, 20, 8, seed=3)
    assert x.shape == (50, 8) and x_test.shape == (20, 8) and y.shape == (50,)
    assert x.min() >= -1 and x.max() <= 1
    noise = torch.cat([y - sparse_regression_target(x), y_test - sparse_regression_target(x_test)])
    assert 0.6 < float(noise.std()) < 1.4  # N(0, 1) noise: sd 1 within 6 standard errors of 70
    with pytest.raises(ValueError, match="num_inputs must be at least 5"):
        sparse_regression_data(10, 10, 4)


def test_quick_run(load_script, run_quick):
    tutorial = load_script("tutorials/sparse_regression.py")
    result, out = run_quick(tutorial, "spike_slab_inputs.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    inclusion = result["inclusion"]
    assert inclusion.shape == (200,) and ((inclusion > 0) & (inclusion < 1)).all()
    sparse = result["sparse"]
    assert sum(sparse.sizes.values()) == 1527  # 200-7-7-7-1: the paper's network
    kept_first = sparse.per_layer()["0"][0]
    first = sparse.net[0]
    assert kept_first == int((first.weight != 0).sum()) + int((first.bias != 0).sum())
    assert result["selected"] == (inclusion > 0.5).nonzero().flatten().tolist()
    steps, losses, kept = zip(*result["history"])
    assert steps[-1] == 12 and losses[-1] < losses[0]  # 12 epochs (36 steps) lower the loss
    assert math.isfinite(result["rmse"]) and kept[-1] == sparse.kept_fraction
