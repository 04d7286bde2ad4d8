"""The BNN regression tutorial, end to end in its quick mode."""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def tutorial(load_script):
    return load_script("tutorials/bnn_regression.py")


def test_toy_data(tutorial):
    x, y = tutorial.toy_data()
    assert x.shape == (128, 1) and y.shape == (128,)
    x = x.squeeze(-1)
    assert x.min() >= -1.0 and x.max() <= 2.0
    assert not tutorial.in_gap(x).any()  # the gap is empty
    assert (x < tutorial.GAP[0]).any() and (x > tutorial.GAP[1]).any()
    # the noise has the paper's variance exp(-3)
    assert tutorial.NOISE**2 == pytest.approx(math.exp(-3))
    residual = y - tutorial.target(x)
    assert 0.15 < float(residual.std()) < 0.3


def test_quick_run(tutorial, run_quick):
    result, out = run_quick(tutorial, "bnn_regression.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["K"] == 3  # QuadratureELBO's default rule: 3 nodes a step
    results = result["results"]
    assert len(results) == 2  # no NUTS in quick mode
    qnvb = next(r for name, r in results.items() if name.startswith("QNVB"))
    adam = next(r for name, r in results.items() if name.startswith("Adam"))
    assert "450 steps" in next(name for name in results if name.startswith("Adam"))
    for r in (qnvb, adam):
        assert math.isfinite(r["nll"]) and math.isfinite(r["rmse"])
        # the predictive sd includes the noise, and the network's own spread adds to it
        assert r["sd_data"] > tutorial.NOISE
        assert r["rmse"] < 1.0  # the fits follow the data (the targets' sd is about 1)
    # QNVB's predictive sd is larger inside the gap than where the data are
    assert qnvb["sd_gap"] > qnvb["sd_data"]
