"""OPQA evidence: exact evidences, the Parseval / Gauss-Hermite identity, truncation, errors."""

from __future__ import annotations

import inspect
import itertools
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from numpy.polynomial import hermite as physicists
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_value,
)
from pyro.nn import PyroModule, PyroSample
from scipy import integrate
from torch import nn

from pyro_quadvi import opqa_evidence
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import LogJoint, latent_sites_of_model
from pyro_quadvi.quadrature import gauss_hermite
from pyro_quadvi.testing.evidence_models import (
    BERNOULLI_DATA,
    F64,
    POISSON_DATA,
    beta_and_gamma,
    beta_bernoulli,
    beta_bernoulli_posterior,
    gamma_poisson,
    gamma_poisson_posterior,
    linear_regression,
    linear_regression_matmul,
    linear_regression_misbroadcast,
    linear_regression_posterior,
    logistic_data,
    logistic_regression,
    normal_normal,
    normal_normal_log_evidence,
    regression_data,
)


@pytest.fixture(autouse=True)
def clear_param_store():
    pyro.clear_param_store()


# ---------------------------------------------------------------- exact evidences


@pytest.mark.parametrize("num_points", [1, 4, 8])
def test_normal_normal_centred_is_exact(num_points):
    x = torch.tensor(0.7, dtype=F64)
    result = opqa_evidence(normal_normal, x, num_points=num_points)
    assert abs(result.log_evidence - normal_normal_log_evidence(0.7)) < 1e-8


def test_normal_normal_fixed_weight_struggles():
    # The paper's weight exp(-mu^2) is ten times wider than the posterior (sigma_x = 0.1).
    x = torch.tensor(0.7, dtype=F64)
    result = opqa_evidence(normal_normal, x, num_points=8, center="none")
    assert abs(result.log_evidence - normal_normal_log_evidence(0.7)) > 1e-2
    assert result.diagnostics["edge_fraction"] > 1e-3  # and the diagnostics say so


@pytest.mark.parametrize("num_points", [1, 3])
def test_linear_regression_with_correlated_features_is_exact(num_points):
    X, y = regression_data()
    assert torch.corrcoef(X.T)[0, 1] > 0.8
    _, _, log_evidence = linear_regression_posterior(X, y)
    result = opqa_evidence(linear_regression, X, y, num_points=num_points)
    assert abs(result.log_evidence - log_evidence) < 1e-8
    assert result.diagnostics["vectorized"]


@pytest.mark.parametrize("dim", [64, 70])
def test_one_point_is_exact_beyond_torchs_64_axes(dim):
    # a coefficient tensor with an axis per coordinate, or its multi-indices with one more,
    # exceeds torch's 64 axes: the contraction, the degrees and the posterior run flat
    X, y = regression_data(n=150, p=dim)
    mean, covariance, log_evidence = linear_regression_posterior(X, y)
    result = opqa_evidence(linear_regression, X, y, num_points=1)
    assert abs(result.log_evidence - log_evidence) < 1e-8
    shape = (1,) * dim if dim <= 64 else (1,)  # flat above torch's limit
    assert result.normalized_coefficients.shape == shape
    assert result.normalized_coefficients.abs().item() == pytest.approx(1.0, abs=1e-12)
    posterior = result.posterior
    assert torch.allclose(posterior.mean_unconstrained, mean, atol=1e-8)
    assert torch.allclose(posterior.covariance_unconstrained, covariance, atol=1e-10)


def test_beta_latent_evidence():
    _, _, log_evidence = beta_bernoulli_posterior(BERNOULLI_DATA)
    result = opqa_evidence(beta_bernoulli, BERNOULLI_DATA, num_points=24)
    assert abs(result.log_evidence - log_evidence) < 1e-8


def test_gamma_latent_evidence():
    _, _, log_evidence = gamma_poisson_posterior(POISSON_DATA)
    result = opqa_evidence(gamma_poisson, POISSON_DATA, num_points=20)
    assert abs(result.log_evidence - log_evidence) < 1e-8


def test_two_constrained_sites_evidence_is_the_product():
    expected = (
        beta_bernoulli_posterior(BERNOULLI_DATA)[2] + gamma_poisson_posterior(POISSON_DATA)[2]
    )
    result = opqa_evidence(beta_and_gamma, BERNOULLI_DATA, POISSON_DATA, num_points=24)
    assert result.diagnostics["dim"] == 2
    assert abs(result.log_evidence - expected) < 1e-8


def test_evidence_converges_with_points():
    _, _, log_evidence = beta_bernoulli_posterior(BERNOULLI_DATA)
    errors = [
        abs(opqa_evidence(beta_bernoulli, BERNOULLI_DATA, num_points=m).log_evidence - log_evidence)
        for m in (4, 8, 16)
    ]
    assert errors[0] > errors[1] > errors[2]
    assert errors[0] > 1e-5  # the comparison is not vacuous


# ---------------------------------------------------------------- guides as the weight


def _set_scales(guide, *args, scale: float):
    """Run ``guide`` once and set its scales by hand, as fitting would move them
    (``center="guide"`` refuses a guide whose scales are all at their ``init_scale``)."""
    guide(*args)
    store = pyro.get_param_store()
    for name in list(store.keys()):
        if name.endswith(".scale") or ".scales." in name:
            store[name] = torch.full_like(store[name], scale)
    return guide


def _gamma_guide(guide_class, loc: float, scale: float):
    init = init_to_value(values={"rate": torch.tensor(math.exp(loc), dtype=F64)})
    return _set_scales(guide_class(gamma_poisson, init_loc_fn=init), POISSON_DATA, scale=scale)


@pytest.mark.parametrize(
    "guide_class", [AutoNormal, AutoMeanFieldNormal, AutoDiagonalNormal, AutoMultivariateNormal]
)
def test_guide_weight(guide_class):
    _concentration, _rate, log_evidence = gamma_poisson_posterior(POISSON_DATA)
    # a guide a little off the posterior of log(rate) (mean ~1.35, sd ~0.19)
    guide = _gamma_guide(guide_class, 1.3, 0.22)
    result = opqa_evidence(gamma_poisson, POISSON_DATA, num_points=24, center="guide", guide=guide)
    assert torch.allclose(result.diagnostics["loc"], torch.tensor([1.3], dtype=F64))
    assert torch.allclose(result.diagnostics["scale_tril"], torch.tensor([[0.22]], dtype=F64))
    assert abs(result.log_evidence - log_evidence) < 1e-8
    assert result.diagnostics["weight_evaluations"] == 0


def test_guide_starts_the_laplace_search():
    concentration, rate, log_evidence = gamma_poisson_posterior(POISSON_DATA)
    guide = _gamma_guide(AutoNormal, 1.0, 0.5)
    result = opqa_evidence(gamma_poisson, POISSON_DATA, num_points=20, guide=guide)
    assert abs(result.log_evidence - log_evidence) < 1e-8
    # z = log(rate) has density proportional to exp(a z - b e^z): its mode is log(a / b)
    assert abs(float(result.diagnostics["loc"][0]) - math.log(concentration / rate)) < 1e-7


def test_coefficients_of_a_shifted_posterior_are_analytic():
    # Two independent normal means with the guide's scale equal to the posterior's and its loc
    # shifted by delta: in the offsets x the posterior is N(delta / sd, I), and
    # sqrt(g) = sqrt(Z) exp(mu.x / 2 - |mu|^2 / 4) has a_(i,j) = sqrt(Z) e^(-|mu|^2/8)
    # (mu_1/2)^i (mu_2/2)^j / sqrt(i! j!).
    obs = torch.tensor([[0.3, -1.2], [0.8, -0.4], [0.5, -0.9]], dtype=F64)

    def model(obs):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=F64), 1.0).to_event(1))
        with pyro.plate("obs", obs.shape[0]):
            pyro.sample("x", dist.Normal(mu, 0.5).to_event(1), obs=obs)

    precision = 1.0 + obs.shape[0] / 0.25
    post_mean = obs.sum(0) / 0.25 / precision
    post_sd = precision**-0.5
    delta = torch.tensor([0.25, -0.5], dtype=F64)
    guide = AutoNormal(model, init_loc_fn=init_to_value(values={"mu": post_mean - delta}))
    _set_scales(guide, obs, scale=post_sd)
    result = opqa_evidence(model, obs, num_points=16, center="guide", guide=guide)
    mu = (delta / post_sd).tolist()
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    log_expected = (
        0.5 * result.log_evidence
        - (mu[0] ** 2 + mu[1] ** 2) / 8
        + i * math.log(abs(mu[0]) / 2)
        + j * math.log(abs(mu[1]) / 2)
        - 0.5 * (np.vectorize(math.lgamma)(i + 1.0) + np.vectorize(math.lgamma)(j + 1.0))
    )
    expected = np.sign(mu[0]) ** i * np.sign(mu[1]) ** j * np.exp(log_expected)
    low = (i + j) <= 6
    assert np.abs(result.coefficients.numpy()[low] - expected[low]).max() < 1e-10
    assert result.coefficients[0, 1] < 0 < result.coefficients[1, 0]  # axes not swapped


def test_fixed_weight_coefficients_are_the_papers_eq9():
    # a_n = int sqrt(P(theta, x)) h_n(theta) exp(-theta^2 / 2) dtheta with the normalized
    # physicists' Hermite h_n (paper eq. 9, 18-19), by adaptive 1-D quadrature.
    x, sigma_x = 0.5, 1.0
    result = opqa_evidence(
        normal_normal, torch.tensor(x, dtype=F64), 1.0, sigma_x, num_points=40, center="none"
    )

    def joint(theta):
        return math.exp(
            -0.5 * theta**2 - 0.5 * (x - theta) ** 2 / sigma_x**2 - math.log(2 * math.pi * sigma_x)
        )

    for n in range(6):
        unit = np.zeros(n + 1)
        unit[n] = 1.0 / math.sqrt(math.sqrt(math.pi) * 2**n * math.factorial(n))

        def integrand(theta, unit=unit):
            return (
                math.sqrt(joint(theta))
                * physicists.hermval(theta, unit)
                * math.exp(-0.5 * theta**2)
            )

        expected, _ = integrate.quad(integrand, -np.inf, np.inf, epsabs=1e-14)
        assert abs(float(result.coefficients[n]) - expected) < 1e-10


# ---------------------------------------------------------------- the identity and truncation


def _plain_gauss_hermite(model, args, loc, scale_tril, num_points) -> float:
    """log of sum_j w_j |det L| f(m + L x_j) / phi(x_j) on the tensor grid, by brute force."""
    nodes, weights = gauss_hermite(num_points)
    dim = loc.shape[0]
    x = torch.cartesian_prod(*[nodes] * dim).reshape(-1, dim)
    w = torch.cartesian_prod(*[weights] * dim).reshape(-1, dim).prod(-1)
    log_joint = LogJoint(model, latent_sites_of_model(model, *args))
    log_f = log_joint(loc + x @ scale_tril.T, args, vectorize=False)
    log_phi = -0.5 * (x**2).sum(-1) - 0.5 * dim * math.log(2 * math.pi)
    log_det = scale_tril.diagonal().log().sum()
    return float(torch.logsumexp(w.log() + log_det + log_f - log_phi, 0))


def test_full_degree_equals_plain_gauss_hermite():
    X, y = logistic_data()
    result = opqa_evidence(logistic_regression, X, y, num_points=6)
    loc, scale_tril = result.diagnostics["loc"], result.diagnostics["scale_tril"]
    plain = _plain_gauss_hermite(logistic_regression, (X, y), loc, scale_tril, 6)
    assert abs(result.log_evidence - plain) < 1e-12
    # the expansion is not trivial: the higher coefficients carry part of the sum
    assert 1e-4 < 1.0 - result.diagnostics["energy_by_degree"][0] < 0.1


def test_truncation_never_exceeds_the_full_sum():
    X, y = logistic_data()
    full = opqa_evidence(logistic_regression, X, y, num_points=5)
    values = [
        opqa_evidence(logistic_regression, X, y, num_points=5, max_degree=k).log_evidence
        for k in range(9)
    ]
    assert all(a <= b + 1e-14 for a, b in itertools.pairwise(values))
    assert values[0] < values[2] < full.log_evidence
    assert abs(values[-1] - full.log_evidence) < 1e-13
    # degree 0 alone: a_0^2 = (sum_j w_j sqrt(g(x_j)))^2
    assert full.coefficients[0, 0] ** 2 == pytest.approx(math.exp(values[0]), rel=1e-12)
    truncated = opqa_evidence(logistic_regression, X, y, num_points=5, max_degree=3)
    degree = torch.arange(5)[:, None] + torch.arange(5)[None, :]
    assert torch.all(truncated.coefficients[degree > 3] == 0)
    assert math.log(truncated.coefficients.square().sum()) == pytest.approx(
        truncated.log_evidence, abs=1e-12
    )


def test_chunks_and_loops_give_the_same_evidence():
    X, y = logistic_data()
    one = opqa_evidence(logistic_regression, X, y, num_points=7)
    chunked = opqa_evidence(logistic_regression, X, y, num_points=7, chunk_size=5)
    looped = opqa_evidence(logistic_regression, X, y, num_points=7, vectorize=False)
    assert abs(one.log_evidence - chunked.log_evidence) < 1e-12
    assert abs(one.log_evidence - looped.log_evidence) < 1e-12
    assert one.diagnostics["vectorized"] and not looped.diagnostics["vectorized"]


@pytest.mark.parametrize("model", [linear_regression_matmul, linear_regression_misbroadcast])
def test_models_that_do_not_vectorize_fall_back_to_a_loop(model):
    X, y = regression_data()
    _, _, log_evidence = linear_regression_posterior(X, y)
    result = opqa_evidence(model, X, y, num_points=2)
    assert not result.diagnostics["vectorized"]
    assert result.diagnostics["vectorize_fallback"]
    assert abs(result.log_evidence - log_evidence) < 1e-8


def _scale_from_a_float(x):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
    scale = 0.1 if float(mu) < 100 else 1.0  # float() of the batch of points in a pass
    pyro.sample("x", dist.Normal(mu, scale), obs=x)


def test_float_of_a_latent_falls_back_to_a_loop_without_the_advice_on_far_nodes():
    # was: "only one element tensors can be converted to Python scalars ... The outermost nodes
    # lie 2.65 weight standard deviations from the centre; fewer points keep them closer"
    x = torch.tensor(0.7, dtype=F64)
    with pytest.warns(UserWarning, match="only one element tensors can be converted"):
        result = opqa_evidence(_scale_from_a_float, x, num_points=4)
    assert not result.diagnostics["vectorized"]
    assert abs(result.log_evidence - normal_normal_log_evidence(0.7)) < 1e-8
    # forced, the error propagates, named, without advice on the nodes that does not apply
    with pytest.raises(ValueError) as error:
        opqa_evidence(_scale_from_a_float, x, num_points=4, vectorize=True)
    message = str(error.value)
    assert message.startswith(
        "opqa_evidence: at the grid chunk starting at node 0: only one element tensors can be "
        "converted to Python scalars"
    )
    assert "outermost nodes" not in message


def test_number_of_evaluations():
    X, y = logistic_data()
    result = opqa_evidence(logistic_regression, X, y, num_points=5, center="none", vectorize=False)
    assert result.num_evaluations == 25 + 1  # the grid and the check at the centre
    laplace = opqa_evidence(logistic_regression, X, y, num_points=5)
    # the three probes of the vectorized pass count twice: alone and in the mixing check's pass
    assert laplace.num_evaluations == 25 + 1 + 6 + laplace.diagnostics["weight_evaluations"]
    assert laplace.diagnostics["weight_evaluations"] > 3  # the MAP search is counted


@pytest.mark.parametrize("detach", [torch.Tensor.detach, float], ids=["detach", "float"])
def test_a_likelihood_without_a_gradient_is_warned_of(detach):
    # autograd sees the prior alone: the Laplace weight sat on it (loc 0, scale 1, the MAP
    # gradient 0), and at 8 points the evidence was 0.63 nats off, without a word
    y = torch.tensor([0.5, 1.2, 0.9, -0.1, 0.7], dtype=F64)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(detach(mu), 0.5), obs=y)

    with pytest.warns(UserWarning, match="derivatives of the log joint disagree") as record:
        opqa_evidence(model, y, num_points=2, vectorize=False)
    (warning,) = [w for w in record if "disagree" in str(w.message)]
    # d/dmu at 0 of the likelihood: sum(y) / 0.5^2 = 12.8; the curvature 1 + 5 / 0.25 = 21
    assert (
        "the slope is 12.8 by finite differences and 0 by autograd, the curvature -21 and -1"
        in (str(warning.message))
    )
    assert "float(x)" in str(warning.message)
    assert warning.filename == __file__  # the user's call, not opqa_evidence's inside


def test_the_map_gradient_and_fallback_warnings_point_at_the_users_call():
    # both pointed inside the package (opqa.py: the MAP warning at opqa_evidence's line, the
    # fallback at its evaluate_batch call), where a filter on the user's module missed them
    def kinked(y):  # a Laplace likelihood: the mode sits on its kink, autograd's slope 0.5 there
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        pyro.sample("y", dist.Laplace(mu, 1.0), obs=y)

    def one_sum(y):  # sums the two latents of every point together: no vectorized pass
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=F64), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(torch.stack([mu[0], mu[1]]).sum(), 1.0), obs=y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # the two calls' lines
        opqa_evidence(kinked, torch.tensor(0.5, dtype=F64), num_points=3)
        opqa_evidence(one_sum, torch.tensor(0.3, dtype=F64), num_points=3)
    starts = {  # (no warning of the distance to the mode: autograd's slope there is the kink's)
        "opqa_evidence(center='laplace'): autograd's derivatives of the log joint disagree": line,
        "opqa_evidence: the model does not evaluate all 9 points in one vectorized pass": line + 1,
    }
    where = {
        s: [(w.filename, w.lineno) for w in caught if str(w.message).startswith(s)] for s in starts
    }
    assert where == {start: [(__file__, line)] for start, line in starts.items()}
    assert len(caught) == 2


def test_a_log_joint_partly_in_float32_is_not_warned_of():
    # dist.HalfCauchy(1.) casts its value to its float32 scale: the log joint carries about
    # 1e-7 nats of rounding, which at a step of 1e-3 standard deviations moved the curvature by
    # finite differences to 1.35 (against autograd's 1), and a smooth model was warned of
    x = torch.linspace(-2.0, 2.0, 50, dtype=F64)

    def model(x):
        s = pyro.sample("s", dist.HalfCauchy(1.0))
        with pyro.plate("n", len(x)):
            pyro.sample("x", dist.Normal(0.0, s), obs=x)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = opqa_evidence(model, x, num_points=12, vectorize=False)
    assert not [w for w in record if "disagree" in str(w.message)]

    def integrand(s):  # p(s) p(x | s): HalfCauchy(1) and 50 normals, in float64
        return math.exp(
            math.log(2 / math.pi)
            - math.log1p(s * s)
            - len(x) * math.log(s * math.sqrt(2 * math.pi))
            - float(x.square().sum()) / (2 * s * s)
        )

    expected, _ = integrate.quad(integrand, 0.0, np.inf, epsabs=0.0, epsrel=1e-12)
    assert abs(result.log_evidence - math.log(expected)) < 1e-6


# ---------------------------------------------------------------- errors


def test_refuses_discrete_latents():
    def model():
        coin = pyro.sample("coin", dist.Bernoulli(torch.tensor(0.5, dtype=F64)))
        pyro.sample("x", dist.Normal(coin, 1.0), obs=torch.tensor(0.3, dtype=F64))

    with pytest.raises(ValueError, match="'coin' is discrete"):
        opqa_evidence(model)


def test_refuses_too_many_latents():
    def model():
        pyro.sample("z", dist.Normal(torch.zeros(25, dtype=F64), 1.0).to_event(1))

    # 2^25 > 2^20: not even 2 points fit, and one point is no grid to advise as a fix
    with pytest.raises(ValueError, match=r"8\^25 .* even num_points=2 needs 2\^25 nodes"):
        opqa_evidence(model)
    with pytest.raises(ValueError, match=r"use num_points <= 2"):
        opqa_evidence(model, num_points=3, max_nodes=2**25)


def _walled():
    z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
    pyro.factor("wall", torch.where(z > 0.5, 0.0, -math.inf))


def test_refuses_a_log_joint_not_finite_at_the_centre():
    with pytest.raises(ValueError, match="not finite at the centre of the weight"):
        opqa_evidence(_walled, center="none")
    with pytest.raises(ValueError, match="MAP start"):
        opqa_evidence(_walled)


def test_refuses_a_flat_direction():
    def model():
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        pyro.factor("flat", -dist.Normal(0.0, 1.0).log_prob(b))  # b is left improper
        pyro.sample("x", dist.Normal(a, 1.0), obs=torch.tensor(0.2, dtype=F64))

    # named, and not sent to center="guide", where a finite grid gives a finite, wrong value
    with pytest.raises(ValueError) as error:
        opqa_evidence(model)
    message = str(error.value)
    assert message.startswith(
        "opqa_evidence(center='laplace'): the log joint does not depend on 'b' near the point "
        "found (z = ["
    )
    assert message.endswith(
        "]): a flat direction (a latent with an improper prior that no term informs), along "
        "which the integral is infinite, so the evidence does not exist and no weight "
        "(center='guide' neither) gives it; give the latent a proper prior, or remove it"
    )


def test_a_funnel_names_the_scale_that_ran_away_and_no_guide_advice():
    # a centred hierarchical model: the log joint grows without bound as tau -> 0 with the
    # group means at mu, so L-BFGS runs tau's log to about -1e5; the message named 'th' and
    # gave advice for a guide (init_to_value, init_scale, trust_region) though none was passed
    y = torch.tensor([2.8, 0.8, -0.3], dtype=F64)
    s = torch.tensor([1.5, 1.0, 1.6], dtype=F64)

    def model(y, s):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 2.0))
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=F64)))
        with pyro.plate("J", len(y)):
            theta = pyro.sample("th", dist.Normal(mu, tau))
            pyro.sample("y", dist.Normal(theta, s), obs=y)

    with pytest.raises(ValueError) as error:
        opqa_evidence(model, y, s, num_points=4)
    message = str(error.value)
    assert "having moved farthest along 'tau' (unconstrained, from 0 to -" in message
    assert "no mode exists" in message
    assert message.endswith(
        "Write the model non-centred (theta = mu + tau * theta_raw with theta_raw ~ Normal(0, "
        "1)), or fit a Gaussian guide and use center='guide'"
    )
    for guide_advice in ("init_to_value", "init_scale", "trust_region", "guide's start"):
        assert guide_advice not in message


def test_refuses_subsampling():
    def model(data):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        with pyro.plate("data", len(data), subsample_size=3) as index:
            pyro.sample("x", dist.Normal(mu, 1.0), obs=data[index])

    with pytest.raises(ValueError, match="plate 'data' is subsampled"):
        opqa_evidence(model, torch.zeros(10, dtype=F64))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_points": 0}, "num_points"),
        ({"max_degree": -1}, "max_degree"),
        ({"center": "mode"}, "center must be one of"),
        ({"center": "guide"}, "needs the fitted guide"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"vectorize": "try"}, "opqa_evidence: vectorize must be True, False or None"),
    ],
)
def test_refuses_bad_arguments(options, match):
    with pytest.raises(ValueError, match=match):
        opqa_evidence(normal_normal, torch.tensor(0.7, dtype=F64), **options)


def test_refuses_a_guide_that_is_not_gaussian():
    guide = AutoDelta(gamma_poisson)
    guide(POISSON_DATA)
    with pytest.raises(ValueError, match="needs a Gaussian AutoGuide"):
        opqa_evidence(gamma_poisson, POISSON_DATA, center="guide", guide=guide)


# ---------------------------------------------------------------- PyroModule models, float64


# The priors are float32 distributions, built with the module: their normalizing constants
# (log 1.5, say) are computed in float32, a 1e-8 error per coordinate that OPQA cannot undo. A scale
# of 1 has an exact log, so the evidence below is exact in float64.
PRIOR = 1.0


class BayesianLinear(PyroModule):
    """A conjugate Bayesian linear regression written as a Pyro user would: ``nn.Linear`` with
    ``PyroSample`` priors, built in float32 (torch's default dtype)."""

    def __init__(self, p: int):
        super().__init__()
        self.fc = PyroModule[nn.Linear](p, 1)
        self.fc.weight = PyroSample(dist.Normal(0.0, PRIOR).expand([1, p]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, PRIOR).expand([1]).to_event(1))

    def forward(self, X, y):
        mean = self.fc(X).squeeze(-1)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(mean, 0.4), obs=y)


def bayesian_linear_log_evidence(X, y) -> float:
    """y ~ N(0, PRIOR^2 (X X^T + 1 1^T) + 0.4^2 I), in float64."""
    X, y = X.double(), y.double()
    covariance = PRIOR**2 * (X @ X.T + 1.0) + 0.4**2 * torch.eye(len(y), dtype=F64)
    return float(dist.MultivariateNormal(torch.zeros(len(y), dtype=F64), covariance).log_prob(y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pyro_module_regression_evidence_is_exact_in_float32_and_float64(dtype):
    assert torch.get_default_dtype() == torch.float32
    X, y = (t.to(dtype) for t in regression_data())
    with pytest.warns(UserWarning, match="opqa_evidence: the model does not evaluate all"):
        result = opqa_evidence(BayesianLinear(3), X, y, num_points=2)
    assert abs(result.log_evidence - bayesian_linear_log_evidence(X, y)) < 1e-8
    assert result.diagnostics["dtype"] == torch.float64
    assert not result.diagnostics["vectorized"]


def test_model_that_cannot_run_in_float64_is_refused_with_the_fix():
    net = nn.Linear(3, 1)  # fixed float32 weights

    def model(X, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(w * net(X).squeeze(-1), 0.4), obs=y)

    X, y = regression_data()
    with pytest.raises(ValueError, match=r"does not run in float64.*set_default_dtype"):
        opqa_evidence(model, X.float(), y.float())


# ---------------------------------------------------------------- one meaning of vectorize


def test_vectorize_true_forces_the_vectorized_pass():
    X, y = regression_data()
    with pytest.raises(RuntimeError, match="Expected size for first two dimensions"):
        opqa_evidence(linear_regression_matmul, X, y, num_points=2, vectorize=True)
    result = opqa_evidence(linear_regression, X, y, num_points=2, vectorize=True)
    # the first chunk checked at its first, middle and last node (vectorize=True's meaning),
    # each run alone and the three in one pass for the mixing check
    assert result.diagnostics["vectorized"] and result.diagnostics["probe_evaluations"] == 6


def test_an_error_of_the_model_propagates_instead_of_a_fallback():
    def model(y):
        rate = pyro.sample("rate", dist.Gamma(torch.tensor(2.0, dtype=F64), 1.0))
        if rate.numel() > 1:  # raised in the vectorized pass only, as a model's own check would
            raise ValueError("this model checks its rate one at a time")
        pyro.sample("y", dist.Poisson(rate), obs=y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="checks its rate one at a time"):
            opqa_evidence(model, torch.tensor(3.0, dtype=F64), num_points=4)


# ---------------------------------------------------------------- a guide that was not fitted


def test_guide_never_run_is_refused_with_the_fix():
    guide = AutoNormal(gamma_poisson)
    with pytest.raises(ValueError, match=r"center='guide'\): AutoNormal was never run.*svi\.step"):
        opqa_evidence(gamma_poisson, POISSON_DATA, center="guide", guide=guide)
    assert len(pyro.get_param_store()) == 0  # the check did not set it up


@pytest.mark.parametrize(
    "guide_class", [AutoNormal, AutoMeanFieldNormal, AutoDiagonalNormal, AutoMultivariateNormal]
)
def test_guide_at_its_initial_scales_is_refused(guide_class):
    guide = guide_class(gamma_poisson, init_scale=0.2)
    guide(POISSON_DATA)  # run, never fitted: its weight misses the posterior
    with pytest.raises(ValueError, match=r"still equals its init_scale=0.2.*never fitted"):
        opqa_evidence(gamma_poisson, POISSON_DATA, center="guide", guide=guide)
    # fitted, the same guide is accepted and the evidence is exact
    pyro.set_rng_seed(0)
    svi = pyro.infer.SVI(
        gamma_poisson, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO()
    )
    for _ in range(300):
        svi.step(POISSON_DATA)
    result = opqa_evidence(gamma_poisson, POISSON_DATA, num_points=24, center="guide", guide=guide)
    assert abs(result.log_evidence - gamma_poisson_posterior(POISSON_DATA)[2]) < 1e-8
