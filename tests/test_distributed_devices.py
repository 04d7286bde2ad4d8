"""The rows fingerprint ``DistributedOptimizer`` compares across ranks, with a plate's indices off
the CPU. A model on CUDA subsamples with CUDA indices (``tests/test_cuda.py`` does); the
fingerprint mixed them with CPU tensors and raised a device mismatch at the first
multi-rank step. Without a GPU, the ``meta`` device stands in for CUDA (the fingerprint then
has no values, only a device and a shape)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pyro_quadvi.distributed.comm import host_values, projection, projections
from pyro_quadvi.distributed.optim import _rows_fingerprint
from pyro_quadvi.testing.meta import FakeSync


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


def _old_projections(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``comm.projections`` before session 25: one copy to the host per tensor."""
    return sum(
        (projection(t).cpu() * (i + 1) for i, t in enumerate(tensors)),
        torch.zeros((), dtype=torch.float64),
    )


def _bits(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.int64 if t.dtype == torch.float64 else torch.int32).tolist()


def test_projections_are_the_old_sum_bit_for_bit():
    """float32 and float64 tensors of several shapes (a 0-d one, an empty one), 1, 10 and 200
    of them: the per-device copy changes no bit of the sum the ranks compare."""
    g = torch.Generator().manual_seed(5)
    shapes = [(), (0,), (7,), (3, 4), (2, 3, 5), (1, 9)]
    for dtype in (torch.float32, torch.float64):
        for count in (1, 10, 200):
            tensors = [
                torch.randn(shapes[i % len(shapes)], generator=g, dtype=dtype) * 10.0 ** (i % 7)
                for i in range(count)
            ]
            new, old = projections(tensors), _old_projections(tensors)
            assert new.dtype == torch.float64 and new.shape == () and new.device.type == "cpu"
            assert _bits(new) == _bits(old), (dtype, count)
    assert _bits(projections([])) == _bits(torch.zeros((), dtype=torch.float64))


def test_host_values_are_the_old_concatenation_bit_for_bit():
    """Mixed dtypes promote as torch.cat promotes them after the copies (int64 and float32 to
    float32, with float64 to float64)."""
    tensors = [
        torch.tensor([16_777_217, -3]),
        torch.tensor([[0.1, -2.5]], dtype=torch.float32),
        torch.tensor(1.0 / 3.0, dtype=torch.float32),
    ]
    new = host_values(tensors)
    old = torch.cat([t.reshape(-1).cpu() for t in tensors])
    assert new.dtype == old.dtype == torch.float32
    assert _bits(new) == _bits(old)
    wide = [*tensors, torch.tensor([1.0 / 3.0], dtype=torch.float64)]
    assert _bits(host_values(wide)) == _bits(torch.cat([t.reshape(-1) for t in wide]))


def test_projections_copy_to_the_host_once_per_device():
    """On ``meta`` (a stand-in for CUDA) the copies to the host are counted: 10 tensors on the
    device and 2 on the CPU make one copy, where the old sum made one per device tensor."""
    tensors = [torch.ones(3, 4, device="meta") for _ in range(10)] + [torch.ones(2), torch.ones(5)]
    with FakeSync() as syncs:
        assert projections(tensors).device.type == "cpu"
    assert syncs.total == 1
    with FakeSync() as syncs:
        values = host_values(tensors[:3] + tensors[-1:] + tensors[3:5])
    assert syncs.total == 1
    assert values.shape == (12 + 12 + 12 + 5 + 12 + 12,)
    assert values[36:41].tolist() == [1.0] * 5  # the CPU tensor kept its place and values
    with FakeSync() as syncs:
        _old_projections(tensors)
    assert syncs.total == 10


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
