"""Why QNVB stalls on a small tanh network's ELBO where untuned Adam goes lower.

``docs/benchmarks.md``, "Small tanh network: the damping stalls the means", records its output.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_small_net_elbo.py --part small-net
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_small_net_elbo.py --part regression
    python benchmarks/bench_small_net_elbo.py --quick --part all       # smoke run

``--part small-net``: a 3-32-1 tanh :class:`~pyro_quadvi.nn.BayesianModule` (prior
``priors.Normal(1.0)``, ``likelihoods.Gaussian(200, scale=0.3)``, ``y = sin(x . w) + noise``, full
batch of N = 200), ``AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())``, ``QuadratureELBO``,
trained by each of :data:`SMALL_NET_VARIANTS` for ``--steps``; per variant the final ``-ELBO`` by
500 Monte Carlo draws (``Trace_ELBO``), the test RMSE of the predictive mean (100 test rows,
64 draws), the median guide scale and, for QNVB, the median damping divisor ``k``; and at the
steps of ``--trace-every`` and ``--trace-steps`` (and the last one) where each rule binds, measured
with the package's own update (:class:`RuleTrace`; ``--show-trace`` prints it).

``--part regression``: the regression cells the "Quality" section of ``docs/nn.md`` quotes, reduced
(diabetes 1x50 and Boston 2x128, ``--splits`` splits, ``--evals`` gradient evaluations), run
through ``benchmarks/bench_bnn_quality.py``'s own ``run`` for each of :data:`REGRESSION_VARIANTS`
in the same process: the final test NLL and the ``-ELBO`` (64 draws) per split.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn
from tqdm import tqdm

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi import metrics as M
from pyro_quadvi.nn import NETWORK_QNVB_SETTINGS, BayesianModule, likelihoods, priors
from pyro_quadvi.optim.qnvb_functional import qnvb_update

sys.path.insert(0, str(Path(__file__).parent))
import bench_bnn_quality as quality

#: name -> (qnvb_settings of the module (None: what it declares), QNVB arguments, rule); "adam":
#: Pyro's Adam at lr 0.01 instead of QNVB
SMALL_NET_VARIANTS = {
    "declared (QNVB())": (None, {}, None),
    "declared, damping=False": (None, {"damping": False}, None),
    "declared, damping=False, beta1=0.9": (None, {"damping": False, "betas": (0.9, 0.999)}, None),
    "declared, significance=0": (None, {"significance": 0.0}, None),
    "declared, trust_region=inf": (None, {"trust_region": math.inf}, None),
    "declared, scale_max=10": (None, {"scale_max": 10.0}, None),
    "declared, damping_recovery=1": (None, {"damping_recovery": 1.0}, None),
    "declared, damping_recovery=1.5": (None, {"damping_recovery": 1.5}, None),
    "declared, damping_recovery=2": (None, {"damping_recovery": 2.0}, None),
    "declared, damping_recovery=2, beta1=0.9": (
        None,
        {"damping_recovery": 2.0, "betas": (0.9, 0.999)},
        None,
    ),
    "declared, hadamard K=4": (None, {}, ("hadamard", 4)),
    "own (qnvb_settings={})": ({}, {}, None),
    "own, trust_region=1": ({}, {"trust_region": 1.0}, None),
    "own, trust_region=1, damping=False": ({}, {"trust_region": 1.0, "damping": False}, None),
    "adam lr 0.01": None,
}

#: name -> QNVB arguments for every block (bench_bnn_quality's modules declare nothing)
REGRESSION_VARIANTS = {
    "declared": dict(NETWORK_QNVB_SETTINGS),
    "declared, damping=False": {**NETWORK_QNVB_SETTINGS, "damping": False},
    "declared, damping=False, beta1=0.9": {
        **NETWORK_QNVB_SETTINGS,
        "damping": False,
        "betas": (0.9, 0.999),
    },
    "declared, damping_recovery=2": {**NETWORK_QNVB_SETTINGS, "damping_recovery": 2.0},
    "declared, damping_recovery=2, beta1=0.9": {
        **NETWORK_QNVB_SETTINGS,
        "damping_recovery": 2.0,
        "betas": (0.9, 0.999),
    },
}


def small_net_problem():
    """The data (train and test) of the small tanh network, seeded."""
    torch.manual_seed(0)
    w = torch.tensor([1.0, -2.0, 0.5])
    x = torch.randn(200, 3)
    y = torch.sin(x @ w) + 0.3 * torch.randn(200)
    x_test = torch.randn(100, 3)
    y_test = torch.sin(x_test @ w) + 0.3 * torch.randn(100)
    return x, y, x_test, y_test


#: rule -> the hyperparameters under which the package's update skips it (each read in
#: ``qnvb_functional._reference_rules``): with ``damping=False`` the update keeps the state's
#: divisor, so :class:`RuleTrace` also passes a state whose divisor is 1; ``scale_min`` must be
#: positive (``QNVBHyperparameters`` refuses 0), and ``sigma`` times the smallest normal float is
#: 0 in float32 and below any target in float64
RULES_OFF = {
    "damping": {"damping": False},
    "sigma held (significance)": {"significance": 0.0},
    "trust region": {"trust_region": math.inf},
    "lr cap": {"lr": math.inf},
    "scale_max": {"scale_max": math.inf},
    "scale_min": {"scale_min": sys.float_info.min},
}


class RuleTrace:
    """Wraps the package's flat QNVB update to measure, at the steps it is armed for, where each
    rule of :data:`RULES_OFF` binds: the step's own inputs go through the package's reference
    :func:`~pyro_quadvi.optim.qnvb_functional.qnvb_update` once as given and once per rule with
    that rule switched off, and a rule binds at the coordinates whose new ``mu`` or ``sigma``
    differs. No rule is computed here; the rest is read from the update's results (``k``, the
    sign test's gradients, ``h_avg``, the ``sigma_min``/``sigma_max`` counts)."""

    def __init__(self):
        import pyro_quadvi.optim.qnvb as qnvb_module

        self.module = qnvb_module
        self.original = qnvb_module.qnvb_update_many
        self.signature = inspect.signature(self.original)
        self.armed = False
        self.cpu = 0.0  # process time spent measuring (not training)
        self.measured: list[dict[str, torch.Tensor]] = []

    def __enter__(self):
        self.module.qnvb_update_many = self
        return self

    def __exit__(self, *exc):
        self.module.qnvb_update_many = self.original
        return False

    def __call__(self, *args, **kwargs):
        results = self.original(*args, **kwargs)
        if self.armed:
            start = time.process_time()
            self.measure(self.signature.bind(*args, **kwargs))
            self.cpu += time.process_time() - start
        return results

    def measure(self, call: inspect.BoundArguments) -> None:
        """Run the reference update on the step's inputs, as given and per rule switched off."""
        call.apply_defaults()
        a = call.arguments
        blocks = list(zip(a["mus"], a["sigmas"], a["gs"], a["hs"], a["states"]))

        def update(hp, no_divisor=False):
            return [
                qnvb_update(
                    mu,
                    sigma,
                    g,
                    h,
                    state._replace(damping=torch.ones_like(state.damping)) if no_divisor else state,
                    hp,
                    a["weight"],
                    a["prior_precision"],
                )
                for mu, sigma, g, h, state in blocks
            ]

        def flat(tensors):
            return torch.cat([t.reshape(-1) for t in tensors])

        given = update(a["hp"])
        row = {
            "k": flat([r.state.damping for r in given]),
            # the update's own sign test: this step's total gradient (kept as last_grad) against
            # the previous one
            "flipped": flat(
                [r.state.last_grad * s.last_grad < 0 for r, s in zip(given, a["states"])]
            ),
            "h sigma^2": flat([r.state.h_avg * s**2 for r, s in zip(given, a["sigmas"])]),
            "sigma_min": torch.stack([r.num_sigma_min for r in given]).sum(),
            "sigma_max": torch.stack([r.num_sigma_max for r in given]).sum(),
        }
        for rule, change in RULES_OFF.items():
            off = update(replace(a["hp"], **change), no_divisor=rule == "damping")
            row[rule] = flat([(o.mu != r.mu) | (o.sigma != r.sigma) for o, r in zip(off, given)])
        self.measured.append(row)

    def take(self) -> dict[str, float]:
        """The measurements since the last call (every block the update saw), as fractions of the
        coordinates and medians; empty if there were none."""
        if not self.measured:
            return {}
        rows, self.measured = self.measured, []
        joined = {key: [row[key] for row in rows] for key in rows[0]}
        total = sum(t.numel() for t in joined["k"])
        out = {"k median": float(torch.cat(joined["k"]).median())}
        out["flipped"] = float(torch.cat(joined["flipped"]).float().mean())
        for rule in RULES_OFF:
            out[rule] = float(torch.cat(joined[rule]).float().mean())
        for bound in ("sigma_min", "sigma_max"):
            out[bound] = float(sum(joined[bound])) / total
        out["h sigma^2"] = float(torch.cat(joined["h sigma^2"]).median())
        return out


def run_small_net(name: str, steps: int, traced: set[int], bar: tqdm) -> dict:
    """Train the small net with one variant; the final scores and the trace (at the steps in
    ``traced`` and the last one; the CPU time leaves out the trace's measurements)."""
    x, y, x_test, y_test = small_net_problem()
    spec = SMALL_NET_VARIANTS[name]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    net = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))
    settings = {} if spec is None or spec[0] is None else {"qnvb_settings": spec[0]}
    bnn = BayesianModule(
        net, priors.Normal(1.0), likelihoods.Gaussian(len(y), scale=0.3), **settings
    )
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    if spec is None:
        optim, elbo = pyro.optim.Adam({"lr": 0.01}), QuadratureELBO()
    else:
        rule = {} if spec[2] is None else {"rule": spec[2][0], "num_points": spec[2][1]}
        optim, elbo = QNVB(**spec[1]), QuadratureELBO(**rule)
    svi = SVI(bnn, guide, optim, elbo)
    trace, start = [], time.process_time()
    with RuleTrace() as rules:
        for i in range(1, steps + 1):
            rules.armed = i in traced or i == steps
            loss = svi.step(x, y)
            if rules.armed:
                scale = torch.cat([s.scale.detach().reshape(-1) for s in guide.mean_field_sites()])
                trace.append(
                    {"step": i, "loss": loss, "scale median": float(scale.median()), **rules.take()}
                )
            bar.update()
    cpu = time.process_time() - start - rules.cpu
    pyro.set_rng_seed(1)
    mc = Trace_ELBO(num_particles=100, vectorize_particles=True, max_plate_nesting=1)
    neg_elbo = sum(mc.loss(bnn, guide, x, y) for _ in range(5)) / 5
    pred = bnn.predict(guide, x_test, num_samples=64)
    return {
        "neg_elbo": neg_elbo,
        "rmse": float(M.rmse(pred.mean.squeeze(-1), y_test)),
        "scale": trace[-1]["scale median"],
        "k": trace[-1].get("k median", float("nan")),
        "cpu": cpu,
        "trace": trace,
        "model": (bnn, guide, x, y),
    }


def part_small_net(opts) -> None:
    names = opts.variants or list(SMALL_NET_VARIANTS)
    bar = tqdm(total=len(names) * opts.steps, desc="small net")
    traced = set(range(opts.trace_every, opts.steps + 1, opts.trace_every))
    traced |= set(opts.trace_steps or ())
    results = {name: run_small_net(name, opts.steps, traced, bar) for name in names}
    bar.close()
    print(f"\n3-32-1 tanh, {opts.steps} steps\n")
    print("| variant | -ELBO (MC 500) | test RMSE | median scale | median k | CPU s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['neg_elbo']:.1f} | {r['rmse']:.3f} | {r['scale']:.3f} | "
            f"{r['k']:.1f} | {r['cpu']:.0f} |"
        )
    for name in opts.show_trace or ():
        print(f"\ntrace of {name}:\n")
        rows = results[name]["trace"]
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---:|" * len(keys))
        for row in rows:
            print("| " + " | ".join(f"{row.get(k, float('nan')):.3g}" for k in keys) + " |")


def rule_moments(bnn, guide, x, y, elbo, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``draws`` estimates of ``g`` and ``h`` (every coordinate) by ``elbo`` at the guide's current
    parameters, read from the gradients as QNVB reads them (``docs/qnvb.md``: ``g = dL/dmu``,
    ``h = (dL/dsigma + 1/sigma) / sigma``; the scales are ``softplus`` of their leaves)."""
    store = pyro.get_param_store()
    sites = guide.mean_field_sites()
    locs = [store[s.param_names["loc"]] for s in sites]
    leaves = [store._params[s.param_names["scale"]] for s in sites]
    u = torch.cat([leaf.detach().reshape(-1) for leaf in leaves])
    sigma = torch.nn.functional.softplus(u)
    gs, hs = [], []
    for _ in range(draws):
        grads = torch.autograd.grad(elbo.differentiable_loss(bnn, guide, x, y), locs + leaves)
        flat = [t.reshape(-1) for t in grads]
        gs.append(torch.cat(flat[: len(locs)]))
        d_sigma = torch.cat(flat[len(locs) :]) / torch.sigmoid(u)
        hs.append((d_sigma + 1 / sigma) / sigma)
    return torch.stack(gs), torch.stack(hs)


def quantiles(t: torch.Tensor) -> str:
    q = t.quantile(torch.tensor([0.1, 0.5, 0.9], dtype=t.dtype)).tolist()
    return " / ".join(f"{v:.3g}" for v in q)


def part_probe(opts) -> None:
    """At the declared settings' final point: is ``h`` biased, how noisy is ``g``?"""
    bar = tqdm(total=opts.steps, desc="small net, declared")
    bnn, guide, x, y = run_small_net("declared (QNVB())", opts.steps, set(), bar)["model"]
    bar.close()
    sigma = torch.cat([s.scale.detach().reshape(-1) for s in guide.mean_field_sites()])
    pyro.set_rng_seed(2)
    mc = Trace_ELBO(num_particles=opts.mc_draws, vectorize_particles=True, max_plate_nesting=1)
    _, h_mc = rule_moments(bnn, guide, x, y, mc, 5)
    h_true = h_mc.mean(0)
    print(f"\nat the declared settings' point after {opts.steps} steps (10% / 50% / 90%)\n")
    print("| estimate | draws | h / h(MC) | h sigma^2 | abs(mean g) / sd(g) | sign flips |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| Trace_ELBO, {opts.mc_draws} particles | 5 | 1 | {quantiles(h_true * sigma**2)} | "
        f"- | - |"
    )
    rules = (
        ("blocked_simplex", 3, opts.rule_draws),
        ("hadamard", 4, opts.rule_draws),
        ("hadamard", 256, max(2, opts.rule_draws // 10)),
    )
    for rule, k, draws in rules:
        g_q, h_q = rule_moments(bnn, guide, x, y, QuadratureELBO(rule=rule, num_points=k), draws)
        flips = float((g_q[1:] * g_q[:-1] < 0).float().mean())
        print(
            f"| {rule} K={k} | {draws} | {quantiles(h_q.mean(0) / h_true)} | "
            f"{quantiles(h_q.mean(0) * sigma**2)} | "
            f"{quantiles(g_q.mean(0).abs() / g_q.std(0))} | {flips:.2f} |"
        )


def part_regression(opts) -> None:
    cells = [tuple(cell.split("/")) for cell in opts.cells]
    variants = opts.regression_variants or list(REGRESSION_VARIANTS)
    grid = quality.eval_grid(opts.evals, 4)
    total = len(cells) * opts.splits * len(variants)
    bar = tqdm(total=total, desc="regression")
    print(f"\nregression, {opts.evals} evaluations, splits 0..{opts.splits - 1}\n")
    print("| cell | split | variant | test NLL | -ELBO (64 draws) | weight scale median |")
    print("|---|---:|---|---:|---:|---:|")
    for name, net_name in cells:
        in_dim = quality.regression_task(name, 0).x_train.shape[1]
        make = partial(quality.regression_net, in_dim, net_name)
        for split in range(opts.splits):
            task = quality.regression_task(name, split)
            for variant in variants:
                args = REGRESSION_VARIANTS[variant]
                r = quality.run("qnvb", task, make, None, grid, 32, seed=split, qnvb_args=args)
                f = r["final"]
                print(
                    f"| {name} {net_name} | {split} | {variant} | {f['nll']:.3f} | "
                    f"{r['neg_elbo']:.1f} | {r['weight_scale_median']:.3f} |",
                    flush=True,
                )
                bar.update()
    bar.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--part", choices=("small-net", "probe", "regression", "all"), default="all"
    )
    parser.add_argument("--steps", type=int, default=2000, help="small net: steps per variant")
    parser.add_argument("--trace-every", type=int, default=250, help="small net: trace period")
    parser.add_argument(
        "--trace-steps", type=int, nargs="+", help="small net: more steps to trace (e.g. 1 2 5)"
    )
    parser.add_argument("--variants", nargs="+", choices=sorted(SMALL_NET_VARIANTS))
    parser.add_argument("--show-trace", nargs="+", choices=sorted(SMALL_NET_VARIANTS))
    parser.add_argument("--mc-draws", type=int, default=20000, help="probe: MC particles")
    parser.add_argument("--rule-draws", type=int, default=200, help="probe: draws of each rule")
    parser.add_argument("--splits", type=int, default=2, help="regression splits")
    parser.add_argument("--evals", type=int, default=1000, help="regression evaluations")
    parser.add_argument(
        "--cells", nargs="+", default=["diabetes/1x50", "boston/2x128"], help="regression cells"
    )
    parser.add_argument("--regression-variants", nargs="+", choices=sorted(REGRESSION_VARIANTS))
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.steps, opts.trace_every, opts.splits, opts.evals = 20, 10, 1, 30
        opts.mc_draws, opts.rule_draws = 200, 4
    if opts.part in ("small-net", "all"):
        part_small_net(opts)
    if opts.part in ("probe", "all"):
        part_probe(opts)
    if opts.part in ("regression", "all"):
        part_regression(opts)


if __name__ == "__main__":
    main()
