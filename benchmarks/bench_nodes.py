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
"""

from __future__ import annotations

import argparse
import json
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
    args = parser.parse_args(argv)
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
