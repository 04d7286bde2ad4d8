"""The evidence-comparison tutorial, end to end in its quick mode."""

from __future__ import annotations

import pytest

from pyro_quadvi import opqa_evidence


@pytest.fixture(scope="module")
def tutorial(load_script):
    return load_script("tutorials/evidence_comparison.py")


def test_closed_form_evidence(tutorial):
    x, y = tutorial.polynomial_data()
    X = tutorial.design(x, 0)
    result = opqa_evidence(tutorial.normal_gamma_regression, X, y, num_points=20)
    assert abs(result.log_evidence - tutorial.normal_gamma_log_evidence(X, y)) < 1e-8


def test_quick_run(tutorial, run_quick):
    out, plot = run_quick(tutorial, "evidence_comparison.png", "--no-dynesty")
    assert out["out"] == str(plot)
    assert out["chosen"] == 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = out["rows"]
    for degree in range(4):
        by_method = {row["method"]: row for row in rows if row["degree"] == degree}
        assert by_method["OPQA"]["error"] < 1e-3
        assert by_method["OPQA"]["error"] < by_method["IS (prior)"]["error"]
        assert by_method["OPQA"]["error"] < by_method["IS (guide)"]["error"]
    # the Bayes factor by OPQA agrees with the exact one to 1e-3 nats
    exact = tutorial.bayes_factors(rows, "exact")
    for degree, value in out["bayes_factors"].items():
        assert abs(value - exact[degree]) < 1e-3


def test_nested_sampling_problem(tutorial):
    pytest.importorskip("dynesty")
    x, y = tutorial.polynomial_data()
    X = tutorial.design(x, 0)
    estimate = tutorial.nested_estimate(X, y, nlive=100, seed=0)
    error = abs(estimate.log_evidence - tutorial.normal_gamma_log_evidence(X, y))
    assert error < 4 * estimate.std_error + 0.05
