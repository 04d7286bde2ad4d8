"""The rows fingerprint ``DistributedOptimizer`` compares across ranks, with a plate's indices off
the CPU. A model on CUDA subsamples with CUDA indices (``tests/test_cuda.py`` does); the
fingerprint mixed them with CPU tensors and raised a device mismatch at the first
multi-rank step. Without a GPU, the ``meta`` device stands in for CUDA (the fingerprint then
has no values, only a device and a shape)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pyro_quadvi.distributed.optim import _rows_fingerprint


def test_rows_fingerprint_is_count_sum_squares_and_positions():
    """Rows 2, 0, 1 of one plate and 5 of another: 4 rows, sum 8, squares 30, and
    1 * 2 + 2 * 0 + 3 * 1 + 4 * 5 = 25; no rows at all: zeros."""
    sites = [
        SimpleNamespace(rows={-1: torch.tensor([2, 0, 1])}),
        SimpleNamespace(rows={}),
        SimpleNamespace(rows={-2: torch.tensor([[5]])}),
    ]
    got = _rows_fingerprint(sites)
    assert got.dtype == torch.float64 and got.device.type == "cpu"
    assert got.tolist() == [4.0, 8.0, 30.0, 25.0]
    assert _rows_fingerprint([SimpleNamespace(rows=None)]).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rows_fingerprint_stays_on_the_device_of_the_rows():
    """Indices on another device than the CPU (CUDA on a GPU, ``meta`` here): four float64
    numbers there, where before a CPU count and CPU positions met them and the step raised."""
    site = SimpleNamespace(rows={-1: torch.arange(3, device="meta")})
    got = _rows_fingerprint([site])
    assert got.device.type == "meta"
    assert got.shape == (4,) and got.dtype == torch.float64
