"""Mixed terms: RASP pair exactness and unbiasedness, blocked sigma points, Hadamard periodicity.

The mixed quadratic moment of a quadrature ``(X, w)`` is ``M = X^T diag(w) X``; under ``N(0, I)``
its off-diagonal entries must be 0. All checks are in float64 at several hundred dimensions.
Statistical checks use tolerances of at least 5 standard errors, with fixed seeds.
"""

from __future__ import annotations

import math

import pytest
import torch

from pyro_quadvi.quadrature import (
    BlockedSimplexRule,
    hadamard_signs,
    make_rule,
    quadratic_exactness,
    simplex_reference,
)

EXACT = 1e-12


def second_moments(X: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (X * w[:, None]).T @ X


def upper(M: torch.Tensor) -> torch.Tensor:
    """The entries above the diagonal, row by row."""
    rows, cols = torch.triu_indices(M.shape[0], M.shape[1], offset=1)
    return M[rows, cols]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ RASP

RASP_CASES = [
    ("rasp_simplex", 3, 2),
    ("rasp_simplex", 4, 3),
    ("rasp_simplex", 6, 5),
    ("rasp_cross", 4, 2),
    ("rasp_cross", 6, 3),
    ("rasp_cross", 10, 5),
]


@pytest.mark.parametrize("name, num_points, r", RASP_CASES)
def test_rasp_exact_pair_fraction_is_one_minus_one_over_r(name, num_points, r):
    """rasp paper, Theorem 3.2: a pair is exact with probability ``1 - 1/r``.

    The pair events "coordinates i and j share a reference dimension" are pairwise independent
    (for uniform affinities), so the count of exact pairs over ``n`` draws has exactly the binomial
    variance ``N p (1 - p)``, ``N = n d (d - 1) / 2``.
    """
    dim, draws = 400, 6
    rule = make_rule(name, num_points)
    exact = 0
    for seed in range(draws):
        X, w = rule.nodes(dim, generator=generator(seed), dtype=torch.float64)
        cross = upper(second_moments(X, w))
        is_exact = cross.abs() <= EXACT
        # the others are off by exactly +-1 (Theorem 3.3's proof: s_i s_j rho_j^2 summed = +-1)
        assert (cross[~is_exact].abs() - 1).abs().max().item() < EXACT
        exact += int(is_exact.sum())
        if seed == 0:
            assert quadratic_exactness(X, w).cross == int(is_exact.sum())
    pairs = draws * dim * (dim - 1) // 2
    p = 1 - 1 / r
    assert abs(exact / pairs - p) < 5 * math.sqrt(p * (1 - p) / pairs), (exact / pairs, p)


@pytest.mark.parametrize("name", ["rasp_simplex", "rasp_cross"])
def test_rasp_with_one_reference_dimension_gets_no_pair_right(name):
    X, w = make_rule(name, 2).nodes(300, generator=generator(0), dtype=torch.float64)
    cross = upper(second_moments(X, w))
    assert torch.allclose(cross.abs(), torch.ones_like(cross), rtol=0, atol=EXACT)


@pytest.mark.parametrize("name, num_points, r", [RASP_CASES[0], RASP_CASES[4]])
def test_rasp_cross_terms_are_unbiased_over_seeds(name, num_points, r):
    """rasp paper, Theorem 3.3: the error of ``Q[x_i x_j]`` has mean zero over the draws.

    Each error is 0 or +-1 (previous test), with variance ``1 / r`` (Table 1); errors of distinct
    pairs are uncorrelated (``E[s_i s_j s_i s_k] = 0``).
    """
    dim, draws = 300, 400
    rule = make_rule(name, num_points)
    X = torch.cat(
        [
            rule.nodes(dim, generator=generator(1000 + seed), dtype=torch.float64)[0]
            for seed in range(draws)
        ]
    )
    mean_error = upper(X.T @ X / X.shape[0])  # per pair, the mean over the draws
    variance = 1 / r
    # the grand mean over all pairs and draws, standard error sqrt(variance / (draws * pairs))
    grand_mean = mean_error.mean().item()
    assert abs(grand_mean) < 5 * math.sqrt(variance / (draws * mean_error.numel())), grand_mean
    # no single pair is biased: per pair the standard error is sqrt(variance / draws)
    z = mean_error / math.sqrt(variance / draws)
    assert z.abs().max().item() < 6.0, z.abs().max()
    # ... and the spread of the per-pair means is that of unbiased errors of variance 1 / r
    assert z.pow(2).mean().item() == pytest.approx(1.0, abs=0.05)


def random_odd_monomials(dim: int, count: int, seed: int):
    """Index and exponent arrays ``(count, 5)`` of monomials ``prod_v x_{idx_v}^{exp_v}`` with odd
    total degree; up to 5 distinct coordinates, exponents 0-4."""
    g = generator(seed)
    index = torch.stack([torch.randperm(dim, generator=g)[:5] for _ in range(count)])
    exponent = torch.randint(0, 5, (count, 5), generator=g)
    exponent[:, 0] += (exponent.sum(dim=1) % 2 == 0).long()  # make the total degree odd
    return index, exponent


def monomial_quadrature(X, w, index, exponent):
    return torch.einsum("k,km->m", w, (X[:, index] ** exponent).prod(dim=-1))


@pytest.mark.parametrize(
    "name, num_points",
    [("rasp_cross", 4), ("rasp_cross", 6), ("rasp_cross", 8), ("hadamard", 4), ("hadamard", 6)],
)
def test_symmetric_rules_integrate_every_odd_monomial(name, num_points):
    """rasp paper, Theorem 3.4: a symmetric reference makes every odd total-degree monomial exact
    (its integral is 0); the Hadamard antithetic pairs are symmetric too."""
    dim = 300
    index, exponent = random_odd_monomials(dim, 3000, seed=5)
    # include the named low-degree cases explicitly: x_i x_j x_k, x_i^2 x_j, x_i^3, x_i^3 x_j^2
    index[:4, :3] = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2], [3, 4, 5]])
    exponent[:4] = torch.tensor(
        [[1, 1, 1, 0, 0], [2, 1, 0, 0, 0], [3, 0, 0, 0, 0], [3, 2, 0, 0, 0]]
    )
    assert (exponent.sum(dim=1) % 2 == 1).all()
    rule = make_rule(name, num_points)
    for seed in range(3):
        X, w = rule.nodes(dim, step=seed, generator=generator(seed), dtype=torch.float64)
        values = monomial_quadrature(X, w, index, exponent)
        assert values.abs().max().item() < 1e-9


def test_simplex_rasp_does_not_integrate_odd_monomials():
    """The simplex reference is not symmetric: Theorem 3.4 does not apply."""
    dim = 300
    index, exponent = random_odd_monomials(dim, 3000, seed=5)
    X, w = make_rule("rasp_simplex", 3).nodes(dim, generator=generator(0), dtype=torch.float64)
    values = monomial_quadrature(X, w, index, exponent)
    assert (values.abs() > 1e-3).float().mean().item() > 0.3


# --------------------------------------------------------------------------- blocked sigma points


@pytest.mark.parametrize("num_points, dim", [(3, 300), (3, 301), (4, 301), (4, 302), (6, 300)])
def test_blocked_simplex_every_quadratic_within_a_block_is_exact(num_points, dim):
    """sequence paper, Section 3.1: the simplex sigma points on each block of ``r = K - 1``
    consecutive coordinates, including a shorter last block."""
    r = num_points - 1
    block = torch.arange(dim) // r
    same_block = block[:, None] == block[None, :]
    rule = make_rule("blocked_simplex", num_points)
    extra = 0
    for seed in range(4):
        X, w = rule.nodes(dim, generator=generator(seed), dtype=torch.float64)
        M = second_moments(X, w)
        assert (w @ X).abs().max().item() < EXACT
        error = (M - torch.eye(dim, dtype=M.dtype)).abs()
        assert error[same_block].max().item() < EXACT
        off_block = error[~same_block]
        assert (off_block > EXACT).any()  # not a full sigma-point rule
        extra += int((off_block <= EXACT).sum()) // 2
        counted = quadratic_exactness(X, w)
        assert counted.square == dim and counted.linear == dim
        within = int(same_block.sum() - dim) // 2
        assert counted.cross == within + int((off_block <= EXACT).sum()) // 2
    # "extra exactness" (sequence paper, Sec. 3.1.1): compatible permutations across blocks
    assert extra > 0


@pytest.mark.parametrize("random_signs", [True, False])
def test_blocked_simplex_permutations_and_signs_are_uniform(random_signs):
    """Each block's nodes are a uniformly random permutation of the K simplex vertices, times a
    uniformly random sign (``random_signs=True``) or always ``+1`` (the paper's rule)."""
    num_points, dim, draws = 3, 2, 3000  # one block of two coordinates
    rule = BlockedSimplexRule(num_points, random_signs=random_signs)
    vertices = simplex_reference(num_points - 1).T  # (K, r): vertex k
    outcomes = 2 * math.factorial(num_points) if random_signs else math.factorial(num_points)
    counts: dict[tuple, int] = {}
    g = generator(1)
    for _ in range(draws):
        X, _ = rule.nodes(dim, generator=g, dtype=torch.float64)
        # which signed vertex sits at node k: match rows against +-vertices
        signed = torch.cat([vertices, -vertices])  # (2K, r): row K + k is -vertex k
        match = (X[:, None, :] - signed[None, :, :]).abs().sum(-1).argmin(dim=1)
        assert torch.equal(X, signed[match])
        sign = (match // num_points).unique()
        assert sign.numel() == 1  # one sign per block
        vertex = match % num_points
        assert sorted(vertex.tolist()) == list(range(num_points))
        key = (int(sign), *vertex.tolist())
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == outcomes
    p = 1 / outcomes
    sd = math.sqrt(draws * p * (1 - p))
    assert max(abs(c - draws * p) for c in counts.values()) < 5 * sd


# (K, exponents on the block's first coordinates, unsigned value): the paper's rule gives these
# odd moments the same nonzero value at every draw; hand-computed from the K = 3 vertices
# (1.366, -0.366), (-0.366, 1.366), (-1, -1): x^3 -> (2.549 - 0.049 - 1) / 3 = 0.5, x_1^2 x_2 ->
# (-0.683 + 0.183 - 1) / 3 = -0.5; for K = 4, from the vertices of simplex_reference(3).
ODD_MONOMIALS = [
    (3, (3, 0), 0.5),
    (3, (2, 1), -0.5),
    (3, (5, 0), None),
    (4, (3, 0, 0), None),
    (4, (1, 1, 1), None),
    (4, (2, 1, 0), None),
]


@pytest.mark.parametrize("num_points, exponent, unsigned_value", ODD_MONOMIALS)
def test_blocked_simplex_odd_moments_vanish_over_draws_only_with_random_signs(
    num_points, exponent, unsigned_value
):
    """An odd-degree monomial within a block: the paper's rule (``random_signs=False``) gives it
    the simplex's value (+-0.5 for K = 3), the same at every draw, where N(0, I) gives 0; with a
    random sign per block its average over the draws is 0 (within 5 standard errors), while
    every coordinate's quadratic stays exact draw by draw."""
    r = num_points - 1
    blocks, draws = 150, 200
    dim = blocks * r
    power = torch.tensor(exponent, dtype=torch.float64)
    vertices = simplex_reference(r).T  # (K, r)
    value = (vertices[:, : len(exponent)] ** power).prod(-1).mean().item()
    if unsigned_value is not None:
        assert value == pytest.approx(unsigned_value, abs=1e-12)
    assert abs(value) > 0.1  # odd, and not integrated by the simplex
    for random_signs in (True, False):
        rule = BlockedSimplexRule(num_points, random_signs=random_signs)
        g = generator(7)
        per_draw = torch.empty(draws, dtype=torch.float64)
        for t in range(draws):
            X, w = rule.nodes(dim, generator=g, dtype=torch.float64)
            x = X.reshape(num_points, blocks, r)[:, :, : len(exponent)]
            monomial = w @ (x**power).prod(-1)  # (blocks,): the quadrature of each block
            assert (w @ X).abs().max().item() < EXACT
            assert (w @ X**2 - 1).abs().max().item() < EXACT
            per_draw[t] = monomial.mean()
            if random_signs:
                assert torch.allclose(monomial.abs(), torch.full_like(monomial, abs(value)))
            else:
                assert torch.allclose(monomial, torch.full_like(monomial, value))
        mean = per_draw.mean().item()
        se = per_draw.std().item() / math.sqrt(draws)
        if random_signs:
            assert abs(value) > 20 * se  # the test can tell 0 from the unsigned value
            assert abs(mean) < 5 * se, (mean, se)
        else:
            assert se < EXACT and mean == pytest.approx(value, abs=EXACT)


def test_blocked_simplex_products_across_blocks_match_the_tensor_product_in_expectation():
    """sequence paper, Theorem 3.1: for f = prod_b f_b(theta_b) with each f_b a quadratic on its
    block, the expectation over the permutations of Q[f] is the exact integral prod_b E[f_b]."""
    num_points, dim, draws = 3, 300, 3000
    r = num_points - 1
    blocks = dim // r
    g = generator(2)
    # a random quadratic per block: f_b(x) = a_b + c_b . x + x^T C_b x, E[f_b] = a_b + tr(C_b)
    a = torch.randn(blocks, generator=g, dtype=torch.float64)
    c = torch.randn(blocks, r, generator=g, dtype=torch.float64)
    C = torch.randn(blocks, r, r, generator=g, dtype=torch.float64)
    means = a + C.diagonal(dim1=1, dim2=2).sum(-1)

    rule = make_rule("blocked_simplex", num_points)
    sums = torch.zeros(2, blocks - 2, dtype=torch.float64)
    sums_sq = torch.zeros_like(sums)
    g = generator(3)
    for _ in range(draws):
        X, w = rule.nodes(dim, generator=g, dtype=torch.float64)
        x = X.reshape(num_points, blocks, r)
        f = a + torch.einsum("br,kbr->kb", c, x) + torch.einsum("kbr,brs,kbs->kb", x, C, x)
        # within one block the quadrature is exact, draw by draw
        assert torch.allclose(w @ f, means, rtol=0, atol=1e-12)
        pair = w @ (f[:, :-2] * f[:, 1:-1])  # products over two adjacent blocks
        triple = w @ (f[:, :-2] * f[:, 1:-1] * f[:, 2:])  # ... and over three
        values = torch.stack([pair, triple])
        sums += values
        sums_sq += values**2
    exact = torch.stack([means[:-2] * means[1:-1], means[:-2] * means[1:-1] * means[2:]])
    mean = sums / draws
    std = (sums_sq / draws - mean**2).clamp_min(0).sqrt()
    assert (std > 1e-3).all()  # a single draw is not exact for these products
    z = (mean - exact) / (std / math.sqrt(draws))
    assert z.abs().max().item() < 5.0, z.abs().max()


# -------------------------------------------------------------------------------------- Hadamard


def sylvester(order: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while H.shape[0] < order:
        H = torch.kron(base, H)
    return H


def test_hadamard_signs_are_the_sylvester_hadamard_matrix():
    H = sylvester(128)
    index = torch.arange(128, dtype=torch.int32)
    for q in range(128):
        assert torch.equal(hadamard_signs(index, q, dtype=torch.float64), H[q])
    # tensor iterates broadcast against indices
    table = hadamard_signs(index[None, :], index[:, None], dtype=torch.float64)
    assert torch.equal(table, H)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_hadamard_signs_for_large_indices_and_iterates(index_dtype):
    g = generator(9)
    top = 2**31 - 1
    index = torch.cat(
        [torch.arange(top - 999, top + 1), torch.randint(0, top, (1000,), generator=g)]
    )
    iterates = [
        0,
        1,
        top,
        top - 1,
        2**30,
        12345678,
        *torch.randint(0, top, (20,), generator=g).tolist(),
        2**31 + 5,
        2**40 + 3,
    ]  # only the low 31 bits matter for indices below 2^31
    for q in iterates:
        signs = hadamard_signs(index.to(index_dtype), q, dtype=torch.float64)
        expected = [1.0 - 2.0 * (bin(i & q).count("1") % 2) for i in index.tolist()]
        assert signs.tolist() == expected, q


@pytest.mark.parametrize(
    "index_dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8]
)
def test_hadamard_signs_for_unsigned_and_narrow_indices(index_dtype):
    """Unsigned indices are widened first: in uint8 ``1 - 2 * parity`` wrapped to 255, and torch
    has no shifts for uint16 to uint64 ("rshift_cpu" not implemented)."""
    index = torch.tensor([0, 1, 2, 3, 126, 127]).to(index_dtype)
    expected = [1.0, -1.0, -1.0, 1.0, -1.0, 1.0]  # row 3 of the Sylvester-Hadamard matrix
    assert hadamard_signs(index, 3).tolist() == expected
    assert hadamard_signs(index, torch.tensor(3).to(index_dtype)).tolist() == expected


@pytest.mark.parametrize(
    "index, iterate, message",
    [
        (
            torch.tensor([1, -2]),
            1,
            r"index must hold coordinate indices in \[0, 2\^31\), got an entry -2",
        ),
        (torch.tensor([2**31, 1]), 1, r"index must .* \[0, 2\^31\), got an entry 2147483648"),
        (torch.tensor([1, 2]), -1, "iterate must be >= 0, got -1"),
        (torch.tensor([1, 2]), torch.tensor([[0], [-3]]), "iterate must be >= 0, got -3"),
    ],
)
def test_hadamard_signs_refuses_arguments_outside_their_range(index, iterate, message):
    """``iterate = -1`` was read as 2^31 - 1, negative indices and indices from 2^31 were taken."""
    with pytest.raises(ValueError, match="^hadamard_signs: " + message + "$"):
        hadamard_signs(index, iterate)


def test_hadamard_nodes_are_antithetic_pairs_of_consecutive_iterates():
    """sequence paper, Algorithm 3.1: nodes 2j and 2j+1 are +s and -s for iterate step K/2 + j."""
    dim, num_points, step = 64, 6, 5
    X, w = make_rule("hadamard", num_points).nodes(dim, step=step, dtype=torch.float64)
    H = sylvester(64)
    for j in range(num_points // 2):
        q = step * num_points // 2 + j
        assert torch.equal(X[2 * j], H[q % 64]) and torch.equal(X[2 * j + 1], -H[q % 64])
    assert torch.equal(w, torch.full((num_points,), 1 / num_points, dtype=torch.float64))


def test_hadamard_one_node_at_a_time_across_the_iterate_wraparound():
    """Iterates 2^31 - 2, 2^31 - 1, 2^31 (= 0 for 31-bit indices): node(k) equals the matrix."""
    num_points, dim = 6, 64
    step = (2**31 - 2) // 3
    node_set = make_rule("hadamard", num_points).draw(dim, step=step, dtype=torch.float64)
    matrix = node_set.matrix()
    index = torch.arange(dim).tolist()
    for k in range(num_points):
        q = step * 3 + k // 2
        expected = [(1.0 - 2.0 * (bin(i & q).count("1") % 2)) * (-1) ** k for i in index]
        assert node_set.node(k).tolist() == expected == matrix[k].tolist()


def lowest_differing_bit(dim: int) -> torch.Tensor:
    """``(dim, dim)`` matrix of the lowest set bit of ``i XOR j`` (-1 on the diagonal)."""
    index = torch.arange(dim)
    x = index[:, None] ^ index[None, :]
    lowest = torch.where(x > 0, (x & -x).double().log2().round().long(), -1)
    return lowest


@pytest.mark.parametrize("dim", [300, 512])
@pytest.mark.parametrize("num_points", [4, 8, 16])
def test_hadamard_periodic_exactness(dim, num_points):
    """sequence paper, Theorem 3.3: with K/2 = 2^m, every step makes every pair whose lowest
    differing index bit is below m exact, and (Lemma 3.2) every other pair is off by exactly +-1."""
    m = int(math.log2(num_points // 2))
    bit = lowest_differing_bit(dim)
    rows, cols = torch.triu_indices(dim, dim, offset=1)
    low = bit[rows, cols] < m
    rule = make_rule("hadamard", num_points)
    for step in (0, 1, 5, 37, 1001):
        X, w = rule.nodes(dim, step=step, dtype=torch.float64)
        cross = upper(second_moments(X, w))
        assert cross[low].abs().max().item() < EXACT
        assert ((cross[~low].abs() - 1).abs() < EXACT).all()
        if step == 5:
            counted = quadratic_exactness(X, w)
            assert counted.cross == int(low.sum())
            assert counted.total == counted.num_basis - int((~low).sum())
    if dim == 512:
        # closed form: pairs agreeing in the m low bits are 2^m * C(dim / 2^m, 2)
        group = dim >> m
        assert int((~low).sum()) == 2**m * group * (group - 1) // 2
        assert low.float().mean().item() == pytest.approx(1 - (group - 1) / (dim - 1))


@pytest.mark.parametrize("num_points", [2, 6, 10])
def test_hadamard_with_odd_number_of_pairs_gets_no_pair_right_at_one_step(num_points):
    """An odd count of +-1 sign products never sums to 0 (docs/quadrature.md)."""
    X, w = make_rule("hadamard", num_points).nodes(300, step=3, dtype=torch.float64)
    assert quadratic_exactness(X, w).cross == 0


def test_hadamard_pairs_see_the_tensor_product_cubature():
    """Theorem 3.3: over a window the pair (i, j) sees the 4-node tensor product of {+1, -1}, which
    integrates x_i^a x_j^b exactly for a, b <= 3."""
    dim, num_points = 256, 8
    X, w = make_rule("hadamard", num_points).nodes(dim, step=3, dtype=torch.float64)
    bit = lowest_differing_bit(dim)
    i, j = torch.nonzero((bit >= 0) & (bit < 2), as_tuple=True)
    exact = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)  # E[x^a], a = 0..3
    for a in range(4):
        for b in range(4):
            values = w @ (X[:, i] ** a * X[:, j] ** b)
            assert (values - exact[a] * exact[b]).abs().max().item() < EXACT


@pytest.mark.parametrize("num_points, dim", [(4, 300), (6, 300), (8, 200)])
def test_hadamard_full_period_makes_every_pair_exact(num_points, dim):
    rule = make_rule("hadamard", num_points)
    period = rule.period(dim)
    length = rule.sequence_length(dim)
    assert length == 1 << math.ceil(math.log2(dim))
    assert period * (num_points // 2) == math.lcm(length, num_points // 2)
    nodes = [rule.nodes(dim, step=step, dtype=torch.float64)[0] for step in range(period)]
    X = torch.cat(nodes)  # all K * period nodes, each of weight 1 / (K * period)
    average = X.T @ X / X.shape[0]
    assert (average - torch.eye(dim, dtype=torch.float64)).abs().max().item() < EXACT
    half = torch.cat(nodes[: period // 2])
    assert (upper(half.T @ half / half.shape[0]).abs() > EXACT).any()  # half a period is not enough
    # and the sequence repeats after one period
    assert torch.equal(rule.nodes(dim, step=period + 2)[0], rule.nodes(dim, step=2)[0])


@pytest.mark.parametrize("step", [0, 3, (2**31 - 2) // 3])
def test_hadamard_nodes_beyond_the_low_16_index_bits(step):
    """node(k) builds the signs from the high and low 16 index bits; check it against the signs
    computed directly for every index, on a dimension that is not a multiple of 2^16."""
    dim, num_points = 3 * 2**16 + 5, 6
    node_set = make_rule("hadamard", num_points).draw(dim, step=step, dtype=torch.float64)
    index = torch.arange(dim)
    matrix = node_set.matrix()
    for k in range(num_points):
        q = step * num_points // 2 + k // 2
        expected = hadamard_signs(index, q, dtype=torch.float64) * (-1) ** k
        node = node_set.node(k)
        assert node.shape == (dim,) and node.is_contiguous()
        assert torch.equal(node, expected) and torch.equal(matrix[k], expected)


def test_hadamard_matrix_past_the_low_16_index_bits_equals_the_bit_formula():
    """The matrix is built from Kronecker rows of the high and low 16 index bits; check it against
    the parity of the whole index, at iterates whose high bits are set."""
    dim, step = 2**16 + 100, 70_000
    X = make_rule("hadamard", 4).draw(dim, step=step, dtype=torch.float64).matrix()
    index = torch.arange(dim, dtype=torch.int32)
    for j in range(2):
        signs = hadamard_signs(index, step * 2 + j, dtype=torch.float64)
        assert torch.equal(X[2 * j], signs) and torch.equal(X[2 * j + 1], -signs)
