"""Gauss-Hermite nodes and weights, orthonormal Hermite polynomials, the tensor rule, and the
quadratic exactness counter."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from numpy.polynomial.hermite_e import hermegauss, hermeval

from pyro_quadvi.quadrature import (
    gauss_hermite,
    make_rule,
    orthonormal_hermite,
    quadratic_exactness,
)


def normal_moment(p: int) -> float:
    return 0.0 if p % 2 else float(math.prod(range(p - 1, 0, -2)))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 12, 20, 40, 60, 100])
def test_gauss_hermite_matches_numpy(m):
    nodes, weights = gauss_hermite(m)
    expected_nodes, expected_weights = hermegauss(m)
    expected_weights = expected_weights / math.sqrt(2 * math.pi)  # numpy's weight is exp(-x^2/2)
    assert nodes.dtype == weights.dtype == torch.float64
    np.testing.assert_allclose(nodes.numpy(), expected_nodes, rtol=0, atol=1e-13)
    # relative accuracy of every weight, down to the smallest (about 1e-180 for m = 100)
    np.testing.assert_allclose(weights.numpy(), expected_weights, rtol=1e-12, atol=0)
    assert weights.sum().item() == pytest.approx(1.0, abs=1e-15)
    # exactly symmetric about 0
    assert torch.equal(nodes, -nodes.flip(0)) and torch.equal(weights, weights.flip(0))


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_gauss_hermite_is_exact_to_degree_2m_minus_1_only(m):
    nodes, weights = gauss_hermite(m)
    for p in range(2 * m + 1):
        value = (weights * nodes**p).sum().item()
        scale = (weights * nodes.abs() ** p).sum().item()  # the size of the rounding errors
        if p <= 2 * m - 1:
            assert abs(value - normal_moment(p)) <= 1e-13 * scale, p
        else:
            assert abs(value - normal_moment(p)) > 1e-6 * normal_moment(p)


def test_gauss_hermite_dtype_and_bad_size():
    nodes, weights = gauss_hermite(5, dtype=torch.float32)
    assert nodes.dtype == weights.dtype == torch.float32
    with pytest.raises(ValueError, match="num_points >= 1"):
        gauss_hermite(0)


@pytest.mark.parametrize("m", [5, 20, 60])
def test_orthonormal_hermite_is_orthonormal_under_gauss_hermite(m):
    nodes, weights = gauss_hermite(m)
    psi = orthonormal_hermite(nodes, m - 1)  # products have degree <= 2m - 2: integrated exactly
    assert psi.shape == (m, m)
    gram = psi.T @ (weights[:, None] * psi)
    assert (gram - torch.eye(m, dtype=torch.float64)).abs().max().item() < 1e-13


def test_orthonormal_hermite_equals_scaled_probabilists_hermite():
    x = torch.linspace(-4, 4, 41, dtype=torch.float64).reshape(41, 1)
    degree = 12
    psi = orthonormal_hermite(x, degree)
    assert psi.shape == (41, 1, degree + 1)
    for n in range(degree + 1):
        coefficients = np.zeros(n + 1)
        coefficients[n] = 1.0
        expected = hermeval(x.numpy(), coefficients) / math.sqrt(math.factorial(n))
        np.testing.assert_allclose(psi[..., n].numpy(), expected, rtol=1e-12, atol=1e-12)
    assert orthonormal_hermite(x, 0).shape == (41, 1, 1)
    with pytest.raises(ValueError, match="degree must be >= 0"):
        orthonormal_hermite(x, -1)


@pytest.mark.parametrize("m, dim", [(1, 3), (2, 3), (3, 3), (4, 2), (5, 3)])
def test_tensor_gauss_hermite_is_exact_to_degree_2m_minus_1_per_coordinate(m, dim):
    X, w = make_rule("gauss_hermite", m).nodes(dim, dtype=torch.float64)
    assert X.shape == (m**dim, dim)
    assert w.sum().item() == pytest.approx(1.0, abs=1e-14)
    # every monomial with each exponent <= 2m - 1, and random combinations of them
    exponents = torch.tensor(list(itertools.product(range(2 * m), repeat=dim)))
    values = w @ (X[:, None, :] ** exponents[None]).prod(dim=-1)
    scale = w @ (X[:, None, :].abs() ** exponents[None]).prod(dim=-1)
    exact = torch.tensor(
        [math.prod(normal_moment(int(p)) for p in e) for e in exponents], dtype=torch.float64
    )
    assert ((values - exact).abs() <= 1e-13 * scale).all()
    coefficients = torch.randn(
        len(exponents), generator=torch.Generator().manual_seed(m), dtype=torch.float64
    )
    error = (coefficients @ values - coefficients @ exact).abs().item()
    assert error <= 1e-13 * (coefficients.abs() @ scale).item()
    # but x_i^(2m) is not exact in any coordinate
    even = w @ X ** (2 * m)
    assert ((even - normal_moment(2 * m)).abs() > 0.1).all()


def test_tensor_gauss_hermite_node_order_and_weights():
    """Node k has base-m digits k = sum_i a_i m^(dim - 1 - i) and weight prod_i w_{a_i}."""
    m, dim = 3, 4
    points, point_weights = gauss_hermite(m)
    X, w = make_rule("gauss_hermite", m).nodes(dim, dtype=torch.float64)
    for k, digits in enumerate(itertools.product(range(m), repeat=dim)):
        assert torch.equal(X[k], points[list(digits)])
        assert w[k].item() == pytest.approx(
            math.prod(point_weights[a].item() for a in digits), rel=1e-14
        )


def test_quadratic_exactness_counts_a_hand_made_quadrature():
    # d = 3: two nodes of weight 1/2
    X = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    counted = quadratic_exactness(X, w)
    # constant exact; means 0, 0, 1 -> 2 exact; squares all 1 -> 3; cross x0x1 = 1, x0x2 = 0,
    # x1x2 = 0 -> 2 exact
    assert (counted.constant, counted.linear, counted.square, counted.cross) == (1, 2, 3, 2)
    assert counted.total == 8 and counted.num_basis == 1 + 2 * 3 + 3
    assert counted.fraction == pytest.approx(0.8)
    assert counted.cross_fraction == pytest.approx(2 / 3)
    # weights that do not sum to 1 lose the constant; a tolerance decides near misses
    counted = quadratic_exactness(X, torch.tensor([0.5, 0.6], dtype=torch.float64))
    assert counted.constant == 0 and counted.cross == 0
    near = X.clone()
    near[0, 2] += 1e-6
    assert quadratic_exactness(near, w).square == 2
    assert quadratic_exactness(near, w, atol=1e-5).square == 3


@pytest.mark.parametrize("name", ["rasp_simplex", "rasp_cross", "blocked_simplex", "vrmc2"])
def test_quadratic_exactness_of_float32_nodes_counts_what_float64_counts(name):
    # the default tolerance follows the nodes' dtype: float32 rounding (about 1e-7 on these
    # sums) is not inexactness (a fixed 1e-9 counted every float32 term of rasp_simplex inexact)
    generator = torch.Generator().manual_seed(0)
    X, w = make_rule(name).nodes(64, dtype=torch.float64, generator=generator)
    exact = quadratic_exactness(X, w)
    assert quadratic_exactness(X.float(), w.float()) == exact
    assert exact.constant == 1 and exact.linear == 64 and exact.square == 64


def test_quadratic_exactness_refuses_half_precision_and_counts_integer_nodes():
    # 100 ulps of bfloat16 (0.78) counted plainly wrong moments exact; integers raised in finfo
    X = torch.tensor([[1, 1], [-1, -1]])
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    counted = quadratic_exactness(X, w)
    assert (counted.constant, counted.linear, counted.square, counted.cross) == (1, 2, 2, 0)
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match=f"{dtype} rounds a moment"):
            quadratic_exactness(X.to(dtype), w)


def test_quadratic_exactness_of_one_dimension_has_no_pairs():
    X = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    counted = quadratic_exactness(X, torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert counted.cross == 0 and counted.cross_fraction == 1.0 and counted.fraction == 1.0


def test_too_many_nodes_is_refused_with_a_readable_count_at_any_dim():
    # m^dim of a large dim was printed in full: 2,385 digits at d = 5000, and at d = 100000
    # Python's own "Exceeds the limit (4300 digits)" error instead of the rule's
    rule = make_rule("gauss_hermite", 2)
    with pytest.raises(ValueError, match=r"needs 2\^21 = 2097152 nodes, more than max_nodes"):
        rule.nodes(21)
    with pytest.raises(ValueError, match=r"needs 2\^100000 = about 10\^30103 nodes, more than"):
        rule.nodes(100_000)
    assert rule.nodes(3, dtype=torch.float64)[0].shape == (8, 3)
    # max_nodes is checked when the rule is made (0 gave a math domain error at a large dim)
    for bad in (0, math.inf, 2.5, "1"):
        with pytest.raises(ValueError, match="max_nodes must be an integer >= 1"):
            make_rule("gauss_hermite", 2, max_nodes=bad)
