"""Session 14: the default rule's nodes made cheaper, bit for bit.

``blocked_simplex`` (the default of ``QuadratureELBO()``) orders each block's random keys by
pairwise comparisons into one code per block and gathers its nodes from a table of every
permutation; it used ``argsort`` per block and a gather by the permutations. The old code is kept
here (:func:`old_blocked`) as the reference: the same ``torch.rand`` calls on the same generator
must give the same nodes, ties between keys included. RASP's matrix and Hadamard's matrix are
checked against their definitions (rasp paper eq. 13; sequence paper Algorithm 3.1).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pyro_quadvi.quadrature import make_rule
from pyro_quadvi.quadrature.hadamard import hadamard_signs
from pyro_quadvi.quadrature.rasp import (
    _GATHER_CHUNK,
    BlockedSimplexRule,
    _block_codes,
    simplex_reference,
)


def old_blocked(num_points, random_signs, dim, generator, dtype):
    """The blocked rule as it drew before session 14: keys argsorted per block (a chunk of
    ``_GATHER_CHUNK`` blocks per ``torch.rand`` call), nodes gathered by the permutations and
    multiplied by the int8 signs. Returns the ``(K, dim)`` matrix and the permutations."""
    r = num_points - 1
    num_blocks = -(-dim // r)
    perms = torch.cat(
        [
            torch.rand(min(_GATHER_CHUNK, num_blocks - start), num_points, generator=generator)
            .argsort(dim=1)
            .to(torch.int8)
            for start in range(0, num_blocks, _GATHER_CHUNK)
        ]
    )
    blocks = simplex_reference(r).to(dtype).T[perms.T.long()]  # (K, num_blocks, r)
    if random_signs:
        signs = torch.randint(0, 2, (num_blocks,), generator=generator, dtype=torch.int8)
        blocks.mul_(signs.mul_(2).sub_(1)[None, :, None])
    return blocks.reshape(num_points, -1)[:, :dim], perms


def assert_same_as_old(num_points, random_signs, dim, seed, dtype=torch.float32):
    rule = BlockedSimplexRule(num_points, random_signs=random_signs)
    new_generator = torch.Generator().manual_seed(seed)
    nodes = rule.draw(dim, step=2, generator=new_generator, dtype=dtype)
    old_generator = torch.Generator().manual_seed(seed)
    expected, perms = old_blocked(num_points, random_signs, dim, old_generator, dtype)
    matrix = nodes.matrix()
    assert matrix.dtype == dtype and matrix.shape == (num_points, dim)
    assert torch.equal(matrix, expected)
    for k in range(num_points):
        assert torch.equal(nodes.node(k), expected[k])
    assert torch.equal(nodes.perms, perms)
    # the generator is left where the old draws left it
    assert torch.equal(
        torch.rand(3, generator=new_generator), torch.rand(3, generator=old_generator)
    )
    return perms


def dims_for(num_points):
    r = num_points - 1
    return [1, r, r + 1, 7, 301, 2 * r + 1]


@pytest.mark.parametrize("random_signs", [False, True])
@pytest.mark.parametrize("num_points", [2, 3, 4, 6, 7])
def test_blocked_draws_equal_the_old_code(num_points, random_signs):
    """Several seeds and dims (1, r, r + 1, odd sizes); K = 7 takes the argsort path."""
    for dim, seed in itertools.product(dims_for(num_points), [0, 1, 5]):
        assert_same_as_old(num_points, random_signs, dim, seed)
    assert_same_as_old(num_points, random_signs, 301, 3, dtype=torch.float64)
    assert_same_as_old(num_points, random_signs, 301, 4, dtype=torch.float16)


@pytest.mark.parametrize("num_points", [2, 3, 4, 6])
def test_blocked_draws_equal_the_old_code_at_a_million(num_points):
    assert_same_as_old(num_points, num_points % 2 == 0, 10**6 + 1, 11)


@pytest.mark.parametrize(
    ("num_points", "dim"), [(2, _GATHER_CHUNK + 5), (3, 2 * _GATHER_CHUNK + 3)]
)
def test_blocked_draws_equal_the_old_code_across_chunks(num_points, dim):
    """Past one chunk of 2^20 blocks: one ``torch.rand`` call per chunk, as before."""
    assert_same_as_old(num_points, True, dim, 7)


@pytest.mark.parametrize("random_signs", [False, True])
@pytest.mark.parametrize("num_points", [2, 3, 4, 6, 7])
def test_blocked_draws_equal_the_old_code_with_forced_ties(num_points, random_signs, monkeypatch):
    """Keys rounded down to {0, 1, 2}: most blocks hold tied keys, which argsort orders by index
    on the CPU and the codes the same way."""
    rand = torch.rand

    def coarse_rand(*args, **kwargs):
        return rand(*args, **kwargs).mul_(3).floor_()

    monkeypatch.setattr(torch, "rand", coarse_rand)
    for dim, seed in itertools.product([1, 2 * num_points + 1, 3001], [0, 1]):
        perms = assert_same_as_old(num_points, random_signs, dim, seed)
    generator = torch.Generator().manual_seed(1)
    keys = coarse_rand(perms.shape[0], num_points, generator=generator)
    tied = (keys[:, :, None] == keys[:, None, :]).sum(dim=(1, 2)) > num_points
    assert tied.float().mean() > 0.2  # the last check above did see ties


@pytest.mark.parametrize("num_points", [2, 3, 4, 5, 6])
def test_codes_order_every_tie_pattern_as_cpu_argsort(num_points):
    """All ``K^K`` rows of keys from ``{0, .., K-1}`` (every weak order of K keys): the code's
    permutation is torch's CPU ``argsort`` (which here equals ``stable=True``, ties by index),
    and the ranks' codes (used off the CPU, where argsort orders ties its own way) agree."""
    keys = torch.tensor(list(itertools.product(range(num_points), repeat=num_points)))
    keys = keys.float()
    rule = BlockedSimplexRule(num_points)
    codes = _block_codes(keys, torch.empty(keys.shape[0], dtype=torch.int64))
    expected = keys.argsort(dim=1)
    assert torch.equal(expected, keys.argsort(dim=1, stable=True))
    assert torch.equal(rule._perm_table[codes].long(), expected)
    ranks = expected.argsort(dim=1)
    assert torch.equal(_block_codes(ranks, torch.empty_like(codes)), codes)
    # the codes of the K! orders are 0 .. K! - 1, each once
    perms = torch.tensor(list(itertools.permutations(range(num_points))))
    all_codes = _block_codes(perms, torch.empty(perms.shape[0], dtype=torch.int64))
    assert torch.equal(all_codes.sort().values, torch.arange(perms.shape[0]))


def test_signed_codes_give_the_signs_and_the_state_is_one_small_integer_per_block():
    nodes = BlockedSimplexRule(3, random_signs=True).draw(
        10**4 + 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    assert nodes.code.dtype == torch.int8 and nodes.code.shape == (5001,)
    assert int(nodes.code.min()) >= 0 and int(nodes.code.max()) < 12
    assert torch.equal(nodes.signs, torch.where(nodes.code >= 6, -1, 1).to(torch.int8))
    X = nodes.matrix()
    unsigned = make_rule("blocked_simplex").draw(
        10**4 + 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    assert torch.equal(X, unsigned.matrix() * nodes.signs.double().repeat_interleave(2)[:-1])
    assert BlockedSimplexRule(6, random_signs=True).draw(30).code.dtype == torch.int16


@pytest.mark.parametrize("name", ["rasp_simplex", "rasp_cross"])
@pytest.mark.parametrize("dim", [1, 5, 2 * _GATHER_CHUNK + 17])
def test_rasp_matrix_is_the_gather_of_eq_13(name, dim):
    """``X[k, i] = S[j_i, k]`` (rasp paper, eq. 13), as the old advanced indexing built it."""
    nodes = make_rule(name, 4).draw(dim, generator=torch.Generator().manual_seed(0))
    expected = nodes.table.T[:, nodes.index.long()]
    assert torch.equal(nodes.matrix(), expected)
    for k in range(len(nodes)):
        assert torch.equal(nodes.node(k), expected[k])


@pytest.mark.parametrize("dim", [1, 3, 65535, 65537, 3 * 65536 + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_hadamard_matrix_is_algorithm_3_1(dim, dtype):
    """Rows ``2j, 2j + 1`` are ``+-(-1)^parity(i AND q)`` for ``q = step K/2 + j`` (sequence
    paper, Algorithm 3.1), written straight into the matrix."""
    rule = make_rule("hadamard", 6)
    nodes = rule.draw(dim, step=1000, dtype=dtype)
    index = torch.arange(dim, dtype=torch.int32)
    signs = torch.stack([hadamard_signs(index, 3000 + j, dtype=dtype) for j in range(3)])
    expected = torch.stack([signs, -signs], dim=1).reshape(6, dim)
    assert torch.equal(nodes.matrix(), expected)
    for k in range(6):
        node = nodes.node(k)
        assert node.is_contiguous() and torch.equal(node, expected[k])
