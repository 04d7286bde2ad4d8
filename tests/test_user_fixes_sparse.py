"""Fixes of user-found bugs in the spike-and-slab, sparsifying QNVB and WHVI features."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoMultivariateNormal, AutoNormal
from torch import nn

from pyro_quadvi import AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO, SparseQNVB
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.infer import GumbelSpikeSlabELBO
from pyro_quadvi.linalg import fwht
from pyro_quadvi.nn import BayesianModule, WHVILinear, likelihoods, priors, whvi
from pyro_quadvi.optim import SparseQNVBOptimizer
from pyro_quadvi.optim.sparse_functional import (
    SparseQNVBHyperparameters,
    init_sparse_block,
    init_sparse_counters,
    result_messages,
    sieve_map,
    sieve_pieces,
    sparse_qnvb_update,
)

# ------------------------------------------------------------- 1. at least one weight nonzero


def test_the_sieve_holds_one_coordinate_nonzero_when_round_s0_d_is_d():
    """5 coordinates at the default s0 = 0.97: round(4.85) = 5 would hold all near zero; the
    sieve holds the smallest logit at exactly zeta_hat^(1) (p_nonzero = p_high) and the 4 others
    at zeta - zeta^(0) + zeta_hat^(0), zeta^(0) = 2 the second smallest."""
    hp = SparseQNVBHyperparameters()
    zeta = torch.tensor([3.0, 1.0, 5.0, 2.0, 4.0], dtype=torch.float64)
    pieces = sieve_pieces(zeta, 0.97, 0.01)
    assert (pieces.upper.item(), pieces.lower.item()) == (2.0, 1.0)
    zeta_hat0, zeta_hat1 = hp.sieve_logits
    mapped = sieve_map(zeta, pieces, hp)
    expected = torch.tensor(
        [1.0 + zeta_hat0, zeta_hat1, 3.0 + zeta_hat0, zeta_hat0, 2.0 + zeta_hat0]
    )
    torch.testing.assert_close(mapped, expected.double())
    torch.testing.assert_close(torch.sigmoid(-mapped[1]), torch.tensor(0.999, dtype=torch.float64))


def test_tied_logits_are_assigned_to_the_pieces_by_rank():
    """21 equal logits at s0 = 0.7, s1 = 0.3: round(6.3) = 6 held nonzero (the 6 first indices,
    ties broken by index), round(14.7) = 15 held near zero, none in the middle. The old test
    ``zeta >= zeta^(0)`` first held all 21 near zero."""
    hp = SparseQNVBHyperparameters(target_sparsity=0.7, target_free=0.1)
    zeta_hat0, zeta_hat1 = hp.sieve_logits
    zeta = torch.full((21,), -1.0e3, dtype=torch.float64)
    mapped = sieve_map(zeta, sieve_pieces(zeta, 0.7, 0.3), hp)
    expected = torch.tensor([zeta_hat1] * 6 + [zeta_hat0] * 15, dtype=torch.float64)
    torch.testing.assert_close(mapped, expected)


def test_ties_at_both_boundaries_put_the_middle_at_the_midpoint():
    """Logits [0, 1, 1, 1, 1, 1, 1, 2] at s0 = 0.25, s1 = 0.25 (2 and 2 of 8): zeta^(1) =
    zeta^(0) = 1, so the pieces by rank are indices {0, 1} and {6, 7}; the middle {2..5} ties
    both boundaries and sits at (zeta_hat^(0) + zeta_hat^(1)) / 2 = 0 (p_nonzero = 1/2); the
    outer pieces are shifted as the map says: 0 - 1 + zeta_hat^(1), 1 - 1 + zeta_hat^(0)..."""
    hp = SparseQNVBHyperparameters()
    zeta_hat0, zeta_hat1 = hp.sieve_logits
    zeta = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    pieces = sieve_pieces(zeta, 0.25, 0.25)
    assert (pieces.upper.item(), pieces.lower.item()) == (1.0, 1.0)
    assert pieces.held_nonzero.nonzero().flatten().tolist() == [0, 1]
    assert pieces.held_zero.nonzero().flatten().tolist() == [6, 7]
    mapped = sieve_map(zeta, pieces, hp)
    expected = [zeta_hat1, zeta_hat1 - 1, 0.0, 0.0, 0.0, 0.0, zeta_hat0 + 1, zeta_hat0]
    torch.testing.assert_close(mapped, torch.tensor(expected, dtype=torch.float64))


def test_logits_at_the_clamp_are_counted_and_named_once():
    """float32, epoch 2 of 4: a mean of 1e12 with curvature 1e4 gives h nu^2 = 1e28, beyond the
    clamp sqrt(finfo(float32).max) = 1.84e19 of the zero logits: that coordinate is counted and
    the message names the divergence."""
    hp = SparseQNVBHyperparameters(num_epochs=4, target_sparsity=0.5, target_free=0.25)
    block = init_sparse_block(torch.tensor([1e12, 0.5, 0.5, -0.5]), hp)
    counters = init_sparse_counters(hp, 2)._replace(step=2, n0=1.0)
    g, h = torch.zeros(4), torch.full((4,), 1e4)
    result = sparse_qnvb_update((block,), counters, [g], [h], hp, 2)
    assert int(result.num_clamped) == 1
    big = torch.tensor(torch.finfo(torch.float32).max ** 0.5)  # rounded to float32
    assert result.zero_logits[0][0] == -big
    warned: set[str] = set()
    (message,) = result_messages(result, warned)
    assert "zero logits of 1 coordinates reached the clamp" in message
    assert "Gaussian means have diverged" in message
    assert result_messages(result, warned) == []


def _linear_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=generator)
    y = 2.0 * x[:, :1] + 0.1 * torch.randn(16, 1, generator=generator)
    return x, y


def _five_weight_net():
    """``nn.Linear(4, 1)`` (seeded) and its SparseQNVBOptimizer over 16 cases, 2 steps an epoch."""
    torch.manual_seed(1)
    net = nn.Linear(4, 1)
    optimizer = SparseQNVBOptimizer(
        net.parameters(),
        num_cases=16,
        steps_per_epoch=2,
        num_epochs=3,
        generator=torch.Generator().manual_seed(0),
    )
    return net, optimizer


def test_a_five_weight_net_keeps_its_one_weight_plain_torch():
    """``nn.Linear(4, 1)`` at the default target_sparsity: the realized pattern keeps one weight
    (the one of the input y depends on), not none (the loss went from 0.395 to 2.82)."""
    x, y = _linear_data()
    net, optimizer = _five_weight_net()

    def closure():
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(8):
        loss = optimizer.step(closure)
    patterns = [optimizer.state[p]["pattern"] for p in net.parameters()]
    assert torch.equal(patterns[0], torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(patterns[1], torch.tensor([0.0]))
    assert optimizer.sparsity() == 0.8
    assert net.weight[0, 0].item() == pytest.approx(2.0, abs=0.7)
    assert float(loss) < 1.0  # all zeros: the mean of y^2, about 4


def _five_weight_model(x, y):
    w = pyro.sample("w", SpikeSlab(0.5, 1.0).expand([4]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x @ w, 0.1), obs=y)


def test_a_five_weight_model_keeps_its_one_weight_pyro(fresh_param_store):
    x, y = _linear_data()
    y = y[:, 0]
    guide = AutoSpikeSlab(_five_weight_model, init_scale=1e-5**0.5, init_inclusion=1 - 1e-9)
    optim = SparseQNVB(num_epochs=3, steps_per_epoch=2, num_cases=16)
    svi = SVI(
        _five_weight_model,
        guide,
        optim,
        QuadratureELBO(rule="hadamard", num_points=4, vectorize=False),
    )
    for _ in range(6):
        svi.step(x, y)
    pattern = optim.pattern()["AutoSpikeSlab.locs.w"]
    assert torch.equal(pattern, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    median = guide.median()["w"]
    assert torch.equal(median[1:], torch.zeros(3))
    assert median[0].item() == pytest.approx(2.0, abs=0.5)


# --------------------------------------- 2. no silent fallback for a guide it cannot sparsify


@pytest.mark.parametrize(
    "guide_class, elbo, found",
    [
        (AutoMeanFieldNormal, QuadratureELBO(vectorize=False), r"blocks are \['gaussian'\]"),
        (AutoNormal, Trace_ELBO(), "no block came with the moments"),
        (AutoDelta, Trace_ELBO(), "no block came with the moments"),
        (AutoMultivariateNormal, QuadratureELBO(vectorize=False), "no block came with the moments"),
        (AutoSpikeSlab, Trace_ELBO(), "no block came with the moments"),
        (AutoSpikeSlab, GumbelSpikeSlabELBO(vectorize=False), "no block came with the moments"),
    ],
)
def test_sparse_qnvb_refuses_a_step_with_nothing_to_sparsify(
    fresh_param_store, guide_class, elbo, found
):
    x, y = _linear_data()
    y = y[:, 0]
    guide = guide_class(_five_weight_model)
    guide(x, y)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    svi = SVI(_five_weight_model, guide, SparseQNVB(steps_per_epoch=1, num_cases=16), elbo)
    with pytest.raises(TypeError, match=found + r".*AutoSpikeSlab\(model\).*QuadratureELBO"):
        svi.step(x, y)
    for name, value in before.items():  # nothing was trained
        assert torch.equal(pyro.param(name).detach(), value)


def _model_with_a_param(x, y):
    shift = pyro.param("shift", torch.tensor(0.5))
    w = pyro.sample("w", SpikeSlab(0.5, 1.0).expand([4]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x @ w + shift, 0.1), obs=y)


def test_sparse_qnvb_keeps_the_fallback_beside_a_sparsified_block(fresh_param_store):
    """A model's ``pyro.param`` beside the spike-and-slab site goes to Adam(lr=0.01), whose first
    step moves it by 0.01 against its gradient's sign (y has mean about 0, the shift 0.5)."""
    x, y = _linear_data()
    guide = AutoSpikeSlab(_model_with_a_param)
    optim = SparseQNVB(num_epochs=3, steps_per_epoch=2, num_cases=16)
    elbo = QuadratureELBO(rule="hadamard", num_points=4, vectorize=False)
    svi = SVI(_model_with_a_param, guide, optim, elbo)
    svi.step(x, y[:, 0] - y[:, 0].mean())
    assert pyro.param("shift").item() == pytest.approx(0.49, abs=1e-6)
    assert list(optim.blocks) == ["AutoSpikeSlab.locs.w"]


# ------------------------------------------------------------------------ 6. minor input checks


def test_infinite_or_boolean_scales_are_refused_by_name():
    with pytest.raises(ValueError, match=r"slab_scale must be finite and > 0, got inf"):
        priors.SpikeSlab(0.5, slab_scale=math.inf)
    for bad in (math.inf, True):
        with pytest.raises(
            ValueError, match=r"prior_scale must be > 0 and finite \(a number, not a bool\)"
        ):
            WHVILinear(4, 4, prior_scale=bad)
    assert WHVILinear(4, 4, prior_scale=2).prior_scale == 2.0


def test_init_inclusion_takes_a_0d_tensor(fresh_param_store):
    x, y = _linear_data()
    guide = AutoSpikeSlab(_five_weight_model, init_inclusion=torch.tensor(0.25))
    guide(x, y[:, 0])
    torch.testing.assert_close(guide.inclusion_probs()["w"], torch.full((4,), 0.25))
    with pytest.raises(ValueError, match=r"init_inclusion must be a float in \(0, 1\).*got 1.5"):
        AutoSpikeSlab(_five_weight_model, init_inclusion=torch.tensor(1.5))


def test_fwht_of_an_empty_last_dim_says_it_is_empty():
    with pytest.raises(ValueError, match=r"the last dim of x is empty \(shape \(3, 0\)\)"):
        fwht(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="power of two, got 3; pad it with zeros to 4"):
        fwht(torch.zeros(3))


# ----------------------------------------- 4. a learned noise scale beside spike-and-slab weights


def _bnn(net, likelihood_scale=0.1, **kwargs):
    likelihood = likelihoods.Gaussian(dataset_size=16, scale=likelihood_scale)
    return BayesianModule(net, priors.SpikeSlab(0.5), likelihood, qnvb_settings={}, **kwargs)


def test_a_learned_noise_scale_gets_a_gaussian_factor(fresh_param_store):
    """The positive ``noise_scale`` cannot carry a SpikeSlab prior (its support is the real
    line): AutoSpikeSlab fits it with AutoNormal's Gaussian, whose exact median and 84% quantile
    are ``exp(loc)`` and ``exp(loc + scale)``; SparseQNVB sparsifies the weights beside it."""
    x, y = _linear_data()
    bnn = _bnn(nn.Linear(4, 1), likelihood_scale=None)
    guide = AutoSpikeSlab(bnn)
    optim = SparseQNVB(num_epochs=3, steps_per_epoch=2, num_cases=16)
    elbo = QuadratureELBO(rule="hadamard", num_points=4, vectorize=False)
    svi = SVI(bnn, guide, optim, elbo)
    for _ in range(2):
        assert math.isfinite(svi.step(x, y[:, 0]))
    loc = pyro.param("AutoSpikeSlab.locs.noise_scale").detach()
    scale = pyro.param("AutoSpikeSlab.scales.noise_scale").detach()
    quantiles = guide.quantiles([0.5, 0.8413447460685429])["noise_scale"]
    torch.testing.assert_close(quantiles, torch.stack([loc.exp(), (loc + scale).exp()]))
    assert set(guide.inclusion_probs()) == {"weight", "bias"}
    families = {s.name: s.family for s in guide.quadrature_description().sites}
    assert families == {"weight": "dirac_gauss", "bias": "dirac_gauss", "noise_scale": "gaussian"}
    assert sorted(optim.blocks) == ["AutoSpikeSlab.locs.bias", "AutoSpikeSlab.locs.weight"]


# ------------------------------------------ 5. a WHVI layer's declared prior under AutoSpikeSlab


def test_a_declared_gaussian_prior_names_its_layer_and_the_way_out(fresh_param_store):
    x, y = _linear_data()
    net = whvi(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), skip_last=True)
    with pytest.raises(
        ValueError,
        match=r"site '0.g'.*prior Normal has none.*the WHVILinear at '0', declares in "
        r"bayesian_parameters\(\).*declarations=False and hide=\('0.s1', '0.s2'\)",
    ):
        AutoSpikeSlab(_bnn(net))(x, y[:, 0])
    # the way out: every latent weight under the network's spike-and-slab prior
    guide = AutoSpikeSlab(_bnn(net, declarations=False, hide=("0.s1", "0.s2")))
    guide(x, y[:, 0])
    assert set(guide.inclusion_probs()) == {"0.g", "0.bias", "2.weight", "2.bias"}


def test_a_loss_that_is_not_finite_is_refused_by_the_sparse_optimizer():
    """A NaN in the batch made every node's loss NaN; the sieve still moved the weights, with
    one warning. Now the step is refused and the parameters are back at their means."""
    x, y = _linear_data()
    net, optimizer = _five_weight_net()

    def closure(xs=x):
        loss = ((net(xs) - y) ** 2).mean()
        loss.backward()
        return loss

    optimizer.step(closure)
    means = [optimizer.state[p]["mu"].clone() for p in net.parameters()]
    bad = x.clone()
    bad[5, 2] = float("nan")
    with pytest.raises(ValueError, match=r"SparseQNVBOptimizer: the loss averaged .* is nan"):
        optimizer.step(lambda: closure(bad))
    for p, mu in zip(net.parameters(), means):
        assert torch.equal(p.detach(), mu) and torch.equal(optimizer.state[p]["mu"], mu)


# ------------------------------------------- a loop shorter than the declared steps_per_epoch


def test_finished_says_whether_the_pattern_was_realized_and_sampled_params_warns_before():
    """Declared S = 2 over n_e = 3 epochs: the pattern is realized at step (3 - 1) 2 + 1 = 5. A
    loop of 1 step per epoch ends after 3 steps, unfinished (the pattern all ones, no exact
    zero): ``finished`` says so and sampled_params warns once; after step 5 neither."""
    x, y = _linear_data()
    net, optimizer = _five_weight_net()

    def closure():
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    assert not optimizer.finished
    assert all(bool((optimizer.state[p]["pattern"] == 1).all()) for p in net.parameters())
    with pytest.warns(UserWarning, match=r"step 3; the pattern is realized at step 5 ="):
        with optimizer.sampled_params(generator=torch.Generator().manual_seed(0)):
            pass
    optimizer.step(closure)
    assert not optimizer.finished
    optimizer.step(closure)
    assert optimizer.finished
    assert optimizer.sparsity() == 0.8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with optimizer.sampled_params(generator=torch.Generator().manual_seed(0)):
            pass


def test_pyro_sparse_qnvb_finished_after_the_first_step_of_the_final_epoch(fresh_param_store):
    x, y = _linear_data()
    guide = AutoSpikeSlab(_five_weight_model, init_scale=1e-5**0.5, init_inclusion=1 - 1e-9)
    optim = SparseQNVB(num_epochs=3, steps_per_epoch=2, num_cases=16)
    elbo = QuadratureELBO(rule="hadamard", num_points=4, vectorize=False)
    svi = SVI(_five_weight_model, guide, optim, elbo)
    finished = []
    for _ in range(6):
        svi.step(x, y[:, 0])
        finished.append(optim.finished)
    assert finished == [False, False, False, False, True, True]


# ----------------------------------------------------------- the weight of a short last batch


@pytest.mark.parametrize("nominal", [None, 4])
def test_a_short_batch_term_counts_num_cases_over_steps_per_epoch(nominal):
    """n_c = 15 cases in S = 4 steps (batches of 4, 4, 4, 3), a loss linear in w: the term of
    the short batch of 3 is (n_c / S) mean(a) + (h_p / S) mu0 = 3.75 mean(a) + ..., each case
    counted 1.25 times; the documented remedy, a closure returning sum(a) w / B with the nominal
    B = 4, makes it 3.75 sum(a) / 4 (n_c = S B = 16 would count each case once). The term is
    read back from the state: with n_e = 3, n_tgt = S / 4 = 1, so after the first step
    g0 = term + h0 (mu1 - mu0) and h0 = max(h_term, 1 / tau_max^2)."""
    net = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        net.weight.fill_(0.3)
    optimizer = SparseQNVBOptimizer(net.parameters(), num_cases=15, steps_per_epoch=4, num_epochs=3)
    a = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)

    def closure():
        per_case = a * net.weight[0, 0]
        loss = per_case.mean() if nominal is None else per_case.sum() / nominal
        loss.backward()
        return loss

    mu0 = net.weight.detach().clone()
    optimizer.step(closure)
    state = optimizer.state[net.weight]
    h_p = 0.3**-2
    assert state["h0"].item() == pytest.approx(h_p)  # h_term = h_p / 4, floored at 1 / 0.3^2
    term = state["g0"] - state["h0"] * (state["mu"] - mu0)
    batch = a.mean() if nominal is None else a.sum() / nominal
    expected = 15 / 4 * batch + h_p / 4 * mu0
    torch.testing.assert_close(term, expected, rtol=1e-12, atol=1e-12)


# -------------------------------------------------------------- a loss that grows a thousandfold


def _growing_run(factors, optimizer=None, net=None):
    """Steps of ``factor * (1 + 1e-3 w^2)`` on ``nn.Linear(1, 1)``: the loss is about ``factor``
    at every node; returns the optimizer, the net and the warnings raised."""
    if optimizer is None:
        torch.manual_seed(0)
        net = nn.Linear(1, 1, bias=False)
        optimizer = SparseQNVBOptimizer(net.parameters(), num_cases=8, steps_per_epoch=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for factor in factors:

            def closure(factor=factor):
                loss = factor * (1 + 1e-3 * (net.weight**2).sum())
                loss.backward()
                return loss

            optimizer.step(closure)
    return optimizer, net, [w for w in caught if "diverging" in str(w.message)]


def test_a_thousandfold_loss_growth_warns_once_and_survives_a_state_dict():
    """The rule: warn where loss - first > 1000 |first|. 1 -> 500 -> 900 stays below; 2000
    crosses it (once: 5000 after it adds nothing). A state_dict keeps the first loss, so a
    restored optimizer warns at 2000 too (it would take 2000 as its first loss otherwise)."""
    optimizer, net, caught = _growing_run([1.0, 500.0, 900.0])
    assert caught == []
    assert optimizer.first_loss == pytest.approx(1.0, rel=1e-3)
    saved = optimizer.state_dict()
    _, _, caught = _growing_run([2000.0, 5000.0], optimizer, net)
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert "is 2e+03 at step 4, more than 1000 times the first step's 1 above it" in str(
        caught[0].message
    )
    assert caught[0].filename == __file__  # points at the caller's line
    restored = SparseQNVBOptimizer(net.parameters(), num_cases=8, steps_per_epoch=4)
    restored.load_state_dict(saved)
    assert restored.first_loss == optimizer.first_loss
    _, _, caught = _growing_run([2000.0], restored, net)
    assert len(caught) == 1
