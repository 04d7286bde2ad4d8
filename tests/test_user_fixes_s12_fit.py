"""A tutorial writer's trial of ``fit`` and ``predict``: data in forms ``fit`` took silently or
failed on obscurely (a bare tensor trained one row per step without labels; ``[x, y]`` is two
batches), inputs of another float type than the net, and ``predict``'s unchecked arguments."""

from __future__ import annotations

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, fit, likelihoods, priors

N = 12


def _svi():
    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = BayesianModule(
        nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)),
        priors.Normal(1.0),
        likelihoods.Gaussian(N, scale=0.5),
    )
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    return bnn, guide, SVI(bnn, guide, QNVB(), QuadratureELBO("hadamard"))


def _data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(N, 2, generator=generator)
    return x, x.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x, y: x, r"^fit: data is a Tensor; pass the arguments of a step as a tuple"),
        (lambda x, y: x.numpy(), r"^fit: data is a ndarray; pass"),
        (lambda x, y: {"x": x, "y": y}, r"^fit: data is a dict; pass"),
        (lambda x, y: [x, y], r"^fit: a BayesianModule's step takes \(x, y\), got a batch of 1"),
        (lambda x, y: [{"x": x, "y": y}], r"^fit: a batch is a dict \(keys \['x', 'y'\]\)"),
        (lambda x, y: [(x, y, torch.ones(N))], r"got a batch of 3 item\(s\)"),
    ],
    ids=["tensor", "array", "dict", "list [x, y]", "dict batches", "weights"],
)
def test_data_in_a_form_fit_cannot_take_is_refused_before_any_step(make, match):
    x, y = _data()
    _, _, svi = _svi()
    with pytest.raises(TypeError, match=match):
        fit(svi, make(x, y), 3, progress=False)
    assert list(pyro.get_param_store().keys()) == []  # no step ran: the guide was never built


def test_fit_takes_numpy_integers_for_its_counts():
    x, y = _data()
    _, _, svi = _svi()
    history = fit(svi, (x, y), np.int64(3), every=np.int64(2), progress=False)
    assert len(history.loss) == 3


def test_inputs_of_another_float_type_than_the_net_are_named():
    # float64 data (NumPy's) on a float32 net: torch's "expected scalar type Float but found
    # Double" from inside the net, in predict and in every step
    x, y = _data()
    bnn, guide, svi = _svi()
    svi.step(x, y)
    with pytest.raises(
        ValueError, match=r"^x is torch.float64 \(NumPy's float64, say\) but the net's "
    ):
        bnn.predict(guide, x.double())
    with pytest.raises(ValueError, match=r"convert the inputs, x.to\(torch.float32\)"):
        svi.step(x.double(), y.double())


def test_predicts_unchecked_arguments_are_refused():
    x, y = _data()
    bnn, guide, svi = _svi()
    svi.step(x, y)
    with pytest.raises(TypeError, match=r"num_samples must be an int >= 1, got 2.5"):
        bnn.predict(guide, x, num_samples=2.5)
    with pytest.raises(TypeError, match=r"num_samples must be an int >= 1, got True"):
        bnn.predict(guide, x, num_samples=True)
    with pytest.raises(ValueError, match=r"num_points=5 is the size of a quadrature rule"):
        bnn.predict(guide, x, num_points=5)
    assert bnn.predict(guide, x, quadrature="hadamard", num_points=4).outputs.shape[0] == 4


def test_the_metrics_say_how_to_pass_binary_probabilities_and_float_labels():
    from pyro_quadvi import metrics

    p = torch.tensor([0.2, 0.9, 0.6])
    y = torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match=r"torch.stack\(\[1 - p, p\], dim=1\)"):
        metrics.accuracy(p, y)
    probs = torch.stack([1 - p, p], dim=1)
    assert metrics.accuracy(probs, y).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"got dtype torch.float32 \(labels stored as numbers: "):
        metrics.accuracy(probs, y.float())


def test_the_data_checks_hold_for_wrapped_models_datasets_and_zero_steps():
    from pyro import poutine
    from torch.utils.data import TensorDataset

    x, y = _data()
    bnn, guide, _ = _svi()
    qnvb = QNVB()
    for model in (poutine.scale(bnn, scale=0.5), qnvb.anneal(bnn)):
        svi = SVI(model, guide, qnvb, QuadratureELBO("hadamard"))
        with pytest.raises(TypeError, match=r"a BayesianModule's step takes \(x, y\)"):
            fit(svi, [x, y], 2, progress=False)
    svi = SVI(bnn, guide, qnvb, QuadratureELBO("hadamard"))
    with pytest.raises(TypeError, match=r"data is a TensorDataset.*wrap the dataset in a"):
        fit(svi, TensorDataset(x, y), 2, progress=False)
    with pytest.raises(TypeError, match=r"^fit: data is a Tensor"):
        fit(svi, x, 0, progress=False)  # refused before any step, even with none to take


def test_a_net_that_converts_its_inputs_runs_on_them_and_predict_takes_numpy_counts():
    class Converting(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def forward(self, x):
            return self.layer(x.float())

    x, y = _data()
    pyro.clear_param_store()
    bnn = BayesianModule(Converting(), priors.Normal(1.0), likelihoods.Gaussian(N, scale=0.5))
    guide = AutoMeanFieldNormal(bnn)
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO("hadamard"))
    loss = svi.step(x.double(), y)  # the float64 inputs are the net's own business
    assert torch.isfinite(torch.tensor(loss))
    assert bnn.predict(guide, x.double(), num_samples=np.int64(8)).outputs.shape == (8, N, 1)
