"""The training loss against the log evidence, and the Gauss-Hermite ELBO that bounds it.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_elbo_bound.py [--seeds 0 1 2]

docs/evidence.md ("The training loss, the ELBO and the evidence") quotes these figures. Two
models, each fitted by ``--steps`` steps of ``QNVB()`` with ``QuadratureELBO()`` (the default
rule, ``blocked_simplex``) and ``AutoMeanFieldNormal``, ``pyro.set_rng_seed(0)``:

* ``logistic``: a logistic regression with 3 coefficients (an intercept and two features, a
  standard normal prior) on 50 rows drawn from the data seed (true coefficients 0.5, 1, -1), one
  row per data seed. Over the last 100 steps: the standard deviation of the step loss, in how many
  of them ``-loss`` is above ``log p(x)`` and by how much at most. ``log p(x)`` is OPQA's
  (``opqa_evidence(..., num_points=16)``).
* ``normal-gamma``: the model of the docs block ``evidence-elbo-bound`` (30 rows, a Normal mean
  and precision), its ``log p(x)`` also OPQA's (``tests/test_evidence_bound.py`` checks the
  block's two figures against the closed-form evidence).

For each, ``ELBO - log p(x)``: the fitted guide's ELBO by ``QuadratureELBO(rule="gauss_hermite",
num_points=16).loss`` (its difference from 24 points in the next column), and the standard
deviation of ``rule="mc"`` with 4,096 points over ``--mc-repeats`` evaluations.
"""

from __future__ import annotations

import argparse
import statistics

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, opqa_evidence


def logistic(X, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Bernoulli(logits=(X * w).sum(-1)), obs=y)


def logistic_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.ones(50, 1), torch.randn(50, 2, generator=generator)], 1)
    p = torch.sigmoid(X @ torch.tensor([0.5, 1.0, -1.0]))
    return X, torch.bernoulli(p, generator=generator)


def normal_gamma(y):
    tau = pyro.sample("tau", dist.Gamma(2.0, 1.0))
    mu = pyro.sample("mu", dist.Normal(0.0, (0.25 * tau) ** -0.5))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, tau**-0.5), obs=y)


def normal_gamma_data() -> tuple[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.linspace(-1.0, 1.0, 30)
    return (0.5 - x + 1.5 * x**2 + 0.3 * torch.randn(30, generator=generator),)


def measure(model, args: tuple, steps: int, mc_repeats: int) -> dict[str, float]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    losses = [svi.step(*args) for _ in range(steps)]
    log_evidence = float(opqa_evidence(model, *args, num_points=16).log_evidence)
    above = [-loss - log_evidence for loss in losses[-100:]]
    elbo = {
        m: -QuadratureELBO(rule="gauss_hermite", num_points=m).loss(model, guide, *args)
        for m in (16, 24)
    }
    mc = QuadratureELBO(rule="mc", num_points=4096)
    mc_elbos = [-mc.loss(model, guide, *args) for _ in range(mc_repeats)]
    return {
        "log_evidence": log_evidence,
        "loss_sd": statistics.stdev(losses[-100:]),
        "steps_above": sum(a > 0 for a in above),
        "most_above": max(above),
        "elbo_gap": elbo[16] - log_evidence,
        "gh_error": abs(elbo[24] - elbo[16]),
        "mc_sd": statistics.stdev(mc_elbos) if mc_repeats > 1 else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="logistic data")
    parser.add_argument("--steps", type=int, default=400, help="fit steps (at least 100)")
    parser.add_argument("--mc-repeats", type=int, default=20, help="evaluations of rule='mc'")
    options = parser.parse_args()
    if options.steps < 100:
        parser.error(
            f"--steps must be at least 100 (the last 100 are summarized), got {options.steps}"
        )
    torch.set_default_dtype(torch.float64)
    runs = [
        (f"logistic, data seed {seed}", logistic, logistic_data(seed)) for seed in options.seeds
    ]
    runs.append(("normal-gamma", normal_gamma, normal_gamma_data()))
    print(
        "| model | log p(x) | loss sd | steps with -loss > log p(x) | largest excess | "
        "ELBO - log p(x) | GH 16 vs 24 points | MC sd (4,096 points) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, model, args in runs:
        r = measure(model, args, options.steps, options.mc_repeats)
        print(
            f"| {label} | {r['log_evidence']:.4f} | {r['loss_sd']:.3f} | "
            f"{r['steps_above']} of 100 | {r['most_above']:+.3f} | {r['elbo_gap']:+.4f} | "
            f"{r['gh_error']:.1e} | {r['mc_sd']:.3f} |"
        )


if __name__ == "__main__":
    main()
