"""A user trial of QNVB's settings: a QNVB reused for a second fit, or shared by two models, reads
its annealing schedule at its own step count, so the second fit started part-way through the
schedule, or after it, without a word. It is now named once."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.optim.annealing import geometric_annealing

X = torch.linspace(-1.0, 1.0, 20, dtype=torch.float64)
Y = 0.5 * X + 0.1


def _model():
    w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with pyro.plate("data", len(X)):
        pyro.sample("y", dist.Normal(w * X, 0.3), obs=Y)


def _fit(qnvb: QNVB, steps: int) -> list[str]:
    """``steps`` of a fresh guide under ``qnvb`` (annealed model); the annealing warnings."""
    guide = AutoMeanFieldNormal(_model)
    svi = SVI(qnvb.anneal(_model), guide, qnvb, QuadratureELBO("hadamard"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step()
    return [str(w.message) for w in caught if "starts afresh" in str(w.message)]


def test_a_reused_annealed_qnvb_names_where_its_schedule_stands(float64_store):
    qnvb = QNVB(annealing=geometric_annealing(0.01, num_steps=4))
    assert _fit(qnvb, 3) == []  # its first fit starts at step 0
    pyro.clear_param_store()
    messages = _fit(qnvb, 3)  # the same QNVB for a new fit: the schedule is at step 3
    assert messages == [
        "QNVB: every block of this step starts afresh, but this QNVB has taken 3 steps, and its "
        "annealing schedule is read at its step count: this fit starts at factor 0.3162, not at "
        "the schedule's step 0. The step count (the annealing position) belongs to the QNVB "
        "object: for a new fit or another model build a new QNVB, or restore its state with "
        "set_state (a schedule shared on purpose, by models fitted in turn, needs nothing)."
    ]
    # a new QNVB, or none reused without a schedule, says nothing
    pyro.clear_param_store()
    assert _fit(QNVB(annealing=geometric_annealing(0.01, num_steps=4)), 3) == []
    plain = QNVB()
    _fit(plain, 3)
    pyro.clear_param_store()
    assert _fit(plain, 3) == []


def test_an_unpickled_qnvb_watches_the_guides_in_a_process_that_never_built_one(float64_store):
    """A process that only loads a pickled QNVB (``torch.load`` of a checkpoint) never ran the
    constructor, which installs the global hook by which QNVB finds the guides that run: under
    ``Trace_ELBO`` it found none, warned that nothing was paired and sent every parameter to its
    fallback. Simulated here by removing the hook before unpickling."""
    import copy
    import pickle

    from pyro.infer import Trace_ELBO

    from pyro_quadvi.guides import interface

    pyro.set_rng_seed(0)
    guide, qnvb = AutoMeanFieldNormal(_model), QNVB()
    svi = SVI(_model, guide, qnvb, Trace_ELBO())
    for _ in range(3):
        svi.step()
    saved = pickle.dumps(qnvb), copy.deepcopy(pyro.get_param_store().get_state())
    rng = pyro.util.get_rng_state()
    svi.step()
    expected = pyro.param("AutoMeanFieldNormal.scales.w").detach().clone()

    interface._WATCH_HANDLE.remove()  # a fresh process: no hook, no guide seen
    interface._WATCH_HANDLE = None
    interface._LIVE_GUIDES.clear()
    pyro.clear_param_store()
    resumed = pickle.loads(saved[0])
    guide = AutoMeanFieldNormal(_model)
    guide()
    pyro.get_param_store().set_state(copy.deepcopy(saved[1]))
    pyro.util.set_rng_state(rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SVI(_model, guide, resumed, Trace_ELBO()).step()
    assert interface._WATCH_HANDLE is not None
    assert not [w for w in caught if "none of the" in str(w.message)]
    assert torch.equal(pyro.param("AutoMeanFieldNormal.scales.w").detach(), expected)
