"""Predictive metrics: negative log likelihood, RMSE, accuracy, Brier score, calibration.

Pure torch: every metric takes tensors and returns a 0-dim tensor (on the inputs' device, in their
floating dtype), so it runs on CUDA unchanged. Conventions:

- The leading dimension of every input indexes the test cases (``n`` of them).
- Classification metrics take class **probabilities** ``probs`` of shape ``(n, C)``, ``C >= 2``
  (for a Bayesian model, the model-averaged predictive probabilities), never logits; each row must
  lie in ``[0, 1]`` and sum to 1 within ``PROB_SUM_ATOL`` (float16 and bfloat16: within 4 ulps of
  1 of their dtype, ``4 * torch.finfo(dtype).eps``), and an entry outside ``[0, 1]`` by no more
  than that (rounding) is clamped. Labels ``y`` are integers of shape ``(n,)`` in ``[0, C)``.
- The predicted class is ``probs.argmax(-1)``; ties go to the lowest class index (``torch.argmax``
  returns the first maximum).

Calibration follows Guo et al. (2017), "On Calibration of Modern Neural Networks", ICML, Sec. 2:
the top-class confidence ``max_c p_c`` of every case is put into one of ``M`` equal-width bins
``B_m``, and ``ECE = sum_m |B_m|/n * |acc(B_m) - conf(B_m)|``. `calibration_bins` is the one
binning used by both `expected_calibration_error` and `reliability_diagram`.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "PROB_SUM_ATOL",
    "CalibrationBins",
    "accuracy",
    "brier_score",
    "calibration_bins",
    "categorical_nll",
    "expected_calibration_error",
    "gaussian_nll",
    "reliability_diagram",
    "rmse",
]

PROB_SUM_ATOL = 1e-4
"""Largest ``|sum_c p_c - 1|`` accepted for a row of ``probs`` (float32 softmax output passes);
for a dtype of fewer bits, ``4 * torch.finfo(dtype).eps`` where that is larger (float16: 0.0039,
bfloat16: 0.031): rounding a row that sums to 1 to float16 alone moves its sum by up to half an
ulp of 1 (4.9e-4), and a softmax or model average computed in that dtype adds a few more."""

_PROB_SUM_ULPS = 4  # the tolerance of a low-precision dtype, in its ulps at 1

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# --------------------------------------------------------------------------------------------
# Validation


def _check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_float(name: str, value: object) -> torch.Tensor:
    value = _check_tensor(name, value)
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    if value.dim() < 1 or value.shape[0] == 0:
        raise ValueError(
            f"{name} must have a leading dimension of at least one case, got shape "
            f"{tuple(value.shape)}"
        )
    if not torch.isfinite(value).all():
        raise ValueError(f"{name} must be finite (it holds NaN or infinite values)")
    return value


def _check_probs(probs: object) -> torch.Tensor:
    probs = _check_float("probs", probs)
    if probs.dim() != 2:
        hint = (
            " (for a binary problem's P(y = 1), of shape (n,): torch.stack([1 - p, p], dim=1))"
            if probs.dim() == 1
            else ""
        )
        raise ValueError(
            f"probs must have shape (n, C) (cases, classes), got shape {tuple(probs.shape)}" + hint
        )
    if probs.shape[1] == 0:
        raise ValueError(
            f"probs has no classes (shape {tuple(probs.shape)}); pass one column of "
            "probabilities per class, shape (n, C)"
        )
    if probs.shape[1] == 1:
        # refused even where every row is 1: a saturated P(y = 1) read as one class scores 0 loss
        raise ValueError(
            f"probs has one column (shape {tuple(probs.shape)}), a problem of one class; for a "
            "binary classifier's probability p of class 1, pass both columns, "
            "torch.cat([1 - p, p], dim=1), of shape (n, 2)"
        )
    atol = max(PROB_SUM_ATOL, _PROB_SUM_ULPS * torch.finfo(probs.dtype).eps)
    within = f"{atol:.3g}" if atol == PROB_SUM_ATOL else f"{atol:.3g} for {probs.dtype}"
    outside = torch.maximum(-probs, probs - 1).max().item()
    if outside > atol:
        raise ValueError(
            f"probs must lie in [0, 1] up to rounding ({within}); an entry is outside by "
            f"{outside:.3g} (pass probabilities, not logits)"
        )
    # summed in float32 at least: the sum of a low-precision row does not add its own rounding
    sums = probs.sum(-1, dtype=torch.promote_types(probs.dtype, torch.float32))
    worst = (sums - 1).abs().max().item()
    if worst > atol:
        raise ValueError(
            f"every row of probs must sum to 1 within {within}; the worst row is off "
            f"by {worst:.3g} (pass probabilities, not logits)"
        )
    # a rounding overshoot (a float32 mean of draws, 1.0000004) is clamped, as the sums are let be
    return probs.clamp(0, 1) if outside > 0 else probs


def _check_labels(y: object, probs: torch.Tensor) -> torch.Tensor:
    y = _check_tensor("y", y)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(
            f"y must hold integer class labels, got dtype {y.dtype} (labels stored as numbers: "
            "y.long())"
        )
    if y.shape != probs.shape[:1]:
        raise ValueError(
            f"y must have shape (n,) = {tuple(probs.shape[:1])} to match probs of shape "
            f"{tuple(probs.shape)}, got shape {tuple(y.shape)}"
        )
    num_classes = probs.shape[1]
    if ((y < 0) | (y >= num_classes)).any():
        raise ValueError(f"y must hold class labels in [0, {num_classes}) (the columns of probs)")
    if y.device != probs.device:
        raise ValueError(f"y is on {y.device} but probs is on {probs.device}")
    return y.long()


def _check_same_shape(name: str, value: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    value = _check_float(name, value)
    if value.shape != ref.shape:
        raise ValueError(
            f"{name} must have the shape of {ref_name}, {tuple(ref.shape)}, got "
            f"{tuple(value.shape)}"
        )
    if value.device != ref.device:
        raise ValueError(
            f"{name} is on {value.device} but {ref_name} is on {ref.device}; move it there "
            f"({name}.to({ref_name}.device))"
        )
    return value


def _check_num_bins(num_bins: object) -> int:
    """``num_bins`` as an ``int``: any integral (``int``, ``numpy.int64``, an integer 0-d
    tensor, through ``operator.index``) that is positive; not a ``bool``."""
    try:
        value = None if isinstance(num_bins, bool) else operator.index(num_bins)
    except TypeError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")
    return value


#: Guo et al.'s number of bins, the default of the calibration metrics, allowed whatever the
#: number of cases (`_check_bins_for_cases`)
_GUO_BINS = 15


def _check_bins_for_cases(num_bins: int, num_cases: int) -> None:
    """Refuse more bins than both the number of cases and `_GUO_BINS` (`calibration_bins`)."""
    if num_bins > max(num_cases, _GUO_BINS):
        raise ValueError(
            f"num_bins={num_bins} is more than the {num_cases} cases (the rows of probs): "
            f"{num_cases} cases fill at most {num_cases} bins, so at least "
            f"{num_bins - num_cases} would be empty whatever the predictions; pass num_bins <= "
            f"{max(num_cases, _GUO_BINS)} (Guo et al. use {_GUO_BINS})"
        )


# --------------------------------------------------------------------------------------------
# Regression


def gaussian_nll(mean: torch.Tensor, scale: torch.Tensor | float, y: torch.Tensor) -> torch.Tensor:
    """Average negative log likelihood of ``y`` under Gaussian predictions ``N(mean, scale^2)``.

    The full Gaussian log density, constant included:

        nll_i = sum_d [ log(scale_id) + log(2 pi) / 2 + (y_id - mean_id)^2 / (2 scale_id^2) ]

    summed over the output dims ``d`` of one case (independent outputs; for ``y`` of shape ``(n,)``
    there is one) and averaged over the ``n`` cases: the per-test-point NLL reported for Bayesian
    neural networks on UCI regression (Hernández-Lobato and Adams 2015). Passing a predictive
    *mixture*'s (e.g. a Bayesian model average's) mean and standard deviation scores the Gaussian
    with the mixture's moments, an approximation of the mixture's own NLL, not that NLL.

    Args:
        mean: Predictive means, shape ``(n, ...)``.
        scale: Predictive standard deviations (> 0): a positive float or 0-dim tensor (one
            noise level for all, moved to ``mean``'s device), or a tensor on ``mean``'s device
            with its number of dims that broadcasts to its shape: for ``mean`` of shape
            ``(n, D)``, ``(n, 1)`` is one scale per case, ``(1, D)`` one per output, ``(n, D)``
            one per entry. A scale with fewer dims broadcasts from the right (``(D,)``: one per
            output), except that one whose first size is ``n`` is refused: it reads as one scale
            per case, which broadcasting would apply per *column* (so for ``n = D`` pass a
            per-output scale as ``(1, D)``).
        y: Observed targets, the shape of ``mean``.

    Returns:
        The per-case average NLL, a 0-dim tensor.

    Raises:
        ValueError: On mismatched shapes or devices (but a 0-dim ``scale``), non-finite values
            or a non-positive ``scale``.
        TypeError: For a ``scale`` that is neither a number nor a tensor (``None``, a string).
    """
    mean = _check_float("mean", mean)
    y = _check_same_shape("y", y, "mean", mean)
    if not isinstance(scale, torch.Tensor):
        try:
            scale = torch.as_tensor(scale, dtype=mean.dtype, device=mean.device)
        except (TypeError, ValueError, RuntimeError) as error:  # None, a string, a dict
            raise TypeError(
                f"scale must be a number > 0 or a floating tensor, got {scale!r} "
                f"({type(scale).__name__})"
            ) from error
    if not scale.is_floating_point():
        raise ValueError(f"scale must have a floating dtype, got {scale.dtype}")
    if scale.device != mean.device:
        if scale.dim():
            raise ValueError(
                f"scale is on {scale.device} but mean is on {mean.device}; move it there "
                "(scale.to(mean.device))"
            )
        scale = scale.to(mean.device)  # one noise level, as a float would be
    if 0 < scale.dim() < mean.dim() and scale.shape[0] == mean.shape[0]:
        # aligned from the right, a scale of n rows would be read per column, not per case
        n, rest = mean.shape[0], mean.shape[1:]
        ones = (1,) * len(rest)
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} is ambiguous for mean of shape "
            f"{tuple(mean.shape)}: give it mean's {mean.dim()} dims, {(n, *ones)} for one "
            f"scale per case, {(1, *rest)} for one per output or {tuple(mean.shape)} for one "
            "per entry (e.g. scale[:, None] for one scale per case of a mean of shape (n, D)); "
            "or a scalar for one in all"
        )
    try:
        torch.broadcast_shapes(scale.shape, mean.shape)
    except RuntimeError:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} does not broadcast to mean's shape "
            f"{tuple(mean.shape)}"
        ) from None
    if torch.broadcast_shapes(scale.shape, mean.shape) != mean.shape:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} broadcasts beyond mean's shape "
            f"{tuple(mean.shape)}"
        )
    if not (torch.isfinite(scale) & (scale > 0)).all():
        raise ValueError("scale must be finite and positive (a standard deviation, not a variance)")
    z = (y - mean) / scale
    per_entry = torch.log(scale).expand(mean.shape) + _HALF_LOG_2PI + 0.5 * z.square()
    return per_entry.reshape(mean.shape[0], -1).sum(-1).mean()


def rmse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Root mean squared error, ``sqrt(mean((pred - y)^2))``, the mean over every entry.

    For targets with several outputs this is the square root of the mean over cases *and*
    outputs (the convention of ``sklearn.metrics.root_mean_squared_error`` on flattened arrays).

    The residuals are divided by their largest magnitude before they are squared (and the root
    multiplied by it after), so that squares beyond the dtype's range neither overflow to
    infinity (float32 residuals of 3e19, float16 ones of 300) nor underflow to 0 (float32
    residuals of 1e-30). A residual beyond the dtype's range (finite ``pred`` and ``y`` of
    opposite signs near its largest value) gives ``inf``.

    Args:
        pred: Point predictions (e.g. the predictive mean), shape ``(n, ...)``.
        y: Observed targets, the shape of ``pred``.

    Returns:
        The RMSE, a 0-dim tensor.
    """
    pred = _check_float("pred", pred)
    y = _check_same_shape("y", y, "pred", pred)
    residual = pred - y
    largest = residual.abs().max()
    if largest == 0 or largest.isinf():  # 0 / 0 and inf / inf would be NaN
        return largest
    return largest * (residual / largest).square().mean().sqrt()


# --------------------------------------------------------------------------------------------
# Classification


def categorical_nll(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Average negative log predictive probability of the true class, ``mean_i -log p_i[y_i]``.

    Also called log loss or cross-entropy. ``log(0)`` is guarded by clamping ``p_i[y_i]`` from
    below at ``torch.finfo(probs.dtype).eps`` (2.2e-16 in float64, 1.2e-7 in float32), so a case
    given probability 0 costs ``-log(eps)`` (36.0 in float64, 15.9 in float32) instead of infinity;
    scikit-learn's ``log_loss`` clips the same way. float16 and bfloat16 probabilities are clamped
    and averaged in float32 (their own ``eps``, 9.8e-4 and 7.8e-3, would cap every case's cost at
    6.9 and 4.9) and the result is returned in their dtype.

    Args:
        probs: Predictive class probabilities, shape ``(n, C)``.
        y: True class labels, integers of shape ``(n,)``.

    Returns:
        The per-case average NLL, a 0-dim tensor.
    """
    probs = _check_probs(probs)
    y = _check_labels(y, probs)
    p_true = probs.gather(1, y[:, None]).squeeze(1)
    p_true = p_true.to(torch.promote_types(probs.dtype, torch.float32))
    eps = torch.finfo(p_true.dtype).eps
    return -torch.log(p_true.clamp(min=eps)).mean().to(probs.dtype)


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fraction of cases whose most probable class is the true one, ``mean_i [argmax p_i = y_i]``.

    Ties go to the lowest class index.

    Args:
        probs: Predictive class probabilities, shape ``(n, C)``.
        y: True class labels, integers of shape ``(n,)``.

    Returns:
        The accuracy in ``[0, 1]``, a 0-dim tensor of ``probs``' dtype.
    """
    probs = _check_probs(probs)
    y = _check_labels(y, probs)
    return (probs.argmax(-1) == y).to(probs.dtype).mean()


def brier_score(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Multi-class Brier score, ``mean_i sum_c (p_ic - [y_i = c])^2`` (Brier 1950).

    The original definition: summed over all ``C`` classes, not halved, so it lies in ``[0, 2]``
    (for two classes it is twice the binary ``mean_i (p_i1 - y_i)^2``). This is
    ``sklearn.metrics.brier_score_loss`` for multi-class input.

    Args:
        probs: Predictive class probabilities, shape ``(n, C)``.
        y: True class labels, integers of shape ``(n,)``.

    Returns:
        The Brier score, a 0-dim tensor.
    """
    probs = _check_probs(probs)
    y = _check_labels(y, probs)
    onehot = torch.nn.functional.one_hot(y, probs.shape[1]).to(probs.dtype)
    return (probs - onehot).square().sum(-1).mean()


class CalibrationBins(NamedTuple):
    """Per-bin summary of the top-class confidence; see `calibration_bins`.

    Attributes:
        confidence: Mean top-class confidence of the cases in each bin, shape ``(num_bins,)``;
            NaN for an empty bin.
        accuracy: Fraction of the cases in each bin that are classified correctly, shape
            ``(num_bins,)``; NaN for an empty bin.
        count: Number of cases in each bin, shape ``(num_bins,)`` (integer dtype).
        edges: The bin edges ``k / num_bins``, ``k = 0..num_bins``, shape ``(num_bins + 1,)``.
    """

    confidence: torch.Tensor
    accuracy: torch.Tensor
    count: torch.Tensor
    edges: torch.Tensor


def calibration_bins(probs: torch.Tensor, y: torch.Tensor, num_bins: int = 15) -> CalibrationBins:
    """Bin the cases by top-class confidence into ``num_bins`` equal-width bins (Guo et al. 2017).

    The confidence of case ``i`` is ``max_c p_ic`` and its prediction ``argmax_c p_ic``. The edges
    are ``e_k = k / num_bins`` (computed as that division in ``probs``' dtype, so a confidence
    written as, e.g., ``0.7`` falls exactly on the edge ``7 / 10``). Bin ``m`` (from 1) is the
    interval ``(e_{m-1}, e_m]``, open below and closed above as in Guo et al.'s
    ``I_m = ((m-1)/M, m/M]``, except the first, ``[0, e_1]``, which also holds a confidence of
    exactly 0. A confidence exactly on an inner edge therefore goes to the bin *below* it.

    Args:
        probs: Predictive class probabilities, shape ``(n, C)``.
        y: True class labels, integers of shape ``(n,)``.
        num_bins: Number of bins ``M``: a positive integer, at most ``max(n, 15)``. ``n`` cases
            fill at most ``n`` bins, so each bin beyond ``n`` is empty whatever the predictions;
            and once every case has a bin of its own the ECE is ``mean_i |[argmax p_i = y_i] -
            max_c p_ic|``, the largest any binning of these cases gives (by the triangle
            inequality), no longer an average within bins. The bound also keeps the binning's
            seven arrays of ``M`` entries (32 bytes a bin in float32) near the size of
            ``probs``: ``num_bins = 10**9`` asked for 32 GB, and timed out. Up to 15 (Guo et
            al.'s ``M``, the default) is allowed for any ``n``, so that the default and small
            examples run.

    Returns:
        Per-bin mean confidence, accuracy and count, and the edges.

    Raises:
        ValueError: for a ``num_bins`` that is not a positive integer, or more than
            ``max(n, 15)``.
    """
    probs = _check_probs(probs)
    y = _check_labels(y, probs)
    num_bins = _check_num_bins(num_bins)
    _check_bins_for_cases(num_bins, probs.shape[0])
    confidence, prediction = probs.max(-1)
    correct = (prediction == y).to(probs.dtype)
    edges = torch.arange(num_bins + 1, dtype=probs.dtype, device=probs.device) / num_bins
    # bucketize(right=False) gives k with e_{k-1} < x <= e_k; x = 0 gives 0, moved to the first bin.
    index = (torch.bucketize(confidence, edges, right=False) - 1).clamp(min=0)
    count = torch.zeros(num_bins, dtype=torch.long, device=probs.device)
    count.scatter_add_(0, index, torch.ones_like(index))
    conf_sum = torch.zeros(num_bins, dtype=probs.dtype, device=probs.device)
    conf_sum.scatter_add_(0, index, confidence)
    correct_sum = torch.zeros(num_bins, dtype=probs.dtype, device=probs.device)
    correct_sum.scatter_add_(0, index, correct)
    denom = count.to(probs.dtype)
    # 0 / 0 = NaN marks an empty bin.
    return CalibrationBins(conf_sum / denom, correct_sum / denom, count, edges)


def expected_calibration_error(
    probs: torch.Tensor, y: torch.Tensor, num_bins: int = 15
) -> torch.Tensor:
    """Expected calibration error with equal-width bins (Guo et al. 2017, Eq. 3).

    ``ECE = sum_m (n_m / n) * |acc(B_m) - conf(B_m)|`` over the bins of `calibration_bins`
    (see there for the edges); empty bins contribute nothing. This is the top-label, L1 ECE, the
    quantity ``torchmetrics.classification.MulticlassCalibrationError(n_bins=num_bins,
    norm="l1")`` computes (torchmetrics puts a confidence exactly on an inner edge into the bin
    *above* it, and 1.0 into a bin of its own; the two agree whenever no confidence lies on an
    inner edge or equals 1).

    Args:
        probs: Predictive class probabilities, shape ``(n, C)``.
        y: True class labels, integers of shape ``(n,)``.
        num_bins: Number of bins ``M`` (15 as in Guo et al.), at most ``max(n, 15)`` (see
            `calibration_bins`).

    Returns:
        The ECE in ``[0, 1]``, a 0-dim tensor.
    """
    bins = calibration_bins(probs, y, num_bins)
    # empty bins weigh 0 (their accuracy is 0/0): a where, not a mask, whose index would read
    # the mask back to the host (a sync on a GPU)
    weight = bins.count.to(bins.confidence.dtype) / bins.count.sum()
    gap = torch.where(bins.count > 0, (bins.accuracy - bins.confidence).abs(), 0.0)
    return (weight * gap).sum()


def reliability_diagram(
    probs: torch.Tensor, y: torch.Tensor, num_bins: int = 15, ax: Axes | None = None
) -> Axes:
    """Plot a reliability diagram (Guo et al. 2017, Fig. 1, bottom row) with matplotlib.

    One bar per bin of `calibration_bins`, spanning the bin on the confidence axis, with the
    bin's accuracy as its height (0 for an empty bin); the diagonal ``accuracy = confidence`` of
    perfect calibration; and the `expected_calibration_error` in the title. matplotlib (the
    ``plots`` extra) is imported only when this function is called.

    Args:
        probs: Predictive class probabilities, shape ``(n, C)``.
        y: True class labels, integers of shape ``(n,)``.
        num_bins: Number of bins ``M``, at most ``max(n, 15)`` (see `calibration_bins`).
        ax: Axes to draw on; a new figure and axes when None.

    Returns:
        The Axes drawn on; ``ax.patches`` are the ``num_bins`` bars, in bin order.

    Raises:
        TypeError: For an ``ax`` that is not a matplotlib ``Axes`` (nor ``None``), before
            anything is computed.
    """
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes

    if ax is not None and not isinstance(ax, Axes):
        raise TypeError(
            f"reliability_diagram: ax must be a matplotlib Axes (plt.subplots()[1]) or None "
            f"for a new figure, got {ax!r} ({type(ax).__name__})"
        )

    bins = calibration_bins(probs, y, num_bins)
    ece = expected_calibration_error(probs, y, num_bins)
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    edges = bins.edges.detach().cpu().double()
    heights = torch.nan_to_num(bins.accuracy.detach().cpu().double(), nan=0.0)
    ax.bar(
        edges[:-1].numpy(),
        heights.numpy(),
        width=(edges[1:] - edges[:-1]).numpy(),
        align="edge",
        edgecolor="black",
        label="accuracy",
    )
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(f"ECE = {ece.item():.4f}")
    ax.legend(loc="upper left")
    return ax
