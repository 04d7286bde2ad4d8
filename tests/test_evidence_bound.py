"""The training loss is no bound on the evidence; a Gauss-Hermite ELBO at the fitted guide is.

docs/evidence.md ("The training loss, the ELBO and the evidence") states these numbers for the
normal-gamma model of the evidence tutorial (30 rows, a Normal mean and precision: 2 latents),
fitted by 400 steps of QNVB with the default rule: the step's ``-loss`` is 0.0357 nats above the
closed-form log evidence, the Gauss-Hermite ELBO 0.0256 below it.
"""

from __future__ import annotations

import pyro
import pytest
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO


@pytest.fixture(scope="module")
def fitted(load_script):
    tutorial = load_script("tutorials/evidence_comparison.py")
    x, y = tutorial.polynomial_data()
    X = tutorial.design(x, 0)  # the intercept: 2 latents with the precision
    model = tutorial.normal_gamma_regression
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    losses = [svi.step(X, y) for _ in range(400)]
    yield model, guide, (X, y), losses, tutorial.normal_gamma_log_evidence(X, y)
    pyro.clear_param_store()


def test_the_step_loss_sits_above_the_evidence_at_every_step(fitted):
    model, guide, args, losses, log_evidence = fitted
    above = [-loss - log_evidence for loss in losses[-100:]]
    assert min(above) > 0.035  # every step: one block, the same three points
    assert above[-1] == pytest.approx(0.0357, abs=5e-5)
    at_the_guide = -QuadratureELBO().loss(model, guide, *args) - log_evidence
    assert at_the_guide == pytest.approx(0.0357, abs=5e-5)


def test_the_gauss_hermite_elbo_is_below_the_evidence(fitted):
    model, guide, args, _, log_evidence = fitted
    elbo = {
        m: -QuadratureELBO(rule="gauss_hermite", num_points=m).loss(model, guide, *args)
        for m in (8, 16, 32)
    }
    assert elbo[16] - log_evidence == pytest.approx(-0.0256, abs=5e-5)
    assert elbo[16] < log_evidence
    assert abs(elbo[8] - elbo[16]) < 1e-6 and abs(elbo[32] - elbo[16]) < 1e-6
