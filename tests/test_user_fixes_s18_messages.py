"""Session 18 (trial t1): the ELBO's errors on a diverged or unscaled fit name the value that
overflowed and the advice that fits; the vectorize fallback names the broadcasting form of
``x @ b``; pyro.contrib.gp's own guide is refused with the way out, and docs/guides.md's GP
recipe predicts at the fitted hyperparameters."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pyro
import pyro.contrib.gp as gp
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.nn import PyroSample

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer.batched import BatchMismatch
from pyro_quadvi.infer.log_joint import LogJoint, latent_sites_of_model

ROOT = Path(__file__).resolve().parent.parent
OLD_ADVICE = "else from a smaller init_scale"


def hierarchical_non_centred(group, num_groups, y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 1000.0))
    tau = pyro.sample("tau", dist.HalfNormal(100.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(200.0))
    with pyro.plate("groups", num_groups):
        eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
    with pyro.plate("data", group.shape[0]):
        pyro.sample("y", dist.Normal((mu + tau * eta)[..., group], sigma), obs=y)


def test_a_latent_that_a_step_too_large_overflowed_is_named_with_the_step_advice():
    # t1's E1: y near 1000, one group 100 times the others; QNVB(lr=1e4)'s first step moves
    # log tau to 107.9, tau = inf in float32, and the second step's log density of tau is -inf
    g = torch.Generator().manual_seed(13)
    sizes = [1000] + [10] * 7
    group = torch.cat([torch.full((n,), j) for j, n in enumerate(sizes)])
    theta = 1000.0 + 50.0 * torch.randn(8, generator=g)
    y = theta[group] + 100.0 * torch.randn(len(group), generator=g)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(hierarchical_non_centred)
    svi = SVI(hierarchical_non_centred, guide, QNVB(lr=1e4), QuadratureELBO())
    svi.step(group, 8, y=y)
    with pytest.raises(ValueError) as raised:
        svi.step(group, 8, y=y)
    message = str(raised.value)
    assert "the log density of site 'tau' is not finite (-inf)" in message
    found = re.search(
        r"the latent site 'tau' is inf at this point, where its unconstrained value "
        r"is ([\d.]+): its transform to the support overflows float32",
        message,
    )
    assert found and 100 < float(found.group(1)) < 120
    assert "a smaller lr" in message and "trust_region" in message
    assert OLD_ADVICE not in message


def model_tau(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = pyro.sample("tau", dist.LogNormal(0.0, 1.0))
    eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 3):
        pyro.sample("y", dist.Normal(mu + tau * eta, 1.0), obs=y)


@pytest.mark.parametrize("vectorize", [True, False])
@pytest.mark.parametrize("eta", [1.0, 0.0])
def test_log_joint_names_the_latent_whose_transform_overflowed(vectorize, eta):
    # eta = 1: tau = exp(100) = inf gives -inf densities; eta = 0: inf * 0 makes y's loc NaN,
    # which Pyro's validation refuses first (the named-site path): both name tau
    y = torch.zeros(3)
    log_joint = LogJoint(model_tau, latent_sites_of_model(model_tau, y))
    z = torch.tensor([[0.0, 100.0, eta], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError) as raised:
        log_joint(z, (y,), vectorize=vectorize)
    message = str(raised.value)
    assert "the latent site 'tau' is inf at" in message
    assert "overflows float32" in message and "trust_region" in message
    assert OLD_ADVICE not in message
    if vectorize and eta == 1.0:  # (read at the node itself, with its coordinate)
        assert "where its unconstrained value is 100:" in message


def test_a_latent_at_a_nan_coordinate_is_named_as_a_diverged_fit():
    # (with validation on, Pyro refuses the NaN value at the site itself)
    y = torch.zeros(3)
    log_joint = LogJoint(model_tau, latent_sites_of_model(model_tau, y))
    with pytest.raises(ValueError) as raised, pyro.validation_enabled(False):
        log_joint(torch.tensor([[0.0, float("nan"), 1.0]]), (y,), vectorize=False)
    message = str(raised.value)
    assert "the latent site 'tau' has the unconstrained value nan at this point" in message
    assert "the fit has diverged" in message and "overflows" not in message


def unscaled_poisson(x, y=None):
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    b = pyro.sample("b", dist.Normal(0.0, 100.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Poisson((a + (x * b).sum(-1)).exp()), obs=y)


@pytest.mark.parametrize("vectorize", [None, False])
def test_a_parameter_that_overflowed_at_finite_latents_is_named_with_the_scaling_advice(vectorize):
    # t1's E2: features on scales 1e-3 .. 1e4; at the first nodes (b = 0.137) the Poisson rate
    # is exp(1e4 * 0.137) = inf and its log density NaN
    scales = torch.tensor([1e-3, 1.0, 1e2, 1e4])
    g = torch.Generator().manual_seed(12)
    x = scales * torch.exp(0.5 * torch.randn(300, 4, generator=g))
    y = torch.poisson((7.5 + (x * (0.2 / scales / 1.13)).sum(-1)).exp(), generator=g)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(unscaled_poisson)
    svi = SVI(unscaled_poisson, guide, QNVB(), QuadratureELBO(vectorize=vectorize))
    with pytest.raises(ValueError) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Pyro's "Encountered NaN" on the way)
        svi.step(x, y)
    message = str(raised.value)
    assert "the log density of site 'y' is not finite (nan)" in message
    assert "its Poisson parameter 'rate' is inf there, while every latent is finite" in message
    assert "model's arithmetic overflowed" in message
    assert "standardize the inputs" in message and "init_to_value" in message
    assert OLD_ADVICE not in message


def nan_loc(y):
    s = pyro.sample("s", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 3):
        pyro.sample("y", dist.Normal(torch.log(s - 2.0) * 0 + s, 1.0), obs=y)


def test_a_nan_parameter_at_finite_latents_is_named_as_nan_arithmetic():
    # log of a negative number: the loc is NaN at every finite s < 2; Pyro's validation refuses
    # it, and the named site's message reads the parameter
    y = torch.zeros(3)
    log_joint = LogJoint(nan_loc, latent_sites_of_model(nan_loc, y))
    with pytest.raises(ValueError) as raised:
        log_joint(torch.tensor([[0.5]]), (y,), vectorize=False)
    message = str(raised.value)
    assert "its Normal parameter 'loc' is nan there, while every latent is finite" in message
    assert "the model's arithmetic gave NaN" in message and "log of a" in message


def bounded(y):
    theta = pyro.sample("theta", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", 3):
        pyro.sample("y", dist.Uniform(0.0, theta), obs=y)


@pytest.mark.parametrize("vectorize", [True, False])
def test_an_observation_outside_a_latent_support_keeps_the_old_advice(vectorize):
    # theta = 1 at z = 0 and y = 5 lies outside (0, theta): no value overflowed
    y = torch.full((3,), 5.0)
    log_joint = LogJoint(bounded, latent_sites_of_model(bounded, y))
    with pytest.raises(ValueError) as raised, pyro.validation_enabled(False):
        log_joint(torch.zeros(2, 1), (y,), vectorize=vectorize)
    message = str(raised.value)
    assert "the log density of site 'y' is not finite (-inf)" in message
    assert OLD_ADVICE in message
    assert "overflow" not in message


def wide_tau(y):
    tau = pyro.sample("tau", dist.LogNormal(0.0, 100.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(0.0, tau), obs=y)


def test_a_latent_overflowed_at_the_guides_initial_value_is_not_blamed_on_a_step():
    # review s18 r1: at step 0 the message said "an optimizer's step that was too large", but
    # no step had been taken; the initial value 3.3e38 puts a node's tau beyond float32
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    start = pyro.infer.autoguide.init_to_value(values={"tau": torch.tensor(3.3e38)})
    guide = AutoMeanFieldNormal(wide_tau, init_loc_fn=start)
    svi = SVI(wide_tau, guide, QNVB(), QuadratureELBO())
    with pytest.raises(ValueError) as raised:
        svi.step(torch.randn(10))
    message = str(raised.value)
    assert "the latent site 'tau' is inf at this point" in message
    assert "comes from an optimizer's step" not in message
    assert "before any step, its initial value" in message and "init_to_value" in message


def poisson_regression(x, c):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", len(c)):
        pyro.sample("c", dist.Poisson((x * w).sum(-1).exp()), obs=c)


def test_a_nan_covariate_is_named_by_argument_and_index():
    # review s18 r1: "inf - inf after an overflow", and nothing said that x holds NaN (the
    # guide's set-up run, where Pyro's validation refuses the rate)
    x = torch.randn(20, 2)
    x[3, 0] = float("nan")
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svi = SVI(poisson_regression, AutoMeanFieldNormal(poisson_regression), QNVB(), QuadratureELBO())
    with pytest.raises(ValueError) as raised:
        svi.step(x, torch.ones(20))
    message = str(raised.value)
    assert "the model's argument x holds NaN (first at index [3, 0])" in message
    assert "inf - inf" not in message and "standardize" not in message


def data_scale(s, y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, s), obs=y)


@pytest.mark.parametrize("vectorize", [True, False])
def test_an_infinite_scale_in_the_data_is_named_not_blamed_on_overflow(vectorize):
    # review s18 r1: "the model's arithmetic overflowed ... standardize the inputs"
    s = torch.ones(5)
    s[2] = math.inf
    y = torch.zeros(5)
    log_joint = LogJoint(data_scale, latent_sites_of_model(data_scale, s, y))
    with pytest.raises(ValueError) as raised, pyro.validation_enabled(False):
        log_joint(torch.zeros(2, 1), (), {"s": s, "y": y}, vectorize=vectorize)
    message = str(raised.value)
    assert "the log density of site 'y' is not finite (-inf)" in message
    assert "the model's argument s holds inf (first at index [2])" in message
    assert "overflowed" not in message and "standardize" not in message


def test_a_nonfinite_input_inside_a_container_is_named_by_its_path():
    def model(data):
        data_scale(data["scales"][0], data["y"])

    s = torch.ones(5)
    s[4] = -math.inf
    data = {"scales": [s], "y": torch.zeros(5)}
    log_joint = LogJoint(model, latent_sites_of_model(model, data))
    with pytest.raises(ValueError, match=re.escape("argument data['scales'][0] holds -inf")):
        with pyro.validation_enabled(False):
            log_joint(torch.zeros(1, 1), (data,), vectorize=False)


def matmul_model(x, y=None):
    a = pyro.sample("a", dist.Normal(0.0, 5.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(a + x @ b, 1.0), obs=y)


def walk_model(y):
    # a vector latent read inside a plate of its size: a fallback for another reason
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
    with pyro.plate("t", 4):
        pyro.sample("y", dist.Normal(w, 1.0), obs=y)


def test_the_fallback_for_x_at_b_names_the_broadcasting_form():
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([1.0, -1.0, 0.5])
    pyro.clear_param_store()
    svi = SVI(matmul_model, AutoMeanFieldNormal(matmul_model), QNVB(), QuadratureELBO())
    with pytest.warns(UserWarning, match="does not evaluate all") as caught:
        svi.step(x, y)
    message = next(str(w.message) for w in caught if "does not evaluate all" in str(w.message))
    assert "The failing operation is a matrix product" in message
    assert "write a + (x * b).sum(-1), which broadcasts over the points" in message
    # under vectorize=True the error carries it
    pyro.clear_param_store()
    elbo = QuadratureELBO(vectorize=True)
    with pytest.raises(RuntimeError, match=re.escape("a + (x * b).sum(-1)")):
        SVI(matmul_model, AutoMeanFieldNormal(matmul_model), QNVB(), elbo).step(x, y)
    # another cause of the fallback gets no such advice
    pyro.clear_param_store()
    svi = SVI(walk_model, AutoMeanFieldNormal(walk_model), QNVB(), QuadratureELBO())
    with pytest.warns(UserWarning, match="does not evaluate all") as caught:
        svi.step(torch.zeros(4))
    assert not any("matrix product" in str(w.message) for w in caught)
    with pytest.raises(BatchMismatch) as raised:
        guide = AutoMeanFieldNormal(walk_model)
        QuadratureELBO(vectorize=True).loss(walk_model, guide, torch.zeros(4))
    assert "matrix product" not in str(raised.value)


def make_gpr(X, y):
    gpr = gp.models.GPRegression(X, y, gp.kernels.RBF(input_dim=1), noise=torch.tensor(0.1))
    gpr.kernel.lengthscale = PyroSample(dist.LogNormal(0.0, 1.0))
    gpr.kernel.variance = PyroSample(dist.LogNormal(0.0, 1.0))
    return gpr


def gp_data():
    g = torch.Generator().manual_seed(7)
    X = torch.linspace(0.0, 5.0, 30)
    return X, 0.5 * torch.sin(3 * X) + 0.2 * torch.randn(30, generator=g)


def test_a_gps_own_guide_is_refused_naming_the_guide_of_its_model():
    pyro.clear_param_store()
    gpr = make_gpr(*gp_data())
    svi = SVI(gpr.model, gpr.guide, QNVB(), QuadratureELBO())
    with pytest.raises(TypeError) as raised:
        svi.step()
    message = str(raised.value)
    assert "the guide method 'GPRegression.guide'" in message
    assert "For a GPRegression gpr, fit guide = AutoMeanFieldNormal(gpr.model) instead" in message
    assert "Gaussian processes from pyro.contrib.gp" in message


def page_block(page: str, name: str) -> str:
    """The python block of ``page`` below the marker ``<!-- docs-test: name -->``."""
    text = (ROOT / page).read_text()
    found = re.search(rf"<!-- docs-test: {name} -->\n\n```python\n(.*?)\n```", text, re.S)
    assert found, f"{page} has no block {name!r}"
    return found.group(1)


def test_the_gp_recipe_predicts_at_the_guides_median_hyperparameters():
    X, y = gp_data()
    Xnew = torch.linspace(0.0, 5.0, 7)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ns = dict(
        X=X,
        y=y,
        Xnew=Xnew,
        torch=torch,
        dist=dist,
        SVI=SVI,
        QNVB=QNVB,
        AutoMeanFieldNormal=AutoMeanFieldNormal,
        QuadratureELBO=QuadratureELBO,
    )
    fit = page_block("docs/guides.md", "guides-gp-fit")
    assert fit.count("range(300)") == 1
    exec(fit.replace("range(300)", "range(30)"), ns)
    gpr, guide = ns["gpr"], ns["guide"]
    with torch.no_grad():
        untrained, _ = gpr(Xnew)  # gp's own guide: the initial hyperparameters
    exec(page_block("docs/guides.md", "guides-gp-median"), ns)
    with torch.no_grad():
        median = guide.median()
        length, variance = median["kernel.lengthscale"], median["kernel.variance"]
        noise = median["noise"]

        def kernel(a, b):
            return variance * torch.exp(-0.5 * (a[:, None] - b[None, :]) ** 2 / length**2)

        jittered = kernel(X, X) + (noise + gpr.jitter) * torch.eye(len(X))
        by_hand = kernel(Xnew, X) @ torch.linalg.solve(jittered, y)
    torch.testing.assert_close(ns["mean"], by_hand, rtol=1e-4, atol=1e-5)
    assert (ns["mean"] - untrained).abs().max() > 0.05
    exec(page_block("docs/guides.md", "guides-gp-draws"), ns)
    assert ns["mean"].shape == ns["var"].shape == (7,)
    assert torch.isfinite(ns["mean"]).all() and (ns["var"] > 0).all()


def test_a_factor_over_nan_data_names_the_factor_and_the_argument():
    def model(data):
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.factor("penalty", -(a * data).square().sum())

    log_joint = LogJoint(model, latent_sites_of_model(model, torch.ones(2)))
    with pytest.raises(ValueError) as raised:
        log_joint(torch.zeros(1, 1), (torch.tensor([1.0, math.nan]),), vectorize=False)
    message = str(raised.value)
    assert "the pyro.factor 'penalty' is NaN, computed by the model" in message
    assert "the model's argument data holds NaN (first at index [1])" in message


def test_an_infinite_input_by_design_is_not_blamed_for_a_latent_sites_density(
    fresh_param_store,
):
    """An infinite censoring time held on purpose (rows not censored) is not the cause when the
    density that is not finite is a latent site's prior at the guide's point (``tau``'s initial
    value ``3.3e38`` is beyond its LogNormal prior's reach in float32): the message does not name
    the input, and keeps the advice on the start."""
    from pyro.infer.autoguide import init_to_value

    def model(y, censor):
        tau = pyro.sample("tau", dist.LogNormal(0.0, 100.0))
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(0.0, tau), obs=torch.minimum(y, censor))

    guide = AutoMeanFieldNormal(
        model, init_loc_fn=init_to_value(values={"tau": torch.tensor(3.3e38)})
    )
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    censor = torch.tensor([math.inf, 0.5, math.inf])
    with pytest.raises(ValueError) as raised:
        svi.step(torch.tensor([0.1, -0.2, 0.3]), censor)
    message = str(raised.value)
    assert "'tau'" in message
    assert "argument" not in message and "censor" not in message


def test_an_infinite_input_is_not_blamed_where_validation_refuses_a_latent_site(
    fresh_param_store,
):
    """The same rule where Pyro's validation refuses first (`_name_the_invalid_site`): ``z``'s
    prior has scale ``tau = 0`` at the guide's initial value, and the infinite censoring time
    held on purpose is not named; the advice on the start is."""
    from pyro.infer.autoguide import init_to_value

    def model(y, censor):
        tau = pyro.sample("tau", dist.HalfNormal(1.0))
        z = pyro.sample("z", dist.Normal(0.0, tau))
        with pyro.plate("d", len(y)):
            pyro.sample("y", dist.Normal(z, 1.0), obs=torch.minimum(y, censor))

    guide = AutoMeanFieldNormal(model, init_loc_fn=init_to_value(values={"tau": torch.tensor(0.0)}))
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    with pyro.validation_enabled(True), pytest.raises(ValueError) as raised:
        svi.step(torch.tensor([0.1, -0.2, 0.3]), torch.tensor([math.inf, 0.5, math.inf]))
    message = str(raised.value)
    assert "site 'z' is not finite (nan) at the guide's initial values" in message
    assert "censor" not in message and "init_loc_fn=init_to_value" in message
