"""QNVB's cost per site on a model with many small sites: a random walk written as ``T`` scalar
sites, against the same latent written as one vector site.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_many_sites.py [--T 10 100 1000]
        [--steps 5] [--profile-T 1000] [--top 15] [--quick]

The model is a local level (a Gaussian random walk seen through noise): ``x_1 ~ N(0, q^2)``,
``x_t ~ N(x_{t-1}, q^2)``, ``y_t ~ N(x_t, r^2)``, ``q = 0.5``, ``r = 1``, ``y`` drawn from it
(seed 0). Two ways of writing it, each fitted by ``AutoMeanFieldNormal`` + ``QuadratureELBO()``
+ ``QNVB()``:

- ``sites``: ``T`` scalar sites ``x_t`` in a ``pyro.markov`` loop, the way a user ports a
  sequential model: QNVB updates ``T`` blocks of one coordinate each;
- ``vector``: one site ``x ~ MultivariateNormal(0, scale_tril=q * tril(1))`` (the walk's prior)
  and ``y ~ Normal(x, r).to_event(1)``: one block of ``T`` coordinates, the fast way to write it.

Each row: the whole ``svi.step`` and QNVB's own step (its ``__call__``: pairing the blocks,
the update, the write-back), wall-clock milliseconds, the median of ``--steps`` steps after two
warm-up steps, one torch thread; the ratios are to the ``vector`` form at the same ``T``. QNVB's
step is timed twice, in two fits: as it runs, and with Python's garbage collector paused during
it. A model of ``T`` sites leaves the ELBO's traces of ``T`` sites to collect, and a collection
runs where an allocation happens to trigger it: often inside QNVB, whose own work is the second
figure (the collection then runs in the ELBO instead). Then a cProfile of QNVB's step alone
(collector paused) on the ``sites`` form at ``--profile-T``: the functions with the most time
of their own (``tottime``), in milliseconds per step. ``--quick`` (the test of the
scripts): ``T`` of 10 and 20, two steps, the profile at ``T = 20``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
import warnings
from pathlib import Path

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


def sites(y: torch.Tensor) -> None:
    x = y.new_zeros(())
    for t in pyro.markov(range(len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, Q))
        pyro.sample(f"y_{t}", dist.Normal(x, R), obs=y[t])


def vector(y: torch.Tensor) -> None:
    T = len(y)
    walk = Q * torch.tril(y.new_ones(T, T))
    x = pyro.sample("x", dist.MultivariateNormal(y.new_zeros(T), scale_tril=walk))
    pyro.sample("y", dist.Normal(x, R).to_event(1), obs=y)


FORMS = {"sites": sites, "vector": vector}


class TimedQNVB(QNVB):
    """``QNVB`` whose steps are timed (``times``) or profiled (``profiler``); with ``pause_gc``
    Python's garbage collector is off during them (``gc.disable``)."""

    def __init__(self, pause_gc: bool = False) -> None:
        super().__init__()
        self.times: list[float] = []
        self.profiler: cProfile.Profile | None = None
        self.pause_gc = pause_gc

    def __call__(self, *args, **kwargs) -> None:
        if self.pause_gc:
            gc.disable()
        if self.profiler is not None:
            self.profiler.enable()
        start = time.perf_counter()
        super().__call__(*args, **kwargs)
        self.times.append(time.perf_counter() - start)
        if self.profiler is not None:
            self.profiler.disable()
        gc.enable()


def fit(form: str, T: int, pause_gc: bool = False) -> tuple[SVI, TimedQNVB, torch.Tensor]:
    y = data(T)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = FORMS[form]
    optim = TimedQNVB(pause_gc)
    return SVI(model, AutoMeanFieldNormal(model), optim, QuadratureELBO()), optim, y


def timed(form: str, T: int, steps: int, pause_gc: bool = False) -> tuple[float, float]:
    """Median milliseconds of the SVI step and of QNVB's step, after two warm-up steps."""
    svi, optim, y = fit(form, T, pause_gc)
    times = []
    for _ in range(2 + steps):
        start = time.perf_counter()
        svi.step(y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3, statistics.median(optim.times[2:]) * 1e3


def profiled(T: int, steps: int, top: int) -> None:
    svi, optim, y = fit("sites", T, pause_gc=True)
    for _ in range(2):
        svi.step(y)
    optim.profiler = cProfile.Profile()
    for _ in range(steps):
        svi.step(y)
    stats = pstats.Stats(optim.profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    total = sum(own for _, _, own, _, _ in stats.values())
    print(f"\ncProfile of QNVB's step, sites form, T = {T} ({steps} steps; ms per step):\n")
    print("| function | calls/step | own ms | cumulative ms | share of own |")
    print("|---|---:|---:|---:|---:|")
    for (file, line, func), (_, calls, own, cumulative, _) in rows:
        where = func if file == "~" else f"{Path(file).name}:{line}({func})"
        print(
            f"| `{where}` | {calls / steps:.0f} | {own / steps * 1e3:.2f} "
            f"| {cumulative / steps * 1e3:.2f} | {own / total:.0%} |"
        )
    print(f"\nQNVB's step under the profiler: {total / steps * 1e3:.1f} ms of own time per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up)")
    parser.add_argument("--profile-T", type=int, default=1000, help="0: no profile")
    parser.add_argument("--top", type=int, default=15, help="functions in the profile")
    parser.add_argument("--quick", action="store_true", help="T 10 and 20, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.T, args.steps, args.profile_T = [10, 20], 2, 20
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # QNVB's sigma_max warning of the first steps
    print(
        "| T | form | step ms | QNVB ms | QNVB ms, GC paused | QNVB ms/site, GC paused "
        "| step / vector | QNVB / vector |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for T in args.T:
        results = {form: timed(form, T, args.steps) for form in FORMS}
        paused = {form: timed(form, T, args.steps, pause_gc=True)[1] for form in FORMS}
        base_step, base_qnvb = results["vector"]
        for form, (step, qnvb) in results.items():
            per_site = f"{paused[form] / T:.3f}" if form == "sites" else "-"
            print(
                f"| {T} | {form} | {step:.1f} | {qnvb:.2f} | {paused[form]:.2f} | {per_site} | "
                f"{step / base_step:.1f} | {qnvb / base_qnvb:.1f} |"
            )
    if args.profile_T:
        profiled(args.profile_T, args.steps, args.top)


if __name__ == "__main__":
    main()
