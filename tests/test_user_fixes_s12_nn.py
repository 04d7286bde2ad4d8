"""Fixes of what a user trial of ``BayesianModule`` on real ``nn.Module`` s found: the padding row
of ``nn.Embedding(padding_idx=p)``, spectral normalization, the message of a weight-normalized net
started at 0, a hidden tied alias, keyword arguments; and the recipes ``docs/nn.md`` gives
(parametrizations' sites and priors, the trained means put back into the net)."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils import spectral_norm as spectral_norm_hook
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, fit, likelihoods, priors

# -- 1. nn.Embedding(padding_idx=p): the layer's own padding row, a constant ------------------


class _SumEmbedding(nn.Module):
    """Tokens (B, T) -> the sum of their embeddings -> one output; padding adds the padding row."""

    def __init__(self, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(6, 3, padding_idx=padding_idx)
        self.head = nn.Linear(3, 1)

    def forward(self, tokens):
        return self.head(self.emb(tokens).sum(1))


class _MaskedSum(_SumEmbedding):
    """The same net without padding_idx, the padded positions multiplied by 0 by hand."""

    def __init__(self):
        super().__init__(padding_idx=None)

    def forward(self, tokens):
        return self.head((self.emb(tokens) * (tokens != 0).unsqueeze(-1)).sum(1))


def _tokens(n=120):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 6, (n, 4), generator=gen)
    tokens[: n // 2, 2:] = 0  # half the rows padded
    y = (tokens == 3).sum(1) - (tokens == 5).sum(1) + 0.1 * torch.randn(n, generator=gen)
    return tokens, y.double()


def test_padding_row_is_the_layers_own_in_every_pass():
    # a padding row set to a constant c: the net adds c at each padded position whatever the
    # sampled row 0 is, in the vectorized pass (draws with a particle lead) and the looped one
    torch.manual_seed(1)
    net = _SumEmbedding().double()
    with torch.no_grad():
        net.emb.weight[0] = torch.tensor([0.5, -0.25, 1.0])
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(8, scale=0.1))
    tokens = torch.tensor([[3, 1, 0, 0], [2, 4, 5, 0], [1, 2, 3, 4]])
    gen = torch.Generator().manual_seed(2)
    draws = {
        name: torch.randn((5, 1, *p.shape), generator=gen, dtype=p.dtype)
        for name, p in bnn.latent_parameters().items()
    }
    batched = bnn.evaluate(draws, tokens)
    for k in range(5):
        one = {name: value[k, 0] for name, value in draws.items()}
        looped = bnn.evaluate(one, tokens)
        reference = _SumEmbedding().double()
        with torch.no_grad():
            for name, value in one.items():
                reference.get_parameter(name).copy_(value)
            reference.emb.weight[0] = net.emb.weight[0]
        expected = reference(tokens)
        torch.testing.assert_close(batched[k], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(looped, expected, rtol=1e-12, atol=1e-12)


def _fitted(make, tokens, y, steps):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    torch.manual_seed(1)
    net = make().double()
    with torch.no_grad():
        net.emb.weight[0] = 0.0  # as nn.Embedding(padding_idx=0) leaves it
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(len(y), scale=0.1))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    history = fit(SVI(bnn, guide, QNVB(), QuadratureELBO()), (tokens, y), steps, progress=False)
    return bnn, guide, history


def test_padded_fit_equals_the_fit_that_masks_the_padding():
    # the padding row contributes nothing in either net, so both fits are the same fit: the same
    # losses and the same predictions (the same draws under one seed), to rounding
    tokens, y = _tokens()
    padded = _fitted(_SumEmbedding, tokens, y, 300)
    masked = _fitted(_MaskedSum, tokens, y, 300)
    torch.testing.assert_close(
        torch.tensor(padded[2].loss), torch.tensor(masked[2].loss), rtol=1e-9, atol=1e-9
    )
    test = torch.tensor([[3, 3, 0, 0], [5, 1, 2, 0], [4, 4, 4, 4]])
    predictions = []
    for bnn, guide, _ in (padded, masked):
        pyro.set_rng_seed(3)
        predictions.append(bnn.predict(guide, test, num_samples=200))
    torch.testing.assert_close(predictions[0].mean, predictions[1].mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(
        predictions[0].variance, predictions[1].variance, rtol=1e-9, atol=1e-9
    )
    # a padded sequence predicts as its unpadded self: [3, 3, 0, 0] as [3, 3], near the truth 2
    bnn, guide, _ = padded
    pyro.set_rng_seed(4)
    with_padding = bnn.predict(guide, torch.tensor([[3, 3, 0, 0]]), num_samples=200)
    pyro.set_rng_seed(4)
    without = bnn.predict(guide, torch.tensor([[3, 3]]), num_samples=200)
    torch.testing.assert_close(with_padding.mean, without.mean, rtol=1e-12, atol=1e-12)
    assert abs(with_padding.mean.item() - 2.0) < 0.2


def test_predict_vectorized_and_looped_use_the_padding_row():
    torch.manual_seed(1)
    net = _SumEmbedding().double()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(8, scale=0.1))
    tokens = torch.tensor([[3, 3, 0, 0], [3, 3, 3, 0]])
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=0.3)
    guide(tokens)
    outputs = []
    for vectorize in (True, False):
        pyro.set_rng_seed(5)
        padded = bnn.predict(guide, tokens, num_samples=16, vectorize=vectorize).outputs
        pyro.set_rng_seed(5)
        short = bnn.predict(guide, tokens[:, :3], num_samples=16, vectorize=vectorize).outputs
        torch.testing.assert_close(padded, short, rtol=1e-12, atol=1e-12)
        outputs.append(padded)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)


def test_a_padding_row_tied_to_an_output_layer_stays_sampled():
    # the output layer's logit of token 0 uses the row: the likelihood sees it, as in plain torch
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3, padding_idx=0)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, tokens):
            return self.out(self.emb(tokens).mean(1))

    torch.manual_seed(1)
    net = Tied().double()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(4))
    assert list(bnn.latent_parameters()) == ["emb.weight"]
    weight = torch.randn(5, 3, dtype=torch.float64)
    tokens = torch.tensor([[1, 0], [2, 3]])
    expected = (weight[tokens].mean(1)) @ weight.T  # the sampled row 0 at both places
    torch.testing.assert_close(bnn.evaluate({"emb.weight": weight}, tokens), expected)


# -- 2. spectral_norm: refused where the weight is sampled or trained ---------------------------


@pytest.mark.parametrize(
    "wrap, site",
    [(spectral_norm, "0.parametrizations.weight.original"), (spectral_norm_hook, "0.weight_orig")],
)
def test_spectral_norm_is_refused_naming_the_layer_and_the_ways_out(wrap, site):
    torch.manual_seed(1)
    net = nn.Sequential(wrap(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 1))
    assert site in dict(net.named_parameters())
    with pytest.raises(ValueError) as raised:
        BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(8, scale=0.3))
    message = str(raised.value)
    for part in ("at '0'", repr(site), "eval mode", "u^T W v", "weight_norm", "requires_grad_"):
        assert part in message
    # hiding it (the name is accepted) is refused too: a point estimate drifts from u, v
    with pytest.raises(ValueError, match="spectral_norm"):
        BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(8, scale=0.3), hide=[site])
    # frozen, it is a constant: the net as plain torch runs it in eval mode
    net[0].requires_grad_(False)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(8, scale=0.3))
    assert list(bnn.latent_parameters()) == ["2.weight", "2.bias"]
    x = torch.randn(5, 4)
    values = {name: p.detach() for name, p in bnn.latent_parameters().items()}
    torch.testing.assert_close(bnn.evaluate(values, x), net(x), rtol=0, atol=0)


def test_spectral_norm_removed_keeping_the_normalized_weight_is_accepted():
    torch.manual_seed(1)
    layer = spectral_norm(nn.Linear(4, 8))
    normalized = layer.weight.detach().clone()
    parametrize.remove_parametrizations(layer, "weight")
    bnn = BayesianModule(
        nn.Sequential(layer, nn.Linear(8, 1)), priors.Normal(1.0), likelihoods.Gaussian(8)
    )
    torch.testing.assert_close(bnn.latent_parameters()["0.weight"].detach(), normalized)
    assert torch.linalg.matrix_norm(normalized, 2).item() == pytest.approx(1.0, abs=1e-4)


# -- 3. weight_norm started at 0: the message names the cause and init_to_net ------------------


def _weight_normed():
    torch.manual_seed(1)
    net = nn.Sequential(weight_norm(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 1))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(12, scale=0.3))
    return net, bnn


def test_weight_norm_started_at_zero_names_init_to_net():
    x, y = torch.randn(12, 4), torch.randn(12)
    pyro.clear_param_store()
    _, bnn = _weight_normed()
    svi = SVI(bnn, AutoMeanFieldNormal(bnn), QNVB(), QuadratureELBO())
    with pytest.raises(ValueError) as raised:
        svi.step(x, y)
    message = str(raised.value)
    assert "site 'obs' is not finite" in message
    assert "'0.parametrizations.weight.original0', '0.parametrizations.weight.original1'" in message
    assert "start at 0 everywhere" in message
    assert "init_loc_fn=bnn.init_to_net()" in message
    assert "check the model's support" not in message
    # the fix it names works
    pyro.clear_param_store()
    _, bnn = _weight_normed()
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    assert torch.isfinite(torch.tensor(SVI(bnn, guide, QNVB(), QuadratureELBO()).step(x, y)))


def test_the_hint_stays_silent_where_no_weight_starts_at_zero():
    _, bnn = _weight_normed()
    trace = pyro.poutine.trace(bnn).get_trace(torch.randn(3, 4))
    assert bnn.invalid_start_hint(trace) is None
    values = {name: torch.zeros_like(p) for name, p in bnn.latent_parameters().items()}
    with pyro.validation_enabled(False):  # the net's output is NaN there
        zero = pyro.poutine.trace(pyro.poutine.condition(bnn, data=values)).get_trace(
            torch.randn(3, 4)
        )
    hint = bnn.invalid_start_hint(zero)
    # the normalized layer's weights are named, not all four
    assert "'0.parametrizations.weight.original0', '0.parametrizations.weight.original1' " in hint
    assert "'2.weight'" not in hint


class _NotANumber(nn.Module):
    """A net whose output is NaN whatever its weights."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x) + torch.sqrt(-x.abs().sum(-1, keepdim=True) - 1.0)


def test_the_hint_stays_silent_for_a_plain_net_at_zero():
    # Pyro's default start puts every weight at 0, so a zero weight is no cause by itself: the
    # hint named weight_norm's 0/0 and init_to_net for a net that is NaN anywhere
    x, y = torch.randn(12, 4), torch.randn(12)
    pyro.clear_param_store()
    bnn = BayesianModule(_NotANumber(), priors.Normal(1.0), likelihoods.Gaussian(12, scale=0.3))
    svi = SVI(bnn, AutoMeanFieldNormal(bnn), QNVB(), QuadratureELBO())
    with pytest.raises(ValueError) as raised:
        svi.step(x, y)
    message = str(raised.value)
    assert "site 'obs' is not finite" in message
    assert "init_to_net" not in message and "start at 0 everywhere" not in message


# -- 4. the docs' claims: parametrized sites and priors, tied weights, keyword arguments ---------


def test_weight_norm_sites_and_their_layerwise_prior():
    net, _ = _weight_normed()
    bnn = BayesianModule(net, priors.LayerwiseNormal("radford"), likelihoods.Gaussian(12))
    latent = bnn.latent_parameters()
    assert list(latent) == [
        "0.bias",
        "0.parametrizations.weight.original0",
        "0.parametrizations.weight.original1",
        "2.weight",
        "2.bias",
    ]
    g, v = (
        latent["0.parametrizations.weight.original0"],
        latent["0.parametrizations.weight.original1"],
    )
    assert g.shape == (8, 1) and v.shape == (8, 4)
    # g, of shape (8, 1), has fan_in 1: radford's 1 / sqrt(fan_in) = 1; v's fan_in is 4
    assert torch.all(bnn.prior_of("0.parametrizations.weight.original0", g).base_dist.scale == 1.0)
    assert torch.all(bnn.prior_of("0.parametrizations.weight.original1", v).base_dist.scale == 0.5)


def test_hiding_a_tied_alias_names_the_first_name():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5)
            self.out.weight = self.emb.weight

    with pytest.raises(
        ValueError, match=r"'out\.weight', which is tied to 'emb\.weight'.*hide 'emb\.weight'"
    ):
        BayesianModule(Tied(), priors.Normal(1.0), likelihoods.Categorical(4), hide=["out.weight"])
    with pytest.raises(ValueError, match=r"\['nope'\], which are not parameters"):
        BayesianModule(Tied(), priors.Normal(1.0), likelihoods.Categorical(4), hide=["nope"])
    bnn = BayesianModule(
        Tied(), priors.Normal(1.0), likelihoods.Categorical(4), hide=["emb.weight"]
    )
    assert list(bnn.latent_parameters()) == ["out.bias"]


def test_keyword_arguments_are_refused_by_name():
    torch.manual_seed(1)
    bnn = BayesianModule(nn.Linear(3, 1), priors.Normal(1.0), likelihoods.Gaussian(4))
    with pytest.raises(TypeError, match=r"keyword arguments \(scale\) are not supported"):
        bnn(torch.randn(4, 3), torch.randn(4), scale=2.0)


def test_the_trained_means_put_back_into_the_net():
    # docs/nn.md: net.load_state_dict(guide.median(), strict=False); the net then computes what
    # the model computes at the guide's medians: a parametrized layer, tied weights, a padding
    # row and a buffer included; the learned noise scale is left out
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 3, padding_idx=0)
            self.hidden = weight_norm(nn.Linear(3, 4))
            self.norm = nn.BatchNorm1d(4)
            self.head = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)
            self.out.weight = self.head.weight  # tied

        def forward(self, tokens):
            h = self.head(torch.tanh(self.norm(self.hidden(self.emb(tokens).sum(1)))))
            return self.out(torch.tanh(h))[:, :1]

    tokens, y = _tokens(40)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    torch.manual_seed(1)
    net = Net().double()
    with torch.no_grad():
        net.norm.running_mean.fill_(0.3)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(40, scale=None))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    fit(SVI(bnn, guide, QNVB(), QuadratureELBO()), (tokens, y), 20, progress=False)
    medians = {name: value.detach() for name, value in guide.median().items()}
    assert "noise_scale" in medians and "out.weight" not in medians and "head.weight" in medians
    with pytest.raises(ValueError, match=r"values for \['noise_scale'\], which are not latent"):
        bnn.evaluate(medians, tokens)
    expected = bnn.evaluate({n: v for n, v in medians.items() if n != "noise_scale"}, tokens)
    before = net.emb.weight.detach().clone()
    missing, unexpected = net.load_state_dict(medians, strict=False)
    assert sorted(missing) == [  # (torch does not count num_batches_tracked missing)
        "norm.running_mean",
        "norm.running_var",
        "out.weight",  # loaded under "head.weight", the same Parameter
    ]
    assert unexpected == ["noise_scale"]
    assert net.out.weight is net.head.weight
    assert not torch.equal(net.emb.weight[1:], before[1:])  # the means were loaded
    torch.testing.assert_close(net.emb.weight[0], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(net(tokens), expected, rtol=1e-12, atol=1e-12)


def test_an_embedding_bag_never_uses_its_padding_row():
    torch.manual_seed(1)
    net = nn.Sequential(nn.EmbeddingBag(6, 3, mode="sum", padding_idx=0), nn.Linear(3, 1)).double()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(4))
    values = {name: p.detach().clone() for name, p in bnn.latent_parameters().items()}
    tokens = torch.tensor([[3, 3, 0, 0], [1, 2, 0, 4]])
    first = bnn.evaluate(values, tokens)
    values["0.weight"][0] = 7.0  # another row 0: the same outputs
    torch.testing.assert_close(bnn.evaluate(values, tokens), first, rtol=0, atol=0)
    torch.testing.assert_close(first[0], bnn.evaluate(values, tokens[:1, :2])[0], rtol=0, atol=0)
