"""Quadrature rules: weights, univariate exactness, determinism, one node at a time, dtypes, errors.

Every exactness claim is checked in float64 at several hundred dimensions against the exact moments
of the standard normal, ``E[x^p] = (p - 1)!!`` for even ``p`` and 0 for odd ``p``. Pair properties
(RASP, blocked, Hadamard) are in ``test_quadrature_pairs.py``; Gauss-Hermite and the exactness
counter in ``test_quadrature_hermite.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pyro
import pytest
import torch

from pyro_quadvi.quadrature import RULES, make_rule

DIM = 400
ATOL = 1e-10


def normal_moment(p: int) -> float:
    """``E[x^p]`` for ``x ~ N(0, 1)``."""
    return 0.0 if p % 2 else float(math.prod(range(p - 1, 0, -2)))


def draw(name, num_points, dim=DIM, seed=0, step=0, dtype=torch.float64, **options):
    rule = make_rule(name, num_points, **options)
    generator = torch.Generator().manual_seed(seed)
    return rule.nodes(dim, step=step, generator=generator, dtype=dtype)


def coordinate_moments(X: torch.Tensor, w: torch.Tensor, degree: int) -> torch.Tensor:
    """``sum_k w_k X[k, i]^p`` for ``p = 0 .. degree``: shape ``(degree + 1, dim)``."""
    powers = X[None] ** torch.arange(degree + 1, dtype=X.dtype)[:, None, None]
    return torch.einsum("k,pki->pi", w, powers)


# (rule, K, univariate degree of exactness). rasp_simplex and blocked_simplex with K = 2 use the
# one-dimensional simplex {+1, -1}, which is symmetric and so exact to degree 3, and so is vrmc2
# with K = 2 (two draws centred and scaled are -1 and +1); the cross-polytope with r = 3 (K = 6)
# is exact to degree 5 (rasp paper, Sec. 3.2).
UNIVARIATE_DEGREE = [
    ("rasp_simplex", 2, 3),
    ("rasp_simplex", 3, 2),
    ("rasp_simplex", 4, 2),
    ("rasp_simplex", 7, 2),
    ("rasp_cross", 2, 3),
    ("rasp_cross", 4, 3),
    ("rasp_cross", 6, 5),
    ("rasp_cross", 8, 3),
    ("rasp_cross", 12, 3),
    ("hadamard", 2, 3),
    ("hadamard", 4, 3),
    ("hadamard", 6, 3),
    ("hadamard", 16, 3),
    ("blocked_simplex", 2, 3),
    ("blocked_simplex", 3, 2),
    ("blocked_simplex", 5, 2),
    ("mc", 3, 0),
    ("mc", 8, 0),
    ("vrmc1", 2, 1),
    ("vrmc1", 5, 1),
    ("vrmc2", 2, 3),
    ("vrmc2", 3, 2),
    ("vrmc2", 6, 2),
]


@pytest.mark.parametrize("name, num_points, degree", UNIVARIATE_DEGREE)
def test_univariate_moments_exact_to_the_claimed_degree_and_not_beyond(name, num_points, degree):
    for seed, step in [(0, 0), (1, 3)]:
        X, w = draw(name, num_points, seed=seed, step=step)
        assert X.shape == (num_points, DIM) and w.shape == (num_points,)
        assert w.sum().item() == pytest.approx(1.0, abs=1e-15)
        moments = coordinate_moments(X, w, degree + 1)
        exact = torch.tensor([normal_moment(p) for p in range(degree + 2)], dtype=X.dtype)
        error = (moments - exact[:, None]).abs()
        # every coordinate, every power up to the claimed degree
        assert error[: degree + 1].max().item() < ATOL, (name, num_points, error.max(dim=1))
        # ... and no coordinate at all is exact one degree higher
        assert error[degree + 1].min().item() > 1e-8, (name, num_points, error[degree + 1].min())


@pytest.mark.parametrize("name, num_points, degree", UNIVARIATE_DEGREE)
def test_random_sums_of_univariate_polynomials(name, num_points, degree):
    """``f(x) = sum_i sum_p c_ip x_i^p`` with random ``c``: exact to the claimed degree only."""
    X, w = draw(name, num_points, seed=7)
    coefficients = torch.randn(
        degree + 2, DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    exact = torch.tensor([normal_moment(p) for p in range(degree + 2)], dtype=torch.float64)
    powers = X[None] ** torch.arange(degree + 2, dtype=X.dtype)[:, None, None]  # (p, K, dim)
    values = torch.einsum("pi,pki->kp", coefficients, powers)  # f_p(X[k]) per top degree p
    quadrature = w @ values.cumsum(dim=1)  # column p: the polynomial truncated at degree p
    integral = (coefficients.sum(dim=1) * exact).cumsum(dim=0)
    scale = coefficients.abs().sum().item()
    assert torch.allclose(
        quadrature[: degree + 1], integral[: degree + 1], rtol=0, atol=1e-13 * scale
    )
    assert abs(quadrature[degree + 1] - integral[degree + 1]).item() > 1e-6


@pytest.mark.parametrize("name", [n for n in RULES if n != "gauss_hermite"])
def test_weights_are_equal_and_sum_to_one(name):
    for num_points in (2, 4, 8):
        X, w = draw(name, num_points)
        assert torch.equal(w, torch.full((num_points,), 1.0 / num_points, dtype=torch.float64))
        assert w.sum().item() == pytest.approx(1.0, abs=1e-15)
        assert torch.isfinite(X).all()


# ------------------------------------------------------------------ determinism and reproducibility

RANDOM_RULES = [name for name in RULES if make_rule(name).is_random]
DETERMINISTIC_RULES = [name for name in RULES if name not in RANDOM_RULES]


def small_dim(name):
    return 4 if name == "gauss_hermite" else 300


def test_which_rules_are_random():
    assert sorted(RANDOM_RULES) == sorted(
        ["rasp_simplex", "rasp_cross", "blocked_simplex", "mc", "vrmc1", "vrmc2"]
    )


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("num_points", [1, 2, 3, 4, 6])
def test_exact_coordinate_quadratics_says_what_the_nodes_do(name, num_points):
    # the flag QuadratureELBO relies on to integrate Normal priors in closed form: sum w = 1,
    # sum w x_j = 0, sum w x_j^2 = 1 along every coordinate, at several steps and seeds
    try:
        rule = make_rule(name, num_points)
    except ValueError:  # a size the rule refuses
        return
    exact = True
    for dim in (1, 3) if name == "gauss_hermite" else (1, 7, 40):
        for step in (0, 1, 5):
            X, w = rule.nodes(
                dim, step=step, generator=torch.Generator().manual_seed(step), dtype=torch.float64
            )
            exact &= bool(
                abs(w.sum().item() - 1) < 1e-12
                and (w @ X).abs().max() < 1e-12
                and (w @ X**2 - 1).abs().max() < 1e-12
            )
    assert rule.exact_coordinate_quadratics == exact


@pytest.mark.parametrize("name", list(RULES))
def test_same_generator_seed_gives_identical_nodes(name):
    dim = small_dim(name)
    X1, w1 = draw(name, None, dim=dim, seed=11, step=2)
    X2, w2 = draw(name, None, dim=dim, seed=11, step=2)
    assert torch.equal(X1, X2) and torch.equal(w1, w2)


@pytest.mark.parametrize("name", RANDOM_RULES)
def test_random_rules_differ_between_seeds_and_between_successive_draws(name):
    X1, _ = draw(name, None, dim=300, seed=11)
    X2, _ = draw(name, None, dim=300, seed=12)
    assert not torch.equal(X1, X2)
    rule = make_rule(name)
    generator = torch.Generator().manual_seed(11)
    first = rule.nodes(300, generator=generator, dtype=torch.float64)[0]
    second = rule.nodes(300, generator=generator, dtype=torch.float64)[0]
    assert torch.equal(first, X1)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("name", DETERMINISTIC_RULES)
def test_deterministic_rules_ignore_the_generator(name):
    dim = small_dim(name)
    X1, _ = draw(name, None, dim=dim, seed=11, step=3)
    X2, _ = draw(name, None, dim=dim, seed=12, step=3)
    X3, _ = make_rule(name).nodes(dim, step=3, dtype=torch.float64)
    assert torch.equal(X1, X2) and torch.equal(X1, X3)


def test_hadamard_steps_select_different_quadratures():
    X0, _ = draw("hadamard", 4, step=0)
    X1, _ = draw("hadamard", 4, step=1)
    assert not torch.equal(X0, X1)


@pytest.mark.parametrize("name", RANDOM_RULES)
@pytest.mark.parametrize("seed_fn", [torch.manual_seed, pyro.set_rng_seed])
def test_global_seed_makes_generator_none_reproducible(name, seed_fn):
    rule = make_rule(name)
    seed_fn(123)
    X1, _ = rule.nodes(300, dtype=torch.float64)
    X2, _ = rule.nodes(300, dtype=torch.float64)
    seed_fn(123)
    X3, _ = rule.nodes(300, dtype=torch.float64)
    assert torch.equal(X1, X3)
    assert not torch.equal(X1, X2)


# ------------------------------------------------------------------------- one node at a time


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("num_points", [None, 4])
def test_one_node_at_a_time_equals_the_matrix_and_nodes(name, num_points):
    rule = make_rule(name, num_points)
    dim = small_dim(name)
    for dtype in (torch.float32, torch.float64):
        node_set = rule.draw(dim, step=5, generator=torch.Generator().manual_seed(4), dtype=dtype)
        X, w = rule.nodes(dim, step=5, generator=torch.Generator().manual_seed(4), dtype=dtype)
        matrix = node_set.matrix()
        assert len(node_set) == rule.num_nodes(dim) == X.shape[0]
        for k in range(len(node_set)):
            node = node_set.node(k)
            assert node.shape == (dim,) and node.dtype == dtype
            assert torch.equal(node, matrix[k]) and torch.equal(node, X[k])
        assert torch.equal(node_set.weights, w)
        with pytest.raises(IndexError, match="out of range"):
            node_set.node(len(node_set))


@pytest.mark.parametrize("name", list(RULES))
def test_requested_dtype_is_returned(name):
    rule = make_rule(name)
    dim = small_dim(name)
    results = {}
    for dtype in (torch.float32, torch.float64):
        X, w = rule.nodes(dim, generator=torch.Generator().manual_seed(0), dtype=dtype)
        assert X.dtype == dtype and w.dtype == dtype
        results[dtype] = X
    X, w = rule.nodes(dim, generator=torch.Generator().manual_seed(0))
    assert X.dtype == w.dtype == torch.get_default_dtype()
    # the same nodes, rounded: the tables (and the Monte Carlo draws) are made in float64 and cast
    assert torch.equal(results[torch.float32], results[torch.float64].float())


@pytest.mark.parametrize("name", list(RULES))
def test_node_takes_any_integer_index_and_refuses_others_naming_k(name):
    """Each rule failed its own way on ``node(1.0)`` (slice indices, manual_seed, ``&``), and
    ``mc``/``vrmc*`` refused ``node(np.int64(1))`` ("an integer is required")."""
    node_set = make_rule(name).draw(small_dim(name), generator=torch.Generator().manual_seed(0))
    assert torch.equal(node_set.node(np.int64(1)), node_set.matrix()[1])
    assert torch.equal(node_set.node(torch.tensor(1)), node_set.matrix()[1])
    for bad, shown in [(1.0, "1.0 (float)"), (True, "True (bool)"), ("1", "'1' (str)")]:
        with pytest.raises(ValueError) as error:
            node_set.node(bad)
        assert str(error.value) == f"{name}: node index k must be an int, got {shown}"


@pytest.mark.parametrize("name", ["rasp_simplex", "rasp_cross"])
def test_rasp_one_node_at_a_time_across_gather_chunks(name):
    """node(k) gathers 2^20 coordinates per pass: check a dimension just past two chunks."""
    dim = 2 * 2**20 + 17
    node_set = make_rule(name).draw(dim, generator=torch.Generator().manual_seed(0))
    table = node_set.table  # (2r, K): row j holds signed reference dimension j of every node
    index = node_set.index.long()
    for k in range(len(node_set)):
        assert torch.equal(node_set.node(k), table[index, k])


@pytest.mark.parametrize("dim", [1, 7, 300, 301])
def test_blocked_signs_are_one_byte_per_block_and_multiply_the_unsigned_nodes(dim):
    """``blocked_simplex`` with ``random_signs=True`` draws the unsigned rule's permutations, then
    one int8 sign per block: from the same generator state its nodes are the unsigned nodes times
    the block's sign, and its table (``r K`` float64) is the unsigned rule's (the default)."""
    signed, unsigned = (
        make_rule("blocked_simplex", random_signs=True),
        make_rule("blocked_simplex"),
    )
    assert signed.random_signs and not unsigned.random_signs
    assert repr(unsigned) == "BlockedSimplexRule(num_points=3, random_signs=False)"
    assert signed.table_bytes() == unsigned.table_bytes() == 2 * 3 * 8
    node_set = signed.draw(dim, generator=torch.Generator().manual_seed(3))
    blocks = -(-dim // 2)
    assert node_set.signs.dtype == torch.int8 and node_set.signs.shape == (blocks,)
    assert set(node_set.signs.tolist()) <= {-1, 1}
    assert node_set.perms.dtype == torch.int8 and node_set.perms.shape == (blocks, 3)
    assert unsigned.draw(dim).signs is None
    X, _ = signed.nodes(dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    U, _ = unsigned.nodes(dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    per_coordinate = node_set.signs.double().repeat_interleave(2)[:dim]
    assert torch.equal(X, U * per_coordinate)
    if dim == 301:
        assert (per_coordinate == 1).any() and (per_coordinate == -1).any()


def test_unsigned_blocked_draws_are_the_rules_draws_before_the_signs():
    """The default (``random_signs=False``) is bit for bit the rule as it drew before the signs
    (the checksum tests/test_meta_device.py pins: dim 10, step 2, seed 3, sum of X * sin(1..K dim),
    and the generator's next randint(0, 1000)); the signed rule draws others."""
    sums = {}
    for random_signs in (False, True):
        rule = make_rule("blocked_simplex", random_signs=random_signs)
        generator = torch.Generator().manual_seed(3)
        X = rule.draw(10, step=2, generator=generator, dtype=torch.float64).matrix()
        weights = torch.arange(1, X.numel() + 1, dtype=torch.float64).reshape(X.shape).sin()
        sums[random_signs] = (
            round(float((X * weights).sum()), 12),
            int(torch.randint(0, 1000, (), generator=generator)),
        )
    assert sums[False] == (0.827099233154, 149)
    assert sums[True] == (-5.319912799538, 356)
    assert not make_rule("blocked_simplex").random_signs


def test_blocked_random_signs_must_be_a_bool():
    with pytest.raises(ValueError, match="blocked_simplex: random_signs must be True or False"):
        make_rule("blocked_simplex", random_signs=1)


def test_rasp_state_is_one_byte_per_coordinate():
    for name in ("rasp_simplex", "rasp_cross"):
        node_set = make_rule(name).draw(1000, generator=torch.Generator().manual_seed(0))
        assert node_set.index.dtype == torch.int8 and node_set.index.shape == (1000,)


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "name, num_points, message",
    [
        ("rasp_simplex", 1, "rasp_simplex needs num_points >= 2"),
        ("rasp_simplex", 0, "num_points >= 2"),
        ("rasp_cross", 5, "rasp_cross needs an even num_points >= 2"),
        ("rasp_cross", 0, "even num_points >= 2"),
        ("hadamard", 3, "hadamard needs an even num_points >= 2"),
        ("hadamard", 0, "even num_points >= 2"),
        ("blocked_simplex", 1, "blocked_simplex needs num_points >= 2"),
        ("gauss_hermite", 0, "gauss_hermite needs num_points >= 1"),
        ("mc", 0, "mc needs num_points >= 1"),
        ("vrmc1", 1, "vrmc1 needs num_points >= 2"),
        ("vrmc2", 1, "vrmc2 needs num_points >= 2"),
        ("hadamard", 4.0, "num_points must be an int"),
        ("hadamard", True, "num_points must be an int"),
    ],
)
def test_bad_num_points_raise(name, num_points, message):
    with pytest.raises(ValueError, match=message):
        make_rule(name, num_points)


def test_unknown_rule_lists_the_choices():
    with pytest.raises(
        ValueError,
        match=r"unknown quadrature rule 'simplex'; choose one of .*"
        r"'hadamard'.*'rasp_simplex'",
    ):
        make_rule("simplex")


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("rasp_simplex", {"reference": "cross"}, r"rule 'rasp_simplex' fixes \['reference'\]"),
        ("vrmc1", {"moments": 2}, r"rule 'vrmc1' fixes \['moments'\]"),
        ("hadamard", {"max_nodes": 10}, r"invalid options \['max_nodes'\] for rule 'hadamard'"),
    ],
)
def test_fixed_or_unknown_options_raise(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_rule(name, **options)


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("dim", [0, -3, 2.5, True, "10"])
def test_bad_dim_raises(name, dim):
    with pytest.raises(ValueError, match="dim must be an integer >= 1"):
        make_rule(name).nodes(dim)


def test_gauss_hermite_refuses_large_grids():
    with pytest.raises(ValueError, match=r"3\^20 = 3486784401 nodes, more than max_nodes=1048576"):
        make_rule("gauss_hermite").nodes(20)
    rule = make_rule("gauss_hermite", 2, max_nodes=16)
    assert rule.nodes(4)[0].shape == (16, 4)
    with pytest.raises(ValueError, match="raise max_nodes, or a sigma-point rule"):
        rule.nodes(5)


def test_hadamard_refuses_negative_steps_and_too_many_coordinates():
    rule = make_rule("hadamard")
    with pytest.raises(ValueError, match="step must be >= 0"):
        rule.nodes(10, step=-1)
    with pytest.raises(ValueError, match=r"hadamard supports dim <= 2\^31"):
        rule.draw(2**31 + 1)


def test_vrmc2_matches_the_variance_even_where_the_draws_nearly_coincide():
    """With K = 2 some of 200 000 coordinates have two draws within 1e-4 of each other; the
    streaming variance must still scale them to an exact second moment (and never to inf)."""
    rule = make_rule("vrmc2", 2)
    for dtype, tolerance in [(torch.float64, 1e-9), (torch.float32, 1e-6)]:
        node_set = rule.draw(200_000, generator=torch.Generator().manual_seed(0), dtype=dtype)
        X = torch.stack([node_set.node(k) for k in range(2)])  # the one-node-at-a-time path
        assert torch.isfinite(X).all()
        assert (node_set.weights @ X).abs().max().item() < tolerance
        assert (node_set.weights @ X**2 - 1).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_vrmc2_in_half_precision_keeps_its_exact_coordinate_quadratics(dtype):
    """The draws are standardized in float64 and only the nodes rounded: standardized in the half
    dtype, nearly equal draws cancelled (K = 2: 101 of 1e5 bfloat16 coordinates had both nodes at
    0, a second moment of 0; K = 3: off by 0.37 in bfloat16, 0.13 in float16)."""
    generator = torch.Generator().manual_seed(0)
    X, _ = make_rule("vrmc2", 2).nodes(50_000, generator=generator, dtype=dtype)
    assert torch.equal(X.abs(), torch.ones_like(X)) and torch.equal(X[0], -X[1])  # +-1: exact
    X, w = make_rule("vrmc2", 3).nodes(50_000, generator=generator, dtype=dtype)
    second = w.double() @ X.double() ** 2
    # the rounding of the nodes alone: measured 1.0e-3 (float16), 8.1e-3 (bfloat16) at 1e5
    assert (second - 1).abs().max().item() < {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def test_monte_carlo_nodes_are_the_float64_nodes_rounded_to_the_dtype():
    """One generator state gives one set of nodes, rounded to each dtype (the draws were made in
    the dtype: float32's differed from float64's by up to 3.6); float64's stay those drawn before
    (bit for bit, checked against values from before the change)."""
    before = {
        "mc": ["0x1.b5c830bc36b6fp-1", "-0x1.39e321814bd67p-1", "0x1.f1f674fb3ca2dp-1"],
        "vrmc1": ["0x1.7d676806b17eep-1", "0x1.dcc77617d799cp-3", "0x1.4b9fad20ca114p-1"],
        "vrmc2": ["0x1.87576ae6d98e4p-1", "0x1.5c9823390649fp+0", "0x1.695fa87554029p+0"],
    }
    for name, expected in before.items():
        rule = make_rule(name, 3)
        X64 = rule.nodes(40, generator=torch.Generator().manual_seed(7), dtype=torch.float64)[0]
        assert [X64[k, i].item().hex() for k, i in [(0, 0), (1, 17), (2, 39)]] == expected
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            X = rule.nodes(40, generator=torch.Generator().manual_seed(7), dtype=dtype)[0]
            assert torch.equal(X, X64.to(dtype)), (name, dtype)


@pytest.mark.parametrize("dim", [1, 151, 4096, 65537, 478410])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_hadamard_nodes_from_the_sign_table_are_the_definition(dim, dtype):
    """The node matrix and single nodes, read from the table of parities, are the signs of
    `hadamard_signs` (nodes ``2j, 2j + 1`` are ``+-`` iterate ``step * K/2 + j``), bit for bit,
    at steps whose iterates set high bits too (``2^31 - 1`` wraps to 0); the table has the
    power of two entries the first 16 index bits need (256 at ``dim = 151``), and no more."""
    from pyro_quadvi.quadrature import hadamard

    hadamard._SIGN_TABLES.pop((dtype, torch.device("cpu")), None)  # built by this draw
    rule = make_rule("hadamard", 6)
    index = torch.arange(dim)
    for step in (0, 1, 7, 12345, 715827882):  # 715827882 * 3 + 2 = 2^31 + 0: wraps
        nodes = rule.draw(dim, step=step, dtype=dtype)
        expected = torch.stack(
            [
                sign * hadamard.hadamard_signs(index, step * 3 + j, dtype)
                for j in range(3)
                for sign in (1, -1)
            ]
        )
        assert torch.equal(nodes.matrix(), expected), step
        assert torch.equal(nodes.node(3), expected[3])
    table_index, table = hadamard._SIGN_TABLES[(dtype, torch.device("cpu"))]
    assert table.numel() == table_index.numel() == min(1 << (dim - 1).bit_length(), 1 << 16)
    assert table.dtype == dtype
    assert torch.equal(table, hadamard.hadamard_signs(table_index, table.numel() - 1, dtype))
