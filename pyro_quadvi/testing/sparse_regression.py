"""The sparse-VI paper's nonlinear regression: 200 uniform inputs of which 5 matter.

Bai, Song and Cheng, "Efficient variational inference for sparse deep learning with theoretical
guarantee", Experiment: ``x ~ U(-1, 1)^p`` and

    y = 7 x2 / (1 + x1^2) + 5 sin(x3 x4) + 2 x5 + N(0, 1)

(inputs numbered from 1), so the noise floor of the test RMSE is 1. Shared by
``benchmarks/bench_spike_slab.py`` and ``tutorials/sparse_regression.py``.
"""

from __future__ import annotations

import torch

__all__ = ["TRUE_INPUTS", "sparse_regression_data", "sparse_regression_target"]

TRUE_INPUTS = 5
"""The inputs the target depends on are the first five (indices 0 to 4)."""


def sparse_regression_target(x: torch.Tensor) -> torch.Tensor:
    """``7 x2 / (1 + x1^2) + 5 sin(x3 x4) + 2 x5`` for rows ``x`` of at least 5 columns."""
    return 7 * x[:, 1] / (1 + x[:, 0] ** 2) + 5 * torch.sin(x[:, 2] * x[:, 3]) + 2 * x[:, 4]


def sparse_regression_data(
    num_train: int = 3000, num_test: int = 10_000, num_inputs: int = 200, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, x_test, y_test)`` drawn from a generator seeded with ``seed`` (float32).

    Raises:
        ValueError: for fewer than 5 inputs.
    """
    if num_inputs < TRUE_INPUTS:
        raise ValueError(f"num_inputs must be at least {TRUE_INPUTS}, got {num_inputs}")
    gen = torch.Generator().manual_seed(seed)
    n = num_train + num_test
    x = torch.rand(n, num_inputs, generator=gen) * 2 - 1
    y = sparse_regression_target(x) + torch.randn(n, generator=gen)
    return x[:num_train], y[:num_train], x[num_train:], y[num_train:]
