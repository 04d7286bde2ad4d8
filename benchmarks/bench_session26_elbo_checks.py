"""What session 26's model checks in `DistributedQuadratureELBO` cost against the step they guard.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_session26_elbo_checks.py [--repeats 7]
        [--steps 5] [--quick]

With several ranks, the ELBO's one collective per step now carries three more numbers: the full
size of the model's first subsampled data plate, a fingerprint of every such plate's name and
size, and one of the Gaussian priors integrated in closed form (`_model_sections`); the watch of
the model's sites that finds the plates (`_WholePlateObservations`) now runs in node mode too. Their
CPU cost, in one process (the collective's three more float64 numbers are not timed: an
``all_gather`` of a few numbers costs its latency): the sections built from a step's plates and
priors, and one step run inside the watch against the same step without it, against one
``svi.step`` of QNVB on a `BayesianModule` (a unit Gaussian prior, the default rule, random data).

CPU times (``time.process_time``, one thread, the garbage collector off during each timed run),
medians of ``--repeats``. ``--quick`` runs a few seconds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_session24_checks import cpu_time, network_case

from pyro_quadvi.distributed import DistributedQuadratureELBO
from pyro_quadvi.distributed.elbo import _WholePlateObservations


def case(widths: list[int], batch: int, classes: bool, repeats: int, steps: int) -> dict:
    svi, data, _ = network_case(widths, batch, classes)
    elbo = DistributedQuadratureELBO()  # no process group: the sections are built by hand
    with _WholePlateObservations() as watch, torch.no_grad():
        elbo._quadrature_loss(svi.model, svi.guide, data, {})
    elbo._plate_sizes = watch.full_sizes
    assert elbo._plate_sizes and elbo._closed_priors, "no plate or prior to fingerprint"

    def watched_step():
        with _WholePlateObservations():
            svi.step(*data)

    step, watched, sections = [], [], []
    for _ in range(repeats):
        step.append(cpu_time(lambda: svi.step(*data), steps))
        watched.append(cpu_time(watched_step, steps))
        sections.append(cpu_time(elbo._model_sections, 100))
    return {
        "priors": len(elbo._closed_priors),
        "step_ms": 1e3 * statistics.median(step),
        "watch_ms": 1e3 * (statistics.median(watched) - statistics.median(step)),
        "sections_ms": 1e3 * statistics.median(sections),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, steps = (2, 1) if args.quick else (args.repeats, args.steps)
    torch.set_num_threads(1)
    cases = [("1-50-1, B=128", [1, 50, 1], 128, False)]
    if not args.quick:
        cases.append(("784-400-400-10, B=256", [784, 400, 400, 10], 256, True))
    print(
        "| network | closed-form priors | step (ms) | sections (ms) | sections / step "
        "| watch (ms, step inside it - step) |"
    )
    print("|---|---|---|---|---|---|")
    for name, widths, batch, classes in cases:
        row = case(widths, batch, classes, repeats, steps)
        print(
            f"| {name} | {row['priors']} | {row['step_ms']:.2f} | {row['sections_ms']:.4f} | "
            f"{row['sections_ms'] / row['step_ms']:.1e} | {row['watch_ms']:+.3f} |"
        )


if __name__ == "__main__":
    main()
