"""The BNN classification tutorial: its data choice (digits or MNIST), the MNIST path on stand-in
images, and the digits end to end in its quick mode."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="module")
def tutorial(load_script):
    return load_script("tutorials/bnn_classification.py")


def test_split_and_rotation(tutorial):
    x_train, y_train, x_test, y_test = tutorial.digits_split()
    assert x_train.shape == (1438, 8, 8) and x_test.shape == (359, 8, 8)
    assert y_train.shape == (1438,) and y_test.shape == (359,)
    assert set(y_test.tolist()) == set(range(10))
    # the split is fixed by its seed
    again = tutorial.digits_split()
    assert torch.equal(again[3], y_test)
    standardize = tutorial.Standardizer(x_train)
    z = standardize(x_train)
    assert z.shape == (1438, 64) and torch.isfinite(z).all()
    assert z.mean(0).abs().max() < 1e-4
    pooled = tutorial.Standardizer(x_train, per_pixel=False)(x_train)
    assert abs(pooled.mean().item()) < 1e-4 and pooled.std().item() == pytest.approx(1, abs=1e-4)
    assert torch.allclose(pooled, (x_train.reshape(1438, -1) - x_train.mean()) / x_train.std())
    rotated = tutorial.rotate(x_test[:5], 90)
    assert rotated.shape == (5, 8, 8)
    # a quarter turn in the same 8x8 frame moves the pixels exactly (no interpolation)
    assert torch.allclose(rotated, torch.rot90(x_test[:5], 1, dims=(1, 2)), atol=1e-4)


def test_quick_run(tutorial, run_quick):
    result, out = run_quick(tutorial, "bnn_classification.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = result["results"]
    assert len(results) == 3
    assert [name.split(" ")[0] for name in results] == ["QNVB", "Adam(lr=0.01)", "deterministic,"]
    for r in results.values():
        assert 0.5 < r["accuracy"] <= 1.0  # digits is easy
        assert 0.0 <= r["ece"] <= 1.0
        assert 0.0 <= r["brier"] <= 2.0
        assert math.isfinite(r["nll"]) and 0.0 <= r["nll"] < math.log(10)
        assert len(r["entropy"]) == len(tutorial.ANGLES) == 4
        for e in r["entropy"]:
            assert math.isfinite(e) and 0.0 <= e <= math.log(10) + 1e-6


class FakeMnistSplit:
    """Stands in for ``mnist_split``: seeded random ``(n, 1, 28, 28)`` images, records its calls."""

    def __init__(self, num_train: int, num_test: int):
        generator = torch.Generator().manual_seed(1)
        n = num_train + num_test
        x = torch.rand(n, 1, 28, 28, generator=generator)
        y = torch.randint(0, 10, (n,), generator=generator)
        self.split = x[:num_train], y[:num_train], x[num_train:], y[num_train:]
        self.calls = []

    def __call__(self, data_dir=None, num_train=8000, seed=0):
        self.calls.append((data_dir, num_train, seed))
        return self.split


def test_data_choice(tutorial, monkeypatch):
    fake = FakeMnistSplit(12, 4)
    monkeypatch.setattr(tutorial, "mnist_split", fake)
    monkeypatch.delenv("PYRO_QUADVI_DATA", raising=False)
    # no directory: the digits
    assert tutorial.load_data(quick=False, data_dir=None).name == "digits" and fake.calls == []
    monkeypatch.setenv("PYRO_QUADVI_DATA", "/nonexistent")
    # --quick: the digits whatever the environment says
    digits = tutorial.load_data(quick=True, data_dir=None)
    assert digits.name == "digits" and digits.train_images.shape == (1438, 8, 8)
    assert fake.calls == []
    # the environment variable: MNIST, the package's split (8,000 train, seed 0)
    mnist = tutorial.load_data(quick=False, data_dir=None)
    assert fake.calls == [(None, 8000, 0)]
    assert mnist.name == "mnist" and mnist.origin == "/nonexistent/mnist-t10k"
    assert mnist.train_images.shape == (12, 28, 28) and mnist.test_images.shape == (4, 28, 28)
    assert torch.equal(mnist.train_images, fake.split[0][:, 0])
    assert torch.equal(mnist.y_test, fake.split[3])
    assert "seed 0: 12 train / 4 test" in mnist.description
    # an explicit directory wins
    assert tutorial.load_data(quick=False, data_dir="D").origin == "D"
    assert fake.calls[-1] == ("D", 8000, 0)
    # --quick and --data-dir together are refused before any work
    with pytest.raises(SystemExit):
        tutorial.main(["--quick", "--data-dir", "D"])
    assert len(fake.calls) == 2


def test_missing_mnist_is_named_with_the_fix(tutorial, monkeypatch, tmp_path):
    monkeypatch.setenv("PYRO_QUADVI_DATA", str(tmp_path))  # no mnist-t10k/ below it
    with pytest.raises(FileNotFoundError, match=r"no MNIST in .*mnist-t10k.*unset PYRO_QUADVI"):
        tutorial.load_data(quick=False, data_dir=None)
    with pytest.raises(FileNotFoundError, match="pass --data-dir"):
        tutorial.load_data(quick=False, data_dir=str(tmp_path))


def test_mnist_path_end_to_end(tutorial, monkeypatch, tmp_path):
    fake = FakeMnistSplit(200, 50)
    monkeypatch.setattr(tutorial, "mnist_split", fake)
    out = tmp_path / "m.png"
    threads = torch.get_num_threads()
    try:
        result = tutorial.main(
            ["--data-dir", "D", "--epochs", "1", "--samples", "4", "--out", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
    assert fake.calls == [("D", 8000, 0)]
    assert result["data"] == "mnist" and result["num_inputs"] == 28 * 28
    assert result["steps"] == math.ceil(200 / tutorial.BATCH) == 2  # one epoch of minibatches
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(result["results"]) == 3
    for r in result["results"].values():
        assert math.isfinite(r["nll"]) and 0.0 <= r["ece"] <= 1.0
        for e in r["entropy"]:
            assert math.isfinite(e) and 0.0 <= e <= math.log(10) + 1e-6
