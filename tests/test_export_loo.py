"""LOO over observed sites in plates of different sizes: docs/arviz.md's recipe (the block
``arviz-loo-plates``) concatenates the sites' log likelihoods along one observation dim, and
``az.loo`` of that array is the sum of the pointwise PSIS-LOO values computed by hand."""

from __future__ import annotations

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import xarray as xr
from pyro.infer import SVI
from scipy.special import logsumexp

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, to_inference_data


def two_sites(xa, ya, xb, yb):
    mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    with pyro.plate("groupA", len(ya)):
        pyro.sample("ya", dist.Normal(mu + xa, s), obs=ya)
    with pyro.plate("groupB", len(yb)):
        pyro.sample("yb", dist.Normal(mu - xb, 2 * s), obs=yb)


@pytest.fixture
def idata():
    generator = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(25, generator=generator), torch.randn(10, generator=generator)
    ya = 1 + xa + 0.3 * torch.randn(25, generator=generator)
    yb = 1 - xb + 0.6 * torch.randn(10, generator=generator)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(two_sites)
    svi = SVI(two_sites, guide, QNVB(), QuadratureELBO())
    for _ in range(100):
        svi.step(xa, ya, xb, yb)
    yield to_inference_data(two_sites, guide, xa, ya, xb, yb, num_samples=500, prior=False)
    pyro.clear_param_store()


def by_hand(log_lik: np.ndarray) -> np.ndarray:
    """Pointwise PSIS-LOO of a ``(draws, observations)`` array: ``log sum_s w_is p(y_i |
    theta_s)`` with the Pareto-smoothed, normalized weights ``w_is`` of ``1 / p(y_i | theta_s)``
    (one chain: relative efficiency 1, as ``az.loo`` takes it)."""
    log_weights, _ = az.psislw(-log_lik.T)
    return logsumexp(log_lik.T + log_weights, axis=-1)


def test_loo_over_sites_in_plates_of_different_sizes(idata):
    with pytest.raises(TypeError, match="Found several log likelihood arrays"):
        az.loo(idata)
    log_lik = idata.log_likelihood
    sites = {"ya": "groupA", "yb": "groupB"}  # the recipe of docs/arviz.md
    rows = [log_lik[site].rename({dim: "obs"}).drop_vars("obs") for site, dim in sites.items()]
    log_lik["y"] = xr.concat(rows, dim="obs")
    loo = az.loo(idata, var_name="y", pointwise=True)

    combined = log_lik["y"].values[0]
    assert log_lik["y"].dims == ("chain", "draw", "obs") and combined.shape == (500, 35)
    np.testing.assert_array_equal(combined[:, :25], log_lik["ya"].values[0])
    np.testing.assert_array_equal(combined[:, 25:], log_lik["yb"].values[0])
    pointwise = by_hand(combined)
    assert loo.n_data_points == 35
    np.testing.assert_allclose(loo.loo_i.values, pointwise, rtol=1e-12, atol=1e-12)
    assert loo.elpd_loo == pytest.approx(pointwise.sum(), abs=1e-10)
    assert loo.se == pytest.approx((35 * pointwise.var()) ** 0.5, rel=1e-10)
    each = [az.loo(idata, var_name=site).elpd_loo for site in sites]
    assert loo.elpd_loo == pytest.approx(sum(each), abs=1e-10)
