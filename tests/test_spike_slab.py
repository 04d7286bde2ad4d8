"""SpikeSlab (the Dirac-Gauss mixture, sequence paper eq. 4.1-4.2) and the AutoSpikeSlab guide."""

from __future__ import annotations

import copy
import math
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from scipy import integrate, optimize, stats
from torch.distributions import kl_divergence

from pyro_quadvi import AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.guides import describe_guide
from pyro_quadvi.quadrature import make_rule

pytestmark = pytest.mark.usefixtures("fresh_param_store")

DTYPE = torch.float64
# (inclusion, slab scale, slab loc): a wide and a narrow slab, near zero and far from it
CASES = [(0.3, 1.0, 0.5), (0.9, 2.0, -1.0), (0.97, 0.1, 2.0), (0.05, 0.7, 0.0)]


def mixture(inclusion, scale, loc):
    t = torch.tensor
    return SpikeSlab(t(inclusion, dtype=DTYPE), t(scale, dtype=DTYPE), t(loc, dtype=DTYPE))


def slab_integral(d: SpikeSlab, power: int) -> float:
    """int_{x != 0} x^power exp(log_prob(x)) dx by adaptive quadrature."""

    def f(x):
        return x**power * math.exp(d.log_prob(torch.tensor(x, dtype=DTYPE)).item())

    loc, scale = d.slab_loc.item(), d.slab_scale.item()
    lo, hi = loc - 12 * scale, loc + 12 * scale
    return integrate.quad(f, lo, hi, points=[0.0] if lo < 0 < hi else None, limit=200)[0]


# --------------------------------------------------------------------------- the distribution
@pytest.mark.parametrize("case", CASES)
def test_log_prob_integrates_to_one_over_the_slab_and_the_spike(case):
    d = mixture(*case)
    spike = d.log_prob(torch.tensor(0.0, dtype=DTYPE)).exp().item()
    assert spike == pytest.approx(1 - case[0], rel=1e-12)
    assert slab_integral(d, 0) == pytest.approx(case[0], rel=1e-9)
    assert spike + slab_integral(d, 0) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_mean_and_variance_are_eq_4_2_and_match_numeric_integration(case):
    inclusion, scale, loc = case
    d = mixture(*case)
    mean = slab_integral(d, 1)  # the spike adds 0 to every moment
    variance = slab_integral(d, 2) - mean**2
    assert d.mean.item() == pytest.approx(mean, rel=1e-9, abs=1e-12)
    assert d.variance.item() == pytest.approx(variance, rel=1e-9)
    # eq. 4.2 written out: mu = q(not z) nu, sigma^2 = q(z) q(not z) nu^2 + q(not z) tau^2
    assert d.mean.item() == pytest.approx(inclusion * loc, rel=1e-12, abs=1e-15)
    eq42 = (1 - inclusion) * inclusion * loc**2 + inclusion * scale**2
    assert d.variance.item() == pytest.approx(eq42, rel=1e-12)


def test_samples_have_the_zero_fraction_and_moments_within_binomial_tolerance():
    torch.manual_seed(0)
    n = 200_000
    for inclusion, scale, loc in CASES:
        d = mixture(inclusion, scale, loc)
        x = d.sample((n,))
        zeros = (x == 0).double().mean().item()
        assert abs(zeros - (1 - inclusion)) < 4 * math.sqrt(inclusion * (1 - inclusion) / n)
        assert abs(x.mean().item() - d.mean.item()) < 4 * math.sqrt(d.variance.item() / n)
        fourth = ((x - d.mean) ** 4).mean().item()
        var_se = math.sqrt((fourth - d.variance.item() ** 2) / n)
        assert abs(x.var().item() - d.variance.item()) < 5 * var_se
    assert not SpikeSlab(0.5, 1.0).has_rsample


@pytest.mark.parametrize("case", CASES)
def test_icdf_inverts_the_cdf_written_independently(case):
    inclusion, scale, loc = case
    d = mixture(*case)

    def cdf(x):
        return (1 - inclusion) * (x >= 0) + inclusion * stats.norm.cdf(x, loc, scale)

    for p in [0.01, 0.2, 0.5, 0.8, 0.99]:
        q = d.icdf(torch.tensor(p, dtype=DTYPE)).item()
        lower = cdf(q - 1e-9)  # the quantile is the least x with cdf(x) >= p
        assert cdf(q) >= p - 1e-9 and lower <= p + 1e-9, (p, q)
        if q != 0:
            assert q == pytest.approx(optimize.brentq(lambda x, p=p: cdf(x) - p, -50, 50), abs=1e-7)


def test_closed_form_kl_is_the_sparse_vi_formula_and_matches_monte_carlo():
    torch.manual_seed(1)
    prior = SpikeSlab(torch.tensor(0.2, dtype=DTYPE), torch.tensor(1.3, dtype=DTYPE))
    for phi, tau, nu in CASES:
        q = mixture(phi, tau, nu)
        lam, s0 = 0.2, 1.3
        slab_kl = math.log(s0 / tau) + (tau**2 + nu**2) / (2 * s0**2) - 0.5
        paper = (
            phi * math.log(phi / lam) + (1 - phi) * math.log((1 - phi) / (1 - lam)) + phi * slab_kl
        )
        assert kl_divergence(q, prior).item() == pytest.approx(paper, rel=1e-12)
        x = q.sample((400_000,))
        ratio = q.log_prob(x) - prior.log_prob(x)
        se = ratio.std().item() / math.sqrt(len(x))
        assert abs(ratio.mean().item() - paper) < 4 * se
        entropy = -q.log_prob(x)
        assert abs(entropy.mean().item() - q.entropy().item()) < 4 * entropy.std().item() / 632


def test_kl_of_a_gaussian_against_a_spike_and_slab_matches_monte_carlo():
    torch.manual_seed(2)
    q = dist.Normal(torch.tensor(0.4, dtype=DTYPE), torch.tensor(0.3, dtype=DTYPE))
    prior = SpikeSlab(torch.tensor(0.1, dtype=DTYPE), torch.tensor(2.0, dtype=DTYPE))
    x = q.sample((200_000,))
    ratio = q.log_prob(x) - prior.log_prob(x)
    assert abs(ratio.mean().item() - kl_divergence(q, prior).item()) < 4 * ratio.std() / 447


@pytest.mark.parametrize("zeta", [-20.0, 20.0])
def test_gradients_in_float32_far_in_either_tail_match_float64_autograd(zeta):
    # at zeta = -20, 1 - sigmoid(20) is exactly 0 in float32, and so is torch.sigmoid's derivative
    # y (1 - y) at y = sigmoid(20): both would drop the gradient the float64 run has
    prior64 = SpikeSlab(
        torch.tensor(0.3, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64)
    )
    prior32 = SpikeSlab(torch.tensor(0.3), torch.tensor(1.5))

    def quantities(dtype, prior):
        logit = torch.tensor(zeta, dtype=dtype, requires_grad=True)
        q = SpikeSlab(
            zero_logits=logit,
            slab_scale=torch.tensor(0.4, dtype=dtype),
            slab_loc=torch.tensor(0.7, dtype=dtype),
        )
        values = {
            "q(zero)": q.exclusion,
            "q(not zero)": q.inclusion,
            "log q(zero)": q.log_prob(torch.zeros((), dtype=dtype)),
            "mean": q.mean,
            "variance": q.variance,
            "entropy": q.entropy(),
            "kl": kl_divergence(q, prior),
        }
        return {k: torch.autograd.grad(v, logit)[0] for k, v in values.items()}

    got, want = quantities(torch.float32, prior32), quantities(torch.float64, prior64)
    for name in got:
        assert got[name].item() != 0.0, name
        assert got[name].item() == pytest.approx(want[name].item(), rel=1e-5), name


def test_shapes_expand_and_bad_arguments():
    d = SpikeSlab(0.3, torch.ones(4)).expand((2, 4))
    assert d.batch_shape == (2, 4) and d.sample((3,)).shape == (3, 2, 4)
    assert d.to_event(2).log_prob(torch.zeros(2, 4)).item() == pytest.approx(8 * math.log(0.7))
    with pytest.raises(ValueError, match="inclusion must lie in"):
        SpikeSlab(1.5, 1.0)
    with pytest.raises(ValueError, match="exactly one of inclusion and zero_logits"):
        SpikeSlab(0.5, 1.0, zero_logits=0.0)
    # inclusion 1: no spike, a Gaussian; the logit form keeps exclusion exact near 1
    assert SpikeSlab(1.0, 2.0).log_prob(torch.tensor(0.0)).item() == -math.inf
    near_one = SpikeSlab(zero_logits=torch.tensor(-40.0, dtype=DTYPE), slab_scale=1.0)
    assert near_one.log_exclusion.item() == pytest.approx(-40.0, rel=1e-12)


# --------------------------------------------------------------------------------- the guide
W_TRUE = torch.tensor([1.5, 0.0, -2.0], dtype=DTYPE)
X = torch.linspace(-1, 1, 24, dtype=DTYPE).reshape(8, 3)
Y = X @ W_TRUE


def regression(x, y=None):
    w = pyro.sample("w", SpikeSlab(torch.tensor(0.3, dtype=DTYPE), 1.0).expand([3]).to_event(1))
    b = pyro.sample("b", SpikeSlab(torch.tensor(0.9, dtype=DTYPE), 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal((x * w).sum(-1) + b, 0.5), obs=y)


def set_params(guide, nu, tau, zeta):
    """Set site w's slab mean, slab scale and zero logit (constrained values); a run of the guide
    takes them from the param store into its module."""
    store = pyro.get_param_store()
    with torch.no_grad():
        store[f"{guide._pyro_name}.locs.w"] = torch.tensor(nu, dtype=DTYPE)
        store[f"{guide._pyro_name}.scales.w"] = torch.tensor(tau, dtype=DTYPE)
        store[f"{guide._pyro_name}.logits.w"] = torch.tensor(zeta, dtype=DTYPE)
    guide(X, Y)


def test_inclusion_probs_and_sparsity_start_at_init_inclusion():
    guide = AutoSpikeSlab(regression, init_inclusion=0.8)
    with pytest.raises(RuntimeError, match="has not been run yet"):
        guide.inclusion_probs()
    guide(X, Y)
    probs = guide.inclusion_probs()
    assert set(probs) == {"w", "b"} and probs["w"].shape == (3,)
    torch.testing.assert_close(probs["w"], torch.full((3,), 0.8, dtype=DTYPE))
    assert guide.sparsity() == pytest.approx(0.2, rel=1e-12)
    with pytest.raises(ValueError, match="init_inclusion must be a float in"):
        AutoSpikeSlab(regression, init_inclusion=1.0)


def test_description_nodes_reproduce_the_mixture_mean_and_variance_exactly():
    guide = AutoSpikeSlab(regression)
    guide(X, Y)
    nu, tau, zeta = [0.7, -1.2, 0.05], [0.3, 0.2, 1.1], [-2.0, 0.4, 3.0]
    set_params(guide, nu, tau, zeta)
    site = {s.name: s for s in describe_guide(guide).sites}["w"]
    assert site.family == "dirac_gauss" and set(site.params) == {"loc", "scale", "logit"}
    q_zero = torch.sigmoid(torch.tensor(zeta, dtype=DTYPE))
    q_nonzero = 1 - q_zero
    nu_t, tau_t = torch.tensor(nu, dtype=DTYPE), torch.tensor(tau, dtype=DTYPE)
    torch.testing.assert_close(site.loc, q_nonzero * nu_t, rtol=1e-14, atol=0)
    variance = q_zero * q_nonzero * nu_t**2 + q_nonzero * tau_t**2  # eq. 4.2
    torch.testing.assert_close(site.scale**2, variance, rtol=1e-13, atol=0)
    # a sigma-point rule's nodes at these moments carry the mean and variance exactly
    description = describe_guide(guide)
    variance_all = (description.scale**2).detach()
    torch.testing.assert_close(variance_all[:3], variance.detach(), rtol=1e-13, atol=0)
    for rule in ["blocked_simplex", "rasp_simplex", "rasp_cross"]:
        nodes = make_rule(rule).draw(description.dim, step=3, dtype=DTYPE)
        z = description.affine(nodes.matrix()).detach()
        w = nodes.weights.to(DTYPE)
        mean = w @ z
        torch.testing.assert_close(mean[:3], q_nonzero * nu_t, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(w @ (z - mean) ** 2, variance_all, rtol=1e-12, atol=1e-14)


def test_median_and_quantiles_are_the_mixtures_exact_quantiles():
    guide = AutoSpikeSlab(regression)
    guide(X, Y)
    # coordinate 0: mostly zero (median 0); 1: almost surely the slab; 2: a slab straddling 0
    set_params(guide, [0.7, 3.0, 0.2], [0.3, 0.2, 1.0], [2.0, -6.0, -1.0])
    median = guide.median()["w"]
    assert median[0].item() == 0.0
    q = torch.sigmoid(torch.tensor([2.0, -6.0, -1.0], dtype=DTYPE))
    phi = 1 - q
    for i, (nu, tau) in enumerate([(0.7, 0.3), (3.0, 0.2), (0.2, 1.0)]):
        p = phi[i].item()

        def cdf(x, p=p, nu=nu, tau=tau):
            return (1 - p) * (x >= 0) + p * stats.norm.cdf(x, nu, tau)

        for level, value in zip([0.05, 0.95], guide.quantiles([0.05, 0.95])["w"][:, i]):
            v = value.item()
            assert cdf(v) >= level - 1e-9 and cdf(v - 1e-9) <= level + 1e-9
        if i > 0:
            assert median[i].item() == pytest.approx(
                optimize.brentq(lambda x, c=cdf: c(x) - 0.5, -20, 20), abs=1e-7
            )


def test_predictive_draws_exact_zeros_at_the_rate_of_the_spike():
    guide = AutoSpikeSlab(regression, init_inclusion=0.6, init_scale=0.5)
    guide(X, Y)
    n = 1000
    draws = Predictive(regression, guide=guide, num_samples=n, return_sites=["w"])(X)["w"]
    assert draws.shape == (n, 1, 3)
    zeros = (draws == 0).double().mean().item()
    assert abs(zeros - 0.4) < 4 * math.sqrt(0.24 / (3 * n))


def local_model(data):
    with pyro.plate("rows", 6, subsample_size=2) as idx:
        u = pyro.sample("u", SpikeSlab(torch.tensor(0.5, dtype=DTYPE), 1.0))
        pyro.sample("obs", dist.Normal(u, 1.0), obs=data[idx])


def test_subsampled_plates_use_the_minibatch_rows_and_scale():
    data = torch.arange(6, dtype=DTYPE)
    guide = AutoSpikeSlab(local_model)
    guide(data)
    with torch.no_grad():
        guide.locs.u_unconstrained.copy_(data)
    trace = pyro.poutine.trace(guide).get_trace(data)
    rows = trace.nodes["rows"]["value"]
    site = describe_guide(guide, trace).sites[0]
    assert site.scale_factor == pytest.approx(3.0) and torch.equal(site.rows[-1], rows)
    assert guide.locs.u.shape == (6,)  # full-size parameters, the run's rows in the description
    torch.testing.assert_close(site.values["loc"], data[rows])
    torch.testing.assert_close(site.loc, 0.99 * data[rows], rtol=1e-12, atol=0)
    # without a trace: the last run's rows, kept by the guide
    last = describe_guide(guide).sites[0]
    assert torch.equal(last.rows[-1], rows) and last.scale_factor == pytest.approx(3.0)


def test_guide_survives_pickle_deepcopy_and_param_store_state_bit_for_bit():
    guide = AutoSpikeSlab(regression)
    guide(X, Y)
    set_params(guide, [0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, -0.8, 0.9])
    state = pyro.get_param_store().get_state()
    before = guide.inclusion_probs()["w"].clone()
    clone = pickle.loads(pickle.dumps(guide))
    torch.testing.assert_close(clone.inclusion_probs()["w"], before, rtol=0, atol=0)
    torch.testing.assert_close(
        copy.deepcopy(guide).median()["w"], guide.median()["w"], rtol=0, atol=0
    )
    pyro.clear_param_store()
    pyro.get_param_store().set_state(state)
    fresh = AutoSpikeSlab(regression)
    fresh(X, Y)
    assert torch.equal(fresh.inclusion_probs()["w"], before)
    pyro.set_rng_seed(3)
    loss = QuadratureELBO().loss(regression, fresh, X, Y)
    pyro.set_rng_seed(3)
    assert loss == QuadratureELBO().loss(regression, clone, X, Y)
