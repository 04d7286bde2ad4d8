"""Fixes of what a trial reader found in ``pyro_quadvi.nn``: attention layers under ``vmap``,
chunked ``predict``, a custom likelihood, the messages of misuse, batch norm without running
statistics, hidden parameters after a restored store, ``Predictive`` on a large test set and the
fans of a transposed convolution."""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.infer.batched import vmap_safe_attention
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss

# -- 1. attention layers in a vectorized pass ---------------------------------------------------


class _Encoder(nn.Module):
    """Tokens -> a TransformerEncoderLayer -> mean over positions -> two logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens):
        return self.out(self.enc(self.emb(tokens)).mean(1))


class _Attention(nn.Module):
    """Features -> self-attention (nn.MultiheadAttention) -> mean over positions -> two logits."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.att(x, x, x, need_weights=False)[0].mean(1))


def _attention_problem(kind):
    torch.manual_seed(0)
    if kind == "transformer":
        net, x = _Encoder(), torch.randint(0, 7, (6, 5))
    else:
        net, x = _Attention(), torch.randn(6, 5, 4)
    return net, x, torch.randint(0, 2, (6,))


@pytest.fixture(params=[True, False], ids=["fastpath-on", "fastpath-off"])
def fastpath(request):
    """Runs the test with the global fast-path flag set to each value, and checks that the test
    left it as it found it."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(request.param)
    try:
        yield request.param
        assert torch.backends.mha.get_fastpath_enabled() is request.param
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _elbo_loss_and_grads(bnn, guide, x, y, vectorize):
    pyro.set_rng_seed(5)
    for p in guide.parameters():
        p.grad = None
    loss = QuadratureELBO(vectorize=vectorize).differentiable_loss(bnn, guide, x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in guide.parameters()]


@pytest.mark.parametrize("kind", ["transformer", "attention"])
def test_attention_nets_run_the_vectorized_elbo_as_the_loop(kind, fastpath):
    pyro.clear_param_store()
    net, x, y = _attention_problem(kind)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Categorical(30))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(x, y)
    loss_v, grads_v = _elbo_loss_and_grads(bnn, guide, x, y, True)
    loss_l, grads_l = _elbo_loss_and_grads(bnn, guide, x, y, False)
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=0)
    assert len(grads_v) == len(grads_l) > 0
    for g_v, g_l in zip(grads_v, grads_l):
        torch.testing.assert_close(g_v, g_l, rtol=1e-5, atol=1e-5 * g_l.abs().max().item())
    # one QNVB step through SVI's vectorized pass moves the guide
    locs = [p.detach().clone() for p in guide.parameters()]
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO(vectorize=True))
    assert torch.isfinite(torch.tensor(svi.step(x, y)))
    assert any(not torch.equal(p, q) for p, q in zip(guide.parameters(), locs))


@pytest.mark.parametrize("kind", ["transformer", "attention"])
def test_attention_nets_run_the_optimizer_vectorized_as_the_loop(kind, fastpath):
    net, x, y = _attention_problem(kind)
    net = net.double().eval()  # eval: no dropout, and the mode in which the fast path is taken
    x = x if kind == "transformer" else x.double()
    runs = []
    for vectorize in (True, False):
        copy_ = copy.deepcopy(net)
        optimizer = QNVBOptimizer(
            copy_.named_parameters(),
            likelihood_weight=6,
            quadrature="hadamard",
            init_sigma=0.05,
            generator=torch.Generator().manual_seed(3),
        )
        loss = optimizer.step(
            loss_fn=module_loss(copy_, F.cross_entropy), batch=(x, y), vectorize=vectorize
        )
        runs.append((loss, [p.detach().clone() for p in copy_.parameters()]))
    (loss_v, params_v), (loss_l, params_l) = runs
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=0)
    moved = False
    for p_v, p_l, p0 in zip(params_v, params_l, net.parameters()):
        torch.testing.assert_close(p_v, p_l, rtol=1e-5, atol=1e-8)
        moved = moved or not torch.equal(p_l, p0.detach())
    assert moved


@pytest.mark.parametrize("before", [True, False])
def test_the_fast_path_flag_is_restored_after_an_error(before):
    saved = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(before)
    try:
        with pytest.raises(ZeroDivisionError), vmap_safe_attention():
            assert torch.backends.mha.get_fastpath_enabled() is False
            raise ZeroDivisionError("inside the pass")
        assert torch.backends.mha.get_fastpath_enabled() is before
    finally:
        torch.backends.mha.set_fastpath_enabled(saved)


# -- 2. predict in pieces of batch_size rows ------------------------------------------------------


class _Rows(nn.Module):
    """A small MLP that records the number of rows of each input it is run on."""

    def __init__(self, outputs):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, outputs))
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.body(x)


@pytest.mark.parametrize("kind", ["gaussian", "categorical"])
@pytest.mark.parametrize("quadrature", [None, "hadamard"])
@pytest.mark.parametrize("vectorize", [True, False])
def test_predict_in_pieces_equals_one_pass(kind, quadrature, vectorize):
    pyro.clear_param_store()
    torch.manual_seed(1)
    if kind == "gaussian":  # a learned noise scale: its draws are taken once too
        net, likelihood = _Rows(1), likelihoods.Gaussian(10, scale=None)
        y = torch.randn(10)
    else:
        net, likelihood = _Rows(4), likelihoods.Categorical(10)
        y = torch.randint(0, 4, (10,))
    x = torch.randn(10, 3)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihood)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=0.3)
    guide(x, y)
    results = []
    for batch_size in (None, 4):
        pyro.set_rng_seed(7)
        net.rows.clear()
        results.append(
            bnn.predict(
                guide,
                x,
                num_samples=5,
                quadrature=quadrature,
                vectorize=vectorize,
                batch_size=batch_size,
            )
        )
        rows = sorted(set(net.rows))
        assert rows == ([10] if batch_size is None else [2, 4]), rows
    whole, pieces = results
    for field in ("outputs", "weights", "mean", "probs", "variance", "noise_variance"):
        a, b = getattr(whole, field), getattr(pieces, field)
        assert (a is None) == (b is None) == (field in _absent(kind)), field
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=field)
    # the draws differ from one another (the comparison is not of one repeated net)
    assert (whole.outputs[0] - whole.outputs[-1]).abs().max() > 1e-3


def _absent(kind):
    return ("variance", "noise_variance") if kind == "categorical" else ("probs",)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_predict_refuses_a_bad_batch_size_by_name(bad):
    pyro.clear_param_store()
    bnn = BayesianModule(nn.Linear(3, 2), priors.Normal(1.0), likelihoods.Categorical(4))
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    guide = AutoMeanFieldNormal(bnn)
    guide(x, y)
    with pytest.raises((TypeError, ValueError), match=rf"batch_size .*got {bad!r}"):
        bnn.predict(guide, x, batch_size=bad)


# -- 3. a custom likelihood: heteroscedastic regression (the example of docs/nn.md) ----------------


class Heteroscedastic(likelihoods.Likelihood):
    """``y ~ Normal(out[..., 0], exp(out[..., 1]))``: the net outputs a mean and a log-scale."""

    def row_shape(self, outputs, batch_dims):
        return outputs.shape[batch_dims + 1 : -1]  # two outputs a row observe one number

    def distribution(self, outputs, latents, row_dims):
        return dist.Normal(outputs[..., 0], outputs[..., 1].exp()).to_event(row_dims)


def _heteroscedastic_problem():
    pyro.clear_param_store()
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.linspace(-2, 2, 12, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(12, dtype=torch.float64)
    return BayesianModule(net, priors.Normal(1.0), Heteroscedastic(dataset_size=48)), x, y


def test_a_heteroscedastic_likelihood_is_the_hand_computed_normal():
    bnn, x, y = _heteroscedastic_problem()
    weights = {name: p.detach() for name, p in bnn.latent_parameters().items()}
    trace = poutine.trace(poutine.condition(bnn, data=weights)).get_trace(x, y)
    trace.compute_log_prob()
    site = trace.nodes["obs"]
    with torch.no_grad():
        out = bnn.net(x)
    by_hand = torch.distributions.Normal(out[:, 0], out[:, 1].exp()).log_prob(y).sum()
    assert site["log_prob"].shape == (12,)
    assert site["scale"] == 4.0  # dataset_size / rows = 48 / 12, in the trace's log_prob already
    torch.testing.assert_close(site["log_prob"].sum(), 4 * by_hand, rtol=1e-12, atol=0)


def test_a_heteroscedastic_likelihood_runs_vectorized_as_the_loop():
    bnn, x, y = _heteroscedastic_problem()
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=0.1)
    guide(x, y)
    loss_v, grads_v = _elbo_loss_and_grads(bnn, guide, x, y, True)
    loss_l, grads_l = _elbo_loss_and_grads(bnn, guide, x, y, False)
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-10, atol=0)
    for g_v, g_l in zip(grads_v, grads_l):
        torch.testing.assert_close(g_v, g_l, rtol=1e-10, atol=1e-10)
    # predict: no variance for a likelihood it does not know; the docs' law of total variance
    p = bnn.predict(guide, x, quadrature="hadamard")
    assert p.variance is None and p.probs is None
    mu, sigma2 = p.outputs[..., 0], (2 * p.outputs[..., 1]).exp()  # as docs/nn.md computes it
    mean = p.mean[:, 0]
    variance = p.weights @ (mu - mean) ** 2 + p.weights @ sigma2
    # the same by a loop over the draws: E[Var(y | theta)] + Var(E[y | theta])
    second = sum(w * (o[:, 0] ** 2 + (2 * o[:, 1]).exp()) for w, o in zip(p.weights, p.outputs))
    torch.testing.assert_close(variance, second - mean**2, rtol=1e-9, atol=1e-12)


# -- 4. (B, C, H, W) logits with Categorical ------------------------------------------------------


def test_categorical_names_the_class_dim_and_the_permute_for_images():
    bnn = BayesianModule(nn.Conv2d(2, 3, 1), priors.Normal(1.0), likelihoods.Categorical(60))
    x, y = torch.randn(6, 2, 4, 5), torch.randint(0, 3, (6, 4, 5))
    with pytest.raises(ValueError) as error:
        bnn(x, y)
    message = str(error.value)
    assert "classes are the last dim of the network's outputs (6, 3, 4, 5)" in message
    assert "logits.permute(0, 2, 3, 1)" in message
    assert "(6, 4, 5, 3) logits observe y of shape (6, 4, 5)" in message
    assert "y must be (6, 3, 4)" not in message  # the misleading fix of before

    class Permuted(nn.Module):  # the fix the message gives
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 1)

        def forward(self, x):
            return self.conv(x).permute(0, 2, 3, 1)

    fixed = BayesianModule(Permuted(), priors.Normal(1.0), likelihoods.Categorical(60))
    trace = poutine.trace(fixed).get_trace(x, y)
    assert trace.nodes["obs"]["fn"].event_shape == (4, 5)
    assert torch.equal(trace.nodes["obs"]["value"], y)


# -- 5. a prior callable that returns a tensor ----------------------------------------------------


@pytest.mark.parametrize(
    "prior, got",
    [
        (lambda name, p: torch.zeros(1), r"a tensor of shape \(1,\)"),
        (lambda name, p: 0.0, r"0.0 \(float\)"),
    ],
)
def test_a_prior_that_is_not_a_distribution_is_refused_naming_the_parameter(prior, got):
    pyro.clear_param_store()
    bnn = BayesianModule(nn.Linear(3, 1), prior, likelihoods.Gaussian(4))
    x, y = torch.randn(4, 3), torch.randn(4)
    with pytest.raises(
        TypeError, match=rf"returned {got} for the parameter 'weight'.*distribution"
    ):
        bnn(x, y)
    with pytest.raises(TypeError, match=r"parameter 'weight'.*must return a distribution"):
        AutoMeanFieldNormal(bnn)(x, y)


# -- 6. the train-mode refusal names the layers --------------------------------------------------


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.linear(x))


def test_the_train_mode_refusal_names_the_layers_by_path():
    pyro.clear_param_store()
    net = nn.Sequential()
    net.add_module("block", _Block())
    net.add_module("drop", nn.Dropout(0.5))
    net.add_module("out", nn.Linear(4, 1))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(4))
    x, y = torch.randn(4, 3), torch.randn(4)
    net.block.bn.train()  # one layer: the container above it stays in eval mode
    with pytest.raises(
        ValueError,
        match=r"^BayesianModule: the BatchNorm1d at 'block\.bn' of the "
        r"network is in training mode",
    ):
        bnn(x, y)
    net.train()  # every module: the layers are named, not the containers
    with pytest.raises(ValueError) as error:
        bnn(x, y)
    message = str(error.value)
    assert message.startswith(
        "BayesianModule: the Linear at 'block.linear', the BatchNorm1d at 'block.bn', the Dropout "
        "at 'drop', the Linear at 'out' of the network are in training mode"
    ), message
    assert "Sequential" not in message and "_Block" not in message
    net.eval()
    bnn(x, y)  # accepted again


# -- 7. batch norm that normalizes with the batch's statistics in eval mode ---------------------


def test_a_batch_norm_without_running_statistics_is_refused_naming_it_and_the_fix():
    pyro.clear_param_store()
    block = _Block()
    block.bn = nn.BatchNorm1d(4, track_running_stats=False)
    net = nn.Sequential()
    net.add_module("block", block)
    net.add_module("out", nn.Linear(4, 1))
    x = torch.randn(6, 3)
    # the hazard: in eval mode the layer's output for a row depends on the rows passed with it
    net.eval()
    with torch.no_grad():
        assert (net(x)[:3] - net(x[:3])).abs().max() > 1e-2
    with pytest.raises(
        ValueError,
        match=r"^BayesianModule: the BatchNorm1d at 'block\.bn' has no running statistics "
        r"\(track_running_stats=False\).*nn\.LayerNorm or nn\.GroupNorm.*"
        r"track_running_stats=True",
    ):
        BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(6))


def test_normalizations_that_treat_each_row_alone_are_accepted_and_predict_row_by_row():
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(3, 4),
        nn.BatchNorm1d(4),  # running statistics: an affine map in eval mode
        nn.LayerNorm(4),
        nn.Unflatten(1, (2, 2)),
        nn.InstanceNorm1d(2),  # track_running_stats=False, but it normalizes each row alone
        nn.Flatten(),
        nn.Linear(4, 1),
    ).double()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(6, scale=0.5))
    x = torch.randn(6, 3, dtype=torch.float64)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=0.1)
    guide(x, torch.zeros(6, dtype=torch.float64))
    whole = bnn.predict(guide, x, quadrature="hadamard")
    one_by_one = bnn.predict(guide, x, quadrature="hadamard", batch_size=1)
    torch.testing.assert_close(one_by_one.mean, whole.mean, rtol=1e-12, atol=1e-12)
    assert whole.variance.min() > 0.25  # the noise's 0.5^2 and a model part


# -- 8. hidden parameters follow a restored param store -----------------------------------------


def _hidden_problem():
    """A small regression with the first layer's bias hidden: the net, bnn, guide and SVI."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    bnn = BayesianModule(
        net, priors.Normal(1.0), likelihoods.Gaussian(32, scale=0.1), hide=["0.bias"]
    )
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    optim = QNVB()
    return net, bnn, guide, optim, SVI(bnn, guide, optim, QuadratureELBO())


def test_a_hidden_parameter_of_the_net_follows_a_restored_store():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    y = x[:, 0] - x[:, 1] + 0.1 * torch.randn(32, generator=generator, dtype=torch.float64)
    net, _, _, _, svi = _hidden_problem()
    for _ in range(6):
        svi.step(x, y)
    reference = net.state_dict()["0.bias"].clone()  # the store holds the net's own Parameter
    assert pyro.get_param_store()["net.0.bias"] is net[0].bias

    net, _, guide, optim, svi = _hidden_problem()
    for _ in range(3):
        svi.step(x, y)
    saved = (pyro.get_param_store().get_state(), optim.get_state(), pyro.util.get_rng_state())
    saved = copy.deepcopy(saved)
    net, _, guide, optim, svi = _hidden_problem()
    guide(x, y)
    start = net[0].bias.detach().clone()
    pyro.clear_param_store()
    pyro.get_param_store().set_state(saved[0])
    optim.set_state(saved[1])
    pyro.util.set_rng_state(saved[2])
    assert torch.equal(net[0].bias.detach(), start)  # the store's value arrives at the next run
    for _ in range(3):
        svi.step(x, y)
    store = pyro.get_param_store()
    assert store["net.0.bias"] is net[0].bias
    assert torch.equal(net.state_dict()["0.bias"], reference)
    assert (reference - start).abs().max() > 1e-2  # a restore the net would have missed


def test_a_store_of_another_shape_is_refused_naming_the_parameter():
    bnn = _hidden_problem()[1]
    pyro.get_param_store()["net.0.bias"] = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"holds 'net\.0\.bias' of shape \(5,\).*\(8,\)"):
        bnn(torch.randn(2, 4, dtype=torch.float64))


def test_a_non_contiguous_hidden_parameter_keeps_one_store_tensor_and_its_optimizer():
    # Pyro's store keeps value.contiguous(): for a transposed (or channels-last) Parameter that
    # is a copy, never the Parameter; each run replaced it, and Adam restarted every step (one
    # more torch optimizer per step). Now the copy stays, and its value is copied into the net
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    dtype = torch.float64
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    net[0].weight = nn.Parameter(torch.randn(4, 3, dtype=dtype).t())  # (3, 4), not contiguous
    assert not net[0].weight.is_contiguous()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(16, 0.1), hide=["0.weight"])
    guide = AutoMeanFieldNormal(bnn)
    optim = pyro.optim.Adam({"lr": 0.01})
    svi = SVI(bnn, guide, optim, Trace_ELBO())
    x, y = torch.randn(16, 4, dtype=dtype), torch.randn(16, dtype=dtype)
    svi.step(x, y)
    trained = pyro.get_param_store()["net.0.weight"]
    count = len(optim.optim_objs)
    for _ in range(4):
        svi.step(x, y)
    assert pyro.get_param_store()["net.0.weight"] is trained
    assert len(optim.optim_objs) == count
    bnn(x, y)  # the net follows at the model's next run
    assert torch.equal(net[0].weight.detach(), trained.detach())


# -- 9. Predictive on more rows than dataset_size -----------------------------------------------


def test_predictive_samples_a_test_set_larger_than_the_training_set():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    dtype = torch.float64
    bnn = BayesianModule(
        nn.Linear(2, 1).double(), priors.Normal(1.0), likelihoods.Gaussian(50, scale=0.1)
    )
    guide = AutoMeanFieldNormal(bnn, init_scale=0.2)
    guide(torch.randn(50, 2, dtype=dtype), torch.randn(50, dtype=dtype))
    x = torch.randn(51, 2, dtype=dtype)
    # unobserved: a plate of the 51 rows, unscaled
    trace = poutine.trace(poutine.condition(bnn, data=bnn.latent_parameters())).get_trace(x)
    assert trace.nodes["obs"]["scale"] == 1.0
    assert trace.nodes["obs"]["cond_indep_stack"][0].size == 51
    with pytest.raises(ValueError, match=r"51 rows is larger than dataset_size=50: pass the"):
        bnn(x, torch.zeros(51, dtype=dtype))  # observed: still a minibatch of the 50 rows

    num = 4000
    out = Predictive(
        bnn, guide=guide, num_samples=num, parallel=True, return_sites=["weight", "bias", "obs"]
    )(x)
    assert out["obs"].shape == (num, 51)
    # each draw's obs is Normal(x.w + b, 0.1): standardized residuals ~ N(0, 1)
    mean = (x @ out["weight"].reshape(num, 2).T).T + out["bias"].reshape(num, 1)
    residual = (out["obs"] - mean) / 0.1
    assert residual.mean().abs() < 5 / (num * 51) ** 0.5
    assert (residual.var() - 1).abs() < 5 * (2 / (num * 51)) ** 0.5
    # against predict: the same predictive mean and variance, to Monte Carlo error
    pred = bnn.predict(guide, x, num_samples=num)
    sd = pred.variance[:, 0].sqrt()
    difference = out["obs"].mean(0) - pred.mean[:, 0]
    assert (difference.abs() < 5 * sd * (2 / num) ** 0.5).all()
    ratio = out["obs"].var(0) / pred.variance[:, 0]
    assert ((ratio - 1).abs() < 5 * (4 / num) ** 0.5).all()


# -- 10. the fans of a transposed convolution ----------------------------------------------------


def test_a_transposed_convolution_takes_torchs_fans():
    # ConvTranspose2d(3, 8, 5, groups=1)'s weight is (in, out / groups, k, k) = (3, 8, 5, 5):
    # torch's fan_in = 8 * 25 = 200, fan_out = 3 * 25 = 75
    net = nn.Sequential(nn.ConvTranspose2d(3, 8, 5), nn.Flatten())
    assert priors.fan_in_and_fan_out(net[0].weight.shape) == (200, 75)
    bnn = BayesianModule(net, priors.LayerwiseNormal("radford"), likelihoods.Gaussian(4))
    for name in ("0.weight", "0.bias"):
        param = dict(net.named_parameters())[name]
        scale = bnn.prior_of(name, param).base_dist.stddev
        torch.testing.assert_close(scale, torch.full_like(param, 200**-0.5))
    grouped = nn.ConvTranspose2d(4, 6, 3, groups=2)  # weight (4, 3, 3, 3): fan_in = 3 * 9
    assert priors.fan_in_and_fan_out(grouped.weight.shape) == (27, 36)
