"""The sparse MNIST tutorial, end to end in its quick mode (sklearn digits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def tutorial(load_script):
    return load_script("tutorials/sparse_mnist.py")


def test_quick_run(tutorial, run_quick):
    result, out = run_quick(tutorial, "sparse_mnist.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    net, history = result["net"], result["history"]
    hp = history["hyperparameters"]
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    d = weights.numel()
    assert d == history["num_weights"] == 64 * 64 + 64 + 64 * 10 + 10
    # the realized pattern: at least round(0.97 d) exact zeros, at most all but round(0.01 d)
    zeros = int((weights == 0).sum())
    assert round(hp.target_sparsity * d) <= zeros <= d - round(hp.target_free * d)
    assert history["zeros"][-1] == zeros / d
    # before the final epoch nothing is realized; the last epoch keeps the rounded pattern
    assert history["zeros"][0] == 0.0
    assert history["rounded_zeros"][-1] == zeros / d
    for counts in history["histograms"]:  # every weight in one bin of the histogram
        assert sum(counts) == d
    # epoch 1: s0 = 0, every probability of a nonzero is at least 0.999 (the last bin)
    assert history["histograms"][0][-1] == d
    assert np.isclose(history["histograms"][-1][0], zeros)  # realized zeros: p_nonzero = 0
    assert history["bytes_sparse"] < history["bytes_dense"] / 3
    assert history["accuracy"][-1] > 0.5  # 10 classes: chance is 0.1
