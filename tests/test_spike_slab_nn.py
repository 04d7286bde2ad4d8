"""Spike-and-slab Bayesian networks: the prior, both ELBOs through BayesianModule's one-pass
evaluation, and the realized sparse network."""

from __future__ import annotations

import math

import pyro
import pytest
import torch
from torch import nn

from pyro_quadvi import AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.infer import GumbelSpikeSlabELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors, sparse_network

pytestmark = pytest.mark.usefixtures("fresh_param_store")


def small_bnn(hide=()):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    prior = priors.SpikeSlab(inclusion=0.2, slab_scale=1.5)
    return BayesianModule(net, prior, likelihoods.Gaussian(dataset_size=40, scale=0.3), hide=hide)


X = torch.linspace(-1, 1, 30).reshape(10, 3)
Y = torch.sin(X).sum(-1)


def test_the_prior_is_a_spike_and_slab_of_each_parameters_shape():
    bnn = small_bnn()
    fn = bnn.prior_of("0.weight", bnn.latent_parameters()["0.weight"])
    assert fn.event_shape == (4, 3)
    weight = torch.zeros(4, 3)
    weight[0, 0] = 0.5
    # one nonzero entry: log(0.2) + log N(0.5 | 0, 1.5^2); eleven zeros: log(0.8) each
    slab = math.log(0.2) - 0.5 * math.log(2 * math.pi * 1.5**2) - 0.5 * (0.5 / 1.5) ** 2
    assert fn.log_prob(weight).item() == pytest.approx(slab + 11 * math.log(0.8), rel=1e-6)
    assert isinstance(fn.base_dist, SpikeSlab)
    with pytest.raises(ValueError, match="inclusion must lie in"):
        priors.SpikeSlab(inclusion=1.0)


def test_theorem_inclusion_is_the_papers_lambda_for_its_network():
    # -log lambda = log 1527 + 0.1 [4 log 7 + log(sqrt(3000) 200)] = 7.3311 + 1.7083 = 9.0394
    assert priors.theorem_inclusion(1527, 3, 7, 3000, 200) == pytest.approx(1.1862e-4, rel=1e-3)


@pytest.mark.parametrize("elbo", ["quadrature", "gumbel"])
def test_one_vectorized_pass_gives_the_looped_loss_and_gradients(elbo):
    bnn = small_bnn()
    guide = AutoSpikeSlab(bnn, init_inclusion=0.7)
    guide(X, Y)
    results = []
    for vectorize in (True, False):
        objective = (
            QuadratureELBO(vectorize=vectorize)
            if elbo == "quadrature"
            else GumbelSpikeSlabELBO(num_particles=3, vectorize=vectorize)
        )
        pyro.set_rng_seed(4)
        loss = objective.differentiable_loss(bnn, guide, X, Y)
        grads = torch.autograd.grad(loss, list(guide.parameters()))
        results.append((loss, grads))
    (loss_v, grads_v), (loss_l, grads_l) = results
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=1e-4)
    for a, b in zip(grads_v, grads_l):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sparse_network_has_exact_zeros_where_inclusion_is_low_and_slab_means_elsewhere():
    bnn = small_bnn(hide=("2.bias",))
    guide = AutoSpikeSlab(bnn)
    guide(X, Y)
    with torch.no_grad():
        for param in guide.locs.parameters():
            param.copy_(torch.randn_like(param))
        logits = dict(guide.logits.named_parameters())
        # zero logits > 0: P(zero) > 1/2, those entries are dropped
        logits["0.weight_unconstrained"].copy_(
            torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, -1.0], [2.0, 2.0, 2.0], [-3, 0.5, -3]])
        )
        logits["2.weight_unconstrained"].copy_(torch.tensor([[-1.0, 1.0, -1.0, 1.0]]))
    sparse = sparse_network(bnn, guide, threshold=0.5)
    w0 = dict(sparse.net.named_parameters())["0.weight"]
    kept = logits["0.weight_unconstrained"] < 0
    nu0 = guide.locs.get_parameter("0.weight_unconstrained")
    assert torch.equal(w0[~kept], torch.zeros(int((~kept).sum())))
    assert torch.equal(w0[kept], nu0[kept].detach())
    assert sparse.nonzeros == {"0.weight": 6, "0.bias": 4, "2.weight": 2}
    assert sparse.per_layer() == {"0": (10, 16), "2": (2, 4)}
    assert sparse.kept_fraction == pytest.approx(12 / 20)
    # the deterministic net is the same function as the BayesianModule at the point estimate
    values = guide.sparse_point_estimate(0.5)
    expected = bnn.evaluate({k: values[k] for k in bnn.latent_parameters()}, X)
    torch.testing.assert_close(sparse(X), expected.detach(), rtol=0, atol=0)
    hidden_bias = pyro.get_param_store()["net.2.bias"]
    assert torch.equal(dict(sparse.net.named_parameters())["2.bias"], hidden_bias.detach())
    with pytest.raises(TypeError, match="needs an AutoSpikeSlab guide"):
        sparse_network(bnn, object())
    with pytest.raises(ValueError, match="threshold must lie in"):
        guide.sparse_point_estimate(1.0)
