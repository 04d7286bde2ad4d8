"""Session 24, helper f1: a trial's findings on predictions and calibration. A saturated
``(n, 1)`` Bernoulli probability read as one class by the metrics, ``predict``'s float32
average of probabilities above 1, one unbatched example ``x`` of shape ``(F,)`` read as ``C``
rows, and the documented bias of one quadrature step's predictive variance."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pyro_quadvi import AutoMeanFieldNormal
from pyro_quadvi.metrics import (
    accuracy,
    brier_score,
    categorical_nll,
    expected_calibration_error,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors

ONE_COLUMN = (
    "probs has one column (shape (3, 1)), a problem of one class; for a binary classifier's "
    "probability p of class 1, pass both columns, torch.cat([1 - p, p], dim=1), of shape (n, 2)"
)


@pytest.mark.parametrize(
    "metric", [categorical_nll, accuracy, brier_score, expected_calibration_error]
)
def test_a_saturated_one_column_probability_is_refused(metric):
    p = torch.sigmoid(torch.tensor([[20.0], [25.0], [18.0]]))  # float32: exactly 1.0
    assert p.sum(-1).tolist() == [1.0, 1.0, 1.0]  # every row sums to 1, as one class's would
    y = torch.tensor([0, 0, 0])
    with pytest.raises(ValueError) as info:
        metric(p, y)
    assert str(info.value) == ONE_COLUMN
    # the fix scores what the labels say: -log(eps) and 2 for wrong certain predictions
    two = torch.cat([1 - p, p], dim=1)
    assert categorical_nll(two, y).item() == pytest.approx(-math.log(torch.finfo().eps))
    assert brier_score(two, y).item() == 2.0


def test_metrics_clamp_an_overshoot_of_rounding_and_refuse_more():
    probs = torch.tensor([[1.0000004, 0.0], [-1e-7, 1.0], [0.3, 0.7]])
    y = torch.tensor([0, 1, 1])
    assert categorical_nll(probs, y).item() == pytest.approx(-math.log(0.7) / 3, rel=1e-6)
    assert brier_score(probs, y).item() == pytest.approx(2 * 0.3**2 / 3, rel=1e-6)
    assert expected_calibration_error(probs, y).item() == pytest.approx(0.3 / 3, rel=1e-6)
    with pytest.raises(ValueError) as info:
        categorical_nll(torch.tensor([[1.5, -0.5]]), torch.tensor([0]))
    assert str(info.value) == (
        "probs must lie in [0, 1] up to rounding (0.0001); an entry is outside by 0.5 (pass "
        "probabilities, not logits)"
    )


@pytest.mark.parametrize("num_samples", [10, 20, 30])
def test_predict_clamps_a_float32_average_of_saturated_probabilities(
    fresh_param_store, num_samples
):
    # the trial's net: Linear(5, 2) with logits of +-30 x_0; unclamped, 1.0000001 to 1.0000004
    x = torch.randn(200, 5, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    net = nn.Linear(5, 2)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[-30.0, 0, 0, 0, 0], [30.0, 0, 0, 0, 0]]))
        net.bias.zero_()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(200))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=0.1)
    guide(x, y)
    probs = bnn.predict(guide, x, num_samples=num_samples).probs
    assert probs.max().item() == 1.0
    assert probs.min().item() >= 0.0
