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
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer.batched import BatchMismatch, evaluate_batch, probe_tolerance
from pyro_quadvi.infer.log_joint import LogJoint, latent_sites_of_model
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


def _offset(values: torch.Tensor, at: tuple[int, ...], by: float):
    """A batched evaluation equal to ``values`` at every point but one entry of each, off by
    ``by``; the single evaluation returns ``values[k]``."""

    def batched(points):
        out = values.clone()
        out[(slice(None), *at)] += by
        return out

    return batched, lambda point: values[int(point)]


def test_a_small_entry_beside_large_ones_is_compared_at_the_tensor_s_scale():
    # the trial's case: predict's probes compared logits elementwise, and a logit near 0 beside
    # logits of 1e5 moved by what they round to (21.7507 against 21.7351 next to 8.3e5)
    logits = torch.tensor([[8.3e5, 21.7351, -4.1e5], [7.9e5, 3.0, -2.2e5]]).expand(4, 2, 3)
    points = torch.arange(4)
    _, decision = evaluate_batch(*_offset(logits, (0, 1), 0.0156), points, True)
    assert decision.vectorized  # 0.0156 is 1.9e-8 of 8.3e5
    with pytest.raises(BatchMismatch, match=r"largest difference 415, 0.0005 of the largest"):
        evaluate_batch(*_offset(logits, (0, 1), 415.0), points, True)  # 5e-4 > 3.5e-4


def test_a_disagreement_at_rounding_scale_may_be_rounding_below_float64():
    values = torch.full((4,), -20000.0)
    points = torch.arange(4)
    with pytest.raises(BatchMismatch) as small:
        evaluate_batch(*_offset(values, (), 78.0), points, True)  # 3.9e-3: 11 tolerances
    message = str(small.value)
    assert "78, 0.0039 of the largest value 2e+04); a difference this small may" in message
    assert "run in float64 to tell" in message and "batch dims outside every plate" in message
    with pytest.raises(BatchMismatch) as large:
        evaluate_batch(*_offset(values, (), 2000.0), points, True)  # 0.1: 290 tolerances
    assert "ill-conditioned" not in str(large.value)
    with pytest.warns(UserWarning, match="a difference this small may also be the rounding"):
        evaluate_batch(*_offset(values, (), 78.0), points, None)
    # a float64 run is not told to run in float64 (5.5e-5 of the value: 55 tolerances)
    with pytest.raises(BatchMismatch) as wide:
        evaluate_batch(*_offset(values.double(), (), 1.1), points, True)
    assert "float64" not in str(wide.value) and "batch dims outside every plate" in str(wide.value)


def test_bool_values_are_compared_exactly():
    # the tensor-scale comparison subtracted bool tensors (a RuntimeError under vectorize=None)
    flags = torch.tensor([[True, False], [False, True], [True, True], [False, False]])
    values, decision = evaluate_batch(
        lambda points: flags, lambda k: flags[int(k)], torch.arange(4), True
    )
    assert decision.vectorized and torch.equal(values, flags)
    with pytest.raises(BatchMismatch):
        evaluate_batch(lambda points: ~flags, lambda k: flags[int(k)], torch.arange(4), True)


def _factor_model(n: int = 60_000):
    """The review's model: a soft sum-to-zero factor outside the groups' plate reads the group
    effects, so in one pass over the nodes it sums them over the nodes' dim as well; beside it,
    60,000 observations make a log joint of about 94,000 nats."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    y = 0.5 * x + torch.randn(n, generator=torch.Generator().manual_seed(1))
    groups = torch.arange(n) % 30

    def model():
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("groups", 30):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
            c = pyro.sample("c", dist.Normal(0.0, 1.0))
        pyro.factor("sum_to_zero", -0.5 * (c.sum(-1) / 0.5) ** 2)
        with pyro.plate("data", n):
            pyro.sample("y", dist.Normal(a[..., groups] + b * x, 1.0), obs=y)

    return model


def test_a_wrong_term_hidden_in_a_large_log_joint_is_refused_site_by_site():
    # the wrong factor is 7 nats of 94,000 (7.9e-5 of the total, inside the total's float32
    # tolerance, so the pass was taken and the fit went wrong); compared site by site it is 41
    # times its own value
    pyro.clear_param_store()
    model = _factor_model()
    guide = AutoMeanFieldNormal(model)
    elbo = QuadratureELBO(vectorize=True, generator=torch.Generator().manual_seed(1))
    with pytest.raises(BatchMismatch, match=r"\['sum_to_zero'\] at point 0: -7.56 vectorized"):
        elbo.loss(model, guide)
    with pytest.warns(UserWarning, match="sum_to_zero"):
        QuadratureELBO(generator=torch.Generator().manual_seed(1)).loss(model, guide)


def test_a_hessian_through_the_node_by_node_prior_is_refused_not_silently_wrong():
    # torch's once_differentiable returned a gradient without a graph when the incoming one had
    # none: the Hessian lost the prior's -1/4, silently
    dim = 70_000

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(dim), 2.0).to_event(1))
        pyro.sample("y", dist.Normal(w[..., :5] ** 3, 1.0).to_event(1), obs=torch.ones(5))

    sites = latent_sites_of_model(model)
    z = torch.full((1, dim), 0.5, requires_grad=True)
    (grad,) = torch.autograd.grad(LogJoint(model, sites)(z).sum(), z, create_graph=True)
    (hessian,) = torch.autograd.grad(grad[0, 10], z)
    assert hessian[0, 10].item() == -0.25  # torch's log_prob: the prior's curvature
    lean = LogJoint(model, sites, node_by_node=True)
    with pytest.raises(RuntimeError, match="no second derivative: for a create_graph=True"):
        torch.autograd.grad(lean(z).sum(), z, create_graph=True)
