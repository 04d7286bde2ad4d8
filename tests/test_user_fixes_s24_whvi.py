"""Session 24, trial t4: whvi() on transformers, tied and frozen Linears; WHVILinear's input checks;
fwht(normalized=True) in the range of its result."""

from __future__ import annotations

import math

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.linalg import fwht
from pyro_quadvi.nn import BayesianModule, WHVILinear, likelihoods, priors, whvi


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.enc(x).mean(-2)).squeeze(-1)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_whvi_keeps_the_linears_a_transformer_encoder_layer_reads_and_the_net_steps(
    fresh_param_store,
):
    # the encoder layer's fast path reads linear1.weight.device: a WHVILinear there raised a bare
    # AttributeError ('function' object has no attribute 'device') in BayesianModule's eval pass
    torch.manual_seed(0)
    net = whvi(Encoder())
    assert type(net.enc.linear1) is nn.Linear and type(net.enc.linear2) is nn.Linear
    assert type(net.head) is WHVILinear
    x, y = torch.randn(6, 3, 8), torch.randn(6)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(6, scale=1.0))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    loss = SVI(bnn, guide, QNVB(lr=0.1), QuadratureELBO()).step(x, y)
    assert math.isfinite(loss)
    # a decoder layer reads no Linear's weight itself: its feed-forward Linears are replaced
    decoder = whvi(nn.TransformerDecoderLayer(8, 2, 16, batch_first=True, dropout=0.0)).eval()
    assert type(decoder.linear1) is WHVILinear and type(decoder.linear2) is WHVILinear
    assert decoder(x, x).shape == x.shape


def test_whvi_replaces_a_tied_linear_by_one_layer_at_every_place():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    tied = whvi(nn.Sequential(lin, nn.ReLU(), lin))
    assert type(tied[0]) is WHVILinear and tied[2] is tied[0]
    bnn = BayesianModule(tied, priors.Normal(1.0), likelihoods.Gaussian(4))
    assert list(bnn.latent_parameters()) == ["0.g", "0.bias"]
    # skip_last keeps the last distinct Linear, at both of its places
    first = nn.Linear(8, 8)
    kept = whvi(nn.Sequential(first, nn.ReLU(), lin, nn.ReLU(), lin), skip_last=True)
    assert type(kept[0]) is WHVILinear and kept[2] is kept[4] and type(kept[2]) is nn.Linear


def test_a_module_used_twice_stays_latent_and_untouched_after_a_step(fresh_param_store):
    # torch's functional_call(tie_weights=True) swapped the shared layer's place twice and left the
    # sampled tensor in it (pytorch/pytorch#164759): after one model run the layer dropped out of
    # latent_parameters() and the guide, its weight silently a constant
    torch.manual_seed(0)
    for lin in (nn.Linear(4, 4), WHVILinear(4, 4)):
        net = nn.Sequential(nn.Sequential(nn.Linear(2, 4), lin), nn.Tanh(), lin, nn.Linear(4, 1))
        before = dict(net.named_parameters())
        bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(3))
        guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
        SVI(bnn, guide, QNVB(lr=0.1), QuadratureELBO()).step(torch.randn(3, 2), torch.randn(3))
        assert all(p is before[n] for n, p in net.named_parameters())  # the net's own Parameters
        latent = [n for n in before if not n.endswith(("s1", "s2"))]
        assert list(bnn.latent_parameters()) == latent
        prefix = "AutoMeanFieldNormal.locs."
        assert sorted(k[len(prefix) :] for k in pyro.get_param_store() if k.startswith(prefix)) == (
            sorted(latent)
        )
        pyro.clear_param_store()


def test_whvi_replaces_exactly_nn_linear():
    class MyLinear(nn.Linear):
        pass

    net = whvi(nn.Sequential(MyLinear(4, 4), nn.LazyLinear(3), nn.Linear(3, 2)))
    assert [type(m).__name__ for m in net] == ["MyLinear", "LazyLinear", "WHVILinear"]
    lazy = nn.Sequential(nn.LazyLinear(3))
    lazy(torch.zeros(1, 5))  # a LazyLinear that has run is an nn.Linear
    assert type(whvi(lazy)[0]) is WHVILinear


def test_whvi_keeps_a_frozen_linear_frozen():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    net[0].requires_grad_(False)
    net[2].bias.requires_grad_(False)
    converted = whvi(net)
    flags = {n: p.requires_grad for n, p in converted.named_parameters()}
    assert flags == {
        "0.g": False,
        "0.s1": False,
        "0.s2": False,
        "0.bias": False,
        "2.g": True,
        "2.s1": True,
        "2.s2": True,
        "2.bias": False,
    }
    bnn = BayesianModule(converted, priors.Normal(1.0), likelihoods.Gaussian(4))
    assert list(bnn.latent_parameters()) == ["2.g"]


def test_whvi_sizes_take_numpy_integers_not_bools():
    layer = WHVILinear(np.int64(13), np.int32(4))
    assert (layer.in_features, layer.out_features) == (13, 4)
    assert type(layer.in_features) is int and layer.g.shape == (1, 16)
    assert whvi(nn.Sequential(nn.Linear(np.int64(13), 4)))(torch.zeros(2, 13)).shape == (2, 4)
    with pytest.raises(ValueError, match=r"out_features must be a positive integer, got True"):
        WHVILinear(4, True)
    with pytest.raises(ValueError, match=r"in_features must be a positive integer, got 2\.0"):
        WHVILinear(2.0, 4)


def test_a_wrongly_shaped_g_loc_or_scale_is_refused_naming_the_shape():
    layer = WHVILinear(5, 3)
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match=r"^WHVILinear\.weight: g must be a tensor of g's shape "):
        WHVILinear(4, 4).weight(torch.randn(3, 1, 4))
    message = r"loc must be a tensor of g's shape \(stack, D\) = \(1, 8\), got \(2, 8\)"
    with pytest.raises(ValueError, match=message):
        layer.output_moments(x, torch.zeros(2, 8), torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"scale must be .* = \(1, 8\), got \(8,\)"):
        layer.output_moments(x, torch.zeros(1, 8), torch.ones(8))
    mean, factor = layer.output_moments(x, layer.g.detach(), torch.ones(1, 8))
    torch.testing.assert_close(mean, x @ layer.weight().detach().T)
    assert factor.shape == (2, 3, 8)


@pytest.mark.parametrize(
    "dtype, value, size",
    [
        (torch.float16, 20.0, 4096),  # the result 1280; the unnormalized sums reach 81,920 > 65,504
        (torch.float16, 40.0, 2048),  # odd log2 D: the result 1810; unnormalized 81,920
        (torch.bfloat16, 1e36, 4096),  # the result 6.4e37; unnormalized 4.1e39 > 3.4e38
        (torch.float32, 1e35, 4096),  # the result 6.4e36; unnormalized 4.1e38 > 3.4e38
    ],
)
def test_normalized_fwht_overflows_only_where_its_result_does(dtype, value, size):
    x = torch.full((2, size), value, dtype=dtype)
    y = fwht(x, normalized=True)
    assert y.dtype == dtype
    expected = torch.zeros(2, size, dtype=torch.float64)
    expected[:, 0] = x[0, 0].double() * math.sqrt(size)
    tolerance = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(
        y.double(), expected, rtol=tolerance, atol=tolerance * expected[0, 0].item()
    )
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, size, dtype=torch.float64, generator=g)  # ordinary values: still accurate
    reference = fwht(z, normalized=True)
    error = (fwht(z.to(dtype), normalized=True).double() - reference).abs().max()
    assert error < {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5}[dtype]


def test_one_hadamard_steps_predictive_variance_on_a_whvi_layer_is_up_to_d_times_exact(
    fresh_param_store,
):
    # docs/whvi.md#limits: beyond nn.md's 3 times of a Linear(4, 1), at most D (Cauchy-Schwarz)
    torch.manual_seed(0)
    layer = WHVILinear(5, 3, bias=False, dtype=torch.float64)
    bnn = BayesianModule(layer, priors.Normal(1.0), likelihoods.Gaussian(10, scale=1.0))
    guide = AutoMeanFieldNormal(bnn, init_scale=0.5)
    guide(torch.zeros(1, 5, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64))
    x = torch.randn(2000, 5, dtype=torch.float64)
    loc, scale = guide.locs.g.detach(), guide.scales.g.detach()
    _, factor = layer.output_moments(x, loc, scale)
    exact = (factor**2).sum(-1)
    one = bnn.predict(guide, x, quadrature="hadamard")
    ratio = (one.variance - one.noise_variance) / exact
    assert 3.5 < ratio.max() <= layer.size and ratio.min() < 0.01
    period = bnn.predict(guide, x, quadrature="hadamard", steps="period")
    torch.testing.assert_close(period.variance - period.noise_variance, exact)
