"""What session 22's two checks cost, and what they buy.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_session22_checks.py [--repeats 7]
        [--rows 10000] [--sites 10 100 1000] [--fit-steps 60] [--gamma-steps 300]
        [--seeds 0 1 2] [--quick]

1. **The mixing check** (`pyro_quadvi.infer.batched._mixed_points`): where the probes of the
   vectorized pass run (``QuadratureELBO``'s first call for a model and guide, ``opqa_evidence``'s
   first chunk), one more pass over the probed points alone, and a backward pass per point, asks
   that each point's value have a gradient of exactly 0 at the others.

   a) Its cost: the CPU time of the first ``SVI(model, AutoMeanFieldNormal, QNVB(),
      QuadratureELBO())`` step (the default rule, K = 3 nodes: probes at nodes 0 and 2) with the
      check and without it (``batched._checks_mixing`` replaced by one that returns ``False``),
      on the non-centred eight schools, a regression of ``--rows`` rows and 10 weights (unknown
      noise), and a ``BayesianModule`` MLP 784-100-10 (ReLU, categorical, random data) at a
      batch of 256; the check's own time (``_mixed_points`` wrapped in a timer: less noisy than
      the difference of two first steps); and one later step for scale (decided on the first
      call: neither variant probes). Each repeat builds fresh objects (the guide run once before
      the timed step). Also ``opqa_evidence`` (8 points a coordinate, the Laplace centre) on a
      regression of 1,000 rows, 2 weights and the noise (512 nodes, one chunk), total time.
   b) What it buys: the fit of ``w`` in the model of ``tests/test_qnvb_tiny_init.py`` (``w[0] * x``
      on a vector latent ``w`` of one entry, ``s ~ LogNormal``; float32, ``--fit-steps`` QNVB
      steps of ``QuadratureELBO()``) from an ``init_scale`` of 1e-1, 1e-5 and 1e-8, with the
      check and without it, against the loop over the nodes (``vectorize=False``) in float64 from
      1e-1 (``4 * --fit-steps`` steps): the mean field's value of ``w``.

2. **GuideDelta** (`pyro_quadvi.guides.mean_field._KeepDensity`): ``AutoMeanFieldNormal`` samples
   each site through a ``GuideDelta`` so that ``TraceMeanField_ELBO`` counts a constrained
   site's change of variables.

   c) Its cost: one guide run (``poutine.trace(guide)(...)``) with it and without it
      (``AutoMeanFieldNormal._draw`` replaced by ``AutoNormal.forward``, as before the change),
      on models of ``--sites`` sites of shape ``(5,)``, their priors alternately ``Gamma(2, 1)``
      and ``LogNormal(0, 1)``, observed through a Normal of their sum, the variants alternated
      call by call (about 2,000 sites drawn a repeat), and the extra a site; one SVI step of
      ``QuadratureELBO`` + ``QNVB`` on the model of 100 sites (10 a repeat); and, for the work
      added a site besides the messenger's dispatch, one ``Delta`` and one ``GuideDelta`` built.
   d) What it buys: the lone ``Gamma(0.1, 1)`` site fitted by ``QNVB`` in ``--gamma-steps`` steps
      under ``TraceMeanField_ELBO`` with the ``GuideDelta`` and without it, against
      ``Trace_ELBO`` and against ``QuadratureELBO(rule="gauss_hermite", num_points=20)`` (the
      mean field's reference, deterministic: one seed), each seed of ``--seeds`` from
      ``init_scale`` 0.1; and the optimum in closed form (``loc = log(0.1) - 5``,
      ``scale = sqrt(10)``: the loss is ``-0.1 m + exp(m + s^2 / 2) - log s``).

Times are CPU times (``time.process_time``, one thread, the garbage collector off during each
timed run, as in ``timeit``), medians of ``--repeats``, the variants alternated within each
repeat and compared in the same run. ``--quick`` runs a few seconds.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
import timeit
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_quadvi.infer.batched as batched
from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, opqa_evidence
from pyro_quadvi.distributions import GuideDelta
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.testing.problems import eight_schools

_CHECKS_MIXING = batched._checks_mixing
_KEEP_DENSITY_DRAW = AutoMeanFieldNormal._draw


_MIXED_POINTS = batched._mixed_points
_CHECK_TIMES: list[float] = []  # CPU seconds of each run of the check itself


def _mixing_check(on: bool) -> None:
    batched._checks_mixing = _CHECKS_MIXING if on else (lambda points, indices: False)


def _timed_mixed_points(*args, **kwargs):
    start = time.process_time()
    try:
        return _MIXED_POINTS(*args, **kwargs)
    finally:
        _CHECK_TIMES.append(time.process_time() - start)


def _own_time(run: Callable[[bool], float]) -> tuple[Callable[[bool], float], list[float]]:
    """``run``, and the list it fills with the CPU seconds the check took in each run with it."""
    own: list[float] = []

    def timed(on: bool) -> float:
        del _CHECK_TIMES[:]
        batched._mixed_points = _timed_mixed_points
        try:
            seconds = run(on)
        finally:
            batched._mixed_points = _MIXED_POINTS
        if on:
            own.append(sum(_CHECK_TIMES))
        return seconds

    return timed, own


def _guide_delta(on: bool) -> None:
    AutoMeanFieldNormal._draw = _KEEP_DENSITY_DRAW if on else AutoNormal.forward


def _cpu(call: Callable[[], object]) -> float:
    start = time.process_time()
    call()
    return time.process_time() - start


@contextmanager
def _no_collector() -> Iterator[None]:
    """The garbage collector off, after a collection, as ``timeit`` runs its statement: its
    pauses land on whichever call allocates when they fall due."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _alternate(run: Callable[[bool], float], switch, repeats: int) -> dict[bool, float]:
    """Median of ``run(on)`` for ``on`` in (True, False), alternated ``repeats`` times after one
    untimed round (the first runs in a process import and build what later ones reuse)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for repeat in range(repeats + 1):
            for on in (True, False) if repeat % 2 else (False, True):
                switch(on)
                with _no_collector():
                    seconds = run(on)
                if repeat:
                    times[on].append(seconds)
    finally:
        switch(True)
    return {on: statistics.median(t) for on, t in times.items()}


# a) the mixing check's cost


def _regression_model(x: torch.Tensor, y: torch.Tensor) -> None:
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("rows", len(y)):
        pyro.sample("y", dist.Normal((x * w).sum(-1), s), obs=y)


def _regression_data(rows: int, weights: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, weights, generator=g, dtype=dtype)
    y = x.sum(-1) + 0.5 * torch.randn(rows, generator=g, dtype=dtype)
    return x, y


def _mlp_case(rows: int):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, 784, generator=g), torch.randint(10, (rows,), generator=g)

    def model() -> BayesianModule:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))
        return BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(60000))

    return model, (x, y)


def _first_steps(label: str, make_model, args: tuple, repeats: int) -> str:
    """The row of one model: its first step with and without the check, and a later step."""
    later: list[float] = []

    def run(on: bool) -> float:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = make_model()
        guide = AutoMeanFieldNormal(model)
        guide(*args)
        elbo = QuadratureELBO()
        svi = SVI(model, guide, QNVB(), elbo)
        first = _cpu(lambda: svi.step(*args))
        if elbo.vectorized(model, guide) is not True:
            raise RuntimeError(f"{label}: the first step did not keep the vectorized pass")
        if on:
            later.append(_cpu(lambda: svi.step(*args)))
        return first

    timed, own = _own_time(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the loop would time something else
        median = _alternate(timed, _mixing_check, repeats)
    on, off = median[True] * 1e3, median[False] * 1e3
    check = statistics.median(own[1:] or own) * 1e3  # the untimed round left out
    step = statistics.median(later[1:] or later) * 1e3
    return (
        f"| {label} | {off:.1f} | {on:.1f} | {on / off:.2f} | {check:.1f} | {step:.1f} "
        f"| {check / step:.2f} |"
    )


def _opqa_row(repeats: int) -> str:
    x, y = _regression_data(1000, 2, torch.float64)

    def run(on: bool) -> float:
        result = None

        def evidence() -> None:
            nonlocal result
            result = opqa_evidence(_regression_model, x, y, num_points=8)

        seconds = _cpu(evidence)
        if not result.diagnostics["vectorized"]:
            raise RuntimeError("opqa_evidence did not keep the vectorized pass")
        return seconds

    timed, own = _own_time(run)
    median = _alternate(timed, _mixing_check, repeats)
    on, off = median[True] * 1e3, median[False] * 1e3
    check = statistics.median(own[1:] or own) * 1e3
    label = "opqa_evidence, regression 1000 rows, 3 latents, 512 nodes (total)"
    return f"| {label} | {off:.1f} | {on:.1f} | {on / off:.2f} | {check:.1f} | - | - |"


def part_a(rows: int, repeats: int, mlp: bool) -> None:
    print("\n### a) The mixing check's cost: the first QuadratureELBO step (it probes)\n")
    print(
        "| model | first step, no check (ms) | with the check (ms) | ratio "
        "| the check itself (ms) | later step (ms) | check / later step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    schools = eight_schools().model
    print(_first_steps("eight schools (10 latents)", lambda: schools, (), repeats))
    x, y = _regression_data(rows, 10)
    label = f"regression, {rows} rows, 10 weights + noise"
    print(_first_steps(label, lambda: _regression_model, (x, y), repeats))
    if mlp:
        make, args = _mlp_case(256)
        print(_first_steps("BayesianModule MLP 784-100-10, B = 256", make, args, repeats))
    print(_opqa_row(repeats))


# b) what the mixing check buys


def _mixing_model(x: torch.Tensor, y: torch.Tensor) -> None:
    """``tests/test_qnvb_tiny_init.py``'s model: ``w[0]`` indexes the nodes' dim in a pass."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(1), 1.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(x.new_zeros(()), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(w[0] * x, s), obs=y)


def _mixing_data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, generator=g)
    return (x.to(dtype), (2 * x + 0.5 * torch.randn(100, generator=g)).to(dtype))


def _fit_w(init_scale: float, steps: int, dtype: torch.dtype, **elbo) -> tuple[float, float, bool]:
    """``w``'s loc and scale after ``steps`` QNVB steps, and whether a fallback was warned of."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    args = _mixing_data(dtype)
    guide = AutoMeanFieldNormal(_mixing_model, init_scale=init_scale)
    svi = SVI(_mixing_model, guide, QNVB(), QuadratureELBO(**elbo))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step(*args)
    warned = any("one by one" in str(w.message) for w in caught)
    return guide.locs.w.item(), guide.scales.w.item(), warned


def part_b(steps: int) -> None:
    exact, exact_scale, _ = _fit_w(0.1, 4 * steps, torch.float64, vectorize=False)
    print(f"\n### b) What it buys: `w[0]` on a vector latent, float32, {steps} QNVB steps\n")
    print(
        f"The mean field's w (the loop over the nodes, float64, {4 * steps} steps): "
        f"loc {exact:.4f}, scale {exact_scale:.4f}.\n"
    )
    print("| init_scale | w without the check | w with the check | fallback warned |")
    print("|---:|---:|---:|---|")
    for init_scale in (1e-1, 1e-5, 1e-8):
        fits = {}
        for on in (False, True):
            _mixing_check(on)
            try:
                fits[on] = _fit_w(init_scale, steps, torch.float32)
            finally:
                _mixing_check(True)
        print(
            f"| {init_scale:g} | {fits[False][0]:.4f} | {fits[True][0]:.4f} "
            f"| without: {fits[False][2]}, with: {fits[True][2]} |"
        )


# c) GuideDelta's cost


def _sites_model(n: int):
    def model(y: torch.Tensor) -> None:
        total = y.new_zeros(())
        for i in range(n):
            prior = dist.Gamma(2.0, 1.0) if i % 2 == 0 else dist.LogNormal(0.0, 1.0)
            total = total + pyro.sample(f"z{i}", prior.expand([5]).to_event(1)).sum(-1)
        pyro.sample("y", dist.Normal(total / (5 * n), 1.0), obs=y)

    return model


def _interleaved(call: Callable[[], object], calls: int, repeats: int) -> dict[bool, float]:
    """Median over ``repeats`` of the mean CPU seconds of ``call()`` with the `GuideDelta` and
    without it, the two alternated call by call (``calls`` of each a repeat), after one untimed
    call of each."""
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for on in (True, False):
            _guide_delta(on)
            call()
        for _ in range(repeats):
            total = {True: 0.0, False: 0.0}
            with _no_collector():
                for i in range(calls):
                    for on in (True, False) if i % 2 else (False, True):
                        _guide_delta(on)
                        total[on] += _cpu(call)
            for on in total:
                times[on].append(total[on] / calls)
    finally:
        _guide_delta(True)
    return {on: statistics.median(t) for on, t in times.items()}


def part_c(sites: list[int], repeats: int, svi_sites: int | None, draws: int) -> None:
    print("\n### c) GuideDelta's cost: one guide run, sites of shape (5,), positive support\n")
    print("| what | without GuideDelta (ms) | with (ms) | ratio | extra a site (µs) |")
    print("|---|---:|---:|---:|---:|")
    y = torch.tensor(1.0)
    for n in sites:
        pyro.clear_param_store()
        guide = AutoMeanFieldNormal(_sites_model(n))
        guide(y)
        median = _interleaved(
            lambda guide=guide: poutine.trace(guide).get_trace(y),
            max(1, draws // n),  # about `draws` sites drawn a repeat
            repeats,
        )
        on, off = median[True] * 1e3, median[False] * 1e3
        extra = (on - off) / n * 1e3
        print(f"| guide run, {n} sites | {off:.3f} | {on:.3f} | {on / off:.3f} | {extra:.0f} |")
    if svi_sites:
        model = _sites_model(svi_sites)
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoMeanFieldNormal(model)
        svi = SVI(model, guide, QNVB(), QuadratureELBO())
        svi.step(y)
        median = _interleaved(lambda: svi.step(y), 10, repeats)
        on, off = median[True] * 1e3, median[False] * 1e3
        label = f"SVI step, QuadratureELBO + QNVB, {svi_sites} sites"
        extra = (on - off) / svi_sites * 1e3
        print(f"| {label} | {off:.2f} | {on:.2f} | {on / off:.3f} | {extra:.0f} |")
    # the work `_KeepDensity` adds a site, besides its dispatch on every message: one more Delta
    v, log_density = torch.rand(5), torch.zeros(())
    built: dict[str, list[float]] = {"Delta": [], "GuideDelta": []}
    for repeat in range(6):  # alternated; the first round untimed
        for kind in (dist.Delta, GuideDelta) if repeat % 2 else (GuideDelta, dist.Delta):
            seconds = timeit.timeit(
                lambda k=kind: k(v, log_density=log_density, event_dim=1), number=2000
            )
            if repeat:
                built[kind.__name__].append(seconds / 2000 * 1e6)
    print(
        f"\nOne Delta of shape (5,) built: {min(built['Delta']):.1f} µs, one GuideDelta: "
        f"{min(built['GuideDelta']):.1f} µs (best of 5 timings of 2,000, alternated)."
    )


# d) what GuideDelta buys


def _gamma_model() -> None:
    pyro.sample("tau", dist.Gamma(0.1, 1.0))


def _fit_gamma(elbo, steps: int, seed: int) -> tuple[float, float, str]:
    """The site's loc and scale after ``steps`` steps, and how the fit ended."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(_gamma_model, init_scale=0.1)
    svi = SVI(_gamma_model, guide, QNVB(), elbo)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the diverging fits' warnings of overflows
        for step in range(steps):
            try:
                svi.step()
            except ValueError as error:  # QNVB refuses a run of steps that update nothing
                reason = str(error).split(": ", 1)[1].split(" (")[0]
                ended = f"QNVB refused step {step + 1}: {reason}"
                return guide.locs.tau.item(), guide.scales.tau.item(), ended
    return guide.locs.tau.item(), guide.scales.tau.item(), f"{steps} steps"


def _gauss_hermite_20() -> QuadratureELBO:
    return QuadratureELBO(rule="gauss_hermite", num_points=20)


def part_d(steps: int, seeds: list[int]) -> None:
    print(f"\n### d) What it buys: a lone `Gamma(0.1, 1)` site, QNVB, {steps} steps\n")
    # the mean field's loss of u = log tau ~ N(m, s^2) is -0.1 m + exp(m + s^2 / 2) - log s
    print(
        "The mean field's optimum in closed form: loc = log(0.1) - 5 = "
        f"{math.log(0.1) - 5:.3f}, scale = sqrt(10) = {math.sqrt(10):.3f}.\n"
    )
    print("| ELBO | seed | loc | scale | ended |")
    print("|---|---:|---:|---:|---|")
    variants = [
        ("TraceMeanField_ELBO, no GuideDelta", TraceMeanField_ELBO, False),
        ("TraceMeanField_ELBO, GuideDelta", TraceMeanField_ELBO, True),
        ("Trace_ELBO", Trace_ELBO, True),
        ("QuadratureELBO, Gauss-Hermite 20", _gauss_hermite_20, True),
    ]
    for label, make, on in variants:
        for seed in seeds if make is not _gauss_hermite_20 else seeds[:1]:  # deterministic
            _guide_delta(on)
            try:
                loc, scale, ended = _fit_gamma(make(), steps, seed)
            finally:
                _guide_delta(True)
            print(f"| {label} | {seed} | {loc:.3f} | {scale:.3g} | {ended} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--fit-steps", type=int, default=60)
    parser.add_argument("--gamma-steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a run of a few seconds: 1 repeat, 1,000 rows, no MLP, 10 sites, short fits",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rows, args.sites = 1, 1000, [10]
        args.fit_steps, args.gamma_steps, args.seeds = 10, 20, [0]
    torch.set_num_threads(1)
    print(f"CPU times, one thread, medians of {args.repeats} repeats (the variants alternated).")
    part_a(args.rows, args.repeats, mlp=not args.quick)
    part_b(args.fit_steps)
    part_c(args.sites, args.repeats, None if args.quick else 100, 100 if args.quick else 2000)
    part_d(args.gamma_steps, args.seeds)


if __name__ == "__main__":
    main()
