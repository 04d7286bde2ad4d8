"""Session 22 user trial: the ArviZ export of an observed site whose distribution is narrower
than its data, and `opqa_evidence` naming every subsampled plate in one refusal."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_quadvi import opqa_evidence, to_inference_data

G, N = 6, 4


def _data() -> torch.Tensor:
    return torch.randn(G, N, generator=torch.Generator().manual_seed(0)) + torch.arange(G)[:, None]


def _event_model(y, rewritten=False):
    """The trial's model: ``y`` of shape ``(G, N)`` observed under a distribution of event shape
    ``(1,)``, or (``rewritten``) of the data's shape, as the refusal says."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("g", G):
        th = pyro.sample("th", dist.Normal(mu, 1.0))
        d = dist.Normal(th.unsqueeze(-1), 1.0)
        if rewritten:
            d = d.expand(d.batch_shape[:-1] + (N,))  # noqa: RUF005 (as the refusal writes it)
        pyro.sample("y", d.to_event(1), obs=y)


def _batch_model(y, rewritten=False):
    """Event dim 0, the plate at dim -2: a batch dim of 1 at the right where the data have
    ``N``; or (``rewritten``) inside a plate of ``N`` at dim -1, as the refusal says."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("g", G, dim=-2):
        th = pyro.sample("th", dist.Normal(mu, 1.0))
        if rewritten:
            with pyro.plate("n", N, dim=-1):
                pyro.sample("y", dist.Normal(th, 1.0), obs=y)
        else:
            pyro.sample("y", dist.Normal(th, 1.0), obs=y)


def _run_guide(model, y, **kwargs) -> AutoNormal:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    guide(y, **kwargs)
    return guide


def _refusal(model, y, vectorize) -> str:
    guide = _run_guide(model, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError) as info:
            to_inference_data(model, guide, y, num_samples=10, vectorize=vectorize)
    # refused before any draw: no warning that the vectorized pass failed comes first, and the
    # message is not wrapped in Pyro's trace shapes
    assert not [w for w in caught if "vectorized pass" in str(w.message)]
    assert info.value.__cause__ is None and "Trace Shapes" not in str(info.value)
    return str(info.value)


_EVENT_REWRITE = (
    "with d = dist.Normal(...), write d.expand(d.batch_shape[:-1] + (4,)).to_event(1) in place "
    "of d.to_event(1) (that is d.expand([6, 4]).to_event(1) in one run;"
)


@pytest.mark.parametrize("vectorize", [None, False])
def test_export_refuses_distribution_narrower_than_its_data(vectorize):
    message = _refusal(_event_model, _data(), vectorize)
    assert message.startswith("to_inference_data: observed site 'y' has data of shape (6, 4)")
    assert "its distribution is of shape (6, 1) (batch_shape (6,), event_shape (1,))" in message
    assert "posterior_predictive" in message
    assert _EVENT_REWRITE in message


def _exported_log_likelihood(model, y) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The rewritten model's export (vectorized, no warning): the log likelihood of ``y`` at
    its 20 draws, the same by hand from the exported ``th``, and the InferenceData."""
    guide = _run_guide(model, y, rewritten=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idata = to_inference_data(model, guide, y, rewritten=True, num_samples=20)
    th = torch.as_tensor(idata.posterior["th"].values[0], dtype=torch.float64).reshape(20, G, 1)
    pointwise = dist.Normal(th, 1.0).log_prob(y.double())  # (draw, G, N)
    exported = torch.as_tensor(idata.log_likelihood["y"].values[0])
    assert idata.posterior_predictive["y"].shape == (1, 20, G, N)
    assert idata.observed_data["y"].shape == (G, N)
    return exported, pointwise, idata


def test_the_event_rewrite_exports_the_log_likelihood():
    y = _data()
    assert _EVENT_REWRITE in _refusal(_event_model, y, None)
    exported, pointwise, _ = _exported_log_likelihood(_event_model, y)
    assert exported.shape == (20, G)
    torch.testing.assert_close(exported, pointwise.sum(-1), rtol=1e-6, atol=1e-6)


def test_export_refuses_batch_dim_narrower_than_its_data():
    y = _data()
    message = _refusal(_batch_model, y, None)
    assert "observed site 'y' has data of shape (6, 4)" in message
    assert "distribution is of shape (6, 1) (batch_shape (6, 1), event_shape ())" in message
    assert message.endswith("observe it inside pyro.plate(..., 4, dim=-1)")
    exported, pointwise, _ = _exported_log_likelihood(_batch_model, y)
    torch.testing.assert_close(exported, pointwise, rtol=1e-6, atol=1e-6)


D, S = 5, 4


def _nested(y, districts=None, schools=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("district", D, subsample_size=districts, dim=-2) as di:
        u = pyro.sample("u", dist.Normal(mu, 1.0))
        with pyro.plate("school", S, subsample_size=schools, dim=-1) as si:
            v = pyro.sample("v", dist.Normal(u, 0.5))
            pyro.sample("y", dist.Normal(v, 0.8), obs=y[di][:, si])


def test_opqa_names_every_subsampled_plate():
    y = torch.randn(D, S, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError) as info:
        opqa_evidence(_nested, y, 2, 3)
    message = str(info.value)
    assert message.startswith(
        "opqa_evidence: 2 plates do not run on each of their rows once, 'district' and 'school': "
    )
    assert "(1) plate 'district' is subsampled (2 of 5)" in message
    assert "(2) plate 'school' is subsampled (3 of 4)" in message
    assert message.count("drop subsample_size (or pass subsample_size=None)") == 2
    # one subsampled plate: the message as before
    with pytest.raises(ValueError) as info:
        opqa_evidence(_nested, y, None, 3)
    assert str(info.value) == (
        "opqa_evidence: plate 'school' is subsampled (3 of 4); the evidence needs the full data: "
        "the plate draws 3 of its 4 rows at random in each run (subsample_size=3): drop "
        "subsample_size (or pass subsample_size=None)"
    )


def _leading_one_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("g", G):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_data_with_a_leading_dim_of_one_is_told_to_take_the_distributions_shape():
    # the data (1, G) add only a leading dim of size 1: the message gave an empty rewrite (the
    # first review); and the log density (1, G) is the data's, so the fit runs
    y = _data()[:, 0][None]
    message = _refusal(_leading_one_model, y, None)
    assert "the fit and opqa_evidence run" in message
    assert message.endswith(
        "Pass data of the distribution's shape: the data's 1 leading dim(s) of size 1 are not "
        "the distribution's (data.reshape((6,)))"
    )


def _broadcasting_data_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("g", 2, dim=-2):
        pyro.sample("y", dist.Normal(mu, 1.0).expand([1, G]).to_event(1), obs=y)


def test_data_that_broadcast_too_are_not_said_to_give_the_fits_density():
    # data (2, G) against a distribution (2, 1, G): the log density is (2, 2, G), neither's
    message = _refusal(_broadcasting_data_model, torch.zeros(2, G), None)
    assert "its log density broadcasts with the data to (2, 2, 6)" in message
    assert "the fit and opqa_evidence run" not in message
