"""Sparsifying QNVB (sequence paper, Sections 4.3 and 5): the pure update and the torch optimizer,
each piece against a hand computation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pyro_quadvi.optim import SparseQNVB, SparseQNVBHyperparameters, SparseQNVBOptimizer
from pyro_quadvi.optim.sparse_functional import (
    SievePieces,
    hybrid_coefficients,
    hybrid_sum,
    init_sparse_block,
    init_sparse_counters,
    mixture_moments,
    result_messages,
    sieve_fractions,
    sieve_map,
    sieve_pieces,
    sparse_qnvb_update,
    zero_logits,
)

DTYPE = torch.float64


# --- eq. 5.1 (corrected) ------------------------------------------------------------------------


@pytest.mark.parametrize("n0", range(1, 9))
@pytest.mark.parametrize("n1", range(1, 13))
def test_hybrid_coefficients_preserve_mean_and_variance(n0, n1):
    """E[a_hat] = (c0 n0 + c1 n1) alpha and Var[a_hat] = (c0^2 n0 + c1^2 n1) v: both must be
    max(n0, n1) times those of one term. (The printed eq. 5.1 multiplies a_0 twice, see
    design/qnvb-update-rule.md; the code implements the corrected form.)"""
    c0, c1 = hybrid_coefficients(n0, n1)
    assert c0 * n0 + c1 * n1 == pytest.approx(max(n0, n1), rel=1e-14)
    assert c0**2 * n0 + c1**2 * n1 == pytest.approx(max(n0, n1), rel=1e-14)


@pytest.mark.parametrize(("n0", "n1"), [(6, 2), (3, 5)])
def test_hybrid_sum_of_random_sums(n0, n1):
    """Sums of i.i.d. N(0.7, 2) terms: the hybrid sum has mean 0.7 m and variance 2 m,
    m = max(n0, n1), within four standard errors over 200,000 replicates."""
    generator = torch.Generator().manual_seed(0)
    reps, mean, var = 200_000, 0.7, 2.0
    x = mean + math.sqrt(var) * torch.randn(reps, n0 + n1, generator=generator, dtype=DTYPE)
    a_hat = hybrid_sum(x[:, :n0].sum(1), x[:, n0:].sum(1), n0, n1)
    m = max(n0, n1)
    assert abs(a_hat.mean().item() - mean * m) < 4 * math.sqrt(var * m / reps)
    # the sample variance of a Gaussian has standard error var * sqrt(2 / (reps - 1))
    assert abs(a_hat.var().item() - var * m) < 4 * var * m * math.sqrt(2 / reps)


@pytest.mark.parametrize(
    ("n0", "n1", "named"),
    [
        (math.nan, 2.0, "n0 is nan"),  # max(0, nan) = 0: was (0.0, 1.0), silently
        (3.0, math.nan, "n1 is nan"),
        (math.inf, 2.0, "n0 is inf"),  # (inf - 2) / inf = nan: was (0.0, 1.0)
        (3.0, math.inf, "n1 is inf"),
        (-1.0, 2.0, "n0 is -1.0"),
        (3.0, -2.0, "n1 is -2.0"),
    ],
)
def test_hybrid_sums_refuse_a_count_that_is_not_finite_and_nonnegative(n0, n1, named):
    with pytest.raises(ValueError, match=f"finite counts >= 0 .*: {named} "):
        hybrid_coefficients(n0, n1)
    with pytest.raises(ValueError, match=f": {named} "):
        hybrid_sum(torch.ones(2), torch.ones(2), n0, n1)


# --- the sieve ----------------------------------------------------------------------------------


def test_sieve_schedule_matches_the_formula():
    hp = SparseQNVBHyperparameters()  # n_e = 10, s_tgt = (0.97, 0.01)
    for t in (0.0, 0.5, 1.0):
        assert sieve_fractions(t, hp) == (0.0, 0.98)
    s0, s1 = sieve_fractions(2.0, hp)
    assert s0 == pytest.approx(0.5 / (1 - 1 / 256) * 0.97, rel=1e-15)
    assert s1 == pytest.approx(0.98 - s0, rel=1e-15)
    s0, _ = sieve_fractions(4.5, hp)
    assert s0 == pytest.approx((1 - 2**-3.5) / (1 - 2**-8) * 0.97, rel=1e-15)
    for t in (9.0, 9.5, 10.0):  # the target is reached at t = n_e - 1 and held
        assert sieve_fractions(t, hp)[0] == pytest.approx(0.97, rel=1e-15)
        assert sieve_fractions(t, hp)[1] == pytest.approx(0.01, abs=1e-15)


def _by_value(zeta, upper, lower):
    """The pieces of arbitrary points ``zeta`` by value, to probe the map as a function."""
    return SievePieces(upper, lower, zeta >= upper, zeta <= lower)


def test_sieve_map_continuous_monotone_and_on_target():
    hp = SparseQNVBHyperparameters()
    zeta_hat0, zeta_hat1 = hp.sieve_logits
    assert zeta_hat0 == pytest.approx(-math.log(0.001 / 0.999))
    assert zeta_hat1 == pytest.approx(-math.log(0.999 / 0.001))
    zeta = 5 * torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    pieces = sieve_pieces(zeta, 0.3, 0.5)
    upper, lower = pieces.upper, pieces.lower
    ordered = zeta.sort().values
    assert upper == ordered[-300] and lower == ordered[499]
    assert torch.equal(pieces.held_zero, zeta >= upper)  # no ties: rank and value agree
    assert torch.equal(pieces.held_nonzero, zeta <= lower)
    mapped = sieve_map(zeta, pieces, hp)
    assert int((mapped >= zeta_hat0).sum()) == 300  # held near zero: exactly the 300 largest
    assert set((mapped >= zeta_hat0).nonzero().flatten().tolist()) == set(
        zeta.topk(300).indices.tolist()
    )
    assert int((mapped <= zeta_hat1).sum()) == 500  # held nonzero: exactly the 500 smallest
    for point, value in ((upper, zeta_hat0), (lower, zeta_hat1)):
        point = point.reshape(1)
        assert sieve_map(point, _by_value(point, upper, lower), hp).item() == value
    # monotone (strictly) and continuous at both boundaries
    fine = torch.linspace(ordered[0].item() - 1, ordered[-1].item() + 1, 20001, dtype=DTYPE)
    out = sieve_map(fine, _by_value(fine, upper, lower), hp)
    assert bool((out.diff() > 0).all())
    for boundary in (upper, lower):
        eps = 1e-9
        around = torch.stack([boundary - eps, boundary + eps])
        left, right = sieve_map(around, _by_value(around, upper, lower), hp)
        assert abs(right - left) < 1e-6
    # the middle piece is affine between (zeta^(1), zeta_hat^(1)) and (zeta^(0), zeta_hat^(0))
    mid = (0.25 * upper + 0.75 * lower).reshape(1)
    expected = zeta_hat1 + 0.25 * (zeta_hat0 - zeta_hat1)
    assert sieve_map(mid, _by_value(mid, upper, lower), hp).item() == pytest.approx(expected)


def test_sieve_holds_everything_free_while_nothing_is_held_near_zero():
    """s0 = 0 (the first epoch): min over an empty set is +inf, so the middle piece is flat at
    zeta_hat^(1): no coordinate gets a probability of zero above 1 - p_nonzero_high."""
    hp = SparseQNVBHyperparameters()
    zeta = torch.randn(200, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    pieces = sieve_pieces(zeta, 0.0, 0.98)
    assert math.isinf(pieces.upper.item()) and pieces.lower == zeta.sort().values[195]
    assert not bool(pieces.held_zero.any())
    mapped = sieve_map(zeta, pieces, hp)
    assert bool((mapped <= hp.sieve_logits[1] + 1e-12).all())
    assert int((mapped < hp.sieve_logits[1]).sum()) == 195


# --- eq. 4.2 and 4.6 ----------------------------------------------------------------------------


def test_mixture_moments_eq_4_2():
    p = torch.tensor([1.0, 0.0, 0.25], dtype=DTYPE)
    nu = torch.tensor([2.0, 3.0, -4.0], dtype=DTYPE)
    tau = torch.tensor([0.5, 0.5, 2.0], dtype=DTYPE)
    mu, sigma = mixture_moments(p, nu, tau)
    assert mu.tolist() == [2.0, 0.0, -1.0]
    # 0.25 * 0.75 * 16 + 0.25 * 4 = 4
    assert sigma.tolist() == [0.5, 0.0, 2.0]


# --- the update on quadratic losses -------------------------------------------------------------


def _quadratic(d=1000, seed=0):
    """Per term, L(theta) = sum_i a_i (theta_i - b_i)^2 / 2 with a_i in [20, 100]: every
    quadrature integrates it exactly, g = a (mu - b), h = a."""
    generator = torch.Generator().manual_seed(seed)
    a = 20 + 80 * torch.rand(d, generator=generator, dtype=DTYPE)
    b = 0.3 * torch.randn(d, generator=generator, dtype=DTYPE)
    return a, b


def _run(hp, steps_per_epoch, a, b, num_steps):
    blocks = (init_sparse_block(torch.zeros_like(a), hp),)
    counters = init_sparse_counters(hp, steps_per_epoch)
    history = []
    for _ in range(num_steps):
        mu = blocks[0].mu
        result = sparse_qnvb_update(blocks, counters, [a * (mu - b)], [a], hp, steps_per_epoch)
        blocks, counters = result.blocks, result.counters
        history.append(result)
    return history


def test_one_update_by_hand_floors_and_trust_region():
    """n_e = 4, S = 8: n0 = 1, h_min = 1 / (1 * max_lr) = 100 with max_lr = 0.01. After one term
    n1 = 1, so alpha = (0, 1): h_hat = max(h, 1 / tau_max^2) and nu moves by g / max(h_hat, 100)."""
    hp = SparseQNVBHyperparameters(num_epochs=4, max_lr=0.01)
    theta = torch.tensor([1.0, 1.0, 1.0], dtype=DTYPE)
    block = init_sparse_block(theta, hp)
    counters = init_sparse_counters(hp, 8)
    assert counters.n0 == 1.0 and block.h0.tolist() == pytest.approx([1e5] * 3, rel=1e-15)
    g = torch.tensor([2.0, 2.0, 2.0], dtype=DTYPE)
    h = torch.tensor([5.0, 500.0, -3.0], dtype=DTYPE)
    result = sparse_qnvb_update((block,), counters, [g], [h], hp, 8)
    new = result.blocks[0]
    floor = 0.3**-2
    assert new.tau.tolist() == pytest.approx([floor**-0.5, 500**-0.5, floor**-0.5])
    assert new.nu.tolist() == pytest.approx([1 - 2 / 100, 1 - 2 / 500, 1 - 2 / 100])
    assert result.counters == (1, 1.0, 0.0)  # n_tgt = 8 * 2^(1-4) = 1 reached: restarted
    assert new.h0.tolist() == pytest.approx([floor, 500.0, floor])  # moved to the index-0 sums
    assert new.h1.tolist() == [0.0, 0.0, 0.0]
    # the sums were carried to the new expansion point before the restart: g1 + h1 (mu' - mu)
    delta = new.mu - block.mu
    assert new.g0.tolist() == pytest.approx((g + new.h0 * delta).tolist())


@pytest.mark.parametrize("late_epoch, floor", [(1, 0.6**-2), (2, 0.3**-2)])
def test_late_tau_max_lowers_the_step_floor_not_the_slab(late_epoch, floor):
    """The extension: from ``late_epoch`` on, h1 is floored at 1 / late_tau_max^2 = 2.78 (tau_max
    0.3, late_tau_max 0.6), so nu moves by g / max(h, 2.78) (the trust region 1 / max_lr = 0.1
    does not bind); the slab's precision stays max(h_hat, 1 / 0.3^2), so tau <= 0.3, and the zero
    logits are eq. 4.6 at that precision. Before late_epoch (the first update is in epoch 1) the
    paper's floor 1 / 0.3^2 = 11.1 holds."""
    hp = SparseQNVBHyperparameters(
        num_epochs=4, max_lr=10.0, late_tau_max=0.6, late_epoch=late_epoch
    )
    assert hp.curvature_floor(1) == pytest.approx(floor)
    assert hp.curvature_floor(2) == pytest.approx(0.6**-2)
    theta = torch.tensor([1.0, 1.0, 1.0], dtype=DTYPE)
    block, counters = init_sparse_block(theta, hp), init_sparse_counters(hp, 8)
    g = torch.tensor([2.0, 2.0, 2.0], dtype=DTYPE)
    h = torch.tensor([1.0, 500.0, -3.0], dtype=DTYPE)
    result = sparse_qnvb_update((block,), counters, [g], [h], hp, 8)
    new = result.blocks[0]
    step_h = torch.tensor([floor, 500.0, floor], dtype=DTYPE)
    torch.testing.assert_close(new.nu, theta - g / step_h, rtol=1e-14, atol=0)
    slab_h = step_h.clamp(min=0.3**-2)
    torch.testing.assert_close(new.tau, slab_h.rsqrt(), rtol=1e-14, atol=0)
    torch.testing.assert_close(
        result.zero_logits[0], zero_logits(slab_h, new.nu, 0.3), rtol=1e-14, atol=0
    )
    torch.testing.assert_close(new.h0, step_h, rtol=1e-14, atol=0)  # the sums keep the floor


def test_late_tau_max_off_is_the_paper_rule():
    """``late_tau_max=None`` (the default) gives the same update bit for bit as before, whatever
    ``late_epoch`` says."""
    a, b = _quadratic()
    paper = _run(SparseQNVBHyperparameters(num_epochs=4), 8, a, b, 19)[-1]
    other = _run(SparseQNVBHyperparameters(num_epochs=4, late_epoch=1), 8, a, b, 19)[-1]
    for x, y in zip(paper.blocks[0], other.blocks[0]):
        assert torch.equal(x, y)


def test_quadratic_lands_on_newton_point_with_eq_4_6_logits():
    """n_e = 4, S = 8: n_tgt = 1, 2, 4, 8 per epoch. Update 19 (epoch 3, its third term) has
    n0 = 2, n1 = 3: h_hat = 3 a, so tau = (3a)^(-1/2), nu = b (the Newton point of the hybrid
    quadratic, whose sums all stem from the same quadratic), and the zero logits are eq. 4.6:
    (log(3 a tau_max^2) - 3 a b^2) / 2; the probabilities are the sieve's map of them."""
    hp = SparseQNVBHyperparameters(num_epochs=4)
    a, b = _quadratic()
    history = _run(hp, 8, a, b, 19)
    result = history[-1]
    block = result.blocks[0]
    assert result.counters == (19, 2.0, 3.0)
    torch.testing.assert_close(block.nu, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(block.tau, (3 * a).rsqrt(), rtol=1e-14, atol=0)
    expected = 0.5 * (torch.log(3 * a * 0.09) - 3 * a * b**2)
    torch.testing.assert_close(result.zero_logits[0], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(zero_logits(3 * a, b, 0.3), expected, rtol=1e-14, atol=0)
    s0, s1 = sieve_fractions(2 + 3 / 8, hp)
    p = torch.sigmoid(-sieve_map(expected, sieve_pieces(expected, s0, s1), hp))
    torch.testing.assert_close(block.p_nonzero, p, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.mu, p * b, rtol=1e-12, atol=1e-12)


def _epoch_two_move(cases_per_step, steps_per_epoch, g_case):
    """How far ``nu`` moves during epoch 2 of a loss with the constant gradient ``g_case`` per case
    and no curvature (terms of ``cases_per_step`` cases), where only the trust region limits it
    (the curvature floor 1e-6 and the sums carried with it change the move by about 1e-5)."""
    hp = SparseQNVBHyperparameters(num_epochs=4, tau_max=1e3)  # curvature floor 1e-6
    blocks = (init_sparse_block(torch.zeros_like(g_case), hp),)
    counters = init_sparse_counters(hp, steps_per_epoch)
    term, zero = cases_per_step * g_case, torch.zeros_like(g_case)
    start = None
    for step in range(2 * steps_per_epoch):
        if step == steps_per_epoch:
            start = blocks[0].nu
        result = sparse_qnvb_update(
            blocks, counters, [term], [zero], hp, steps_per_epoch, cases_per_step
        )
        blocks, counters = result.blocks, result.counters
    return blocks[0].nu - start


def test_trust_region_moves_a_minibatch_as_far_as_its_cases():
    """Section 5.1.3: where the trust region binds, each update moves nu by its term's gradient
    over h_min = 1 / (n_c 2^(1 - n_e) alpha_max) = 1.25 (n_c = 64, n_e = 4, alpha_max = 0.1): 64
    per-case updates move nu by 64 g / 1.25 = 51.2 g in an epoch, and so must 8 minibatches of 8
    cases. With h_min counted in steps (1 / (S 2^(1 - n_e) alpha_max)) they moved 8 times less."""
    g_case = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=DTYPE)
    expected = -51.2 * g_case
    per_case = _epoch_two_move(1.0, 64, g_case)
    minibatch = _epoch_two_move(8.0, 8, g_case)
    torch.testing.assert_close(per_case, expected, rtol=1e-4, atol=0)
    torch.testing.assert_close(minibatch, expected, rtol=1e-4, atol=0)


def test_optimizer_trust_region_counts_cases():
    """The same through ``SparseQNVBOptimizer``: the mean loss per case ``w . c`` of a linear model
    has the gradient ``c`` per case and, integrated by the antithetic nodes, no curvature; with 64
    cases in 8 steps of 8 and no prior, nu moves by -51.2 c in epoch 2."""
    c = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=DTYPE)
    net = torch.nn.Linear(4, 1, bias=False).to(DTYPE)
    torch.nn.init.zeros_(net.weight)
    optimizer = SparseQNVBOptimizer(
        net.parameters(),
        num_cases=64,
        steps_per_epoch=8,
        num_epochs=4,
        tau_max=1e3,
        prior_precision=0.0,
        generator=torch.Generator().manual_seed(0),
    )

    def closure():
        loss = (net.weight * c).sum()
        loss.backward()
        return loss

    for _ in range(8):
        optimizer.step(closure)
    start = optimizer.state[net.weight]["nu"].clone()
    for _ in range(8):
        optimizer.step(closure)
    moved = optimizer.state[net.weight]["nu"] - start
    torch.testing.assert_close(moved, -51.2 * c, rtol=1e-4, atol=0)


@pytest.mark.parametrize("target_free", [0.1, 0.01])
def test_final_epoch_realizes_and_keeps_the_pattern(target_free):
    """After n_e epochs the weights are exactly zero where the probability of a nonzero was below
    1/2 at the end of epoch n_e - 1: exactly round(0.9 d) zeros when target_free = 1 - 0.9 (no
    middle band), between round(0.9 d) and d - round(0.01 d) otherwise."""
    hp = SparseQNVBHyperparameters(num_epochs=4, target_sparsity=0.9, target_free=target_free)
    a, b = _quadratic()
    history = _run(hp, 8, a, b, 32)
    before = history[23].blocks[0].p_nonzero  # end of epoch 3
    expected_zeros = before < 0.5
    if target_free == 0.1:
        assert int(expected_zeros.sum()) == 900
    else:
        assert 900 <= int(expected_zeros.sum()) <= 990
    for result in history[24:]:
        block = result.blocks[0]
        assert result.zero_logits is None
        assert torch.equal(block.pattern, (~expected_zeros).to(DTYPE))
        assert torch.equal(block.mu == 0, expected_zeros)
        assert torch.equal(block.sigma == 0, expected_zeros)
    # the nonzeros sit at their Newton point b, and the zeros are the smallest |b| sqrt(a) on the
    # whole: eq. 4.6 ranks by h nu^2 - log(h tau^2)
    last = history[-1].blocks[0]
    torch.testing.assert_close(last.mu[~expected_zeros], b[~expected_zeros], rtol=0, atol=1e-12)
    score = a * b**2
    assert score[expected_zeros].max() < score[~expected_zeros].max()


def test_hyperparameters_are_checked_by_name():
    with pytest.raises(ValueError, match="target_sparsity"):
        SparseQNVBHyperparameters(target_sparsity=1.2)
    with pytest.raises(ValueError, match="target_sparsity \\+ target_free"):
        SparseQNVBHyperparameters(target_sparsity=0.97, target_free=0.05)
    with pytest.raises(ValueError, match="p_nonzero_high"):
        SparseQNVBHyperparameters(p_nonzero_high=0.3)
    with pytest.raises(ValueError, match="num_epochs"):
        SparseQNVBHyperparameters(num_epochs=2)
    with pytest.raises(TypeError, match="num_pairs"):
        SparseQNVBHyperparameters(num_pairs=1.5)
    with pytest.raises(TypeError, match="tau_max"):
        SparseQNVBHyperparameters(tau_max="0.3")
    with pytest.raises(ValueError, match="late_tau_max"):
        SparseQNVBHyperparameters(late_tau_max=-0.1)
    with pytest.raises(ValueError, match="late_epoch must be at most num_epochs=10"):
        SparseQNVBHyperparameters(late_tau_max=0.1, late_epoch=11)
    with pytest.raises(ValueError, match="late_epoch"):
        SparseQNVBHyperparameters(late_epoch=0)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        init_sparse_counters(SparseQNVBHyperparameters(), 0)


def test_initial_lr_above_max_lr_is_refused_by_both_optimizers():
    # every step is capped at max_lr: initial_lr=0.5 only started the nodes at sigma = 0.71
    message = r"^initial_lr=0\.5 is above max_lr=0\.1: the learning rate rises from initial_lr"
    with pytest.raises(ValueError, match=message):
        SparseQNVBHyperparameters(initial_lr=0.5, max_lr=0.1)
    weight = torch.nn.Parameter(torch.ones(3, dtype=DTYPE))
    with pytest.raises(ValueError, match=message):
        SparseQNVBOptimizer([weight], num_cases=4, steps_per_epoch=2, initial_lr=0.5)
    assert SparseQNVBHyperparameters(initial_lr=0.1, max_lr=0.1).initial_lr == 0.1
    # SparseQNVB has no initial_lr (the guide's start is it): a max_lr below Table 1's 1e-5
    # is not refused for it, and its repr names no initial_lr
    optimizer = SparseQNVB(3, steps_per_epoch=2, max_lr=1e-6)
    assert repr(optimizer) == "SparseQNVB(num_epochs=3, steps_per_epoch=2, max_lr=1e-06)"


# --- SparseQNVBOptimizer ------------------------------------------------------------------------


def _separable_regression(num_batches=10, d=16, seed=0):
    """Minibatches whose rows are +-e_j, each coordinate twice per batch: every minibatch's
    Hessian is diagonal, so the Hadamard quadrature's g and h are exact. Three true nonzeros."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.zeros(d, dtype=DTYPE)
    w[[2, 7, 11]] = torch.tensor([1.5, -2.0, 0.8], dtype=DTYPE)
    batches = []
    for _ in range(num_batches):
        x = torch.cat([torch.eye(d, dtype=DTYPE), -torch.eye(d, dtype=DTYPE)])
        y = x @ w + 0.1 * torch.randn(2 * d, generator=generator, dtype=DTYPE)
        batches.append((x, y))
    return w, batches


def _train(net, optimizer, batches, steps):
    for step in range(steps):
        x, y = batches[step % len(batches)]

        def closure(x=x, y=y):
            loss = 50.0 * ((net(x).squeeze(-1) - y) ** 2).mean()  # noise sd 0.1, per case
            loss.backward()
            return loss

        optimizer.step(closure)


def _net(d=16, seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Linear(d, 1, bias=False).to(DTYPE)
    torch.nn.init.normal_(net.weight, std=0.1)
    return net


def test_optimizer_finds_the_sparse_support():
    """16 weights, 3 true nonzeros: 12 are sieved near zero and 3 held nonzero by the end of
    epoch 9; the one left in the middle band is rounded at the realization. Exactly the true
    support survives, and the nonzeros approach the posterior mean on it."""
    w, batches = _separable_regression()
    net = _net()
    optimizer = SparseQNVBOptimizer(
        net.parameters(),
        num_cases=32 * len(batches),
        steps_per_epoch=len(batches),
        target_sparsity=12 / 16,
        target_free=3 / 16,
        generator=torch.Generator().manual_seed(0),
    )
    _train(net, optimizer, batches, 10 * len(batches))
    weights = net.weight.detach().reshape(-1)
    assert optimizer.epoch == 10
    assert torch.equal(weights != 0, w != 0)
    assert optimizer.sparsity() == 13 / 16
    # posterior mean on the support: each of the 10 batches has 2 rows per coordinate with noise
    # precision 100, and the slab prior's precision is 1 / 0.3^2
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    posterior_mean = 100 * (xs * ys[:, None]).sum(0) / (100 * (xs**2).sum(0) + 0.3**-2)
    torch.testing.assert_close(weights[w != 0], posterior_mean[w != 0], rtol=0, atol=0.03)
    assert optimizer.p_nonzero().shape == (16,)


def test_optimizer_resumes_bit_for_bit():
    _, batches = _separable_regression()
    kwargs = dict(num_cases=320, steps_per_epoch=10, num_epochs=4, target_sparsity=0.75)
    net = _net()
    optimizer = SparseQNVBOptimizer(
        net.parameters(), generator=torch.Generator().manual_seed(3), **kwargs
    )
    _train(net, optimizer, batches, 17)
    saved_net = copy.deepcopy(net.state_dict())
    saved = copy.deepcopy(optimizer.state_dict())
    _train(net, optimizer, batches[7:] + batches[:7], 23)

    other = _net(seed=5)
    other.load_state_dict(saved_net)
    resumed = SparseQNVBOptimizer(
        other.parameters(), generator=torch.Generator().manual_seed(99), **kwargs
    )
    resumed.load_state_dict(saved)
    _train(other, resumed, batches[7:] + batches[:7], 23)
    assert torch.equal(net.weight, other.weight)
    for name, value in optimizer.state[net.weight].items():
        assert torch.equal(value, resumed.state[other.weight][name]), name
    assert optimizer.counters == resumed.counters
    assert optimizer.sequence_offset == resumed.sequence_offset


def test_optimizer_load_refuses_other_settings():
    """A state loaded into a differently configured optimizer would continue under another
    schedule or other terms: each differing setting is named and nothing is loaded."""
    _, batches = _separable_regression()
    kwargs = dict(num_cases=320, steps_per_epoch=10, num_epochs=4, target_sparsity=0.75)
    net = _net()
    optimizer = SparseQNVBOptimizer(net.parameters(), **kwargs)
    _train(net, optimizer, batches, 3)
    saved = optimizer.state_dict()
    changes = [
        ({"steps_per_epoch": 20}, r"steps_per_epoch=10 \(this optimizer: 20\)"),
        ({"num_cases": 640}, r"num_cases=320\.0 \(this optimizer: 640\.0\)"),
        ({"prior_precision": 1.0}, r"prior_precision=11\.1.* \(this optimizer: 1\.0\)"),
        ({"initial_lr": 1e-4}, r"initial_lr=1e-05 \(this optimizer: 0\.0001\)"),
        ({"num_pairs": 4}, r"num_pairs=2 \(this optimizer: 4\)"),
        (
            {"tau_max": 0.1, "num_epochs": 5},
            r"num_epochs=4 .*tau_max=0\.3 \(this optimizer: 0\.1\)",
        ),
    ]
    for change, message in changes:
        other_net = _net(seed=1)
        other = SparseQNVBOptimizer(other_net.parameters(), **{**kwargs, **change})
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(saved)
        assert other.counters.step == 0 and other.sequence_offset is None and not other.state


def test_optimizer_refuses_bad_input():
    net = _net()
    with pytest.raises(ValueError, match="num_cases"):
        SparseQNVBOptimizer(net.parameters(), num_cases=0, steps_per_epoch=3)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        SparseQNVBOptimizer(net.parameters(), num_cases=10, steps_per_epoch=0)
    with pytest.raises(ValueError, match="parameter groups take no options"):
        SparseQNVBOptimizer(
            [{"params": net.parameters(), "tau_max": 0.1}], num_cases=10, steps_per_epoch=3
        )
    optimizer = SparseQNVBOptimizer(net.parameters(), num_cases=10, steps_per_epoch=3)
    with pytest.raises(TypeError, match="SparseQNVBOptimizer: the closure must return the scalar"):
        optimizer.step(lambda: None)
    with pytest.raises(
        RuntimeError,
        match="SparseQNVBOptimizer: none of the 1 parameters this optimizer holds received a grad",
    ):
        optimizer.step(lambda: torch.tensor(1.0))
    assert torch.equal(net.weight, optimizer.state[net.weight]["mu"])  # restored to the mean


def test_no_nan_or_infinity_leaves_the_update():
    """float32, n0 = 2 and n1 = 1 (alpha_1 = 4/3): g = 3e38 overflows g_hat, so that coordinate
    drops the term and keeps its Gaussian; a NaN g drops its term too; both are counted."""
    hp = SparseQNVBHyperparameters(num_epochs=4)
    block = init_sparse_block(torch.tensor([0.5, 0.5, 0.5]), hp)
    counters = init_sparse_counters(hp, 8)._replace(step=1, n0=2.0)
    g = torch.tensor([3e38, float("nan"), 1.0])
    h = torch.tensor([20.0, 20.0, 20.0])
    result = sparse_qnvb_update((block,), counters, [g], [h], hp, 8)
    new = result.blocks[0]
    for value in new:
        assert bool(torch.isfinite(value).all())
    assert int(result.num_overflow) == 1 and int(result.num_nonfinite) == 1
    assert new.nu[0] == block.nu[0]  # kept
    assert new.nu[1] == block.nu[1]  # g, h dropped: g_nu = g_hat + h_hat (nu - mu) = 0 here
    assert new.nu[2] != block.nu[2]
    warned: set[str] = set()
    messages = result_messages(result, warned)
    assert len(messages) == 2 and "overflowed at 1 coordinates" in messages[1]
    assert result_messages(result, warned) == []  # each kind once


def test_curvature_term_carries_the_cross_terms_scaled_by_the_sigma_ratio():
    """On a dense quadratic 0.5 theta^T A theta - b^T theta, one step's curvature term is the
    Stein estimate of Algorithm 4.1, h_i = sum_j A_ij (sigma_j / sigma_i) mean_k(x_ki x_kj), the
    pairs that the step's two Hadamard iterates do not separate (Theorem 3.3) keeping their cross
    term scaled by sigma_j / sigma_i (docs, 'Limits': why dense problems diverge)."""
    d = 8
    generator = torch.Generator().manual_seed(3)
    m = torch.randn(d, d, generator=generator, dtype=DTYPE)
    a = m.T @ m + d * torch.eye(d, dtype=DTYPE)
    b = torch.randn(d, generator=generator, dtype=DTYPE)
    theta = torch.nn.Parameter(torch.randn(d, generator=generator, dtype=DTYPE))
    optimizer = SparseQNVBOptimizer(
        [theta],
        num_cases=1,
        steps_per_epoch=1,
        tau_max=1e3,  # curvature floor 1e-6
        prior_precision=0.0,
        generator=torch.Generator().manual_seed(0),
    )
    optimizer.p_nonzero()  # makes the state
    sigma = torch.tensor([1e-2, 1e-4, 3e-3, 1e-2, 1e-5, 2e-2, 1e-3, 5e-3], dtype=DTYPE)
    optimizer.state[theta]["sigma"] = sigma.clone()

    def closure():
        loss = 0.5 * theta @ a @ theta - b @ theta
        loss.backward()
        return loss

    optimizer.step(closure)
    # one step per epoch: the term's sum has replaced h0 (Algorithm 5.2, lines 13-15)
    nodes = optimizer.rule.draw(d, step=optimizer.sequence_offset, dtype=DTYPE)
    x = torch.stack([nodes.node(k) for k in range(len(nodes))])
    moments = x.T @ x / len(nodes)
    expected = (a * moments * sigma).sum(1) / sigma
    torch.testing.assert_close(
        optimizer.state[theta]["h0"], expected.clamp(min=1e-6), rtol=1e-10, atol=0
    )
    cross = (expected - a.diagonal()).abs() / a.diagonal()
    assert cross.max() > 10  # a 1e-5 sigma beside 1e-2 ones: the cross terms dominate
    assert (moments - torch.diag(moments.diagonal())).abs().sum() > 0  # some pairs not separated
