"""Every benchmark script's smallest run finishes: a script that subclasses or calls the package's
internals (``bench_bnn_speed.py`` times ``QNVBOptimizer._update``) breaks when they change, and
nothing else runs it. Each invocation below takes a few seconds; its outputs go to ``tmp_path``.

The scripts run as subprocesses from the repository root (tests never import ``benchmarks/``), as
``docs/benchmarks.md`` runs them. Each must exit 0 and print its markdown table (a header, its
separator and at least one row), or write the files it is told to. Left out: the scripts that need
MNIST (``bench_bnn_quality.py``, ``bench_distributed.py``, ``bench_qnvb_wide.py``,
``bench_sparse_qnvb_diagnose.py``) and those with no run under about 6 seconds
(``bench_anneal_lag.py``, ``bench_evidence.py``, ``bench_elbo_accuracy.py``, ``bench_nodes.py``,
``bench_whvi.py``'s ``fwht`` and ``layer``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent

# (script, arguments; "{tmp}" is the test's tmp_path, files: what it must have written)
RUNS = {
    "skewed_site": ("bench_skewed_site.py", "--steps 5", ()),
    "session22_checks": ("bench_session22_checks.py", "--quick", ()),
    "session24_checks": ("bench_session24_checks.py", "--quick", ()),
    "session26_checks": ("bench_session26_checks.py", "--quick", ()),
    "node_parallel_check": ("bench_node_parallel_check.py", "--quick", ()),
    "session26_elbo_checks": ("bench_session26_elbo_checks.py", "--quick", ()),
    "session26_declaration": ("bench_session26_declaration.py", "--repeats 1 --steps 1", ()),
    "laplace_hessian": ("bench_laplace_hessian.py", "--sites 5 --repeats 1", ()),
    "session27_moments_check": (
        "bench_session27_moments_check.py",
        "--repeats 1 --steps 1 --widths 20-10-3",
        (),
    ),
    "projections": ("bench_projections.py", "--quick", ()),
    "export_trial": ("bench_export_trial.py", "--rows 200 --chunks 50 --repeats 1", ()),
    "resolution_check": ("bench_resolution_check.py", "--repeats 1 --steps 1 --widths 10-5-3", ()),
    "bnn_speed": ("bench_bnn_speed.py", "--nets 1-50-1 --repeats 1 --steps 1 --no-compile", ()),
    "arviz_export": ("arviz_export.py", "--repeats 1", ()),
    "data_checks": ("bench_data_checks.py", "--repeats 1", ()),
    "markov_chain": ("bench_markov_chain.py", "--forms vector --T 20 --steps 1 10", ()),
    "observed_check": ("bench_observed_check.py", "--rows 10000 --repeats 1", ()),
    "latent_memory": ("bench_latent_memory.py", "--sizes 1000 --guides mean_field", ()),
    "probe_tolerance": ("bench_probe_tolerance.py", "--repeats 1 --nets '13-50-1, B=64'", ()),
    "sparse_qnvb_trial": (
        "bench_sparse_qnvb_trial.py",
        "--steps 3 --report 3 --methods sparse qnvb adam pyro",
        (),
    ),
    "elbo_cost": ("bench_elbo_cost.py", "--repeats 1 --steps 2", ()),
    "exactness": ("bench_exactness.py", "--dim 16 --trials 2 --max-k 6 --plot ''", ()),
    "predict_memory": (
        "bench_predict_memory.py",
        "--rows 200 --draws 4 --batch-sizes 0 100 --repeats 1",
        (),
    ),
    "sparse_dense": (
        "bench_sparse_dense.py",
        "--batches 32 --tau-max 0.1 --pairs 2 --sparsity 0.7",
        (),
    ),
    "qnvb": ("bench_qnvb.py", "--problems linear-d10-rho0 --max-evals 200 --history", ()),
    "qnvb_diagnostics": (
        "qnvb_diagnostics.py",
        "--problem linear-d10-rho0 --loss trace --steps 10",
        (),
    ),
    "rules": (
        "bench_rules.py",
        "--problems eight-schools pyro-eight-schools --budget 48 --early 24 --seeds 1",
        (),
    ),
    "blocked_signs": (
        "bench_blocked_signs.py",
        "--part suite --seeds 1 --problems eight-schools --budget 48 --early 24",
        (),
    ),
    "small_net_elbo": ("bench_small_net_elbo.py", "--quick --part probe", ()),
    "qnvb_lr": (
        "bench_qnvb_lr.py",
        "--splits 1 --evals 30 --draws 4 --results {tmp}/qnvb_lr.json",
        ("qnvb_lr.json",),
    ),
    "hierarchical_exact": (
        "bench_hierarchical_exact.py",
        "nested --rules blocked_simplex --steps 10 --adam-steps 10 --draws 10 --mc 1000",
        (),
    ),
    "spike_slab": (
        "bench_spike_slab.py",
        "--epochs 2 --reps 1 --eval-every 1 --json {tmp}/s.jsonl --plot {tmp}/s.png --no-progress",
        ("s.jsonl", "s.png"),
    ),
    "sparse_qnvb_regression": (
        "bench_sparse_qnvb_regression.py",
        "--reps 1 --sparse-epochs 3 --gumbel-epochs 1 --sparse-batch 512 "
        "--json {tmp}/r.jsonl --plot {tmp}/r.png",
        ("r.jsonl", "r.png"),
    ),
    "sparse_qnvb_integration": (
        "bench_sparse_qnvb.py",
        "--integration --trials 50 --fig-dir {tmp} --out {tmp}/i.json",
        ("i.json",),
    ),
    "sparse_qnvb_digits": (
        "bench_sparse_qnvb.py",
        "--dataset digits --net mlp --epochs 3 --methods sparse --fig-dir {tmp} --out {tmp}/s.json",
        ("s.json",),
    ),
    "whvi_uci": (
        "bench_whvi.py",
        "uci --datasets boston --splits 1 --steps 5 --adam-steps 15 --jsonl {tmp}/w.jsonl",
        ("w.jsonl",),
    ),
    "whvi_toy": ("bench_whvi.py", "toy --steps 5 --out {tmp}/t.png", ("t.png",)),
    "guide_hook": ("bench_guide_hook.py", "--depth 2 --repeats 1 --calls 10 --steps 2", ()),
    "qnvb_float32_forms": ("qnvb_float32_forms.py", "", ()),
    "vectorize_check": ("bench_vectorize_check.py", "--repeats 2 --steps 3", ()),
    "many_sites": ("bench_many_sites.py", "--quick", ()),
    "guide_call": ("bench_guide_call.py", "--quick", ()),
    "first_step": ("bench_first_step.py", "--quick", ()),
    "given_rows": ("bench_given_rows.py", "--repeats 1", ()),
    "unscaled": ("bench_unscaled.py", "--draws 2 --seeds 1 --steps 2 --rules hadamard", ()),
    "rows_scale": ("bench_rows_scale.py", "--sizes 1000 --variants now --repeats 1 --steps 2", ()),
    "elbo_bound": ("bench_elbo_bound.py", "--seeds 0 --steps 100 --mc-repeats 2", ()),
    "horseshoe": ("bench_horseshoe.py", "--quick", ()),
}

# scripts that report in prose lines, not a markdown table
NO_TABLE = {"qnvb_float32_forms"}


def _run(script: str, arguments: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
        "MPLBACKEND": "Agg",
    }
    env.pop("PYRO_QUADVI_DATA", None)  # no MNIST: every run here uses generated or packaged data
    command = [sys.executable, str(ROOT / "benchmarks" / script)]
    command += shlex.split(arguments.format(tmp=tmp))
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )


def _table_rows(stdout: str) -> int:
    """Rows of the markdown tables printed (lines starting with ``|`` after a separator)."""
    rows, in_table = 0, False
    for line in stdout.splitlines():
        if line.startswith("|---") or line.startswith("| ---"):
            in_table = True
        elif in_table and line.startswith("|"):
            rows += 1
        else:
            in_table = False
    return rows


# in the default suite: the scripts that subclass the package's classes or call its private
# functions (bnn_speed, blocked_signs, data_checks, given_rows, rows_scale, many_sites,
# observed_check, small_net_elbo, sparse_qnvb_trial, session22_checks, session24_checks,
# session26_checks, session26_elbo_checks, session27_moments_check, projections: the ones a
# refactor breaks first) and two quick ones of the export and the sparse optimizers; the others
# with ``-m slow`` (together 65 s on one core, mostly each process's imports of torch and pyro)
# functions (bnn_speed, blocked_signs, data_checks, given_rows, rows_scale, many_sites, guide_call,
# first_step, observed_check, small_net_elbo, sparse_qnvb_trial, session22_checks, session24_checks,
# session26_checks, session26_elbo_checks, projections: the ones a refactor breaks first) and
# two quick ones of the export and the sparse optimizers; the others with ``-m slow`` (together
# 65 s on one core, mostly each process's imports of torch and pyro)
INTERNALS = {
    "bnn_speed",
    "arviz_export",
    "blocked_signs",
    "data_checks",
    "given_rows",
    "rows_scale",
    "many_sites",
    "guide_call",
    "first_step",
    "observed_check",
    "small_net_elbo",
    "sparse_qnvb_integration",
    "sparse_qnvb_trial",
    "session22_checks",
    "session24_checks",
    "session26_checks",
    "session26_elbo_checks",
    "session27_moments_check",
    "projections",
}


@pytest.mark.parametrize(
    "name",
    [name if name in INTERNALS else pytest.param(name, marks=pytest.mark.slow) for name in RUNS],
)
def test_the_benchmark_script_finishes(name, tmp_path):
    script, arguments, files = RUNS[name]
    done = _run(script, arguments, tmp_path)
    assert done.returncode == 0, f"{script} {arguments}\n{done.stderr[-3000:]}"
    missing = [f for f in files if not (tmp_path / f).is_file()]
    assert not missing, f"{script} did not write {missing}"
    if not files and name not in NO_TABLE:
        assert _table_rows(done.stdout) >= 1, f"{script} printed no table:\n{done.stdout[-2000:]}"


def test_bench_qnvb_refuses_a_method_it_does_not_know(tmp_path):
    # a misspelt --methods name used to be dropped silently, leaving a table without its row
    done = _run("bench_qnvb.py", "--methods 'QNVB + Trace_ELBO' 'Adam + Trace_ELBO'", tmp_path)
    assert done.returncode == 2
    assert "unknown --methods ['Adam + Trace_ELBO']; known: ['QNVB + QuadratureELBO" in done.stderr
