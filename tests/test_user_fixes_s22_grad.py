"""Session 22: a step that cannot train the guide is refused, not run as a silent no-op: under
``torch.no_grad()`` / ``torch.inference_mode()``, after the guide's first run under
``inference_mode`` (its parameters inference tensors), or with ``guide.requires_grad_(False)``.
Before, the loss stayed at its start for 300 steps (185.7 against the optimum 20.9)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO

Y = torch.tensor([0.5, 1.5, 1.0, 2.0])


def _model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("rows", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _svi():
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_model)
    return guide, SVI(_model, guide, QNVB(), QuadratureELBO())


@pytest.mark.parametrize(
    "context, words",
    [(torch.no_grad, "torch.no_grad()"), (torch.inference_mode, "torch.inference_mode()")],
)
def test_a_step_with_gradients_off_is_refused_and_the_loss_still_evaluates(context, words):
    guide, svi = _svi()
    svi.step(Y)
    before = guide.median()["mu"].item()
    with context():
        with pytest.raises(
            RuntimeError, match=rf"svi.step\) was called under {words}.*evaluate_loss"
        ):
            svi.step(Y)
        loss = svi.evaluate_loss(Y)
    assert guide.median()["mu"].item() == before
    assert loss == pytest.approx(QuadratureELBO().loss(_model, guide, Y))


def test_a_guide_first_run_under_inference_mode_is_named():
    _, svi = _svi()
    with torch.inference_mode():
        svi.evaluate_loss(Y)
    with pytest.raises(
        RuntimeError, match=r"'locs.mu_unconstrained'.*inference tensors.*outside inference_mode"
    ):
        svi.step(Y)


def test_a_guide_that_requires_no_grad_is_named():
    guide, svi = _svi()
    svi.step(Y)
    guide.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"requires_grad_\(False\)\?"):
        svi.step(Y)
    guide.requires_grad_(True)
    svi.step(Y)  # and trains again
