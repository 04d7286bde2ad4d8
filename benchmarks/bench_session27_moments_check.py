"""Session 27: the cost of QNVB's check of published moments against its gradients.

QNVB compares the moments ``QuadratureELBO`` published for each Gaussian block with the gradients
it is handed (`QNVB._entropy_weights`: the loc's gradient against ``s g``, the entropy weight
``sigma^2 h - sigma dL/dsigma / s``, at up to ``CHECKED_COORDINATES`` coordinates a block), once a
step, before it steps on them. This times, on a `BayesianModule` with `AutoMeanFieldNormal`
(``--widths``: 784-400-400-10, 478,410 coordinates in 6 blocks, or 1-50-1, 151 in 4; random
data, batch 256, unit Gaussian prior, the default rule), one ``svi.step`` and the check on the
moments and gradients of one backward pass. CPU times, one thread, medians of ``--repeats``.

    PYTHONPATH=. python benchmarks/bench_session27_moments_check.py [--repeats 7 --steps 5]
        [--widths 784-400-400-10]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from bench_session24_checks import cpu_time, network_case

from pyro_quadvi.guides.interface import published_moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--widths", default="784-400-400-10", help="the network's layer widths")
    args = parser.parse_args()
    torch.set_num_threads(1)
    svi, (x, y), _ = network_case([int(w) for w in args.widths.split("-")], 256, classes=True)
    params = list(svi.guide.parameters())
    times: dict[str, list[float]] = {"step": [], "check": []}
    for _ in range(args.repeats):
        times["step"].append(cpu_time(lambda: svi.step(x, y), args.steps))
        svi.loss_and_grads(svi.model, svi.guide, x, y)
        published = [m for m in map(published_moments, params) if m is not None]
        check = functools.partial(svi.optim._entropy_weights, published)
        assert all(c == 1.0 for c in check())  # one QuadratureELBO: nothing divided
        times["check"].append(cpu_time(check, 4 * args.steps))
        for p in params:
            p.grad = None
    ms = {key: 1000 * statistics.median(value) for key, value in times.items()}
    coordinates = sum(m.g.numel() for m in published)
    print("| network | blocks | coordinates | step (ms) | moments' check (ms) |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| {args.widths}, batch 256 | {len(published)} | {coordinates:,} | {ms['step']:.2f} "
        f"| {ms['check']:.2f} ({ms['check'] / ms['step']:.1%}) |"
    )


if __name__ == "__main__":
    main()
