"""Fixes of faults users found in ``pyro_quadvi.metrics``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyro_quadvi.metrics import (
    accuracy,
    calibration_bins,
    categorical_nll,
    expected_calibration_error,
    gaussian_nll,
)

DTYPE = torch.float64
_MEAN = torch.zeros(3, 3, dtype=DTYPE)
_Y = torch.arange(9.0, dtype=DTYPE).reshape(3, 3)
_SCALE = torch.tensor([1.0, 2.0, 3.0], dtype=DTYPE)


def _by_hand(scale_of) -> float:
    """mean_i sum_d [log s + log(2 pi) / 2 + y_id^2 / (2 s^2)] with s = scale_of(i, d)."""
    total = 0.0
    for i in range(3):
        for d in range(3):
            s = scale_of(i, d)
            total += math.log(s) + 0.5 * math.log(2 * math.pi) + (3 * i + d) ** 2 / (2 * s * s)
    return total / 3


def test_a_one_dim_scale_for_a_two_dim_mean_is_refused_as_ambiguous():
    with pytest.raises(ValueError) as info:
        gaussian_nll(_MEAN, _SCALE, _Y)
    assert str(info.value) == (
        "scale of shape (3,) is ambiguous for mean of shape (3, 3): give it mean's 2 dims, "
        "(3, 1) for one scale per case, (1, 3) for one per output or (3, 3) for one per entry "
        "(e.g. scale[:, None] for one scale per case of a mean of shape (n, D)); or a scalar for "
        "one in all"
    )
    # the fixes it names give the two readings, each equal to the hand computation
    per_case = gaussian_nll(_MEAN, _SCALE[:, None], _Y).item()
    per_output = gaussian_nll(_MEAN, _SCALE[None], _Y).item()
    assert per_case == pytest.approx(_by_hand(lambda i, d: float(_SCALE[i])), abs=1e-12)
    assert per_output == pytest.approx(_by_hand(lambda i, d: float(_SCALE[d])), abs=1e-12)
    assert per_case == pytest.approx(10.224500994767999, abs=1e-12)
    assert per_output == pytest.approx(16.520797291064294, abs=1e-12)


def test_scales_that_are_not_ambiguous_are_still_taken():
    # a scalar, a 0-dim tensor, and a (n,) scale for a (n,) mean
    expected = _by_hand(lambda i, d: 2.0)
    assert gaussian_nll(_MEAN, 2.0, _Y).item() == pytest.approx(expected, abs=1e-12)
    scalar = torch.tensor(2.0, dtype=DTYPE)
    assert gaussian_nll(_MEAN, scalar, _Y).item() == pytest.approx(expected, abs=1e-12)
    one_dim = gaussian_nll(_MEAN[:, 0], _SCALE, _Y[:, 0]).item()
    hand = sum(math.log(s) + 0.5 * math.log(2 * math.pi) + (3 * i) ** 2 / (2 * s * s)
               for i, s in enumerate((1.0, 2.0, 3.0))) / 3  # fmt: skip
    assert one_dim == pytest.approx(hand, abs=1e-12)


_PROBS = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.65, 0.35]], dtype=DTYPE)
_LABELS = torch.tensor([0, 0, 1])


@pytest.mark.parametrize("num_bins", [np.int64(10), np.int32(10), torch.tensor(10)])
def test_num_bins_takes_any_integral(num_bins):
    bins = calibration_bins(_PROBS, _LABELS, num_bins=num_bins)
    # confidences 0.9, 0.8, 0.65 fall in (0.8, 0.9], (0.7, 0.8], (0.6, 0.7]
    assert bins.count.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    # |acc - conf| per case: |1 - 0.9|, |0 - 0.8|, |0 - 0.65|, each with weight 1/3
    ece = expected_calibration_error(_PROBS, _LABELS, num_bins=num_bins)
    assert ece.item() == pytest.approx((0.1 + 0.8 + 0.65) / 3, abs=1e-12)


@pytest.mark.parametrize("num_bins", [10.0, True, 0, "10", np.float64(10)])
def test_num_bins_that_are_not_positive_integers_are_refused(num_bins):
    with pytest.raises(ValueError) as info:
        calibration_bins(_PROBS, _LABELS, num_bins=num_bins)
    assert str(info.value) == f"num_bins must be a positive integer, got {num_bins!r}"


def test_probs_without_classes_are_refused_saying_so():
    with pytest.raises(ValueError) as info:
        accuracy(torch.zeros(3, 0, dtype=DTYPE), torch.zeros(3, dtype=torch.long))
    assert str(info.value) == (
        "probs has no classes (shape (3, 0)); pass one column of probabilities per class, "
        "shape (n, C)"
    )


def test_a_single_column_of_binary_probabilities_gets_the_two_column_hint():
    p = torch.tensor([[0.3], [0.9]], dtype=DTYPE)
    with pytest.raises(ValueError) as info:
        categorical_nll(p, torch.tensor([0, 1]))
    assert str(info.value) == (
        "probs has one column (shape (2, 1)), a problem of one class; for a binary classifier's "
        "probability p of class 1, pass both columns, torch.cat([1 - p, p], dim=1), of shape "
        "(n, 2)"
    )
    # the hint's fix: -(log(1 - 0.3) + log(0.9)) / 2
    nll = categorical_nll(torch.cat([1 - p, p], dim=1), torch.tensor([0, 1]))
    assert nll.item() == pytest.approx(-(math.log(0.7) + math.log(0.9)) / 2, abs=1e-12)


def test_a_one_dim_scale_of_one_per_output_is_taken():
    # (D,) against a (n, D) mean with n != D: per output by broadcasting, not ambiguous
    mean, y = _MEAN[:2], _Y[:2]  # (2, 3)
    per_output = gaussian_nll(mean, _SCALE, y).item()
    assert per_output == pytest.approx(gaussian_nll(mean, _SCALE[None], y).item(), abs=1e-15)
    hand = sum(
        math.log(_SCALE[d]) + 0.5 * math.log(2 * math.pi)
        + (y[i, d] - mean[i, d]).item() ** 2 / (2 * _SCALE[d].item() ** 2)
        for i in range(2) for d in range(3)
    ) / 2  # fmt: skip
    assert per_output == pytest.approx(hand, abs=1e-12)
    with pytest.raises(ValueError, match=r"scale of shape \(2,\) is ambiguous"):
        gaussian_nll(mean, _SCALE[:2], y)  # n scales: meant per case, read per column


@pytest.mark.parametrize(
    ("dtype", "unit"),
    [(torch.float32, 1e19), (torch.float32, 1e-30), (torch.float16, 100.0)],
    ids=["float32 squares overflow", "float32 squares underflow", "float16 squares overflow"],
)
def test_rmse_of_residuals_whose_squares_leave_the_dtype(dtype, unit):
    # residuals 3, -3, 1, 0 (times unit): sqrt((9 + 9 + 1) / 4) = sqrt(4.75) units. Squared
    # first, 3e19 became inf in float32 (9e38 > 3.4e38), 1e-30 became 0, and 300 inf in float16
    from pyro_quadvi.metrics import rmse

    pred = torch.tensor([3.0, -3.0, 1.0, 0.0]).mul(unit).to(dtype)
    y = torch.zeros(4, dtype=dtype)
    reference = np.sqrt(np.mean(pred.double().numpy() ** 2))  # numpy in float64
    assert reference == pytest.approx(math.sqrt(4.75) * unit, rel=1e-6)
    value = rmse(pred, y)
    assert value.dtype == dtype
    assert value.item() == pytest.approx(reference, rel=2 * torch.finfo(dtype).eps, abs=0)


def test_rmse_of_a_residual_beyond_the_dtype_s_range_is_inf():
    # 3e38 - (-3e38) = 6e38 > float32's 3.4e38 is inf, and the RMSE (4.24e38) is beyond the
    # range too: inf, as the plain formula gave; inf / inf made it NaN
    from pyro_quadvi.metrics import rmse

    pred = torch.tensor([3e38, 0.0])
    assert rmse(pred, torch.tensor([-3e38, 0.0])).item() == math.inf
    assert rmse(pred, torch.zeros(2)).item() == pytest.approx(3e38 / math.sqrt(2), rel=1e-6)
