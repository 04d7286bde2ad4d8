"""The WHVI regression tutorial, end to end in its quick mode."""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def tutorial(load_script):
    return load_script("tutorials/whvi_regression.py")


def test_quick_run(tutorial, run_quick):
    result, out = run_quick(tutorial, "whvi_regression.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["settings"]["hidden"] == 32
    whvi, mfg = result["results"]["WHVI"], result["results"]["MFG"]
    # 13-32-32-1: WHVI layers 13 -> 32 (D = 16, 2 blocks) and 32 -> 32 hold 4 * 32 + 2 * 32 each,
    # the mean-field last layer 2 * 33, the noise scale 2
    assert whvi["parameters"] == 192 + 192 + 66 + 2
    assert mfg["parameters"] == 2 * (13 * 32 + 32 + 32 * 32 + 32 + 33) + 2
    for r in (whvi, mfg):
        assert math.isfinite(r["rmse"]) and math.isfinite(r["mnll"])
        assert r["rmse"] < 9.2  # below the targets' standard deviation (9.2 k$ on Boston)
        assert (r["low"] < r["mean"]).all() and (r["mean"] < r["high"]).all()
        assert r["y"].shape == (51,)
    assert whvi["rmse"] < 6.0  # 100 steps fit the data well
