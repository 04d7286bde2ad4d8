"""What ``vectorize=True``'s first-call check costs, and that later steps pay nothing for it.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_vectorize_check.py [--repeats 7]
        [--steps 10] [--batch 128]

On the 1-50-1 network of ``bench_bnn_speed.py`` (Gaussian likelihood, ``B`` generated float32
rows, Hadamard with K = 4 nodes), for two forms:

- **ELBO**: ``SVI(BayesianModule(net, ...), AutoMeanFieldNormal, QNVB(), QuadratureELBO(
  "hadamard", num_points=4, vectorize=...))``, whose first call checks the pass at 2 nodes;
- **optimizer**: ``QNVBOptimizer.step(loss_fn=module_loss(net, mse), batch=(x, y),
  vectorize=...)``, whose first step checks it at 3 nodes.

Each repeat builds fresh objects (the guide run once beforehand), times the first step and then
``--steps`` later steps. The first step's extra is its time less the median later step: the
probes and the one-time set-up (the guide's description, the optimizer's state). The same extra
with ``vectorize=False`` (no probes, the same set-up, a looped step) is the baseline; their
difference is what the check adds. Later steps of ``vectorize=True`` are timed against later
steps of ``vectorize=None`` (decided vectorized: the pass alone, as ``True`` ran it before the
check existed). CPU time (``time.process_time``), medians over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss

K = 4


def data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch, 1, generator=generator), torch.randn(batch, generator=generator)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 1))


def elbo_stepper(vectorize, x, y):
    """A fresh SVI step of the ELBO form (its guide already run)."""
    pyro.clear_param_store()
    bnn = BayesianModule(net(), priors.Normal(1.0), likelihoods.Gaussian(len(x), scale=0.1))
    guide = AutoMeanFieldNormal(bnn)
    guide(x, y)
    elbo = QuadratureELBO("hadamard", num_points=K, vectorize=vectorize)
    svi = SVI(bnn, guide, QNVB(), elbo)
    return lambda: svi.step(x, y)


def optimizer_stepper(vectorize, x, y):
    """A fresh one-pass step of the plain-torch form."""
    model = net()
    optimizer = QNVBOptimizer(
        model.named_parameters(), likelihood_weight=len(x), quadrature="hadamard", num_eval=K
    )
    loss_fn = module_loss(model, lambda out, target: F.mse_loss(out.squeeze(-1), target))
    return lambda: optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=vectorize)


def first_and_later(make, vectorize, x, y, steps: int) -> tuple[float, float]:
    """CPU seconds of a fresh object's first step, and the median of its ``steps`` later ones."""
    step = make(vectorize, x, y)
    start = time.process_time()
    step()
    first = time.process_time() - start
    later = []
    for _ in range(steps):
        start = time.process_time()
        step()
        later.append(time.process_time() - start)
    return first, statistics.median(later)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, y = data(args.batch)
    print(
        "| form | first step, True (ms) | later step, True (ms) | first-step extra, True (ms) "
        "| first-step extra, False (ms) | check adds (ms; in later steps) "
        "| later step, None (ms) | later True / None |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, make in (("ELBO", elbo_stepper), ("optimizer", optimizer_stepper)):
        runs = {vectorize: [] for vectorize in (True, False, None)}
        for _ in range(args.repeats):
            for vectorize in runs:  # alternately
                runs[vectorize].append(first_and_later(make, vectorize, x, y, args.steps))
        first = {v: statistics.median(f for f, _ in r) for v, r in runs.items()}
        later = {v: statistics.median(s for _, s in r) for v, r in runs.items()}
        extra = {v: first[v] - later[v] for v in runs}
        added = extra[True] - extra[False]
        print(
            f"| {name} | {first[True] * 1e3:.2f} | {later[True] * 1e3:.3f} "
            f"| {extra[True] * 1e3:.2f} | {extra[False] * 1e3:.2f} "
            f"| {added * 1e3:.2f} ({added / later[True]:.1f}) | {later[None] * 1e3:.3f} "
            f"| {later[True] / later[None]:.3f} |"
        )


if __name__ == "__main__":
    main()
