"""What a rule refuses (issue 10, faults 6 and 7): too few points to fit the scales of a mean
field, and arrays larger than ``max_bytes``, refused before they are allocated."""

from __future__ import annotations

import re
import time

import pytest
import torch

from pyro_quadvi import QuadratureELBO
from pyro_quadvi.quadrature import (
    DEFAULT_MAX_BYTES,
    RULES,
    NodeSet,
    QuadratureRule,
    make_rule,
)
from pyro_quadvi.quadrature.base import equal_weights

# ------------------------------------------------------------- fault 6: rules that cannot fit


@pytest.mark.parametrize("name", ["gauss_hermite", "mc"])
def test_one_point_cannot_fit_and_the_error_names_the_minimum(name):
    rule = make_rule(name, 1)  # a valid quadrature (OPQA uses one Gauss-Hermite point) ...
    with pytest.raises(ValueError) as error:  # ... but not a rule to fit with
        rule.check_sees_curvature()
    assert str(error.value) == (
        f"{name} with num_points=1 cannot fit the scales of a mean field: it needs "
        "num_points >= 2 (with fewer, every node sits at the mean along some coordinate, or "
        "there is only one node, so the scales see no curvature and stay at their initial value)"
    )


def test_one_gauss_hermite_point_sees_no_curvature():
    """The fault itself: the Stein estimate of the curvature of ``x^2 / 2`` (exactly 1) is
    ``sum_k w_k x_k f'(x_k) = sum_k w_k x_k^2``: 0 with one point, 1 with two."""
    for m, curvature in [(1, 0.0), (2, 1.0)]:
        X, w = make_rule("gauss_hermite", m).nodes(3, dtype=torch.float64)
        assert (w @ X**2).tolist() == pytest.approx([curvature] * 3, abs=1e-14)


@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_sees_curvature_at_its_default_and_at_two_points(name):
    for num_points in (None, 2):
        rule = make_rule(name, num_points)
        assert rule.min_curvature_points == 2
        X, _ = rule.nodes(3 if name == "gauss_hermite" else 50, dtype=torch.float64)
        rule.check_sees_curvature(X)  # no error


class _BlindRule(QuadratureRule):
    """A third-party rule whose nodes all sit at the mean along coordinate 1."""

    name = "blind"

    def draw(self, dim, step=0, generator=None, dtype=None, device=None) -> NodeSet:
        return _BlindNodes(dim, equal_weights(self.num_points, dtype, device))


class _BlindNodes(NodeSet):
    def node(self, k: int) -> torch.Tensor:
        x = torch.full((self.dim,), 1.0 if k % 2 else -1.0, dtype=self.dtype)
        x[1] = 0.0
        return x


def test_a_rule_blind_along_one_coordinate_is_refused_by_its_nodes():
    rule = _BlindRule(2)
    rule.check_sees_curvature()  # num_points alone does not tell
    with pytest.raises(ValueError) as error:
        rule.check_sees_curvature(rule.nodes(4)[0])
    assert str(error.value) == (
        "blind: every node has x = 0 along coordinate 1 (1 such coordinates), so its scale sees "
        "no curvature and would stay at its initial value"
    )


def test_a_single_node_is_refused():
    rule = _BlindRule(2)
    with pytest.raises(ValueError, match=r"^blind has 1 node\(s\): a fit needs at least 2 to see"):
        rule.check_sees_curvature(torch.ones(1, 4))


@pytest.mark.parametrize(
    "nodes, got",
    [
        (torch.ones(4), "a tensor of shape (4,) and dtype torch.float32"),
        (torch.ones(2, 3, dtype=torch.int64), "a tensor of shape (2, 3) and dtype torch.int64"),
        ([[1.0, -1.0], [-1.0, 1.0]], "a list"),
    ],
)
def test_check_sees_curvature_refuses_nodes_that_are_not_a_k_by_dim_tensor(nodes, got):
    """A 1-D tensor passed unchecked (no curvature check at all), a list failed with an
    AttributeError ('list' object has no attribute 'shape')."""
    with pytest.raises(ValueError) as error:
        make_rule("hadamard").check_sees_curvature(nodes)
    assert str(error.value) == (
        "hadamard: check_sees_curvature needs nodes as a floating (K, dim) tensor "
        f"(rule.nodes(dim)[0]), got {got}"
    )


# ------------------------------------------------------------- fault 7: memory, before allocating


def test_rasp_with_20000_points_is_refused_at_construction_naming_the_memory():
    start = time.perf_counter()
    with pytest.raises(ValueError) as error:
        make_rule("rasp_simplex", 20000)
    assert time.perf_counter() - start < 1.0  # not 13 s of allocation first
    assert str(error.value) == (
        "rasp_simplex with num_points=20000 needs reference tables of 3 r K float64 entries "
        "(r = 19999, K = 20000): 3 * 19999 * 20000 * 8 = 9599520000 bytes (8.94 GiB) at "
        "construction, more than max_bytes=1073741824 bytes (1 GiB); use fewer points, or pass "
        "a larger max_bytes"
    )


def test_quadrature_elbo_refuses_it_when_built():
    with pytest.raises(ValueError, match=re.escape("9599520000 bytes (8.94 GiB) at construction")):
        QuadratureELBO("rasp_simplex", num_points=20000)


@pytest.mark.parametrize(
    "name, num_points, table_bytes",
    [
        ("rasp_simplex", 100, 3 * 99 * 100 * 8),
        ("rasp_cross", 100, 3 * 50 * 100 * 8),
        ("blocked_simplex", 100, 99 * 100 * 8),
    ],
)
def test_tables_up_to_max_bytes_are_built_and_one_byte_more_is_refused(
    name, num_points, table_bytes
):
    rule = make_rule(name, num_points, max_bytes=table_bytes)
    assert rule.table_bytes() == table_bytes
    assert rule.nodes(10)[0].shape == (num_points, 10)
    with pytest.raises(ValueError, match=f"= {table_bytes} bytes .* at construction"):
        make_rule(name, num_points, max_bytes=table_bytes - 1)


@pytest.mark.parametrize("name", list(RULES))
def test_the_node_matrix_is_refused_before_allocating_but_single_nodes_are_not(name):
    dim = 3 if name == "gauss_hermite" else 32
    probe = make_rule(name)
    num = probe.num_nodes(dim)
    needed = num * dim * 8
    assert make_rule(name, max_bytes=needed).nodes(dim, dtype=torch.float64)[0].shape == (num, dim)
    rule = make_rule(name, max_bytes=needed - 1)
    with pytest.raises(ValueError) as error:
        rule.nodes(dim, dtype=torch.float64)
    assert str(error.value).startswith(
        f"the {num} x {dim} node matrix of {name} needs K * dim * itemsize = {num} * {dim} * 8 = "
        f"{needed} bytes ({needed / 2**30:.3g} GiB), more than max_bytes={needed - 1} bytes "
    )
    assert str(error.value).endswith(
        "use fewer nodes, produce them one at a time with draw(...).node(k), "
        "or pass a larger max_bytes to the rule"
    )
    nodes = rule.draw(dim, dtype=torch.float64)  # the compact path needs O(dim) per node
    assert nodes.node(num - 1).shape == (dim,)


def test_default_limit_and_bad_values():
    assert DEFAULT_MAX_BYTES == 2**30
    assert make_rule("hadamard").max_bytes == 2**30
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=f"max_bytes must be an integer >= 1, got {bad!r}"):
            make_rule("hadamard", max_bytes=bad)


def test_vrmc_refuses_a_large_matrix_before_matching_its_moments(monkeypatch):
    # vrmc2 took the K draws' mean and spread when drawn, an O(K dim) pass: at dim = 1e8 it spent
    # 5 to 7 s before matrix() refused the 1.2 GB matrix; the moments now wait for a node
    from pyro_quadvi.quadrature import montecarlo

    def match(self):
        raise AssertionError("moments taken before the check")

    monkeypatch.setattr(montecarlo._MonteCarloNodes, "_match_moments", match)
    with pytest.raises(ValueError, match=r"the 3 x 100000000 node matrix of vrmc2 needs"):
        make_rule("vrmc2").nodes(10**8)


def test_vrmc_moments_interrupted_are_taken_again_whole(monkeypatch):
    # the moments were marked taken before they were: an error in that pass left later nodes
    # unmatched (their weighted mean no longer 0)
    from pyro_quadvi.quadrature import montecarlo

    generator = torch.Generator().manual_seed(0)
    nodes = make_rule("vrmc2").draw(5, generator=generator, dtype=torch.float64)
    expected = make_rule("vrmc2").draw(
        5, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    raw, calls = montecarlo._MonteCarloNodes._raw, []

    def failing_once(self, k):
        calls.append(k)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return raw(self, k)

    monkeypatch.setattr(montecarlo._MonteCarloNodes, "_raw", failing_once)
    with pytest.raises(RuntimeError, match="out of memory"):
        nodes.node(0)
    matrix = nodes.matrix()
    assert torch.equal(matrix, expected.matrix())
    assert (nodes.weights @ matrix).abs().max() < 1e-15
