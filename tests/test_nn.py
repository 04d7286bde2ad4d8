"""Bayesian neural networks from any nn.Module (issue 11, core): BayesianModule, priors,
likelihoods, predict."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch import nn
from torch.func import functional_call

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides import describe_guide
from pyro_quadvi.guides.interface import published_moments
from pyro_quadvi.nn import BayesianModule, likelihoods, priors

DTYPE = torch.float64
pytestmark = pytest.mark.usefixtures("fresh_param_store")

# ------------------------------------------------------- Bayesian linear regression, exactly
# Design: 8 rows of a Hadamard matrix; the bias column (all ones) and the three feature columns
# are orthogonal, so the posterior precision over (weight, bias) is diagonal and the optimal
# Gaussian mean field is the exact posterior.
_H2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=DTYPE)
_H8 = torch.kron(torch.kron(_H2, _H2), _H2)
X_LIN = _H8[:, 1:4] * torch.tensor([0.5, 0.3, 0.2], dtype=DTYPE)
Y_LIN = torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4, 0.2, 0.0, 0.6], dtype=DTYPE)
NOISE = 0.5
N_LIN = len(Y_LIN)
DESIGN = torch.cat([X_LIN, torch.ones(N_LIN, 1, dtype=DTYPE)], dim=1)  # (weight, bias)
PRECISION = torch.eye(4, dtype=DTYPE) + DESIGN.T @ DESIGN / NOISE**2
POST_MEAN = torch.linalg.solve(PRECISION, DESIGN.T @ Y_LIN / NOISE**2)
POST_STD = PRECISION.diagonal() ** -0.5


def linear_bnn(**kwargs):
    net = nn.Linear(3, 1).double()
    likelihood = likelihoods.Gaussian(N_LIN, scale=NOISE)
    return BayesianModule(net, priors.Normal(1.0), likelihood, **kwargs)


def fitted_moments(guide):
    """(mean, std) over (weight, bias) of a mean-field guide of a linear layer."""
    locs, scales = [], []
    for name in ("weight", "bias"):
        loc, scale = guide._get_loc_and_scale(name)
        locs.append(loc.detach().reshape(-1))
        scales.append(scale.detach().reshape(-1))
    return torch.cat(locs), torch.cat(scales)


def set_guide(guide, loc: torch.Tensor, scale: torch.Tensor, bnn) -> None:
    """Put a mean-field guide at flat (loc, scale) laid out in the net's parameter order."""
    start = 0
    with torch.no_grad():
        for name, param in bnn.latent_parameters().items():
            n = param.numel()
            path = name.split(".")
            locs, scales = guide.locs, guide.scales
            for part in path[:-1]:
                locs, scales = getattr(locs, part), getattr(scales, part)
            getattr(locs, path[-1]).copy_(loc[start : start + n].reshape(param.shape))
            setattr(scales, path[-1], scale[start : start + n].reshape(param.shape).clone())
            start += n


def closed_form_elbo(mu: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The ELBO of Bayesian linear regression at the mean field N(mu, diag(s^2))."""
    resid = Y_LIN - DESIGN @ mu
    expected_sq = resid**2 + (DESIGN**2) @ s**2
    loglik = (-0.5 * math.log(2 * math.pi * NOISE**2) - expected_sq / (2 * NOISE**2)).sum()
    logprior = (-0.5 * math.log(2 * math.pi) - (mu**2 + s**2) / 2).sum()
    entropy = (0.5 * math.log(2 * math.pi * math.e) + s.log()).sum()
    return loglik + logprior + entropy


@pytest.mark.parametrize("settings, first_exact", [({}, 1), (None, 5)])
def test_linear_layer_lands_on_the_closed_form_mean_field(settings, first_exact):
    # QNVB's own defaults (the module declaring nothing) land in one Newton step; the network
    # settings a BayesianModule declares (steps of at most 0.3 sigma, sigma held until the
    # curvature is significant) take five, to the same fixed point
    assert torch.allclose(PRECISION, torch.diag(PRECISION.diagonal()))  # orthogonal design
    bnn = linear_bnn(qnvb_settings=settings)
    guide = AutoMeanFieldNormal(bnn)
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO("gauss_hermite", num_points=2))
    for step in range(1, first_exact + 3):
        svi.step(X_LIN, Y_LIN)
        mean, std = fitted_moments(guide)
        error = max((mean - POST_MEAN).abs().max().item(), (std - POST_STD).abs().max().item())
        assert (error < 1e-8) == (step >= first_exact)


def linear_bnn_at_a_fixed_mean_field():
    """The linear BNN and its guide at a fixed mean field ``N(mu, diag(s^2))``."""
    bnn = linear_bnn()
    guide = AutoMeanFieldNormal(bnn)
    guide(X_LIN, Y_LIN)
    mu = torch.tensor([0.3, -0.7, 0.2, 0.1], dtype=DTYPE)
    s = torch.tensor([0.4, 0.25, 0.6, 0.35], dtype=DTYPE)
    set_guide(guide, mu, s, bnn)
    return bnn, guide, mu, s


def test_gauss_hermite_loss_equals_the_closed_form_elbo():
    bnn, guide, mu, s = linear_bnn_at_a_fixed_mean_field()
    loss = QuadratureELBO("gauss_hermite", num_points=2).loss(bnn, guide, X_LIN, Y_LIN)
    assert abs(loss + closed_form_elbo(mu, s).item()) < 1e-10


def test_vectorized_trace_elbo_runs_the_net_once_and_estimates_the_closed_form_elbo():
    bnn, guide, mu, s = linear_bnn_at_a_fixed_mean_field()
    calls = []
    bnn.net.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    pyro.set_rng_seed(0)
    particles = 20_000
    elbo = Trace_ELBO(num_particles=particles, vectorize_particles=True)
    elbo.loss(bnn, guide, X_LIN, Y_LIN)  # Pyro's first call also guesses the plate nesting
    calls.clear()
    loss = elbo.loss(bnn, guide, X_LIN, Y_LIN)
    assert calls == [torch.Size([N_LIN, 1])]  # one call of the net for all particles (vmap)
    # Monte Carlo error: one particle's ELBO has sd 2.6 here (measured over 2,000), below 3
    assert abs(loss + closed_form_elbo(mu, s).item()) < 5 * 3 / math.sqrt(particles)


# --------------------------------------------------------------- one pass for all nodes
def tanh_net(out: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, out)).double()


X_NET = torch.linspace(-1.0, 1.0, 10, dtype=DTYPE).reshape(5, 2)
Y_REG = torch.tensor([0.1, -0.3, 0.4, 0.0, 0.2], dtype=DTYPE)
Y_CLS = torch.tensor([0, 2, 1, 1, 0])


def perturbed_guide(bnn, x, y):
    guide = AutoMeanFieldNormal(bnn)
    guide(x, y)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return guide


@pytest.mark.parametrize(
    ("likelihood", "out", "y"),
    [
        (likelihoods.Gaussian(20, scale=0.3), 1, Y_REG),
        (likelihoods.Categorical(20), 3, Y_CLS),
    ],
    ids=["gaussian", "categorical"],
)
@pytest.mark.parametrize("rule", ["hadamard", "blocked_simplex"])
def test_vectorized_loss_and_gradients_equal_the_looped_ones(likelihood, out, y, rule):
    bnn = BayesianModule(tanh_net(out), priors.Normal(1.0), likelihood)
    guide = perturbed_guide(bnn, X_NET, y)
    results = []
    for vectorize in (True, False):
        pyro.set_rng_seed(5)  # the same random rotation of the rule
        guide.zero_grad()
        elbo = QuadratureELBO(rule, vectorize=vectorize, name=f"vectorize={vectorize}")
        loss = elbo.differentiable_loss(bnn, guide, X_NET, y)  # both at step 0 of the rule
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in guide.parameters()]))
    (loss_v, grads_v), (loss_l, grads_l) = results
    assert abs(loss_v - loss_l) < 1e-10
    assert max((a - b).abs().max().item() for a, b in zip(grads_v, grads_l)) < 1e-10
    # the default decides for the one pass, without the "one by one" warning; the two passes'
    # gradients and moments are cleared first (QNVB would find their moments beside the step's
    # gradients alone, and warn that they do not match)
    guide.zero_grad()
    for p in guide.parameters():
        published_moments(p)
    elbo = QuadratureELBO(rule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SVI(bnn, guide, QNVB(), elbo).step(X_NET, y)
    assert elbo.vectorized(bnn, guide) is True


def test_predictive_and_vectorized_particles_run_in_one_pass():
    bnn = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    guide = perturbed_guide(bnn, X_NET, Y_REG)
    draws = Predictive(guide, num_samples=4)(X_NET)  # (4, ...) per site
    samples = {name: draws[name] for name in bnn.latent_parameters()}
    outputs = {}
    for parallel in (True, False):
        predictive = Predictive(
            bnn, posterior_samples=samples, parallel=parallel, return_sites=["_RETURN"]
        )
        outputs[parallel] = predictive(X_NET)["_RETURN"]
    assert outputs[True].shape == (4, 5, 1)
    assert (outputs[True] - outputs[False].reshape(4, 5, 1)).abs().max().item() < 1e-12
    for k in range(4):
        one = {name: value[k] for name, value in samples.items()}
        direct = functional_call(bnn.net, one, (X_NET,))
        assert (outputs[True][k] - direct).abs().max().item() < 1e-12


# --------------------------------------------------------------------- sites and hiding
def test_init_to_net_starts_the_guide_at_the_nets_parameters_and_the_rest_at_the_fallback():
    net = tanh_net()
    bnn = BayesianModule(
        net, priors.Normal(1.0), likelihoods.Gaussian(20, scale=None), hide=("0.bias",)
    )
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(X_NET, Y_REG)
    latent = bnn.latent_parameters()
    assert "0.bias" not in latent and len(latent) == 3
    for name, param in latent.items():
        loc, _ = guide._get_loc_and_scale(name)
        assert torch.equal(loc.detach(), param.detach()), name
    # the learned noise scale (LogNormal prior) at init_to_feasible: exp(0) = 1
    loc, _ = guide._get_loc_and_scale("noise_scale")
    assert loc.item() == 0.0  # the unconstrained loc of a positive site
    # the default start: every weight at the prior's centre
    pyro.clear_param_store()
    zero = AutoMeanFieldNormal(bnn)
    zero(X_NET, Y_REG)
    assert all(zero._get_loc_and_scale(n)[0].abs().max().item() == 0.0 for n in latent)
    with pytest.raises(ValueError, match="noise_scale"):
        AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(fallback=None))(X_NET, Y_REG)


def test_sites_are_the_parameters_and_hidden_ones_are_trained_by_svi():
    bnn = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    trace = poutine.trace(bnn).get_trace(X_NET, Y_REG)
    latents = {
        name: tuple(site["value"].shape)
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and name != "data"
    }
    expected = {name: tuple(p.shape) for name, p in bnn.net.named_parameters()}
    assert latents == expected
    assert list(latents) == list(expected)  # in the net's order
    for name, p in bnn.net.named_parameters():
        assert trace.nodes[name]["fn"].event_dim == p.dim()

    hidden = BayesianModule(
        tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3), hide=("0.bias",)
    )
    guide = AutoMeanFieldNormal(hidden)
    before = hidden.net[0].bias.detach().clone()
    SVI(hidden, guide, QNVB(), QuadratureELBO()).step(X_NET, Y_REG)
    names = [site.name for site in describe_guide(guide).latent_sites]
    assert names == ["0.weight", "2.weight", "2.bias"]
    assert "net.0.bias" in pyro.get_param_store()
    assert pyro.get_param_store()["net.0.bias"] is hidden.net[0].bias
    assert (hidden.net[0].bias.detach() - before).abs().max().item() > 1e-4


def test_hidden_parameters_are_trained_under_module_local_params():
    with pyro.settings.context(module_local_params=True):
        hidden = BayesianModule(
            tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3), hide=("2.bias",)
        )
        guide = AutoMeanFieldNormal(hidden)
        before = hidden.net[2].bias.detach().clone()
        SVI(hidden, guide, QNVB(), QuadratureELBO()).step(X_NET, Y_REG)
    assert "net.2.bias" not in pyro.get_param_store()
    assert (hidden.net[2].bias.detach() - before).abs().max().item() > 1e-4


class GainLinear(nn.Module):
    """A user's layer: ``y = gain * (W x) + b``, its gain a point estimate, a Laplace bias."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features, dtype=DTYPE))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=DTYPE))
        self.gain = nn.Parameter(torch.ones(out_features, dtype=DTYPE))

    def bayesian_parameters(self):
        zeros = torch.zeros_like(self.bias).detach()
        return {"gain": "deterministic", "bias": dist.Laplace(zeros, torch.full_like(zeros, 0.1))}

    def forward(self, x):
        return self.gain * (x @ self.weight.T) + self.bias


def test_a_users_layer_declares_a_hidden_gain_and_a_laplace_bias():
    net = nn.Sequential(GainLinear(2, 4), nn.Tanh(), nn.Linear(4, 1).double())
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    assert bnn.hide == ("0.gain",)
    trace = poutine.trace(bnn).get_trace(X_NET, Y_REG)
    latents = [n for n, s in trace.nodes.items() if s["type"] == "sample" and n != "data"]
    assert latents == ["0.weight", "0.bias", "2.weight", "2.bias", "obs"]
    # the declared Laplace(0, 0.1) bias: sum of -|v| / b - log(2 b); the weight N(0, 1)
    value = trace.nodes["0.bias"]["value"]
    laplace = (-value.abs() / 0.1 - math.log(0.2)).sum()
    torch.testing.assert_close(trace.nodes["0.bias"]["fn"].log_prob(value), laplace)
    weight = trace.nodes["0.weight"]["value"]
    normal = (-(weight**2) / 2 - 0.5 * math.log(2 * math.pi)).sum()
    torch.testing.assert_close(trace.nodes["0.weight"]["fn"].log_prob(weight), normal)
    # the gain is a pyro.param the fallback optimizer moves
    guide = AutoMeanFieldNormal(bnn)
    SVI(bnn, guide, QNVB(), QuadratureELBO()).step(X_NET, Y_REG)
    assert pyro.get_param_store()["net.0.gain"] is net[0].gain
    assert (net[0].gain.detach() - 1.0).abs().max().item() > 1e-4


# -------------------------------------------------------------------------- subsampling
def test_a_minibatch_log_likelihood_is_scaled_to_the_dataset_size():
    N, B, noise = 50, 5, 0.3
    bnn = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(N, scale=noise))
    trace = poutine.trace(bnn).get_trace(X_NET, Y_REG)
    trace.compute_log_prob()
    obs = trace.nodes["obs"]
    weights = {name: trace.nodes[name]["value"] for name in bnn.latent_parameters()}
    mean = functional_call(bnn.net, weights, (X_NET,)).squeeze(-1)
    by_hand = -0.5 * ((Y_REG - mean) / noise) ** 2 - math.log(noise) - 0.5 * math.log(2 * math.pi)
    assert obs["scale"] == N / B
    assert abs(obs["log_prob_sum"].item() - N / B * by_hand.sum().item()) < 1e-10


# ---------------------------------------------------------------------------- priors
@pytest.mark.parametrize(
    ("method", "std"),
    [
        ("radford", lambda fi, fo: fi**-0.5),
        ("kaiming", lambda fi, fo: (2 / fi) ** 0.5),
        ("xavier", lambda fi, fo: (2 / (fi + fo)) ** 0.5),
    ],
)
def test_layerwise_prior_scales_follow_the_fans(method, std):
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    bnn = BayesianModule(net, priors.LayerwiseNormal(method), likelihoods.Gaussian(10))
    fans = {"0.weight": (3, 5), "0.bias": (3, 5), "2.weight": (5, 2), "2.bias": (5, 2)}
    for name, param in net.named_parameters():
        prior = bnn.prior_of(name, param)
        assert prior.event_shape == param.shape and prior.batch_shape == ()
        scale = prior.base_dist.scale
        assert scale.dtype == DTYPE
        assert torch.allclose(scale, torch.full_like(scale, std(*fans[name])), rtol=1e-15)


def test_a_callable_prior_and_a_normal_prior():
    net = nn.Linear(2, 1).double()

    def laplace(name, param):
        return dist.Laplace(torch.zeros_like(param), 0.5 if name == "bias" else 2.0)

    bnn = BayesianModule(net, laplace, likelihoods.Gaussian(10))
    assert bnn.prior_of("bias", net.bias).base_dist.scale.item() == 0.5
    assert bnn.prior_of("weight", net.weight).event_shape == (1, 2)
    normal = priors.Normal(scale=0.7)("weight", net.weight)
    assert normal.scale.dtype == DTYPE and torch.all(normal.scale == 0.7)


# ---------------------------------------------------------------------------- predict
def test_predict_with_tiny_scales_is_the_net_at_the_locs():
    bnn = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    guide = perturbed_guide(bnn, X_NET, Y_REG)
    dim = describe_guide(guide).dim
    loc = describe_guide(guide).loc.detach()
    set_guide(guide, loc, torch.full((dim,), 1e-8, dtype=DTYPE), bnn)
    at_locs = {}
    start = 0
    for name, param in bnn.latent_parameters().items():
        at_locs[name] = loc[start : start + param.numel()].reshape(param.shape)
        start += param.numel()
    expected = functional_call(bnn.net, at_locs, (X_NET,))
    pred = bnn.predict(guide, X_NET, num_samples=16)
    assert pred.outputs.shape == (16, 5, 1)
    assert abs(pred.weights.sum().item() - 1.0) < 1e-12
    assert (pred.mean - expected).abs().max().item() < 1e-6


def test_quadrature_predict_of_a_linear_layer_is_the_exact_predictive_mean():
    bnn, guide, mu, s = linear_bnn_at_a_fixed_mean_field()
    pred = bnn.predict(guide, X_LIN, quadrature="gauss_hermite", num_points=2)
    assert pred.outputs.shape == (16, N_LIN, 1)
    assert (pred.mean.squeeze(-1) - DESIGN @ mu).abs().max().item() < 1e-12
    # and the spread of the nodes is the exact predictive variance of the mean
    var = torch.tensordot(pred.weights, (pred.outputs.squeeze(-1) - DESIGN @ mu) ** 2, dims=1)
    assert (var - (DESIGN**2) @ s**2).abs().max().item() < 1e-12


@pytest.mark.parametrize("quadrature", [None, "hadamard"])
def test_classification_predictions_are_probabilities(quadrature):
    bnn = BayesianModule(tanh_net(3), priors.Normal(1.0), likelihoods.Categorical(20))
    guide = perturbed_guide(bnn, X_NET, Y_CLS)
    pred = bnn.predict(guide, X_NET, num_samples=8, quadrature=quadrature)
    assert pred.probs.shape == (5, 3)
    assert (pred.probs.sum(-1) - 1).abs().max().item() < 1e-12
    assert pred.probs.min().item() >= 0.0
    expected = torch.tensordot(pred.weights, torch.softmax(pred.outputs, -1), dims=1)
    assert (pred.probs - expected).abs().max().item() < 1e-15

    pyro.clear_param_store()  # the next guide has the same name and other shapes
    binary = BayesianModule(tanh_net(1), priors.Normal(1.0), likelihoods.Bernoulli(20))
    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0], dtype=DTYPE)
    guide = perturbed_guide(binary, X_NET, y)
    pred = binary.predict(guide, X_NET, num_samples=8, quadrature=quadrature)
    assert pred.probs.shape == (5, 1)
    assert 0.0 <= pred.probs.min().item() <= pred.probs.max().item() <= 1.0


# ------------------------------------------------------------------------- learned noise
def test_learned_noise_adds_one_latent_site_and_vectorizes():
    net = tanh_net(2)
    y = torch.stack([Y_REG, -Y_REG], dim=-1)
    fixed = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    learned = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(20, scale=None))

    def latents(model):
        trace = poutine.trace(model).get_trace(X_NET, y)
        return [
            name
            for name, site in trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"] and name != "data"
        ]

    extra = [name for name in latents(learned) if name not in latents(fixed)]
    assert extra == ["noise_scale"]
    assert len(latents(learned)) == len(latents(fixed)) + 1
    guide = perturbed_guide(learned, X_NET, y)
    losses = []
    for vectorize in (True, False):
        losses.append(
            QuadratureELBO("hadamard", vectorize=vectorize).loss(learned, guide, X_NET, y)
        )
    assert abs(losses[0] - losses[1]) < 1e-10


# ------------------------------------------------------------- convolutions and batch norm
def test_a_convolutional_net_with_batch_norm_runs_in_one_pass_and_keeps_its_statistics():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)
    ).double()
    with torch.no_grad():
        net[1].running_mean.fill_(0.2)
        net[1].running_var.fill_(1.5)
    bnn = BayesianModule(net, priors.LayerwiseNormal("kaiming"), likelihoods.Categorical(40))
    bnn.train()
    assert not net.training  # eval mode: running statistics as they are
    x = torch.linspace(-1.0, 1.0, 64, dtype=DTYPE).reshape(4, 1, 4, 4)
    y = torch.tensor([0, 1, 2, 1])
    guide = perturbed_guide(bnn, x, y)
    losses = [
        QuadratureELBO("hadamard", vectorize=v, name=str(v)).loss(bnn, guide, x, y)
        for v in (True, False)
    ]
    assert abs(losses[0] - losses[1]) < 1e-10
    SVI(bnn, guide, QNVB(), QuadratureELBO()).step(x, y)
    assert torch.all(net[1].running_mean == 0.2) and torch.all(net[1].running_var == 1.5)
    assert int(net[1].num_batches_tracked) == 0
    names = [site.name for site in describe_guide(guide).latent_sites]
    assert names == [name for name, _ in net.named_parameters()]


def test_a_pickled_module_keeps_its_declared_settings_and_an_older_pickle_declares_none():
    import pickle

    bnn = linear_bnn(qnvb_settings={"trust_region": 0.5})
    clone = pickle.loads(pickle.dumps(bnn))
    trace = pyro.poutine.trace(clone).get_trace(X_LIN, Y_LIN)
    assert trace.nodes["weight"]["infer"] == {"qnvb": {"trust_region": 0.5}}
    del bnn.__dict__["qnvb_settings"]  # as pickled before modules declared settings
    old = pickle.loads(pickle.dumps(bnn))
    trace = pyro.poutine.trace(old).get_trace(X_LIN, Y_LIN)
    assert trace.nodes["weight"]["infer"] == {} and old.qnvb_settings == {}


def test_qnvb_settings_must_be_a_mapping():
    with pytest.raises(TypeError, match="qnvb_settings must be a dict of QNVB settings"):
        linear_bnn(qnvb_settings=[("trust_region", 0.3)])
    assert linear_bnn(qnvb_settings={"lr": 0.5}).qnvb_settings == {"lr": 0.5}


# ---------------------------------- nets that vmap cannot batch, and nets that return tuples
class GRUNet(nn.Module):
    """A recurrent net: ``torch.func.vmap`` has no batching rule for ``aten::gru``."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(2, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.unsqueeze(1))
        return self.head(out[:, -1])


def gru_bnn():
    torch.manual_seed(0)
    net = GRUNet().double()
    return BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))


def test_a_net_vmap_cannot_batch_falls_back_to_one_node_at_a_time():
    bnn = gru_bnn()
    guide = perturbed_guide(bnn, X_NET, Y_REG)
    looped = QuadratureELBO("hadamard", vectorize=False).loss(bnn, guide, X_NET, Y_REG)
    elbo = QuadratureELBO("hadamard")
    with pytest.warns(UserWarning, match="Batching rule not implemented.*one by one"):
        loss = elbo.loss(bnn, guide, X_NET, Y_REG)
    assert loss == looped  # the same loop, bit for bit
    assert elbo.vectorized(bnn, guide) is False
    with pytest.raises(RuntimeError, match="network GRUNet cannot run 4 weight draws or nodes"):
        QuadratureELBO("hadamard", vectorize=True).loss(bnn, guide, X_NET, Y_REG)


def test_predict_falls_back_for_a_net_vmap_cannot_batch_and_decides_once():
    bnn = gru_bnn()
    guide = perturbed_guide(bnn, X_NET, Y_REG)
    with pytest.warns(UserWarning, match="predict: .*Batching rule not implemented"):
        pred = bnn.predict(guide, X_NET, quadrature="hadamard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided: no second probe, no second warning
        again = bnn.predict(guide, X_NET, quadrature="hadamard")
    looped = bnn.predict(guide, X_NET, quadrature="hadamard", vectorize=False)
    assert torch.equal(pred.outputs, looped.outputs) and torch.equal(again.mean, looped.mean)
    assert pred.outputs.shape == (4, 5, 1)
    with pytest.raises(RuntimeError, match=r"network GRUNet .* predict fall back by themselves"):
        bnn.predict(guide, X_NET, quadrature="hadamard", vectorize=True)


def test_predict_keeps_the_one_pass_for_a_float32_mlp():
    # a batched product rounds differently from a single one: the check must not mistake that
    # for that (784 inputs: differences of about 3e-6 on logits of about 16 here)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 10))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(1000))
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    guide = AutoMeanFieldNormal(bnn)
    guide(x, y)
    pyro.set_rng_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = bnn.predict(guide, x, num_samples=16)
    pyro.set_rng_seed(3)
    one_pass = bnn.predict(guide, x, num_samples=16, vectorize=True)
    assert torch.equal(default.outputs, one_pass.outputs)  # the vectorized outputs were kept
    pyro.set_rng_seed(3)
    looped = bnn.predict(guide, x, num_samples=16, vectorize=False)
    assert (looped.outputs - one_pass.outputs).abs().max() < 1e-4


def test_a_net_returning_a_tuple_is_refused_naming_the_net():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x):
            out = self.linear(x)
            return out, out.detach()

    bnn = BayesianModule(Pair().double(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    with pytest.raises(TypeError, match="network Pair returned a tuple; the likelihood needs one"):
        bnn(X_NET, Y_REG)
    with pytest.raises(TypeError, match="network Pair returned a tuple"):
        QuadratureELBO("hadamard").loss(bnn, AutoMeanFieldNormal(bnn), X_NET, Y_REG)


# ------------------------------------------------------------- a guide built without the data
def test_a_guide_built_without_the_observations_is_refused():
    # built from bnn(x) alone, an AutoGuide takes the unobserved "obs" for a latent: its entropy
    # and nodes would enter the ELBO silently
    bnn = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    guide = AutoMeanFieldNormal(bnn)
    guide(X_NET)
    assert "obs" in [site.name for site in describe_guide(guide).latent_sites]
    with pytest.raises(ValueError, match="the guide samples 'obs', which the model observes"):
        QuadratureELBO("hadamard").loss(bnn, guide, X_NET, Y_REG)


def test_predict_refuses_a_guide_that_has_not_run():
    bnn = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    guide = AutoMeanFieldNormal(bnn)
    with pytest.raises(ValueError, match=r"guide has not run yet.*guide\(x, y\)"):
        bnn.predict(guide, X_NET)
    assert guide.prototype_trace is None  # and it was left unbuilt


# ---------------------------------------------------------------------- observations' shapes
def test_y_of_another_width_than_the_outputs_is_refused_naming_both():
    bnn = BayesianModule(tanh_net(2), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    with pytest.raises(ValueError, match=r"y has shape \(5,\), but .* rows of shape \(2,\)"):
        bnn(X_NET, Y_REG)


def test_y_of_the_right_size_in_another_layout_is_refused():
    # per-pixel classes: outputs (B, H, W, C) observe labels (B, H, W); (B, W, H) has as many
    # labels, which a reshape would pair with the wrong pixels
    class PerPixel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 4 * 3 * 5)

        def forward(self, x):
            return self.linear(x).reshape(len(x), 4, 3, 5)

    bnn = BayesianModule(PerPixel().double(), priors.Normal(1.0), likelihoods.Categorical(20))
    labels = torch.zeros(5, 4, 3, dtype=torch.long)
    bnn(X_NET, labels)  # the layout of the outputs: accepted
    with pytest.raises(ValueError, match=r"y has shape \(5, 3, 4\).*y must be \(5, 4, 3\)"):
        bnn(X_NET, labels.transpose(1, 2))

    # size-1 dims aside, the layouts agree: outputs (B, 1, 2) observe y (B, 2) value by value
    class Channel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(x)[:, None, :]

    channel = BayesianModule(Channel().double(), priors.Normal(1.0), likelihoods.Gaussian(20))
    pair = torch.stack([Y_REG, -Y_REG], dim=-1)
    trace = poutine.trace(channel).get_trace(X_NET, pair)
    assert torch.equal(trace.nodes["obs"]["value"], pair[:, None, :])
    # one number per row: y may be (B,) or (B, 1), and both observe the same values
    single = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    trace = poutine.trace(single).get_trace(X_NET, Y_REG[:, None])
    assert torch.equal(trace.nodes["obs"]["value"], Y_REG)


def test_bernoulli_takes_integer_and_boolean_labels_as_floats():
    bnn = BayesianModule(tanh_net(), priors.Normal(1.0), likelihoods.Bernoulli(20))
    labels = torch.tensor([1, 0, 0, 1, 1])
    guide = perturbed_guide(bnn, X_NET, labels.to(DTYPE))
    elbo = QuadratureELBO("hadamard")
    losses = [elbo.loss(bnn, guide, X_NET, y) for y in (labels.to(DTYPE), labels, labels.bool())]
    assert losses[0] == losses[1] == losses[2]
    # and the loss is the labels' own: flipping one changes it
    assert elbo.loss(bnn, guide, X_NET, 1 - labels) != losses[0]


# ------------------------------------------------------------ priors: binding, fans, dtypes
def test_one_layerwise_prior_serves_two_networks_each_with_its_own_fans():
    prior = priors.LayerwiseNormal("radford")
    wide = BayesianModule(nn.Linear(400, 2).double(), prior, likelihoods.Gaussian(10))
    narrow = BayesianModule(nn.Linear(4, 2).double(), prior, likelihoods.Gaussian(10))
    for bnn, fan_in in ((wide, 400), (narrow, 4)):  # a bias takes its own layer's fan-in
        scale = bnn.prior_of("bias", bnn.net.bias).base_dist.scale
        assert torch.allclose(scale, torch.full_like(scale, fan_in**-0.5), rtol=1e-15)


def test_an_unbound_layerwise_prior_refuses_a_bias_instead_of_a_unit_scale():
    prior = priors.LayerwiseNormal("radford")
    net = nn.Linear(400, 2).double()
    with pytest.raises(ValueError, match=r"prior of 'bias' \(1-d\).*never bound.*prior.bind"):
        BayesianModule(net, lambda n, p: prior(n, p), likelihoods.Gaussian(10)).prior_of(
            "bias", net.bias
        )
    prior.bind(net.named_parameters(), net.named_modules())
    assert prior.std("bias", net.bias) == 400**-0.5


def test_a_recurrent_layers_biases_take_the_fans_of_their_own_weights():
    gru = nn.GRU(3, 5)  # weight_ih_l0 (15, 3), weight_hh_l0 (15, 5); biases of 15
    prior = priors.LayerwiseNormal("kaiming")
    prior.bind(gru.named_parameters(), gru.named_modules())
    assert prior.std("bias_ih_l0", gru.bias_ih_l0) == (2 / 3) ** 0.5
    assert prior.std("bias_hh_l0", gru.bias_hh_l0) == (2 / 5) ** 0.5
    attention = nn.MultiheadAttention(8, 2)  # in_proj_weight (24, 8), in_proj_bias (24,)
    prior.bind(attention.named_parameters(), attention.named_modules())
    assert prior.std("in_proj_bias", attention.in_proj_bias) == (2 / 8) ** 0.5
    assert prior.std("out_proj.bias", attention.out_proj.bias) == (2 / 8) ** 0.5


def test_a_prior_of_another_dtype_than_its_parameter_is_refused_naming_the_site():
    bnn = BayesianModule(
        nn.Linear(2, 1).double(), lambda n, p: dist.Normal(0.0, 1.0), likelihoods.Gaussian(10)
    )
    with pytest.raises(ValueError, match=r"value of 'weight' is torch\.float32, but the param"):
        bnn(X_NET, Y_REG)


# ---------------------------------------------------- frozen parameters, modes, settings
def test_frozen_parameters_are_constants_neither_latent_nor_trained():
    for local in (False, True):
        pyro.clear_param_store()
        with pyro.settings.context(module_local_params=local):
            net = tanh_net()
            net[0].requires_grad_(False)  # a frozen first layer: a fixed feature map
            frozen = {n: p.detach().clone() for n, p in net[0].named_parameters()}
            bnn = BayesianModule(
                net, priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3), hide=("0.bias",)
            )
            assert list(bnn.latent_parameters()) == ["2.weight", "2.bias"]
            assert set(bnn.frozen_parameters()) == {"0.weight", "0.bias"}
            guide = AutoMeanFieldNormal(bnn)
            svi = SVI(bnn, guide, QNVB(), QuadratureELBO())
            for _ in range(3):
                svi.step(X_NET, Y_REG)
            # the frozen layer is unchanged and still frozen, the model used it as it is
            for name, p in net[0].named_parameters():
                assert torch.equal(p, frozen[name]) and not p.requires_grad
            last = {name: value.detach() for name, value in guide.median().items()}
            features = torch.tanh(X_NET @ frozen["weight"].T + frozen["bias"])
            direct = features @ last["2.weight"].T + last["2.bias"]
            assert torch.allclose(bnn.evaluate(last, X_NET), direct, rtol=1e-12)


def test_a_net_put_back_in_training_mode_is_refused_naming_the_layer():
    net = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(20, scale=0.3))
    bnn.train()  # keeps the net in eval mode
    bnn(X_NET, Y_REG)
    net.train()  # undoes it: batch statistics, and running statistics updated at every node
    with pytest.raises(
        ValueError, match=r"the BatchNorm1d at '1', .* of the network are in training"
    ):
        bnn(X_NET, Y_REG)
    net[0].eval(), net[2].eval(), net[3].eval()
    net.training = False
    with pytest.raises(ValueError, match=r"the BatchNorm1d at '1' .* Call bnn.net.eval\(\)"):
        bnn(X_NET, Y_REG)


def test_misspelt_qnvb_settings_are_refused_when_the_module_is_built():
    with pytest.raises(TypeError, match=r"unknown QNVB settings \['trustregion'\]"):
        linear_bnn(qnvb_settings={"trustregion": 0.3})
    with pytest.raises(ValueError, match="trust_region"):
        linear_bnn(qnvb_settings={"trust_region": -1.0})


def test_an_explicit_vectorize_in_predict_does_not_become_the_default():
    bnn = gru_bnn()
    guide = perturbed_guide(bnn, X_NET, Y_REG)
    bnn.predict(guide, X_NET, quadrature="hadamard", vectorize=False)  # decides nothing
    with pytest.warns(UserWarning, match="predict: .*Batching rule not implemented"):
        bnn.predict(guide, X_NET, quadrature="hadamard")  # the default still tries, and warns
