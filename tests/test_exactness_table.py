"""The exactness table of the demo and of ``benchmarks/bench_exactness.py``."""

from __future__ import annotations

import pytest

from pyro_quadvi.demo import exactness_table, format_table, main


def test_exactness_table_fractions():
    dim, evaluations = 64, [2, 3, 4, 6, 8, 12]
    table = exactness_table(dim, evaluations, trials=3, seed=1)
    assert set(table) == {
        "rasp_simplex",
        "rasp_cross",
        "hadamard",
        "blocked_simplex",
        "mc",
        "vrmc1",
        "vrmc2",
    }
    pairs = dim * (dim - 1) // 2
    basis = 1 + 2 * dim + pairs
    # the pair rules do not exist for odd K
    assert 3 not in table["hadamard"] and 3 not in table["rasp_cross"]
    # Hadamard: every pair except those agreeing in the m low index bits, 2^m the largest power of
    # two dividing K/2 (Theorem 3.3): none for an odd K/2, K = 12 as K = 4
    for K, m in [(4, 1), (6, 0), (8, 2), (12, 1)]:
        group = dim >> m
        cross = 1 - 2**m * group * (group - 1) // 2 / pairs
        assert table["hadamard"][K]["cross"] == pytest.approx(cross)
        assert table["hadamard"][K]["total"] == pytest.approx((1 + 2 * dim + cross * pairs) / basis)
    # one reference dimension: no pair exact, every univariate quadratic exact
    assert table["rasp_simplex"][2] == {"cross": 0.0, "total": (1 + 2 * dim) / basis}
    # Monte Carlo: only the constant; VRMC-1 adds the means, VRMC-2 the squares
    assert table["mc"][4] == {"cross": 0.0, "total": 1 / basis}
    assert table["vrmc1"][4]["total"] == pytest.approx((1 + dim) / basis)
    assert table["vrmc2"][4]["total"] == pytest.approx((1 + 2 * dim) / basis)
    # RASP simplex with 3 evaluations: about half of the mixed terms (rasp paper, Theorem 3.2)
    assert table["rasp_simplex"][3]["cross"] == pytest.approx(0.5, abs=0.05)


def test_format_table_and_demo(capsys):
    table = {"hadamard": {2: {"cross": 0.0, "total": 0.25}, 4: {"cross": 0.5, "total": 0.625}}}
    assert format_table(table, [2, 3, 4]).splitlines() == [
        "| rule | K=2 | K=3 | K=4 |",
        "|---|---|---|---|",
        "| hadamard | 0.000 | - | 0.500 |",
    ]
    assert format_table(table, [4], key="total").splitlines()[-1] == "| hadamard | 0.625 |"
    main(["--dim", "16", "--trials", "1"])
    out = capsys.readouterr().out
    assert "| rule | K=2 |" in out and "| hadamard | 0.000 | - | 0.533 |" in out
