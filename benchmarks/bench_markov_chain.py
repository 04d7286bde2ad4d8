"""QNVB + QuadratureELBO on a local-level model (a Gaussian random walk seen through noise): which
rule, and which way of writing the walk, reach the exact mean field.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_markov_chain.py [--steps 300]
        [--forms loop vector noncentred] [--rules hadamard blocked_simplex] [--T 20 100 1000]

The model: ``x_1 ~ N(0, q^2)``, ``x_t ~ N(x_{t-1}, q^2)``, ``y_t ~ N(x_t, r^2)``, with ``q = 0.5``,
``r = 1`` and ``y`` drawn from it (seed 0). Its posterior is Gaussian with a tridiagonal
precision ``L``, so the optimum of a mean-field guide is known: the exact posterior mean, and the
scales ``1 / sqrt(L_ii)``. Three ways of writing it:

- ``loop``: centred, ``T`` scalar sites ``x_t`` in a ``pyro.markov`` loop (one site per step);
- ``vector``: centred, one vector site ``x ~ MultivariateNormal(0, scale_tril=q * tril(1))``
  (the random walk's prior) and ``y ~ Normal(x, r).to_event(1)``, no plate;
- ``noncentred``: the innovations ``e_t ~ N(0, 1)`` in a plate, ``x = q * cumsum(e)``; the mean
  field is then over ``e``, with precision ``I + C^T C / r^2``.

Each row: ``AutoMeanFieldNormal`` + ``QNVB()`` + ``QuadratureELBO(rule)``, after ``s`` steps, the
largest error of the means in units of the exact mean-field scales and the largest relative
error of the scales (``sd/exact - 1``), and the seconds per step (median; CPU, one thread). The
last table gives the exact mean field's scale of the last state against the posterior's marginal
scale, ``1 / sqrt(L_TT)`` against ``sqrt((L^-1)_TT)``, and the spread of the eigenvalues of the
precision scaled to a unit diagonal (``D^-1/2 L D^-1/2``), whose width is what slows (or, for
the non-centred form, destabilises) an elementwise second-order method.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO

Q, R = 0.5, 1.0


def data(T: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.cumsum(Q * torch.randn(T, generator=generator, dtype=torch.float64), 0)
    return (x + R * torch.randn(T, generator=generator, dtype=torch.float64)).float()


def loop(y):
    x = y.new_zeros(())
    for t in pyro.markov(range(len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, Q))
        pyro.sample(f"y_{t}", dist.Normal(x, R), obs=y[t])


def vector(y):
    T = len(y)
    walk = Q * torch.tril(y.new_ones(T, T))
    x = pyro.sample("x", dist.MultivariateNormal(y.new_zeros(T), scale_tril=walk))
    pyro.sample("y", dist.Normal(x, R).to_event(1), obs=y)


def noncentred(y):
    T = len(y)
    with pyro.plate("time", T):
        e = pyro.sample("e", dist.Normal(y.new_zeros(()), 1.0))
    with pyro.plate("time_y", T):
        pyro.sample("y", dist.Normal(Q * torch.cumsum(e, -1), R), obs=y)


MODELS = {"loop": loop, "vector": vector, "noncentred": noncentred}


def precision(form: str, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The posterior's precision and mean over the guide's coordinates (``x``, or ``e``)."""
    y = y.double().numpy()
    T = len(y)
    if form == "noncentred":
        C = Q * np.tril(np.ones((T, T)))
        L = np.eye(T) + C.T @ C / R**2
        b = C.T @ y / R**2
    else:
        D = np.eye(T) - np.eye(T, k=-1)  # x_t - x_{t-1}, with x_0 = 0
        L = D.T @ D / Q**2 + np.eye(T) / R**2
        b = y / R**2
    return L, np.linalg.solve(L, b)


def guide_values(guide, form: str, T: int) -> tuple[np.ndarray, np.ndarray]:
    if form == "loop":
        loc = torch.stack([getattr(guide.locs, f"x_{t}") for t in range(T)])
        scale = torch.stack([getattr(guide.scales, f"x_{t}") for t in range(T)])
    else:
        name = "e" if form == "noncentred" else "x"
        loc, scale = getattr(guide.locs, name), getattr(guide.scales, name)
    return loc.detach().double().numpy(), scale.detach().double().numpy()


def run(form: str, T: int, rule: str, checkpoints: list[int]) -> list[tuple]:
    y = data(T)
    L, mean = precision(form, y)
    sd = 1 / np.sqrt(np.diag(L))
    model = MODELS[form]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO(rule))
    rows, times = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # QNVB's divergence warnings: the table shows them
        for step in range(1, max(checkpoints) + 1):
            start = time.process_time()
            svi.step(y)
            times.append(time.process_time() - start)
            if step in checkpoints:
                loc, scale = guide_values(guide, form, T)
                mean_error = np.max(np.abs(loc - mean) / sd)
                sd_error = np.max(np.abs(scale / sd - 1))
                rows.append((step, mean_error, sd_error))
    return [(*row, statistics.median(times)) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10, 100, 300])
    parser.add_argument("--forms", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rules", nargs="+", default=["hadamard", "blocked_simplex"])
    parser.add_argument("--T", type=int, nargs="+", default=[20, 100])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| form | T | rule | step | mean error (sd) | sd error (rel.) | s/step |")
    print("|---|---|---|---|---|---|---|")
    for form in args.forms:
        for T in args.T:
            for rule in args.rules:
                for step, mean_error, sd_error, seconds in run(form, T, rule, args.steps):
                    print(
                        f"| {form} | {T} | {rule} | {step} | {mean_error:.2g} | {sd_error:.2g} "
                        f"| {seconds:.3f} |"
                    )
    print()
    print("| form | T | last state: mean-field sd | marginal sd | scaled precision eigenvalues |")
    print("|---|---|---|---|---|")
    for form in args.forms:
        for T in args.T:
            L, _ = precision(form, data(T))
            d = 1 / np.sqrt(np.diag(L))
            eigenvalues = np.linalg.eigvalsh(d[:, None] * L * d[None, :])
            last = "- | -"  # (the non-centred guide's coordinates are innovations)
            if form != "noncentred":
                last = f"{d[-1]:.3f} | {np.sqrt(np.linalg.inv(L)[-1, -1]):.3f}"
            print(f"| {form} | {T} | {last} | {eigenvalues.min():.2g} .. {eigenvalues.max():.3g} |")


if __name__ == "__main__":
    main()
