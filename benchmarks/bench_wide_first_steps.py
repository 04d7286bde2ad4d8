"""The first steps of QNVB on a wide MLP, traced (``docs/benchmarks.md``, "Wide networks: the
first steps (session 15)").

A seeded ``SVI(BayesianModule(net, prior, likelihoods.Categorical(dataset_size=N)),
AutoMeanFieldNormal, QNVB(), QuadratureELBO())`` on MNIST's seeded 8,000 / 2,000 split (inputs
zero-padded to 32 x 32 for a net of 1,024 inputs), minibatches of 128, float32. Per step it
prints the loss ``svi.step`` returned (the ``-ELBO`` estimate of the guide *before* the step's
update) and, per layer, what QNVB's update saw and did: the norms and largest entries of ``mu``
and ``sigma`` before the update, the moments ``g`` (of the likelihood and prior together) and
``h``, the fraction of coordinates whose curvature passed the significance test, the size of the
mean's step and how many steps the trust region cut, and how ``sigma`` moved. With ``--evals``
the test NLL of the Bayesian model average (``predict``, 8 draws) after each step.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_wide_first_steps.py --net 784-400-400-10 \\
        --prior normal --steps 5 --data-dir "$PYRO_QUADVI_DATA/mnist-t10k"
    # --prior kaiming for LayerwiseNormal("kaiming"); --init net to start at the net's own
    # initialization; --qnvb KEY=VALUE to pass a QNVB setting (e.g. significance=0)
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path

import pyro
import pyro.util
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import qnvb as qnvb_module
from pyro_quadvi.testing.datasets import mnist_split

PRIORS = {
    "normal": lambda: priors.Normal(1.0),
    "kaiming": lambda: priors.LayerwiseNormal("kaiming"),
    "radford": lambda: priors.LayerwiseNormal("radford"),
}


def make_net(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def load(data_dir: str | None, inputs: int):
    x, y, xt, yt = mnist_split(data_dir)
    x, xt = x.reshape(len(x), -1).float(), xt.reshape(len(xt), -1).float()
    if inputs == 1024:  # 28 x 28 zero-padded to 32 x 32
        x = F.pad(x.reshape(-1, 28, 28), (2, 2, 2, 2)).reshape(len(x), -1)
        xt = F.pad(xt.reshape(-1, 28, 28), (2, 2, 2, 2)).reshape(len(xt), -1)
    elif inputs != 784:
        raise SystemExit(f"--net must start with 784 or 1024 inputs, got {inputs}")
    return x, y, xt, yt


class Recorder:
    """Wraps the update QNVB calls for blocks updated together and keeps, per call, what each
    block's update saw and returned."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []
        self._inner = qnvb_module.qnvb_update_many

    def __call__(self, mus, sigmas, gs, hs, states, hp, *args, **kwargs):
        olds = [(m.clone(), s.clone()) for m, s in zip(mus, sigmas)]
        counts = [st.curvature_count.clone() for st in states]
        results = self._inner(mus, sigmas, gs, hs, states, hp, *args, **kwargs)
        rows = []
        for (mu, sigma), g, h, count, result in zip(olds, gs, hs, counts, results):
            n = result.state.curvature_count  # after the step's forgetting; taken before it:
            c = (count + 1).clamp(max=1.0 / (1.0 - hp.betas[1]))
            h_avg, h2_avg = result.state.h_avg, result.state.h2_avg
            stderr = ((h2_avg - h_avg**2).clamp(min=0) / c).sqrt()
            significant = h_avg > hp.significance * stderr
            step = mu - result.mu
            radius = hp.trust_region * sigma
            ratio = result.sigma / sigma
            rows.append(
                {
                    "shape": tuple(mu.shape),
                    "mu_rms": mu.pow(2).mean().sqrt().item(),
                    "mu_max": mu.abs().max().item(),
                    "sigma_med": sigma.median().item(),
                    "sigma_max": sigma.max().item(),
                    "g_rms": g.pow(2).mean().sqrt().item(),
                    "h_pos": (h > 0).float().mean().item(),
                    "h_med": h.median().item(),
                    "sig_frac": significant.float().mean().item(),
                    "step_rms": step.pow(2).mean().sqrt().item(),
                    "step_max": step.abs().max().item(),
                    "at_radius": (step.abs() >= radius * (1 - 1e-6)).float().mean().item(),
                    "doubled": (ratio > hp.scale_max * (1 - 1e-6)).float().mean().item(),
                    "shrank": (ratio < 1 - 1e-6).float().mean().item(),
                    "new_sigma_med": result.sigma.median().item(),
                    "count_after": n.mean().item(),
                }
            )
        self.calls.append(rows)
        return results


def kl_to_prior(bnn: BayesianModule, guide: AutoMeanFieldNormal) -> float:
    """The guide's KL to the prior in closed form (both Normal per weight)."""
    total = 0.0
    with torch.no_grad():
        for name, param in bnn.latent_parameters().items():
            prior = bnn.prior_of(name, param).base_dist
            q = torch.distributions.Normal(
                pyro.param(f"AutoMeanFieldNormal.locs.{name}"),
                pyro.param(f"AutoMeanFieldNormal.scales.{name}"),
            )
            p = torch.distributions.Normal(prior.loc, prior.scale)
            total += torch.distributions.kl_divergence(q, p).sum().item()
    return total


def test_nll(bnn: BayesianModule, guide: AutoMeanFieldNormal, xt, yt) -> float:
    """Test NLL of the Bayesian model average by 8 draws; the fit's random state untouched."""
    rng = pyro.util.get_rng_state()
    with torch.no_grad():
        probs = bnn.predict(guide, xt, num_samples=8).probs
    pyro.util.set_rng_state(rng)
    return -probs[torch.arange(len(yt)), yt].clamp(min=1e-12).log().mean().item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", default="784-400-400-10")
    parser.add_argument("--prior", choices=sorted(PRIORS), default="normal")
    parser.add_argument("--init", choices=("feasible", "net"), default="feasible")
    parser.add_argument("--init-scale", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evals", type=int, nargs="*", default=(), help="steps to score NLL at")
    parser.add_argument("--trace", action="store_true", help="print the per-layer trace")
    parser.add_argument("--qnvb", nargs="*", default=(), metavar="KEY=VALUE")
    parser.add_argument("--data-dir", default=None, help="the MNIST dir (or PYRO_QUADVI_DATA)")
    args = parser.parse_args(argv)
    data_dir = args.data_dir
    if data_dir is None and os.environ.get("PYRO_QUADVI_DATA"):
        data_dir = os.path.join(os.environ["PYRO_QUADVI_DATA"], "mnist-t10k")
    widths = [int(w) for w in args.net.split("-")]
    x, y, xt, yt = load(data_dir, widths[0])
    settings = {}
    for item in args.qnvb:
        key, value = item.split("=")
        settings[key] = float(value)

    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    net = make_net(widths)
    bnn = BayesianModule(net, PRIORS[args.prior](), likelihoods.Categorical(dataset_size=len(y)))
    init = {} if args.init == "feasible" else {"init_loc_fn": bnn.init_to_net()}
    guide = AutoMeanFieldNormal(bnn, init_scale=args.init_scale, **init)
    recorder = Recorder()
    qnvb_module.qnvb_update_many = recorder
    svi = SVI(bnn, guide, QNVB(**settings), QuadratureELBO())
    shuffle = torch.Generator().manual_seed(args.seed)
    per_epoch = len(y) // args.batch  # minibatches of each epoch's permutation, the rest dropped
    print(
        f"net {args.net}, prior {args.prior}, init {args.init} (init_scale {args.init_scale}), "
        f"QNVB({settings}), batch {args.batch}, seed {args.seed}, "
        f"{sum(p.numel() for p in net.parameters()):,} weights"
    )
    rng = pyro.util.get_rng_state()
    guide(x[:1], y[:1])  # sets the guide's parameters up (the KL and the score read them)
    pyro.util.set_rng_state(rng)
    for step in range(1, args.steps + 2):
        if step - 1 in args.evals:
            print(
                f"after {step - 1} steps: test NLL {test_nll(bnn, guide, xt, yt):.4g}", flush=True
            )
        if step > args.steps:
            break
        if (step - 1) % per_epoch == 0:
            order = torch.randperm(len(y), generator=shuffle)
        start = (step - 1) % per_epoch * args.batch
        rows = order[start : start + args.batch]
        kl = kl_to_prior(bnn, guide)
        loss = svi.step(x[rows], y[rows])
        print(f"step {step}: loss {loss:.4g} = KL {kl:.4g} + data {loss - kl:.4g}", flush=True)
        if args.trace:
            # the blocks in the update's order, named by shape (biases of one width: both names)
            names: dict[tuple, list[str]] = {}
            for n, p in bnn.latent_parameters().items():
                names.setdefault(tuple(p.shape), []).append(n)
            for row in recorder.calls[-1]:
                name = "/".join(names[row["shape"]])
                words = ", ".join(
                    f"{k} {v:.3g}" if isinstance(v, float) and math.isfinite(v) else f"{k} {v}"
                    for k, v in row.items()
                    if k != "shape"
                )
                print(f"    {name}: {words}")


if __name__ == "__main__":
    main()
