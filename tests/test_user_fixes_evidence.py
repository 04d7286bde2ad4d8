"""Fixes of faults users found in the quadrature rules, the OPQA evidence and the ArviZ export."""

from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoNormal

from pyro_quadvi import opqa_evidence, to_inference_data
from pyro_quadvi.evidence.posterior import OPQAPosterior, _in_image
from pyro_quadvi.infer.log_joint import LatentSite
from pyro_quadvi.quadrature import RULES, gauss_hermite, make_rule
from pyro_quadvi.testing.evidence_models import (
    F64,
    beta_bernoulli,
    beta_bernoulli_posterior,
    linear_regression,
    linear_regression_posterior,
    regression_data,
)

# ---------------------------------------------------------------- draw arguments (1, 5, 6)


@pytest.mark.parametrize("name", list(RULES))
def test_an_integer_dtype_is_refused_instead_of_zero_weights(name):
    with pytest.raises(ValueError) as error:
        make_rule(name).nodes(3, dtype=torch.int64)
    assert str(error.value) == (
        f"{name}: dtype must be a floating torch.dtype (torch.float32, torch.float64, ...), got "
        "torch.int64: the weights 1 / K and the nodes are not integers"
    )


@pytest.mark.parametrize("name", ["rasp_simplex", "hadamard", "vrmc2"])
def test_float16_is_accepted_with_moments_exact_to_its_rounding(name):
    num_points = 7 if name == "rasp_simplex" else 8
    X, w = make_rule(name, num_points).nodes(
        2000, generator=torch.Generator().manual_seed(0), dtype=torch.float16
    )
    assert X.dtype == w.dtype == torch.float16
    assert abs(float(w.float().sum()) - 1.0) <= 2.5e-4
    second = (w[:, None].float() * X.float() ** 2).sum(0)
    assert float((second - 1).abs().max()) <= 3e-3  # float16's eps is 9.8e-4


@pytest.mark.parametrize("name", list(RULES))
def test_a_generator_that_is_not_a_torch_generator_is_refused(name):
    with pytest.raises(ValueError) as error:
        make_rule(name).draw(3, generator="cpu")
    assert str(error.value) == (
        f"{name}: generator must be a torch.Generator or None, got 'cpu' (str); pass "
        "torch.Generator().manual_seed(seed), or None for torch's global generator"
    )


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("step", [-5, 1.5, True])
def test_every_rule_refuses_a_step_that_is_not_an_integer_at_least_0(name, step):
    with pytest.raises(ValueError) as error:
        make_rule(name).draw(3, step=step)
    assert str(error.value) == f"{name}: step must be >= 0 (an integer), got {step!r}"


# ------------------------------------------------------------------------- memory (4, 7)


def test_gauss_hermite_counts_its_jacobi_matrix_and_refuses_before_allocating():
    message = (
        "needs an m x m float64 Jacobi matrix (and an m x m table of Hermite values) "
        "(m = 1000000): 1000000 * 1000000 * 8 = 8000000000000 bytes (7.45e+03 GiB)"
    )
    with pytest.raises(ValueError) as error:
        make_rule("gauss_hermite", 10**6)
    assert str(error.value).startswith(f"gauss_hermite with num_points=1000000 {message} at ")
    with pytest.raises(ValueError) as error:
        gauss_hermite(10**6)
    assert str(error.value).startswith(f"Gauss-Hermite with num_points=1000000 {message}, more")
    # the limit is exact: 8 m^2 bytes pass, one byte fewer does not
    rule = make_rule("gauss_hermite", 100, max_bytes=8 * 100 * 100)
    assert rule.table_bytes() == 80000
    assert float(rule.draw(1, dtype=torch.float64).weights.sum()) == pytest.approx(1.0, abs=1e-14)
    with pytest.raises(ValueError, match=r"= 80000 bytes .* at construction"):
        make_rule("gauss_hermite", 100, max_bytes=79999)


def test_the_weights_are_counted_at_construction_and_at_every_draw():
    with pytest.raises(ValueError) as error:
        make_rule("mc", 10**9)
    assert str(error.value) == (
        "mc with num_points=1000000000 needs 1000000000 float64 weights: 1000000000 * 8 = "
        "8000000000 bytes (7.45 GiB) at construction, more than max_bytes=1073741824 bytes "
        "(1 GiB); use fewer points, or pass a larger max_bytes"
    )
    assert len(make_rule("hadamard", 1000, max_bytes=8000).draw(3, dtype=torch.float64)) == 1000
    with pytest.raises(ValueError, match=r"1000 float64 weights: 1000 \* 8 = 8000 bytes"):
        make_rule("hadamard", 1000, max_bytes=7999)
    # Gauss-Hermite: K = 2^10 weights, known only at the draw
    rule = make_rule("gauss_hermite", 2, max_bytes=8191)
    assert len(rule.draw(10, dtype=torch.float32)) == 1024  # 4096 bytes
    with pytest.raises(ValueError) as error:
        rule.draw(10, dtype=torch.float64)
    assert str(error.value).startswith(
        "the 1024 weights of gauss_hermite in 10 dimensions need K * itemsize = 1024 * 8 = "
        "8192 bytes (7.63e-06 GiB), more than max_bytes=8191 bytes"
    )


# ------------------------------------------------------------------------ OPQA (2, 3, 9, 10)


def test_an_unfitted_low_rank_guide_is_refused_and_a_fitted_one_accepted():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = regression_data(20, 3)
    guide = AutoLowRankMultivariateNormal(linear_regression, init_scale=0.2)
    guide(X, y)  # run, never fitted: its random covariance factor hides it from the weight
    with pytest.raises(ValueError) as error:
        opqa_evidence(linear_regression, X, y, center="guide", guide=guide)
    assert str(error.value).startswith(
        "opqa_evidence(center='guide'): every entry of the diagonal scale of the "
        "AutoLowRankMultivariateNormal still equals its start, init_scale / sqrt(2) with "
        "init_scale=0.2: the guide was never fitted"
    )
    svi = pyro.infer.SVI(
        linear_regression, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO()
    )
    for _ in range(300):
        svi.step(X, y)
    result = opqa_evidence(linear_regression, X, y, num_points=8, center="guide", guide=guide)
    # 300 noisy Adam steps leave the weight a little off the posterior; the unfitted guide's
    # evidence was 15 nats off
    assert result.log_evidence == pytest.approx(linear_regression_posterior(X, y)[2], abs=0.1)


def test_the_posterior_density_is_minus_inf_outside_the_support():
    data = torch.tensor([1.0, 0, 1, 1, 0, 1, 1], dtype=F64)
    a, b, _ = beta_bernoulli_posterior(data)
    posterior = opqa_evidence(beta_bernoulli, data, num_points=32).posterior
    values = torch.tensor([0.3, 1.5, -0.2, 0.7], dtype=F64)
    log_q = posterior.log_prob({"p": values})
    assert log_q[1] == log_q[2] == -math.inf
    exact = dist.Beta(torch.tensor(a, dtype=F64), torch.tensor(b, dtype=F64)).log_prob(
        values[[0, 3]]
    )
    assert torch.allclose(log_q[[0, 3]], exact, atol=1e-5)


def _scaled_regression(X, y):
    beta = pyro.sample("beta", dist.Normal(torch.zeros(3, dtype=F64), 1.5).to_event(1))
    with pyro.plate("data", X.shape[0]), poutine.scale(scale=2.0):
        pyro.sample("y", dist.Normal((X * beta).sum(-1), 0.4), obs=y)


def test_a_scaled_sample_site_is_refused_naming_it():
    X, y = regression_data(20, 3)
    with pytest.raises(ValueError) as error:
        opqa_evidence(_scaled_regression, X, y, num_points=2)
    assert str(error.value) == (
        "opqa_evidence: sample site 'y' is scaled by 2.0 (poutine.scale): the evidence is the "
        "integral of the model's unscaled joint density, and a tempered term would change it (the "
        "ArviZ export drops the scale too); remove the poutine.scale, or write the tempering into "
        "the model's distributions"
    )


def test_nan_in_the_observed_data_is_named_before_the_map_search():
    X, y = regression_data(20, 3)
    y = torch.where(torch.arange(20) == 3, math.nan, y)
    with pytest.raises(ValueError) as error:
        opqa_evidence(linear_regression, X, y, num_points=2)
    assert str(error.value) == (
        "opqa_evidence: the observed data of site 'y' hold NaN (first at index [3] of its value "
        "in the model): its log likelihood is undefined there. Drop or impute those rows before "
        "computing the evidence (and the fit)"
    )


# ------------------------------------------------------------------------ ArviZ export (11)


def _line(x, y=None):
    a = pyro.sample("a", dist.Normal(0.0, 5.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(a * x, 1.0), obs=y)


def test_dims_with_more_names_than_the_variable_are_refused_naming_the_site():
    pyro.clear_param_store()
    x = torch.linspace(-1, 1, 5)
    guide = AutoNormal(_line)
    guide(x, x)
    with pytest.raises(ValueError) as error:
        to_inference_data(_line, guide, x, x, num_samples=4, dims={"y": ["obs", "extra"]})
    assert str(error.value) == (
        "dims['y'] names 2 dims (obs, extra) but the exported 'y' has 1 after chain and draw "
        "(data); drop ['extra']"
    )
    idata = to_inference_data(_line, guide, x, x, num_samples=4, dims={"y": ["obs"]})
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "obs")
    assert idata.observed_data["y"].dims == ("obs",)


def test_numpy_and_tensor_integers_are_taken_as_dim_and_step():
    rule = make_rule("hadamard", 8)
    expected = rule.draw(3, step=2).matrix()
    assert torch.equal(rule.draw(np.int32(3), step=np.int64(2)).matrix(), expected)
    assert torch.equal(rule.draw(3, step=torch.tensor(2)).matrix(), expected)
    for step in (1.0, torch.tensor(2.0), True):
        with pytest.raises(ValueError, match="step must be >= 0"):
            rule.draw(3, step=step)


def test_a_float32_bayesian_module_gets_opqa_s_float64_advice_and_in_float64_the_exact_evidence():
    # the BayesianModule's own dtype check fired first, pointing at the prior or the guide; the
    # fix is the net in float64, where a linear layer's evidence is the Gaussian closed form
    from torch import nn

    from pyro_quadvi.nn import BayesianModule, likelihoods, priors

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, generator=generator, dtype=F64)
    y = (
        x @ torch.tensor([0.7, -1.2], dtype=F64)
        + 0.3
        + 0.4 * torch.randn(12, generator=generator, dtype=F64)
    )
    likelihood = likelihoods.Gaussian(len(x), scale=0.4)
    bnn = BayesianModule(nn.Linear(2, 1), priors.Normal(1.0), likelihood)
    with pytest.raises(
        ValueError, match=r"does not run in float64 .*net.double\(\) before wrapping"
    ):
        opqa_evidence(bnn, x.float(), y.float())
    bnn = BayesianModule(nn.Linear(2, 1).double(), priors.Normal(1.0), likelihood)
    design = torch.cat([x, torch.ones(len(x), 1, dtype=F64)], dim=1)  # (weight, bias), N(0, 1)
    covariance = design @ design.T + 0.4**2 * torch.eye(len(x), dtype=F64)
    exact = torch.distributions.MultivariateNormal(torch.zeros(len(x), dtype=F64), covariance)
    result = opqa_evidence(bnn, x, y)
    assert result.log_evidence == pytest.approx(float(exact.log_prob(y)), abs=1e-8)


# ------------------------------------------------------- masked latents (second trial, 1)

_Y = torch.tensor([0.3, -0.5, 1.2, 0.8], dtype=F64)
_OBSERVED = torch.tensor([True, False, True, True])


def _missing_y(y, mask):
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y, obs_mask=mask)


def _masked_y(y, mask):
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 1.0))
    with pyro.plate("data", len(y)), poutine.mask(mask=mask):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _gaussian_log_evidence(y):
    """``y_i = mu + e_i``, ``mu, e_i ~ N(0, 1)``: ``y ~ N(0, I + 1 1^T)``."""
    covariance = torch.eye(len(y), dtype=F64) + 1.0
    return float(dist.MultivariateNormal(torch.zeros(len(y), dtype=F64), covariance).log_prob(y))


_NO_EVIDENCE = (
    "so the evidence is not defined: a log density of 0 is Lebesgue measure, not a probability, "
    "and the integral over those entries is infinite (the support's volume on a bounded one)"
)


def test_the_obs_mask_latent_is_refused_with_what_to_do_before_any_weight_is_built():
    # the trial: center="none" gave +3.1 to +5.3 nats and a fitted guide +11 to +13 growing with
    # the points; center="laplace" sent the model to center="guide"
    pyro.clear_param_store()
    guide = AutoNormal(_missing_y)
    svi = pyro.infer.SVI(_missing_y, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    for _ in range(20):
        svi.step(_Y, _OBSERVED)
    message = (
        "opqa_evidence: latent site 'y_unobserved', made by pyro.sample('y', ..., obs=..., "
        f"obs_mask=...), has its observed entries masked out: the model gives them no density, "
        f"{_NO_EVIDENCE}. Drop the missing rows from the data; or fill them with any finite "
        "value and, instead of obs_mask, observe 'y' under poutine.mask(mask=obs_mask), so the "
        "missing rows count 0"
    )
    for options in ({}, {"center": "none"}, {"center": "guide", "guide": guide}):
        with pytest.raises(ValueError) as error:
            opqa_evidence(_missing_y, _Y, _OBSERVED, num_points=2, **options)
        assert str(error.value) == message
    # a NaN in the missing row meets the same refusal, not the NaN one of 'y_observed'
    with pytest.raises(ValueError, match=r"^opqa_evidence: latent site 'y_unobserved'"):
        opqa_evidence(_missing_y, torch.where(_OBSERVED, _Y, math.nan), _OBSERVED)
    # the advice holds: the masked likelihood gives the evidence of the observed rows
    result = opqa_evidence(_masked_y, _Y, _OBSERVED, num_points=2)
    assert result.log_evidence == pytest.approx(_gaussian_log_evidence(_Y[_OBSERVED]), abs=1e-12)


def _junk_under_mask(y, mask):
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 1.0))
    with pyro.plate("junk_plate", 3), poutine.mask(mask=mask):
        pyro.sample("junk", dist.Normal(torch.zeros((), dtype=F64), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _junk_masked_distribution(y, mask):
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 1.0))
    pyro.sample("junk", dist.Normal(torch.zeros(3, dtype=F64), 1.0).mask(mask).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize("model", [_junk_under_mask, _junk_masked_distribution])
def test_a_masked_latent_is_refused_naming_it_and_a_mask_keeping_everything_is_not(model):
    for mask in (False, torch.tensor([True, False, True])):
        with pytest.raises(ValueError) as error:
            opqa_evidence(model, _Y, mask, num_points=2, center="none")
        assert str(error.value) == (
            "opqa_evidence: latent site 'junk' has masked-out entries (a False in its mask, by "
            f"poutine.mask or Distribution.mask): the model gives them no density, {_NO_EVIDENCE}. "
            "Mask only the likelihood of observed sites, and give every latent its density (or "
            "remove the latent)"
        )
    # junk ~ N(0, I) independent of the data integrates to 1: the evidence is the data's
    result = opqa_evidence(model, _Y, torch.ones(3, dtype=torch.bool), num_points=2)
    assert result.log_evidence == pytest.approx(_gaussian_log_evidence(_Y), abs=1e-12)


def test_every_row_missing_leaves_a_proper_latent_with_evidence_1():
    # obs_mask all False: 'y_unobserved' is unmasked (a proper latent), 'y_observed' counts 0
    result = opqa_evidence(_missing_y, _Y, torch.zeros(4, dtype=torch.bool), num_points=2)
    assert result.diagnostics["dim"] == 5
    assert result.log_evidence == pytest.approx(0.0, abs=1e-12)


# ------------------------------------- the posterior on the support's boundary (second trial, 2-6)


def _corr_cholesky(r, off=0.0):
    """The 2 x 2 Cholesky factor of the correlation ``r``, with ``off`` above the diagonal."""
    return [[1.0, off], [r, math.sqrt(max(1.0 - r * r, 0.0))]]


_NEAR = 1e-9  # a step inside a bound: a finite density, however small
# (support, event shape, values, whether each lies in the open image, decided by hand)
_SUPPORTS = {
    "interval(1, 4)": (
        constraints.interval(1.0, 4.0),
        (),
        [0.5, 1.0, 1.0 + _NEAR, 2.5, 4.0 - _NEAR, 4.0, 5.0, -math.inf],
        lambda v: (v > 1) & (v < 4),
    ),
    "unit_interval": (
        constraints.unit_interval,
        (),
        [-0.1, 0.0, _NEAR, 0.5, 1.0 - _NEAR, 1.0, 1.5],
        lambda v: (v > 0) & (v < 1),
    ),
    "positive": (
        constraints.positive,
        (),
        [-1.0, -0.0, 0.0, _NEAR, 3.0, math.inf],
        lambda v: (v > 0) & (v < math.inf),
    ),
    "greater_than(2)": (
        constraints.greater_than(2.0),
        (),
        [1.0, 2.0, 2.0 + _NEAR, 7.0],
        lambda v: v > 2,
    ),
    "less_than(2)": (
        constraints.less_than(2.0),
        (),
        [3.0, 2.0, 2.0 - _NEAR, -5.0],
        lambda v: v < 2,
    ),
    "simplex": (
        constraints.simplex,
        (3,),
        [
            [1.0, 0.0, 0.0],
            [0.0, 1.0, 0.0],
            [0.0, 0.0, 1.0],
            [0.5, 0.5, 0.0],
            [0.0, 0.5, 0.5],
            [0.5, 0.0, 0.5],
            [0.2, 0.3, 0.5],
            [_NEAR, 0.5, 0.5 - _NEAR],
            [0.5, 0.6, -0.1],
            [0.3, 0.3, 0.3],
        ],
        lambda v: (v > 0).all(-1) & ((v.sum(-1) - 1).abs() < 1e-6),
    ),
    "positive_ordered_vector": (
        constraints.positive_ordered_vector,
        (2,),
        [[1.0, 2.0], [0.0, 2.0], [2.0, 1.0], [1.0, 1.0], [_NEAR, 1.0]],
        lambda v: (v[..., 0] > 0) & (v[..., 1] > v[..., 0]),
    ),
    "corr_cholesky": (
        constraints.corr_cholesky,
        (2, 2),
        [
            _corr_cholesky(0.3),
            _corr_cholesky(-0.999),
            _corr_cholesky(1.0),
            _corr_cholesky(-1.0),
            _corr_cholesky(0.3, off=0.1),
            [[1.0, 0.0], [0.5, 0.5]],
        ],
        lambda v: (
            (v.triu(1) == 0).all((-1, -2))
            & (v.diagonal(dim1=-2, dim2=-1) > 0).all(-1)
            & ((v.square().sum(-1) - 1).abs() < 1e-12).all(-1)
        ),
    ),
    "stack([positive, interval(1, 4)])": (
        constraints.stack([constraints.positive, constraints.interval(1.0, 4.0)], dim=-1),
        (2,),
        [[2.0, 2.5], [0.0, 2.5], [2.0, 1.0], [2.0, 4.0], [-1.0, 2.5], [2.0, 5.0], [_NEAR, 3.9]],
        lambda v: (v[..., 0] > 0) & (v[..., 1] > 1) & (v[..., 1] < 4),
    ),
}


@pytest.mark.parametrize("name", list(_SUPPORTS))
def test_the_density_is_minus_inf_on_and_outside_the_boundary_of_each_support(name):
    """A posterior ``q(z) = N(z; 0, I)`` built by hand, carried through ``biject_to(support)``:
    where the hand-decided open image holds a value, the density is ``N(T^-1(v)) / |J|``; on its
    boundary and outside, ``-inf`` (before: NaN at the simplex's faces, a huge finite value at
    [.5, .5, 0], -6.8e5 at the bound of an interval where the Sigmoid's inverse clamps); a NaN
    value gives NaN (before: -inf on every bounded site)."""
    support, event, values, in_image = _SUPPORTS[name]
    transform = torch.distributions.biject_to(support)
    shape = torch.Size(transform.inverse_shape(event))
    site = LatentSite(name, shape, len(shape), transform)
    dim = site.numel
    posterior = OPQAPosterior(
        [site],
        torch.zeros(dim, dtype=F64),
        torch.eye(dim, dtype=F64),
        torch.ones((1,) * dim, dtype=F64),
    )
    v = torch.tensor(values, dtype=F64)
    nan = torch.full_like(v[:1], math.nan)
    got = posterior.log_prob(torch.cat([v, nan]))
    inside = in_image(v)
    assert 0 < int(inside.sum()) < len(v)
    assert torch.isnan(got[-1])
    assert torch.equal(got[:-1][~inside], torch.full_like(got[:-1][~inside], -math.inf))
    z = transform.inv(v[inside])
    ladj = transform.log_abs_det_jacobian(z, v[inside]).reshape(len(z), -1).sum(-1)
    exact = dist.Normal(0.0, 1.0).log_prob(z).reshape(len(z), -1).sum(-1) - ladj
    assert torch.isfinite(exact).all()
    assert torch.allclose(got[:-1][inside], exact, rtol=1e-12, atol=0.0)


def test_tanh_s_bounds_are_outside_its_image():
    # the inverse, atanh, is infinite at the bounds; no support's biject_to uses a Tanh
    values = torch.tensor([-1.5, -1.0, -0.999, 0.0, 0.999, 1.0], dtype=F64)
    inside = _in_image(torch.distributions.transforms.TanhTransform(), values, torch.Size([6]))
    assert inside.tolist() == [False, False, True, True, True, False]


_COUNTS = torch.tensor([0, 1, 1, 2, 0, 1, 1, 0, 2, 1])
_ALPHA = torch.tensor([1.5, 2.0, 0.8], dtype=F64)


def _dirichlet_categorical(y):
    p = pyro.sample("p", dist.Dirichlet(_ALPHA))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Categorical(p), obs=y)


def test_the_dirichlet_posterior_is_minus_inf_at_the_vertices_and_faces_and_exact_inside():
    posterior = opqa_evidence(_dirichlet_categorical, _COUNTS, num_points=16).posterior
    boundary = torch.tensor(
        [[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [0.5, 0.5, 0], [0, 0.5, 0.5], [0.5, 0, 0.5]],
        dtype=F64,
    )
    got = posterior.log_prob(boundary)
    assert torch.equal(got, torch.full((6,), -math.inf, dtype=F64))
    inside = torch.tensor([[0.3, 0.5, 0.2], [0.25, 0.45, 0.3], [0.35, 0.4, 0.25]], dtype=F64)
    exact = dist.Dirichlet(_ALPHA + torch.bincount(_COUNTS, minlength=3)).log_prob(inside)
    assert torch.allclose(posterior.log_prob(inside), exact, atol=2e-4, rtol=0.0)


def _uniform_location(y):
    mu = pyro.sample("mu", dist.Uniform(torch.tensor(1.0, dtype=F64), 4.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_the_bound_of_a_uniform_prior_has_density_0_and_numbers_are_taken_as_values():
    # the trial's Uniform(1, 4) gave -676900 at exactly 1.0 (the Sigmoid's clamp), now the
    # density's limit; a float, a list and a NumPy array are values like a tensor
    posterior = opqa_evidence(_uniform_location, _Y + 2.0, num_points=16).posterior
    bounds = posterior.log_prob(torch.tensor([1.0, 4.0, math.nan], dtype=F64))
    assert bounds[:2].tolist() == [-math.inf, -math.inf] and math.isnan(bounds[2])
    at = torch.tensor(2.45, dtype=F64)  # the posterior's mean: N(2.45, 1/4) truncated to (1, 4)
    normal = dist.Normal(at, 0.5)
    mass = normal.cdf(torch.tensor(4.0, dtype=F64)) - normal.cdf(torch.tensor(1.0, dtype=F64))
    exact = float(normal.log_prob(at) - mass.log())
    assert float(posterior.log_prob(at)) == pytest.approx(exact, abs=3e-3)  # 16 points: 1.8e-3
    for value in (2.45, [2.45], np.array(2.45), {"mu": 2.45}):
        expected = posterior.log_prob(torch.as_tensor(2.45, dtype=F64).reshape(np.shape(value)))
        assert torch.equal(posterior.log_prob(value), expected)
    with pytest.raises(ValueError) as error:
        posterior.log_prob("2.45")
    assert str(error.value).startswith(
        "log_prob: the value of site 'mu' must be a tensor, a number or an array-like that "
        "torch.as_tensor takes, got str ("
    )
