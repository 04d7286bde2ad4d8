"""QNVB on two hierarchical models against their exact mean-field optimum.

Model 1 (``nested``): ``mu0 ~ N(0, 5)``, ``sd_g ~ HalfNormal(2)``, 6 groups (``plate(dim=-2)``) of
10 observations (``plate(dim=-1)``), ``mu_g ~ N(mu0, sd_g)``, ``y ~ N(mu_g, 1)``, a
``pyro.deterministic`` site. With ``u = log sd_g`` every expectation of its mean-field ELBO is
analytic (``E exp(a u) = exp(a m_u + a^2 s_u^2 / 2)``).

Model 2 (``schools``): centred eight schools, ``mu ~ N(0, 10)``, ``tau ~ HalfCauchy(25)``,
``theta_j ~ N(mu, tau)``. Its mean-field ELBO is analytic except ``E log(1 + tau^2 / 625)``, a
one-dimensional integral over ``u = log tau`` taken by 200-point Gauss-Hermite.

What the script measures, per model:

* ``exact``: the mean-field optimum (L-BFGS in float64 on the analytic negative ELBO, several
  starts), the analytic ELBO checked against a Monte Carlo estimate of the same expectation
  (``--mc`` draws) with the negative log joint taken from Pyro's own trace of the model.
* ``expected``: the rule's loss averaged over ``--draws`` draws of its nodes at fixed
  ``(loc, scale)``, i.e. the objective QNVB and Adam see on average, evaluated at the exact optimum
  and minimized (L-BFGS on the same fixed draws: a sample-average approximation).
* ``fits``: QNVB and Adam on ``QuadratureELBO(rule)``, with QNVB's settings ablated one at a time;
  every fit is scored by the exact negative ELBO at its ``(loc, scale)``.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_hierarchical_exact.py nested
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_hierarchical_exact.py schools
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from tqdm import tqdm

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides import describe_guide
from pyro_quadvi.quadrature import gauss_hermite, make_rule
from pyro_quadvi.testing.problems import minimize_mean_field

# -- model 1: two nested plates ---------------------------------------------------------------

G, M = 6, 10


def nested_data(groups: int = G) -> torch.Tensor:
    """The user trial's data: ``torch.manual_seed(0)``, group means ``N(1, 2)``, unit noise."""
    torch.manual_seed(0)
    return (torch.randn(groups, 1) * 2 + 1 + torch.randn(groups, M)).contiguous()


def nested(y: torch.Tensor) -> None:
    groups = y.shape[0]
    mu0 = pyro.sample("mu0", dist.Normal(0.0, 5.0))
    sd_g = pyro.sample("sd_g", dist.HalfNormal(2.0))
    with pyro.plate("group", groups, dim=-2):
        mu_g = pyro.sample("mu_g", dist.Normal(mu0, sd_g))
        pyro.deterministic("shift", mu_g - mu0)
        with pyro.plate("obs", M, dim=-1):
            pyro.sample("y", dist.Normal(mu_g, 1.0), obs=y)


def nested_neg_log_joint(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``-log p(y, T(z)) - log|J|`` at unconstrained points ``z = (mu0, log sd_g, mu_g)`` of shape
    ``(..., D)``, up to a constant (written by hand; :func:`study_nested` checks it against Pyro's
    trace of the model)."""
    mu0, u, mg = z[..., 0], z[..., 1], z[..., 2:]
    groups = mg.shape[-1]
    value = mu0**2 / 50 + torch.exp(2 * u) / 8 - u + groups * u
    value = value + 0.5 * torch.exp(-2 * u) * ((mg - mu0[..., None]) ** 2).sum(-1)
    return value + 0.5 * ((y - mg[..., :, None]) ** 2).sum((-1, -2))


def nested_neg_elbo(m: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The analytic negative mean-field ELBO, up to the constant of :func:`nested_neg_log_joint`."""
    m0, s0, mu, su, mg, sg = m[0], s[0], m[1], s[1], m[2:], s[2:]
    groups, obs = y.shape
    value = (m0**2 + s0**2) / 50 + torch.exp(2 * mu + 2 * su**2) / 8 - mu + groups * mu
    value = value + 0.5 * torch.exp(-2 * mu + 2 * su**2) * ((mg - m0) ** 2 + sg**2 + s0**2).sum()
    value = value + 0.5 * (((y - mg[:, None]) ** 2).sum() + obs * (sg**2).sum())
    return value - s.log().sum()


# -- model 2: centred eight schools -----------------------------------------------------------

Y8 = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
S8 = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def schools(sigma: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(torch.zeros(1), 10 * torch.ones(1)))
    tau = pyro.sample("tau", dist.HalfCauchy(scale=25 * torch.ones(1)))
    with pyro.plate("J", 8):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=Y8)


def schools_neg_log_joint(z: torch.Tensor, y=Y8, sd=S8) -> torch.Tensor:
    """``-log p - log|J|`` at ``z = (mu, log tau, theta)``, the full constant included."""
    mu, u, th = z[..., 0], z[..., 1], z[..., 2:]
    value = -dist.Normal(0.0, 10.0).log_prob(mu)
    value = value - math.log(2 / (math.pi * 25)) + torch.log1p(torch.exp(2 * u) / 625) - u
    value = value + (
        u[..., None] + 0.5 * torch.exp(-2 * u[..., None]) * (th - mu[..., None]) ** 2
    ).sum(-1)
    value = value + 8 * 0.5 * math.log(2 * math.pi)
    return value + (0.5 * ((y - th) / sd) ** 2 + torch.log(sd) + 0.5 * math.log(2 * math.pi)).sum(
        -1
    )


_GH_X, _GH_W = (t.double() for t in gauss_hermite(200))


def schools_neg_elbo(m: torch.Tensor, s: torch.Tensor, y=Y8, sd=S8) -> torch.Tensor:
    """The analytic negative mean-field ELBO (Pyro's loss, constants included); the only
    non-analytic term, ``E log(1 + tau^2/625)``, by 200-point Gauss-Hermite in ``u``."""
    y, sd = y.to(m.dtype), sd.to(m.dtype)
    m_mu, s_mu, m_u, s_u, m_th, s_th = m[0], s[0], m[1], s[1], m[2:], s[2:]
    value = 0.5 * (m_mu**2 + s_mu**2) / 100 + math.log(10) + 0.5 * math.log(2 * math.pi)
    value = value - math.log(2 / (math.pi * 25))
    value = (
        value + (_GH_W.to(m) * torch.log1p(torch.exp(2 * (m_u + s_u * _GH_X.to(m))) / 625)).sum()
    )
    value = value - m_u + 8 * (m_u + 0.5 * math.log(2 * math.pi))
    value = (
        value
        + 0.5 * torch.exp(-2 * m_u + 2 * s_u**2) * ((m_th - m_mu) ** 2 + s_th**2 + s_mu**2).sum()
    )
    value = value + (((y - m_th) ** 2 + s_th**2) / (2 * sd**2) + torch.log(sd)).sum()
    value = value + 8 * 0.5 * math.log(2 * math.pi)
    entropy = (s.log() + 0.5 * (1 + math.log(2 * math.pi))).sum()
    return value - entropy


# -- shared tools -----------------------------------------------------------------------------


def lbfgs(
    objective, m0: torch.Tensor, log_s0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """:func:`~pyro_quadvi.testing.problems.minimize_mean_field` from ``(m0, log_s0)``, and the
    objective's value there."""
    m, s = minimize_mean_field(objective, m0.numel(), m0, log_s0)
    with torch.no_grad():
        return m, s, float(objective(m, s))


def rule_draws(rule_name: str, dim: int, draws: int, seed: int = 0):
    """``draws`` node sets of a rule, stacked: ``X`` ``(N, K, dim)``, ``w`` ``(N, K)``."""
    rule = make_rule(rule_name)
    generator = torch.Generator().manual_seed(seed)
    count = 1 if not rule.is_random and rule_name != "hadamard" else draws
    sets = [rule.nodes(dim, step=t, generator=generator) for t in range(count)]
    X = torch.stack([x.double() for x, _ in sets])
    w = torch.stack([w.double() for _, w in sets])
    return X, w


def expected_quadrature_loss(neg_log_joint, X, w, entropy_constant: bool = False):
    """The rule's loss averaged over its draws, ``(m, s) -> mean_n sum_k w U(m + s x) - H[q]``,
    ``H[q] = sum log s`` plus its constant with ``entropy_constant`` (when ``U`` has its own)."""
    constant = 0.5 * (1 + math.log(2 * math.pi)) if entropy_constant else 0.0

    def objective(m, s):
        entropy = (s.log() + constant).sum()
        return (w * neg_log_joint(m + s * X)).sum(-1).mean() - entropy

    return objective


def check_node_order(model, data, neg_log_joint, rule_name: str) -> float:
    """Largest spread, over three guide states, of ``QuadratureELBO(rule).loss`` minus the loss
    made here from the same draw (``rule.nodes`` with the same seed) and the hand-written log
    joint: a constant when the coordinates are laid out in the same order."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    guide(data)
    rule = make_rule(rule_name)
    differences = []
    for shift in (0.0, 0.7, -1.3):
        with torch.no_grad():
            for k, p in enumerate(guide.parameters()):
                p.add_(shift * (k + 1) / 3)
        elbo = QuadratureELBO(rule_name, generator=torch.Generator().manual_seed(3))
        value = elbo.loss(model, guide, data)
        m, s = read_guide(guide)
        X, w = rule.nodes(m.numel(), step=0, generator=torch.Generator().manual_seed(3))
        mine = float((w.double() * neg_log_joint(m + s * X.double())).sum() - s.log().sum())
        differences.append(value - mine)
    return max(differences) - min(differences)


def read_guide(guide) -> tuple[torch.Tensor, torch.Tensor]:
    """The guide's locs and scales laid end to end in its site order, float64."""
    sites = describe_guide(guide).sites
    m = torch.cat([s.loc.detach().reshape(-1) for s in sites]).double()
    s = torch.cat([s.scale.detach().reshape(-1) for s in sites]).double()
    return m, s


def fit(model, data, optim, rule: str, steps: int, seed: int = 0):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, optim, QuadratureELBO(rule))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step(data)
    return guide, [str(c.message)[:80] for c in caught]


ABLATIONS: dict[str, dict] = {
    "default": {},
    "curvature=rms": {"curvature": "rms"},
    "significance=1": {"significance": 1.0},
    "scale_max=2": {"scale_max": 2.0},
    "damping=False": {"damping": False},
    "damping_recovery=1": {"damping_recovery": 1.0},
    "damping_recovery=1.5": {"damping_recovery": 1.5},
    "damping_recovery=2": {"damping_recovery": 2.0},
    "damping_recovery=2, betas=(0.9,0.999)": {"damping_recovery": 2.0, "betas": (0.9, 0.999)},
    "drift_forgetting=0": {"drift_forgetting": 0.0},
    "recent_fraction=0.1": {"recent_fraction": 0.1},
    "betas=(0,0.9)": {"betas": (0.0, 0.9)},
    "trust_region=1": {"trust_region": 1.0},
    "lr=0.1": {"lr": 0.1},
}


def adam(steps: int):
    """ClippedAdam from lr 0.05 decayed to 5e-4 over ``steps``: lands on the expected loss's
    minimizer up to the last steps' noise."""
    return pyro.optim.ClippedAdam({"lr": 0.05, "lrd": (1e-2) ** (1 / steps)})


def row(label, m, s, exact_value, neg_elbo, idx, extra=""):
    value = float(neg_elbo(m, s))
    print(
        f"| {label} | {s[idx[0]]:.3f} | {m[idx[1]]:.3f} | {s[idx[1]]:.3f} | {value:.3f} | "
        f"{value - exact_value:+.3f} |{extra}",
        flush=True,
    )


def trace_default(model, data, rule: str, steps: int, site: str, at: tuple[int, ...]) -> None:
    """Default QNVB's path: per checkpoint the locs and scales, and of ``site``'s block the
    curvature ``h`` of that step, the running average ``h_avg`` QNVB sets ``sigma`` from, its
    sample count and the damping divisor ``k``."""
    import pyro_quadvi.infer.quadrature_elbo as quadrature_elbo

    seen = []
    publish = quadrature_elbo.publish_moments

    def spy(moments):
        if moments.site.name == site:
            seen.append(float(moments.h.reshape(-1)[0]))
        return publish(moments)

    quadrature_elbo.publish_moments = spy
    try:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoMeanFieldNormal(model)
        optim = QNVB()
        svi = SVI(model, guide, optim, QuadratureELBO(rule))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t in tqdm(range(1, steps + 1), desc="trace", leave=False):
                svi.step(data)
                if t == 1:  # the guide's sites are known once it ran
                    first = describe_guide(guide).sites[0].name
                    print(
                        f"\n| step | loc(log scale) | sd(log scale) | sd({first}) | "
                        f"h({site}) of the step | h_avg | count | k |"
                    )
                    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
                if t in at:
                    m, s = read_guide(guide)
                    state = optim.get_state()["qnvb"]["pairs"][f"AutoMeanFieldNormal.locs.{site}"]
                    print(
                        f"| {t} | {m[1]:.3f} | {s[1]:.3f} | {s[0]:.3f} | {seen[-1]:.3f} | "
                        f"{float(state['h_avg'].reshape(-1)[0]):.3f} | "
                        f"{float(state['curvature_count'].reshape(-1)[0]):.1f} | "
                        f"{float(state['damping'].reshape(-1)[0]):.1f} |",
                        flush=True,
                    )
    finally:
        quadrature_elbo.publish_moments = publish


# -- the two studies --------------------------------------------------------------------------


def study_nested(args) -> None:
    y = nested_data(args.groups).double()
    groups = y.shape[0]
    dim = groups + 2
    objective = lambda m, s: nested_neg_elbo(m, s, y)  # noqa: E731
    best = None
    for start in (0.0, 2.0, -1.0):
        m, s, v = lbfgs(objective, torch.full((dim,), start), torch.full((dim,), -1.0))
        best = (m, s, v) if best is None or v < best[2] else best
        print(f"exact from start {start:+.0f}: -ELBO {v:.6f} sd(mu0) {s[0]:.4f}")
    m_ex, s_ex, v_ex = best
    # the analytic ELBO against Monte Carlo of Pyro's own log joint (trace of the model)
    generator = torch.Generator().manual_seed(1)
    z = m_ex + s_ex * torch.randn(args.mc, dim, generator=generator, dtype=torch.float64)
    u_hand = nested_neg_log_joint(z[:5], y)
    u_pyro = []
    for zi in z[:5]:
        data = {"mu0": zi[0], "sd_g": zi[1].exp(), "mu_g": zi[2:, None]}
        tr = pyro.poutine.trace(pyro.poutine.condition(nested, data=data)).get_trace(y)
        u_pyro.append(-tr.log_prob_sum() - zi[1])
    offset = (torch.stack(u_pyro) - u_hand).tolist()
    mc = nested_neg_log_joint(z, y)
    mc_value = float(mc.mean() - s_ex.log().sum())
    print(
        f"check: Pyro's -log p - log|J| minus the hand-written one at 5 draws: "
        f"{[round(o, 9) for o in offset]} (a constant); Monte Carlo ({args.mc} draws) of the "
        f"ELBO at the optimum {mc_value:.4f} +- {float(mc.std()) / args.mc**0.5:.4f}, "
        f"analytic {v_ex:.4f}"
    )
    print(
        f"EXACT: sd(mu0) {s_ex[0]:.4f}, loc(log sd_g) {m_ex[1]:.4f}, "
        f"sd(log sd_g) {s_ex[1]:.4f}, sd(mu_g) {s_ex[2]:.4f}"
    )
    if args.trace:
        trace_default(
            nested,
            y.float(),
            "blocked_simplex",
            2000,
            "mu0",
            (1, 2, 3, 5, 10, 50, 100, 400, 1000, 2000),
        )
        return
    neg_elbo = objective
    idx = (0, 1)
    print("\n| rule / fit | sd(mu0) | loc(log sd_g) | sd(log sd_g) | exact -ELBO | minus optimum |")
    print("|---|---:|---:|---:|---:|---:|")
    row("exact mean field", m_ex, s_ex, v_ex, neg_elbo, idx)
    rules = args.rules.split(",")
    for rule in rules:
        spread = check_node_order(nested, y.float(), lambda z: nested_neg_log_joint(z, y), rule)
        print(
            f"<!-- {rule}: QuadratureELBO.loss minus the loss made here, spread over 3 "
            f"points {spread:.2e} -->"
        )
        X, w = rule_draws(rule, dim, args.draws)
        expected = expected_quadrature_loss(lambda z: nested_neg_log_joint(z, y), X, w)
        minimizer_row(rule, expected, X.shape[0], m_ex, s_ex, v_ex, neg_elbo, idx)
        run_fits(nested, y.float(), rule, args, v_ex, neg_elbo, idx)


def minimizer_row(rule, expected, draws, m_ex, s_ex, v_ex, neg_elbo, idx) -> None:
    """The row of the minimizer of the rule's expected loss (over ``draws`` node sets), started
    at the exact optimum ``(m_ex, s_ex)``."""
    at_exact = float(expected(m_ex, s_ex))
    m_q, s_q, _ = lbfgs(expected, m_ex, s_ex.log())
    row(
        f"{rule}: minimizer of the expected loss ({draws} draws)",
        m_q,
        s_q,
        v_ex,
        neg_elbo,
        idx,
        f" expected loss - exact at the optimum {at_exact - v_ex:+.4f}",
    )


def run_fits(model, data, rule, args, v_ex, neg_elbo, idx) -> None:
    t0 = time.process_time()
    few = ("default", "damping=False", "recent_fraction=0.1")
    ablations = ABLATIONS if rule == args.ablate_rule else {k: ABLATIONS[k] for k in few}
    if args.settings:
        ablations = {k: ABLATIONS[k] for k in args.settings}
    for label, settings in tqdm(ablations.items(), desc=rule, leave=False):
        for steps in args.steps:
            guide, caught = fit(model, data, QNVB(**settings), rule, steps)
            m, s = read_guide(guide)
            note = f" warnings: {sorted(set(caught))}" if caught else ""
            row(f"{rule}: QNVB {label}, {steps} steps", m, s, v_ex, neg_elbo, idx, note)
    guide, _ = fit(model, data, adam(args.adam_steps), rule, args.adam_steps)
    m, s = read_guide(guide)
    row(f"{rule}: ClippedAdam 0.05 -> 5e-4, {args.adam_steps} steps", m, s, v_ex, neg_elbo, idx)
    print(f"<!-- {rule}: {time.process_time() - t0:.1f} s CPU -->", flush=True)


def study_schools(args) -> None:
    dim = 10
    neg_elbo = lambda m, s: schools_neg_elbo(m, s)  # noqa: E731
    best = None
    for start in ((0.0, 0.0), (5.0, 1.0), (5.0, 2.0), (0.0, -2.0), (8.0, 2.5), (6.0, 3.0)):
        m0 = torch.tensor([start[0], start[1]] + [start[0]] * 8)
        m, s, v = lbfgs(neg_elbo, m0, torch.full((dim,), -1.0))
        best = (m, s, v) if best is None or v < best[2] else best
        print(
            f"exact from start {start}: -ELBO {v:.4f} mu {m[0]:.3f} "
            f"tau median {m[1].exp():.3f} sd(log tau) {s[1]:.3f}"
        )
    m_ex, s_ex, v_ex = best
    generator = torch.Generator().manual_seed(1)
    z = m_ex + s_ex * torch.randn(args.mc, dim, generator=generator, dtype=torch.float64)
    u_pyro = []
    for zi in z[:3]:
        data = {"mu": zi[:1], "tau": zi[1:2].exp(), "theta": zi[2:]}
        tr = pyro.poutine.trace(pyro.poutine.condition(schools, data=data)).get_trace(S8.double())
        u_pyro.append(float(-tr.log_prob_sum() - zi[1]))
    u_hand = schools_neg_log_joint(z[:3]).tolist()
    mc = schools_neg_log_joint(z)
    entropy = float((s_ex.log() + 0.5 * (1 + math.log(2 * math.pi))).sum())
    print(
        f"check: Pyro's -log p - log|J| {[round(a, 6) for a in u_pyro]} vs hand-written "
        f"{[round(a, 6) for a in u_hand]}; Monte Carlo ({args.mc}) -ELBO at the optimum "
        f"{float(mc.mean()) - entropy:.4f} +- {float(mc.std()) / args.mc**0.5:.4f}, "
        f"analytic {v_ex:.4f}"
    )
    print(
        f"EXACT: mu {m_ex[0]:.3f} sd {s_ex[0]:.3f}; log tau {m_ex[1]:.3f} sd {s_ex[1]:.3f} "
        f"(median tau {m_ex[1].exp():.3f})"
    )
    if args.trace:
        trace_default(
            schools, S8, "blocked_simplex", 3000, "tau", (1, 2, 3, 5, 10, 100, 300, 1000, 3000)
        )
        return
    idx = (0, 1)
    print("\n| rule / fit | sd(mu) | loc(log tau) | sd(log tau) | exact -ELBO | minus optimum |")
    print("|---|---:|---:|---:|---:|---:|")
    row("exact mean field", m_ex, s_ex, v_ex, neg_elbo, idx)
    for rule in args.rules.split(","):
        spread = check_node_order(schools, S8, schools_neg_log_joint, rule)
        print(
            f"<!-- {rule}: QuadratureELBO.loss minus the loss made here, spread over 3 "
            f"points {spread:.2e} -->"
        )
        X, w = rule_draws(rule, dim, args.draws)
        expected = expected_quadrature_loss(schools_neg_log_joint, X, w, entropy_constant=True)
        minimizer_row(rule, expected, X.shape[0], m_ex, s_ex, v_ex, neg_elbo, idx)
        run_fits(schools, S8, rule, args, v_ex, neg_elbo, idx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=["nested", "schools"])
    parser.add_argument("--groups", type=int, default=G)
    parser.add_argument("--rules", default="blocked_simplex,rasp_cross,hadamard")
    parser.add_argument("--ablate-rule", default="blocked_simplex")
    parser.add_argument("--steps", type=int, nargs="+", default=[400])
    parser.add_argument("--adam-steps", type=int, default=3000)
    parser.add_argument("--draws", type=int, default=400)
    parser.add_argument("--mc", type=int, default=200_000)
    parser.add_argument("--trace", action="store_true", help="trace default QNVB's path, then stop")
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=list(ABLATIONS),
        help="run only these QNVB settings (of ABLATIONS) for every rule",
    )
    args = parser.parse_args()
    torch.set_default_dtype(torch.float32)
    {"nested": study_nested, "schools": study_schools}[args.model](args)


if __name__ == "__main__":
    main()
