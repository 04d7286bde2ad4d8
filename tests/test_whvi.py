"""WHVI layers: the weight S1 H diag(g) H S2, Algorithm 1's blocks, eq. 6, and BayesianModule."""

from __future__ import annotations

import copy
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import scipy.linalg
import torch
from pyro.infer import SVI
from torch import nn
from torch.func import functional_call, vmap

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import (
    BayesianModule,
    WHVILinear,
    likelihoods,
    priors,
    setup_dimensions,
    whvi,
)

F64 = torch.float64


def orthonormal_hadamard(size: int) -> torch.Tensor:
    return torch.from_numpy(scipy.linalg.hadamard(size)).to(F64) / math.sqrt(size)


def random_layer(in_features: int, out_features: int, seed: int = 0, bias: bool = True):
    torch.manual_seed(seed)
    layer = WHVILinear(in_features, out_features, bias=bias, dtype=F64)
    with torch.no_grad():  # S1, S2 away from their initial ones
        layer.s1.normal_()
        layer.s2.normal_()
    return layer


def explicit_blocks(layer: WHVILinear, g: torch.Tensor) -> torch.Tensor:
    """S1_j H diag(g_j) H S2_j of every block, from scipy's Hadamard matrix (eq. 2)."""
    H = orthonormal_hadamard(layer.size)
    return torch.stack(
        [
            torch.diag(layer.s1[j]) @ H @ torch.diag(g[j]) @ H @ torch.diag(layer.s2[j])
            for j in range(layer.stack)
        ]
    ).detach()


# ----------------------------------------------------------------------------- Algorithm 1


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ((128, 128), (128, 0, 1)),
        ((13, 128), (16, 3, 8)),
        ((8, 3), (8, 0, 1)),
        ((5, 3), (8, 3, 1)),
        ((100, 300), (128, 28, 3)),
        ((128, 13), (128, 0, 1)),
        ((1, 1), (1, 0, 1)),
    ],
)
def test_setup_dimensions(sizes, expected):
    assert setup_dimensions(*sizes) == expected


@pytest.mark.parametrize(
    "sizes", [(128, 128), (13, 128), (5, 3), (100, 300), (128, 13), (1, 1), (1, 100), (50, 1)]
)
def test_shapes_and_parameter_count(sizes):
    in_features, out_features = sizes
    layer = WHVILinear(in_features, out_features, dtype=F64)
    names = [name for name, _ in layer.named_parameters()]
    assert names == ["g", "s1", "s2", "bias"]  # only the documented parameters
    if layer.vector:  # Section 2.5: an m x m matrix, m^2 >= n, m a power of two
        n = max(sizes)
        m = layer.size
        assert m * m >= n and (m // 2) ** 2 < n and m & (m - 1) == 0
        assert layer.g.shape == (1, m)
    else:
        size, _, stack = setup_dimensions(*sizes)
        assert layer.g.shape == layer.s1.shape == layer.s2.shape == (stack, size)
    # the paper's count: mean and variance of g and of the bias, and S1, S2
    stack, size = layer.g.shape
    assert layer.num_variational_parameters == 4 * stack * size + 2 * out_features
    x = torch.randn(2, 3, in_features, dtype=F64)
    assert layer(x).shape == (2, 3, out_features)
    assert layer.weight().shape == (out_features, in_features)


def test_parameter_count_of_a_square_layer_and_its_guide():
    # the paper's O(D) count for D = 128: 6 D = 768 against 2 (D^2 + D) = 33,024 for mean field
    layer = WHVILinear(128, 128)
    assert layer.num_variational_parameters == 768
    pyro.clear_param_store()
    bnn = BayesianModule(layer, priors.Normal(1.0), likelihoods.Gaussian(4))
    assert bnn.hide == ("s1", "s2")  # the net is the layer itself: its own names
    guide = AutoMeanFieldNormal(bnn)
    guide(torch.randn(4, 128), torch.randn(4, 128))  # its run registers the hidden pyro.params
    count = sum(v.numel() for v in pyro.get_param_store().values())
    assert count == 768
    pyro.clear_param_store()


# ----------------------------------------------------------------------------- the weight


@pytest.mark.parametrize("sizes", [(8, 8), (13, 40), (5, 3), (16, 2)])
def test_materialized_weight_is_s1_h_g_h_s2(sizes):
    layer = random_layer(*sizes)
    blocks = explicit_blocks(layer, layer.g)
    expected = blocks.reshape(layer.stack * layer.size, layer.size)
    expected = expected[: layer.out_features, : layer.in_features]
    torch.testing.assert_close(layer.weight(), expected, rtol=0, atol=1e-12)
    x = torch.randn(7, sizes[0], dtype=F64)
    torch.testing.assert_close(layer(x), x @ expected.T + layer.bias, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sizes", [(1, 100), (50, 1), (1, 16)])
def test_vector_layer_reshapes_one_whvi_matrix(sizes):
    layer = random_layer(*sizes)
    n = max(sizes)
    w = explicit_blocks(layer, layer.g)[0].reshape(-1)[:n]
    expected = w.unsqueeze(-1) if sizes[0] == 1 else w.unsqueeze(0)
    torch.testing.assert_close(layer.weight(), expected, rtol=0, atol=1e-12)
    x = torch.randn(5, sizes[0], dtype=F64)
    torch.testing.assert_close(layer(x), x @ expected.T + layer.bias, rtol=0, atol=1e-12)


def test_prior_weight_variance_is_prior_scale_squared_over_d():
    # at S1 = S2 = I and g ~ N(0, s^2): W = H diag(g) H has entries of variance s^2 / D
    layer = WHVILinear(16, 16, prior_scale=2.0, dtype=F64)
    torch.manual_seed(1)
    g = 2.0 * torch.randn(20000, 1, 16, dtype=F64)
    weights = vmap(layer.weight)(g)
    variance = weights.var(0)
    assert variance.mean().item() == pytest.approx(4.0 / 16, rel=0.02)
    # and the prior_scale the layer draws its initial g from
    assert WHVILinear(16, 16, prior_scale=2.0).prior_scale == 2.0


# ----------------------------------------------------------------------------- eq. 6


@pytest.mark.parametrize("sizes", [(8, 8), (6, 20), (1, 12), (12, 1)])
def test_output_moments_match_eq6_by_enumeration(sizes):
    """W x is linear in g: W(g) x = sum_k g_k W(e_k) x, so its covariance is
    sum_k var(g_k) (W(e_k) x)(W(e_k) x)^T, enumerated with the materialized weight."""
    layer = random_layer(*sizes, seed=2)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, sizes[0], dtype=F64, generator=generator)
    loc = torch.randn(layer.g.shape, dtype=F64, generator=generator)
    scale = torch.rand(layer.g.shape, dtype=F64, generator=generator) + 0.1
    mean, factor = layer.output_moments(x, loc, scale)
    with torch.no_grad():
        torch.testing.assert_close(mean, x @ layer.weight(loc).T, rtol=0, atol=1e-12)
        columns = []
        for k in range(loc.numel()):
            unit = torch.zeros(loc.numel(), dtype=F64)
            unit[k] = 1.0
            columns.append(x @ layer.weight(unit.reshape(loc.shape)).T)  # (3, out)
        jacobian = torch.stack(columns, dim=-1)  # (3, out, num_g)
        covariance = jacobian @ torch.diag_embed(scale.reshape(-1) ** 2) @ jacobian.mT
        torch.testing.assert_close(factor @ factor.mT, covariance, rtol=0, atol=1e-12)


def test_output_moments_match_monte_carlo():
    layer = random_layer(6, 12, seed=4)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(6, dtype=F64, generator=generator)
    loc = torch.randn(layer.g.shape, dtype=F64, generator=generator)
    scale = 0.5 * torch.rand(layer.g.shape, dtype=F64, generator=generator) + 0.2
    mean, factor = layer.output_moments(x, loc, scale)
    draws = loc + scale * torch.randn((200_000, *loc.shape), dtype=F64, generator=generator)
    with torch.no_grad():
        outputs = vmap(lambda g: functional_call(layer, {"g": g}, (x,)))(draws) - layer.bias
    covariance = factor @ factor.T
    torch.testing.assert_close(outputs.mean(0), mean, rtol=0, atol=0.02)
    empirical = torch.cov(outputs.T)
    assert (empirical - covariance).abs().max() < 0.03 * covariance.abs().max()
    # the covariance across outputs is not diagonal: q(W) is matrix-variate (eq. 3-5)
    off_diagonal = covariance - torch.diag(torch.diag(covariance))
    assert off_diagonal.abs().max() > 0.1 * torch.diag(covariance).max()


# ----------------------------------------------------------------------------- whvi(net)


def test_whvi_replaces_linear_layers_in_a_copy():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
    net.append(nn.Linear(32, 1)).double()
    converted = whvi(net)
    assert [type(m).__name__ for m in converted] == ["WHVILinear", "ReLU"] * 2 + ["WHVILinear"]
    assert all(type(m) is not WHVILinear for m in net)  # the original is untouched
    assert torch.equal(converted[0].bias, net[0].bias)  # biases copied
    assert converted[0].g.dtype == F64
    kept = whvi(net, skip_last=True, prior_scale=0.5)
    assert type(kept[4]) is nn.Linear and torch.equal(kept[4].weight, net[4].weight)
    assert kept[2].prior_scale == 0.5
    bnn = BayesianModule(kept, priors.Normal(1.0), likelihoods.Gaussian(4))
    assert bnn.hide == ("0.s1", "0.s2", "2.s1", "2.s2")
    assert isinstance(whvi(nn.Linear(4, 4)), WHVILinear)
    x = torch.randn(5, 13, dtype=F64)
    assert converted(x).shape == (5, 1)


def test_declared_prior_of_g_and_the_layerwise_bias():
    net = whvi(nn.Sequential(nn.Linear(13, 32), nn.Tanh(), nn.Linear(32, 3)), skip_last=True)
    net[0].prior_scale = 0.7
    bnn = BayesianModule(net, priors.LayerwiseNormal("radford"), likelihoods.Gaussian(4))
    params = dict(net.named_parameters())
    g = bnn.prior_of("0.g", params["0.g"]).base_dist
    assert torch.equal(g.scale, torch.full((2, 16), 0.7)) and torch.equal(g.loc, torch.zeros(2, 16))
    # the WHVI bias gets the fans of the (32, 13) weight it stands for: 1 / sqrt(13)
    bias = bnn.prior_of("0.bias", params["0.bias"]).base_dist
    assert bias.scale[0].item() == pytest.approx(1 / math.sqrt(13))
    weight = bnn.prior_of("2.weight", params["2.weight"]).base_dist
    assert weight.scale[0, 0].item() == pytest.approx(1 / math.sqrt(32))


# ----------------------------------------------------------------------------- BayesianModule


def make_net():
    torch.manual_seed(0)
    net = whvi(nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 1)), skip_last=True)
    net = net.double()
    with torch.no_grad():  # S1, S2 away from ones, a prior scale away from 1
        net[0].s1.normal_()
        net[0].s2.normal_()
    net[0].prior_scale = 0.6
    return net


def make_bnn(net=None):
    """The automatic set-up: the WHVI layer declares its S1, S2 and the prior of g."""
    net = make_net() if net is None else net
    return BayesianModule(net, priors.LayerwiseNormal(), likelihoods.Gaussian(20, scale=0.5))


def make_manual_bnn(net):
    """The set-up by hand, declarations ignored: hide S1, S2 and write g's prior."""
    layerwise = priors.LayerwiseNormal()
    dense = torch.empty(12, 5, device="meta")  # the weight the WHVI layer stands for
    layerwise.bind([*net.named_parameters(), ("0.weight", dense)])

    def prior(name, param):
        if name == "0.g":
            loc = torch.zeros_like(param).detach()
            return dist.Normal(loc, torch.full_like(loc, 0.6))
        return layerwise(name, param)

    likelihood = likelihoods.Gaussian(20, scale=0.5)
    return BayesianModule(net, prior, likelihood, hide=["0.s1", "0.s2"], declarations=False)


def test_automatic_set_up_equals_the_manual_one(fresh_param_store):
    net = make_net()
    auto, manual = make_bnn(net), make_manual_bnn(net)
    assert auto.hide == tuple(manual.hide) == ("0.s1", "0.s2")
    assert list(auto.latent_parameters()) == list(manual.latent_parameters())
    assert list(auto.latent_parameters()) == ["0.g", "0.bias", "2.weight", "2.bias"]
    generator = torch.Generator().manual_seed(9)
    for name, param in auto.latent_parameters().items():
        value = torch.randn((3, *param.shape), dtype=F64, generator=generator)
        expected = manual.prior_of(name, param).log_prob(value)
        assert torch.equal(auto.prior_of(name, param).log_prob(value), expected), name
    # the declared g ~ N(0, 0.6^2), by hand: sum of -v^2 / (2 s^2) - log s - log(2 pi) / 2
    value = torch.randn(net[0].g.shape, dtype=F64, generator=generator)
    closed = (-(value**2) / (2 * 0.36) - math.log(0.6) - 0.5 * math.log(2 * math.pi)).sum()
    got = auto.prior_of("0.g", net[0].g).log_prob(value)
    torch.testing.assert_close(got, closed, rtol=0, atol=1e-12)
    # the WHVI bias: radford's 1 / sqrt(fan_in) of the dense (12, 5) weight, not fan_in = 1
    assert auto.prior_of("0.bias", net[0].bias).base_dist.scale[0].item() == 5**-0.5


def run_steps(bnn, x, y, steps=3):
    pyro.clear_param_store()
    pyro.set_rng_seed(11)
    guide = AutoMeanFieldNormal(bnn)
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO())
    losses = [svi.step(x, y) for _ in range(steps)]
    state = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return losses, state


def test_a_qnvb_step_equals_the_manual_set_up_bit_for_bit(fresh_param_store):
    net = make_net()
    generator = torch.Generator().manual_seed(10)
    x = torch.randn(20, 5, dtype=F64, generator=generator)
    y = torch.sin(x.sum(-1))
    auto_losses, auto_state = run_steps(make_bnn(copy.deepcopy(net)), x, y)
    manual_losses, manual_state = run_steps(make_manual_bnn(copy.deepcopy(net)), x, y)
    assert auto_losses == manual_losses
    assert list(auto_state) == list(manual_state)
    assert "net.0.s1" in auto_state  # the hidden S1 went through the fallback optimizer
    assert not torch.equal(auto_state["net.0.s1"], net[0].s1)
    for name, value in auto_state.items():
        assert torch.equal(value, manual_state[name]), name


def test_explicit_hide_and_prior_win_over_declarations(fresh_param_store):
    net = make_net()
    lik = likelihoods.Gaussian(20, scale=0.5)
    # a given hide is the whole hidden set: s2 becomes latent under the network's prior
    bnn = BayesianModule(net, priors.Normal(2.0), lik, hide=["0.s1"])
    assert bnn.hide == ("0.s1",)
    assert list(bnn.latent_parameters()) == ["0.g", "0.s2", "0.bias", "2.weight", "2.bias"]
    assert torch.equal(
        bnn.prior_of("0.s2", net[0].s2).base_dist.scale, torch.full((2, 8), 2.0, dtype=F64)
    )
    assert torch.equal(
        bnn.prior_of("0.g", net[0].g).base_dist.scale, torch.full((2, 8), 0.6, dtype=F64)
    )
    # hiding the declared g: a point estimate, its declared prior unused
    bnn = BayesianModule(net, priors.Normal(2.0), lik, hide=["0.g", "0.s1", "0.s2"])
    assert list(bnn.latent_parameters()) == ["0.bias", "2.weight", "2.bias"]
    # declarations=False: the network's prior for g, nothing hidden unless asked
    bnn = BayesianModule(net, priors.Normal(2.0), lik, declarations=False)
    assert bnn.hide == ()
    assert torch.equal(
        bnn.prior_of("0.g", net[0].g).base_dist.scale, torch.full((2, 8), 2.0, dtype=F64)
    )
    # hide=() keeps every parameter latent, g under its declared prior
    bnn = BayesianModule(net, priors.Normal(2.0), lik, hide=())
    assert len(bnn.latent_parameters()) == 6
    assert torch.equal(
        bnn.prior_of("0.g", net[0].g).base_dist.scale, torch.full((2, 8), 0.6, dtype=F64)
    )


class Declaring(nn.Module):
    """A layer whose declaration the test sets."""

    def __init__(self, declared):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 3))
        self.declared = declared

    def bayesian_parameters(self):
        return self.declared

    def forward(self, x):
        return x @ self.weight.T


def test_bad_declarations_name_the_module_and_the_parameter():
    lik, prior = likelihoods.Gaussian(4), priors.Normal(1.0)
    net = nn.Sequential(nn.Tanh(), Declaring({"wieght": "deterministic"}))
    with pytest.raises(ValueError, match=r"Declaring at '1' declares 'wieght'.*\(weight\)"):
        BayesianModule(net, prior, lik)
    net = nn.Sequential(nn.Tanh(), Declaring({"weight": "fixed"}))
    with pytest.raises(TypeError, match=r"Declaring at '1' declares 'weight' as 'fixed'"):
        BayesianModule(net, prior, lik)
    net = nn.Sequential(Declaring(["weight"]))
    with pytest.raises(TypeError, match=r"Declaring at '0': bayesian_parameters\(\) must return"):
        BayesianModule(net, prior, lik)
    net = nn.Sequential(Declaring({"weight": dist.Normal(torch.zeros(3), 1.0)}))
    with pytest.raises(
        ValueError,
        match=r"prior of '0.weight' \(declared by the Declaring at '0'\) has shape \(3,\)",
    ):
        BayesianModule(net, prior, lik)
    # a declaration changed after the module was built is caught, not silently used
    layer = Declaring({"weight": dist.Normal(torch.zeros(2, 3), 1.0)})
    bnn = BayesianModule(layer, prior, lik)
    layer.declared = {"weight": "deterministic"}
    with pytest.raises(ValueError, match="build a new one"):
        bnn(torch.zeros(4, 3))
    # two layers sharing one parameter may not both declare it
    first = Declaring({"weight": "deterministic"})
    second = Declaring({"weight": "deterministic"})
    second.weight = first.weight
    with pytest.raises(
        ValueError, match=r"Declaring at '1' declares 'weight', the net's '0.weight'"
    ):
        BayesianModule(nn.Sequential(first, second), prior, lik)
    with pytest.raises(TypeError, match="iterable of parameter names"):
        BayesianModule(nn.Linear(2, 2), prior, lik, hide="weight")


def test_one_pass_equals_the_loop(fresh_param_store):
    bnn = make_bnn()
    assert list(bnn.latent_parameters()) == ["0.g", "0.bias", "2.weight", "2.bias"]
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(9, 5, dtype=F64, generator=generator)
    K = 4
    values = {
        name: torch.randn((K, 1, *p.shape), dtype=F64, generator=generator)
        for name, p in bnn.latent_parameters().items()
    }
    batched = bnn.evaluate(values, x)
    looped = [bnn.evaluate({n: v[k, 0] for n, v in values.items()}, x) for k in range(K)]
    looped = torch.stack(looped)
    assert batched.shape == (K, 9, 1)
    torch.testing.assert_close(batched, looped, rtol=0, atol=1e-13)


def test_qnvb_trains_g_and_the_fallback_trains_s1_s2(fresh_param_store):
    bnn = make_bnn()
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(20, 5, dtype=F64, generator=generator)
    y = torch.sin(x.sum(-1))
    guide = AutoMeanFieldNormal(bnn)
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO())
    first = svi.step(x, y)
    for _ in range(60):
        last = svi.step(x, y)
    store = pyro.get_param_store()
    s1 = store["net.0.s1"]
    assert s1.shape == (2, 8) and not torch.equal(s1, torch.ones_like(s1))  # point estimates
    names = [site.name for site in guide.mean_field_sites()]
    assert names == ["0.g", "0.bias", "2.weight", "2.bias"]
    assert last < first - 5.0  # the ELBO improved


def test_network_counts_of_the_docs(fresh_param_store):
    """docs/whvi.md: 13-128-128-1 with a learned noise, 1,796 (WHVI) against 36,868 (MFG)."""
    x, y = torch.randn(4, 13), torch.randn(4)
    counts = {}
    for kind in ("WHVI", "MFG"):
        pyro.clear_param_store()
        net = nn.Sequential(nn.Linear(13, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        net.append(nn.Linear(128, 1))
        if kind == "WHVI":
            net = whvi(net, skip_last=True)
        bnn = BayesianModule(net, priors.LayerwiseNormal(), likelihoods.Gaussian(4, scale=None))
        AutoMeanFieldNormal(bnn)(x, y)
        counts[kind] = sum(v.numel() for v in pyro.get_param_store().values())
    assert counts == {"WHVI": 1796, "MFG": 36868}


def test_one_pass_gradients_equal_the_loop(fresh_param_store):
    bnn = make_bnn()
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(9, 5, dtype=F64, generator=generator)
    weights = torch.randn(3, 9, 1, dtype=F64, generator=generator)
    values = {
        name: torch.randn((3, 1, *p.shape), dtype=F64, generator=generator, requires_grad=True)
        for name, p in bnn.latent_parameters().items()
    }
    batched = torch.autograd.grad((bnn.evaluate(values, x) * weights).sum(), list(values.values()))
    looped = []
    for k in range(3):
        out = bnn.evaluate({n: v[k, 0] for n, v in values.items()}, x)
        looped.append(torch.autograd.grad((out * weights[k]).sum(), list(values.values())))
    for i, value in enumerate(batched):
        torch.testing.assert_close(value, sum(g[i] for g in looped), rtol=0, atol=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        WHVILinear(0, 4)
    with pytest.raises(ValueError, match="prior_scale must be > 0"):
        WHVILinear(4, 4, prior_scale=0.0)
    with pytest.raises(ValueError, match="in_features=4"):
        WHVILinear(4, 4)(torch.zeros(2, 5))
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        whvi("net")


@pytest.mark.parametrize("bias", ["yes", "no", 1, 0, None])
def test_bias_must_be_a_bool(bias):
    # nn.Linear's `if bias:` would give "no" a bias and None none: refused, naming bias
    with pytest.raises(TypeError, match=r"WHVILinear: bias must be True or False \(a numpy "):
        WHVILinear(4, 3, bias=bias)
    assert WHVILinear(4, 3, bias=False).bias is None


@pytest.mark.parametrize("flag", [np.bool_, torch.tensor])
def test_bias_may_be_a_numpy_bool_or_a_bool_tensor(flag):
    # nn.Linear reads them as the bools they are; they were refused as "not True or False"
    for value in (True, False):
        layer, linear = WHVILinear(4, 3, bias=flag(value)), nn.Linear(4, 3, bias=flag(value))
        assert (layer.bias is None, linear.bias is None) == (not value, not value)
        assert f"bias={value}," in repr(layer)
    with pytest.raises(TypeError, match=r"got tensor\(\[True\]\) \(Tensor\)$"):
        WHVILinear(4, 3, bias=torch.tensor([True]))  # one entry, not a 0-d flag
