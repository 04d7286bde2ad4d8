"""Session 22: ``QuadratureELBO``'s sequence position in Pyro's param store leaves no tensor
behind per step (the store maps every tensor ever set under a name back to it)."""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO


def _model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("rows", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_the_position_written_each_step_is_the_only_one_the_store_names():
    y = torch.tensor([0.5, 1.5, 1.0])
    pyro.clear_param_store()
    elbo = QuadratureELBO()
    guide = AutoMeanFieldNormal(_model)
    svi = SVI(_model, guide, QNVB(), elbo)
    store = pyro.get_param_store()
    svi.step(y)
    key = elbo.step_key(guide)
    earlier = store.get_param(key).unconstrained()
    for _ in range(5):
        svi.step(y)
    # before: each step's position stayed in the store's tensor-to-name map, one entry a step
    # (1.3 KB a step of a long run's resident memory)
    assert store.param_name(earlier) is None
    assert store.param_name(store.get_param(key).unconstrained()) == key
    assert elbo.step(guide) == 6
    # a state taken before a step keeps its position
    state = store.get_state()
    svi.step(y)
    assert state["params"][key].item() == 6.0 and elbo.step(guide) == 7
