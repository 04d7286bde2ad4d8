"""Classification and calibration: a Bayesian MLP on MNIST or sklearn's digits, QNVB against Adam.

**The data.** MNIST when a directory holding it is known: ``--data-dir D``, or else the
environment variable ``PYRO_QUADVI_DATA`` (its ``mnist-t10k`` subdirectory), read by
:func:`pyro_quadvi.testing.datasets.mnist_split`: the 10,000 images of MNIST's test set (28x28) in
its seeded 8,000 / 2,000 split (``numpy.random.default_rng(0).permutation``; the split every MNIST
figure of the package reports). Without a directory, and always with ``--quick``, scikit-learn's
``load_digits`` (1797 grey-scale 8x8 images of the digits 0-9, shipped with the package) split
once, with ``torch.Generator().manual_seed(0)``, into 1438 training and 359 test images (80/20).
Either way the images are flattened and standardized with the training set's statistics: the
digits pixel by pixel (a pixel constant on the training set is only centred), MNIST by one mean and
standard deviation for all pixels (its border pixels are almost always blank, so per-pixel scaling
would blow a rare stroke up to about 1,700).

A ``P``-100-10 MLP with tanh activations (``P`` = 64 pixels for the digits, 784 for MNIST) is a
:class:`~pyro_quadvi.nn.BayesianModule` with the iid prior ``priors.Normal(scale=1.0)`` on every
weight and bias and the likelihood ``likelihoods.Categorical(dataset_size=N)`` (``N`` the training
images), trained on shuffled minibatches of 128 (a ``DataLoader``: 12 a pass through the digits,
63 through MNIST) three ways, at equal gradient evaluations:

1. ``QNVB()`` + ``QuadratureELBO()`` (the package's defaults: K nodes a step; QNVB takes the
   network settings the ``BayesianModule`` declares) with an
   ``AutoMeanFieldNormal`` guide started at a prior draw (``init_to_sample``), 100 epochs on the
   digits (4 in ``--quick``), 20 on MNIST (1260 steps, about the digits' 1200);
2. ``pyro.optim.Adam({"lr": 0.01})`` + ``Trace_ELBO()`` (one draw a step) with the same guide,
   K times as many steps;
3. the same network without priors (deterministic), ``torch.optim.Adam(lr=1e-3)`` on the
   cross-entropy, also K times as many steps.

The test split scores the Bayesian model average of ``bnn.predict(guide, x, num_samples=100)``
(``prediction.probs``; the deterministic net: its softmax) by accuracy, negative log likelihood,
expected calibration error (15 equal-width bins) and Brier score (:mod:`pyro_quadvi.metrics`).
Under a shift the predictive entropy ``-sum_c p_c log p_c`` should grow: the test images are
rotated by 0, 30, 60 and 90 degrees (``scipy.ndimage.rotate(..., reshape=False)``, linear
interpolation, before standardization) and the mean entropy is reported at each angle.

On the digits the prior matters more than the optimizer: with the fan-in scaled
``priors.LayerwiseNormal("radford")`` (``N(0, 1 / fan_in)``) both mean fields stay close to the
prior and are badly underconfident (after 60 epochs, test NLL about 0.53, ECE about 0.28, for
either optimizer; with that prior the guides' initial scale, 0.1 or 0.01, changed nothing
measurable); ``N(0, 1)`` on every entry regularizes less.

Run::

    python tutorials/bnn_classification.py               # digits, under a minute (MNIST if
                                                         # PYRO_QUADVI_DATA is set)
    python tutorials/bnn_classification.py --data-dir D  # MNIST 8,000 / 2,000
    python tutorials/bnn_classification.py --quick --out /tmp/c.png   # digits, seconds (CI runs it)

The figure (reliability diagrams of the three methods and the entropy against the angle) goes to
``docs/img/bnn_classification.png`` (digits) or ``docs/img/bnn_classification_mnist.png`` (MNIST)
unless ``--out`` says otherwise; ``--quick`` without ``--out`` writes ``bnn_classification.png``
to the temporary directory (``tempfile.gettempdir()``) and leaves the committed figure alone.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import NamedTuple

import numpy as np
import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_sample
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi import metrics as M
from pyro_quadvi.nn import BayesianModule, fit, likelihoods, priors
from pyro_quadvi.testing.datasets import mnist_split

SEED = 0
TEST_FRACTION = 0.2
BATCH = 128
HIDDEN = 100
ANGLES = (0, 30, 60, 90)
NUM_BINS = 15
SETTINGS = {"full": {"epochs": 100}, "quick": {"epochs": 4}, "mnist": {"epochs": 20}}
FIGURES = {
    "digits": "docs/img/bnn_classification.png",
    "mnist": "docs/img/bnn_classification_mnist.png",
}


# ----------------------------------------------------------------------------- the data


def digits_split(seed: int = SEED):
    """The digits as raw ``(n, 8, 8)`` images and labels, split 80/20 by a seeded permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32)
    labels = torch.as_tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = round(TEST_FRACTION * len(labels))
    test, train = order[:n_test], order[n_test:]
    return images[train], labels[train], images[test], labels[test]


def mnist_images(data_dir: str | None = None):
    """MNIST's seeded 8,000 / 2,000 split (:func:`~pyro_quadvi.testing.datasets.mnist_split`, seed
    0) as ``(n, 28, 28)`` images in [0, 1] and labels; ``data_dir=None`` reads
    ``$PYRO_QUADVI_DATA/mnist-t10k``."""
    x_train, y_train, x_test, y_test = mnist_split(data_dir, seed=SEED)
    return x_train[:, 0], y_train, x_test[:, 0], y_test


class Data(NamedTuple):
    """Raw ``(n, H, W)`` training and test images, their labels, and where they come from."""

    name: str  # "digits" or "mnist"
    description: str  # the data and the split, for the output and the figure
    origin: str  # where it was read from
    train_images: torch.Tensor
    y_train: torch.Tensor
    test_images: torch.Tensor
    y_test: torch.Tensor


def load_data(quick: bool, data_dir: str | None) -> Data:
    """MNIST from ``data_dir`` or, without it, from ``$PYRO_QUADVI_DATA`` when that is set; the
    digits otherwise and always when ``quick``."""
    if quick or (data_dir is None and "PYRO_QUADVI_DATA" not in os.environ):
        split, name, origin = digits_split(), "digits", "sklearn.datasets.load_digits"
        what = f"sklearn digits (8x8), seeded 80/20 split (torch seed {SEED})"
    else:
        origin = data_dir or os.path.join(os.environ["PYRO_QUADVI_DATA"], "mnist-t10k")
        try:
            split, name = mnist_images(data_dir), "mnist"
        except FileNotFoundError as error:
            raise FileNotFoundError(
                f"no MNIST in {origin} ({error}): pass --data-dir with the directory holding "
                "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz, or leave out --data-dir "
                "and unset PYRO_QUADVI_DATA to run on sklearn's digits"
            ) from error
        what = f"MNIST t10k (28x28), mnist_split seed {SEED}"
    description = f"{what}: {len(split[1])} train / {len(split[3])} test"
    return Data(name, description, origin, *split)


class Standardizer:
    """Flattens images and standardizes them with the training set's statistics: each pixel by
    its own mean and standard deviation (``per_pixel``), or all pixels by one (MNIST, whose border
    pixels are nearly always blank: per pixel, a test image would reach values of about 1,700)."""

    def __init__(self, images: torch.Tensor, per_pixel: bool = True):
        flat = images.reshape(len(images), -1)
        if per_pixel:
            self.mean = flat.mean(0)
            std = flat.std(0)
            self.std = torch.where(std > 0, std, torch.ones_like(std))
        else:
            self.mean, self.std = flat.mean(), flat.std()

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return (images.reshape(len(images), -1) - self.mean) / self.std


def rotate(images: torch.Tensor, angle: float) -> torch.Tensor:
    """The ``(n, H, W)`` images rotated by ``angle`` degrees about their centre, same frame."""
    if angle == 0:
        return images.clone()
    from scipy.ndimage import rotate as nd_rotate

    out = nd_rotate(images.numpy(), angle, axes=(1, 2), reshape=False, order=1, mode="constant")
    return torch.as_tensor(np.ascontiguousarray(out), dtype=images.dtype)


def loader(x: torch.Tensor, y: torch.Tensor, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=generator)


# ----------------------------------------------------------------------------- the models


def make_net(num_inputs: int, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(num_inputs, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 10))


def make_bnn(num_inputs: int, n_train: int) -> BayesianModule:
    return BayesianModule(
        make_net(num_inputs),
        priors.Normal(scale=1.0),
        likelihoods.Categorical(dataset_size=n_train),
    )


def fit_svi(bnn, data, optimizer, elbo, steps: int, label: str, seed: int = SEED):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=init_to_sample)
    history = fit(SVI(bnn, guide, optimizer, elbo), data, steps, desc=label, progress=False)
    return guide, history


def fit_deterministic(data, num_inputs: int, steps: int, lr: float = 1e-3):
    net = make_net(num_inputs)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    batches = iter(())
    for _ in range(steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(data)
            x, y = next(batches)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
    net.eval()
    return net


# ----------------------------------------------------------------------------- the scores


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """The mean predictive entropy (nats) of the rows of ``probs``."""
    return -(probs * probs.clamp(min=1e-12).log()).sum(-1).mean()


def scores(probs: torch.Tensor, y: torch.Tensor) -> dict:
    probs = probs.double()
    probs = probs / probs.sum(-1, keepdim=True)
    return {
        "accuracy": float(M.accuracy(probs, y)),
        "nll": float(M.categorical_nll(probs, y)),
        "ece": float(M.expected_calibration_error(probs, y, NUM_BINS)),
        "brier": float(M.brier_score(probs, y)),
    }


def plot(results: dict, y_test: torch.Tensor, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, axes = plt.subplots(1, len(names) + 1, figsize=(4.0 * (len(names) + 1), 4.0))
    for ax, name in zip(axes, names):
        probs = results[name]["probs"].double()
        M.reliability_diagram(probs / probs.sum(-1, keepdim=True), y_test, NUM_BINS, ax=ax)
        ax.set_title(f"{name}\nECE {results[name]['ece']:.3f}", fontsize=9)
        ax.legend(loc="upper left", fontsize=7)
    ax = axes[-1]
    for name, marker in zip(names, "osd"):
        ax.plot(ANGLES, results[name]["entropy"], marker=marker, label=name.split(" (")[0])
    ax.axhline(math.log(10), color="gray", ls=":", lw=0.8, label="log 10 (uniform)")
    ax.set_xticks(ANGLES)
    ax.set_xlabel("rotation of the test digits (degrees)")
    ax.set_ylabel("mean predictive entropy (nats)")
    ax.set_title("predictive entropy under rotation", fontsize=9)
    ax.set_ylim(-0.05, 3.0)
    ax.legend(loc="upper left", fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def print_table(results: dict) -> None:
    heads = " | ".join(f"entropy {a}°" for a in ANGLES)
    print(f"| method | accuracy | NLL | ECE | Brier | {heads} | time (s) |")
    print("|---" * (6 + len(ANGLES)) + "|")
    for name, r in results.items():
        ent = " | ".join(f"{e:.3f}" for e in r["entropy"])
        print(
            f"| {name} | {r['accuracy']:.3f} | {r['nll']:.3f} | {r['ece']:.3f} | "
            f"{r['brier']:.3f} | {ent} | {r['time_s']:.1f} |"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few epochs (CI)")
    parser.add_argument(
        "--data-dir",
        help="MNIST directory (t10k-*-ubyte.gz; default: $PYRO_QUADVI_DATA/mnist-t10k if that "
        "variable is set, else sklearn digits)",
    )
    parser.add_argument(
        "--out", help="figure path (default: docs/img/bnn_classification*.png; temp dir if --quick)"
    )
    parser.add_argument("--epochs", type=int, help="QNVB epochs (the others: K times the steps)")
    parser.add_argument("--samples", type=int, default=100, help="guide draws for prediction")
    options = parser.parse_args(argv)
    if options.quick and options.data_dir is not None:
        parser.error("--quick runs on sklearn's digits: leave out --data-dir (or --quick)")
    torch.set_num_threads(1)
    source = load_data(options.quick, options.data_dir)
    setting = "quick" if options.quick else "full" if source.name == "digits" else "mnist"
    epochs = options.epochs or SETTINGS[setting]["epochs"]
    default = (
        os.path.join(tempfile.gettempdir(), "bnn_classification.png")
        if options.quick
        else FIGURES[source.name]
    )
    out = options.out or default
    print(f"data: {source.description} (from {source.origin})")

    y_train, y_test = source.y_train, source.y_test
    standardize = Standardizer(source.train_images, per_pixel=source.name == "digits")
    x_train = standardize(source.train_images)
    x_tests = {angle: standardize(rotate(source.test_images, angle)) for angle in ANGLES}
    n_train, num_inputs = x_train.shape
    data = loader(x_train, y_train, SEED)
    steps = epochs * len(data)

    elbo = QuadratureELBO()
    bnn = make_bnn(num_inputs, n_train)
    K = elbo.rule.num_nodes(sum(p.numel() for p in bnn.latent_parameters().values()))
    results = {}

    def record(label, predict_probs, elapsed):
        r = {"time_s": elapsed, "entropy": []}
        for angle, x_test in x_tests.items():
            pyro.set_rng_seed(10)
            probs = predict_probs(x_test)
            if angle == 0:
                r.update(scores(probs, y_test), probs=probs)
            r["entropy"].append(float(entropy(probs)))
        results[label] = r

    def bayes_probs(bnn, guide):
        return lambda x: bnn.predict(guide, x, num_samples=options.samples).probs

    # 1. QNVB + QuadratureELBO: K gradient evaluations a step
    start = time.perf_counter()
    guide, _ = fit_svi(bnn, data, QNVB(), elbo, steps, "QNVB + QuadratureELBO")
    record(
        f"QNVB + QuadratureELBO ({steps} steps x K={K})",
        bayes_probs(bnn, guide),
        time.perf_counter() - start,
    )

    # 2. Adam + Trace_ELBO: one draw a step, K times the steps
    adam_steps = K * steps
    bnn = make_bnn(num_inputs, n_train)
    start = time.perf_counter()
    guide, _ = fit_svi(
        bnn, data, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), adam_steps, "Adam + Trace_ELBO"
    )
    record(
        f"Adam(lr=0.01) + Trace_ELBO ({adam_steps} steps)",
        bayes_probs(bnn, guide),
        time.perf_counter() - start,
    )

    # 3. a deterministic net, Adam on the cross-entropy, the same gradient evaluations
    start = time.perf_counter()
    net = fit_deterministic(data, num_inputs, adam_steps)
    elapsed = time.perf_counter() - start

    def net_probs(x):
        with torch.no_grad():
            return torch.softmax(net(x), -1)

    record(f"deterministic, Adam(lr=1e-3) ({adam_steps} steps)", net_probs, elapsed)

    title = (
        f"{num_inputs}-{HIDDEN}-10 tanh MLP on {source.description}\n"
        f"{epochs} epochs of QNVB; equal gradient evaluations"
    )
    plot(results, y_test, out, title)
    print_table(results)
    print(f"\nfigure saved to {out}")
    return {
        "results": results,
        "K": K,
        "epochs": epochs,
        "steps": steps,
        "data": source.name,
        "num_inputs": num_inputs,
        "out": out,
    }


if __name__ == "__main__":
    main()
