"""evaluate_batch: one meaning of vectorize; only broadcasting failures fall back; DecisionCache."""

from __future__ import annotations

import copy
import gc
import inspect
import pickle
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn
from torch.func import vmap

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, to_inference_data
from pyro_quadvi.evidence import opqa_evidence
from pyro_quadvi.infer import GumbelSpikeSlabELBO, LogJoint, latent_sites_of_model
from pyro_quadvi.infer.batched import (
    BatchDecision,
    BatchMismatch,
    DecisionCache,
    evaluate_batch,
    is_broadcast_error,
)
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer


def raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as error:  # the test inspects whatever is raised
        return error
    raise AssertionError("nothing was raised")


def plate_mismatch():
    with pyro.plate("data", 5):
        pyro.sample("x", dist.Normal(torch.zeros(3), 1.0), obs=torch.zeros(3))


GRU = nn.GRU(3, 3)  # built outside vmap: its initialization is random

BROADCAST = {
    "size must match": lambda: torch.ones(3) + torch.ones(4),
    "matmul": lambda: torch.ones(2, 3) @ torch.ones(2, 3),
    "nn.Linear": lambda: nn.Linear(3, 1)(torch.ones(2, 4)),
    "batched matmul": lambda: torch.ones(20, 3) @ torch.ones(8, 1, 3),
    "batched nn.Linear weight": lambda: nn.functional.linear(torch.ones(2, 3), torch.ones(4, 1, 3)),
    "conv": lambda: nn.Conv1d(1, 1, 2)(torch.ones(2, 3, 1, 5)),
    "reshape": lambda: torch.ones(6).reshape(4, 2),
    "expand": lambda: torch.ones(3).expand(4, 2),
    # a fixed expand([G, n]) of a distribution whose parameters the pass holds with the nodes'
    # dim in front
    "expand to fewer dims": lambda: torch.ones(3, 6, 1).expand([6, 4]),
    # control flow on a latent's value (if mu > 0, assert mu <= 0.2), given the points
    "bool of a batch": lambda: bool(torch.ones(3) > 0),
    "cat": lambda: torch.cat([torch.ones(2, 3), torch.ones(2, 4)]),
    "index": lambda: torch.ones(3)[0, 1],
    "dim out of range": lambda: torch.ones(3).sum(2),
    # vector or matrix operations given a batch (Pyro's examples/lkj.py: diag, mm)
    "diag": lambda: torch.diag(torch.ones(2, 3, 3)),
    "mm": lambda: torch.mm(torch.ones(2, 3, 3), torch.ones(3, 3)),
    "mm's second": lambda: torch.mm(torch.ones(3, 3), torch.ones(2, 3, 3)),
    "addmm": lambda: torch.addmm(torch.ones(3, 3), torch.ones(2, 3, 3), torch.ones(3, 3)),
    "dot": lambda: torch.dot(torch.ones(2, 3), torch.ones(3)),
    "trace": lambda: torch.trace(torch.ones(2, 3, 3)),
    "mv": lambda: torch.mv(torch.ones(2, 3, 3), torch.ones(3)),
    "outer": lambda: torch.outer(torch.ones(2, 3), torch.ones(3)),
    "pyro plate": plate_mismatch,
    "validate_sample": lambda: dist.Normal(torch.zeros(3), 1.0).log_prob(torch.zeros(4)),
    "mismatch": lambda: (_ for _ in ()).throw(BatchMismatch("values differ")),
    # operations torch.func.vmap cannot batch (a BayesianModule's net runs under vmap)
    "vmap gru": lambda: vmap(lambda w: GRU(w.expand(2, 3))[0])(torch.ones(4, 3)),
    "vmap item": lambda: vmap(lambda w: w.sum().item() * w)(torch.ones(4, 3)),
    "vmap control flow": lambda: vmap(lambda w: w if w.sum() > 0 else -w)(torch.ones(4, 3)),
    "vmap nonzero": lambda: vmap(torch.nonzero)(torch.ones(4, 3)),
    "vmap boolean mask": lambda: vmap(lambda w: w[w > 0])(torch.ones(4, 3)),
}

NOT_BROADCAST = {
    "model's ValueError": lambda: (_ for _ in ()).throw(ValueError("negative rate")),
    "model's RuntimeError": lambda: (_ for _ in ()).throw(RuntimeError("solver diverged")),
    "dtype": lambda: torch.ones(2, 2) @ torch.ones(2, 2, dtype=torch.float64),
    "NaN parameter": lambda: dist.Normal(torch.tensor(float("nan")), 1.0),
    "NaN observation": lambda: dist.Normal(0.0, 1.0).log_prob(torch.tensor(float("nan"))),
    "factor": lambda: pyro.factor("f", torch.tensor(float("nan"))),
    "KeyError": lambda: {}["a"],
}


@pytest.mark.parametrize("case", BROADCAST)
def test_broadcasting_errors_are_recognised(case):
    error = raised(BROADCAST[case])
    assert is_broadcast_error(error), f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("case", NOT_BROADCAST)
def test_other_errors_are_not_broadcasting_errors(case):
    with pyro.validation_enabled(True):
        error = raised(NOT_BROADCAST[case])
    assert not is_broadcast_error(error), f"{type(error).__name__}: {error}"


POINTS = torch.arange(5.0)


def single(x):
    return x**2


def test_true_without_probes_runs_only_the_vectorized_pass_and_its_errors_propagate():
    calls = []
    values, decision = evaluate_batch(
        lambda p: p**2, lambda x: calls.append(x) or single(x), POINTS, True, probe=()
    )
    assert torch.equal(values, POINTS**2) and calls == []
    assert decision == BatchDecision(True, None, 0)
    with pytest.raises(RuntimeError, match="must match"):
        evaluate_batch(lambda p: p + torch.ones(2), single, POINTS, True)


def test_false_loops_and_never_runs_the_vectorized_pass():
    def batched(points):
        raise AssertionError("not called")

    values, decision = evaluate_batch(batched, single, POINTS, False)
    assert torch.equal(values, POINTS**2) and decision == BatchDecision(False)


def test_none_checks_the_probes_and_keeps_the_vectorized_pass():
    probed = []

    def counted(x):
        probed.append(float(x))
        return single(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values, decision = evaluate_batch(lambda p: p**2, counted, POINTS, None)
    assert torch.equal(values, POINTS**2)
    assert probed == [0.0, 2.0, 4.0]  # first, middle, last
    # the three single runs, and the three points again in the mixing check's pass
    assert decision == BatchDecision(True, None, 6)


def test_a_pass_that_mixes_points_closer_than_the_tolerance_is_found_out():
    # the pass reads point 0 for every point (a model's w[0] on the nodes' dim); the points lie
    # 1e-9 apart, so every value agrees with its single run within the tolerance, but the
    # gradient of point 2's value reaches point 0
    points = 1.0 + 1e-9 * torch.arange(5, dtype=torch.float64)

    def mixing(p):
        return (p[:1] ** 2).expand(len(p))

    with pytest.warns(UserWarning, match="the vectorized value at point 2 depends on point 0"):
        values, decision = evaluate_batch(mixing, lambda x: x**2, points, None)
    assert torch.equal(values, points**2) and not decision.vectorized
    with pytest.raises(BatchMismatch, match=r"value at point 2 depends on point 0.*w\[\.\.\., 0\]"):
        evaluate_batch(mixing, lambda x: x**2, points, True)
    # a pass that does not mix is kept however close the points
    values, decision = evaluate_batch(lambda p: p**2, lambda x: x**2, points, None)
    assert decision.vectorized


def test_none_falls_back_on_a_broadcasting_error_with_one_warning():
    with pytest.warns(UserWarning, match=r"opqa_evidence: .*5 points.*RuntimeError: The size") as w:
        values, decision = evaluate_batch(
            lambda p: p + torch.ones(2), single, POINTS, None, what="opqa_evidence"
        )
    assert len(w) == 1
    assert torch.equal(values, POINTS**2)
    assert not decision.vectorized and decision.reason.startswith("RuntimeError: The size")


def test_none_falls_back_on_a_numeric_mismatch_and_says_where():
    def mixes(points):  # runs, but mixes the points (as a reduction over the batch would)
        return points**2 + points.mean()

    with pytest.warns(UserWarning, match=r"values differ .*point 0: 2 vectorized, 0 alone"):
        values, decision = evaluate_batch(mixes, single, POINTS, None)
    assert torch.equal(values, POINTS**2)
    assert "differ" in decision.reason


def test_a_random_model_is_named_as_such_not_as_a_vectorization_failure():
    """A ``single`` that gives another value at the same point (a latent hidden by
    ``poutine.block``, drawn afresh at each run) disagrees with any vectorized pass; the warning
    says that the model is random, with both values of the repeated point, not that the
    vectorized pass failed (``vectorize=False`` would not help)."""
    draws = iter([0.5, 0.25, 0.125, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0])

    def noisy(x):
        return x**2 + next(draws)

    with pytest.warns(UserWarning) as caught:
        values, decision = evaluate_batch(lambda p: p**2, noisy, POINTS, None)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "other values at the same point when run twice (point 0: 0.5, then 1)" in message
    assert "poutine.block" in message and "vectorize=False" not in message
    # the probes' values (points 0, 2, 4) are kept; points 1 and 3 are evaluated in the loop
    assert values.tolist() == [0.5, 3.0, 4.25, 13.0, 16.125]
    assert not decision.vectorized and decision.reason == "point 0: 0.5, then 1"


def test_none_falls_back_when_the_vectorized_shape_is_wrong():
    with pytest.warns(UserWarning, match="no value of the shape"):
        _, decision = evaluate_batch(lambda p: (p**2).sum(), single, POINTS, None)
    assert not decision.vectorized


def test_a_model_error_propagates_instead_of_a_fallback():
    def model_error(points):
        raise ValueError("the rate must be positive (a bug in the model)")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="the rate must be positive"):
            evaluate_batch(model_error, single, POINTS, None)


def test_mappings_are_stacked_and_compared_per_entry():
    def both(x):
        return {"a": x, "b": {"c": 2 * x}}

    looped, _ = evaluate_batch(None, both, POINTS, False)
    assert torch.equal(looped["b"]["c"], 2 * POINTS)

    def wrong(points):
        return {"a": points, "b": {"c": 3 * points}}

    with pytest.warns(UserWarning, match=r"\['b'\]\['c'\] at point 2"):
        evaluate_batch(wrong, both, POINTS, None, probe=[2])


def test_bad_vectorize():
    with pytest.raises(ValueError, match="vectorize must be True, False or None"):
        evaluate_batch(single, single, POINTS, "yes")


def _one_normal():
    pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))


def _vectorize_entry_points():
    """``(owner, call)``: every public entry point that takes ``vectorize``, called with it."""
    net = nn.Linear(2, 1)
    bnn = BayesianModule(nn.Linear(2, 1), priors.Normal(1.0), likelihoods.Gaussian(4, scale=0.3))
    x = torch.ones(4, 2)

    def loss_fn(params, x, y):
        return ((torch.func.functional_call(net, params, (x,)) - y) ** 2).mean()

    def step(v):
        optimizer = QNVBOptimizer(net.named_parameters())
        return optimizer.step(loss_fn=loss_fn, batch=(x, torch.ones(4, 1)), vectorize=v)

    return [
        ("", lambda v: evaluate_batch(single, single, POINTS, v)),
        ("QuadratureELBO: ", lambda v: QuadratureELBO(vectorize=v)),
        ("GumbelSpikeSlabELBO: ", lambda v: GumbelSpikeSlabELBO(vectorize=v)),
        ("opqa_evidence: ", lambda v: opqa_evidence(_one_normal, vectorize=v)),
        ("QNVBOptimizer.step: ", step),
        ("predict: ", lambda v: bnn.predict(None, x, vectorize=v)),
        ("to_inference_data: ", lambda v: to_inference_data(_one_normal, _one_normal, vectorize=v)),
    ]


def test_the_fallback_warning_points_at_the_users_svi_step():
    # it pointed at QuadratureELBO's call of evaluate_batch, inside the package
    def one_sum(y):  # sums the latents of every node together: no vectorized pass
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(torch.stack([mu[0], mu[1]]).sum(), 1.0), obs=y)

    svi = pyro.infer.SVI(one_sum, AutoMeanFieldNormal(one_sum), QNVB(), QuadratureELBO("hadamard"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        svi.step(torch.tensor(0.3))
    (warning,) = caught
    assert str(warning.message).startswith("QuadratureELBO: the model does not evaluate all")
    assert (warning.filename, warning.lineno) == (__file__, line)  # the svi.step line


@pytest.mark.parametrize("value", [1, 0])
def test_an_int_vectorize_is_refused_at_every_entry_point(value):
    # 1 in (True, False, None) holds: 1 and 0 passed, and matched neither `is True` nor `is
    # False` (0, "no vectorized pass", tried the vectorized pass)
    for owner, call in _vectorize_entry_points():
        message = f"^{owner}vectorize must be True, False or None, got {value} \\(int\\)$"
        with pytest.raises(ValueError, match=message):
            call(value)
    log_joint = LogJoint(_one_normal, latent_sites_of_model(_one_normal))
    z = torch.zeros(2, 1, dtype=torch.float64)
    for bad in (value, None):  # LogJoint's vectorize is True or False: None looped silently
        with pytest.raises(ValueError, match=r"^LogJoint: vectorize must be True or False, got "):
            log_joint(z, vectorize=bad)
    assert log_joint(z, vectorize=False).shape == (2,)


def test_a_numpy_bool_vectorize_is_refused_naming_numpy():
    # its type's name is "bool" under numpy 2: the message read "got np.True_ (bool)"
    with pytest.raises(ValueError, match=r"got (np\.True_|True) \(numpy\.bool_?\)$"):
        QuadratureELBO(vectorize=np.bool_(True))
    with pytest.raises(ValueError, match=r"got tensor\(False\) \(torch\.Tensor\)$"):
        evaluate_batch(single, single, POINTS, torch.tensor(False))


# ---------------------------------------------------------------- DecisionCache


class Model:
    def __call__(self):
        pass

    def method(self):
        pass


def test_cache_is_per_model_and_guide():
    cache = DecisionCache()
    model, other, guide = Model(), Model(), Model()
    cache.set(model, guide, decision=BatchDecision(False, "mat1 and mat2"))
    assert cache.get(model, guide) == BatchDecision(False, "mat1 and mat2")
    assert cache.get(other, guide) is None
    assert cache.get(guide, model) is None
    # a bound method is the same key each time it is looked up
    cache.set(model.method, guide, decision=BatchDecision(True))
    assert cache.get(model.method, guide) == BatchDecision(True)


def test_cache_forgets_a_freed_model():
    cache = DecisionCache()
    guide = Model()
    model = Model()
    cache.set(model, guide, decision=BatchDecision(False))
    cache.set(model.method, guide, decision=BatchDecision(False))
    del model
    gc.collect()
    assert len(cache) == 0
    for _ in range(100):  # new objects may reuse the freed id: never the old decision
        assert cache.get(Model(), guide) is None


def test_cache_copies_start_empty():
    cache = DecisionCache()
    model, guide = Model(), Model()
    cache.set(model, guide, decision=BatchDecision(True))
    for copied in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert len(copied) == 0 and copied.get(model, guide) is None
    assert cache.get(model, guide) == BatchDecision(True)


def test_an_assert_that_fails_in_the_pass_only_falls_back_under_none():
    # the "Tensor shapes" tutorial's assert d.shape == (3, 4) fails on the pass's leading dim
    def batched(p):
        assert p.dim() == 1 and len(p) == 1
        return p**2

    with pytest.warns(
        UserWarning, match=r"AssertionError.*an assert of the model .*d.shape\[-2:\] == \(3, 4\)"
    ):
        values, decision = evaluate_batch(batched, single, POINTS, None)
    assert torch.equal(values, POINTS**2) and decision == BatchDecision(False, decision.reason, 0)
    # under True it propagates as it is
    with pytest.raises(AssertionError):
        evaluate_batch(batched, single, POINTS, True)


def test_an_assert_that_fails_one_point_at_a_time_too_is_the_models_own():
    def failing(x):
        raise AssertionError("the model's own check")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AssertionError, match="the model's own check"):
            evaluate_batch(failing, failing, POINTS, None)


def test_a_cross_gradient_of_rounding_size_is_no_mixing():
    # a model that centres over the whole tensor (logits - logits.mean()) leaves a gradient of
    # rounding size at the other points; 1e-12 of the own gradient is counted as none
    points = torch.arange(1.0, 6.0, dtype=torch.float64)

    def centred(p):
        return p**2 + 1e-12 * p.sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, decision = evaluate_batch(centred, lambda x: x**2, points, None)
    assert decision.vectorized


def test_a_pass_that_fails_on_the_probe_points_alone_falls_back():
    # the whole pass runs and agrees, but the model reads the points' dim at index 3, which the
    # mixing check's pass over the three probe points (0, 2, 4) does not have
    def reads_index_3(p):
        return p**2 * (1 + 0 * p[3])

    with pytest.warns(
        UserWarning, match=r"the pass over the 3 probe points alone fails \(IndexError"
    ):
        values, decision = evaluate_batch(reads_index_3, single, POINTS, None)
    assert torch.equal(values, POINTS**2) and not decision.vectorized
