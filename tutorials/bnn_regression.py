"""Regression with a gap: predictive bands of a Bayesian network, QNVB against Adam and NUTS.

The toy problem of the WHVI paper's Fig. 4 (Rossi et al., "Walsh-Hadamard variational inference
for Bayesian deep learning", Section 3.1): 128 inputs on ``U[-1, 2]`` with 20% of the interval
left empty, targets a random function plus Gaussian noise of variance ``exp(-3)``. A network with
cosine activations is a :class:`~pyro_quadvi.nn.BayesianModule`, fitted three ways:

1. ``QNVB()`` + ``QuadratureELBO()`` (the package's defaults: ``blocked_simplex``, K = 3 nodes a
   step; QNVB takes the network settings the ``BayesianModule`` declares) with an
   ``AutoMeanFieldNormal`` guide;
2. ``pyro.optim.Adam({"lr": 0.01})`` + ``Trace_ELBO()`` (one draw a step) with the same guide, for
   K times as many steps: both get the same number of gradient evaluations of the model;
3. as the reference, NUTS on a smaller network (full mode only).

What we chose where the paper says little: the gap is ``[0.4, 1.0]`` (20% of ``[-1, 2]``; the
128 inputs are uniform on the rest); the "random function" is a sum of 12 random cosines
``f(x) = sqrt(2 / 12) sum_m a_m cos(w_m x + b_m)`` with ``w_m ~ N(0, 3^2)``, ``b_m ~ U[0, 2 pi]``,
``a_m ~ N(0, 1)`` (seed 0); the noise scale ``exp(-1.5)`` is known to the model. The networks are
1-32-32-1 (VI; 1-16-16-1 in ``--quick``) and 1-10-1 (NUTS) with cosine activations, prior
``N(0, 3^2)`` on the first layer (frequencies and phases) and ``N(0, 1 / fan_in)`` on the others;
the guides start at a prior draw (``init_to_sample``). The paper's 1-128-128-1 underfits under a
mean field at this budget (``--hidden 128,128`` tries it); a 1-50-1 network fits well but, as
Foong et al. (2019) showed for one hidden layer, its mean field has no more spread in the gap than
at the data. NUTS runs one chain of 300 warmup steps and 300 draws (``max_tree_depth=8``).

Run::

    python tutorials/bnn_regression.py                # full study (minutes), writes the figure
    python tutorials/bnn_regression.py --quick --out /tmp/bnn.png   # seconds, no NUTS (CI runs it)

The figure goes to ``docs/img/bnn_regression.png`` unless ``--out`` says otherwise; ``--quick``
without ``--out`` writes ``bnn_regression.png`` to the temporary directory
(``tempfile.gettempdir()``) and leaves the committed figure alone.

The table reports, on a held-out grid of 300 points of ``[-1, 2]`` with fresh noise, the mean
negative log predictive density (the Bayesian model average of the Gaussian likelihood over the
draws) and the RMSE of the predictive mean, and the mean predictive standard deviation (noise
included) where the data are and inside the gap.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import tempfile
import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_sample
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, fit, likelihoods

F64 = torch.float64
NOISE = math.exp(-1.5)  # noise variance exp(-3)
DOMAIN = (-1.0, 2.0)
GAP = (0.4, 1.0)
FIGURE = "docs/img/bnn_regression.png"  # of the full run
SETTINGS = {
    "full": {
        "hidden": (32, 32),
        "qnvb_steps": 2000,
        "nuts_hidden": (10,),
        "nuts_warmup": 300,
        "nuts_samples": 300,
    },
    "quick": {"hidden": (16, 16), "qnvb_steps": 150, "nuts_hidden": ()},
}


# ----------------------------------------------------------------------------- the data


def target(x: torch.Tensor, seed: int = 0, features: int = 12) -> torch.Tensor:
    """The noiseless "random function": a sum of random cosines, fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    w = 3.0 * torch.randn(features, generator=generator, dtype=F64)
    b = 2 * math.pi * torch.rand(features, generator=generator, dtype=F64)
    a = torch.randn(features, generator=generator, dtype=F64)
    return math.sqrt(2.0 / features) * (a * torch.cos(x.unsqueeze(-1) * w + b)).sum(-1)


def in_gap(x: torch.Tensor) -> torch.Tensor:
    return (x > GAP[0]) & (x < GAP[1])


def toy_data(n: int = 128, seed: int = 1):
    """``n`` inputs uniform on ``[-1, 2]`` without the gap, and noisy targets."""
    generator = torch.Generator().manual_seed(seed)
    low, high = DOMAIN
    width = (high - low) - (GAP[1] - GAP[0])
    u = low + width * torch.rand(n, generator=generator, dtype=F64)
    x = torch.where(u > GAP[0], u + (GAP[1] - GAP[0]), u).sort().values
    y = target(x) + NOISE * torch.randn(n, generator=generator, dtype=F64)
    return x.unsqueeze(-1), y


def test_data(n: int = 300, seed: int = 2):
    """A held-out grid of ``[-1, 2]`` with fresh noise on the noiseless targets."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.linspace(*DOMAIN, n, dtype=F64)
    y = target(x) + NOISE * torch.randn(n, generator=generator, dtype=F64)
    return x.unsqueeze(-1), y


# ----------------------------------------------------------------------------- the model


class Cos(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(x)


def make_bnn(hidden: tuple[int, ...], n: int) -> BayesianModule:
    """A network ``1-hidden-...-1`` with cosine activations and its prior, as a Pyro model."""
    widths = (1, *hidden)
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), Cos()]
    net = nn.Sequential(*layers, nn.Linear(widths[-1], 1)).to(F64)
    fan_in = {f"{2 * i}.": width for i, width in enumerate(widths)}

    def prior(name: str, param: torch.Tensor):
        # the first layer's weights and biases are the frequencies and phases of the cosines
        scale = 3.0 if name.startswith("0.") else 1.0 / math.sqrt(fan_in[name.split(".")[0] + "."])
        return dist.Normal(torch.zeros_like(param).detach(), scale)

    return BayesianModule(net, prior, likelihoods.Gaussian(dataset_size=n, scale=NOISE))


def architecture(hidden: tuple[int, ...]) -> str:
    return "-".join(str(w) for w in (1, *hidden, 1))


# ----------------------------------------------------------------------------- the fits


def fit_svi(bnn, x, y, optimizer, elbo, steps: int, label: str, seed: int = 0):
    """``steps`` SVI steps from a prior draw; returns the guide and the final loss."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample)
    history = fit(SVI(bnn, guide, optimizer, elbo), (x, y), steps, desc=label)
    return guide, history.loss[-1]


def run_nuts(bnn, x, y, warmup: int, samples: int, seed: int = 0) -> dict[str, torch.Tensor]:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    mcmc = MCMC(NUTS(bnn, max_tree_depth=8), num_samples=samples, warmup_steps=warmup)
    mcmc.run(x, y)
    return mcmc.get_samples()


# ----------------------------------------------------------------------------- the summaries


def summarize(outputs: torch.Tensor, x_test, y_test) -> dict:
    """Predictive mean and sd (noise included) and test scores from draws ``(S, B)``."""
    mean = outputs.mean(0)
    sd = (outputs.var(0, unbiased=False) + NOISE**2).sqrt()
    # the Bayesian model average of the likelihood: log (1/S) sum_s N(y | f_s(x), noise)
    log_density = dist.Normal(outputs, NOISE).log_prob(y_test)
    nll = -(torch.logsumexp(log_density, 0) - math.log(outputs.shape[0])).mean()
    rmse = ((mean - y_test) ** 2).mean().sqrt()
    x = x_test.squeeze(-1)
    gap = in_gap(x)
    return {
        "mean": mean,
        "sd": sd,
        "nll": float(nll),
        "rmse": float(rmse),
        "sd_data": float(sd[~gap].mean()),
        "sd_gap": float(sd[gap].mean()),
    }


def plot(x, y, x_test, results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), sharey=True)
    axes = [axes] if len(names) == 1 else list(axes)
    grid = x_test.squeeze(-1)
    colors = ["tab:blue", "tab:orange", "tab:green"]
    for ax, name, color in zip(axes, names, colors):
        r = results[name]
        ax.axvspan(*GAP, color="0.92", zorder=0)
        ax.fill_between(
            grid, r["mean"] - 2 * r["sd"], r["mean"] + 2 * r["sd"], color=color, alpha=0.3
        )
        ax.plot(grid, r["mean"], color=color, label="predictive mean ± 2 sd")
        ax.plot(grid, target(grid), "k--", lw=0.8, label="noiseless target")
        ax.plot(x.squeeze(-1), y, "k.", ms=3, label="data")
        ax.set_title(f"{name}\nNLL {r['nll']:.2f}, sd gap/data {r['sd_gap'] / r['sd_data']:.2f}")
        ax.set_xlabel("x")
    axes[0].set_ylabel("y")
    axes[0].legend(loc="lower left", fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_table(results: dict) -> None:
    print("| method | test NLL | test RMSE | sd at the data | sd in the gap | time (s) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['nll']:.3f} | {r['rmse']:.3f} | {r['sd_data']:.3f} | "
            f"{r['sd_gap']:.3f} | {r['time_s']:.1f} |"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run without NUTS (CI)")
    parser.add_argument(
        "--out", help=f"the figure's path (default: {FIGURE}; the temporary dir if --quick)"
    )
    parser.add_argument("--hidden", help="hidden widths of the VI network, e.g. 50 or 32,32")
    parser.add_argument("--steps", type=int, help="QNVB steps (Adam gets K times as many)")
    parser.add_argument("--no-nuts", action="store_true", help="skip the NUTS reference")
    parser.add_argument("--samples", type=int, default=200, help="guide draws for prediction")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # a small network: more threads only add synchronization overhead
    settings = dict(SETTINGS["quick" if options.quick else "full"])
    if options.hidden:
        settings["hidden"] = tuple(int(w) for w in options.hidden.split(","))
    if options.steps:
        settings["qnvb_steps"] = options.steps
    if options.no_nuts:
        settings["nuts_hidden"] = ()

    x, y = toy_data()
    x_test, y_test = test_data()
    n = x.shape[0]
    results = {}

    # 1. QNVB + QuadratureELBO: K nodes, so K gradient evaluations, per step
    bnn = make_bnn(settings["hidden"], n)
    elbo = QuadratureELBO()
    K = elbo.rule.num_nodes(sum(p.numel() for p in bnn.latent_parameters().values()))
    steps = settings["qnvb_steps"]
    start = time.perf_counter()
    guide, _ = fit_svi(bnn, x, y, QNVB(), elbo, steps, "QNVB + QuadratureELBO")
    elapsed = time.perf_counter() - start
    pyro.set_rng_seed(10)
    prediction = bnn.predict(guide, x_test, num_samples=options.samples)
    label = f"QNVB + QuadratureELBO ({steps} steps x K={K})"
    results[label] = summarize(prediction.outputs.squeeze(-1), x_test, y_test)
    results[label]["time_s"] = elapsed

    # 2. Adam + Trace_ELBO: one draw a step, K times the steps
    bnn = make_bnn(settings["hidden"], n)
    adam_steps = K * steps
    start = time.perf_counter()
    guide, _ = fit_svi(
        bnn, x, y, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), adam_steps, "Adam + Trace_ELBO"
    )
    elapsed = time.perf_counter() - start
    pyro.set_rng_seed(10)
    prediction = bnn.predict(guide, x_test, num_samples=options.samples)
    label = f"Adam(lr=0.01) + Trace_ELBO ({adam_steps} steps)"
    results[label] = summarize(prediction.outputs.squeeze(-1), x_test, y_test)
    results[label]["time_s"] = elapsed

    # 3. NUTS on a smaller network, the reference
    if settings["nuts_hidden"]:
        bnn = make_bnn(settings["nuts_hidden"], n)
        start = time.perf_counter()
        samples = run_nuts(bnn, x, y, settings["nuts_warmup"], settings["nuts_samples"])
        elapsed = time.perf_counter() - start
        with torch.no_grad():
            outputs = bnn.evaluate(samples, x_test).squeeze(-1)
        arch = architecture(settings["nuts_hidden"])
        label = f"NUTS, {arch} ({settings['nuts_samples']} draws)"
        results[label] = summarize(outputs, x_test, y_test)
        results[label]["time_s"] = elapsed

    title = (
        f"{architecture(settings['hidden'])} cosine network; the two VI fits at equal "
        "gradient evaluations"
    )
    if not settings["nuts_hidden"]:
        title += " (NUTS reference skipped)"
    default = os.path.join(tempfile.gettempdir(), "bnn_regression.png") if options.quick else FIGURE
    out = options.out or default
    plot(x, y, x_test, results, out, title)
    print_table(results)
    print(f"\nfigure saved to {out}")
    return {"results": results, "K": K, "out": out}


if __name__ == "__main__":
    main()
