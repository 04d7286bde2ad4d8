"""Session 17 fixes in the ELBO's checks and messages and the ArviZ export: NaN in masked
observations refused by name, the fallback's message for a vector latent read inside a plate,
one pointwise log likelihood from many looped observed sites, and the constructors' checks of
``max_plate_nesting``, ``model`` and the probes' tolerances."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.infer import GumbelSpikeSlabELBO, LogJoint
from pyro_quadvi.infer.batched import BatchMismatch, evaluate_batch

pytestmark = pytest.mark.usefixtures("fresh_param_store")

T = 8
MISSING = [3, 4, 6]
OBSERVED = torch.ones(T, dtype=torch.bool)
OBSERVED[MISSING] = False
Y = torch.tensor([0.3, -0.2, 0.9, 1.4, 0.8, 1.9, 1.1, 2.0])


def _filled(value: float) -> torch.Tensor:
    return torch.where(OBSERVED, Y, torch.tensor(value))


def masked_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("time", T), poutine.mask(mask=OBSERVED):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def obs_mask_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("time", T):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y, obs_mask=OBSERVED)


# ---------------------------------------------------------------- NaN under a mask (t1 D1)


@pytest.mark.parametrize("validation", [False, True])
@pytest.mark.parametrize(("model", "site"), [(masked_model, "y"), (obs_mask_model, "y_observed")])
def test_nan_under_a_mask_is_refused_naming_the_site_and_index(model, site, validation):
    # with validation off, the masked NaN gave a finite loss, NaN gradients and a QNVB warning
    # about site 'mu' (the wrong site); with validation on, Pyro's support error without the
    # index or the way out
    with pyro.validation_enabled(validation):
        svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO())
        with pytest.raises(ValueError) as error:
            svi.step(_filled(math.nan))
    assert str(error.value) == (
        f"the observed data of site {site!r} hold NaN or an infinity (first at index [3] of its "
        "value in the model): its log likelihood is undefined there. Drop or impute those rows "
        "before the fit. A masked entry (poutine.mask, obs_mask) counts 0 in the log likelihood, "
        "but NaN or an infinity there still makes the gradients NaN: fill the masked entries "
        "with any finite value (0, say)"
    )


@pytest.mark.parametrize("fill", [math.inf, -math.inf])
@pytest.mark.parametrize(("model", "site"), [(masked_model, "y"), (obs_mask_model, "y_observed")])
def test_an_infinity_under_a_mask_is_refused_as_nan_is(model, site, fill):
    # 0 * inf is NaN too: the review found QNVB holding mu at its start, warning about 'mu' only
    with pyro.validation_enabled(False):
        svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO())
        with pytest.raises(ValueError, match=rf"site {site!r} hold NaN or an infinity \(first at"):
            svi.step(_filled(fill))


def test_a_distribution_masked_off_with_nan_placeholders_is_fitted():
    # mask(False) never reads its data (Pyro's MaskedDistribution returns zeros): the review
    # found it refused; its fit is that of the other site alone, in closed form
    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("n", 3):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=torch.tensor([0.3, 0.1, 0.6]))
            pyro.sample("z", dist.Normal(mu, 1.0).mask(False), obs=torch.full((3,), math.nan))

    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
    for _ in range(5):
        svi.step()
    # posterior N(sum y / 4, 1 / 4): mean 0.25, sd 0.5
    assert guide.locs.mu.item() == pytest.approx(0.25, abs=1e-6)
    assert guide.scales.mu.item() == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("vectorize", [True, False])
def test_the_fill_that_the_message_asks_for_gives_the_masked_loss(vectorize):
    # any finite fill under the mask: the same loss and gradient, whatever the fill
    results = []
    for fill in (0.0, 1e3):
        pyro.clear_param_store()
        guide = AutoMeanFieldNormal(masked_model)
        elbo = QuadratureELBO("hadamard", vectorize=vectorize)
        with pyro.validation_enabled(False):
            loss = elbo.differentiable_loss(masked_model, guide, _filled(fill))
        loss.backward()
        results.append((loss.item(), guide.locs.mu.grad.item()))
    assert results[0] == results[1]
    assert math.isfinite(results[0][1])


def test_nan_in_a_later_minibatch_is_refused_at_that_step():
    # the data are checked on every step (one sum per observed site: the rows change per step)
    with pyro.validation_enabled(False):
        svi = SVI(masked_model, AutoMeanFieldNormal(masked_model), QNVB(), QuadratureELBO())
        svi.step(_filled(0.0))
        with pytest.raises(
            ValueError, match=r"site 'y' hold NaN or an infinity \(first at index \[3\]"
        ):
            svi.step(_filled(math.nan))


def test_adam_and_the_gumbel_elbo_are_refused_alike():
    # Adam took one NaN step and then blamed the latent's support; the other PointsELBO refuses
    def sparse_model(y):
        w = pyro.sample("w", SpikeSlab(torch.tensor(0.5), torch.tensor(2.0)))
        with pyro.plate("time", T), poutine.mask(mask=OBSERVED):
            pyro.sample("y", dist.Normal(w, 1.0), obs=y)

    with pyro.validation_enabled(False):
        svi = SVI(
            masked_model, AutoMeanFieldNormal(masked_model), Adam({"lr": 0.01}), QuadratureELBO()
        )
        with pytest.raises(
            ValueError, match=r"site 'y' hold NaN or an infinity \(first at index \[3\]"
        ):
            svi.step(_filled(math.nan))
        guide = AutoSpikeSlab(sparse_model)
        with pytest.raises(
            ValueError, match=r"site 'y' hold NaN or an infinity \(first at index \[3\]"
        ):
            GumbelSpikeSlabELBO().loss(sparse_model, guide, _filled(math.nan))


def test_a_nan_deterministic_site_is_not_taken_for_data():
    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
        pyro.deterministic("ratio", torch.log(mu - mu - 1.0))  # NaN, a value of the model's
        with pyro.plate("time", T):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pyro.validation_enabled(False):
        loss = QuadratureELBO().loss(model, AutoMeanFieldNormal(model), Y)
    assert math.isfinite(loss)


# --------------------------------------------- a vector latent read inside a plate (t1 D3)

Q, R = 0.5, 1.0
WALK = Q * torch.tril(torch.ones(T, T))


def walk_in_plate(y):
    x = pyro.sample("x", dist.MultivariateNormal(torch.zeros(T), scale_tril=WALK))
    with pyro.plate("time", T):
        pyro.sample("y", dist.Normal(x, R), obs=y)


def walk_to_event(y):
    x = pyro.sample("x", dist.MultivariateNormal(torch.zeros(T), scale_tril=WALK))
    pyro.sample("y", dist.Normal(x, R).to_event(1), obs=y)


def walk_factor(y):
    x = pyro.sample("x", dist.MultivariateNormal(torch.zeros(T), scale_tril=WALK))
    pyro.factor("y", dist.Normal(x, R).log_prob(y).sum(-1))


VECTOR_IN_PLATE = (
    "site 'y': its log density in the vectorized pass has shape (4, 4, 8), 1 dim(s) left of the "
    "quadrature points' dim -2 (left of max_plate_nesting=1 plates), so the points do not line "
    "up at one dim. Either the latent site 'x' is a vector (event shape (8,)) outside every "
    "plate, which the pass holds as (K, 1, 8): if 'y' reads its entries inside the plate of size "
    "8, as that plate's entries, write the likelihood without the plate, pyro.sample('y', "
    "Normal(x, ...).to_event(1), obs=...), or as pyro.factor('y', Normal(x, "
    "...).log_prob(data).sum(-1)): both evaluate all points in one pass; or the model adds a dim "
    "to a latent that the pass holds with batch dims (e.g. w.unsqueeze(-2) on a w of shape (K, 1, "
    "d)): broadcast from the right ((X * w).sum(-1)). Or pass vectorize=False (a loop over the "
    "points) or vectorize=None (try the pass, fall back to the loop)"
)


def test_a_vector_latent_read_inside_a_plate_is_named_with_its_two_fixes():
    # the message blamed "w.unsqueeze(-2)", which the model does not do
    guide = AutoMeanFieldNormal(walk_in_plate)
    with pytest.raises(BatchMismatch) as error:
        QuadratureELBO("hadamard", vectorize=True).loss(walk_in_plate, guide, Y)
    assert str(error.value) == VECTOR_IN_PLATE
    with pytest.warns(UserWarning) as record:
        QuadratureELBO("hadamard").loss(walk_in_plate, guide, Y)
    assert VECTOR_IN_PLATE in str(record[0].message)


@pytest.mark.parametrize("fixed", [walk_to_event, walk_factor])
def test_the_two_fixes_evaluate_in_one_pass_and_give_the_looped_loss(fixed):
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(walk_in_plate)
    guide(Y)
    with torch.no_grad():
        guide.locs.x.copy_(torch.linspace(-1.0, 1.0, T))
    looped = QuadratureELBO("hadamard", vectorize=False).loss(walk_in_plate, guide, Y)
    elbo = QuadratureELBO("hadamard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        loss = elbo.loss(fixed, guide, Y)
    assert elbo.vectorized(fixed, guide) is True
    assert loss == pytest.approx(looped, rel=1e-6)


# ------------------------------------------------ many looped observed sites and az.loo


def looped_model(y):
    x = y.new_zeros(())
    for t in pyro.markov(range(len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, Q))
        pyro.sample(f"y_{t}", dist.Normal(x, R), obs=y[t])


def test_stacked_log_likelihoods_of_looped_sites_give_one_pointwise_array_for_loo():
    az = pytest.importorskip("arviz")
    xr = pytest.importorskip("xarray")
    from pyro_quadvi import to_inference_data

    guide = AutoMeanFieldNormal(looped_model)
    guide(Y)  # (its start: the recipe needs no fit)
    idata = to_inference_data(looped_model, guide, Y, num_samples=200, prior=False)
    with pytest.raises(TypeError, match="Found several log likelihood arrays"):
        az.loo(idata)
    # the recipe of docs/arviz.md, "Many observed sites"
    names = [f"y_{t}" for t in range(T)]
    stacked = xr.concat([idata.log_likelihood[name] for name in names], dim="time")
    idata.log_likelihood["y"] = stacked.transpose("chain", "draw", "time")
    loo = az.loo(idata, var_name="y", pointwise=True)
    # by hand: log N(y_t | x_t, R) at the posterior draws of x_t
    x = np.stack([idata.posterior[f"x_{t}"].values for t in range(T)], axis=-1)
    by_hand = -0.5 * ((Y.double().numpy() - x) / R) ** 2 - math.log(R) - 0.5 * math.log(2 * math.pi)
    assert idata.log_likelihood["y"].shape == (1, 200, T)
    np.testing.assert_allclose(idata.log_likelihood["y"].values, by_hand, rtol=1e-6)
    assert loo.n_data_points == T
    assert loo.elpd_loo == pytest.approx(float(loo.loo_i.sum()), rel=1e-12)
    hand = az.loo(az.from_dict(posterior={"x": x}, log_likelihood={"y": by_hand}))
    assert loo.elpd_loo == pytest.approx(hand.elpd_loo, rel=1e-6)


# ------------------------------------------------------------- constructors' checks (t3)


@pytest.mark.parametrize("elbo", [QuadratureELBO, GumbelSpikeSlabELBO])
@pytest.mark.parametrize(
    ("value", "error", "shown"),
    [
        (None, TypeError, "got None (NoneType)"),
        ("bad", TypeError, "got 'bad' (str)"),
        (True, TypeError, "got True (bool)"),
        (math.nan, ValueError, "got nan"),
        (1e300, ValueError, "got 1e+300"),
        (2.5, ValueError, "got 2.5"),
        (-1, ValueError, "got -1"),
        (3.0, ValueError, "got 3.0; pass 3"),
    ],
)
def test_a_points_elbo_refuses_a_bad_max_plate_nesting_at_construction(elbo, value, error, shown):
    with pytest.raises(error) as raised:
        elbo(max_plate_nesting=value)
    assert str(raised.value).startswith(
        f"{elbo.__name__}: max_plate_nesting must be an int >= 0 (how many plates the model "
        "nests, e.g. 1 for one pyro.plate) or inf (found from a run of the model), "
    )
    assert str(raised.value).endswith(shown)


@pytest.mark.parametrize("value", [0, 2, np.int64(1), math.inf])
def test_a_points_elbo_takes_an_int_or_inf(value):
    assert QuadratureELBO(max_plate_nesting=value).max_plate_nesting == value


@pytest.mark.parametrize(
    ("value", "error"), [("bad", TypeError), (2.5, ValueError), (math.inf, ValueError)]
)
def test_log_joint_refuses_a_bad_max_plate_nesting_at_construction(value, error):
    with pytest.raises(
        error, match=r"^LogJoint: max_plate_nesting must be an int >= 0 .* or None "
    ):
        LogJoint(masked_model, [], max_plate_nesting=value)


def test_log_joint_refuses_a_model_that_is_not_callable():
    with pytest.raises(
        TypeError, match=r"^LogJoint: model must be a callable Pyro model, got None"
    ):
        LogJoint(None, [])


@pytest.mark.parametrize("name", ["rtol", "atol"])
@pytest.mark.parametrize(
    ("value", "error"),
    [(math.nan, ValueError), (-1.0, ValueError), (math.inf, ValueError), ("bad", TypeError)],
)
def test_evaluate_batch_refuses_a_tolerance_that_fails_every_comparison(name, value, error):
    # NaN or -1 gave "the model gives other values at the same point when run twice (point 0: 0,
    # then 0)", a deterministic model called random
    points = torch.zeros(3, 2)

    def single(point):
        return point.sum()

    with pytest.raises(error, match=rf"^evaluate_batch: {name} must be None .* got"):
        evaluate_batch(lambda p: p.sum(-1), single, points, None, **{name: value})
    values, decision = evaluate_batch(lambda p: p.sum(-1), single, points, None, **{name: 0.0})
    assert decision.vectorized and values.tolist() == [0.0, 0.0, 0.0]
