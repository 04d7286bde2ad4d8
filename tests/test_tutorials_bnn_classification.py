"""The BNN classification tutorial (sklearn digits), end to end in its quick mode."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="module")
def tutorial(load_script):
    return load_script("tutorials/bnn_classification.py")


def test_split_and_rotation(tutorial):
    x_train, y_train, x_test, y_test = tutorial.digits_split()
    assert x_train.shape == (1438, 8, 8) and x_test.shape == (359, 8, 8)
    assert y_train.shape == (1438,) and y_test.shape == (359,)
    assert set(y_test.tolist()) == set(range(10))
    # the split is fixed by its seed
    again = tutorial.digits_split()
    assert torch.equal(again[3], y_test)
    standardize = tutorial.Standardizer(x_train)
    z = standardize(x_train)
    assert z.shape == (1438, 64) and torch.isfinite(z).all()
    assert z.mean(0).abs().max() < 1e-4
    rotated = tutorial.rotate(x_test[:5], 90)
    assert rotated.shape == (5, 8, 8)
    # a quarter turn in the same 8x8 frame moves the pixels exactly (no interpolation)
    assert torch.allclose(rotated, torch.rot90(x_test[:5], 1, dims=(1, 2)), atol=1e-4)


def test_quick_run(tutorial, run_quick):
    result, out = run_quick(tutorial, "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = result["results"]
    assert len(results) == 3
    assert [name.split(" ")[0] for name in results] == ["QNVB", "Adam(lr=0.01)", "deterministic,"]
    for r in results.values():
        assert 0.5 < r["accuracy"] <= 1.0  # digits is easy
        assert 0.0 <= r["ece"] <= 1.0
        assert 0.0 <= r["brier"] <= 2.0
        assert math.isfinite(r["nll"]) and 0.0 <= r["nll"] < math.log(10)
        assert len(r["entropy"]) == len(tutorial.ANGLES) == 4
        for e in r["entropy"]:
            assert math.isfinite(e) and 0.0 <= e <= math.log(10) + 1e-6
