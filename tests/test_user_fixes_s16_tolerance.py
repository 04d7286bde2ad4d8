"""Session 16: the probes' check of a vectorized pass compares at the precision of the values.

Found by putting ``docs/benchmarks.md``'s CPU scan under the docs test: on MNIST's 784-400-400-10
MLP at its guide's start, ``QuadratureELBO`` compared the float32 log joint of the vectorized
pass with single evaluations at ``rtol = atol = 1e-6``. The batched products sum in another
order, and the sums differed by ``7.6e-5`` relative (``-18425`` against ``-18426.4``), so the
ELBO fell back to a loop over the nodes with a warning (``vectorize=None``), or refused
(``vectorize=True``), on the network the package is benchmarked on.
"""

from __future__ import annotations

import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer.batched import BatchMismatch, evaluate_batch, probe_tolerance
from pyro_quadvi.nn import BayesianModule, likelihoods, priors


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.float32, 2.0**-11.5),  # sqrt(2^-23)
        (torch.float64, 1e-6),  # sqrt(2^-52) = 1.5e-8, raised to the floor
        (torch.bfloat16, 2.0**-3.5),  # sqrt(2^-7)
        (torch.int64, 1e-6),
    ],
)
def test_probe_tolerance_is_the_square_root_of_the_dtype_epsilon_at_least_1e_6(dtype, expected):
    assert probe_tolerance(dtype) == pytest.approx(expected, rel=1e-12)


def _mlp_fit(vectorize: bool | None) -> tuple[float, bool | None]:
    """One step on a 784-100-100-10 float32 MLP at its guide's start: the loss, and whether the
    ELBO evaluates the nodes in one pass."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = torch.rand(128, 784), torch.randint(0, 10, (128,))
    net = nn.Sequential(
        nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)
    )
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(8000))
    guide = AutoMeanFieldNormal(bnn)
    elbo = QuadratureELBO("hadamard", 4, vectorize=vectorize)
    loss = SVI(bnn, guide, QNVB(), elbo).step(x, y)
    return loss, elbo.vectorized(bnn, guide)


@pytest.mark.parametrize("vectorize", [None, True])
def test_an_mnist_sized_float32_mlp_runs_its_nodes_in_one_pass(vectorize):
    # before: vectorize=None warned and looped (-18420.8 vectorized, -18420.7 alone), True raised
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, vectorized = _mlp_fit(vectorize)
    assert vectorized is True
    looped, _ = _mlp_fit(False)
    # the loop's loss, to float32 rounding of an 18,000-nat sum
    assert loss == pytest.approx(looped, rel=1e-4)


def _scaled(factor: float):
    """A batched evaluation that is ``factor`` times the single one, in float32."""
    return lambda points: factor * points.sum(-1), lambda point: point.sum(-1)


def test_a_float32_pass_off_by_1e_3_is_still_refused_and_5e_5_taken():
    points = torch.linspace(1.0, 2.0, 12, dtype=torch.float32).reshape(4, 3)
    with pytest.raises(BatchMismatch, match="differ from single evaluations"):
        evaluate_batch(*_scaled(1 + 1e-3), points, True)
    values, decision = evaluate_batch(*_scaled(1 + 5e-5), points, True)
    assert decision.vectorized and torch.equal(values, (1 + 5e-5) * points.sum(-1))
    # float64 keeps 1e-6: 5e-5 is refused there
    with pytest.raises(BatchMismatch):
        evaluate_batch(*_scaled(1 + 5e-5), points.double(), True)
