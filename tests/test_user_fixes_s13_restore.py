"""Session 13 user trial of OPQA, the export and the guides' summaries after a param-store restore.

A restored store (``pyro.get_param_store().set_state(...)``) into a guide that has already run:
``opqa_evidence(center="guide")`` used Pyro's ``AutoDiagonalNormal``'s stale ``loc`` (183 nats
off on a conjugate model), and ``AutoMeanFieldNormal.median()`` / ``quantiles()`` returned the
values of the guide's last run, not the store's.
"""

import copy
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal
from torch.distributions import transform_to

from pyro_quadvi import AutoMeanFieldNormal, AutoSpikeSlab, opqa_evidence
from pyro_quadvi.distributions import SpikeSlab

Y = torch.tensor([0.3, -1.2, 2.1, 0.8, 1.5], dtype=torch.float64)
N = len(Y)


def model(y):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


# mu ~ N(0, 1), y_i ~ N(mu, 1): the posterior is N(sum y / (n + 1), 1 / (n + 1)) and the evidence
# is N(y | 0, I + 1 1^T), whose determinant is n + 1 and whose inverse is I - 1 1^T / (n + 1)
POST_MEAN = float(Y.sum()) / (N + 1)
POST_SD = (N + 1) ** -0.5
EXACT_LOG_EVIDENCE = -0.5 * (
    N * math.log(2 * math.pi) + math.log(N + 1) + float(Y @ Y) - float(Y.sum()) ** 2 / (N + 1)
)


def _restore_with(values: dict[str, torch.Tensor]) -> None:
    """Put ``values`` (constrained) into the param store by ``set_state``, as a checkpoint does."""
    store = pyro.get_param_store()
    state = copy.deepcopy(store.get_state())
    for name, value in values.items():
        constraint = state["constraints"][name]
        state["params"][name] = transform_to(constraint).inv(value).detach().clone()
    store.set_state(state)


def test_opqa_evidence_of_a_restored_auto_diagonal_normal_is_exact(float64_store):
    # one Gauss-Hermite point is exact for a Gaussian posterior, if the weight is that posterior
    guide = AutoDiagonalNormal(model)
    guide(Y)  # set up, at the starting loc
    _restore_with(
        {
            "AutoDiagonalNormal.loc": torch.tensor([POST_MEAN]),
            "AutoDiagonalNormal.scale": torch.tensor([POST_SD]),
        }
    )
    result = opqa_evidence(model, Y, num_points=1, center="guide", guide=guide)
    assert result.diagnostics["loc"].tolist() == pytest.approx([POST_MEAN], abs=1e-15)
    assert result.log_evidence == pytest.approx(EXACT_LOG_EVIDENCE, abs=1e-12)


def test_median_quantiles_and_sites_read_a_restored_store(float64_store):
    guide = AutoMeanFieldNormal(model)
    guide(Y)  # set up: loc 0, scale 0.1
    _restore_with(
        {
            "AutoMeanFieldNormal.locs.mu": torch.tensor(POST_MEAN),
            "AutoMeanFieldNormal.scales.mu": torch.tensor(POST_SD),
        }
    )
    assert float(guide.median()["mu"]) == pytest.approx(POST_MEAN, abs=1e-15)
    q = guide.quantiles([0.1, 0.5])["mu"]
    z = 1.2815515655446004  # the standard normal's 0.9 quantile
    assert q.tolist() == pytest.approx([POST_MEAN - z * POST_SD, POST_MEAN], abs=1e-12)
    (site,) = guide.mean_field_sites()
    assert float(site.loc.detach()) == pytest.approx(POST_MEAN, abs=1e-15)
    assert float(site.scale.detach()) == pytest.approx(POST_SD, abs=1e-15)


def test_spike_slab_summaries_read_a_restored_store(fresh_param_store):
    def sparse_model(y):
        w = pyro.sample("w", SpikeSlab(0.5, 2.0).expand([3]).to_event(1))
        pyro.sample("y", dist.Normal(w.sum(), 1.0), obs=y)

    guide = AutoSpikeSlab(sparse_model)
    guide(torch.tensor(1.0))
    nu = torch.tensor([1.5, -2.0, 0.7])
    zero_logits = torch.tensor([-5.0, -5.0, 5.0])  # the third coordinate is zero w.p. sigmoid(5)
    _restore_with({"AutoSpikeSlab.locs.w": nu, "AutoSpikeSlab.logits.w": zero_logits})
    inclusion = torch.sigmoid(-zero_logits)
    torch.testing.assert_close(guide.inclusion_probs()["w"], inclusion, rtol=1e-6, atol=0)
    # the realized estimate: nu where q(not z) > 1/2, exactly 0 elsewhere
    expected = torch.tensor([1.5, -2.0, 0.0])
    torch.testing.assert_close(guide.sparse_point_estimate()["w"], expected, rtol=0, atol=0)
    # the mixture's median sits below nu by the spike's mass: equal to the icdf of the mixture
    median = guide.median()["w"]
    assert median[2] == 0.0 and (median[:2] - nu[:2]).abs().max() < 2e-3


def test_the_guide_watch_classifies_a_compiled_module_by_what_it_wraps(fresh_param_store):
    # one OptimizedModule class wraps guides and networks alike: classified once by that class,
    # a compiled network called after a compiled guide was taken for a guide (a live guide)
    from pyro_quadvi import QNVB
    from pyro_quadvi.guides.interface import live_guides, unwrap_guide

    QNVB()  # installs the watch
    guide = AutoMeanFieldNormal(model)
    compiled_guide = torch.compile(guide, backend="eager")  # (held: the watch's set is weak)
    compiled_guide(Y)
    net = torch.nn.Linear(2, 1).double()
    compiled_net = torch.compile(net, backend="eager")
    compiled_net(Y[:4].reshape(2, 2))
    watched = [unwrap_guide(g) for g in live_guides()]
    assert any(g is guide for g in watched)
    assert not any(g is net for g in watched)


def test_a_bayesian_module_of_a_compiled_net_names_its_sites_as_the_eager_one(fresh_param_store):
    # trial: sites named "_orig_mod.0.weight", so an eager fit's saved store was silently
    # ignored by the compiled net's fit
    from pyro_quadvi import QuadratureELBO
    from pyro_quadvi.nn import BayesianModule, likelihoods, priors

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x, y = torch.randn(6, 2), torch.randn(6, 1)

    def loss_of(module):
        bnn = BayesianModule(module, priors.Normal(1.0), likelihoods.Gaussian(6, scale=0.5))
        guide = AutoMeanFieldNormal(bnn)
        guide(x, y)
        return guide, QuadratureELBO("hadamard", 4).loss(bnn, guide, x, y)

    eager_guide, _ = loss_of(net)
    with torch.no_grad():  # a fitted store: moved away from the guide's start
        for value in pyro.get_param_store().values():
            value.add_(0.3)
    _, eager_loss = loss_of(net)
    saved = copy.deepcopy(pyro.get_param_store().get_state())
    pyro.clear_param_store()
    compiled_guide, fresh_loss = loss_of(torch.compile(net, backend="eager"))
    pyro.get_param_store().set_state(saved)
    assert sorted(n for n, _ in compiled_guide.named_parameters()) == sorted(
        n for n, _ in eager_guide.named_parameters()
    )
    _, restored_loss = loss_of(torch.compile(net, backend="eager"))
    assert restored_loss == eager_loss != fresh_loss


def test_a_stale_store_parameter_of_another_network_names_the_way_out(fresh_param_store):
    # trial: the docs' examples run top to bottom in one process; the second network's new
    # guide took the first's stored '0.weight' of shape (50, 1) and the error said nothing of it
    from pyro_quadvi.nn import BayesianModule, likelihoods, priors

    x, y = torch.randn(4, 1), torch.randn(4, 1)
    first = BayesianModule(
        torch.nn.Sequential(torch.nn.Linear(1, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)),
        priors.Normal(1.0),
        likelihoods.Gaussian(4, scale=0.5),
    )
    AutoMeanFieldNormal(first)(x, y)
    second = BayesianModule(
        torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)),
        priors.Normal(1.0),
        likelihoods.Gaussian(4, scale=0.5),
    )
    guide = AutoMeanFieldNormal(second)
    with pytest.raises(ValueError, match=r"\(5, 1\).*\(3, 2\).*pyro\.clear_param_store\(\)"):
        Trace_ELBO().loss(second, guide, torch.randn(4, 2), y)


def test_a_compiled_net_that_is_falsy_is_looked_through_too(fresh_param_store):
    # review: `compiled_original(net) or net` kept the wrapper of a module whose len() is 0
    from pyro_quadvi.nn import BayesianModule, likelihoods, priors

    class Empty(torch.nn.Module):  # falsy: a container of no layers, one weight of its own
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def __len__(self):
            return 0

        def forward(self, x):
            return self.linear(x)

    bnn = BayesianModule(
        torch.compile(Empty(), backend="eager"),
        priors.Normal(1.0),
        likelihoods.Gaussian(4, scale=0.5),
    )
    guide = AutoMeanFieldNormal(bnn)
    guide(torch.randn(4, 2), torch.randn(4, 1))
    assert sorted(guide.median()) == ["linear.bias", "linear.weight"]
