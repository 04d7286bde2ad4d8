"""What the probes' tolerance decides, and what a wrong decision costs (session 16).

For a few networks at their guide's default start (float32, generated data), one
``QuadratureELBO`` step with ``vectorize=None``: the largest relative disagreement of the probes
(site by site, the vectorized pass against single evaluations at nodes 0 and K - 1), whether
the session's rule (`probe_tolerance`, relative to each tensor's largest value) keeps the pass,
whether the old one (``rtol = atol = 1e-6``) would have, and the time of a step evaluated in one
pass against one that loops over the nodes (what a false fallback costs), as the median of
``--repeats`` steps after two warm-up steps, in the same run.

    OMP_NUM_THREADS=1 python benchmarks/bench_probe_tolerance.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from bench_bnn_speed import make_net
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides.interface import describe_guide
from pyro_quadvi.infer.batched import BatchMismatch, probe_tolerance
from pyro_quadvi.infer.log_joint import LogJoint
from pyro_quadvi.nn import BayesianModule, likelihoods, priors

NETS = {
    "784-100-100-10, B=128": ([784, 100, 100, 10], 128, "categorical"),
    "784-400-400-10, B=128": ([784, 400, 400, 10], 128, "categorical"),
    "784-400-400-400-10, B=128": ([784, 400, 400, 400, 10], 128, "categorical"),
    "13-50-1, B=64": ([13, 50, 1], 64, "gaussian"),
}


def build(widths: list[int], rows: int, kind: str, vectorize: bool | None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.rand(rows, widths[0])
    net = make_net(widths, nn.ReLU)
    if kind == "categorical":
        y, likelihood = torch.randint(0, widths[-1], (rows,)), likelihoods.Categorical(8000)
    else:
        y, likelihood = torch.randn(rows, 1), likelihoods.Gaussian(8000, scale=0.5)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihood)
    guide = AutoMeanFieldNormal(bnn)
    elbo = QuadratureELBO("hadamard", 4, vectorize=vectorize)
    return bnn, guide, elbo, x, y


def disagreement(bnn, guide, elbo, x, y) -> tuple[float, float, bool]:
    """The probes' largest relative disagreement over the sites (to each term's largest value)
    and over the total, and whether the old rule (``allclose`` of the total at 1e-6) held."""
    guide(x, y)
    description = describe_guide(guide)
    with torch.no_grad():
        nodes = elbo.rule.nodes(description.loc.numel(), step=0)[0]
        z = description.affine(nodes.to(description.loc.dtype))
    joint = LogJoint(bnn, description.latent_sites)
    ends = z[[0, -1]]
    batched = joint(ends, (x, y), by_site=True)
    single = [joint(point[None], (x, y), vectorize=False, by_site=True) for point in ends]
    site_rel = max(
        float((batched[name][i] - single[i][name][0]).abs() / single[i][name][0].abs())
        for i in range(2)
        for name in batched
    )
    totals = [sum(t.values()) for t in single]
    total_b = sum(batched.values())
    total_rel = max(float((total_b[i] - totals[i][0]).abs() / totals[i][0].abs()) for i in range(2))
    old = all(torch.allclose(total_b[i], totals[i][0], rtol=1e-6, atol=1e-6) for i in range(2))
    return site_rel, total_rel, old


def step_time(widths, rows, kind, vectorize: bool, repeats: int) -> float:
    bnn, guide, elbo, x, y = build(widths, rows, kind, vectorize)
    svi = SVI(bnn, guide, QNVB(), elbo)
    svi.step(x, y)
    svi.step(x, y)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        svi.step(x, y)
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nets", nargs="*", choices=list(NETS), default=list(NETS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tolerance = probe_tolerance(torch.float32)
    print(f"float32 probe tolerance {tolerance:.3g}; CPU ms per step, median of {args.repeats}\n")
    print(
        "| net | site rel. diff. | total rel. diff. | kept now | kept by 1e-6 | one pass (ms) "
        "| loop (ms) | loop / pass |"
    )
    print("|---|---:|---:|---|---|---:|---:|---:|")
    for name in args.nets:
        widths, rows, kind = NETS[name]
        site_rel, total_rel, old = disagreement(*build(widths, rows, kind, None))
        loop = step_time(widths, rows, kind, False, args.repeats) * 1e3
        try:
            one = step_time(widths, rows, kind, True, args.repeats) * 1e3
        except BatchMismatch:  # refused by the probes: no one-pass step to time
            one_cell, ratio_cell = "refused", "-"
        else:
            one_cell, ratio_cell = f"{one:.1f}", f"{loop / one:.2f}"
        print(
            f"| {name} | {site_rel:.2g} | {total_rel:.2g} | {site_rel <= tolerance} | {old} "
            f"| {one_cell} | {loop:.1f} | {ratio_cell} |"
        )


if __name__ == "__main__":
    main()
