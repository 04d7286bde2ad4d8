"""QuadratureELBO and AutoMeanFieldNormal against closed forms and independent references."""

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuideList,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides import describe_guide
from pyro_quadvi.quadrature import BlockedSimplexRule, make_rule, simplex_reference
from pyro_quadvi.testing import TinyNet

EXACT_RULES = [
    "rasp_simplex",
    "rasp_cross",
    "hadamard",
    "blocked_simplex",
    "gauss_hermite",
    "vrmc2",
]
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


pytestmark = pytest.mark.usefixtures("float64_store")


# -- a conjugate model whose log joint is a diagonal quadratic -------------------------------------

PRIOR_SD = 2.0


def diagonal_model(x):
    with pyro.plate("groups", x.shape[1]):
        z = pyro.sample("z", dist.Normal(0.0, PRIOR_SD))
        with pyro.plate("obs", x.shape[0], dim=-2):
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def diagonal_closed_form(x, loc, scale):
    """-E_q[log p(x, z)] - H[q] for q = N(loc, diag(scale^2)), computed by hand."""
    e_prior = -HALF_LOG_2PI - math.log(PRIOR_SD) - (loc**2 + scale**2) / (2 * PRIOR_SD**2)
    e_lik = -HALF_LOG_2PI - ((x - loc) ** 2 + scale**2) / 2
    entropy = scale.log() + HALF_LOG_2PI + 0.5
    return -(e_prior.sum() + e_lik.sum() + entropy.sum())


def _set_mean_field(guide, name, loc, scale, *args):
    guide(*args)  # create the parameters
    store = pyro.get_param_store()
    store[f"{guide._pyro_name}.locs.{name}"] = loc
    store[f"{guide._pyro_name}.scales.{name}"] = scale
    return store[f"{guide._pyro_name}.locs.{name}"], store[f"{guide._pyro_name}.scales.{name}"]


@pytest.mark.parametrize("vectorize", [True, False])
@pytest.mark.parametrize("rule", EXACT_RULES)
def test_diagonal_quadratic_loss_and_gradients_are_exact(rule, vectorize):
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    guide = AutoMeanFieldNormal(diagonal_model)
    _set_mean_field(guide, "z", torch.randn(6), 0.3 + torch.rand(6), x)
    elbo = QuadratureELBO(rule, vectorize=vectorize)
    loss = elbo.differentiable_loss(diagonal_model, guide, x)
    store = pyro.get_param_store()
    params = [
        store.get_param(n).unconstrained()
        for n in ("AutoMeanFieldNormal.locs.z", "AutoMeanFieldNormal.scales.z")
    ]
    grads = torch.autograd.grad(loss, params)
    loc, scale = store["AutoMeanFieldNormal.locs.z"], store["AutoMeanFieldNormal.scales.z"]
    expected = diagonal_closed_form(x, loc, scale)
    expected_grads = torch.autograd.grad(expected, params)
    assert abs(loss.item() - expected.item()) < 1e-10
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-10, rtol=0)


def test_vrmc1_and_mc_are_not_exact_and_vrmc1_misses_only_the_variance():
    torch.manual_seed(1)
    x = torch.randn(4, 6)
    guide = AutoMeanFieldNormal(diagonal_model)
    loc, scale = _set_mean_field(guide, "z", torch.randn(6), 0.3 + torch.rand(6), x)
    expected = diagonal_closed_form(x, loc, scale).item()
    generator = torch.Generator().manual_seed(5)
    elbo = QuadratureELBO("vrmc1", generator=generator)
    got = elbo.loss(diagonal_model, guide, x)
    # The same nodes, regenerated: the error is the quadratic coefficient times the second-moment
    # error of each coordinate (the mean is matched, so the linear terms are exact).
    X, w = make_rule("vrmc1").nodes(6, generator=torch.Generator().manual_seed(5))
    second = w @ X**2
    curvature = 1 / PRIOR_SD**2 + x.shape[0]  # -d^2 log p / dz^2 per coordinate
    predicted_error = (0.5 * curvature * scale**2 * (second - 1)).sum().item()
    assert abs(got - expected - predicted_error) < 1e-10
    assert abs(got - expected) > 1e-3
    assert abs(QuadratureELBO("mc").loss(diagonal_model, guide, x) - expected) > 1e-6


# -- correlated latents ----------------------------------------------------------------------------

CORR = torch.tensor([[1.0, 0.6, 0.2], [0.6, 1.5, -0.4], [0.2, -0.4, 0.8]], dtype=torch.float64)


def correlated_model():
    pyro.sample("z", dist.MultivariateNormal(torch.zeros(3), CORR))


def correlated_closed_form(loc, scale):
    precision = torch.linalg.inv(CORR)
    second = torch.diag(scale**2) + torch.outer(loc, loc)
    e_log_p = -3 * HALF_LOG_2PI - 0.5 * torch.logdet(CORR) - 0.5 * (precision * second).sum()
    entropy = (scale.log() + HALF_LOG_2PI + 0.5).sum()
    return -(e_log_p + entropy).item()


def _correlated_guide():
    guide = AutoMeanFieldNormal(correlated_model)
    loc, scale = _set_mean_field(
        guide, "z", torch.tensor([0.3, -0.2, 0.5]), torch.tensor([0.7, 1.1, 0.4])
    )
    return guide, correlated_closed_form(loc, scale)


def test_correlated_latents_gauss_hermite_exact():
    guide, expected = _correlated_guide()
    assert (
        abs(QuadratureELBO("gauss_hermite", num_points=2).loss(correlated_model, guide) - expected)
        < 1e-10
    )


def test_correlated_latents_hadamard_exact_over_a_period_not_at_each_step():
    guide, expected = _correlated_guide()
    elbo = QuadratureELBO("hadamard", num_points=2)
    period = elbo.rule.period(3)
    losses = []
    for _ in range(period):
        losses.append(elbo.differentiable_loss(correlated_model, guide).item())
    assert period == 4
    assert abs(sum(losses) / period - expected) < 1e-10
    assert max(abs(loss - expected) for loss in losses) > 1e-3


def test_correlated_latents_rasp_unbiased_over_seeds():
    guide, expected = _correlated_guide()
    pyro.set_rng_seed(0)
    elbo = QuadratureELBO("rasp_simplex")
    losses = torch.tensor([elbo.loss(correlated_model, guide) for _ in range(400)])
    errors = losses - expected
    assert errors.abs().max() > 1e-3  # single draws are not exact ...
    assert abs(errors.mean()) < 4 * errors.std() / math.sqrt(len(errors))  # ... but unbiased


# -- constrained latents against an independent Gauss-Hermite reference ---------------------------


def _gh(n):
    nodes, weights = np.polynomial.hermite_e.hermegauss(n)
    return nodes, weights / math.sqrt(2 * math.pi)


def _normal_logpdf(x, mean, sd):
    return -0.5 * np.log(2 * np.pi) - np.log(sd) - 0.5 * ((x - mean) / sd) ** 2


HALFNORMAL_Y = torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64)


def halfnormal_model():
    s = pyro.sample("s", dist.HalfNormal(1.5))
    with pyro.plate("data", 3):
        pyro.sample("y", dist.Normal(0.0, s), obs=HALFNORMAL_Y)


def test_halfnormal_scale_latent_against_gauss_hermite_reference():
    y = HALFNORMAL_Y
    model = halfnormal_model
    guide = AutoMeanFieldNormal(model)
    loc, scale = _set_mean_field(guide, "s", torch.tensor(0.2), torch.tensor(0.4))
    nodes, weights = _gh(60)
    z = loc.item() + scale.item() * nodes
    s = np.exp(z)
    log_joint = (
        np.log(2) + _normal_logpdf(s, 0, 1.5) + _normal_logpdf(y.numpy()[:, None], 0, s).sum(0) + z
    )  # + log|ds/dz|
    expected = -(weights @ log_joint) - (math.log(scale.item()) + HALF_LOG_2PI + 0.5)
    got = QuadratureELBO("gauss_hermite", num_points=60).loss(model, guide)
    assert abs(got - expected) < 1e-9


def test_beta_and_dirichlet_latents_against_gauss_hermite_reference():
    heads = torch.tensor([1.0, 1.0, 0.0, 1.0])
    counts = torch.tensor([3.0, 1.0, 2.0])

    def model():
        p = pyro.sample("p", dist.Beta(2.0, 3.0))
        w = pyro.sample("w", dist.Dirichlet(torch.tensor([1.5, 2.0, 1.0])))
        with pyro.plate("flips", 4):
            pyro.sample("h", dist.Bernoulli(p), obs=heads)
        pyro.sample("c", dist.Multinomial(6, w), obs=counts)

    guide = AutoMeanFieldNormal(model)
    guide()
    store = pyro.get_param_store()
    store["AutoMeanFieldNormal.locs.p"] = torch.tensor(0.4)
    store["AutoMeanFieldNormal.scales.p"] = torch.tensor(0.6)
    store["AutoMeanFieldNormal.locs.w"] = torch.tensor([0.1, -0.3])
    store["AutoMeanFieldNormal.scales.w"] = torch.tensor([0.5, 0.3])
    got = QuadratureELBO("gauss_hermite", num_points=24).loss(model, guide)

    # Reference: tensor Gauss-Hermite over the three unconstrained coordinates, by hand with numpy.
    from scipy import stats
    from scipy.special import expit

    nodes, weights = _gh(24)
    za = 0.4 + 0.6 * nodes
    p = expit(za)
    log_p = (
        stats.beta.logpdf(p, 2, 3)
        + stats.bernoulli.logpmf(heads.numpy()[:, None], p).sum(0)
        + np.log(p * (1 - p))
    )  # sigmoid Jacobian
    e_p = weights @ log_p
    z1 = 0.1 + 0.5 * nodes[:, None]
    z2 = -0.3 + 0.3 * nodes[None, :]
    # Pyro's stick-breaking: y_i = z_i - log(K - 1 - i), v_i = sigmoid(y_i) of what is left.
    y1, y2 = z1 - math.log(2), z2 - math.log(1)
    v1, v2 = expit(y1), expit(y2)
    w1 = v1 + 0 * v2
    w2 = (1 - v1) * v2
    w3 = (1 - v1) * (1 - v2)
    log_jac = np.log(v1 * (1 - v1)) + np.log(v2 * (1 - v2)) + np.log(1 - v1)
    log_w = (
        stats.dirichlet.logpdf(
            np.stack([w1.ravel(), w2.ravel(), w3.ravel()]), [1.5, 2.0, 1.0]
        ).reshape(w1.shape)
        + stats.multinomial.logpmf(
            counts.numpy(), 6, np.stack([w1.ravel(), w2.ravel(), w3.ravel()], -1)
        ).reshape(w1.shape)
        + log_jac
    )
    e_w = weights @ log_w @ weights
    entropy = (math.log(0.6) + math.log(0.5) + math.log(0.3)) + 3 * (HALF_LOG_2PI + 0.5)
    expected = -(e_p + e_w) - entropy
    assert abs(got - expected) < 1e-9


def beta22_model():
    pyro.sample("z", dist.Beta(2.0, 2.0))


def _fitted_beta22_locs(rule, steps=400, last=200):
    """``loc`` of ``z ~ Beta(2, 2)`` (a logit-space mean field) at the last ``last`` of ``steps``
    Adam steps, from a fixed seed."""
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(beta22_model)
    svi = SVI(beta22_model, guide, pyro.optim.Adam({"lr": 0.05}), QuadratureELBO(rule))
    locs = []
    for step in range(steps):
        svi.step()
        if step >= steps - last:
            locs.append(guide.locs.z.item())
    return torch.tensor(locs), guide.scales.z.item()


def test_blocked_simplex_random_signs_remove_the_skew_of_a_beta_fit():
    """In logit space ``Beta(2, 2)`` has density ``6 s(u)^2 s(-u)^2`` (``s`` the sigmoid, with
    the Jacobian), symmetric about 0, so the best Gaussian has ``loc = 0``. ``blocked_simplex``
    with a random sign per block (``random_signs=True``) averages there, within 5 standard errors of
    the mean of 10 batches of the last steps. The paper's unsigned rule gives the single
    coordinate (the default) the fixed offsets ``x = {1.366, -0.366, -1}`` at every step and
    settles at the
    minimum of ``-log s - mean_k log p(loc + s x_k)``, found here by scipy: ``loc = 0.050``."""
    from scipy.optimize import minimize

    locs, _ = _fitted_beta22_locs(BlockedSimplexRule(3, random_signs=True))
    batch_means = locs.reshape(10, -1).mean(1)
    se = batch_means.std().item() / math.sqrt(10)
    assert 0 < se < 0.01
    assert abs(locs.mean().item()) < 5 * se, (locs.mean().item(), se)

    offsets = simplex_reference(2)[0].numpy()  # the first coordinate of the K = 3 vertices

    def fixed_node_loss(theta):
        u = theta[0] + math.exp(theta[1]) * offsets
        log_p = math.log(6.0) - 2 * np.logaddexp(0, -u) - 2 * np.logaddexp(0, u)
        return -theta[1] - log_p.mean()

    reference = minimize(fixed_node_loss, np.zeros(2), method="BFGS", options={"gtol": 1e-10}).x
    assert reference[0] == pytest.approx(0.0503, abs=5e-4)
    locs, scale = _fitted_beta22_locs(make_rule("blocked_simplex"))
    assert locs.std().item() < 1e-3  # the same nodes at every step: no noise to average
    assert locs.mean().item() == pytest.approx(reference[0], abs=1e-3)
    assert scale == pytest.approx(math.exp(reference[1]), abs=1e-3)


# -- plates and subsampling ------------------------------------------------------------------------


def local_model(x, subsample_size=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
    with pyro.plate("data", len(x), subsample_size=subsample_size) as idx:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=x[idx])


def test_full_batch_subsample_gives_the_full_data_loss():
    x = torch.randn(8)
    guide = AutoMeanFieldNormal(local_model)
    guide(x)
    elbo = QuadratureELBO("hadamard")
    full = elbo.loss(local_model, guide, x)
    batched = elbo.loss(local_model, guide, x, subsample_size=8)
    assert abs(full - batched) < 1e-12


def test_subsampled_local_latents_are_scaled_like_pyro():
    x = torch.randn(8)
    pyro.set_rng_seed(3)
    guide = AutoMeanFieldNormal(local_model)
    guide(x, subsample_size=4)
    store = pyro.get_param_store()
    store["AutoMeanFieldNormal.locs.z"] = torch.randn(8)
    store["AutoMeanFieldNormal.scales.z"] = 0.2 + torch.rand(8)
    # The loss of one minibatch, from the guide trace's subsample indices, by hand.
    pyro.set_rng_seed(11)
    tr = poutine.trace(guide).get_trace(x, subsample_size=4)
    idx = tr.nodes["data"]["value"]
    pyro.set_rng_seed(11)
    # mu and z are coupled (a cross term): Gauss-Hermite integrates it exactly.
    elbo = QuadratureELBO("gauss_hermite", num_points=2)
    got = elbo.loss(local_model, guide, x, subsample_size=4)
    m0, s0 = store["AutoMeanFieldNormal.locs.mu"], store["AutoMeanFieldNormal.scales.mu"]
    m, s = store["AutoMeanFieldNormal.locs.z"][idx], store["AutoMeanFieldNormal.scales.z"][idx]
    xb = x[idx]
    e_mu = -HALF_LOG_2PI - math.log(3.0) - (m0**2 + s0**2) / 18
    e_z = -HALF_LOG_2PI - ((m - m0) ** 2 + s**2 + s0**2) / 2
    e_x = -HALF_LOG_2PI - math.log(0.5) - ((xb - m) ** 2 + s**2) / (2 * 0.25)
    h_mu = s0.log() + HALF_LOG_2PI + 0.5
    h_z = s.log() + HALF_LOG_2PI + 0.5
    expected = -(e_mu + h_mu + 2.0 * (e_z + e_x + h_z).sum())
    assert abs(got - expected.item()) < 1e-10


# -- guide types -----------------------------------------------------------------------------------


def test_autonormal_and_autodiagonalnormal_match_the_closed_form():
    x = torch.randn(4, 6)
    for guide_cls in (AutoNormal, AutoDiagonalNormal):
        pyro.clear_param_store()
        guide = guide_cls(diagonal_model, init_scale=0.4)
        guide(x)
        if guide_cls is AutoNormal:
            loc, scale = guide.locs.z, guide.scales.z
        else:
            loc, scale = guide.loc, guide.scale
        expected = diagonal_closed_form(x, loc, scale).item()
        assert abs(QuadratureELBO("rasp_simplex").loss(diagonal_model, guide, x) - expected) < 1e-10


def constrained_model(x):
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("groups", x.shape[1]):
        z = pyro.sample("z", dist.Normal(0.0, PRIOR_SD))
        with pyro.plate("obs", x.shape[0], dim=-2):
            pyro.sample("x", dist.Normal(z, s), obs=x)


@pytest.mark.parametrize(
    "guide_cls",
    [AutoMeanFieldNormal, AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal],
)
def test_a_deterministic_rules_loss_draws_no_random_numbers(guide_cls):
    # the ELBO reads the guide's parameters, never its draws: with the Hadamard rule a step
    # leaves torch's random state as it found it, and the loss is the closed form's
    x = torch.randn(4, 6)
    guide = guide_cls(constrained_model, init_scale=0.4)
    guide(x)
    elbo = QuadratureELBO("hadamard", num_points=4)
    state = torch.get_rng_state()
    loss = elbo.loss_and_grads(constrained_model, guide, x)
    assert torch.equal(torch.get_rng_state(), state)
    pyro.clear_param_store()
    guide = guide_cls(diagonal_model, init_scale=0.4)
    guide(x)
    state = torch.get_rng_state()
    loss = elbo.loss(diagonal_model, guide, x)
    assert torch.equal(torch.get_rng_state(), state)
    description = describe_guide(guide)
    if description.joint is None:  # a mean field: the closed form of diagonal_model
        expected = diagonal_closed_form(x, description.loc, description.scale).item()
        assert loss == pytest.approx(expected, rel=1e-12)


def _joint_gaussian_closed_form(guide, x) -> float:
    """The exact loss of ``diagonal_model`` under a joint Gaussian guide, from its posterior."""
    posterior = guide.get_posterior()
    loc, cov = posterior.loc, posterior.covariance_matrix
    dim = loc.numel()
    prior_prec = 1 / PRIOR_SD**2
    e_prior = (-HALF_LOG_2PI - math.log(PRIOR_SD)) * dim - 0.5 * prior_prec * (
        loc @ loc + cov.trace()
    )
    e_lik = (-HALF_LOG_2PI - 0.5 * ((x - loc) ** 2 + cov.diagonal())).sum()
    return -(e_prior + e_lik + posterior.entropy()).item()


@pytest.mark.parametrize("guide_cls", [AutoMultivariateNormal, AutoLowRankMultivariateNormal])
def test_full_and_low_rank_gaussian_guides_exact_with_gauss_hermite(guide_cls):
    torch.manual_seed(2)
    x = torch.randn(4, 3)
    guide = guide_cls(diagonal_model, init_scale=0.3)
    guide(x)
    expected = _joint_gaussian_closed_form(guide, x)
    got = QuadratureELBO("gauss_hermite", num_points=2).loss(diagonal_model, guide, x)
    assert abs(got - expected) < 1e-10


def test_a_non_diagonal_factor_makes_the_default_rule_exact_only_over_the_draws():
    """Under the low-rank guide the standard coordinates mix the latents, so the quadratic loss
    needs every cross moment of the nodes, which blocked_simplex has only within its blocks:
    single draws miss the closed form, their mean (over 300 draws) does not, within 5 SE."""
    torch.manual_seed(2)
    x = torch.randn(4, 6)
    guide = AutoLowRankMultivariateNormal(diagonal_model, init_scale=0.3)
    guide(x)
    expected = _joint_gaussian_closed_form(guide, x)
    elbo = QuadratureELBO()
    pyro.set_rng_seed(0)
    errors = torch.tensor([elbo.loss(diagonal_model, guide, x) - expected for _ in range(300)])
    assert (errors.abs() > 1e-6).float().mean() > 0.9
    se = errors.std().item() / math.sqrt(len(errors))
    assert abs(errors.mean().item()) < 5 * se, (errors.mean().item(), se)


def test_unsupported_guide_gets_a_type_error_listing_the_supported_ones():
    x = torch.randn(4, 6)
    with pytest.raises(
        TypeError,
        match="AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoMultivariateNormal, "
        "AutoNormal",
    ):
        QuadratureELBO().loss(diagonal_model, AutoDelta(diagonal_model), x)


# -- a PyroModule network: looped evaluation -------------------------------------------------------


def test_pyromodule_network_falls_back_to_the_loop_with_one_warning_and_exact_values():
    torch.manual_seed(4)
    X = torch.randn(10, 2)
    y = X @ torch.tensor([1.0, -1.0]) + 0.3
    net = TinyNet()
    guide = AutoMeanFieldNormal(net)
    guide(X, y)
    elbo = QuadratureELBO("hadamard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = elbo.loss(net, guide, X, y)
        elbo.loss(net, guide, X, y)
    assert sum("evaluating them one by one" in str(w.message) for w in caught) == 1
    assert elbo.vectorized(net, guide) is False
    with pytest.raises(RuntimeError):
        QuadratureELBO("hadamard", vectorize=True).loss(net, guide, X, y)
    # By hand, over the three unconstrained coordinates in the guide's site order.
    sites = guide.mean_field_sites()
    loc = torch.cat([s.loc.reshape(-1) for s in sites])
    scale = torch.cat([s.scale.reshape(-1) for s in sites])
    offsets, weights = make_rule("hadamard").nodes(3)
    names = [s.name for s in sites]
    total = 0.0
    for k in range(4):
        theta = dict(zip(names, (loc + scale * offsets[k]).split([s.loc.numel() for s in sites])))
        w = theta["fc.weight"]
        b = theta["fc.bias"]
        log_p = dist.Normal(0.0, 1.0).log_prob(w).sum()
        log_p = log_p + dist.Normal(0.0, 1.0).log_prob(b).sum()
        log_p = log_p + dist.Normal(X @ w + b, 0.5).log_prob(y).sum()
        total = total + weights[k] * log_p
    entropy = (scale.log() + HALF_LOG_2PI + 0.5).sum()
    assert abs(got - (-(total + entropy)).item()) < 1e-10


# -- errors ----------------------------------------------------------------------------------------


def test_discrete_latent_is_refused_with_the_site_name():
    def model():
        pyro.sample("k", dist.Bernoulli(0.5))

    with pytest.raises(ValueError, match="'k' is discrete"):
        QuadratureELBO().loss(model, AutoMeanFieldNormal(model))


def test_enumerated_latent_is_refused_with_the_site_name():
    def model():
        pyro.sample("c", dist.Categorical(torch.ones(3)), infer={"enumerate": "parallel"})

    with pytest.raises(ValueError, match="'c' is marked for enumeration"):
        QuadratureELBO().loss(model, AutoMeanFieldNormal(model))


def test_non_finite_log_density_names_node_and_site():
    def model():
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.factor("wall", torch.where(z > 0, 0.0, -math.inf))

    guide = AutoMeanFieldNormal(model, init_loc_fn=lambda site: torch.tensor(0.5), init_scale=1.0)
    with pytest.raises(ValueError, match=r"site 'wall' is not finite .* z = \[-0.5\]"):
        QuadratureELBO("hadamard", num_points=2, vectorize=False).loss(model, guide)


def test_a_factor_not_finite_away_from_the_guide_fits_and_one_at_a_node_is_named_by_node():
    # the sites are found from a draw of the prior, which nothing scores: a factor that is NaN
    # for z > 0 must not stop a guide at z = -5 (Pyro's validation refused it at such a draw);
    # where a node lands in the NaN region (loc -0.1, scale 0.1: node 0 at 0.0), the vectorized
    # pass names the node's point as the loop does
    def model(edge):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.factor("fac", torch.where(z > edge, torch.tensor(math.nan), -(z**2)))

    for seed in range(4):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoMeanFieldNormal(model, init_loc_fn=lambda site: torch.tensor(-5.0))
        loss = QuadratureELBO("hadamard", num_points=2).loss(model, guide, 0.0)
        assert loss == pytest.approx(diagonal_loss_of_factor(-5.0, 0.1), rel=1e-12)
    for vectorize in (True, False):
        pyro.clear_param_store()
        guide = AutoMeanFieldNormal(model, init_loc_fn=lambda site: torch.tensor(-0.1))
        elbo = QuadratureELBO("hadamard", num_points=2, vectorize=vectorize)
        with pytest.raises(ValueError, match=r"'fac' is not finite .*z = \[0.0\]"):
            elbo.loss(model, guide, -0.05)


def diagonal_loss_of_factor(loc: float, scale: float) -> float:
    """-E_q[log N(z; 0, 1) - z^2] - H[q] for q = N(loc, scale^2), by hand."""
    second_moment = loc**2 + scale**2
    e_log_joint = -HALF_LOG_2PI - 1.5 * second_moment
    entropy = math.log(scale) + HALF_LOG_2PI + 0.5
    return -(e_log_joint + entropy)


@pytest.mark.parametrize("rule", ["gauss_hermite", "mc"])
def test_a_rule_that_cannot_fit_scales_is_refused(rule):
    # issue 10, fault 6: one node sees no curvature, and the scales would stay where they started
    message = (
        f"^{rule} with num_points=1 cannot fit the scales of a mean field: it needs num_points >= 2"
    )
    with pytest.raises(ValueError, match=message):
        QuadratureELBO(rule, num_points=1)
    with pytest.raises(ValueError, match=message):
        QuadratureELBO(make_rule(rule, 1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown quadrature rule"):
        QuadratureELBO("simpson")
    with pytest.raises(ValueError, match="num_points goes with a rule name"):
        QuadratureELBO(make_rule("hadamard"), num_points=4)
    with pytest.raises(TypeError, match="rule must be"):
        QuadratureELBO(3)


# -- SVI, sequence position, reproducibility -------------------------------------------------------


def test_svi_with_pyro_adam_converges_to_the_exact_posterior():
    torch.manual_seed(0)
    x = torch.randn(4, 6) + 1.0
    guide = AutoMeanFieldNormal(diagonal_model)
    svi = SVI(diagonal_model, guide, pyro.optim.Adam({"lr": 0.05}), QuadratureELBO())
    for _ in range(600):
        svi.step(x)
    precision = 1 / PRIOR_SD**2 + x.shape[0]
    assert torch.allclose(guide.locs.z, x.sum(0) / precision, atol=1e-3)
    assert torch.allclose(guide.scales.z, torch.full((6,), precision**-0.5), atol=1e-3)


def test_sequence_advances_per_step_only_and_resumes_from_the_param_store():
    x = torch.randn(4, 6)
    guide = AutoMeanFieldNormal(diagonal_model)
    elbo = QuadratureELBO("hadamard")
    svi = SVI(diagonal_model, guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    for _ in range(3):
        svi.step(x)
    svi.evaluate_loss(x)
    Predictive(diagonal_model, guide=guide, num_samples=2)(x)
    assert elbo.step(guide) == 3
    state = pyro.get_param_store().get_state()
    svi.step(x)
    assert elbo.step(guide) == 4
    pyro.get_param_store().set_state(state)
    assert QuadratureELBO("hadamard").step(guide) == 3
    pyro.clear_param_store()
    assert elbo.step(guide) == 0


def test_random_rules_are_reproducible_with_pyro_set_rng_seed():
    guide, _ = _correlated_guide()
    elbo = QuadratureELBO("rasp_simplex")
    pyro.set_rng_seed(7)
    first = [elbo.loss(correlated_model, guide) for _ in range(3)]
    pyro.set_rng_seed(7)
    again = [elbo.loss(correlated_model, guide) for _ in range(3)]
    assert first == again
    assert len(set(first)) == 3


def test_mean_field_sites_interface_and_predictive():
    x = torch.randn(8)
    guide = AutoMeanFieldNormal(local_model)
    with pytest.raises(RuntimeError, match="has not been run yet"):
        guide.mean_field_sites()
    pyro.set_rng_seed(0)
    guide(x, subsample_size=4)
    sites = {s.name: s for s in guide.mean_field_sites()}
    assert sites["z"].shape == (4,) and sites["z"].scale_factor == 2.0
    assert sites["z"].param_names["loc"] == "AutoMeanFieldNormal.locs.z"
    rows = sites["z"].rows[-1]
    full = pyro.get_param_store()["AutoMeanFieldNormal.locs.z"]
    assert torch.equal(sites["z"].loc, full[rows])
    assert sites["mu"].rows == {} and sites["mu"].scale_factor == 1.0
    samples = Predictive(local_model, guide=guide, num_samples=5)(x, subsample_size=4)
    assert samples["z"].shape == (5, 4) and samples["x"].shape == (5, 4)


def test_quadrature_elbo_gradient_identity_with_trace_elbo_in_expectation():
    """dL/dsigma = sigma h - 1/sigma: QuadratureELBO's exact value is Trace_ELBO's expectation."""
    x = torch.randn(4, 6)
    guide = AutoMeanFieldNormal(diagonal_model)
    _set_mean_field(guide, "z", torch.randn(6), 0.5 + torch.rand(6), x)
    quad = QuadratureELBO("hadamard").loss(diagonal_model, guide, x)
    pyro.set_rng_seed(0)
    mc = Trace_ELBO(num_particles=4000, vectorize_particles=True, max_plate_nesting=2)
    assert abs(mc.loss(diagonal_model, guide, x) - quad) < 0.05 * abs(quad)


def test_median_quantiles_and_site_constraints_of_the_mean_field_guide():
    guide = AutoMeanFieldNormal(halfnormal_model)
    _set_mean_field(guide, "s", torch.tensor(0.2), torch.tensor(0.4))
    guide()  # a run syncs the module with the param store, as svi.step does
    assert abs(guide.median()["s"].item() - math.exp(0.2)) < 1e-12
    q = guide.quantiles([0.1, 0.9])["s"]
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor([0.1, 0.9]))
    assert torch.allclose(q, torch.exp(0.2 + 0.4 * z), atol=1e-12)
    site = guide.mean_field_sites()[0]
    assert site.constraint.check(torch.tensor([1.0, -1.0])).tolist() == [True, False]
    assert site.shape == () and site.event_dim == 0


# ------------------------------------------- poutine.scale on one side: the Jacobian's factor
_SCALE_DATA = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=torch.float64)


def _half_cauchy_model(scale_model: float):
    def model():
        with poutine.scale(scale=scale_model):
            s = pyro.sample("s", dist.HalfCauchy(torch.tensor(1.0, dtype=torch.float64)))
        with pyro.plate("d", 4):
            pyro.sample("y", dist.Normal(0.0, s), obs=_SCALE_DATA)

    return model


def _exact_loss(loc: float, sd: float, scale_model: float, scale_guide: float) -> float:
    """-ELBO by a 200-point Gauss-Hermite rule in u = log s: the prior term scaled by the model's
    factor, the guide's log density (its entropy and the log-Jacobian u) by the guide's."""
    x, w = np.polynomial.hermite_e.hermegauss(200)
    u = torch.tensor(loc + sd * x, dtype=torch.float64)
    prior = dist.HalfCauchy(torch.tensor(1.0, dtype=torch.float64)).log_prob(u.exp())
    lik = dist.Normal(0.0, u.exp()[:, None]).log_prob(_SCALE_DATA).sum(-1)
    entropy = 0.5 * math.log(2 * math.pi * math.e * sd**2)
    expected = torch.tensor(w / w.sum()) @ (scale_model * prior + scale_guide * u + lik)
    return -expected.item() - scale_guide * entropy


@pytest.mark.parametrize("scale_model, scale_guide", [(3.0, 1.0), (1.0, 3.0), (3.0, 3.0)])
@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
def test_a_scale_on_one_side_puts_the_jacobian_with_the_guide_as_pyro_does(
    scale_model, scale_guide, guide_class
):
    model = _half_cauchy_model(scale_model)
    guide = guide_class(model, init_scale=0.3)
    guide()
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.2)
    if guide_class is AutoDiagonalNormal:
        loc, sd = guide.loc.item(), guide.scale.item()
    else:
        loc, sd = guide.locs.s.item(), guide.scales.s.item()
    scaled_guide = poutine.scale(guide, scale=scale_guide)
    loss = QuadratureELBO("gauss_hermite", num_points=20).loss(model, scaled_guide)
    assert loss == pytest.approx(_exact_loss(loc, sd, scale_model, scale_guide), abs=1e-9)


def _nested_plates():
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("g", 3, dim=-1):
        a = pyro.sample("a", dist.Normal(mu, 1.0))
        with pyro.plate("i", 4, dim=-2):
            pyro.sample("y", dist.Normal(a, 0.5), obs=torch.ones(4, 3))


@pytest.mark.parametrize("given", [0, 1])
def test_a_max_plate_nesting_below_the_models_is_refused_naming_both(given):
    guide = AutoNormal(_nested_plates)
    guide()
    with pytest.raises(
        ValueError, match=rf"max_plate_nesting={given}, but the model nests .* 2 deep"
    ):
        QuadratureELBO(max_plate_nesting=given).loss(_nested_plates, guide)
    # enough, or found: the same loss (the same random rotation of the rule)
    losses = []
    for elbo in (QuadratureELBO(max_plate_nesting=2), QuadratureELBO()):
        pyro.set_rng_seed(0)
        losses.append(elbo.loss(_nested_plates, guide))
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)


def test_guides_it_cannot_read_are_named_with_what_it_can():
    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    def my_guide():
        loc = pyro.param("loc", torch.tensor(0.0))
        pyro.sample("a", dist.Normal(loc, 1.0))
        pyro.sample("b", dist.Normal(loc, 1.0))

    with pytest.raises(
        TypeError,
        match=r"guide function 'test_guides_it_cannot.*my_guide'.*"
        r"AutoMeanFieldNormal, or Pyro's .*AutoNormal",
    ):
        QuadratureELBO().loss(model, my_guide)
    parts = AutoGuideList(model)
    parts.append(AutoNormal(poutine.block(model, expose=["a"])))
    parts.append(AutoNormal(poutine.block(model, expose=["b"])))
    parts()
    with pytest.raises(
        TypeError,
        match="An AutoGuideList is not read part by part.*amortized or hand-written.*"
        r"Pyro's Trace_ELBO and QNVB\(\)",
    ):
        QuadratureELBO().loss(model, parts)


def test_an_amortized_guide_method_is_named_with_the_way_to_train_it():
    # a VAE's guide is a bound method: it is named as one, with what trains it (QNVB's fallback
    # under Trace_ELBO), and that route gives the fallback's own steps exactly
    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 2)

        def model(self, x):
            with pyro.plate("rows", len(x)):
                pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))

        def guide(self, x):
            pyro.module("encoder", self)
            loc, log_scale = self.net(x).unbind(-1)
            with pyro.plate("rows", len(x)):
                stacked = torch.stack([loc, log_scale.exp()], -1)
                pyro.sample("z", dist.Normal(stacked, 1.0).to_event(1))

    x = torch.randn(5, 3)
    vae = Encoder()
    with pytest.raises(
        TypeError, match=r"guide method '.*Encoder.guide'.*amortized.*Trace_ELBO.*fallback"
    ):
        QuadratureELBO().loss(vae.model, vae.guide, x)
    finals = []
    for optim in (QNVB(), pyro.optim.Adam({"lr": 1e-2})):  # QNVB's default fallback
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        vae = Encoder()
        svi = SVI(vae.model, vae.guide, optim, Trace_ELBO())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "QNVB: none of the 2 parameters")
            for _ in range(3):
                svi.step(x)
        finals.append(vae.net.weight.detach().clone())
    assert torch.equal(finals[0], finals[1])


def test_num_particles_and_a_scheduler_fallback_are_refused_saying_what_to_use():
    with pytest.raises(TypeError, match=r"takes no num_particles: .* num_points"):
        QuadratureELBO(num_particles=4)
    scheduler = pyro.optim.ExponentialLR(
        {"optimizer": torch.optim.Adam, "optim_args": {"lr": 0.01}, "gamma": 0.99}
    )
    with pytest.raises(ValueError, match="a learning-rate scheduler is not supported"):
        QNVB(fallback=scheduler)
