"""``fit``: the SVI loop of the tutorials, against the same loop written out."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import fit

pytestmark = pytest.mark.usefixtures("fresh_param_store")

DTYPE = torch.float64
X = torch.linspace(-1, 1, 12, dtype=DTYPE)
Y = 0.5 * X + 0.1 * torch.sin(7 * X)


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(w * x, 0.2), obs=y)


def _svi():
    return SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO("hadamard"))


def test_fit_is_the_plain_loop_and_records_every_loss():
    svi = _svi()
    by_hand = [svi.step(X, Y) for _ in range(7)]
    by_hand_w = pyro.param("AutoMeanFieldNormal.locs.w").item()
    pyro.clear_param_store()
    history = fit(_svi(), (X, Y), 7, progress=False)
    assert history.loss == by_hand
    assert pyro.param("AutoMeanFieldNormal.locs.w").item() == by_hand_w


def test_fit_cycles_minibatches_and_evaluates_metrics_on_schedule():
    batches = [(X[:6], Y[:6]), (X[6:], Y[6:])]
    seen = []

    def count():
        seen.append(len(seen))
        return pyro.param("AutoMeanFieldNormal.locs.w").item()

    history = fit(_svi(), batches, 5, metrics={"w": count}, every=2, progress=False)
    assert [step for step, _ in history.metrics["w"]] == [2, 4, 5]
    assert len(seen) == 3 and len(history.loss) == 5
    # the last recorded value is the parameter after the last step
    assert history.metrics["w"][-1][1] == pyro.param("AutoMeanFieldNormal.locs.w").item()


def test_a_metric_that_draws_leaves_the_fit_as_it_would_be_without_it():
    # a random rule's nodes (and a shuffled DataLoader's order) come from torch's stream; a
    # metric that draws (predict's samples) moved it, so recording a score changed the fit
    import numpy as np

    def draws() -> float:
        # NumPy's global stream, the one pyro.set_rng_seed seeds and fit restores
        return float(torch.randn(5).sum()) + float(np.random.rand())  # noqa: NPY002

    batches = [(X[:6], Y[:6]), (X[6:], Y[6:])]
    finals = []
    for metrics in (None, {"draws": draws}):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO("rasp_simplex"))
        history = fit(svi, batches, 9, metrics=metrics, every=2, progress=False)
        finals.append((history.loss, pyro.param("AutoMeanFieldNormal.locs.w").item()))
    assert finals[0] == finals[1]


def test_fit_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="num_steps must be an integer >= 0"):
        fit(_svi(), (X, Y), -1)
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        fit(_svi(), (X, Y), 3, every=0)
    with pytest.raises(ValueError, match="yielded no batch"):
        fit(_svi(), [], 3)


def test_a_one_shot_iterator_that_runs_out_is_named_as_such():
    def three():
        for k in range(3):
            yield X[4 * k : 4 * k + 4], Y[4 * k : 4 * k + 4]

    assert len(fit(_svi(), three(), 3, progress=False).loss) == 3  # as many steps as it yields
    pyro.clear_param_store()
    with pytest.raises(ValueError, match=r"one-shot iterator .* cannot be cycled"):
        fit(_svi(), three(), 5, progress=False)
