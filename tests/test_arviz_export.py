"""ArviZ export: groups, shapes, dims, and every number against an independent computation."""

from __future__ import annotations

import math
import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_quadvi import to_inference_data
from pyro_quadvi.guides import AutoMeanFieldNormal

S = 200  # draws

Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]


@pytest.fixture(scope="module", autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def eight_schools(sigma, y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", 8):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def fit(model, guide, *args, steps, lr=0.05):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return guide


@pytest.fixture(scope="module")
def schools():
    """Eight schools fitted with AutoNormal, exported with S draws."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y, sigma = torch.tensor(Y), torch.tensor(SIGMA)
    guide = fit(eight_schools, AutoNormal(eight_schools), sigma, y, steps=300)
    idata = to_inference_data(eight_schools, guide, sigma, y, num_samples=S)
    locs = {name: pyro.param(f"AutoNormal.locs.{name}").detach() for name in ("mu", "tau")}
    scales = {name: pyro.param(f"AutoNormal.scales.{name}").detach() for name in ("mu", "tau")}
    return idata, y, sigma, locs, scales


def standard_normal_check(z: torch.Tensor):
    """Mean 0 and standard deviation 1 within four standard errors."""
    n = z.numel()
    assert abs(z.mean().item()) < 4 / math.sqrt(n)
    assert abs(z.std().item() - 1) < 4 / math.sqrt(2 * n)


def test_eight_schools_groups_shapes_and_dims(schools):
    idata, y, *_ = schools
    assert set(idata.groups()) == {
        "posterior",
        "posterior_predictive",
        "log_likelihood",
        "observed_data",
        "prior",
        "prior_predictive",
    }
    assert idata.posterior.attrs["vectorized"] == 1  # one batched pass
    for group, name in [
        ("posterior", "theta"),
        ("posterior_predictive", "obs"),
        ("log_likelihood", "obs"),
        ("prior", "theta"),
        ("prior_predictive", "obs"),
    ]:
        array = idata[group][name]
        assert array.shape == (1, S, 8)
        assert array.dims == ("chain", "draw", "school")
    # sites outside the plate lose the singleton dim a batched pass gives them
    assert idata.posterior["mu"].shape == (1, S)
    assert idata.prior["tau"].dims == ("chain", "draw")
    np.testing.assert_array_equal(idata.posterior["school"].values, np.arange(8))
    np.testing.assert_array_equal(idata.observed_data["obs"].values, y.numpy())
    assert idata.observed_data["obs"].dims == ("school",)


def test_log_likelihood_is_the_density_of_each_posterior_draw(schools):
    idata, y, sigma, *_ = schools
    theta = torch.tensor(idata.posterior["theta"].values[0])  # (S, 8)
    expected = dist.Normal(theta, sigma).log_prob(y)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected.numpy(), rtol=1e-12)


def test_posterior_draws_come_from_the_fitted_guide(schools):
    idata, _, _, locs, scales = schools
    mu = torch.tensor(idata.posterior["mu"].values[0])
    log_tau = torch.tensor(idata.posterior["tau"].values[0]).log()  # unconstrained
    for draws, name in [(mu, "mu"), (log_tau, "tau")]:
        assert abs(draws.mean() - locs[name]) < 4 * scales[name] / math.sqrt(S)
        assert abs(draws.std() / scales[name] - 1) < 4 / math.sqrt(2 * S)


def test_posterior_predictive_is_new_data_given_each_draw(schools):
    idata, y, sigma, *_ = schools
    y_rep = torch.tensor(idata.posterior_predictive["obs"].values[0])
    theta = torch.tensor(idata.posterior["theta"].values[0])
    assert (y_rep != y).all()
    # y_rep[s] ~ N(theta[s], sigma): paired with the same posterior draw
    standard_normal_check((y_rep - theta) / sigma)


def test_prior_and_prior_predictive(schools):
    idata, _, sigma, *_ = schools
    mu = torch.tensor(idata.prior["mu"].values[0])
    assert abs(mu.mean()) < 4 * 5 / math.sqrt(S)
    assert abs(mu.std() / 5 - 1) < 4 / math.sqrt(2 * S)
    theta = torch.tensor(idata.prior["theta"].values[0])
    tau = torch.tensor(idata.prior["tau"].values[0])
    standard_normal_check((theta - mu[:, None]) / tau[:, None])
    y_rep = torch.tensor(idata.prior_predictive["obs"].values[0])
    standard_normal_check((y_rep - theta) / sigma)


def test_loo_and_summary_run_on_the_export(schools):
    idata, *_ = schools
    loo = az.loo(idata, pointwise=True)
    ll = torch.tensor(idata.log_likelihood["obs"].values[0])
    lppd = (ll.logsumexp(0) - math.log(S)).sum().item()  # log pointwise predictive density
    assert math.isfinite(loo.elpd_loo) and 0 < loo.p_loo < 8
    assert loo.elpd_loo + loo.p_loo == pytest.approx(lppd, abs=1e-8)
    assert loo.n_data_points == 8
    summary = az.summary(idata, var_names=["mu", "tau", "theta"], round_to="none")
    assert len(summary) == 10
    columns = ["mean", "sd", "hdi_3%", "hdi_97%", "ess_bulk", "ess_tail"]
    assert np.isfinite(summary[columns].to_numpy()).all()
    assert summary.loc["mu", "mean"] == pytest.approx(idata.posterior["mu"].values.mean())


class Regression(PyroModule):
    """A Bayesian nn.Linear: its weight cannot take a batch of draws, so the export loops."""

    def __init__(self):
        super().__init__()
        self.fc = PyroModule[nn.Linear](2, 1)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 2]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        mean = self.fc(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)


def test_pyro_module_network_exports_through_the_loop():
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    x = torch.randn(30, 2)
    y = x @ torch.tensor([1.0, -2.0]) + 0.3 + 0.5 * torch.randn(30)
    net = Regression()
    guide = fit(net, AutoMeanFieldNormal(net), x, y, steps=150)
    idata = to_inference_data(net, guide, x, y, num_samples=60)
    assert idata.posterior.attrs["vectorized"] == 0
    assert idata.posterior["fc.weight"].dims == (
        "chain",
        "draw",
        "fc.weight_dim_0",
        "fc.weight_dim_1",
    )
    assert idata.posterior["fc.weight"].shape == (1, 60, 1, 2)
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "data")
    weight = torch.tensor(idata.posterior["fc.weight"].values[0])  # (S, 1, 2)
    bias = torch.tensor(idata.posterior["fc.bias"].values[0])  # (S, 1)
    mean = (x @ weight.transpose(-1, -2)).squeeze(-1) + bias  # (S, 30)
    np.testing.assert_allclose(
        idata.log_likelihood["obs"].values[0],
        dist.Normal(mean, 0.5).log_prob(y).numpy(),
        rtol=1e-12,
    )
    y_rep = torch.tensor(idata.posterior_predictive["obs"].values[0])
    standard_normal_check((y_rep - mean) / 0.5)
    assert idata.prior["fc.weight"].shape == (1, 60, 1, 2)
    standard_normal_check(torch.tensor(idata.prior["fc.weight"].values))


def subsampled(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
    with pyro.plate("data", 50, subsample_size=12) as rows:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(z, 0.5), obs=y[rows])


def test_subsampled_plate_exports_the_full_data():
    pyro.clear_param_store()
    pyro.set_rng_seed(2)
    y = 2 + torch.randn(50)
    guide = fit(subsampled, AutoNormal(subsampled), y, steps=50)
    idata = to_inference_data(subsampled, guide, y, num_samples=S)
    assert idata.posterior["z"].shape == (1, S, 50)
    assert idata.log_likelihood["obs"].shape == (1, S, 50)
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "data")
    np.testing.assert_array_equal(idata.posterior["data"].values, np.arange(50))
    np.testing.assert_array_equal(idata.observed_data["obs"].values, y.numpy())
    z = torch.tensor(idata.posterior["z"].values[0])
    # unscaled: the minibatch factor 50/12 would multiply a scaled log density
    expected = dist.Normal(z, 0.5).log_prob(y)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected.numpy(), rtol=1e-12)
    # row i of z is drawn from row i of the guide's parameters, for all 50 rows
    loc = pyro.param("AutoNormal.locs.z").detach()
    scale = pyro.param("AutoNormal.scales.z").detach()
    standard_normal_check((z - loc) / scale)
    assert ((z.mean(0) - loc).abs() < 4.5 * scale / math.sqrt(S)).all()
    # the global latent is one draw shared by all chunks: the prior z rows scatter around it
    prior_mu = torch.tensor(idata.prior["mu"].values[0])
    standard_normal_check(torch.tensor(idata.prior["z"].values[0]) - prior_mu[:, None])
    y_rep = torch.tensor(idata.posterior_predictive["obs"].values[0])
    standard_normal_check((y_rep - z) / 0.5)


def test_nested_subsampled_plates_with_a_deterministic_site():
    """Two subsampled plates (chunks overlap: 7 rows in 3s, 5 columns in 2s); the deterministic
    site and the observations are assembled from the same draws of u and v in every cell."""

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
        with pyro.plate("col", 5, subsample_size=2, dim=-1) as cols:
            v = pyro.sample("v", dist.Normal(0.0, 1.0))
            with pyro.plate("row", 7, subsample_size=3, dim=-2) as rows:
                u = pyro.sample("u", dist.Normal(mu, 1.0))
                mean = pyro.deterministic("mean", u + v)
                pyro.sample("obs", dist.Normal(mean, 0.5), obs=y[rows][:, cols])

    pyro.clear_param_store()
    pyro.set_rng_seed(7)
    y = torch.randn(7, 5)
    guide = AutoNormal(model, init_scale=0.3)
    guide(y)
    idata = to_inference_data(model, guide, y, num_samples=S)
    assert idata.posterior["u"].dims == ("chain", "draw", "row", "col")
    assert idata.posterior["u"].shape == (1, S, 7, 5)
    assert idata.posterior["v"].dims == ("chain", "draw", "col")
    u, v, mean = (torch.tensor(idata.posterior[k].values[0]) for k in ("u", "v", "mean"))
    np.testing.assert_array_equal(mean, u + v[:, None])
    expected = dist.Normal(mean, 0.5).log_prob(y)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected.numpy(), rtol=1e-12)
    np.testing.assert_array_equal(idata.observed_data["obs"].values, y.numpy())
    standard_normal_check((torch.tensor(idata.posterior_predictive["obs"].values[0]) - mean) / 0.5)
    standard_normal_check((u - pyro.param("AutoNormal.locs.u").detach()) / 0.3)
    prior_mu = torch.tensor(idata.prior["mu"].values[0])
    standard_normal_check(torch.tensor(idata.prior["u"].values[0]) - prior_mu[:, None, None])


def test_plate_indexed_by_the_callers_partial_subsample_is_refused():
    def model(y, rows):
        with pyro.plate("data", 10, subsample=rows):
            pyro.sample("obs", dist.Normal(0.0, 1.0), obs=y[rows])

    def guide(y, rows):
        pass

    with pytest.raises(ValueError, match=r"plate 'data' is given 4 of its 10 indices"):
        to_inference_data(model, guide, torch.randn(10), torch.arange(4), num_samples=5)
    idata = to_inference_data(model, guide, torch.randn(10), torch.arange(10), num_samples=5)
    assert idata.log_likelihood["obs"].shape == (1, 5, 10)


@pytest.mark.parametrize("guide_class", [AutoDiagonalNormal, AutoMultivariateNormal, AutoDelta])
def test_pyro_autoguides(guide_class):
    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    y, sigma = torch.tensor(Y), torch.tensor(SIGMA)
    guide = guide_class(eight_schools)
    guide(sigma, y)  # run once: parameters exist
    idata = to_inference_data(eight_schools, guide, sigma, y, num_samples=50, prior=False)
    assert idata.posterior.attrs["vectorized"] == 1
    assert set(idata.groups()) == {
        "posterior",
        "posterior_predictive",
        "log_likelihood",
        "observed_data",
    }
    theta = torch.tensor(idata.posterior["theta"].values[0])
    assert theta.shape == (50, 8)
    np.testing.assert_allclose(
        idata.log_likelihood["obs"].values[0],
        dist.Normal(theta, sigma).log_prob(y).numpy(),
        rtol=1e-12,
    )
    if guide_class is AutoDelta:  # a point mass: every draw is the median
        np.testing.assert_allclose(theta, guide.median(sigma, y)["theta"].expand(50, 8).detach())
    else:
        assert theta.std(0).min() > 0


def test_multivariate_observation_has_event_dims_in_the_predictive_only():
    def model(y):
        loc = pyro.sample("loc", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", 6):
            pyro.sample("obs", dist.MultivariateNormal(loc, torch.eye(3) * 0.25), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(4)
    y = torch.randn(6, 3)
    guide = AutoNormal(model)
    guide(y)
    idata = to_inference_data(model, guide, y, num_samples=40)
    assert idata.posterior_predictive["obs"].dims == ("chain", "draw", "data", "obs_dim_0")
    assert idata.posterior_predictive["obs"].shape == (1, 40, 6, 3)
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "data")
    assert idata.posterior["loc"].dims == ("chain", "draw", "loc_dim_0")
    loc = torch.tensor(idata.posterior["loc"].values[0])
    expected = dist.MultivariateNormal(loc[:, None], torch.eye(3) * 0.25).log_prob(y)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected.numpy(), rtol=1e-12)


def test_model_that_mixes_draws_when_batched_is_looped():
    """``scale.max()`` reduces over the draws of a batched run with no shape error; the
    comparison with unbatched runs catches it and the export loops."""

    def model(y):
        scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", 5):
            pyro.sample("obs", dist.Normal(0.0, scale.max()), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(5)
    y = torch.randn(5)
    guide = AutoNormal(model, init_scale=0.5)
    guide(y)
    idata = to_inference_data(model, guide, y, num_samples=30, prior=False)
    assert idata.posterior.attrs["vectorized"] == 0
    scale = torch.tensor(idata.posterior["scale"].values[0])
    expected = dist.Normal(0.0, scale[:, None]).log_prob(y)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected.numpy(), rtol=1e-12)


def test_coords_and_dims_override(schools):
    pyro.set_rng_seed(6)
    y, sigma = torch.tensor(Y), torch.tensor(SIGMA)
    names = list("ABCDEFGH")
    guide = AutoNormal(eight_schools)
    guide(sigma, y)
    idata = to_inference_data(
        eight_schools,
        guide,
        sigma,
        y,
        num_samples=10,
        coords={"school": names},
        dims={"obs": ["county"]},
    )
    assert list(idata.posterior["theta"].coords["school"].values) == names
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "county")
    assert idata.posterior_predictive["obs"].dims == ("chain", "draw", "county")
    assert idata.observed_data["obs"].dims == ("county",)
    np.testing.assert_array_equal(idata.observed_data["obs"].values, Y)
    with pytest.raises(ValueError, match=r"not sites of the model"):
        to_inference_data(eight_schools, guide, sigma, y, num_samples=10, dims={"ob": ["x"]})
    with pytest.raises(ValueError, match=r"dims\['theta'\] names 0 dims"):
        to_inference_data(eight_schools, guide, sigma, y, num_samples=10, dims={"theta": []})


def test_a_misspelt_coords_key_is_refused_naming_the_dims():
    pyro.set_rng_seed(6)
    y, sigma = torch.tensor(Y), torch.tensor(SIGMA)
    guide = AutoNormal(eight_schools)
    guide(sigma, y)
    with pytest.raises(
        ValueError, match=r"coords names \['schol'\].*the dims are \['chain', 'draw', 'school'\]"
    ):
        to_inference_data(
            eight_schools, guide, sigma, y, num_samples=10, coords={"schol": list("abcdefgh")}
        )
    # a dim renamed by dims= takes coords under its new name, and the old name is then unknown
    names = list("ABCDEFGH")
    idata = to_inference_data(
        eight_schools,
        guide,
        sigma,
        y,
        num_samples=10,
        dims={"obs": ["county"]},
        coords={"county": names},
    )
    assert list(idata.observed_data["obs"].coords["county"].values) == names
    assert list(idata.posterior["theta"].coords["school"].values) == list(range(8))
    # ArviZ's own chain and draw dims take coords too (refused by the first version of the check)
    idata = to_inference_data(
        eight_schools, guide, sigma, y, num_samples=3, coords={"chain": [7], "draw": [4, 5, 6]}
    )
    assert list(idata.posterior.coords["chain"].values) == [7]
    assert list(idata.posterior.coords["draw"].values) == [4, 5, 6]


def test_a_scalar_observation_stays_0d():
    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    pyro.set_rng_seed(7)
    y = torch.tensor(1.3)
    guide = AutoNormal(model)
    guide(y)
    idata = to_inference_data(model, guide, y, num_samples=50)
    assert idata.observed_data["obs"].dims == ()
    assert idata.observed_data["obs"].values.shape == ()
    assert idata.observed_data["obs"].item() == 1.3
    assert idata.posterior_predictive["obs"].dims == ("chain", "draw")
    assert idata.observed_data.attrs["inference_library"] == "pyro"
    mu = idata.posterior["mu"].values[0]
    expected = dist.Normal(torch.tensor(mu), 1.0).log_prob(y).numpy()
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], expected, rtol=1e-12)


def test_guide_never_run_is_refused_with_the_fix():
    pyro.clear_param_store()
    y, sigma = torch.tensor(Y), torch.tensor(SIGMA)
    with pytest.raises(RuntimeError, match=r"AutoNormal was never run.*svi\.step"):
        to_inference_data(eight_schools, AutoNormal(eight_schools), sigma, y, num_samples=5)

    def guide(sigma, y=None):
        loc = pyro.param("mu_loc", torch.tensor(0.0))
        pyro.sample("mu", dist.Normal(loc, 1.0))

    with pytest.raises(RuntimeError, match=r"'mu_loc' does not exist yet.*svi\.step"):
        to_inference_data(eight_schools, guide, sigma, y, num_samples=5)
    assert "mu_loc" not in pyro.get_param_store()  # the check does not create it


@pytest.mark.parametrize("num_samples", [0, -3, 2.5, True])
def test_bad_num_samples(num_samples):
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        to_inference_data(eight_schools, AutoNormal(eight_schools), num_samples=num_samples)


@pytest.fixture
def float32():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(old)


def test_log_likelihood_is_float64_and_loo_is_finite_for_a_float32_model(float32):
    """Pyro's eight schools in float32, as its example runs it: az.loo needs float64."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y, sigma = torch.tensor(Y), torch.tensor(SIGMA)
    guide = fit(eight_schools, AutoNormal(eight_schools), sigma, y, steps=300)
    # A wide guide for theta (as early in a fit) spreads the log likelihood over tens of nats;
    # there ArviZ's PSIS in float32 returns nan.
    pyro.get_param_store()["AutoNormal.scales.theta"] = torch.full((8,), 60.0)
    idata = to_inference_data(eight_schools, guide, sigma, y, num_samples=S, prior=False)
    assert idata.log_likelihood["obs"].dtype == np.float64
    assert idata.posterior["theta"].dtype == np.float32  # the draws keep the model's dtype
    loo = az.loo(idata, pointwise=True)
    assert math.isfinite(loo.elpd_loo)
    # by hand: the float64 log likelihood of the exported draws, through the same PSIS
    theta = torch.tensor(idata.posterior["theta"].values[0], dtype=torch.float64)
    by_hand = dist.Normal(theta, sigma.double()).log_prob(y.double()).numpy()
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[0], by_hand, rtol=1e-6)
    reference = az.loo(
        az.from_dict(
            posterior={"theta": theta.numpy()[None]}, log_likelihood={"obs": by_hand[None]}
        ),
        pointwise=True,
    )
    assert loo.elpd_loo == pytest.approx(reference.elpd_loo, abs=1e-4)
    ll = torch.tensor(by_hand)
    lppd = (ll.logsumexp(0) - math.log(S)).sum().item()
    assert loo.elpd_loo + loo.p_loo == pytest.approx(lppd, abs=1e-4)


def test_nan_in_the_data_names_the_site():
    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    pyro.clear_param_store()
    guide = AutoNormal(model)
    guide(torch.zeros(3))
    y = torch.tensor([0.1, math.nan, 0.3])
    with pytest.raises(ValueError, match=r"observed data of site 'obs' hold NaN \(first at index"):
        to_inference_data(model, guide, y, num_samples=5, prior=False)


def test_vectorize_forces_or_loops_and_a_model_error_propagates():
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    x = torch.randn(30, 2)
    y = x @ torch.tensor([1.0, -2.0]) + 0.5 * torch.randn(30)
    net = Regression()
    guide = AutoMeanFieldNormal(net)
    guide(x, y)
    with pytest.raises(RuntimeError, match=r"t\(\) expects a tensor with <= 2 dimensions"):
        to_inference_data(net, guide, x, y, num_samples=5, vectorize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idata = to_inference_data(net, guide, x, y, num_samples=5, vectorize=False)
    assert idata.posterior.attrs["vectorized"] == 0

    def checks_one_draw(y):
        scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
        if scale.numel() > 1:  # the model's own error, raised in the batched run only
            raise ValueError("this model takes one scale at a time")
        with pyro.plate("data", 5):
            pyro.sample("obs", dist.Normal(0.0, scale), obs=y)

    guide = AutoNormal(checks_one_draw)
    guide(torch.zeros(5))
    with pytest.raises(ValueError, match="one scale at a time"):
        to_inference_data(checks_one_draw, guide, torch.zeros(5), num_samples=5, prior=False)


def _shifted(x, scale=1.0):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(mu + 0.5 * x, scale), obs=2 * x)


def test_data_given_as_a_list_keeps_the_models_error_and_names_the_list():
    # as Predictive, the list reaches the model unconverted; the model's TypeError (it was bare)
    # now names the list and torch.as_tensor, its type and traceback kept
    pyro.clear_param_store()
    guide = AutoNormal(_shifted)
    guide(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError) as caught:
        to_inference_data(_shifted, guide, [1.0, 2.0], num_samples=5)
    assert str(caught.value) == (
        "can't multiply sequence by non-int of type 'float'. to_inference_data passed argument 0 "
        "([1.0, 2.0]) to the model and the guide as a Python list, as svi.step and Predictive do "
        "(none of them converts it): where the model takes a tensor, pass torch.as_tensor(...) "
        "instead"
    )
    assert caught.traceback[-1].name == "_shifted"  # raised by the model itself
    with pytest.raises(TypeError, match=r"passed x=\[1\.0, 2\.0\] to the model"):
        to_inference_data(_shifted, guide, x=[1.0, 2.0], num_samples=5)

    def converts(x):  # a model that takes a list runs, as under Predictive: nothing is refused
        _shifted(torch.as_tensor(x))

    idata = to_inference_data(converts, guide, [1.0, 2.0], num_samples=5)
    assert idata.observed_data["obs"].values.tolist() == [2.0, 4.0]


def test_a_bare_assert_on_list_data_takes_the_hint_as_its_message():
    # the hint went to a note (str(error) stayed empty; on Python 3.10, which has no
    # add_note, the hint's AttributeError replaced the model's own error)
    def asserts(x):
        if not isinstance(x, torch.Tensor):
            raise AssertionError  # what a bare `assert` raises (pytest rewrites this module's)
        _shifted(x)

    pyro.clear_param_store()
    guide = AutoNormal(_shifted)
    guide(torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError) as caught:
        to_inference_data(asserts, guide, [1.0, 2.0], num_samples=5)
    assert str(caught.value).startswith("to_inference_data passed argument 0 ([1.0, 2.0]) to ")
    assert not getattr(caught.value, "__notes__", None)


def test_guide_site_the_model_lacks_is_named():
    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    def bigger():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    pyro.clear_param_store()
    guide = AutoNormal(bigger)
    guide()
    with pytest.raises(ValueError, match=r"the guide samples a latent site 'b' that the model"):
        to_inference_data(model, guide, num_samples=5)
