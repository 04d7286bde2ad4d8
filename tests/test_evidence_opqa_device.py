"""OPQA evidence with the model's data on a device other than the CPU, checked on ``meta``.

On PyTorch's ``meta`` device (:mod:`pyro_quadvi.testing.meta`) a CPU tensor among device tensors
raises as it would on CUDA, and :class:`FakeSync` answers the reads of values with made-up ones:
the evidence of a meta run means nothing, but every point where the model is evaluated must reach
it on the data's device, and the evaluations must be those of the same run on the CPU. The values
themselves are compared on a GPU in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_quadvi import AutoMeanFieldNormal, opqa_evidence
from pyro_quadvi.evidence.posterior import OPQAPosterior
from pyro_quadvi.infer import latent_sites_of_model
from pyro_quadvi.testing.evidence_models import linear_regression, regression_data
from pyro_quadvi.testing.meta import FakeSync

META = torch.device("meta")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh():
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MAP search on made-up values warns
        yield
    pyro.clear_param_store()


class _RecordingRegression:
    """Linear regression with its prior on the data's device, recording where each point (the
    latent ``beta`` of one run of the model, or of a vectorized pass) is evaluated."""

    def __init__(self) -> None:
        self.points: list[tuple[torch.device, int]] = []  # (device, number of points)

    def __call__(self, X, y, prior_scale=1.5, noise=0.4) -> None:
        zero = torch.zeros(X.shape[1], dtype=X.dtype, device=X.device)
        beta = pyro.sample("beta", dist.Normal(zero, prior_scale).to_event(1))
        self.points.append((beta.device, beta.numel() // X.shape[1]))
        with pyro.plate("data", X.shape[0], device=X.device):
            pyro.sample("y", dist.Normal((X * beta).sum(-1), noise), obs=y)


def _run(device: torch.device, **options):
    X, y = regression_data(n=20, p=2)
    model = _RecordingRegression()
    with FakeSync() as syncs:
        result = opqa_evidence(model, X.to(device), y.to(device), **options)
    return model, result, syncs


@pytest.mark.parametrize(
    "options, evaluations",
    [
        # 5^2 grid nodes, 3 probes of the vectorized pass and its mixing check's pass over
        # them, the centre
        ({"center": "none", "num_points": 5}, 25 + 3 + 3 + 1),
        ({"center": "none", "num_points": 5, "chunk_size": 4}, 25 + 3 + 3 + 1),  # 7 chunks
        ({"center": "none", "num_points": 3, "vectorize": False}, 9 + 1),
    ],
    ids=["one-chunk", "chunks", "loop"],
)
def test_every_point_is_evaluated_on_the_data_device_as_on_the_cpu(options, evaluations):
    """Before: the fixed weight, the nodes and the grid points were made on the CPU, and the
    first run of the model at the centre raised torch's device-mixing error in the model."""
    on_cpu, cpu_result, _ = _run(CPU, **options)
    on_meta, meta_result, syncs = _run(META, **options)
    assert {device for device, _ in on_meta.points} == {META}
    # the same evaluations, point for point, as the CPU run: 2 prior draws (the sites and the
    # checks), the run that finds the plates, and the evaluations the result counts
    assert [k for _, k in on_meta.points] == [k for _, k in on_cpu.points]
    assert sum(k for _, k in on_meta.points) == meta_result.num_evaluations + 3
    assert meta_result.num_evaluations == cpu_result.num_evaluations == evaluations
    # the grid's values, the loc and the scale come back in one copy each
    assert sum(n for (op, _), n in syncs.counts.items() if op == "_to_copy") == 3
    # the result lives on the CPU, as for a CPU model
    for tensor in (
        meta_result.normalized_coefficients,
        meta_result.posterior.loc,
        meta_result.posterior.scale_tril,
        meta_result.diagnostics["loc"],
    ):
        assert tensor.device == CPU


@pytest.mark.parametrize("start_from_guide", [False, True])
def test_the_laplace_search_and_its_hessian_run_on_the_data_device(start_from_guide):
    """The MAP start (zeros, or a guide's loc on the device), every step of L-BFGS, the Hessian
    and the grid reach the model on ``meta``. (The search's length depends on the values, which
    a meta run makes up: only the devices and the count of the points are compared.)"""
    X, y = regression_data(n=20, p=2)
    X, y = X.to(META), y.to(META)
    model = _RecordingRegression()
    guide = None
    if start_from_guide:
        guide = AutoMeanFieldNormal(model)
        with FakeSync():
            guide(X, y)
        assert guide.locs.beta.device == META
    with FakeSync():
        result = opqa_evidence(model, X, y, num_points=3, center="laplace", guide=guide)
    runs_of_the_guide = 1 if start_from_guide else 0
    assert {device for device, _ in model.points} == {META}
    assert result.diagnostics["weight_evaluations"] > 3  # the start, L-BFGS steps, the Hessian
    assert sum(k for _, k in model.points) == result.num_evaluations + 3 + runs_of_the_guide
    assert result.normalized_coefficients.device == CPU


def test_a_guide_fitted_on_the_cpu_lends_its_weight_on_the_data_device():
    """``center="guide"``: the guide's checks read its CPU values (a scale that moved passes),
    then its loc and scale go to the model's device for the grid: 3^2 nodes, 3 probes, the
    centre, all there."""
    X, y = regression_data(n=20, p=2)
    model = _RecordingRegression()
    guide = AutoMeanFieldNormal(model)
    guide(X, y)
    store = pyro.get_param_store()
    store["AutoMeanFieldNormal.scales.beta"] = torch.full((2,), 0.2, dtype=X.dtype)
    model.points.clear()
    with FakeSync():
        result = opqa_evidence(
            model, X.to(META), y.to(META), num_points=3, center="guide", guide=guide
        )
    assert {device for device, _ in model.points} == {META}
    assert result.num_evaluations == 9 + 3 + 3 + 1  # the probes, alone and in the mixing check
    assert sum(k for _, k in model.points) == result.num_evaluations + 3


def test_a_prior_on_the_cpu_beside_data_on_the_device_is_refused_naming_the_site():
    """``evidence_models.linear_regression`` builds its prior's zeros on the CPU: with the data
    on the device the model cannot run, and the error says which latent was drawn where."""
    X, y = regression_data(n=20, p=2)
    with pytest.raises(ValueError, match=r"mixes devices.*'beta' on cpu.*device=X\.device"):
        opqa_evidence(linear_regression, X.to(META), y.to(META), num_points=3)


def test_latents_drawn_on_two_devices_are_refused_naming_both():
    """A model that runs with its latents on two devices (nothing mixes them in the run that
    finds them) would meet them together at the grid points, on one device."""

    def model(x, w):
        a = pyro.sample("a", dist.Normal(torch.zeros(2, device=META), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(a, 1.0).to_event(1), obs=x)
        pyro.sample("w", dist.Normal(b, 1.0).to_event(1), obs=w)

    with pytest.raises(ValueError, match=r"2 devices: 'a' on meta, 'b' on cpu.*device=X\.device"):
        opqa_evidence(model, torch.zeros(2, device=META), torch.zeros(2), num_points=3)


def _bounded_model(y):
    """A location with a ``Uniform`` prior, whose bounds are on the data's device (its transform,
    ``Sigmoid`` then ``Affine``, holds them), a ``HalfNormal`` noise and a ``LogNormal`` rate
    (both ``Exp``, which holds no tensor; a ``Gamma``'s draw has no ``meta`` kernel before torch
    2.13)."""
    one = torch.ones((), dtype=y.dtype, device=y.device)
    mu = pyro.sample("mu", dist.Uniform(0.5 * one, 3.0 * one))
    noise = pyro.sample("noise", dist.HalfNormal(one))
    rate = pyro.sample("rate", dist.LogNormal(0.0 * one, one))
    with pyro.plate("data", len(y), device=y.device):
        pyro.sample("y", dist.Normal(mu, noise), obs=y)
    pyro.sample("count", dist.Poisson(rate), obs=3.0 * one)


BOUNDED_DATA = torch.tensor([1.2, 1.9, 1.4, 2.2, 1.7, 1.1], dtype=torch.float64)


def _bounded_values(device: torch.device) -> dict[str, torch.Tensor]:
    """Four values of each latent of :func:`_bounded_model`, on ``device``."""
    values = {"mu": [0.7, 1.5, 2.0, 2.9], "noise": [0.2, 0.5, 1.0, 2.0], "rate": [0.5, 2, 3, 6]}
    return {name: torch.tensor(v, dtype=torch.float64, device=device) for name, v in values.items()}


def test_the_posterior_of_a_bounded_model_on_the_device_works_on_the_cpu():
    """Before: the posterior's sites kept the transforms built from the priors on the device (the
    ``Uniform``'s bounds in its ``Affine`` part), and ``log_prob`` and ``marginals`` met them with
    CPU tensors: torch's device-mixing error (a copy out of ``meta`` without ``FakeSync``). Now
    they are copied to the CPU with the rest of the posterior: two more copies (the ``Uniform``'s
    loc and scale) than the grid's values, the loc and the scale; the two ``Exp`` sites add none."""
    with FakeSync() as syncs:
        result = opqa_evidence(_bounded_model, BOUNDED_DATA.to(META), num_points=3, center="none")
    posterior = result.posterior
    # after the copies, nothing in the posterior touches the device again: no FakeSync from here
    assert posterior.log_prob(_bounded_values(CPU)).shape == (4,)
    marginals = posterior.marginals(num=7)
    assert list(marginals) == ["mu", "noise", "rate"]
    for marginal in marginals.values():
        for tensor in (marginal.values, marginal.density, marginal.unconstrained_values):
            assert (tensor.shape, tensor.device) == ((7,), CPU)
    assert sum(n for (op, _), n in syncs.counts.items() if op == "_to_copy") == 3 + 2
    affine = posterior.sites[0].transform.parts[1]
    assert (affine.loc.device, affine.scale.device) == (CPU, CPU)
    # the values may come from the device: each is copied to the CPU, once
    with FakeSync() as syncs:
        assert posterior.log_prob(_bounded_values(META)).device == CPU
    assert syncs.total == 3


def test_a_posterior_built_on_the_device_stays_there():
    """``OPQAPosterior`` built by hand with its loc on the device: the scale, the coefficients and
    the sites' transforms are copied there, and every density, moment and marginal is computed
    there. Before: ``marginals`` made its identity matrix, its grid and its Gauss-Hermite nodes on
    the CPU, and mixed them with the device's loc (a CPU ``scale_tril`` would have mixed too)."""
    sites = latent_sites_of_model(_bounded_model, BOUNDED_DATA)  # on the CPU
    coefficients = torch.zeros((3,) * 3, dtype=torch.float64)
    coefficients[0, 0, 0], coefficients[1, 0, 2] = 0.6, 0.8
    with FakeSync() as syncs:
        posterior = OPQAPosterior(
            sites,
            torch.zeros(3, device=META, dtype=torch.float64),
            torch.eye(3, dtype=torch.float64),
            coefficients,
        )
        affine = posterior.sites[0].transform.parts[1]
        tensors = (affine.loc, affine.scale, posterior.scale_tril, posterior.coefficients)
        assert {tensor.device for tensor in tensors} == {META}
        assert posterior.log_prob(_bounded_values(CPU)).device == META
        assert posterior.mean_unconstrained.device == META
        marginals = posterior.marginals(num=5)
        for marginal in marginals.values():
            for tensor in (marginal.values, marginal.density, marginal.unconstrained_density):
                assert (tensor.shape, tensor.device) == ((5,), META)
    # nothing came back to the CPU but the grid's centre and spread of each coordinate (two
    # numbers each) and whether any coefficient counts, for their top degree (one)
    assert {op for op, _ in syncs.counts} == {"_local_scalar_dense"}
    assert syncs.total == 2 * 3 + 1
