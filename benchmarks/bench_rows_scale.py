"""What the check of a plate whose rows the model gives costs at 10^3 to 10^6 rows.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_rows_scale.py \\
        [--sizes 1000 100000 1000000] [--variants drawn before now] [--batch 256] \\
        [--repeats 3] [--steps 20]

The model has a global intercept ``b`` and, in ``pyro.plate("rows", N, subsample=idx) as ind``,
a local latent ``u_i`` of 4 entries decoded by a small MLP (4-64-64-1, tanh, fixed weights) into
the logit of a 0/1 outcome ``y_i`` with few ones (each row 1 with probability 10^-5), read as
``obs=y[ind]``: the idiom that is accepted. ``AutoMeanFieldNormal`` without ``create_plates``
draws its own 256 rows, so the check runs (`pyro_quadvi.guides.rows.check_data_follow_rows`):
at the guide's set-up and at the ELBO's first step, each time three runs of the model at 256
rows; the outcome is all zeros at the rows compared, so each adds the run that tells data that
follow the rows from data kept at ``idx``. That run took all ``N`` rows (``before``: the script
sets the probed rows to ``torch.arange(N)``, as the check did) and takes the guide's and the
model's rows now (``now``). The baseline (``drawn``) is the same model with
``pyro.plate("rows", N, subsample_size=256)``, which the check leaves alone. Fitted with
``QNVB()`` and ``QuadratureELBO()``.

Each row of the table is one process (one thread): set-up is the CPU time of the first
``svi.step`` (the guide's set-up, the ELBO's first call, the checks), median of ``repeats``
fits from a fresh guide; a step is the median of ``steps`` steps after it, each on the next
256 rows of a permutation; the checks are the CPU time inside ``check_data_follow_rows`` in
the first fit, and the runs that decide them (their number, their rows at most, their time)
inside ``_follows_probed_rows``; peak memory is the rise of the process's peak resident set
(``ru_maxrss``, Linux) over the first fit.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides import mean_field, rows

VARIANTS = ("drawn", "before", "now")


def make_model(N: int, B: int, variant: str):
    generator = torch.Generator().manual_seed(0)
    y = (torch.rand(N, generator=generator) < 1e-5).float()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    mlp.requires_grad_(False)

    def model(idx, y):
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        if variant == "drawn":
            plate = pyro.plate("rows", N, subsample_size=B)
        else:
            plate = pyro.plate("rows", N, subsample=idx)
        with plate as ind:
            u = pyro.sample("u", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
            pyro.sample("y", dist.Bernoulli(logits=mlp(u).squeeze(-1) + b), obs=y[ind])

    return model, y


def timed(record: list[float], fn):
    """``fn``, adding its CPU seconds to ``record`` at each call."""

    def run(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.process_time() - start)

    return run


def measure(N: int, B: int, variant: str, repeats: int, steps: int) -> dict:
    """One row of the table, in this process."""
    torch.set_num_threads(1)
    checks: list[float] = []
    probes: list[float] = []
    check = timed(checks, rows.check_data_follow_rows)
    rows.check_data_follow_rows = mean_field.check_data_follow_rows = check
    rows._follows_probed_rows = timed(probes, rows._follows_probed_rows)
    probe_rows, probed = rows._probe_rows, []

    def count_rows(taken, given, size: int, full_size: int) -> torch.Tensor:
        if variant == "before":  # the plate at all N rows, as the check ran it
            chosen = torch.arange(full_size)
        else:
            chosen = probe_rows(taken, given, size, full_size)
        probed.append(len(chosen))
        return chosen

    rows._probe_rows = count_rows
    model, y = make_model(N, B, variant)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    batches = [order[(k * B) % (N - B + 1) :][:B] for k in range(steps + 1)]
    setups, step_times, peak = [], [], 0.0
    for repeat in range(repeats):
        pyro.clear_param_store()
        pyro.set_rng_seed(repeat)
        svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO())
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.process_time()
        svi.step(batches[0], y)
        setups.append(time.process_time() - start)
        if repeat == 0:
            peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
            first = {"check_ms": 1e3 * sum(checks), "probes": len(probes)}
            first["probe_ms"] = 1e3 * sum(probes)
            first["probed"] = max(probed, default=0)
            for batch in batches[1:]:
                start = time.process_time()
                svi.step(batch, y)
                step_times.append(time.process_time() - start)
    return {
        "N": N,
        "variant": variant,
        "setup_ms": 1e3 * statistics.median(setups),
        "step_ms": 1e3 * statistics.median(step_times),
        "peak_mb": peak,
        **first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--case", nargs=2, metavar=("N", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:  # one row, in a process of its own
        N, variant = int(args.case[0]), args.case[1]
        print(json.dumps(measure(N, args.batch, variant, args.repeats, args.steps)))
        return
    common = ["--batch", str(args.batch), "--repeats", str(args.repeats)]
    common += ["--steps", str(args.steps)]
    print(
        "| N | model | set-up (ms) | step (ms) | checks (ms) | deciding runs "
        "| their rows | their time (ms) | peak memory at set-up (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for N in args.sizes:
        if N <= args.batch:
            parser.error(f"--sizes must exceed --batch ({args.batch}), got {N}")
        for variant in args.variants:
            command = [sys.executable, __file__, "--case", str(N), variant, *common]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            label = {
                "drawn": f"subsample_size={args.batch}",
                "before": "subsample=idx, all-rows run (before)",
                "now": "subsample=idx, now",
            }[variant]
            print(
                f"| {N:,} | {label} | {row['setup_ms']:.0f} "
                f"| {row['step_ms']:.1f} | {row['check_ms']:.1f} | {row['probes']} "
                f"| {row['probed']:,} | {row['probe_ms']:.1f} | {row['peak_mb']:.0f} |"
            )


if __name__ == "__main__":
    main()
