"""Peak memory of one ``SVI`` + ``QNVB`` + ``QuadratureELBO`` step on a plain latent vector of ``D``
coordinates, in units of the vector's bytes (``4 D``, float32).

    OMP_NUM_THREADS=1 python benchmarks/bench_latent_memory.py [--sizes 100000 1000000 10000000]
        [--priors plain iid expand] [--guides mean_field diagonal] [--rss] [--held 1000000]
        [--json rows.json]

The model is ``w ~ prior`` over ``D`` coordinates and five observations ``y ~ Normal(w[:5], 1)``;
the prior is

- **plain**: ``dist.Normal(torch.zeros(D), 1.0).to_event(1)``;
- **iid**: the package's ``IidNormal.of(0.0, 1.0, torch.zeros(D)).to_event(1)``, which
  ``QuadratureELBO`` integrates in closed form (not at the nodes);
- **expand**: ``dist.Normal(0.0, 1.0).expand([D]).to_event(1)``;

and the guide ``AutoMeanFieldNormal`` (**mean_field**) or Pyro's ``AutoDiagonalNormal``
(**diagonal**), under ``QNVB()`` and ``QuadratureELBO()`` with its default rule
(``blocked_simplex``, K = 3 nodes). After two warm-up steps (the first checks the vectorized pass
against single evaluations; the optimizer makes its state) each cell is measured three ways with
``torch.profiler`` (``cpu_peak_bytes`` of ``pyro_quadvi.testing.memory``: the most CPU bytes held
at once beyond what was held before the call; deterministic):

- **step**: one ``svi.step()``;
- **elbo**: the ELBO's ``loss_and_grads`` alone;
- **optim**: the optimizer's step alone (``svi.optim`` on the parameters, after a
  ``loss_and_grads`` outside the measurement), as ``SVI.step`` calls it.

``--rss`` adds **rss**: the growth of the resident set's high-water mark (``VmHWM`` of
``/proc/self/status``, reset by writing 5 to ``/proc/self/clear_refs``) over one more step,
beyond the resident set before it: a cross-check that sees every allocation, and also the
allocator's reuse of freed pages (a step can reuse memory the process holds already, so it may
read lower than the profiler's figure).
``--held D`` prints, for each prior and guide at ``D`` coordinates, what one step holds at its peak
grouped by the allocating operator (``live_at_peak`` of ``bench_bnn_speed.py``).
"""

from __future__ import annotations

import argparse
import json

import pyro
import pyro.distributions as dist
import torch
from bench_bnn_speed import live_at_peak
from pyro.infer import SVI
from pyro.infer.autoguide import AutoDiagonalNormal
from pyro.infer.util import zero_grads
from pyro.poutine import trace

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributions import IidNormal
from pyro_quadvi.testing.memory import cpu_peak_bytes

PRIORS = ("plain", "iid", "expand")
GUIDES = {"mean_field": AutoMeanFieldNormal, "diagonal": AutoDiagonalNormal}


def make_model(prior: str, dim: int):
    observed = torch.linspace(-1.0, 1.0, 5)

    def model():
        if prior == "plain":
            fn = dist.Normal(torch.zeros(dim), 1.0).to_event(1)
        elif prior == "iid":
            fn = IidNormal.of(0.0, 1.0, torch.zeros(dim)).to_event(1)
        else:
            fn = dist.Normal(0.0, 1.0).expand([dim]).to_event(1)
        w = pyro.sample("w", fn)
        pyro.sample("y", dist.Normal(w[..., :5], 1.0).to_event(1), obs=observed)

    return model


def set_up(prior: str, guide_name: str, dim: int):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = make_model(prior, dim)
    guide = GUIDES[guide_name](model)
    guide()  # its parameters
    return SVI(model, guide, QNVB(), QuadratureELBO()), model, guide


def captured_loss_and_grads(svi: SVI, model, guide) -> set[torch.Tensor]:
    """The ELBO's ``loss_and_grads``, and the parameters it reached (as ``SVI.step`` finds them)."""
    with trace(param_only=True) as captured:
        svi.loss_and_grads(model, guide)
    return {site["value"].unconstrained() for site in captured.trace.nodes.values()}


def resident_peak(fn) -> int | None:
    """The growth of the resident set's high-water mark (``VmHWM``) while ``fn()`` runs, beyond the
    resident set before it (the mark reset through ``/proc/self/clear_refs``); ``None`` where the
    kernel offers no reset."""

    def status(field: str) -> int:
        with open("/proc/self/status") as file:
            line = next(line for line in file if line.startswith(field))
        return int(line.split()[1]) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        return None
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def profiled(prior: str, guide_name: str, dim: int, resident: bool) -> dict[str, float]:
    svi, model, guide = set_up(prior, guide_name, dim)
    svi.step()
    svi.step()
    unit = 4 * dim
    result = {"step": cpu_peak_bytes(svi.step) / unit}
    params: set[torch.Tensor] = set()
    result["elbo"] = (
        cpu_peak_bytes(lambda: params.update(captured_loss_and_grads(svi, model, guide))) / unit
    )
    result["optim"] = cpu_peak_bytes(lambda: svi.optim(params)) / unit
    zero_grads(params)
    if resident:
        grown = resident_peak(svi.step)
        result["rss"] = float("nan") if grown is None else grown / unit
    return result


def held_table(dim: int, priors, guides) -> None:
    for prior in priors:
        for guide_name in guides:
            svi, *_ = set_up(prior, guide_name, dim)
            svi.step()
            svi.step()
            peak, held = live_at_peak(svi.step)
            print(
                f"\nHeld at the peak of one step, {prior} prior, {guide_name} guide, D = {dim:,} "
                f"(units of 4 D bytes; peak {peak / (4 * dim):.2f}):\n\n"
                "| allocated by | held |\n|---|---:|"
            )
            for made_by, nbytes in sorted(held.items(), key=lambda item: -item[1]):
                if nbytes >= 0.25 * 4 * dim:
                    print(f"| {made_by} | {nbytes / (4 * dim):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    parser.add_argument("--priors", nargs="+", choices=PRIORS, default=list(PRIORS))
    parser.add_argument("--guides", nargs="+", choices=list(GUIDES), default=list(GUIDES))
    parser.add_argument("--rss", action="store_true")
    parser.add_argument("--held", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, pyro {pyro.__version__}; peak bytes over 4 D (float32 "
        "latent vector), default rule (K = 3)\n\n| prior | guide | D | step | elbo | optim |"
        + (" rss |" if args.rss else "")
        + "\n|---|---|---:|---:|---:|---:|"
        + ("---:|" if args.rss else "")
    )
    rows = []
    for dim in args.sizes:
        for prior in args.priors:
            for guide_name in args.guides:
                row = {"prior": prior, "guide": guide_name, "dim": dim}
                row.update(profiled(prior, guide_name, dim, args.rss))
                rows.append(row)
                cells = " | ".join(
                    f"{row[key]:.2f}" for key in ("step", "elbo", "optim", "rss") if key in row
                )
                print(f"| {prior} | {guide_name} | {dim:,} | {cells} |", flush=True)
    if args.held:
        held_table(args.held, args.priors, args.guides)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
