"""The refusals of a plate that does not run on each of its rows once say what applies to how
its rows came (`all_rows_refusal`): a `BayesianModule`'s minibatch, whatever wraps the module;
indices the model or the guide gives, repeated ones named; a random minibatch. An export whose
model's plate does not match the guide's (another size, another number of rows per run, a plate
the guide subsamples without a latent in it) names both and the fix, without Pyro's trace
shapes; an error the package does not raise keeps them."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, opqa_evidence, to_inference_data
from pyro_quadvi.nn import BayesianModule, likelihoods, priors

F64 = torch.float64


@pytest.fixture
def store():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


def regression(rows: int = 40):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 2, generator=generator, dtype=F64)
    y = x @ torch.tensor([0.7, -0.4], dtype=F64) + 0.5 * torch.randn(rows, generator=generator)
    return x, y


def network(dataset_size: int) -> BayesianModule:
    likelihood = likelihoods.Gaussian(dataset_size=dataset_size, scale=0.5)
    return BayesianModule(nn.Linear(2, 1).double(), priors.Normal(scale=1.0), likelihood)


def refusal(call) -> str:
    with pytest.raises(ValueError) as raised:
        call()
    assert raised.value.__cause__ is None and "Trace Shapes" not in str(raised.value)
    return str(raised.value)


class Holder(pyro.nn.PyroModule):
    """A PyroModule that holds the network and calls it."""

    def __init__(self, inner: BayesianModule):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y)


WRAPPERS = {
    "plain": lambda bnn: bnn,
    "poutine.scale": lambda bnn: poutine.scale(bnn, 1.0),
    "poutine.reparam": lambda bnn: poutine.reparam(bnn, config={}),
    "lambda": lambda bnn: lambda x, y: bnn(x, y),
    "PyroModule": Holder,
}


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_a_bayesian_modules_minibatch_is_told_to_pass_all_its_rows(store, wrap):
    x, y = regression(40)
    bnn = network(dataset_size=40)
    model = WRAPPERS[wrap](bnn)
    guide = AutoMeanFieldNormal(model, init_loc_fn=bnn.init_to_net())
    guide(x, y)
    fix = (
        "the BayesianModule's likelihood has dataset_size=40, so x and y of 10 rows are a "
        "minibatch of its data set: pass all 40 rows of x and y (or, for these 10 rows alone, "
        "a likelihood with dataset_size=10 or None)"
    )
    message = refusal(lambda: opqa_evidence(model, x[:10], y[:10], num_points=3))
    assert message == (
        "opqa_evidence: plate 'data' is given 10 of its 40 indices; the evidence needs every row: "
        + fix
    )
    message = refusal(lambda: to_inference_data(model, guide, x[:10], y[:10], num_samples=10))
    assert message == (
        "to_inference_data: plate 'data' is given 10 of its 40 indices; the export needs every "
        "row: " + fix
    )
    if wrap != "plain":
        return
    # what the message says works: all rows, or a likelihood for these rows alone
    idata = to_inference_data(bnn, guide, x, y, num_samples=10)
    assert idata.log_likelihood["obs"].shape == (1, 10, 40)
    bnn.likelihood.dataset_size = None
    assert opqa_evidence(bnn, x[:10], y[:10], num_points=3).log_evidence < 0


def model_given_rows(y, rows):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
    with pyro.plate("data", len(y), subsample=rows) as index:
        pyro.sample("y", dist.Normal(mu, 0.5), obs=y[index])


def model_random_rows(y):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
    with pyro.plate("data", len(y), subsample_size=4) as index:
        pyro.sample("y", dist.Normal(mu, 0.5), obs=y[index])


def test_indices_given_by_the_caller_and_a_random_minibatch_get_their_own_fix(store):
    _, y = regression(10)
    message = refusal(lambda: opqa_evidence(model_given_rows, y, torch.arange(4)))
    assert message.endswith(
        "the evidence needs every row: the model gives it these 4 indices "
        "(pyro.plate('data', 10, subsample=...)): pass all 10 of them "
        "(subsample=torch.arange(10)), or no subsample"
    )
    guide = AutoMeanFieldNormal(model_given_rows)
    guide(y, torch.arange(4))
    message = refusal(lambda: to_inference_data(model_given_rows, guide, y, torch.arange(4)))
    assert message.endswith("pass all 10 of them (subsample=torch.arange(10)), or no subsample")
    message = refusal(lambda: opqa_evidence(model_random_rows, y))
    assert message.endswith(
        "the evidence needs the full data: the plate draws 4 of its 10 rows at random in each "
        "run (subsample_size=4): drop subsample_size (or pass subsample_size=None)"
    )


def test_indices_that_are_not_each_row_once_are_refused(store):
    _, y = regression(10)
    guide = AutoMeanFieldNormal(model_given_rows)
    guide(y, torch.arange(10))
    repeated = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6, 7, 8])  # row 0 twice, row 9 dropped
    wrong = (
        "plate 'data' is given 10 indices of its 10 rows, row 0 more than once, row 9 not at "
        "all; {} needs each row once: the model gives them (pyro.plate('data', 10, "
        "subsample=...)): pass each of the 10 rows once (subsample=torch.arange(10)), or no "
        "subsample"
    )
    message = refusal(lambda: opqa_evidence(model_given_rows, y, repeated))
    assert message == "opqa_evidence: " + wrong.format("the evidence")
    message = refusal(lambda: to_inference_data(model_given_rows, guide, y, repeated))
    assert message == "to_inference_data: " + wrong.format("the export")
    zeros = torch.zeros(10, dtype=torch.long)  # row 0 ten times: the rows left out, shortened
    message = refusal(lambda: opqa_evidence(model_given_rows, y, zeros))
    assert "row 0 more than once, rows 1, 2, 3, 4, 5, ... (9 in all) not at all;" in message
    outside = torch.tensor([-1, 0, 1, 2, 3])  # y[-1] is row 9, the plate's indices are 0..9
    message = refusal(lambda: opqa_evidence(model_given_rows, y, outside))
    assert "plate 'data' is given 5 indices of its 10 rows, index -1 outside 0..9;" in message
    # each row once, in any order, is all the data
    shuffled = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    ordered = opqa_evidence(model_given_rows, y, torch.arange(10), num_points=5).log_evidence
    assert opqa_evidence(model_given_rows, y, shuffled, num_points=5).log_evidence == (
        pytest.approx(ordered, rel=1e-12)
    )
    idata = to_inference_data(model_given_rows, guide, y, shuffled, num_samples=10)
    assert idata.observed_data["y"].values.tolist() == y[shuffled].tolist()


def test_indices_the_guide_gives_are_told_as_the_guides(store):
    _, y = regression(10)

    def plates(y, rows):
        return pyro.plate("data", 10, subsample=rows)

    guide = AutoMeanFieldNormal(model_given_rows, create_plates=plates)
    guide(y, torch.arange(4))
    message = refusal(lambda: to_inference_data(model_given_rows, guide, y, torch.arange(4)))
    assert message == (
        "to_inference_data: plate 'data' is given 4 of its 10 indices; the export needs every "
        "row: the guide gives it these 4 indices (pyro.plate('data', 10, subsample=...)): pass "
        "all 10 of them (subsample=torch.arange(10)), or no subsample"
    )


N = 23


def local_latents(y, batch=None):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
    with pyro.plate("rows", len(y), subsample_size=batch) as index:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(z, 0.5), obs=y[index])


def fit_local(y, batch):
    guide = AutoMeanFieldNormal(local_latents)
    svi = SVI(local_latents, guide, QNVB(), QuadratureELBO())
    for _ in range(5):
        svi.step(y, batch)
    return guide


def test_an_export_with_other_rows_per_run_than_the_guides_plate_is_refused(store):
    y = 1.0 + 1.2 * torch.randn(N, generator=torch.Generator().manual_seed(0), dtype=F64)
    guide = fit_local(y, 5)
    message = refusal(lambda: to_inference_data(local_latents, guide, y, None, num_samples=10))
    assert message.startswith(
        "to_inference_data: plate 'rows' takes 5 of its 23 rows per run in the guide but all 23 "
        "in the model with these arguments, so the guide's local latents do not line up with "
        "the model's rows (an AutoGuide builds its plates on its first run and keeps that "
        "run's rows per run, whatever the model is given later). "
    )
    assert (
        "The guide was fitted on minibatches of 5: export with the model's arguments of the fit "
        "(those given to svi.step); the export then sweeps all 23 rows in chunks of 5" in message
    )
    message = refusal(lambda: to_inference_data(local_latents, guide, y, 10, num_samples=10))
    assert "takes 5 of its 23 rows per run in the guide but 10 of its 23 in the model" in message
    idata = to_inference_data(local_latents, guide, y, 5, num_samples=10)  # as the fit
    assert idata.posterior["z"].shape == (1, 10, 23)

    pyro.clear_param_store()
    guide = fit_local(y, None)
    message = refusal(lambda: to_inference_data(local_latents, guide, y, 5, num_samples=10))
    assert message.startswith(
        "to_inference_data: plate 'rows' takes all 23 rows per run in the guide but 5 of its 23 "
        "in the model"
    )
    assert message.endswith(
        "The guide was fitted on all 23 rows: export with the model's arguments of the fit "
        "(those given to svi.step), without subsampling"
    )


def global_latent(y, batch=None):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
    with pyro.plate("rows", len(y), subsample_size=batch) as index:
        pyro.sample("y", dist.Normal(mu, 0.5), obs=y[index])


def test_a_guide_of_local_latents_exports_on_the_rows_of_its_fit_alone(store):
    y = 1.0 + 1.2 * torch.randn(30, generator=torch.Generator().manual_seed(0), dtype=F64)
    guide = fit_local(y[:N], 5)
    for data, batch in ((y[:5], None), (y, 5), (y[:10], 5)):
        message = refusal(lambda d=data, b=batch: to_inference_data(local_latents, guide, d, b))
        assert message == (
            "to_inference_data: the guide's local latents are of a plate 'rows' of 23 rows, but "
            f"the model's plate 'rows' has {len(data)} with these arguments: a guide of local "
            "latents holds them for the rows it was fitted on and for no other. Export with the "
            "model's arguments of the fit (those given to svi.step); on new data only a guide of "
            "global latents exports (fit a guide to the new data for its local latents)"
        )
    # a guide of global latents exports on new data of any size
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(global_latent)
    svi = SVI(global_latent, guide, QNVB(), QuadratureELBO())
    for _ in range(5):
        svi.step(y[:N], 5)
    for data, batch in ((y[:5], None), (y, 5), (y, None)):
        idata = to_inference_data(global_latent, guide, data, batch, num_samples=10)
        assert idata.observed_data["y"].values.tolist() == data.tolist()


def own_guide(y, batch=None):
    """A guide of local latents written by hand, its plate of 5 rows per run whatever ``batch``."""
    loc = pyro.param("mu_loc", torch.tensor(0.0, dtype=F64))
    pyro.sample("mu", dist.Normal(loc, 0.1))
    z_loc = pyro.param("z_loc", torch.zeros(len(y), dtype=F64))
    with pyro.plate("rows", len(y), subsample_size=5) as index:
        pyro.sample("z", dist.Normal(z_loc[index], 0.1))


def test_the_refusal_says_who_builds_the_guides_plate(store):
    y = 1.0 + 1.2 * torch.randn(N, generator=torch.Generator().manual_seed(0), dtype=F64)
    own_guide(y)
    message = refusal(lambda: to_inference_data(local_latents, own_guide, y, None))
    assert message.startswith(
        "to_inference_data: plate 'rows' takes 5 of its 23 rows per run in the guide but all 23 "
        "in the model with these arguments, so the guide's local latents do not line up with the "
        "model's rows (the guide's own code builds its plates). "
    )
    # a plate the guide subsamples (its create_plates) without a latent in it
    guide = AutoMeanFieldNormal(
        global_latent,
        create_plates=lambda y, batch=None: pyro.plate("rows", len(y), subsample_size=5),
    )
    guide(y)
    message = refusal(lambda: to_inference_data(global_latent, guide, y, None))
    assert message == (
        "to_inference_data: plate 'rows' takes 5 of its 23 rows per run in the guide but all 23 "
        "in the model with these arguments; the guide holds no latent in it (the guide's "
        "create_plates builds its plates, or, for a plate it does not return, the AutoGuide on "
        "its first run), and the export sweeps a plate's rows once for the guide and the model: "
        "give the guide's plate the model's size and subsample size, or leave it out of the "
        "guide (an AutoGuide's create_plates need not return a plate that holds none of its "
        "latents)"
    )


def failing(y, fail=False):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
    with pyro.plate("rows", len(y)):
        if fail:
            raise ValueError("the model's own error")
        pyro.sample("y", dist.Normal(mu, 0.5), obs=y)


def test_an_error_the_package_does_not_raise_keeps_pyros_trace_shapes_and_its_cause(store):
    y = torch.zeros(4, dtype=F64)
    guide = AutoMeanFieldNormal(failing)
    guide(y)
    with pytest.raises(ValueError) as raised:
        to_inference_data(failing, guide, y, fail=True)
    assert str(raised.value).startswith("the model's own error\n")
    assert "Trace Shapes" in str(raised.value)
    cause = raised.value.__cause__
    assert cause is not None and str(cause) == "the model's own error"
