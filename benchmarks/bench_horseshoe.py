"""Horseshoe regression, centred and non-centred: QNVB against Adam, and the training loss's bias.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_horseshoe.py [--quick]

docs/benchmarks.md ("Horseshoe regression: centred and non-centred (session 20)") and
docs/qnvb.md (Limitations) quote these figures. The data: 100 rows, 20 standard normal features
(generator seed 7), coefficients 2, -1.5, 1 on the first three and 0 on the other 17, noise sd
0.5. The model: `tau ~ HalfCauchy(1)`, `lambda_j ~ HalfCauchy(1)`, `sigma ~ HalfNormal(1)`,
`y ~ N(X beta, sigma)`, with `beta_j ~ N(0, tau lambda_j)` (centred) or `beta_j = tau lambda_j z_j`,
`z_j ~ N(0, 1)` (non-centred). The two forms have the same evidence, so their -ELBOs compare.

Each row fits `AutoMeanFieldNormal` from `pyro.set_rng_seed(0)`: QNVB() with
`QuadratureELBO(rule)` for each of `--rules`, or Pyro's Adam at each of `--adam-lrs` with
`Trace_ELBO()` (one particle), `--steps` steps. At the fitted guide:

* `-ELBO (MC)`: `QuadratureELBO(rule="mc", num_points=--mc-points).loss`, the mean of
  `--mc-repeats` evaluations, with the standard deviation of one evaluation;
* `quad loss`: the row's own training loss (`QuadratureELBO(rule).loss`, QNVB rows only), the
  mean of `--mc-repeats` evaluations, and its difference from the MC figure (negative: the training
  loss is optimistic);
* `tau`: the median of `--draws` draws of `tau` from the guide; `null max abs mean`: the largest
  absolute posterior mean of the 17 null coefficients; `signals`: the means of the first three.
"""

from __future__ import annotations

import argparse
import statistics

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO

ROWS, FEATURES = 100, 20
SIGNALS = (2.0, -1.5, 1.0)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    X = torch.randn(ROWS, FEATURES, generator=generator)
    beta = torch.zeros(FEATURES)
    beta[: len(SIGNALS)] = torch.tensor(SIGNALS)
    return X, X @ beta + 0.5 * torch.randn(ROWS, generator=generator)


def centred(X, y):
    tau = pyro.sample("tau", dist.HalfCauchy(1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("coef", X.shape[1]):
        lam = pyro.sample("lam", dist.HalfCauchy(1.0))
        beta = pyro.sample("beta", dist.Normal(0.0, tau * lam))
    mu = (X * beta.unsqueeze(-2)).sum(-1)
    with pyro.plate("rows", X.shape[0]):
        pyro.sample("y", dist.Normal(mu, sigma), obs=y)


def noncentred(X, y):
    tau = pyro.sample("tau", dist.HalfCauchy(1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("coef", X.shape[1]):
        lam = pyro.sample("lam", dist.HalfCauchy(1.0))
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
    beta = pyro.deterministic("beta", tau * lam * z, event_dim=1)
    mu = (X * beta.unsqueeze(-2)).sum(-1)
    with pyro.plate("rows", X.shape[0]):
        pyro.sample("y", dist.Normal(mu, sigma), obs=y)


FORMS = {"centred": centred, "non-centred": noncentred}


def fit(model, args, method: str, setting, steps: int) -> AutoMeanFieldNormal:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    if method == "QNVB":
        svi = SVI(model, guide, QNVB(), QuadratureELBO(setting))
    else:
        svi = SVI(model, guide, pyro.optim.Adam({"lr": setting}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return guide


def losses(model, guide, args, elbo: QuadratureELBO, repeats: int) -> list[float]:
    pyro.set_rng_seed(1)
    with torch.no_grad():
        return [elbo.loss(model, guide, *args) for _ in range(repeats)]


def summary(model, guide, args, num_draws: int) -> tuple[float, float, list[float]]:
    pyro.set_rng_seed(2)
    with torch.no_grad():
        predictive = Predictive(
            model, guide=guide, num_samples=num_draws, return_sites=["tau", "beta"]
        )
        draws = predictive(*args)
    means = draws["beta"].reshape(num_draws, FEATURES).mean(0)
    null = means[len(SIGNALS) :].abs().max().item()
    return draws["tau"].median().item(), null, means[: len(SIGNALS)].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    parser.add_argument("--rules", nargs="*", default=["blocked_simplex", "hadamard", "rasp_cross"])
    parser.add_argument("--adam-lrs", nargs="*", type=float, default=[0.01, 0.03])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--mc-points", type=int, default=4096)
    parser.add_argument("--mc-repeats", type=int, default=10)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a test: one rule, one lr, 10 steps, 2 evaluations of 256 points, 200 draws",
    )
    a = parser.parse_args()
    if a.quick:
        a.rules, a.adam_lrs = a.rules[:1], a.adam_lrs[-1:]
        a.steps, a.mc_points, a.mc_repeats, a.draws = 10, 256, 2, 200
    torch.set_num_threads(1)
    args = data()
    mc = QuadratureELBO(rule="mc", num_points=a.mc_points)
    print(
        f"horseshoe regression, {ROWS} rows, {FEATURES} features, {len(SIGNALS)} signals; "
        f"{a.steps} steps; MC -ELBO of {a.mc_points} points x {a.mc_repeats}"
    )
    print(
        "| form | method | -ELBO (MC) | sd of one | quad loss | quad - MC | tau | "
        "null max abs mean | signals |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    runs = [("QNVB", rule) for rule in a.rules] + [("Adam", lr) for lr in a.adam_lrs]
    for form in a.forms:
        model = FORMS[form]
        for method, setting in runs:
            guide = fit(model, args, method, setting, a.steps)
            mc_losses = losses(model, guide, args, mc, a.mc_repeats)
            mc_mean, mc_sd = statistics.mean(mc_losses), statistics.stdev(mc_losses)
            if method == "QNVB":
                own = statistics.mean(
                    losses(model, guide, args, QuadratureELBO(setting), a.mc_repeats)
                )
                quad = f"{own:.2f} | {own - mc_mean:+.2f}"
                label = f"QNVB, {setting}"
            else:
                quad, label = "- | -", f"Adam lr {setting}, Trace_ELBO"
            tau, null, signals = summary(model, guide, args, a.draws)
            shown = ", ".join(f"{s:.2f}" for s in signals)
            print(
                f"| {form} | {label} | {mc_mean:.2f} | {mc_sd:.2f} | {quad} | {tau:.3f} | "
                f"{null:.3f} | {shown} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
