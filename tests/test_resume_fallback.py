"""Checkpoints of QNVB's fallback optimizer and of named torch groups (user trial t7)."""

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from pyro.nn import PyroModule, PyroParam
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO, SparseQNVB
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer

torch.manual_seed(1)
X = torch.randn(50, 3)
Y = 2 * X[:, 0] + 1 + 0.3 * torch.randn(50)


def gaussian_model(x, y):
    c = pyro.param("c", torch.tensor(0.0))  # a point estimate: the fallback's (Adam)
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", 50):
        pyro.sample("y", dist.Normal((x * w).sum(-1) + c, 0.3), obs=y)


def spike_slab_model(x, y):
    c = pyro.param("c", torch.tensor(0.0))
    w = pyro.sample("w", SpikeSlab(0.1, 2.0).expand([3]).to_event(1))
    with pyro.plate("data", 50):
        pyro.sample("y", dist.Normal((x * w).sum(-1) + c, 0.3), obs=y)


def fit(model, guide, optim, steps):
    svi = SVI(model, guide, optim, QuadratureELBO("hadamard"))
    return [svi.step(X, Y) for _ in range(steps)]


SETUPS = {
    "qnvb": (gaussian_model, AutoMeanFieldNormal, QNVB),
    "sparse": (
        spike_slab_model,
        AutoSpikeSlab,
        lambda: SparseQNVB(num_epochs=3, steps_per_epoch=4, num_cases=50),
    ),
}


@pytest.mark.parametrize("kind", sorted(SETUPS))
def test_get_state_right_after_set_state_keeps_the_fallbacks_state(kind):
    model, make_guide, make_optim = SETUPS[kind]
    pyro.clear_param_store()
    guide, optim = make_guide(model), make_optim()
    fit(model, guide, optim, 3)
    store, saved = copy.deepcopy(pyro.get_param_store().get_state()), optim.get_state()
    reference = fit(model, guide, optim, 4)
    again = make_optim()
    again.set_state(saved)
    resaved = again.get_state()  # before any step: the fallback's state waits for its parameter
    assert list(resaved["fallback"]) == ["c"]
    pyro.clear_param_store()
    pyro.get_param_store().set_state(copy.deepcopy(store))
    guide = make_guide(model)
    guide(X, Y)
    resumed = make_optim()
    resumed.set_state(resaved)
    assert fit(model, guide, resumed, 4) == reference  # was 0.3 (QNVB), 0.5 (Sparse) off


class TwoPointEstimates(PyroModule):
    def __init__(self):
        super().__init__()
        self.c = PyroParam(torch.tensor(0.0))
        self.d = PyroParam(torch.tensor(0.5))

    def forward(self, x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", 50):
            pyro.sample("y", dist.Normal((x * w).sum(-1) + self.c * self.d, 0.3), obs=y)


def test_local_mode_keys_the_fallback_by_the_param_sites_names():
    with pyro.settings.context(module_local_params=True):
        model = TwoPointEstimates()
        guide, optim = AutoMeanFieldNormal(model), QNVB()
        fit(model, guide, optim, 3)
        saved = (
            copy.deepcopy(model.state_dict()),
            copy.deepcopy(guide.state_dict()),
            optim.get_state(),
        )
        reference = fit(model, guide, optim, 4)
        assert sorted(saved[2]["fallback"]) == ["c", "d"]  # was [None]: one state for two
        model = TwoPointEstimates()
        guide = AutoMeanFieldNormal(model)
        guide(X, Y)
        model.load_state_dict(saved[0])
        guide.load_state_dict(saved[1])
        optim = QNVB()
        optim.set_state(saved[2])
        assert fit(model, guide, optim, 4) == reference


def test_a_restored_store_replaces_the_fallbacks_optimizer_of_the_old_tensor():
    pyro.clear_param_store()
    guide, optim = AutoMeanFieldNormal(gaussian_model), QNVB()
    fit(gaussian_model, guide, optim, 3)
    store, saved = copy.deepcopy(pyro.get_param_store().get_state()), optim.get_state()
    reference = fit(gaussian_model, guide, optim, 4)
    for _ in range(2):  # the same objects, restored in the process
        pyro.clear_param_store()
        pyro.get_param_store().set_state(copy.deepcopy(store))
        guide(X, Y)
        optim.set_state(saved)
        assert fit(gaussian_model, guide, optim, 4) == reference
        assert list(optim.get_state()["fallback"]) == ["c"]  # was [None, 'c']
        assert len(optim.optim_objs) == 1  # grew by one per restore


def test_get_state_refuses_a_fallback_parameter_without_a_name():
    pyro.clear_param_store()
    optim = QNVB()
    loose = torch.zeros(3, 2, requires_grad=True)  # in no param store and no module
    loose.grad = torch.ones(3, 2)
    with pytest.warns(RuntimeWarning, match="none of the 1 parameters"):
        optim([loose])
    with pytest.raises(ValueError, match=r"shape \(3, 2\) that has no name.*module_local_params"):
        optim.get_state()


def torch_groups(net, order):
    return [{"params": list(net[k].named_parameters())} for k in order]


TORCH_OPTIMIZERS = {
    "qnvb": lambda groups: QNVBOptimizer(groups, likelihood_weight=64.0),
    "sparse": lambda groups: SparseQNVBOptimizer(
        groups, num_cases=64, num_epochs=3, steps_per_epoch=4
    ),
}


def torch_fit(kind, order):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    net = nn.ModuleDict({"enc": nn.Linear(4, 4), "dec": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    optimizer = TORCH_OPTIMIZERS[kind](torch_groups(net, order))

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(net["head"](torch.tanh(net["dec"](torch.tanh(net["enc"](x))))), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    return net, optimizer


@pytest.mark.parametrize("kind", sorted(TORCH_OPTIMIZERS))
def test_load_refuses_groups_that_names_and_shapes_cannot_tell_apart(kind):
    _, optimizer = torch_fit(kind, ["enc", "dec", "head"])
    saved = optimizer.state_dict()
    _, other = torch_fit(kind, ["dec", "enc", "head"])  # each group's names: weight, bias
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"groups 0 and 1 have the same parameter names.*'enc\."):
        other.load_state_dict(saved)
    assert torch.equal(other.state_dict()["state"][0]["mu"], before["state"][0]["mu"])


@pytest.mark.parametrize("kind", sorted(TORCH_OPTIMIZERS))
def test_groups_of_the_same_names_but_other_shapes_still_load(kind):
    net, optimizer = torch_fit(kind, ["enc", "head"])  # (4, 4) and (2, 4): shapes tell them apart
    saved = optimizer.state_dict()
    other_net, other = torch_fit(kind, ["enc", "head"])
    with torch.no_grad():
        other_net["head"].weight.zero_()
    other.load_state_dict(saved)
    assert torch.equal(other_net["head"].weight, net["head"].weight)
