"""Session 26: the cost of checking a guide's description (`check_declaration`).

`describe_guide` checks the description of a hand-written guide (one whose
``quadrature_description`` is not the package's own) every time it reads it: once a step under
`QuadratureELBO`. The package's `AutoMeanFieldNormal` and the adapters of Pyro's guides are built
consistently and only pay `GuideDescription.check_layout` (run by every description). This
times, on a 784-400-400-10 `BayesianModule` with `AutoMeanFieldNormal` (random data, batch 256,
unit Gaussian prior, the default rule, QNVB), one `svi.step`, the layout check, and the whole
`check_declaration` applied to that guide's description as if it were hand-written (without a
trace), the densities the check of a traced draw adds (`densities`), and (session 27) the check
of a later read of the same guide (``owner=`` the guide, after a first full check: the layout
and ``loc`` and ``scale`` at 16 coordinates a block). CPU times, one thread, medians of
``--repeats``.

    PYTHONPATH=. python benchmarks/bench_session26_declaration.py [--repeats 7 --steps 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import pyro.distributions as dist
import torch
from bench_session24_checks import cpu_time, network_case

from pyro_quadvi.guides import GuideDescription
from pyro_quadvi.guides.interface import check_declaration, describe_guide, trace_for_description


def densities(description: GuideDescription) -> None:
    """What the check of a traced draw adds per block (`AutoMeanFieldNormal` draws a Delta at
    the model's site, so `check_declaration` would refuse its trace): the declared Normal pushed
    through ``transform`` and a draw's own distribution, each one ``log_prob`` at the loc."""
    with torch.no_grad():
        for site in description.sites:
            normal = dist.Normal(site.loc, site.scale).to_event(site.event_dim)
            value = site.transform(site.loc)
            dist.TransformedDistribution(normal, [site.transform]).log_prob(value).sum()
            normal.log_prob(site.loc).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    svi, (x, y), _ = network_case([784, 400, 400, 10], 256, classes=True)
    times = {"step": [], "layout": [], "declaration": [], "densities": [], "later": []}
    for _ in range(args.repeats):
        times["step"].append(cpu_time(lambda: svi.step(x, y), args.steps))
        # of the parameters after the steps
        description = describe_guide(svi.guide, trace_for_description(svi.guide, x, y=y))
        times["layout"].append(cpu_time(description.check_layout, 20 * args.steps))
        times["declaration"].append(
            cpu_time(functools.partial(check_declaration, description), args.steps)
        )
        times["densities"].append(cpu_time(functools.partial(densities, description), args.steps))
        check_declaration(description, owner=svi.guide)  # the first read: in full
        later = functools.partial(check_declaration, description, owner=svi.guide)
        times["later"].append(cpu_time(later, 20 * args.steps))
    ms = {key: 1000 * statistics.median(value) for key, value in times.items()}
    step = ms["step"]
    print(
        "| network | blocks | step (ms) | layout check (ms) | declaration, no trace (ms) "
        "| draws' densities (ms) | a later read's check (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| 784-400-400-10, batch 256 | {len(description.sites)} | {step:.2f} "
        f"| {ms['layout']:.4f} | {ms['declaration']:.2f} ({ms['declaration'] / step:.1%}) "
        f"| {ms['densities']:.2f} ({ms['densities'] / step:.1%}) "
        f"| {ms['later']:.3f} ({ms['later'] / step:.2%}) |"
    )


if __name__ == "__main__":
    main()
