"""Diagnostics behind the reading of the QNVB benchmark (``docs/benchmarks.md``, ``docs/qnvb.md``).

One run on a problem of ``bench_qnvb.py``, printing the error metric and the damping divisor ``k``
(median and maximum over coordinates) at a few steps, and at the end the error of each coordinate
(mean error in units of the optimal sigma, and sigma over the optimal sigma).

* ``--damping-recovery`` sets the hyperparameter ``damping_recovery`` (how much ``k`` shrinks
  after a step without a sign change; default 0.5) to test the symmetric rule (1.0).
* ``--adam LR`` runs ClippedAdam with that learning rate (and ``--lrd``) instead of QNVB, on the
  same loss: a rule's bias shows as the same end point for both optimizers.

Usage::

    python benchmarks/qnvb_diagnostics.py --problem linear-d10-rho0.9 --loss trace --steps 6000
    python benchmarks/qnvb_diagnostics.py --problem linear-d10-rho0.9 --loss trace --steps 20000 \\
        --damping-recovery 1.0
    python benchmarks/qnvb_diagnostics.py --problem eight-schools --loss hadamard --steps 3000
    python benchmarks/qnvb_diagnostics.py --problem eight-schools --loss hadamard --steps 8000 \\
        --adam 0.01 --lrd 0.9995
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyro
import pyro.optim
import torch
from pyro.infer import SVI, Trace_ELBO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_qnvb import make_metric, mean_field, problems
from pyro_quadvi import QNVB, QuadratureELBO
from pyro_quadvi.guides import AutoMeanFieldNormal

CHECKPOINTS = (10, 30, 100, 300, 1000, 2000, 3000, 6000, 10000, 20000)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", required=True, choices=sorted(problems()))
    parser.add_argument("--loss", default="trace", help="'trace' (Trace_ELBO) or a rule name")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--damping-recovery", type=float, default=None)
    parser.add_argument("--adam", type=float, default=None, metavar="LR")
    parser.add_argument("--lrd", type=float, default=1.0, help="ClippedAdam's decay per step")
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float64)

    problem = problems()[args.problem]()
    metric, _, unit = make_metric(problem)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(problem.model)
    loss = Trace_ELBO() if args.loss == "trace" else QuadratureELBO(rule=args.loss)
    if args.adam is None:
        overrides = {}
        if args.damping_recovery is not None:
            overrides["damping_recovery"] = args.damping_recovery
        optimizer = QNVB(**overrides)
    else:
        optimizer = pyro.optim.ClippedAdam({"lr": args.adam, "lrd": args.lrd})
    svi = SVI(problem.model, guide, optimizer, loss)

    print(f"{args.problem}, loss {args.loss}, " + ("QNVB" if args.adam is None else "ClippedAdam"))
    print(f"\n| step | error ({unit}) | median k | max k |\n|---:|---:|---:|---:|")
    for step in range(1, args.steps + 1):
        svi.step()
        if step in CHECKPOINTS or step == args.steps:
            value = metric(*mean_field(guide, problem))
            if args.adam is None:
                pairs = optimizer.get_state()["qnvb"]["pairs"].values()
                k = torch.cat([state["damping"].reshape(-1) for state in pairs])
                median, largest = f"{k.median():.1f}", f"{k.max():.1f}"
            else:
                median = largest = "-"
            print(f"| {step} | {value:.3g} | {median} | {largest} |")
    if problem.mu is not None:
        mu, sigma = mean_field(guide, problem)
        torch.set_printoptions(precision=3, sci_mode=False, linewidth=100)
        print("\n(mu - mu*) / sigma*:", (mu - problem.mu) / problem.sigma)
        print("sigma / sigma*:    ", sigma / problem.sigma)


if __name__ == "__main__":
    main()
