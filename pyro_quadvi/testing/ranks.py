"""Run a function on two (or more) gloo ranks on the loopback interface, for the tests.

`run_ranks` spawns the processes, each joins a process group, runs ``scenarios(outdir)``
and saves what it returned; the caller gets every rank's result, or a failure after
``timeout_s`` (the processes are killed then, so a hang never outlives the test).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RanksFailed", "outcome", "run_ranks"]


class RanksFailed(RuntimeError):
    """The processes did not all finish within the time limit."""


def _worker(
    rank: int,
    scenarios: Callable[[Path], Any],
    rendezvous: str,
    outdir: str,
    world_size: int,
    timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        results = scenarios(Path(outdir))
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(outdir) / f"rank{rank}.pt")


def run_ranks(
    scenarios: Callable[[Path], Any],
    outdir: Path,
    *,
    world_size: int = 2,
    timeout_s: float = 120.0,
) -> list:
    """Every rank's ``scenarios(outdir)``, run in ``world_size`` spawned gloo processes.

    Args:
        scenarios: a module-level function (spawned processes import it by name).
        outdir: a directory for the results (and whatever the scenarios write).
        world_size: the number of processes.
        timeout_s: the process group's timeout, and the time all ranks get to finish.

    Raises:
        RanksFailed: when the processes did not finish within ``timeout_s`` (they are killed).
        torch.multiprocessing.ProcessRaisedException: when a scenario raised.
    """
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # a file store in outdir, not a TCP port: a port found free here could be taken (by the
    # processes of a test running beside this one) before the spawned ranks bind it
    rendezvous = Path(outdir) / ".rendezvous"
    rendezvous.unlink(missing_ok=True)  # a file store is for one process group only
    try:
        context = mp.start_processes(
            _worker,
            args=(scenarios, str(rendezvous), str(outdir), world_size, timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise RanksFailed(f"the {world_size} processes did not finish in {timeout_s} s")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def outcome(run: Callable[[], Any]) -> tuple:
    """What ``run()`` gave on a rank, as a result the test process can compare: ``("ok", its
    value)``, or the ``ValueError`` or ``RuntimeError`` it raised as ``(type name, message)``
    (any other error fails the rank)."""
    try:
        return ("ok", run())
    except (ValueError, RuntimeError) as error:
        return (type(error).__name__, str(error))
