"""Predictive metrics: hand-computed values, bin edges, reliability diagram, reference libraries."""

import math

import pytest
import torch

from pyro_quadvi.metrics import (
    accuracy,
    brier_score,
    calibration_bins,
    categorical_nll,
    expected_calibration_error,
    gaussian_nll,
    reliability_diagram,
    rmse,
)

# Six cases, four classes, three bins with edges 0, 1/3, 2/3, 1.
#   case  probs                     y  conf  pred  correct  bin
#   1     0.30 0.25 0.25 0.20       0  0.30  0     yes      [0, 1/3]
#   2     0.25 0.30 0.25 0.20       0  0.30  1     no       [0, 1/3]
#   3     0.50 0.20 0.20 0.10       0  0.50  0     yes      (1/3, 2/3]
#   4     0.10 0.60 0.20 0.10       2  0.60  1     no       (1/3, 2/3]
#   5     0.90 0.05 0.03 0.02       0  0.90  0     yes      (2/3, 1]
#   6     0.10 0.80 0.05 0.05       1  0.80  1     yes      (2/3, 1]
# bin 1: n=2, conf (0.30 + 0.30)/2 = 0.30, acc 1/2, |gap| 0.20
# bin 2: n=2, conf (0.50 + 0.60)/2 = 0.55, acc 1/2, |gap| 0.05
# bin 3: n=2, conf (0.90 + 0.80)/2 = 0.85, acc 2/2, |gap| 0.15
# ECE = 2/6 * 0.20 + 2/6 * 0.05 + 2/6 * 0.15 = 0.8/6 = 0.13333...
# accuracy = 4/6
SIX_PROBS = torch.tensor(
    [
        [0.30, 0.25, 0.25, 0.20],
        [0.25, 0.30, 0.25, 0.20],
        [0.50, 0.20, 0.20, 0.10],
        [0.10, 0.60, 0.20, 0.10],
        [0.90, 0.05, 0.03, 0.02],
        [0.10, 0.80, 0.05, 0.05],
    ],
    dtype=torch.float64,
)
SIX_Y = torch.tensor([0, 0, 0, 2, 0, 1])


def test_ece_six_cases_three_bins_by_hand():
    assert expected_calibration_error(SIX_PROBS, SIX_Y, num_bins=3).item() == pytest.approx(
        0.8 / 6, abs=1e-12
    )
    bins = calibration_bins(SIX_PROBS, SIX_Y, num_bins=3)
    assert bins.count.tolist() == [2, 2, 2]
    torch.testing.assert_close(
        bins.confidence, torch.tensor([0.30, 0.55, 0.85], dtype=torch.float64)
    )
    torch.testing.assert_close(bins.accuracy, torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(bins.edges, torch.tensor([0, 1 / 3, 2 / 3, 1], dtype=torch.float64))


def test_accuracy_by_hand():
    assert accuracy(SIX_PROBS, SIX_Y).item() == pytest.approx(4 / 6, abs=1e-15)


def test_ece_skips_empty_bins():
    # Same six cases in 5 bins (edges 0, .2, .4, .6, .8, 1): confidences 0.3, 0.3 -> (0.2, 0.4];
    # 0.5, 0.6 -> (0.4, 0.6] (0.6 on the edge goes below); 0.8 -> (0.6, 0.8]; 0.9 -> (0.8, 1].
    # bins: [0, .2] empty; (.2,.4] n=2 conf .30 acc 1/2; (.4,.6] n=2 conf .55 acc 1/2;
    # (.6,.8] n=1 conf .8 acc 1; (.8,1] n=1 conf .9 acc 1.
    # ECE = (2*0.20 + 2*0.05 + 1*0.20 + 1*0.10) / 6 = 0.8/6
    bins = calibration_bins(SIX_PROBS, SIX_Y, num_bins=5)
    assert bins.count.tolist() == [0, 2, 2, 1, 1]
    assert math.isnan(bins.confidence[0].item()) and math.isnan(bins.accuracy[0].item())
    ece = expected_calibration_error(SIX_PROBS, SIX_Y, num_bins=5)
    assert ece.item() == pytest.approx(0.8 / 6, abs=1e-12)


def test_brier_by_hand():
    # case 1: p = (0.7, 0.2, 0.1), y = 0: 0.3^2 + 0.2^2 + 0.1^2 = 0.09 + 0.04 + 0.01 = 0.14
    # case 2: p = (0.1, 0.3, 0.6), y = 1: 0.1^2 + 0.7^2 + 0.6^2 = 0.01 + 0.49 + 0.36 = 0.86
    # Brier = (0.14 + 0.86) / 2 = 0.5
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], dtype=torch.float64)
    assert brier_score(probs, torch.tensor([0, 1])).item() == pytest.approx(0.5, abs=1e-15)
    # A certain, correct prediction scores 0; a certain, wrong one 2 (1^2 + 1^2).
    certain = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    assert brier_score(certain, torch.tensor([0, 0])).item() == 0.0
    assert brier_score(certain, torch.tensor([1, 1])).item() == 2.0


def test_categorical_nll_by_hand():
    # -(log 0.7 + log 0.3) / 2 = (0.3566749439 + 1.2039728043) / 2 = 0.7803238741
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], dtype=torch.float64)
    assert categorical_nll(probs, torch.tensor([0, 1])).item() == pytest.approx(
        0.7803238741323343, abs=1e-12
    )


def test_categorical_nll_clamps_log_zero():
    # p[y] = 0 is clamped to eps: -log(2.220446e-16) = 36.04365 (float64), -log(1.192093e-7) =
    # 15.94239 (float32).
    y = torch.tensor([1])
    nll64 = categorical_nll(torch.tensor([[1.0, 0.0]], dtype=torch.float64), y)
    nll32 = categorical_nll(torch.tensor([[1.0, 0.0]], dtype=torch.float32), y)
    assert nll64.item() == pytest.approx(36.04365338911715, abs=1e-10)
    assert nll32.item() == pytest.approx(15.942385152878742, abs=1e-5)


def test_gaussian_nll_by_hand():
    # case 1: mean 0, scale 1, y 1: log 1 + 0.9189385 + 1/2 = 1.4189385
    # case 2: mean 1, scale 2, y 1: log 2 + 0.9189385 + 0 = 0.6931472 + 0.9189385 = 1.6120857
    # average: (1.4189385 + 1.6120857) / 2 = 1.5155121
    half_log_2pi = 0.5 * math.log(2 * math.pi)
    expected = (0.5 + half_log_2pi + math.log(2) + half_log_2pi) / 2
    assert expected == pytest.approx(1.5155121, abs=1e-7)
    mean = torch.tensor([0.0, 1.0], dtype=torch.float64)
    scale = torch.tensor([1.0, 2.0], dtype=torch.float64)
    y = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert gaussian_nll(mean, scale, y).item() == pytest.approx(expected, abs=1e-12)
    # Two outputs per case are summed, cases averaged: one case holding both entries above.
    assert gaussian_nll(mean[None], scale[None], y[None]).item() == pytest.approx(
        2 * expected, abs=1e-12
    )
    # A scalar scale (fixed noise): scale 1 and errors (1, 0): 0.9189385 + (1/2 + 0) / 2 = 1.1689385
    assert gaussian_nll(mean, 1.0, y).item() == pytest.approx(half_log_2pi + 0.25, abs=1e-12)


def test_gaussian_nll_matches_torch_distributions():
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    scale = torch.rand(50, 3, generator=gen, dtype=torch.float64) + 0.1
    y = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    reference = -torch.distributions.Normal(mean, scale).log_prob(y).sum(-1).mean()
    torch.testing.assert_close(gaussian_nll(mean, scale, y), reference, rtol=0, atol=1e-12)


def test_rmse_by_hand():
    # errors 0, 1, 2, 3: mean square (0 + 1 + 4 + 9) / 4 = 3.5, RMSE sqrt(3.5) = 1.8708287
    pred = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    y = torch.ones(4, dtype=torch.float64)
    assert rmse(pred, y).item() == pytest.approx(1.8708286933869707, abs=1e-12)


def test_perfectly_calibrated_construction_has_zero_ece():
    # 10 cases at confidence 0.8 with 8 correct, 5 at confidence 0.6 with 3 correct; with 10 bins
    # they fall in (0.7, 0.8] and (0.5, 0.6], where accuracy equals confidence exactly.
    probs = torch.tensor([[0.8, 0.2]] * 10 + [[0.4, 0.6]] * 5, dtype=torch.float64)
    y = torch.tensor([0] * 8 + [1] * 2 + [1] * 3 + [0] * 2)
    bins = calibration_bins(probs, y, num_bins=10)
    assert bins.count.tolist() == [0, 0, 0, 0, 0, 5, 0, 10, 0, 0]
    assert expected_calibration_error(probs, y, num_bins=10).item() == pytest.approx(0, abs=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_confidence_on_an_edge_goes_to_the_bin_below(dtype):
    # 5 bins, edges 0, .2, .4, .6, .8, 1 (bins (lo, hi], the first [0, 0.2]):
    # confidence 0.4 -> (0.2, 0.4] (index 1), 0.6 -> (0.4, 0.6] (index 2), 1 -> (0.8, 1] (index 4).
    probs = torch.tensor([[0.4, 0.3, 0.3], [0.2, 0.6, 0.2], [0.0, 0.0, 1.0]], dtype=dtype)
    bins = calibration_bins(probs, torch.tensor([0, 0, 2]), num_bins=5)
    assert bins.count.tolist() == [0, 1, 1, 0, 1]
    assert bins.accuracy[[1, 2, 4]].tolist() == [1.0, 0.0, 1.0]
    # 10 bins: confidence 0.7 lies on the edge 7/10 and goes to (0.6, 0.7] (index 6).
    bins10 = calibration_bins(torch.tensor([[0.7, 0.2, 0.1]], dtype=dtype), torch.tensor([0]), 10)
    assert bins10.count.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]


def test_reliability_diagram_bar_heights():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = reliability_diagram(SIX_PROBS, SIX_Y, num_bins=3)
    try:
        bars = ax.patches
        assert len(bars) == 3
        assert [bar.get_height() for bar in bars] == pytest.approx([0.5, 0.5, 1.0])
        assert [bar.get_x() for bar in bars] == pytest.approx([0, 1 / 3, 2 / 3])
        assert [bar.get_width() for bar in bars] == pytest.approx([1 / 3] * 3)
        assert ax.get_title() == "ECE = 0.1333"
        # An empty bin is drawn with height 0; a given ax is drawn on and returned.
        _, given = plt.subplots()
        assert reliability_diagram(SIX_PROBS, SIX_Y, num_bins=5, ax=given) is given
        assert [bar.get_height() for bar in given.patches] == pytest.approx([0, 0.5, 0.5, 1, 1])
    finally:
        plt.close("all")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: accuracy(torch.tensor([[2.0, -1.0]]), torch.tensor([0])), "probs must lie"),
        (lambda: accuracy(torch.tensor([[0.5, 0.4]]), torch.tensor([0])), "sum to 1"),
        (lambda: accuracy(torch.tensor([0.5, 0.5]), torch.tensor([0])), r"probs must have shape"),
        (lambda: accuracy(torch.tensor([[0.5, 0.5]]), torch.tensor([0, 1])), "y must have shape"),
        (lambda: accuracy(torch.tensor([[0.5, 0.5]]), torch.tensor([2])), r"labels in \[0, 2\)"),
        (lambda: accuracy(torch.tensor([[0.5, 0.5]]), torch.tensor([0.0])), "integer class"),
        (lambda: accuracy(torch.tensor([[0, 1]]), torch.tensor([0])), "probs must have a float"),
        (lambda: accuracy(torch.tensor([[math.nan, 1]]), torch.tensor([0])), "probs must be fin"),
        (lambda: calibration_bins(SIX_PROBS, SIX_Y, 0), "num_bins must be a positive"),
        (lambda: rmse(torch.zeros(3), torch.zeros(4)), "y must have the shape of pred"),
        (lambda: gaussian_nll(torch.zeros(2), torch.zeros(2), torch.zeros(2)), "scale must be"),
        (lambda: gaussian_nll(torch.zeros(2), torch.ones(3), torch.zeros(2)), "does not broad"),
        (lambda: gaussian_nll(torch.zeros(2), torch.ones(2, 2), torch.zeros(2)), "beyond mean"),
        (lambda: gaussian_nll(torch.zeros(2), 1.0, torch.zeros(3)), "y must have the shape"),
    ],
)
def test_invalid_inputs_raise_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_ece_matches_torchmetrics_on_random_data():
    torchmetrics = pytest.importorskip("torchmetrics")
    gen = torch.Generator().manual_seed(0)
    n, num_classes = 2000, 10
    probs = torch.softmax(3 * torch.randn(n, num_classes, generator=gen), dim=-1)
    # Labels drawn from the predictions, but with the top class 20% too often: a miscalibrated
    # model, so the ECE is not near 0.
    y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    flip = torch.rand(n, generator=gen) < 0.2
    y = torch.where(flip, probs.argmax(-1), y)
    for num_bins in (5, 10, 15, 30):
        # The two conventions differ only for a confidence on an inner edge (or 1.0): none here.
        edges = torch.arange(num_bins + 1, dtype=probs.dtype) / num_bins
        assert not torch.isin(probs.max(-1).values, edges).any()
        reference = torchmetrics.classification.MulticlassCalibrationError(
            num_classes=num_classes, n_bins=num_bins, norm="l1"
        )(probs, y)
        ours = expected_calibration_error(probs, y, num_bins)
        assert ours.item() > 0.01
        assert abs(ours.item() - reference.item()) < 1e-6
        # The same cases in float64 agree to the same tolerance.
        ours64 = expected_calibration_error(probs.double(), y, num_bins)
        assert abs(ours64.item() - reference.item()) < 1e-6


def test_classification_metrics_match_sklearn_on_random_data():
    metrics = pytest.importorskip("sklearn.metrics")
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(2 * torch.randn(500, 4, generator=gen, dtype=torch.float64), dim=-1)
    y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    labels = list(range(4))
    p, t = probs.numpy(), y.numpy()
    assert categorical_nll(probs, y).item() == pytest.approx(
        metrics.log_loss(t, p, labels=labels), abs=1e-12
    )
    assert brier_score(probs, y).item() == pytest.approx(
        metrics.brier_score_loss(t, p, labels=labels), abs=1e-12
    )
    assert accuracy(probs, y).item() == pytest.approx(
        metrics.accuracy_score(t, p.argmax(-1)), abs=1e-15
    )
    pred, target = torch.randn(2, 300, 2, generator=gen, dtype=torch.float64)
    assert rmse(pred, target).item() == pytest.approx(
        metrics.root_mean_squared_error(target.numpy().ravel(), pred.numpy().ravel()), abs=1e-12
    )
