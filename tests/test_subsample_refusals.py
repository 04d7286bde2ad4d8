"""The refusals of a plate that does not run on all its rows say what applies to how it was
subsampled (`all_rows_fix`), and an export whose model takes another number of rows per run
than the guide's plate names both and the fix, without Pyro's trace shapes."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
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


def test_a_bayesian_modules_minibatch_is_told_to_pass_all_its_rows(store):
    x, y = regression(40)
    bnn = network(dataset_size=40)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(x, y)
    fix = (
        "the BayesianModule's likelihood has dataset_size=40, so x and y of 10 rows are a "
        "minibatch of its data set: pass all 40 rows of x and y (or, for these 10 rows alone, "
        "a likelihood with dataset_size=10 or None)"
    )
    message = refusal(lambda: opqa_evidence(bnn, x[:10], y[:10], num_points=3))
    assert message == (
        "opqa_evidence: plate 'data' is subsampled (10 of 40); the evidence needs the full data: "
        + fix
    )
    message = refusal(lambda: to_inference_data(bnn, guide, x[:10], y[:10], num_samples=10))
    assert message == (
        "to_inference_data: plate 'data' is given 10 of its 40 indices; the export needs every "
        "row: " + fix
    )
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
        "the evidence needs the full data: the model gives it these 4 indices "
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


N = 23


def local_latents(y, batch=None):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
    with pyro.plate("rows", N, subsample_size=batch) as index:
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
        "the model's rows"
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
