"""The reference estimators OPQA is compared with: importance and nested sampling."""

from __future__ import annotations

import math
import sys

import pyro
import pytest
import torch
from pyro.infer.autoguide import AutoNormal, init_to_value
from scipy import special

from pyro_quadvi.evidence import (
    importance_log_evidence,
    nested_sampling_log_evidence,
    prior_guide,
)
from pyro_quadvi.testing.evidence_models import F64, normal_normal, normal_normal_log_evidence

X_OBS = torch.tensor(0.7, dtype=F64)


@pytest.fixture(autouse=True)
def clear_param_store():
    pyro.clear_param_store()


def test_importance_sampling_from_the_exact_posterior_has_no_variance():
    precision = 1.0 + 1.0 / 0.1**2
    mean = 0.7 / 0.1**2 / precision
    guide = AutoNormal(
        normal_normal,
        init_loc_fn=init_to_value(values={"mu": torch.tensor(mean, dtype=F64)}),
        init_scale=precision**-0.5,
    )
    estimate = importance_log_evidence(normal_normal, guide, X_OBS, num_samples=50)
    assert abs(estimate.log_evidence - normal_normal_log_evidence(0.7)) < 1e-12
    assert estimate.std_error < 1e-12
    assert estimate.info["effective_sample_size"] == pytest.approx(50.0)
    assert estimate.num_evaluations == 50


def test_importance_sampling_from_the_prior():
    pyro.set_rng_seed(0)
    estimate = importance_log_evidence(
        normal_normal, prior_guide(normal_normal), X_OBS, num_samples=20_000, batch_size=7_000
    )
    error = abs(estimate.log_evidence - normal_normal_log_evidence(0.7))
    # the prior is ten times wider than the posterior: about 1 sample in 9 counts
    assert 0.005 < estimate.std_error < 0.05
    assert error < 4 * estimate.std_error
    assert 1_000 < estimate.info["effective_sample_size"] < 4_000


def test_nested_sampling():
    pytest.importorskip("dynesty")

    def log_likelihood(theta):
        return -0.5 * ((0.7 - theta[0]) / 0.1) ** 2 - math.log(0.1 * math.sqrt(2 * math.pi))

    def prior_transform(u):
        return special.ndtri(u)

    estimate = nested_sampling_log_evidence(log_likelihood, prior_transform, 1, nlive=100, seed=1)
    error = abs(estimate.log_evidence - normal_normal_log_evidence(0.7))
    assert 0.0 < estimate.std_error < 0.5
    assert error < 4 * estimate.std_error
    assert estimate.num_evaluations > 100


def test_nested_sampling_without_dynesty(monkeypatch):
    monkeypatch.setitem(sys.modules, "dynesty", None)
    with pytest.raises(ImportError, match=r"pyro-quadvi\[evidence\]"):
        nested_sampling_log_evidence(lambda t: 0.0, lambda u: u, 1)
