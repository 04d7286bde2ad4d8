"""A user trial of QNVB's settings the Pyro way (session 25): a condition put around the annealed
model tempered nothing, a schedule given to QNVB without ``qnvb.anneal`` did nothing, and a
PyroOptim's state, a scheduler class and QNVB itself as the fallback were refused unclearly."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.optim import anneal_likelihood, geometric_annealing

N = 40
X = 2.0 + torch.randn(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
A = 0.3


def _model():
    """``mu ~ N(0, 1)``, ``x_i ~ N(mu, 1)`` with no ``obs=``: the data come by conditioning."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0), 1.0))
    with pyro.plate("n", N):
        pyro.sample("x", dist.Normal(mu, 1.0))


def _fit(model, steps: int = 30) -> AutoMeanFieldNormal:
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    for _ in range(steps):
        svi.step()
    return guide


def test_an_annealed_conditioned_model_fits_the_closed_form_tempered_posterior(float64_store):
    # p(mu) p(x | mu)^a: precision 1 + a N, mean a sum(x) / (1 + a N)
    guide = _fit(anneal_likelihood(pyro.condition(_model, data={"x": X}), A))
    precision = 1 + A * N
    assert guide.locs.mu.item() == pytest.approx(A * X.sum().item() / precision, abs=1e-6)
    assert guide.scales.mu.item() == pytest.approx(precision**-0.5, abs=1e-6)


@pytest.mark.parametrize("condition", [pyro.condition, poutine.condition])
@pytest.mark.parametrize("elbo", [QuadratureELBO, Trace_ELBO])
def test_a_condition_around_the_annealed_model_is_refused_naming_the_fix(
    float64_store, condition, elbo
):
    # it used to fit the untempered posterior (sd 0.156 where the tempered one is 0.277)
    model = condition(anneal_likelihood(_model, A), data={"x": X})
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), elbo())
    with pytest.raises(ValueError) as error:
        svi.step()
    message = str(error.value)
    assert message.startswith(
        "anneal_likelihood: site 'x' was observed by a handler outside the annealed model"
    )
    assert "Condition inside: anneal_likelihood(pyro.condition(model, data), a)" in message
    assert guide.locs.mu.item() == 0.0  # nothing moved


def test_latents_conditioned_around_the_annealed_model_outside_a_fit_are_left_alone(
    float64_store,
):
    """Predictive and MCMC's potential condition the latents outside the model they are given:
    no data, so no refusal, and only the data sites are tempered (the latents are prior)."""
    annealed = anneal_likelihood(pyro.condition(_model, data={"x": X}), A)
    trace = poutine.trace(poutine.condition(annealed, {"mu": torch.tensor(1.0)})).get_trace()
    assert (trace.nodes["mu"]["scale"], trace.nodes["x"]["scale"]) == (1.0, A)
    guide = _fit(annealed, steps=1)
    samples = Predictive(anneal_likelihood(_model, A), guide=guide, num_samples=3)()
    assert samples["x"].shape == (3, N)


def test_a_latent_fixed_around_the_annealed_model_in_a_fit_is_refused_and_inside_is_tempered(
    float64_store,
):
    """docs/qnvb.md: the refusal cannot tell a latent fixed by an outer condition from data; fixed
    inside, its prior term takes the factor (scale A), where outside a fit it keeps 1."""

    def two_means():
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0), 1.0))
        nu = pyro.sample("nu", dist.Normal(torch.tensor(0.0), 1.0))
        with pyro.plate("n", N):
            pyro.sample("x", dist.Normal(mu + nu, 1.0))

    data = pyro.condition(two_means, data={"x": X})
    outside = pyro.condition(anneal_likelihood(data, A), data={"mu": torch.tensor(1.0)})
    guide = AutoMeanFieldNormal(outside)
    with pytest.raises(
        ValueError, match=r"^anneal_likelihood: site 'mu' was observed by a handler"
    ) as refused:
        SVI(outside, guide, QNVB(), QuadratureELBO()).step()
    assert "A latent fixed from outside cannot be told from data here" in str(refused.value)
    inside = anneal_likelihood(pyro.condition(data, data={"mu": torch.tensor(1.0)}), A)
    trace = poutine.trace(inside).get_trace()
    assert (trace.nodes["mu"]["scale"], trace.nodes["x"]["scale"]) == (A, A)


def _noanneal_warnings(wrap: bool) -> list[str]:
    data = {"x": X}
    model = pyro.condition(_model, data=data)
    qnvb = QNVB(annealing=geometric_annealing(1e-3, num_steps=100))
    guide = AutoMeanFieldNormal(model)
    svi = SVI(qnvb.anneal(model) if wrap else model, guide, qnvb, QuadratureELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            svi.step()
    return [(str(w.message), w.filename) for w in caught]


def test_a_schedule_the_model_does_not_read_is_warned_of_once_at_the_users_line(float64_store):
    caught = _noanneal_warnings(wrap=False)
    assert caught == [
        (
            "QNVB: step 0 ran under the annealing schedule geometric_annealing(0.001, 100), but "
            "the model did not read its factor: the schedule takes effect only through the model "
            "qnvb.anneal(model) returns (SVI(qnvb.anneal(model), guide, qnvb, loss)), which "
            "tempers the model's observed sites (condition the model inside it: "
            "qnvb.anneal(pyro.condition(model, data))). Without it the fit runs untempered",
            __file__,
        )
    ]
    pyro.clear_param_store()
    assert _noanneal_warnings(wrap=True) == []


def test_a_pyro_optimizers_state_is_refused_saying_how_to_move_to_qnvb(float64_store):
    guide = _fit(pyro.condition(_model, data={"x": X}), steps=0)
    adam = pyro.optim.Adam({"lr": 0.01})
    SVI(pyro.condition(_model, data={"x": X}), guide, adam, Trace_ELBO()).step()
    with pytest.raises(ValueError) as error:  # was a bare KeyError: 'qnvb'
        QNVB().set_state(adam.get_state())
    message = str(error.value)
    assert message.startswith(
        "QNVB.set_state takes what QNVB.get_state() returned, a dict with the keys 'qnvb' and "
        "'fallback'; got dict with keys ['AutoMeanFieldNormal.locs.mu', "
        "'AutoMeanFieldNormal.scales.mu']. A dict keyed by parameter names is a PyroOptim's "
        "per-parameter state"
    )
    assert "keep Pyro's param store" in message and "start QNVB fresh" in message


@pytest.mark.parametrize(
    "fallback, why",
    [
        (
            (torch.optim.lr_scheduler.ExponentialLR, {"gamma": 0.5}),
            " (a learning-rate scheduler is not supported as the fallback",
        ),
        (QNVB(), " (QNVB is a PyroOptim subclass:"),
        ((torch.optim.Adam, [0.1]), ""),
    ],
)
def test_a_fallback_that_is_not_a_torch_optimizer_class_is_refused_when_built(fallback, why):
    with pytest.raises(ValueError) as error:  # the scheduler: a TypeError at the first step
        QNVB(fallback=fallback)
    message = str(error.value)
    assert message.startswith(
        "fallback must be a plain PyroOptim such as pyro.optim.Adam({'lr': 0.01}) (per-parameter "
        "arguments via pyro.optim.Adam(lambda name: {...})), or a pair (torch.optim.Optimizer "
        "subclass, arguments dict or callable name -> dict), such as (torch.optim.SGD, "
        f"{{'lr': 0.1}}); got {fallback!r}{why}"
    )


def test_a_fallback_pair_takes_per_parameter_arguments_as_pyro_does(float64_store):
    def model():
        b = pyro.param("b", torch.zeros(2))
        pyro.param("c", torch.zeros(2))
        pyro.sample("y", dist.Normal(b.sum() + pyro.param("c").sum(), 1.0), obs=torch.tensor(5.0))

    def lr(name: str) -> dict:
        return {"lr": 0.2 if name == "b" else 0.01}

    qnvb = QNVB(fallback=(torch.optim.Adam, lr))
    with pytest.warns(RuntimeWarning, match="none of the 2 parameters it received"):
        SVI(model, lambda: None, qnvb, Trace_ELBO()).step()
    # Adam's first step moves every coordinate of a nonzero gradient by its lr
    store = pyro.get_param_store()
    assert store["b"].tolist() == pytest.approx([0.2, 0.2], rel=1e-6)
    assert store["c"].tolist() == pytest.approx([0.01, 0.01], rel=1e-6)
    with pytest.raises(TypeError, match=r"^QNVB's fallback: QNVB calls a callable optim_args"):
        QNVB(fallback=(torch.optim.Adam, lambda a, b, c: {}))
