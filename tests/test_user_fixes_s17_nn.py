"""Fixes of the session 17 bad-input sweep on the networks and the plain-torch optimizers: NaN or
infinite inputs refused by the model and by ``predict`` (naming the rows), labels outside a
likelihood's support named with the fix, an empty batch, integer inputs, a likelihood that is no
``Likelihood``, a site name that is no string; the optimizers' batch and mean-field diagnosis of a
non-finite loss or gradient, their ``generator`` checked when built, and settings beyond the
parameters' dtype refused by name."""

from __future__ import annotations

import math

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.nn import (
    BayesianModule,
    WHVILinear,
    fit,
    likelihoods,
    predict,
    priors,
    sparse_network,
)
from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer, module_loss

GEN = torch.Generator().manual_seed(0)
X = torch.randn(16, 3, generator=GEN)
Y = torch.randn(16, 1, generator=GEN)
LABELS = torch.randint(0, 3, (16,), generator=GEN)
BITS = torch.randint(0, 2, (16, 1), generator=GEN).float()


def _net(outputs: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, outputs))


def _svi(likelihood, outputs: int = 1) -> tuple[BayesianModule, SVI]:
    pyro.clear_param_store()
    bnn = BayesianModule(_net(outputs), priors.Normal(1.0), likelihood)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    return bnn, SVI(bnn, guide, QNVB(), QuadratureELBO())


def _with(x: torch.Tensor, row: int, col: int, value: float) -> torch.Tensor:
    x = x.clone()
    x[row, col] = value
    return x


# -- the model's and predict's inputs ------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_step_refuses_nonfinite_x_naming_the_rows_not_the_guide(value):
    # NaN blamed "the guide's initial values"; inf only warned of non-finite gradients
    _, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    x = _with(_with(X, 2, 1, value), 7, 0, value)
    with pytest.raises(ValueError) as caught:
        svi.step(x, Y)
    message = str(caught.value)
    assert message.startswith("BayesianModule: x holds NaN or infinite values at rows [2, 7]")
    assert f"(2 of 16 rows; first: x[2, 1] = {value!r})" in message
    assert "initial values" not in message and "torch.nan_to_num" in message


def test_predict_refuses_nonfinite_x_naming_the_rows():
    # predict gave NaN means and variances silently
    bnn, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    svi.step(X, Y)
    x = _with(X[:5], 3, 2, math.nan)
    with pytest.raises(ValueError, match=r"^predict: x holds NaN .* at rows \[3\] \(1 of 5 rows; "):
        predict(bnn, svi.guide, x, num_samples=4)
    with pytest.raises(ValueError, match=r"first: x\[1, 0\] = inf\)"):
        predict(bnn, svi.guide, _with(X[:5], 1, 0, math.inf), num_samples=4)
    with pytest.raises(TypeError, match=r"predict: x must be a tensor of B rows.*got None"):
        predict(bnn, svi.guide, None, num_samples=4)
    assert torch.isfinite(predict(bnn, svi.guide, X[:5], num_samples=4).mean).all()


def test_integer_x_is_named_as_float64_x_is():
    _, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    with pytest.raises(ValueError, match=r"x is torch.int64 \(integers\) but the net's parameters"):
        svi.step((X * 3).long(), Y)


def test_an_empty_batch_is_refused_by_name():
    # Pyro's plate divided by the batch's size: "float division by zero"
    _, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    with pytest.raises(ValueError, match="Gaussian likelihood: the batch has no rows"):
        svi.step(X[:0], Y[:0])


def test_the_likelihood_and_its_site_name_are_checked_when_built():
    with pytest.raises(TypeError, match=r"likelihood must be a pyro_quadvi\.nn\.likelihoods\.Lik"):
        BayesianModule(_net(), priors.Normal(1.0), None)
    for name in (None, ["obs"], ""):
        with pytest.raises(TypeError, match=r"Categorical: name must be a non-empty string"):
            likelihoods.Categorical(100, name=name)


# -- labels outside the support -------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels, first",
    [
        (torch.where(LABELS == 0, 3, LABELS), "= 3)"),
        (torch.where(LABELS == 0, -1, LABELS), "= -1)"),
        (torch.where(LABELS == 0, 0.5, LABELS.double()), "= 0.5)"),
        (torch.where(LABELS == 0, math.nan, LABELS.double()), "= nan)"),
    ],
)
def test_categorical_labels_outside_the_classes_are_named(labels, first):
    _, svi = _svi(likelihoods.Categorical(100), outputs=3)
    rows = (LABELS == 0).nonzero().flatten().tolist()
    with pytest.raises(ValueError) as caught:
        svi.step(X, labels)
    message = str(caught.value)
    assert message.startswith(
        "Categorical likelihood (site 'obs'): y must hold class indices, whole numbers 0 to 2"
    )
    assert f"rows [{', '.join(map(str, rows))}]" in message and first in message
    assert "pass y - 1" in message


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, math.nan])
def test_bernoulli_targets_outside_0_1_are_named(value):
    _, svi = _svi(likelihoods.Bernoulli(100))
    y = torch.where(BITS > 0, value, 0.0)
    with pytest.raises(ValueError) as caught:
        svi.step(X, y)
    message = str(caught.value)
    assert message.startswith("Bernoulli likelihood (site 'obs'): y must hold 0 / 1 labels")
    assert f"= {value!r})" in message and "(y + 1) / 2" in message


def test_gaussian_nonfinite_y_is_named():
    _, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    with pytest.raises(ValueError, match=r"^Gaussian likelihood .* rows \[4\] .* y\[4, 0\] = inf"):
        svi.step(X, _with(Y, 4, 0, math.inf))


def test_labels_are_checked_without_pyros_validation_too():
    # an ELBO that names a site runs the model again without validation: the check is always made
    _, svi = _svi(likelihoods.Categorical(100), outputs=3)
    with pyro.validation_enabled(False), pytest.raises(ValueError, match=r"^Categorical likel"):
        svi.step(X, torch.where(LABELS == 0, 3, LABELS))


@pytest.mark.parametrize(
    "likelihood, outputs, y",
    [
        (likelihoods.Categorical(100), 3, LABELS),
        (likelihoods.Categorical(100), 3, LABELS.double()),
        (likelihoods.Bernoulli(100), 1, BITS.bool()),
        (likelihoods.Bernoulli(100), 1, BITS.long()),
    ],
)
def test_labels_in_the_support_train(likelihood, outputs, y):
    _, svi = _svi(likelihood, outputs)
    assert math.isfinite(svi.step(X, y))


# -- QNVBOptimizer and SparseQNVBOptimizer ------------------------------------------------------


def _mse(out, y):
    return F.mse_loss(out, y)


def test_one_pass_step_refuses_an_infinite_input_whose_gradient_is_nan():
    # the loss is finite (tanh saturates) and only a warning of non-finite gradients came
    net = _net()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=20.0)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError) as caught:
        optimizer.step(loss_fn=module_loss(net, _mse), batch=(_with(X, 5, 2, math.inf), Y))
    message = str(caught.value)
    assert "batch[0] at rows [5] (1 of 16 rows; first: batch[0][5, 2] = inf)" in message
    assert "the loss is finite but its gradient is not" in message
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    with pytest.raises(ValueError, match=r"batch\[1\] at rows \[0\] .* and the loss is nan"):
        optimizer.step(loss_fn=module_loss(net, _mse), batch=(X, _with(Y, 0, 0, math.nan)))


def test_one_pass_step_takes_a_batch_whose_infinities_leave_loss_and_gradient_finite():
    # an additive mask of -inf, as attention takes one: the loss and its gradient are finite
    net = _net()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=20.0)
    mask = torch.zeros(16, 1).masked_fill(torch.arange(16).unsqueeze(-1) % 4 == 0, -math.inf)

    def loss_fn(params, x, y, mask):
        out = torch.func.functional_call(net, params, (x,))
        keep = torch.isfinite(mask)
        return ((out - y) ** 2).masked_fill(~keep, 0.0).sum() / keep.sum()

    loss = optimizer.step(loss_fn=loss_fn, batch=(X, Y, mask))
    assert math.isfinite(float(loss)) and optimizer.num_steps == 1


def test_a_nonfinite_mean_field_is_named_not_the_data():
    net = _net()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=20.0)
    optimizer.step(loss_fn=module_loss(net, _mse), batch=(X, Y))
    first = next(net.parameters())
    optimizer.state[first]["sigma"] = torch.full_like(first, math.inf)
    with pytest.raises(ValueError) as caught:
        optimizer.step(loss_fn=module_loss(net, _mse), batch=(X, Y))
    message = str(caught.value)
    assert (
        "mean field that is not finite: sigma is inf at 12 coordinates of a parameter of "
        "shape (4, 3)" in message
    )
    assert "batch" not in message


def test_a_closure_of_finite_data_whose_model_overflows_is_told_so():
    net = _net().double()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=20.0)

    def loss_fn(params, x, y):
        return _mse(torch.func.functional_call(net, params, (x,)), y) * math.inf

    with pytest.raises(ValueError, match=r"\(the batch is finite: a model that overflows there"):
        optimizer.step(loss_fn=loss_fn, batch=(X.double(), Y.double()))


@pytest.mark.parametrize("generator", [1, "cpu", [1]])
def test_generators_are_checked_when_the_optimizers_are_built(generator):
    net = _net()
    with pytest.raises(TypeError, match=r"^SparseQNVBOptimizer: generator must be a torch\.Gen"):
        SparseQNVBOptimizer(net.parameters(), num_cases=100, steps_per_epoch=4, generator=generator)
    with pytest.raises(TypeError, match=r"^QNVBOptimizer: generator must be a torch\.Generator"):
        QNVBOptimizer(net.parameters(), generator=generator)


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            {"initial_lr": 1e300, "max_lr": 1e300},
            r"initial_lr=1e\+300 gives the initial curvature 1 / initial_lr",
        ),
        ({"num_cases": 1e300}, r"num_cases / steps_per_epoch=2.5e\+299 is beyond the range"),
        ({"prior_precision": 1e300}, r"prior_precision / steps_per_epoch=2.5e\+299 is beyond"),
    ],
)
def test_sparse_settings_beyond_float32_are_refused_when_built(setting, message):
    # initial_lr=1e300 blamed "a NaN or infinity in the batch"; the others only warned
    kwargs = {"num_cases": 100, "steps_per_epoch": 4, **setting}
    with pytest.raises(ValueError, match="^SparseQNVBOptimizer: " + message):
        SparseQNVBOptimizer(_net().parameters(), **kwargs)
    SparseQNVBOptimizer(_net().double().parameters(), **kwargs)  # float64 holds them


@pytest.mark.parametrize("name", ["init_sigma", "sigma_max"])
def test_qnvb_settings_beyond_float32_are_refused_by_name(name):
    with pytest.raises(ValueError, match=f"^QNVBOptimizer: {name}=1e\\+300 is beyond the range"):
        QNVBOptimizer(_net().parameters(), **{name: 1e300})
    net = _net()
    optimizer = QNVBOptimizer(net.named_parameters())
    optimizer.param_groups[0][name] = 1e300  # as a scheduler or a user may set it
    with pytest.raises(ValueError, match=f"parameter group 0: {name}=1e\\+300 is beyond"):
        optimizer.step(loss_fn=module_loss(net, _mse), batch=(X, Y))
    QNVBOptimizer(_net().double().parameters(), **{name: 1e300})


def test_finite_data_whose_sum_overflows_passes_every_check():
    # the checks sum the data first (one fast pass) and look at each entry only where the sum is
    # not finite: a sum that overflows on finite entries is no error
    big = torch.full((16, 3), 3e38)
    _, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    assert math.isfinite(svi.step(big, Y))  # tanh saturates
    likelihoods.Gaussian(100).check_observations(big, torch.zeros(16, 3))  # finite: no error
    net = _net()
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=20.0)

    def loss_fn(params, x, y, spare):
        return _mse(torch.func.functional_call(net, params, (x,)), y)

    optimizer.step(loss_fn=loss_fn, batch=(X, Y, big))
    assert optimizer.num_steps == 1


# -- settings of the networks and of fit ----------------------------------------------------------


def test_scales_beyond_float32_are_refused_by_name():
    # 1e300 failed in torch: "value cannot be converted to type float without overflow"
    _, svi = _svi(likelihoods.Gaussian(100, scale=1e300))
    with pytest.raises(ValueError, match=r"^Gaussian likelihood: scale=1e\+300 is beyond the ra"):
        svi.step(X, Y)
    with pytest.raises(ValueError, match=r"^WHVILinear: prior_scale=1e\+300 is beyond the range"):
        WHVILinear(3, 4, prior_scale=1e300)
    WHVILinear(3, 4, prior_scale=1e300, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["0.1", [0.1], torch.ones(2)])
def test_gaussian_scale_of_another_type_is_refused_by_name(scale):
    with pytest.raises(TypeError, match=r"^Gaussian: scale must be a number > 0"):
        likelihoods.Gaussian(100, scale=scale)
    assert likelihoods.Gaussian(100, scale=torch.tensor(0.5)).scale == 0.5


def test_hide_that_is_no_list_of_names_is_refused_by_name():
    with pytest.raises(TypeError, match=r"hide must be an iterable of parameter names .* 1 \(int"):
        BayesianModule(_net(), priors.Normal(1.0), likelihoods.Gaussian(100), hide=1)
    with pytest.raises(TypeError, match=r"hide must hold parameter names .* got \[0\]"):
        BayesianModule(_net(), priors.Normal(1.0), likelihoods.Gaussian(100), hide=["0.bias", 0])


def test_fit_refuses_an_svi_data_or_metrics_of_the_wrong_kind_by_name():
    _, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    with pytest.raises(TypeError, match=r"^fit: svi must be a pyro\.infer\.SVI .* got None"):
        fit(None, (X, Y), 1, progress=False)
    for data in (None, 1):
        with pytest.raises(TypeError, match=r"^fit: data must be the arguments of a step"):
            fit(svi, data, 1, progress=False)
    for metrics in (1, "nll", [lambda: 0.0], {"nll": 0.0}):
        with pytest.raises(TypeError, match=r"^fit: metrics must be a dict of name -> a func"):
            fit(svi, (X, Y), 1, metrics=metrics, progress=False)


@pytest.mark.parametrize("threshold", [None, "0.5", torch.full((2,), 0.5)])
def test_sparse_network_threshold_of_another_type_is_refused_by_name(threshold):
    pyro.clear_param_store()
    bnn = BayesianModule(_net(), priors.SpikeSlab(0.3), likelihoods.Gaussian(100, scale=0.1))
    guide = AutoSpikeSlab(bnn)
    guide(X, Y)
    with pytest.raises(TypeError, match=r"^sparse_network: threshold must be a number in \[0, 1"):
        sparse_network(bnn, guide, threshold)


def test_x_and_y_of_other_rows_name_the_likelihood_and_the_fix():
    _, svi = _svi(likelihoods.Gaussian(100, scale=0.1))
    with pytest.raises(ValueError, match=r"^Gaussian likelihood: y has 10 rows, x gave 16: pass"):
        svi.step(X, Y[:10])
