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
        # 5^2 grid nodes, 3 probes of the vectorized pass, the centre
        ({"center": "none", "num_points": 5}, 25 + 3 + 1),
        ({"center": "none", "num_points": 5, "chunk_size": 4}, 25 + 3 + 1),  # 7 chunks
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
    assert result.num_evaluations == 9 + 3 + 1
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
