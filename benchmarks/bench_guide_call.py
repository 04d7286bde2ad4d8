"""What ``AutoMeanFieldNormal``'s own record of a run costs a guide call, against Pyro's
``AutoNormal``, on a model of ``S`` scalar sites.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_guide_call.py [--sites 10 100 1000]
        [--repeats 7] [--samples 40]

``AutoMeanFieldNormal.forward`` ("AMFN", the package as it is) reads, after each run, every
site's minibatch scale, rows and mask (and the parameters' shapes, to refuse a restored store of
another model). It wraps the run in a whole ``poutine.trace`` for that; trial t32 (session 27)
put that trace at about 60 us a site a run. Two variants of AMFN split its extra over
``AutoNormal``:

- "kept": the candidate that would replace that trace, a messenger keeping a copy of each
  sample and param message by name (`KeptSites`: what a `Trace` holds of them, without its
  checks, its graph and its input and return nodes), swapped in for ``poutine.trace`` in
  ``mean_field``'s namespace (`kept`), the rest of ``forward`` as it is;
- "no GuideDelta": each site drawn through Pyro's ``Delta`` (`WithoutGuideDelta`), the
  baseline of the docs' "GuideDelta" section.

The model: ``z_i ~ N(0, 1)``, ``y_i ~ N(z_i, 0.5)`` observed, ``i < S``, float64. Rows, each at
each ``S``:

- ``guide()``: the call as a user makes it, no handler around it (``AutoNormal`` then runs
  without Pyro's effect stack: each ``pyro.sample`` and ``pyro.param`` a plain call);
- ``guide() in a trace``: inside ``poutine.trace``, as an ELBO and ``Predictive`` run it;
- ``Predictive(parallel=True)``: ``--samples`` draws of every site, the guide and the model
  vectorized.

Before timing, AMFN and its "kept" variant are run from one seed and must return the same
draws and record the same minibatch (``_last_run``) to the bit; the script stops otherwise.

Method: CPU time (``time.process_time``), one thread, the garbage collector off during each timed
call (collected before it); the variants alternated within each repeat, the median of
``--repeats`` after one untimed round. ``--quick`` (the test of the scripts): 10 and 20 sites, 2
repeats, 4 samples.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal
from pyro.poutine.messenger import Messenger

from pyro_quadvi import AutoMeanFieldNormal
from pyro_quadvi.guides import mean_field


def make_model(sites: int) -> Callable[[], None]:
    """The model of ``sites`` scalar latents, each observed once (data drawn from seed 0)."""
    y = torch.randn(sites, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def model() -> None:
        for i in range(sites):
            z = pyro.sample(f"z_{i}", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
            pyro.sample(f"y_{i}", dist.Normal(z, 0.5), obs=y[i])

    return model


class KeptSites(Messenger):
    """A copy of each sample and param message of a run by name (``nodes``), taken as a `Trace`
    takes it: after the handlers outside, before those inside (a plate inside subsamples a
    parameter's value afterwards)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, dict] = {}

    def _pyro_post_sample(self, msg: dict) -> None:
        self.nodes[msg["name"]] = msg.copy()

    _pyro_post_param = _pyro_post_sample


class KeptRun:
    """What ``forward`` reads of ``poutine.trace(fn)`` (made for one call): a call of ``fn``
    and its record, ``trace``."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.trace = KeptSites()

    def __call__(self, *args, **kwargs) -> object:
        with self.trace:
            return self.fn(*args, **kwargs)


def kept(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with ``AutoMeanFieldNormal.forward``'s ``poutine.trace`` replaced by `KeptRun`."""

    def run() -> object:
        mean_field.poutine = SimpleNamespace(trace=KeptRun)
        try:
            return call()
        finally:
            mean_field.poutine = poutine

    return run


class WithoutGuideDelta(AutoMeanFieldNormal):
    """``AutoMeanFieldNormal`` drawing through Pyro's ``Delta`` (``_draw`` is ``AutoNormal``'s
    run), as the "GuideDelta" section of the docs' benchmarks times it."""

    def _draw(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return AutoNormal.forward(self, *args, **kwargs)


def check_same(guide: AutoMeanFieldNormal) -> None:
    """The kept and the traced record give the same draws and the same ``_last_run``."""
    runs = []
    for run in (kept(guide), guide):
        pyro.set_rng_seed(1)
        draws = run()
        runs.append((draws, guide._last_run))
    (a, last_a), (b, last_b) = runs
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    same = same and last_a == last_b
    if not same:
        raise SystemExit("the kept and the traced records differ")


def cpu(call: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        call()
        return time.process_time() - start
    finally:
        gc.enable()


def timed(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each call, the calls alternated (order reversed every repeat)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for repeat in range(repeats):
        names = list(calls) if repeat % 2 == 0 else list(calls)[::-1]
        for name in names:
            times[name].append(cpu(calls[name]))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sites, args.repeats, args.samples = [10, 20], 2, 4
    torch.set_num_threads(1)
    print(
        "| S | call | AutoNormal (ms) | AMFN (ms) | kept (ms) | no GuideDelta (ms) "
        "| AMFN / AutoNormal | kept / AMFN | no GuideDelta / AMFN |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for sites in args.sites:
        model = make_model(sites)
        pyro.clear_param_store()
        guides = {
            "AutoNormal": AutoNormal(model),
            "AMFN": AutoMeanFieldNormal(model),
            "no GuideDelta": WithoutGuideDelta(model),
        }
        for guide in guides.values():
            guide()
        check_same(guides["AMFN"])
        kinds = {
            "guide()": lambda g: g,
            "guide() in a trace": lambda g: lambda: poutine.trace(g).get_trace(),
            "Predictive(parallel=True)": lambda g, model=model: Predictive(
                model, guide=g, num_samples=args.samples, parallel=True
            ),
        }
        for label, make in kinds.items():
            calls = {name: make(guide) for name, guide in guides.items()}
            calls["kept"] = kept(make(guides["AMFN"]))
            ms = timed(calls, args.repeats)
            a, t, k, d = (ms[name] for name in ("AutoNormal", "AMFN", "kept", "no GuideDelta"))
            print(
                f"| {sites} | {label} | {a:.2f} | {t:.2f} | {k:.2f} | {d:.2f} | {t / a:.2f} "
                f"| {k / t:.2f} | {d / t:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
