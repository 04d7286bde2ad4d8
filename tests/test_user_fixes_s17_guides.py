"""Guides the session 17 trial found wanting: a guide's site hidden by ``poutine.block``, Pyro's
``AutoNormalMessenger`` (now read), and the refusals of the guides that are not read."""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.contrib.easyguide import easy_guide
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import (
    AutoDiagonalNormal,
    AutoGaussian,
    AutoHierarchicalNormalMessenger,
    AutoIAFNormal,
    AutoLaplaceApproximation,
    AutoNormal,
    AutoNormalizingFlow,
    AutoNormalMessenger,
    AutoRegressiveMessenger,
    init_to_feasible,
)
from pyro.nn import AutoRegressiveNN

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.guides import describe_guide, register_guide
from pyro_quadvi.guides.interface import is_describable, trace_for_description
from pyro_quadvi.testing.problems import linear_regression

pytestmark = pytest.mark.usefixtures("float64_store")


Y = torch.tensor(2.0, dtype=torch.float64)


def ab_model():
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(a, 1.0))
    pyro.sample("y", dist.Normal(b, 1.0), obs=Y)


def spike_model():
    a = pyro.sample("a", SpikeSlab(torch.tensor(0.5, dtype=torch.float64)))
    pyro.sample("y", dist.Normal(a, 1.0), obs=Y)


def _fit(model, guide, steps: int = 3) -> None:
    svi = SVI(model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
    for _ in range(steps):
        svi.step()


# ------------------------------------------------------------------ a site hidden from the guide
@pytest.mark.parametrize(
    "guide_class", [AutoMeanFieldNormal, AutoNormal, AutoDiagonalNormal, AutoNormalMessenger]
)
def test_a_model_site_hidden_from_the_guide_is_refused_not_fitted(guide_class):
    # before: QuadratureELBO read 'a' from the guide itself and fitted it to its posterior
    # (0.667, 0.707), as if nothing were hidden; Trace_ELBO draws it from the prior instead
    guide = guide_class(ab_model)
    with pytest.raises(ValueError) as error:
        _fit(ab_model, poutine.block(guide, hide=["a"]))
    message = str(error.value)
    assert message.startswith(
        "the trace of the guide's run lacks 'a': a poutine.block around the guide hid it, or "
        "the guide's run never samples it (a guide's quadrature_description describes sites its "
        "run samples)."
    )
    assert "it would fit 'a' all the same" in message
    assert "pyro.condition(model, data={...}), and build the guide from that model" in message
    way_out = "build the guide on poutine.block(model, hide=['a']) (or use an AutoGuideList)"
    assert way_out in message


@pytest.mark.parametrize(
    "guide_class, model, draw, sites",
    [
        (AutoMeanFieldNormal, ab_model, "a_unconstrained", "'a'"),
        (AutoNormal, ab_model, "a_unconstrained", "'a'"),
        (AutoSpikeSlab, spike_model, "a_unconstrained", "'a'"),
        (AutoDiagonalNormal, ab_model, "_AutoDiagonalNormal_latent", "'a', 'b'"),
    ],
)
def test_a_hidden_draw_of_the_guide_is_named_not_a_key_error(guide_class, model, draw, sites):
    # before: a bare KeyError with the draw's name
    guide = guide_class(model)
    with pytest.raises(ValueError) as error:
        _fit(model, poutine.block(guide, hide=[draw]))
    message = str(error.value)
    assert message.startswith(
        f"the trace of the guide's run lacks {draw!r} (its draw of {sites}): a poutine.block "
        "around the guide hid it, or the guide's run never samples it"
    )
    assert f"poutine.block(model, hide=[{sites}])" in message


def test_the_way_out_a_guide_of_the_conditioned_model_fits_the_rest_exactly():
    # the message's first way out: b | y, a = 1 is N(1.5, 1/2), which Gauss-Hermite and QNVB
    # reach in a step (a Gaussian model: the fixed point is exact)
    conditioned = pyro.condition(ab_model, data={"a": torch.tensor(1.0, dtype=torch.float64)})
    guide = AutoMeanFieldNormal(conditioned)
    _fit(conditioned, guide)
    assert guide.locs.b.item() == pytest.approx(1.5, abs=1e-12)
    assert guide.scales.b.item() == pytest.approx(0.5**0.5, abs=1e-12)


# -------------------------------------------------------------------------- AutoNormalMessenger
def _mean_field_parameters() -> dict[str, torch.Tensor]:
    """The param store's locs and scales, by their names without the guide's prefix
    (``AutoNormal.locs.b`` and an ``AutoNormalMessenger``'s ``locs.b`` are both ``locs.b``)."""
    store = pyro.get_param_store()
    return {
        name.removeprefix("AutoNormal."): value.detach().clone()
        for name, value in store.items()
        if name.removeprefix("AutoNormal.").startswith(("locs.", "scales."))
    }


def _fit_both(model, steps: int, elbo, set_up: bool = False) -> list[dict[str, torch.Tensor]]:
    """The mean field that ``steps`` QNVB steps under ``elbo`` reach with ``AutoNormalMessenger``
    and with ``AutoNormal``, both from zero locs (``init_to_feasible``); ``set_up``: each guide
    runs once first, then the seed is set, so both fits draw the same random numbers."""
    fits = []
    for guide_class in (AutoNormalMessenger, AutoNormal):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = guide_class(model, init_loc_fn=init_to_feasible)
        if set_up:
            guide()
            pyro.set_rng_seed(0)
        if guide_class is AutoNormalMessenger:
            register_guide(guide)  # (QuadratureELBO needs no registration; Trace_ELBO does)
        svi = SVI(model, guide, QNVB(), elbo)
        for _ in range(steps):
            svi.step()
        fits.append(_mean_field_parameters())
    return fits


def _assert_same_to_rounding(fits: list[dict[str, torch.Tensor]]) -> None:
    messenger, auto_normal = fits
    assert messenger.keys() == auto_normal.keys()
    for name, value in messenger.items():
        torch.testing.assert_close(value, auto_normal[name], rtol=1e-13, atol=1e-14)


def test_auto_normal_messenger_reaches_the_exact_mean_field_as_auto_normal_does():
    problem, _, _ = linear_regression(3, 0.5, seed=5)
    fits = _fit_both(problem.model, 40, QuadratureELBO("gauss_hermite"))
    _assert_same_to_rounding(fits)  # (they differ by one rounding, 6e-17)
    loc, scale = fits[0]["locs.b"], fits[0]["scales.b"]
    assert problem.error(loc, scale) < 1e-7  # the closed-form optimum (5.6e-8 after 40 steps)


COUNTS = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0], dtype=torch.float64)
SPREAD = torch.tensor([0.4, -1.1, 0.7, 0.2], dtype=torch.float64)


def constrained_model():
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    noise = pyro.sample("noise", dist.LogNormal(0.0, 0.5))
    with pyro.plate("counts", len(COUNTS)):
        pyro.sample("k", dist.Poisson(rate), obs=COUNTS)
    with pyro.plate("spread", len(SPREAD)):
        pyro.sample("v", dist.Normal(0.0, noise), obs=SPREAD)


def test_auto_normal_messenger_fits_constrained_sites_as_auto_normal_does():
    # a Gamma and a LogNormal site: the nodes pushed through exp, the Jacobian in the loss; the
    # guide's scale an exp (AutoNormal's a softplus), which QNVB reads from its constraint
    fits = _fit_both(constrained_model, 30, QuadratureELBO("gauss_hermite"))
    _assert_same_to_rounding(fits)
    assert fits[0]["locs.rate"].item() == pytest.approx(0.9496, abs=1e-4)  # the trial's fit


DATA = torch.linspace(-1.0, 2.0, 8, dtype=torch.float64)


def local_model():
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(DATA), subsample_size=4) as rows:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=DATA[rows])


def test_auto_normal_messenger_reads_the_rows_and_scale_of_a_subsampled_plate():
    fits = _fit_both(local_model, 10, QuadratureELBO("gauss_hermite"), set_up=True)
    _assert_same_to_rounding(fits)  # the same minibatches: the same updates of the same rows
    guide = AutoNormalMessenger(local_model)
    elbo = QuadratureELBO("gauss_hermite")
    elbo.loss(local_model, guide)  # sets the guide up
    trace = trace_for_description(guide)
    z = describe_guide(guide, trace).sites[1]
    rows = trace.nodes["data"]["value"]
    assert z.name == "z" and torch.equal(z.rows[-1], rows) and z.scale_factor == 2.0
    assert torch.equal(z.loc, guide.locs.z_unconstrained[rows])
    # without a trace: the same rows, from the guide's own record of its last run
    assert torch.equal(describe_guide(guide).sites[1].rows[-1], rows)


def test_a_predictive_over_a_fitted_auto_normal_messenger_draws_as_over_auto_normal():
    problem, _, _ = linear_regression(3, 0.5, seed=5)
    draws = []
    for guide_class in (AutoNormalMessenger, AutoNormal):
        pyro.clear_param_store()
        guide = guide_class(problem.model, init_loc_fn=init_to_feasible)
        svi = SVI(problem.model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
        for _ in range(40):
            svi.step()
        pyro.set_rng_seed(1)
        predictive = Predictive(problem.model, guide=guide, num_samples=200, return_sites=["b"])
        draws.append(predictive()["b"])
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=1e-14)
    assert draws[0].std(0).squeeze() == pytest.approx(problem.sigma.tolist(), rel=0.15)


def test_a_fit_of_auto_normal_messenger_resumes_bit_for_bit_from_saved_states():
    problem, _, _ = linear_regression(3, 0.9, seed=4)  # far from converged after 6 steps
    elbo = QuadratureELBO("hadamard", num_points=4)

    def fit(guide, qnvb, steps):
        svi = SVI(problem.model, guide, qnvb, elbo)
        return [svi.step() for _ in range(steps)]

    full_losses = fit(AutoNormalMessenger(problem.model), QNVB(), 6)
    full = _mean_field_parameters()
    pyro.clear_param_store()
    qnvb = QNVB()
    fit(AutoNormalMessenger(problem.model), qnvb, 3)
    store, state = copy.deepcopy(pyro.get_param_store().get_state()), qnvb.get_state()
    pyro.clear_param_store()
    guide = AutoNormalMessenger(problem.model)
    guide()  # its parameters exist once it has run, as any AutoGuide's
    pyro.get_param_store().set_state(store)
    resumed = QNVB()
    resumed.set_state(state)
    assert fit(guide, resumed, 3) == full_losses[3:]
    after = _mean_field_parameters()
    assert all(torch.equal(full[name], after[name]) for name in full)


def test_qnvb_under_trace_elbo_updates_a_registered_auto_normal_messenger_as_auto_normal():
    # the same draws (one normal per coordinate, in the same order), the same gradients: the same
    # QNVB steps. Its runs are no nn.Module calls, so QNVB does not see it without register_guide
    problem, _, _ = linear_regression(3, 0.5, seed=5)
    elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
    _assert_same_to_rounding(_fit_both(problem.model, 5, elbo))
    pyro.clear_param_store()
    qnvb = QNVB()
    svi = SVI(problem.model, AutoNormalMessenger(problem.model), qnvb, elbo)
    with pytest.warns(RuntimeWarning, match="none of the 2 parameters") as caught:
        svi.step()
    assert qnvb.get_state()["qnvb"]["pairs"] == {}
    # the warning says how: it used to name only the module guides
    (message,) = [str(w.message) for w in caught if "none of the 2" in str(w.message)]
    assert message.endswith(
        "A guide whose run is no nn.Module call (Pyro's AutoNormalMessenger, a guide function or "
        "callable object) is found only once registered: call "
        "pyro_quadvi.guides.register_guide(guide) once (QuadratureELBO needs none). Pyro's other "
        "effect-based guides and easy_guide guides are not read."
    )


def test_a_deterministic_rules_loss_of_auto_normal_messenger_draws_no_random_numbers():
    # as AutoNormal's (tests/test_quadrature_elbo.py): the ELBO reads the guide's parameters,
    # so its run gives each site the image of its Normal's mean, drawn from nothing
    guide = AutoNormalMessenger(constrained_model, init_loc_fn=init_to_feasible)
    guide()  # (init_to_feasible draws from the prior for the shapes)
    elbo = QuadratureELBO("hadamard", num_points=4)
    state = torch.get_rng_state()
    loss = elbo.loss_and_grads(constrained_model, guide)
    assert torch.equal(torch.get_rng_state(), state)
    pyro.clear_param_store()
    auto_normal = AutoNormal(constrained_model)  # zero locs, scales 0.1, as the messenger's
    auto_normal()
    assert loss == pytest.approx(elbo.loss(constrained_model, auto_normal), rel=1e-14)


def test_auto_normal_messenger_refuses_amortized_plates_and_describing_before_a_run():
    guide = AutoNormalMessenger(local_model, amortized_plates=("data",))
    with pytest.raises(ValueError, match=r"amortized_plates=\('data',\) shares each site's loc"):
        _fit(local_model, guide)
    with pytest.raises(RuntimeError, match="AutoNormalMessenger has not been run yet"):
        describe_guide(AutoNormalMessenger(local_model))


# ---------------------------------------------------------------- guides that are not read
def _easy_guide(model):
    @easy_guide(model)
    def eg(self):
        group = self.group(match="a|b")
        loc = pyro.param("eg_loc", torch.zeros(group.event_shape, dtype=torch.float64))
        group.sample("joint", dist.Delta(loc).to_event(1))

    return eg


def _flow(model):
    return AutoNormalizingFlow(
        model, lambda dim: dist.transforms.AffineAutoregressive(AutoRegressiveNN(dim, [4]))
    )


SAME_SITES = (
    "For a mean field over the same sites, which quadrature and QNVB read, use AutoNormal or "
    "AutoMeanFieldNormal; or fit this guide with Pyro's Trace_ELBO and Adam (pyro.optim.Adam)."
)


def _fit_with_adam(name: str, why: str) -> str:
    # (the review found "...(pyro.optim.Adam): it fits points (MAP): there is ...": two colons)
    return (
        f"{why[0].upper()}{why[1:]}. Fit {name} with Pyro's Trace_ELBO and Adam (pyro.optim.Adam)."
    )


@pytest.mark.parametrize(
    "make, name, way_out",
    [
        (
            AutoHierarchicalNormalMessenger,
            "AutoHierarchicalNormalMessenger",
            "AutoHierarchicalNormalMessenger overrides AutoNormalMessenger.get_posterior, so its "
            "posterior at a site need not be a Normal of that site's own loc and scale "
            "(AutoHierarchicalNormalMessenger's loc moves with the prior's mean, that is with "
            f"the values of the sites upstream). {SAME_SITES}",
        ),
        (
            AutoRegressiveMessenger,
            "AutoRegressiveMessenger",
            "AutoRegressiveMessenger's posterior at a site is made from the prior given the "
            f"values upstream, not a Normal of the site's own parameters. {SAME_SITES}",
        ),
        (
            lambda model: AutoIAFNormal(model, num_transforms=1),
            "AutoIAFNormal",
            _fit_with_adam(
                "AutoIAFNormal",
                "its posterior is a Normal pushed through learned transforms (a normalizing "
                "flow), which a Gaussian quadrature does not integrate",
            ),
        ),
        (
            _flow,
            "AutoNormalizingFlow",
            _fit_with_adam(
                "AutoNormalizingFlow",
                "its posterior is a Normal pushed through learned transforms (a normalizing "
                "flow), which a Gaussian quadrature does not integrate",
            ),
        ),
        (
            AutoLaplaceApproximation,
            "AutoLaplaceApproximation",
            _fit_with_adam(
                "AutoLaplaceApproximation",
                "it fits a point (MAP), and its Gaussian comes after, from "
                "laplace_approximation(), an AutoMultivariateNormal that is read",
            ),
        ),
        (
            AutoGaussian,  # named so, not by its backend's class AutoGaussianDense
            "AutoGaussian",
            _fit_with_adam(
                "AutoGaussian",
                "its Gaussian factors along the model's dependencies, which no adapter reads",
            ),
        ),
        (
            _easy_guide,
            "the easy_guide 'eg' (its pyro.param sites)",
            "A hand-written or amortized guide (an encoder network) trains with Pyro's "
            "Trace_ELBO; QNVB() then hands all its parameters to its fallback optimizer.",
        ),
    ],
)
def test_a_guide_that_is_not_read_is_named_with_why_and_the_way_out(make, name, way_out):
    with pytest.raises(TypeError) as error:
        QuadratureELBO().loss(ab_model, make(ab_model))
    message = str(error.value)
    assert message.startswith(f"pyro-quadvi cannot read the posterior of {name}: quadrature")
    assert message.endswith(f"'Writing a guide for QuadratureELBO and QNVB'). {way_out}")


def test_registering_a_hierarchical_messenger_is_refused_with_the_reason():
    # the adapter of its base class does not cover it, so QNVB never takes it for a mean field
    guide = AutoHierarchicalNormalMessenger(ab_model)
    guide()
    assert not is_describable(guide)
    with pytest.raises(TypeError, match=r"overrides AutoNormalMessenger\.get_posterior"):
        register_guide(guide)


def test_a_guide_of_the_model_trained_on_the_conditioned_model_is_told_so():
    # before: "the guide samples 'a', which the model observes: ... Build it with the data"
    guide = AutoNormal(ab_model)
    conditioned = pyro.condition(ab_model, data={"a": torch.tensor(1.0, dtype=torch.float64)})
    with pytest.raises(ValueError) as error:
        _fit(conditioned, guide)
    assert str(error.value) == (
        "the model given to SVI conditions 'a': build the guide from that model (e.g. "
        "AutoMeanFieldNormal(pyro.condition(model, data=...)), the model SVI is given). The "
        "guide 'AutoNormal' was built from a model that samples 'a', so it would draw what the "
        "model observes"
    )


def test_an_auto_normal_messenger_is_described_under_its_class_name():
    # its _pyro_name is empty: the review found messages naming "the guide ''" and a step key
    # "QuadratureELBO..a.step"
    guide = AutoNormalMessenger(ab_model)
    guide()
    assert describe_guide(guide).guide == "AutoNormalMessenger"
