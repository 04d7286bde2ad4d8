"""Accuracy per evaluation: the expected gradient and Hessian diagonal from K model evaluations.

    python benchmarks/bench_elbo_accuracy.py [--repeats 20] [--plot docs/img/elbo_accuracy.png]

For a mean field q = N(mu, diag(sigma^2)) and L = -log p(x, z), QuadratureELBO's gradients give
    g = dloss/dmu = Q[grad L]      h = (dloss/dsigma + 1/sigma) / sigma = Q[x * grad L] / sigma
(rasp paper eq. 7-8, 11). This script measures the root-mean-square error of g and h, over
coordinates and repeats (fresh draws for random rules, successive steps for the Hadamard sequence),
against a reference:
- logistic regression (d = 20, N = 500): exact, since every term depends on w only through the
  scalar a_n = x_n . w ~ N(x_n . mu, sum_j x_nj^2 sigma_j^2): one-dimensional Gauss-Hermite
  (80 points) per data point;
- a Bayesian MLP (4-8-1, d = 49), at a wide (scales ~0.2-0.5) and a narrow (~0.02-0.05) mean
  field: Monte Carlo with 2^17 antithetic draws of the gradient in
  plain torch (its relative standard error is printed, far below the errors measured).
Every rule is compared at K = 3, 4, 6, 8 evaluations with Monte Carlo (``mc``) at the same K.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pyro
import torch
from models import BayesianMLP, logistic_data, logistic_regression, mlp_data

from pyro_quadvi import AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides.interface import published_moments

RULES = ["mc", "vrmc1", "vrmc2", "rasp_simplex", "rasp_cross", "hadamard", "blocked_simplex"]
EVALUATIONS = [3, 4, 6, 8]


def g_and_h(elbo, model, guide, args):
    """The expected gradient and Hessian diagonal the ELBO integrated (what it publishes)."""
    elbo.differentiable_loss(model, guide, *args).backward()
    moments = [published_moments(site.params["loc"]) for site in guide.mean_field_sites()]
    for p in guide.parameters():
        p.grad = None
    g = torch.cat([m.g.reshape(-1) for m in moments])
    return g.detach(), torch.cat([m.h.reshape(-1) for m in moments]).detach()


def setup(model, args, seed, scale=0.2):
    """A guide at a random mean field: locs N(0, 0.5^2), scales uniform in [scale, 2.5 scale]."""
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model)
    guide(*args)
    generator = torch.Generator().manual_seed(seed)
    store = pyro.get_param_store()
    for site in guide.mean_field_sites():
        shape = store[site.param_names["loc"]].shape
        store[site.param_names["loc"]] = 0.5 * torch.randn(shape, generator=generator)
        store[site.param_names["scale"]] = scale * (
            1 + 1.5 * torch.rand(shape, generator=generator)
        )
    guide(*args)
    return guide


def logistic_reference(X, y, mu, sigma):
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    nodes = torch.tensor(nodes)
    weights = torch.tensor(weights / math.sqrt(2 * math.pi))
    mean = X @ mu
    sd = ((X**2) @ sigma**2).sqrt()
    a = mean[:, None] + sd[:, None] * nodes  # (N, 80)
    p = torch.sigmoid(a)
    e_p = p @ weights
    e_dp = (p * (1 - p)) @ weights
    g = X.T @ (e_p - y) + mu  # N(0, 1) prior
    h = (X**2).T @ e_dp + 1.0
    return g, h


def mlp_reference(net, guide, X, y, num=2**17, chunk=2**13):
    """E_q[grad L] and E_q[x grad L] / sigma for the MLP by antithetic Monte Carlo.

    The negative log joint is written out in plain torch (the same priors and likelihood as
    ``BayesianMLP``) so that ``torch.func.vmap`` evaluates the gradients of many draws at once.
    """
    sites = guide.mean_field_sites()
    loc = torch.cat([s.loc.detach().reshape(-1) for s in sites])
    sigma = torch.cat([s.scale.detach().reshape(-1) for s in sites])
    names = [s.name for s in sites]
    sizes = [s.loc.numel() for s in sites]
    shapes = [s.loc.shape for s in sites]

    def neg_log_joint(theta):
        p = {n: t.reshape(shape) for n, t, shape in zip(names, theta.split(sizes), shapes)}
        hidden = torch.tanh(X @ p["fc1.weight"].T + p["fc1.bias"])
        mean = (hidden @ p["fc2.weight"].T + p["fc2.bias"]).squeeze(-1)
        prior = 0.5 * (theta**2).sum()
        return prior - torch.distributions.Normal(mean, 0.3).log_prob(y).sum()

    grad_fn = torch.func.vmap(torch.func.grad(neg_log_joint))
    generator = torch.Generator().manual_seed(123)
    g_parts, h_parts = [], []
    for _ in range(num // (2 * chunk)):
        half = torch.randn(chunk, loc.numel(), generator=generator)
        eps = torch.cat([half, -half])
        grads = grad_fn(loc + sigma * eps)
        g_parts.append(grads.mean(0))
        h_parts.append((grads * eps).mean(0) / sigma)
    g_parts, h_parts = torch.stack(g_parts), torch.stack(h_parts)
    count = len(g_parts)
    stderr = g_parts.std(0).mean().item() / math.sqrt(count) / g_parts.mean(0).abs().mean().item()
    return g_parts.mean(0), h_parts.mean(0), stderr


def rmse_table(model, args, reference_fn, repeats, vectorize, scale=0.2):
    guide = setup(model, args, seed=0, scale=scale)
    g_ref, h_ref, *extra = reference_fn(guide)
    rows = {}
    for rule in RULES:
        for K in EVALUATIONS:
            try:
                elbo = QuadratureELBO(rule, num_points=K, vectorize=vectorize)
            except ValueError:
                continue
            pyro.set_rng_seed(1)
            err_g, err_h = [], []
            for _ in range(repeats):
                g, h = g_and_h(elbo, model, guide, args)
                err_g.append(((g - g_ref) ** 2).mean())
                err_h.append(((h - h_ref) ** 2).mean())
            rows[(rule, K)] = (
                math.sqrt(sum(err_g) / repeats) / g_ref.abs().mean().item(),
                math.sqrt(sum(err_h) / repeats) / h_ref.abs().mean().item(),
            )
    return rows, extra


def print_rows(title, rows):
    print(f"\n{title}: relative RMSE of g | of h (RMSE / mean |reference|)\n")
    print("| rule | " + " | ".join(f"K={K}" for K in EVALUATIONS) + " |")
    print("|---" * (len(EVALUATIONS) + 1) + "|")
    for rule in RULES:
        cells = []
        for K in EVALUATIONS:
            if (rule, K) in rows:
                g, h = rows[(rule, K)]
                cells.append(f"{g:.3g} \\| {h:.3g}")
            else:
                cells.append("-")
        print(f"| {rule} | " + " | ".join(cells) + " |")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(10, 3.3 * len(results)), sharex=True)
    for row, (title, rows) in enumerate(results):
        for col, label in enumerate(["g (expected gradient)", "h (expected Hessian diagonal)"]):
            ax = axes[row, col]
            for rule in RULES:
                ks = [K for K in EVALUATIONS if (rule, K) in rows]
                ax.plot(ks, [max(rows[(rule, K)][col], 1e-16) for K in ks], "o-", label=rule)
            ax.set_yscale("log")
            ax.set_title(f"{title}: {label}", fontsize=9)
            ax.set_xlabel("model evaluations K")
            ax.set_ylabel("relative RMSE")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--plot", default=None, help="where to save the figure (PNG)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    X, y = logistic_data(500, 20)
    results = []

    def logistic_ref(guide):
        site = guide.mean_field_sites()[0]
        return logistic_reference(X, y, site.loc.detach(), site.scale.detach())

    rows, _ = rmse_table(logistic_regression, (X, y), logistic_ref, args.repeats, True)
    print_rows("Logistic regression, d = 20, N = 500 (exact reference)", rows)
    results.append(("logistic regression d=20", rows))

    Xn, yn = mlp_data(100, 4)
    net = BayesianMLP(4, 8)

    def net_ref(guide):
        return mlp_reference(net, guide, Xn, yn)

    for scale in (0.2, 0.02):
        rows, extra = rmse_table(net, (Xn, yn), net_ref, args.repeats, False, scale=scale)
        print_rows(
            f"Bayesian MLP 4-8-1, d = 49, scales in [{scale}, {2.5 * scale:.2g}] "
            f"(MC reference, relative std. error {extra[0]:.2g})",
            rows,
        )
        results.append((f"MLP d=49, sigma~{scale}", rows))
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot saved to {args.plot}")


if __name__ == "__main__":
    main()
