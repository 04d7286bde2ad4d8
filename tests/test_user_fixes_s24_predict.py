"""Session 24, helper f1: a trial's findings on predictions and calibration. A saturated
``(n, 1)`` Bernoulli probability read as one class by the metrics, ``predict``'s float32
average of probabilities above 1, one unbatched example ``x`` of shape ``(F,)`` read as ``C``
rows, and the documented bias of one quadrature step's predictive variance."""

from __future__ import annotations

import math
from pathlib import Path

import pyro
import pytest
import torch
from pyro.infer import Predictive
from torch import nn

from pyro_quadvi import AutoMeanFieldNormal
from pyro_quadvi.metrics import (
    accuracy,
    brier_score,
    categorical_nll,
    expected_calibration_error,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors

DOCS = Path(__file__).resolve().parent.parent / "docs"
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


def _categorical_5_4_3() -> tuple[BayesianModule, AutoMeanFieldNormal, torch.Tensor]:
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(8))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(x, torch.zeros(8, dtype=torch.long))
    return bnn, guide, x


def _one_example(why: str) -> str:
    return (
        f"BayesianModule: x of shape (5,) is one example, not a batch of rows: {why}. The net "
        "takes x of B rows (its first dim); pass one example as a batch of one row, x[None] "
        "(x.unsqueeze(0))"
    )


def test_one_unbatched_example_is_refused_in_predict_predictive_and_training(fresh_param_store):
    bnn, guide, x = _categorical_5_4_3()
    message = _one_example("the net's first layer, nn.Linear(5, 4), takes 5 features")
    with pytest.raises(ValueError) as info:
        bnn.predict(guide, x[0])
    assert str(info.value) == message
    with pytest.raises(ValueError, match=r"x of shape \(5,\) is one example") as info:
        Predictive(bnn, guide=guide, num_samples=4)(x[0])
    assert message in str(info.value)
    with pytest.raises(ValueError) as info:
        bnn(x[0], torch.tensor([1]))
    assert str(info.value) == message
    # the fix: one row, the first row of the batched prediction
    batched = bnn.predict(guide, x, quadrature="hadamard").probs
    single = bnn.predict(guide, x[0][None], quadrature="hadamard").probs
    assert single.shape == (1, 3)
    torch.testing.assert_close(single[0], batched[0])


def test_one_example_whose_outputs_have_other_rows_is_refused(fresh_param_store):
    # the first layer with parameters is no nn.Linear: the outputs' 3 rows name it
    net = nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 3))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(8, scale=0.1))
    with pytest.raises(ValueError) as info:
        bnn(torch.randn(5))
    assert str(info.value) == _one_example(
        "the net's outputs, of shape (3,), do not have its 5 rows"
    )


def test_a_one_dim_x_of_rows_is_taken(fresh_param_store):
    # token ids, one a row: the outputs have x's 5 rows and the first layer is no nn.Linear
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(5))
    x = torch.tensor([1, 2, 3, 4, 5])
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(x, torch.zeros(5, dtype=torch.long))
    assert bnn.predict(guide, x, num_samples=2).probs.shape == (5, 3)


class _FourierFeatures(nn.Module):
    """A regression on scalar inputs x of shape (N,): sin and cos of 16 frequencies a row, then
    nn.Linear(32, 1)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.linspace(0.5, 8.0, 16))
        self.lin = nn.Linear(32, 1)

    def forward(self, x):
        z = x[:, None] * self.w
        return self.lin(torch.cat([z.sin(), z.cos()], -1)).squeeze(-1)


class _OfScalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x[:, None]))).squeeze(-1)


@pytest.mark.parametrize(("net", "rows"), [(_FourierFeatures, 32), (_OfScalars, 1)])
def test_a_one_dim_batch_of_scalars_is_taken_whatever_its_length(fresh_param_store, net, rows):
    # the net makes rows of x's scalars before its first nn.Linear(F, .): a batch of F scalars
    # (32, a usual batch size; one row of a net of one feature) was refused as one example
    bnn = BayesianModule(net(), priors.Normal(1.0), likelihoods.Gaussian(rows, scale=0.1))
    x = torch.linspace(-1.0, 1.0, rows)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(x, x.sin())
    bnn(x, x.sin())
    prediction = bnn.predict(guide, x, quadrature="hadamard")
    assert prediction.mean.shape == (rows,)
    with torch.no_grad():  # the net at the guide's means: one output a row of x
        expected = torch.func.functional_call(bnn.net, guide.median(), (x,))
    # the Fourier net is linear in its weights, so the average over the nodes is its value there
    torch.testing.assert_close(prediction.mean, expected, atol=0.02, rtol=0)


def test_one_example_whose_outputs_have_its_length_is_refused_in_a_vectorized_pass(
    fresh_param_store,
):
    # nn.Linear(5, 4) then nn.Linear(4, 5): x of shape (5,) gives outputs of shape (5,), read as
    # 5 rows; the first layer was given x itself, in each pass of vmap over the nodes too
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 5))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(5, scale=0.1))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(ValueError) as info:
        bnn.predict(guide, torch.randn(5), quadrature="hadamard")
    assert str(info.value) == _one_example(
        "the net's first layer, nn.Linear(5, 4), takes 5 features"
    )


def test_documented_variance_ratios_of_one_quadrature_step_are_measured(float64_store):
    # docs/nn.md, "Prediction": Linear(4, 1), all scales 0.5, 2,000 random N(0, 1) inputs
    x = torch.randn(2000, 4, generator=torch.Generator().manual_seed(0))
    bnn = BayesianModule(nn.Linear(4, 1), priors.Normal(1.0), likelihoods.Gaussian(2000, 1e-3))
    guide = AutoMeanFieldNormal(bnn)
    guide(x, torch.zeros(2000))
    with torch.no_grad():
        guide.scales.weight = torch.full((1, 4), 0.5)
        guide.scales.bias = torch.full((1,), 0.5)
    exact = (x.square().sum(1) + 1) * 0.25 + 1e-6  # sum_i x_i^2 s_i^2 + scale^2
    text = " ".join(DOCS.joinpath("nn.md").read_text().split())
    for rule in ("hadamard", "blocked_simplex"):
        pyro.set_rng_seed(0)  # the blocked simplex's nodes are random
        ratio = bnn.predict(guide, x, quadrature=rule).variance[:, 0] / exact
        assert f"{ratio.min().item():.1g} to {ratio.max().item():.3g}" in text
        assert ratio.min().item() < 1e-3 and ratio.max().item() > 2.9
    for rule, kwargs in (("hadamard", {"steps": "period"}), ("gauss_hermite", {"num_points": 2})):
        ratio = bnn.predict(guide, x, quadrature=rule, **kwargs).variance[:, 0] / exact
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=1e-14, atol=0)
