"""Node generation at scale: time per node and peak memory per rule, relative to ``torch.randn``.

For each rule (all but ``gauss_hermite``) at ``d = 10^7`` coordinates in float32 (torch's default
dtype, what a model's parameters use):

* ``draw``: the time of ``rule.draw(dim)`` (the compact state of one quadrature: for VRMC it
  streams over the K draws to accumulate the mean and the scale);
* ``node``: the time of one ``node_set.node(k)`` after one draw (mean over ``k = 0 .. K-1``);
* ``state``: the bytes the NodeSet keeps between nodes (its tensors);
* ``peak``: the peak resident memory added by one ``draw`` followed by ``node(0) .. node(K-1)``,
  one node alive at a time, as a real evaluation loop would.

Each round times ``torch.randn(dim)``, the draw and the K nodes back to back; a ratio is the median
over ``--repeats`` rounds of the per-round ratio, so that rule and baseline share the machine's
load. Torch runs ``--threads`` intra-op threads (default 1). Peak memory is measured in a fresh
subprocess per rule: the increase of ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the high-water
mark of the resident set, which sees torch's CPU allocations, unlike ``tracemalloc``) across the
measured work, after torch and the rule are imported and warmed up on a small dimension; the
baseline is the same measurement around ``torch.randn(dim)`` in its own subprocess.

    python benchmarks/bench_nodes.py --dim 10000000 --repeats 7

``--before DIR`` prints instead a before/after table of the rules' own cost at ``--sizes``
coordinates (float32, one thread): ``make_rule(name, K).draw(P, step=i)``, its ``.matrix()`` and
one ``.node(k)`` (mean over k), for ``blocked_simplex`` (K = 3, unsigned and signed),
``rasp_simplex`` (K = 3) and ``hadamard`` (K = 4), timed with ``time.process_time`` (the CPU time
of the process, which leaves out waits for a core on a loaded machine). ``DIR`` holds the package
to compare with (``git archive <commit> pyro_quadvi | tar -x -C DIR``); each of ``--repeats``
rounds runs a fresh process on ``DIR``'s package and one on this tree's, in alternating order, each
timing every cell ``--inner`` times after one warm-up; a cell is the median over the rounds of
the processes' medians, a ratio the median over the rounds of after / before. The draws start
from ``torch.manual_seed(0)`` in both, so the two packages draw the same nodes; the worker checks
a checksum of each matrix, and the table says whether before and after agreed bit for bit.
``--profile`` adds ``torch.profiler``'s operators of this tree's ``blocked_simplex`` draw and
matrix at the largest size, by self CPU time.

    git archive HEAD~1 pyro_quadvi | tar -x -C /tmp/before
    python benchmarks/bench_nodes.py --before /tmp/before --sizes 478410 5000000 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from pyro_quadvi.quadrature import make_rule

RULES = ["rasp_simplex", "rasp_cross", "hadamard", "blocked_simplex", "mc", "vrmc1", "vrmc2"]
BASELINE = "randn"


def max_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def state_bytes(node_set) -> int:
    """Bytes of the tensors a NodeSet holds between nodes (weights excluded: K numbers)."""
    return sum(
        value.numel() * value.element_size()
        for key, value in vars(node_set).items()
        if isinstance(value, torch.Tensor) and key != "weights"
    )


def one_quadrature(rule, dim: int, generator: torch.Generator) -> None:
    node_set = rule.draw(dim, generator=generator)
    for k in range(len(node_set)):
        node = node_set.node(k)
        del node


def worker(name: str, dim: int, repeats: int, num_points: int | None, threads: int) -> dict:
    """Runs in a fresh process: peak memory first (before anything large was allocated), then
    the timings."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    if name == BASELINE:
        torch.randn(16, generator=generator)
        before = max_rss_bytes()
        sample = torch.randn(dim, generator=generator)
        peak = max_rss_bytes() - before
        del sample
        return {"name": name, "peak": peak}

    rule = make_rule(name, num_points)
    one_quadrature(rule, 16, generator)  # warm-up: imports, kernels
    before = max_rss_bytes()
    one_quadrature(rule, dim, generator)
    peak = max_rss_bytes() - before

    randn_times, draw_times, node_times = [], [], []
    state = 0
    for _ in range(repeats):
        start = time.perf_counter()
        sample = torch.randn(dim, generator=generator)
        randn_times.append(time.perf_counter() - start)
        del sample
        start = time.perf_counter()
        node_set = rule.draw(dim, generator=generator)
        draw_times.append(time.perf_counter() - start)
        state = state_bytes(node_set)
        start = time.perf_counter()
        for k in range(len(node_set)):
            node = node_set.node(k)
            del node
        node_times.append((time.perf_counter() - start) / len(node_set))
        del node_set
    return {
        "name": name,
        "K": rule.num_points,
        "peak": peak,
        "state": state,
        "randn": statistics.median(randn_times),
        "draw": statistics.median(d / r for d, r in zip(draw_times, randn_times)),
        "node": statistics.median(n / r for n, r in zip(node_times, randn_times)),
    }


#: the rules of the before/after table: (label, make_rule's name, K, keyword arguments)
COMPARED = [
    ("blocked_simplex (3)", "blocked_simplex", 3, {}),
    ("blocked_simplex signed (3)", "blocked_simplex", 3, {"random_signs": True}),
    ("rasp_simplex (3)", "rasp_simplex", 3, {}),
    ("hadamard (4)", "hadamard", 4, {}),
]
PARTS = ("draw", "matrix", "node")


def compare_worker(sizes: list[int], inner: int) -> dict:
    """Runs in a fresh process on one package: the median of ``inner`` timings of each rule's
    draw, matrix and node at each size, and a digest of each matrix's bytes."""
    import pyro_quadvi

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    cells, digests = {}, {}
    for label, name, num_points, kwargs in COMPARED:
        rule = make_rule(name, num_points, **kwargs)
        for size in sizes:
            torch.manual_seed(0)
            times = {part: [] for part in PARTS}
            for i in range(inner + 1):  # the first is a warm-up
                start = time.process_time()
                nodes = rule.draw(size, step=i)
                drawn = time.process_time()
                matrix = nodes.matrix()
                made = time.process_time()
                for k in range(len(nodes)):
                    nodes.node(k)
                done = time.process_time()
                if i == 0:
                    digest = hashlib.sha256(matrix.contiguous().numpy().tobytes()).hexdigest()
                    digests[f"{label} {size}"] = digest
                    continue
                times["draw"].append(drawn - start)
                times["matrix"].append(made - drawn)
                times["node"].append((done - made) / len(nodes))
                del matrix, nodes
            cells[f"{label} {size}"] = {p: statistics.median(t) for p, t in times.items()}
    return {"package": pyro_quadvi.__file__, "cells": cells, "digests": digests}


def profile_blocked(size: int) -> None:
    """torch.profiler's operators of three blocked_simplex draws and matrices."""
    from torch.profiler import ProfilerActivity, profile

    import pyro_quadvi

    torch.set_num_threads(1)
    rule = make_rule("blocked_simplex", 3)
    rule.draw(size).matrix()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(3):
            rule.draw(size, step=i).matrix()
    print(
        f"\ntorch.profiler, 3 x blocked_simplex (3) draw + matrix at P = {size} "
        f"({pyro_quadvi.__file__}):\n"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def compare(args) -> None:
    """The before/after table (see the module's docstring)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    packages = {"before": os.path.abspath(args.before), "after": here}
    runs = {"before": [], "after": []}
    for round_ in range(args.repeats):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for which in order:
            command = [sys.executable, __file__, "--compare-worker", "--inner", str(args.inner)]
            command += ["--sizes", *map(str, args.sizes)]
            env = {**os.environ, "PYTHONPATH": packages[which], "OMP_NUM_THREADS": "1"}
            output = subprocess.run(
                command, check=True, capture_output=True, text=True, env=env
            ).stdout
            runs[which].append(json.loads(output.strip().splitlines()[-1]))
    for which, results in runs.items():
        print(f"{which}: {results[0]['package']}")
    print(
        f"\nfloat32, torch {torch.__version__}, 1 thread, process time; ms, median of "
        f"{args.repeats} rounds x {args.inner} timings\n"
    )
    print(
        "| rule | P | draw before | draw after | matrix before | matrix after | "
        "node before | node after | draw + matrix after / before | same bits |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, *_ in COMPARED:
        for size in args.sizes:
            key = f"{label} {size}"
            ms = {
                (which, part): statistics.median(r["cells"][key][part] for r in runs[which]) * 1e3
                for which in runs
                for part in PARTS
            }
            ratio = statistics.median(
                (a["cells"][key]["draw"] + a["cells"][key]["matrix"])
                / (b["cells"][key]["draw"] + b["cells"][key]["matrix"])
                for a, b in zip(runs["after"], runs["before"])
            )
            same = {r["digests"][key] for results in runs.values() for r in results}
            print(
                f"| {label} | {size:,} | {ms['before', 'draw']:.1f} | {ms['after', 'draw']:.1f} | "
                f"{ms['before', 'matrix']:.1f} | {ms['after', 'matrix']:.1f} | "
                f"{ms['before', 'node']:.1f} | {ms['after', 'node']:.1f} | {ratio:.2f} | "
                f"{'yes' if len(same) == 1 else 'NO'} |"
            )
    if args.profile:  # in a process on this tree's package
        command = [sys.executable, __file__, "--profile-worker", "--sizes", str(max(args.sizes))]
        env = {**os.environ, "PYTHONPATH": here, "OMP_NUM_THREADS": "1"}
        print(subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout)


def run_worker(name: str, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--dim",
        str(args.dim),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    if args.num_points is not None:
        command += ["--num-points", str(args.num_points)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=10**7)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--num-points",
        type=int,
        default=None,
        help="K for every rule (default: each rule's default)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rules", nargs="+", default=RULES, choices=RULES)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--before",
        default=None,
        help="a directory holding the package to compare with: the before/after table instead",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[478_410, 5_000_000])
    parser.add_argument("--inner", type=int, default=5, help="timings per cell and process")
    parser.add_argument("--profile", action="store_true", help="with --before: profile the rule")
    parser.add_argument("--compare-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.profile_worker:
        profile_blocked(args.sizes[0])
        return
    if args.compare_worker:
        print(json.dumps(compare_worker(args.sizes, args.inner)))
        return
    if args.before is not None:
        compare(args)
        return
    if args.worker is not None:
        print(
            json.dumps(worker(args.worker, args.dim, args.repeats, args.num_points, args.threads))
        )
        return

    baseline = run_worker(BASELINE, args)
    results = [run_worker(name, args) for name in args.rules]
    mb = 1e6
    randn_ms = statistics.median(r["randn"] for r in results) * 1e3
    print(
        f"d = {args.dim:.0e}, float32, torch {torch.__version__}, {args.threads} thread(s), "
        f"median of {args.repeats}; torch.randn(d): {randn_ms:.1f} ms, "
        f"peak {baseline['peak'] / mb:.0f} MB\n"
    )
    print(
        "| rule | K | draw (x randn) | per node (x randn) | state (MB) | "
        "peak (MB) | peak (x randn) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['K']} | {r['draw']:.2f} | "
            f"{r['node']:.2f} | {r['state'] / mb:.0f} | {r['peak'] / mb:.0f} | "
            + (f"{r['peak'] / baseline['peak']:.2f} |" if baseline["peak"] else "- |")
        )


if __name__ == "__main__":
    main()
