"""``load_checkpoint`` failing on two gloo ranks: every rank raises the same error, naming the file
and the fix, and none is left waiting in a collective.

Rank 0 alone reads the file: a path it cannot read raised ``FileNotFoundError`` on rank 0 before
the broadcast, and the other rank got a bare gloo error (under NCCL: a hang until the timeout).
Each rank loads the broadcast bytes itself: a load failing on one rank only raised there, before
the ranks compared outcomes, and the others went on into the next collective. One spawn runs
every case in turn, then a good checkpoint, which only ranks still in step can load.
"""

from __future__ import annotations

from pathlib import Path

import pyro
import pytest
import torch
from pyro.optim import Adam

from pyro_quadvi.distributed import load_checkpoint, save_checkpoint, world

TIMEOUT_S = 40  # no case waits for a collective's timeout: a hang fails the test
CUDA_LESS = (
    "Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False"
)


def _outcome(run) -> tuple[str, str]:
    try:
        run()
    except Exception as error:  # every rank reports what it raised, whatever the type
        return type(error).__name__, str(error)
    return "ok", ""


def _load_on_a_cuda_less_rank_1(path: Path, optim) -> None:
    """Rank 1's ``torch.load`` raises as on a rank without CUDA reading a GPU fit's tensors."""
    real = torch.load

    def cuda_less(*args, **kwargs):
        raise RuntimeError(CUDA_LESS)

    if world()[0] == 1:
        torch.load = cuda_less
    try:
        load_checkpoint(path, optim)
    finally:
        torch.load = real


def _scenarios(outdir: Path) -> dict:
    pyro.clear_param_store()
    pyro.param("w", torch.full((2,), 3.0))
    optim = Adam({"lr": 0.1})
    (outdir / "text.pt").write_bytes(b"not a checkpoint")
    if world()[0] == 0:
        torch.save({"w": torch.ones(2)}, outdir / "tensors.pt")
    save_checkpoint(outdir / "good.pt", optim)  # (a barrier: tensors.pt is written)
    out = {
        "dir": str(outdir),
        "missing": _outcome(lambda: load_checkpoint(outdir / "missing.pt", optim)),
        "directory": _outcome(lambda: load_checkpoint(outdir, optim)),
        "text": _outcome(lambda: load_checkpoint(outdir / "text.pt", optim)),
        "tensors": _outcome(lambda: load_checkpoint(outdir / "tensors.pt", optim)),
        "rank_1": _outcome(lambda: _load_on_a_cuda_less_rank_1(outdir / "good.pt", optim)),
        "save": _outcome(lambda: save_checkpoint(outdir / "no" / "such.pt", optim)),
    }
    out["untouched"] = pyro.param("w").detach().clone()
    pyro.param("w").data.fill_(-1.0)
    out["good"] = _outcome(lambda: load_checkpoint(outdir / "good.pt", optim))
    out["restored"] = pyro.param("w").detach().clone()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    return spawn_ranks(_scenarios, tmp_path_factory.mktemp("ckpt_errors"), timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(
    ("case", "name", "kind", "reason"),
    [
        ("missing", "missing.pt", "FileNotFoundError", "No such file or directory"),
        ("directory", "", "IsADirectoryError", "Is a directory"),
    ],
)
def test_a_file_rank_0_cannot_read_raises_the_same_on_every_rank(ranks, case, name, kind, reason):
    """The error rank 0 met reading (a missing file, a directory), naming the path and the fix,
    raised on both ranks alike."""
    path = str(Path(ranks[0]["dir"], name))
    assert (
        ranks[0][case]
        == ranks[1][case]
        == (
            kind,
            f"load_checkpoint: rank 0 cannot read {path!r} ({reason}); rank 0 reads the checkpoint "
            "for every rank: pass a path that rank 0 can read",
        )
    )


@pytest.mark.parametrize(
    ("case", "why"),
    [("text", "UnpicklingError: invalid load key, 'n'."), ("tensors", "no format")],
)
def test_a_file_that_is_not_a_checkpoint_raises_the_same_on_every_rank(ranks, case, why):
    """A text file (torch.load refuses it) and a torch file of other contents (the format check
    refuses it): a ValueError naming the file and what it should be, the same on both ranks."""
    for rank in ranks:
        kind, message = rank[case]
        assert kind == "ValueError", message
        assert f"{case}.pt" in message and why in message, message
        assert "pass a file written by save_checkpoint" in message, message
    assert ranks[0][case] == ranks[1][case]


def test_a_load_failing_on_one_rank_raises_on_every_rank(ranks):
    """Rank 1 cannot load the file (no CUDA for a GPU fit's tensors): rank 1 raises it, rank 0
    raises the same type with rank 1's message, and both go on in step."""
    path = str(Path(ranks[0]["dir"], "good.pt"))
    kind_1, message_1 = ranks[1]["rank_1"]
    assert kind_1 == "ValueError", message_1
    assert message_1.startswith(
        f"load_checkpoint: torch.load cannot load {path!r} (RuntimeError: {CUDA_LESS}); "
        "pass a file written by save_checkpoint, on ranks that have the devices"
    )
    assert ranks[0]["rank_1"] == (
        "ValueError",
        f"load_checkpoint: loading {path!r} raised on rank(s) [1]; rank 1: {message_1}",
    )


def test_a_save_rank_0_cannot_write_raises_on_every_rank(ranks):
    """A folder that does not exist: rank 0's write failed before the barrier, and rank 1 waited
    there (gloo: a bare connection error once rank 0's process ended; a live rank 0: the
    timeout). Rank 0 raises torch's error reworded to name the file and the fix (torch's own
    names the folder only); rank 1 the same type, naming the file and rank 0's message."""
    path = str(Path(ranks[0]["dir"], "no", "such.pt"))
    kind_0, message_0 = ranks[0]["save"]
    assert kind_0 == "RuntimeError", message_0
    assert message_0 == (
        f"save_checkpoint: rank 0 cannot write {path!r} (Parent directory "
        f"{Path(path).parent} does not exist.); rank 0 writes the checkpoint for every rank: "
        "pass a path in a folder that exists and that rank 0 can write"
    )
    assert ranks[1]["save"] == (
        kind_0,
        f"save_checkpoint: writing {path!r} on rank 0 raised on rank(s) [0]; rank 0: {message_0}",
    )


def test_failed_loads_leave_the_param_store_and_the_ranks_in_step(ranks):
    """After five refused loads and a refused save the param store still holds w = 3, and a
    good checkpoint, loaded over w = -1, restores w = 3 on both ranks (ranks out of step would
    hang or fail here)."""
    for rank in ranks:
        assert rank["untouched"].tolist() == [3.0, 3.0]
        assert rank["good"] == ("ok", "")
        assert rank["restored"].tolist() == [3.0, 3.0]
