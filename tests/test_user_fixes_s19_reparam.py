"""Session 19 fixes around Pyro's reparameterizers (`poutine.reparam`), from a user trial:

- the ArviZ export took the site a reparameterizer leaves behind (``theta`` under
  ``LocScaleReparam``, marked observed by Pyro) for observed data: ``posterior`` lacked it,
  ``observed_data`` held one draw of it, ``log_likelihood`` zeros, and the vectorized export
  failed with a bare ``expand`` error. It is now a deterministic site of the posterior; an
  observed site whose value changes with the draw (an unmasked ``Delta`` of ``HaarReparam``) is
  refused by name;
- QNVB's warning for a site whose loc gets no gradient (no density depends on it) said "frozen or
  detached" and "use AutoMeanFieldNormal" to a user of AutoMeanFieldNormal;
- QNVB's "nothing paired" warning did not say that an amortized guide trains with Adam;
- the recipe for centred hierarchical models (``LocScaleReparam(centered=0.0)``) reaches the
  exact non-centred mean field.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.reparam import HaarReparam, LocScaleReparam, TransformReparam
from pyro.infer.reparam.strategies import AutoReparam

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, to_inference_data
from pyro_quadvi.testing.problems import EIGHT_SCHOOLS_SIGMA, EIGHT_SCHOOLS_Y, eight_schools

Y = torch.tensor(EIGHT_SCHOOLS_Y)
SIGMA = torch.tensor(EIGHT_SCHOOLS_SIGMA)


def centred(sigma, y):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", 8):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def transformed(sigma, y):
    """Centred eight schools with ``theta`` an affine transform of a standard normal."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", 8):
        affine = dist.transforms.AffineTransform(mu, tau)
        theta = pyro.sample("theta", dist.TransformedDistribution(dist.Normal(0.0, 1.0), affine))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def _export(model, vectorize, num_samples=20):
    """The export of ``model`` with a guide run once (its values at the guide's initial point)."""
    guide = AutoMeanFieldNormal(model)
    guide(SIGMA, Y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the loop would warn
        return to_inference_data(
            model, guide, SIGMA, Y, num_samples=num_samples, vectorize=vectorize
        )


def _groups(idata) -> dict[str, list[str]]:
    return {
        group: sorted(getattr(idata, group).data_vars)
        for group in ("posterior", "observed_data", "log_likelihood", "posterior_predictive")
    }


def _assert_observes_obs_only(idata) -> None:
    """``obs`` and nothing else is data, and its log likelihood is the model's, draw by draw."""
    post = idata.posterior
    assert sorted(idata.observed_data.data_vars) == ["obs"]
    assert sorted(idata.log_likelihood.data_vars) == ["obs"]
    assert sorted(idata.posterior_predictive.data_vars) == ["obs"]
    torch.testing.assert_close(torch.as_tensor(idata.observed_data["obs"].values), Y)
    theta = torch.as_tensor(post["theta"].values)
    expected = dist.Normal(theta.double(), SIGMA.double()).log_prob(Y.double())
    torch.testing.assert_close(torch.as_tensor(idata.log_likelihood["obs"].values), expected)


@pytest.mark.parametrize("vectorize", [False, None, True])
def test_a_loc_scale_reparameterized_site_is_exported_as_a_deterministic_site(
    fresh_param_store, vectorize
):
    """It was observed data (``vectorize=False``) or a bare ``expand`` error (otherwise)."""
    model = poutine.reparam(centred, config={"theta": LocScaleReparam(centered=0.0)})
    idata = _export(model, vectorize)
    post = idata.posterior
    assert sorted(post.data_vars) == ["mu", "tau", "theta", "theta_decentered"]
    assert post["theta"].dims == ("chain", "draw", "school") and post["theta"].shape == (1, 20, 8)
    # the draws vary, and each is the transform of its own draw
    assert float(post["theta"].std("draw").min()) > 0
    torch.testing.assert_close(
        torch.as_tensor(post["theta"].values),
        torch.as_tensor((post["mu"] + post["tau"] * post["theta_decentered"]).values),
    )
    _assert_observes_obs_only(idata)
    assert sorted(idata.prior.data_vars) == ["mu", "tau", "theta", "theta_decentered"]
    assert idata.posterior.attrs["vectorized"] == int(vectorize is not False)


def test_a_transform_reparameterized_site_is_exported_as_a_deterministic_site(fresh_param_store):
    model = poutine.reparam(transformed, config={"theta": TransformReparam()})
    idata = _export(model, None)
    post = idata.posterior
    assert sorted(post.data_vars) == ["mu", "tau", "theta", "theta_base"]
    torch.testing.assert_close(
        torch.as_tensor(post["theta"].values),
        torch.as_tensor((post["mu"] + post["tau"] * post["theta_base"]).values),
    )
    _assert_observes_obs_only(idata)
    assert idata.posterior.attrs["vectorized"] == 1


@pytest.mark.parametrize("vectorize", [False, None])
def test_auto_reparam_keeps_mu_in_the_posterior(fresh_param_store, vectorize):
    """`AutoReparam` decentres ``mu`` too: it had gone from the posterior into the data."""
    model = poutine.reparam(centred, config=AutoReparam(centered=0.0))
    idata = _export(model, vectorize)
    post = idata.posterior
    assert {"mu", "mu_decentered", "theta", "theta_decentered"} <= set(post.data_vars)
    # mu ~ N(0, 5): mu = 5 mu_decentered
    torch.testing.assert_close(
        torch.as_tensor(post["mu"].values), torch.as_tensor(5 * post["mu_decentered"].values)
    )
    _assert_observes_obs_only(idata)


def test_an_observed_delta_the_model_writes_stays_observed_data(fresh_param_store):
    """A user's ``pyro.sample("d", Delta(v), obs=data)`` has a density: it is data (the mark of
    a reparameterized site is its masked-off density, not the Delta)."""
    one = torch.tensor(1.0)

    def model(sigma, y):
        centred(sigma, y)
        pyro.sample("d", dist.Delta(torch.tensor(1.0)), obs=one)

    idata = _export(model, None)
    assert _groups(idata) == {
        "posterior": ["mu", "tau", "theta"],
        "observed_data": ["d", "obs"],
        "log_likelihood": ["d", "obs"],
        "posterior_predictive": ["d", "obs"],
    }
    assert idata.observed_data["d"].values == 1
    assert (idata.log_likelihood["d"].values == 0).all()


def _vector(y):
    x = pyro.sample("x", dist.Normal(torch.zeros(4), 1.0).to_event(1))
    pyro.sample("obs", dist.Normal(x, 1.0).to_event(1), obs=y)


@pytest.mark.parametrize("vectorize", [False, None])
def test_an_observed_site_whose_value_changes_with_the_draw_is_refused_by_name(
    fresh_param_store, vectorize
):
    """`HaarReparam` leaves an unmasked ``Delta`` at the transformed value, marked observed: its
    value was exported as data (one draw of it) or failed with a bare ``expand`` error."""
    y = torch.tensor([1.0, 2.0, 0.5, -1.0])
    reparameterized = poutine.reparam(_vector, config={"x": HaarReparam()})
    guide = AutoMeanFieldNormal(reparameterized)
    guide(y)
    with pytest.raises(ValueError) as caught:
        to_inference_data(reparameterized, guide, y, num_samples=5, vectorize=vectorize)
    message = str(caught.value)
    assert message.startswith(
        "to_inference_data: site 'x' is observed, but its value changes from one posterior "
        "draw to the next: the model computes it from the latents, so it is no data."
    )
    assert "HaarReparam" in message and "pyro.deterministic('x', value)" in message


def test_one_looped_draw_of_a_site_computed_from_the_latents_is_refused_too(fresh_param_store):
    """The looped check compares the draws' observed values with each other: one draw passed, and
    `HaarReparam`'s ``x`` was exported as observed data with a log likelihood."""
    y = torch.tensor([1.0, 2.0, 0.5, -1.0])
    reparameterized = poutine.reparam(_vector, config={"x": HaarReparam()})
    guide = AutoMeanFieldNormal(reparameterized)
    guide(y)
    with pytest.raises(ValueError, match=r"^to_inference_data: site 'x' is observed, but its"):
        to_inference_data(reparameterized, guide, y, num_samples=1, vectorize=False)


def test_the_check_of_one_looped_draw_changes_neither_the_export_nor_the_random_state(
    fresh_param_store,
):
    """The extra run that checks one looped draw draws from a forked random state: the groups and
    the random state after the export are those of the batched one-draw export, bit for bit."""
    y = torch.tensor([1.0, 2.0, 0.5, -1.0])
    guide = AutoMeanFieldNormal(_vector)
    guide(y)
    exports = {}
    for vectorize in (True, False):
        pyro.set_rng_seed(1)
        idata = to_inference_data(_vector, guide, y, num_samples=1, vectorize=vectorize, prior=True)
        exports[vectorize] = idata, torch.get_rng_state()
    (batched, batched_state), (looped, looped_state) = exports[True], exports[False]
    assert looped.posterior.attrs["vectorized"] == 0
    for group in ("posterior", "log_likelihood", "posterior_predictive", "prior"):
        for name, values in getattr(batched, group).data_vars.items():
            assert (getattr(looped, group)[name].values == values.values).all(), (group, name)
    assert (looped.observed_data["obs"].values == y.numpy()).all()
    assert torch.equal(looped_state, batched_state)


def test_nan_data_of_a_masked_off_observation_are_the_same_data_in_every_draw(fresh_param_store):
    """The check that the data do not change between looped draws read NaN as a change: a
    ``Normal(...).mask(False)`` observation with a NaN entry (its density never reads it) was
    refused as computed from the latents."""
    y = torch.tensor([1.0, float("nan"), 0.5])

    def model(y):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("n", 3):
            pyro.sample("y", dist.Normal(z, 1.0).mask(False), obs=y)

    guide = AutoMeanFieldNormal(model)
    guide(y)
    idata = to_inference_data(model, guide, y, num_samples=5, vectorize=False)
    torch.testing.assert_close(torch.as_tensor(idata.observed_data["y"].values), y, equal_nan=True)
    assert (idata.log_likelihood["y"].values == 0).all()


# ------------------------------------------------------------------------- QNVB's warnings
def _warnings_of_steps(model, guide, elbo, *args, steps: int = 2) -> list[str]:
    svi = SVI(model, guide, QNVB(), elbo)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step(*args)
    return [str(w.message) for w in caught]


def test_a_site_no_density_depends_on_is_named_as_such_not_as_frozen(fresh_param_store):
    """Under ``poutine.mask(model, False)`` the loc gets no gradient and the scale only the
    entropy's. The warnings said "is the other frozen or detached?" and "Use
    AutoMeanFieldNormal", to a user of AutoMeanFieldNormal."""
    x, y = torch.randn(20, 2), torch.randn(20)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("n", 20):
            pyro.sample("y", dist.Normal((w * x).sum(-1), 0.5), obs=y)

    masked = poutine.mask(model, mask=False)
    messages = _warnings_of_steps(masked, AutoMeanFieldNormal(masked), QuadratureELBO(), x, y)
    assert messages == [
        "QNVB: site 'w' has a gradient on its scale only, none on its loc: no log density of the "
        "model depends on the site (its prior and every term that reads it are masked out, by "
        "poutine.mask or .mask(False), or left out of the loss), so only the guide's entropy "
        "reads it. Its posterior is improper, the prior being missing, and the fallback "
        "optimizer, which both go to, widens its scale without end: leave the site's prior "
        "unmasked, or drop the site from the model and the guide"
    ]


def test_the_nothing_paired_warning_says_an_amortized_guide_trains_with_adam(fresh_param_store):
    data = torch.randn(10, 3)
    decoder, encoder = torch.nn.Linear(2, 3), torch.nn.Linear(3, 4)

    def model(data):
        pyro.module("decoder", decoder)
        with pyro.plate("data", 10):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            pyro.sample("x", dist.Normal(decoder(z), 1.0).to_event(1), obs=data)

    def guide(data):
        pyro.module("encoder", encoder)
        out = encoder(data)
        with pyro.plate("data", 10):
            pyro.sample("z", dist.Normal(out[:, :2], out[:, 2:].exp()).to_event(1))

    (message,) = _warnings_of_steps(model, guide, Trace_ELBO(), data, steps=1)
    assert message.startswith("QNVB: none of the 4 parameters it received belongs to a guide")
    assert (
        "An amortized guide (an encoder network: its locs and scales are the network's outputs, "
        "not parameters of a site) has no block QNVB can update: it trains with "
        "pyro.optim.Adam, so pass that to SVI (the fallback optimizer does its work now)."
    ) in message


# ------------------------------------------------------------------ the recipe of the docs
def _mean_field(guide: AutoMeanFieldNormal, noise: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The guide's locs and scales laid out as the exact problem's: mu, log tau, the noise."""
    names = ("mu", "tau", noise)
    loc = torch.cat([getattr(guide.locs, n).detach().reshape(-1) for n in names])
    scale = torch.cat([getattr(guide.scales, n).detach().reshape(-1) for n in names])
    return loc, scale


def _fit(model, noise: str, steps: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    for _ in range(steps):
        svi.step(SIGMA, Y)
    return _mean_field(guide, noise)


def test_a_decentred_eight_schools_reaches_the_exact_non_centred_mean_field(fresh_param_store):
    """Centred eight schools stalls under QNVB (docs/qnvb.md, Limitations): after 100 steps mu
    is at 0.21 +- 0.19 against the exact mean field's 4.53 +- 3.16. Under
    ``LocScaleReparam(centered=0.0)`` it is the non-centred model, whose mean field
    `eight_schools` knows exactly: the error is 0.07 to 0.095 from step 25 to 300 with the
    default rule (blocked_simplex), most of it log tau's scale, 9% wide (the rule's bias; the
    means wander within 0.04 to 0.095 sd). `TransformReparam` gives the same fit bit for bit."""
    problem = eight_schools()
    _, stalled = _fit(centred, "theta")
    assert stalled[0] < 0.1 * problem.sigma[0]  # mu's scale
    decentred = _fit(
        poutine.reparam(centred, config={"theta": LocScaleReparam(centered=0.0)}),
        "theta_decentered",
    )
    assert problem.error(*decentred) < 0.12
    transform = _fit(
        poutine.reparam(transformed, config={"theta": TransformReparam()}), "theta_base"
    )
    assert all(torch.equal(a, b) for a, b in zip(decentred, transform))
