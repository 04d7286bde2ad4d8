"""The eager QNVB update (``qnvb_update_many``) at several chunk sizes: time and peak memory.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_update_chunks.py [--repeats 9]
        [--chunks 12 14 16 18 20 40] [--nets 784-400-400-10 1024-1800-1800-10]
        [--modes pure in-place] [--count-ops]

On each network's parameter shapes (``bench_bnn_speed.CASES``), the update alone with the inputs
of ``bench_bnn_speed.py --update-only`` (``g`` standard normal, ``h`` uniform on ``[0, 1e-3]``,
weight ``1e4``, prior precision 1, QNVB's own settings), each update fed the previous one's
results (as the optimizers do: the means, scales and states are then pieces of one buffer per
field; ``g`` and ``h`` are separate tensors). For each chunk size ``2^k``
(``qnvb_functional._CHUNK``; ``2^40``: one chunk, the rules on the whole flat buffer at once):
the median CPU time (``time.process_time``) of ``--repeats`` updates after two warm-up updates,
and the peak of the update's CPU allocations (``bench_bnn_speed.live_at_peak``, least of 2), in
MiB and in parameters P (float32: 4 bytes each). The results alone are 10 P (mean, scale, eight
state fields).

``--modes``: ``pure`` (the default call: new results) and ``in-place`` (``donate=("mu", "sigma",
"state")``, as ``QNVBOptimizer`` runs it: the results written over the inputs, no new buffer;
its first warm-up update is pure, as the optimizer's first step, so that the means, scales and
states are pieces of one buffer per field).
A package whose ``qnvb_update_many`` takes no ``donate`` (before session 15, on ``PYTHONPATH``)
runs ``pure`` only.

``--count-ops`` prints instead, per network and mode, the operator calls of one update at the
default chunk (after two updates), by aten operator, from a ``TorchDispatchMode``: every call
but views, slices and reshapes (which move no data), per chunk of the update.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import statistics
import time

import torch
from bench_bnn_speed import CASES, live_at_peak
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_quadvi.optim import qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update_many,
)

#: mode -> what ``qnvb_update_many`` is given to write over (``donate``)
MODES = {"pure": (), "in-place": ("mu", "sigma", "state")}


def run_mode(params, gs, hs, hp, donate, repeats: int) -> tuple[float, int]:
    """The median CPU ms of ``repeats`` updates (after two warm-up updates, the first pure), each
    fed the last's results, and the least peak of two more."""
    run = {
        "mus": [p.clone() for p in params],
        "sigmas": [torch.full_like(p, 1e-2) for p in params],
        "states": [init_qnvb_state(p) for p in params],
    }

    def update(donate=donate) -> None:
        extra = {"donate": donate} if donate else {}
        results = qnvb_update_many(
            run["mus"], run["sigmas"], gs, hs, run["states"], hp, 1e4, 1.0, **extra
        )
        run["mus"] = [r.mu for r in results]
        run["sigmas"] = [r.sigma for r in results]
        run["states"] = [r.state for r in results]

    update(())  # pure, as QNVBOptimizer's first step: the results are pieces of one buffer
    update()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        update()
        times.append(time.process_time() - start)
    peak = min(live_at_peak(update)[0] for _ in range(2))
    return statistics.median(times) * 1e3, peak


#: aten operators that move no data (views), left out of ``--count-ops``
VIEWS = frozenset(
    {"view", "slice", "_unsafe_view", "unbind", "split_with_sizes", "alias", "as_strided"}
)


class CountOps(TorchDispatchMode):
    """Counts the aten operator calls made under it, by operator."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(name, params, gs, hs, hp, modes) -> None:
    """``--count-ops``: the operator calls of one update per chunk, by mode."""
    chunks = -(-sum(p.numel() for p in params) // qnvb_functional._CHUNK)
    for mode in modes:
        extra = {"donate": MODES[mode]} if MODES[mode] else {}
        mus, sigmas = [p.clone() for p in params], [torch.full_like(p, 1e-2) for p in params]
        states = [init_qnvb_state(p) for p in params]
        for warm_up in (True, False):  # the first pure, as in run_mode
            results = qnvb_update_many(
                mus, sigmas, gs, hs, states, hp, 1e4, 1.0, **({} if warm_up else extra)
            )
            mus, sigmas = [r.mu for r in results], [r.sigma for r in results]
            states = [r.state for r in results]
        with CountOps() as counter:
            qnvb_update_many(mus, sigmas, gs, hs, states, hp, 1e4, 1.0, **extra)
        moving = {k: v for k, v in counter.counts.items() if k not in VIEWS}
        top = ", ".join(
            f"{k} {v / chunks:.1f}" for k, v in sorted(moving.items(), key=lambda kv: -kv[1])
        )
        print(f"| {name} | {mode} | {chunks} | {sum(moving.values()) / chunks:.1f} | {top} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--chunks", type=int, nargs="+", default=[12, 14, 16, 18, 20, 40])
    parser.add_argument(
        "--nets", nargs="+", choices=list(CASES), default=["784-400-400-10", "1024-1800-1800-10"]
    )
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="see the module"
    )
    parser.add_argument("--count-ops", action="store_true", help="see the module")
    args = parser.parse_args()
    if "donate" not in inspect.signature(qnvb_update_many).parameters:
        args.modes = [mode for mode in args.modes if not MODES[mode]]  # an older package
    torch.set_num_threads(1)
    hp = QNVBHyperparameters()
    default = qnvb_functional._CHUNK
    timing_header = (
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, default chunk "
        f"2^{default.bit_length() - 1}\n\n| network | parameters P | chunk | mode | update ms | "
        "peak MiB | peak / P |\n|---|---:|---:|---|---:|---:|---:|"
    )
    if not args.count_ops:
        print(timing_header)
    else:
        print("\n| network | mode | chunks | operator calls per chunk | by operator |")
        print("|---|---|---:|---:|---|")
    for key in args.nets:
        name, make, *_ = CASES[key]
        torch.manual_seed(0)
        params = [p.detach() for p in make().parameters()]
        count = sum(p.numel() for p in params)
        gs = [torch.randn_like(p) for p in params]
        hs = [torch.rand_like(p) * 1e-3 for p in params]
        if args.count_ops:
            count_ops(name, params, gs, hs, hp, args.modes)
            continue
        for k in args.chunks:
            qnvb_functional._CHUNK = 2**k
            for mode in args.modes:
                ms, peak = run_mode(params, gs, hs, hp, MODES[mode], args.repeats)
                print(
                    f"| {name} | {count:,} | 2^{k} | {mode} | {ms:.1f} | {peak / 2**20:.2f} | "
                    f"{peak / (4 * count):.2f} |",
                    flush=True,
                )
    qnvb_functional._CHUNK = default


if __name__ == "__main__":
    main()
