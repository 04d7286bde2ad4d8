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


def test_checkpoint_storages_go_to_the_ranks_own_device(monkeypatch):
    """With one GPU per rank, ``load_checkpoint`` puts every CUDA storage of rank 0's file on the
    loading rank's own device, ``torch.cuda.current_device()`` (faked: 3), the one its random
    state goes into, whether or not CUDA had started (it had not: the storages used to stay
    where rank 0 saved them then); CPU storages stay."""
    from pyro_quadvi.distributed.checkpoint import _onto_own_device

    class Storage:
        def __init__(self):
            self.moved_to = None

        def cuda(self, device):
            self.moved_to = device
            return self

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cuda, indexed, cpu = Storage(), Storage(), Storage()
    assert _onto_own_device(cuda, "cuda") is cuda and cuda.moved_to == 3
    assert _onto_own_device(indexed, "cuda:0") is indexed and indexed.moved_to == 3
    assert _onto_own_device(cpu, "cpu") is cpu and cpu.moved_to is None


def _fake_cuda_ranks(outdir):
    """Each rank fakes two CUDA devices, its own current (rank r on cuda:r), with random states
    [1, 1] and [2, 2] where rank 0 saves; rank 0 saves, every rank loads, and reports which
    state went into which device."""
    import pyro
    import torch.distributed as dist
    from pyro.optim import Adam

    from pyro_quadvi.distributed import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    saved = [torch.tensor([1, 1], dtype=torch.uint8), torch.tensor([2, 2], dtype=torch.uint8)]
    restored = {}
    cuda = torch.cuda
    fakes = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 2,
        "current_device": lambda: rank,
        "get_rng_state_all": lambda: [s.clone() for s in saved],
        "set_rng_state": lambda state, device="cuda": restored.__setitem__(device, state.tolist()),
    }
    originals = {name: getattr(cuda, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(cuda, name, fake)
    try:
        pyro.clear_param_store()
        pyro.param("w", torch.ones(2))
        optim = Adam({"lr": 0.1})
        save_checkpoint(outdir / "fake.pt", optim)
        load_checkpoint(outdir / "fake.pt", optim)
    finally:
        for name, original in originals.items():
            setattr(cuda, name, original)
    return restored


def test_each_rank_restores_rank_0s_cuda_state_into_its_own_device(tmp_path, spawn_ranks):
    """Every rank draws the same nodes, so the ranks hold the same random state, each on its own
    device: rank 0's device's state (cuda:0, [1, 1]) goes into cuda:0 on rank 0 and cuda:1 on
    rank 1. Restoring every saved device's state on every rank gave rank 1's device rank 0's
    copy of cuda:1's state ([2, 2]), which rank 0 never draws from."""
    results = spawn_ranks(_fake_cuda_ranks, tmp_path, world_size=2, timeout_s=60)
    assert results == [{0: [1, 1]}, {1: [1, 1]}]
