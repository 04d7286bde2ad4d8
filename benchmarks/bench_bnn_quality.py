"""Quality of Bayesian networks at equal gradient evaluations (issue 11, "Quality").

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part regression
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part mnist --data-dir D
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part diagnose
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part qnvb-lr --data-dir D
    python benchmarks/bench_bnn_quality.py --report          # tables and figures from the JSON
    python benchmarks/bench_bnn_quality.py --quick --part all --data-dir D   # smoke run

The full-length pass (``docs/benchmarks.md`` gives its exact commands): ``--part objective`` and
``--part regression`` with ``--evals 3000 --results benchmarks/results/bnn_quality_e3000.json
--reuse-tuning benchmarks/results/bnn_quality.json`` (the first pass's tuned learning rates),
``--part mnist`` and ``--part objective-mnist`` with ``--mnist-evals 620`` (10 epochs) into
``bnn_quality_mnist10.json``; ``--variants`` adds named QNVB variants (:data:`VARIANTS`).
The retuned regression (``bnn_quality_e3000_tuned.json``): Adam's and IVON's learning rates tuned
at ``--evals 3000`` (``--splits 0``: the tuning runs alone), then ``--methods`` (the regression
methods to run) with ``--reuse-runs bnn_quality_e3000.json``, which copies a run from that JSON
wherever it holds the same key at the same learning rate (a QNVB row: its recorded run, made by
the package of that time) instead of running it again.

``--part mnist --seed k`` reruns the final MNIST runs from seed ``k`` (the net's initialization,
the minibatch order and the Monte Carlo draws; the 8,000 / 2,000 split stays fixed) under keys
``seed<k>/mnist/...``, at the learning rates tuned from seed 0 (``--reuse-tuning`` the seed-0
JSON: no retuning); ``--report --seed0-results`` puts the recorded seed-0 runs beside them.

``D`` is the MNIST directory (default ``$PYRO_QUADVI_DATA/mnist-t10k``). Every run is cached in
``benchmarks/results/bnn_quality.json`` (``--quick``: its own file) under a key naming the data,
the network, the method, the learning rate and the split, and is skipped when present, so an
interrupted run resumes. ``--report`` prints the markdown of the docs section and
draws ``docs/img/bnn_quality_*.png`` from that file alone.

**Methods**, each given the same number of gradient evaluations (one evaluation: one forward and
backward pass of the network over the minibatch at one weight setting):

- ``qnvb``: ``SVI(bnn, guide, QNVB(), QuadratureELBO())``, the package's defaults (a step costs K,
  the rule's number of nodes);
- ``adam``: ``SVI(bnn, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())``, one draw a step, ``lr``
  tuned over ``LR_GRID["adam"]``;
- ``ivon``: ``ivon.IVON(groups, lr, ess=N)`` on the plain network, one group per parameter tensor
  with ``weight_decay = 1/(N prior_sd^2)`` (IVON's prior precision is ``ess * weight_decay``),
  one Monte Carlo sample a step (``with opt.sampled_params(train=True)``), ``lr`` tuned over
  ``LR_GRID["ivon"]`` (its other arguments at their defaults);
- ``map`` (MNIST only): the plain network trained by ``torch.optim.Adam(lr=1e-3)`` on the mean NLL.

``--part diagnose`` runs the controlled diabetes runs of :data:`DIAGNOSE`; ``--part qnvb-lr`` runs
QNVB with ``lr=PROPOSED_LR`` (else defaults) on every cell, the change those runs point to.
``--part objective`` (and ``objective-mnist``) asks whether QNVB's gap to IVON is the objective or
the optimizer: every method's final posterior scored by one model's ``-ELBO`` (:func:`objective`),
IVON's as the Gaussian it samples from, with means and standard deviations swapped between methods.

``bnn`` is ``BayesianModule(net, default_prior(kind), likelihood, qnvb_settings={})``: QNVB's
own settings, as every row was recorded, the QNVB variants naming theirs (``qnvb-wide`` is what
``QNVB()`` on a ``BayesianModule`` now does: its weights declare the network settings).
The priors: regression ``priors.LayerwiseNormal("radford")``, MNIST ``priors.Normal(1.0)``;
the guide
``AutoMeanFieldNormal(bnn, init_loc_fn=init_to_value(the net's own initialization))``, so every
method starts at the same weights (PyTorch's default initialization, seeded; ``--init kaiming``:
the MNIST networks from Kaiming's normal for ReLU, biases zero, :func:`mnist_net`). Regression
uses a learned homoscedastic noise:
``likelihoods.Gaussian(N, scale=None, noise_prior=LogNormal(0, 1))``, a Gaussian prior ``N(0, 1)``
on ``log sigma``, which is exactly what IVON's weight decay puts on a ``log sigma`` parameter
trained alongside the net; so the three methods fit the same model.

**Tuning**: on split 0, the last 10% of the training rows (a seeded permutation) are a validation
set; each learning rate of the grid runs the full budget and the one of lowest final validation
NLL is then run on every split.

**Scores** at a log-spaced grid of evaluation counts: the Bayesian model average of ``S`` weight
draws (``Prediction.outputs`` of :func:`pyro_quadvi.nn.predict`; IVON: ``opt.sampled_params()``),
its test NLL (for regression the Gaussian mixture's log density, in the targets' original units:
``+ log(y_std)``), RMSE of the predictive mean (``* y_std``), and for MNIST accuracy, ECE (15 bins)
and Brier score (:mod:`pyro_quadvi.metrics`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_value
from torch import nn
from tqdm.auto import tqdm

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, metrics
from pyro_quadvi.guides import describe_guide
from pyro_quadvi.nn import BayesianModule, likelihoods, predict, priors
from pyro_quadvi.nn.likelihoods import NOISE_SITE
from pyro_quadvi.optim.annealing import geometric_annealing
from pyro_quadvi.testing.datasets import mnist_split, regression_split

RESULTS = Path(__file__).parent / "results" / "bnn_quality.json"
IMG = Path(__file__).parent.parent / "docs" / "img"
LR_GRID = {"adam": (1e-3, 3e-3, 1e-2, 3e-2), "ivon": (1e-2, 3e-2, 1e-1, 3e-1)}
#: MNIST's grids: three values each, for the CPU budget (the 240-evaluation runs of the first
#: table, whose grids were the first two of each, chose the largest)
MNIST_LR_GRID = {"adam": (3e-3, 1e-2, 3e-2), "ivon": (1e-1, 3e-1, 1.0)}


def default_prior(kind: str) -> priors.Prior:
    """Regression: ``N(0, 1/fan_in)`` per layer ("radford"); classification: ``N(0, 1)``."""
    return priors.LayerwiseNormal("radford") if kind == "regression" else priors.Normal(1.0)


def prior_sd(prior: priors.Prior, net: nn.Module, name: str, param: torch.Tensor) -> float:
    """The prior standard deviation of every entry of the parameter ``name`` of ``net``."""
    if isinstance(prior, priors.LayerwiseNormal):
        prior.bind(net.named_parameters())
        return prior.std(name, param)
    return prior.scale


NOISE_INIT = 1.0  # the noise scale every regression method starts from (standardized targets)

SETTINGS = {
    "full": {
        "datasets": ("diabetes", "boston", "concrete"),
        "nets": ("1x50", "2x128"),
        "splits": 8,
        "evals": 1000,
        "diagnose_evals": 2000,
        "grid_points": 12,
        "draws": 32,
        "mnist_nets": ("mlp", "cnn"),
        "mnist_evals": 240,
        "mnist_batch": 128,
        "mnist_grid": 3,
        "mnist_draws": 8,
        "diagnose_splits": 2,
        "objective_splits": 3,
        "long_evals": 5000,
        "variants": (),
        "init": "default",
    },
    "quick": {
        "datasets": ("diabetes",),
        "nets": ("1x50",),
        "splits": 2,
        "evals": 60,
        "diagnose_evals": 60,
        "grid_points": 4,
        "draws": 8,
        "mnist_nets": ("mlp", "cnn"),
        "mnist_evals": 12,
        "mnist_batch": 64,
        "mnist_grid": 2,
        "mnist_draws": 4,
        "diagnose_splits": 1,
        "objective_splits": 1,
        "long_evals": 90,
        "variants": (),
        "init": "default",
    },
}


# ----------------------------------------------------------------------------- the networks


def regression_net(in_dim: int, name: str) -> nn.Sequential:
    """``"1x50"``: ``in-50-1``; ``"2x128"``: ``in-128-128-1``; ReLU activations."""
    depth, width = (int(part) for part in name.split("x"))
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(in_dim if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


class GroupMix(nn.Module):
    """A grouped 1x1 convolution, each output channel a weighted sum of its own 3 input channels,
    then ReLU: our stand-in for the ternary logic activation of the sequence paper's Table 2 (which
    maps 3 channels to 1)."""

    def __init__(self, channels_in: int, channels_out: int):
        super().__init__()
        self.mix = nn.Conv2d(channels_in, channels_out, 1, groups=channels_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.mix(x))


def table2_cnn() -> nn.Sequential:
    """The convolutional network of the sequence paper's Table 2, ReLU for its ternary units.

    The five 2x2 stride-2 convolutions (1-12, 4-48, 16-192, 64-192, 64-192 channels, no bias: the
    table's parameter counts) take the image padded to 32 x 32 down to 1 x 1; each is followed by a
    :class:`GroupMix` (12-4, 48-16, 192-64, 192-64, 192-64); a linear layer 64-10 gives the logits.
    """
    widths = ((1, 12, 4), (4, 48, 16), (16, 192, 64), (64, 192, 64), (64, 192, 64))
    layers: list[nn.Module] = [nn.ZeroPad2d(2)]
    for channels_in, channels_mid, channels_out in widths:
        layers += [
            nn.Conv2d(channels_in, channels_mid, 2, stride=2, bias=False),
            GroupMix(channels_mid, channels_out),
        ]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, 10))


def mnist_net(name: str, init: str = "default") -> nn.Sequential:
    """``"mlp"``: 784-400-400-10 with ReLU; ``"cnn"``: :func:`table2_cnn`.

    ``init="default"`` keeps PyTorch's initialization; ``init="kaiming"`` redraws every conv and
    linear weight from Kaiming's normal for ReLU, ``N(0, 2 / fan_in)``, and zeroes the biases.
    """
    if name == "cnn":
        net = table2_cnn()
    else:
        net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 400),
            nn.ReLU(),
            nn.Linear(400, 400),
            nn.ReLU(),
            nn.Linear(400, 10),
        )
    if init == "kaiming":
        for layer in net.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
    elif init != "default":
        raise ValueError(f"init must be 'default' or 'kaiming', got {init!r}")
    return net


class NoisyNet(nn.Module):
    """A regression net and ``log sigma`` of its Gaussian noise, for the plain-torch methods."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.log_noise = nn.Parameter(torch.tensor(math.log(NOISE_INIT)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


# ----------------------------------------------------------------------------- the data


@dataclass
class Task:
    """Training and test data; ``y_std`` maps standardized regression targets back (1: none)."""

    kind: str  # "regression" or "classification"
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    y_std: float = 1.0
    batch: int | None = None  # None: full batch


def holdout(task: Task, seed: int = 0) -> Task:
    """The last 10% of a seeded permutation of the training rows as the test set (tuning)."""
    n = len(task.y_train)
    order = torch.as_tensor(np.random.default_rng([seed, 99]).permutation(n))
    cut = n - n // 10
    train, val = order[:cut], order[cut:]
    return Task(
        task.kind,
        task.x_train[train],
        task.y_train[train],
        task.x_train[val],
        task.y_train[val],
        task.y_std,
        task.batch,
    )


def regression_task(name: str, split: int) -> Task:
    s = regression_split(name, split)
    return Task("regression", s.x_train, s.y_train, s.x_test, s.y_test, s.y_std)


def mnist_task(data_dir: str | None, batch: int) -> Task:
    x_train, y_train, x_test, y_test = mnist_split(data_dir)
    return Task("classification", x_train, y_train, x_test, y_test, batch=batch)


class Batches:
    """Full batch, or minibatches of a seeded permutation per epoch."""

    def __init__(self, task: Task, seed: int):
        self.task = task
        self.generator = torch.Generator().manual_seed(seed)
        self.queue: list[torch.Tensor] = []

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        task = self.task
        if task.batch is None:
            return task.x_train, task.y_train
        if not self.queue:
            order = torch.randperm(len(task.y_train), generator=self.generator)
            self.queue = list(order.split(task.batch))
            if len(self.queue[-1]) < task.batch:
                self.queue.pop()
        index = self.queue.pop(0)
        return task.x_train[index], task.y_train[index]


# ----------------------------------------------------------------------------- the scores


def scores(task: Task, outputs: torch.Tensor, noise: torch.Tensor | None) -> dict[str, float]:
    """Scores of ``S`` draws of the net's outputs ``(S, B)`` or ``(S, B, C)`` on the test set.

    Regression: the NLL of the equally weighted Gaussian mixture ``(1/S) sum_s N(f_s, noise_s^2)``
    and the RMSE of its mean, in the targets' original units. Classification: NLL, accuracy, ECE
    (15 bins) and Brier score of the averaged probabilities.
    """
    y = task.y_test
    if task.kind == "regression":
        log_density = dist.Normal(outputs, noise.reshape(-1, 1)).log_prob(y)
        nll = -(torch.logsumexp(log_density, 0) - math.log(len(outputs))).mean()
        return {
            "nll": float(nll) + math.log(task.y_std),
            "rmse": float(metrics.rmse(outputs.mean(0), y)) * task.y_std,
        }
    probs = torch.softmax(outputs, -1).mean(0)
    return {
        "nll": float(metrics.categorical_nll(probs, y)),
        "accuracy": float(metrics.accuracy(probs, y)),
        "ece": float(metrics.expected_calibration_error(probs, y)),
        "brier": float(metrics.brier_score(probs, y)),
    }


# ----------------------------------------------------------------------------- the methods


class Trainer:
    """A method on a task: ``advance(evals)`` trains up to that many gradient evaluations."""

    cost = 1  # gradient evaluations per step

    def __init__(self, task: Task, seed: int):
        self.task = task
        self.batches = Batches(task, seed)
        self.evals = 0

    def step(self) -> None:
        raise NotImplementedError

    def draws(self, num: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def advance(self, evals: int) -> None:
        while self.evals + self.cost <= evals:
            self.step()
            self.evals += self.cost


class PyroTrainer(Trainer):
    """``SVI`` on ``BayesianModule(net)`` with an ``AutoMeanFieldNormal`` at the net's weights."""

    def __init__(
        self,
        task: Task,
        net: nn.Module,
        seed: int,
        optim,
        elbo,
        model_wrap: Callable | None = None,
        noise: float | None = None,
        prior: Callable | None = None,
        likelihood_weight: int = 1,
        init_scale: float = 0.1,
    ):
        super().__init__(task, seed)
        n = len(task.y_train)
        # the likelihood counts likelihood_weight times: -ELBO / weight = -E log lik + KL / weight
        size = n * likelihood_weight
        if task.kind == "regression":
            noise_prior = None if noise else dist.LogNormal(0.0, 1.0)
            likelihood = likelihoods.Gaussian(size, scale=noise, noise_prior=noise_prior)
        else:
            likelihood = likelihoods.Categorical(size)
        prior = default_prior(task.kind) if prior is None else prior
        self.bnn = BayesianModule(net, prior, likelihood, qnvb_settings={})
        start = {name: p.detach().clone() for name, p in net.named_parameters()}
        start["noise_scale"] = torch.tensor(NOISE_INIT)
        pyro.clear_param_store()
        self.guide = AutoMeanFieldNormal(
            self.bnn, init_loc_fn=init_to_value(values=start), init_scale=init_scale
        )
        model = self.bnn if model_wrap is None else model_wrap(self.bnn)
        self.svi = SVI(model, self.guide, optim, elbo)
        if isinstance(elbo, QuadratureELBO):
            dim = sum(p.numel() for p in net.parameters())
            self.cost = elbo.rule.num_nodes(dim + (task.kind == "regression"))

    def step(self) -> None:
        self.svi.step(*self.batches())

    def draws(self, num: int):
        x = self.task.x_test
        outputs = predict(self.bnn, self.guide, x, num_samples=num).outputs
        noise = None
        if self.task.kind == "regression":
            outputs = outputs.squeeze(-1)
            noise = self.noise_draws(num)
        return outputs, noise

    def noise_draws(self, num: int) -> torch.Tensor:
        """``num`` draws of the guide's noise scale (independent of the weights' draws, as the
        mean field makes them)."""
        if self.bnn.likelihood.scale is not None:
            return torch.full((num,), self.bnn.likelihood.scale)
        with torch.no_grad(), pyro.plate("noise_draws", num, dim=-2):
            trace = poutine.trace(self.guide).get_trace(self.task.x_test)
        return trace.nodes["noise_scale"]["value"].reshape(num)


class IVONTrainer(Trainer):
    """``ivon.IVON`` on the plain net (and ``log sigma`` for regression), one sample a step."""

    def __init__(
        self, task: Task, net: nn.Module, seed: int, lr: float, prior: priors.Prior | None = None
    ):
        import ivon

        super().__init__(task, seed)
        n = len(task.y_train)
        prior = default_prior(task.kind) if prior is None else prior
        # IVON's posterior is exp(-ess (loss + wd |theta|^2 / 2)): prior precision ess * wd, so
        # each parameter's group gets wd = 1 / (N sd^2) for its prior sd (log sigma: N(0, 1))
        groups = [
            {"params": [p], "weight_decay": 1.0 / (n * prior_sd(prior, net, name, p) ** 2)}
            for name, p in net.named_parameters()
        ]
        self.model = net
        if task.kind == "regression":
            self.model = NoisyNet(net)
            groups.append({"params": [self.model.log_noise], "weight_decay": 1.0 / n})
        self.opt = ivon.IVON(groups, lr=lr, ess=n)

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task.kind == "regression":
            noise = self.model.log_noise.exp()
            return -dist.Normal(self.model(x), noise).log_prob(y).mean()
        return F.cross_entropy(self.model(x), y)

    def step(self) -> None:
        x, y = self.batches()
        with self.opt.sampled_params(train=True):
            self.opt.zero_grad()
            self.loss_of(x, y).backward()
        self.opt.step()

    def diagnostics(self) -> dict[str, float]:
        """As :func:`diagnostics` (no ELBO): the posterior's noise and weight scales."""
        sd = torch.cat(
            [
                (1.0 / (g["ess"] * (g["hess"] + g["weight_decay"]))).sqrt()
                for g in self.opt.param_groups[:-1]
            ]
        )
        task = self.task
        fit = torch.stack([self.sample_outputs(task.x_train) for _ in range(64)]).mean(0)
        return {
            "noise_median": float(self.model.log_noise.exp()),
            "weight_scale_median": float(sd.median()),
            "train_rmse_std": float(metrics.rmse(fit, task.y_train)),
        }

    def sample_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """The net on ``x`` at one draw of IVON's posterior."""
        with torch.no_grad(), self.opt.sampled_params():
            return self.model(x)

    def draws(self, num: int):
        outputs, noise = [], []
        with torch.no_grad():
            for _ in range(num):
                with self.opt.sampled_params():
                    outputs.append(self.model(self.task.x_test))
                    if self.task.kind == "regression":
                        noise.append(self.model.log_noise.exp())
        return torch.stack(outputs), torch.stack(noise) if noise else None


class MAPTrainer(Trainer):
    """The plain net by ``torch.optim.Adam`` on the mean NLL (a deterministic network)."""

    def __init__(self, task: Task, net: nn.Module, seed: int, lr: float):
        super().__init__(task, seed)
        self.model = net
        self.opt = torch.optim.Adam(net.parameters(), lr=lr)

    def step(self) -> None:
        x, y = self.batches()
        self.opt.zero_grad()
        F.cross_entropy(self.model(x), y).backward()
        self.opt.step()

    def draws(self, num: int):
        with torch.no_grad():
            return self.model(self.task.x_test).unsqueeze(0), None


#: Named variants of a method: name -> (method, its extra arguments). ``-klW``: the KL term
#: weighted by ``W`` (the likelihood by ``1/W``: a tempered, "cold" posterior).
VARIANTS = {
    "qnvb-lr0.1": ("qnvb", {"qnvb_args": {"lr": 0.1}}),
    "qnvb-trust1": ("qnvb", {"qnvb_args": {"trust_region": 1.0}}),
    "qnvb-kl0.1": ("qnvb", {"likelihood_weight": 10}),
    "qnvb-trust1-kl0.1": ("qnvb", {"qnvb_args": {"trust_region": 1.0}, "likelihood_weight": 10}),
    "adam-kl0.1": ("adam", {"likelihood_weight": 10}),
    "qnvb-wide": (
        "qnvb",
        {"qnvb_args": {"trust_region": 0.3, "scale_max": 2.0, "significance": 1.0}},
    ),
}


def make_trainer(method: str, task: Task, net: nn.Module, seed: int, lr: float | None, **extra):
    if method in VARIANTS:
        method, more = VARIANTS[method]
        extra = {**more, **extra}
    if method == "qnvb":
        qnvb = QNVB(**extra.pop("qnvb_args", {}))
        wrap = qnvb.anneal if extra.pop("anneal", False) else None
        return PyroTrainer(task, net, seed, qnvb, QuadratureELBO(), model_wrap=wrap, **extra)
    if method == "adam":
        return PyroTrainer(task, net, seed, pyro.optim.Adam({"lr": lr}), Trace_ELBO(), **extra)
    if method == "ivon":
        return IVONTrainer(task, net, seed, lr, **extra)
    if method == "map":
        return MAPTrainer(task, net, seed, lr)
    raise ValueError(f"unknown method {method!r}")


def eval_grid(max_evals: int, points: int) -> list[int]:
    """Log-spaced evaluation counts from about ``max_evals / 300`` (at least 4) to ``max_evals``."""
    low = max(4, max_evals // 300)
    grid = np.unique(np.round(np.geomspace(low, max_evals, points)).astype(int))
    return [int(e) for e in grid]


ISOLATED_SCORES = False
"""``--isolated-scores``: the scores draw from the global random state saved before them and
restored after, so the scoring grid leaves training unchanged; off by default, as in the recorded
runs, whose scores' draws moved the later Monte Carlo and random-rule draws of training."""


def run(
    method: str,
    task: Task,
    make_net: Callable[[], nn.Module],
    lr: float | None,
    grid: list[int],
    draws: int,
    seed: int = 0,
    keep: list | None = None,
    more_scores: Callable[[Trainer], dict[str, float]] | None = None,
    **extra,
) -> dict:
    """Train one method up to ``grid[-1]`` evaluations, scoring at every point of ``grid``.

    ``keep``: a list the trained :class:`Trainer` is appended to; ``more_scores(trainer)``: further
    scores recorded at every point of the grid.
    """
    pyro.set_rng_seed(seed)
    net = make_net()
    trainer = make_trainer(method, task, net, seed, lr, **extra)
    curve: dict[str, list] = {"evals": []}
    start = time.process_time()
    train_time = 0.0
    for evals in grid:
        tick = time.process_time()
        trainer.advance(evals)
        train_time += time.process_time() - tick
        if trainer.evals == 0 or (curve["evals"] and curve["evals"][-1] == trainer.evals):
            continue  # a QNVB step costs K: grid points below K, or between two steps
        rng_state = pyro.util.get_rng_state() if ISOLATED_SCORES else None
        outputs, noise = trainer.draws(draws)
        curve["evals"].append(trainer.evals)
        for name, value in scores(task, outputs, noise).items():
            curve.setdefault(name, []).append(value)
        if more_scores is not None:
            for name, value in more_scores(trainer).items():
                curve.setdefault(name, []).append(value)
        if rng_state is not None:
            pyro.util.set_rng_state(rng_state)
    result = {
        "curve": curve,
        "final": {name: values[-1] for name, values in curve.items() if name != "evals"},
        "cost": trainer.cost,
        "cpu_s": time.process_time() - start,
        "train_cpu_s": train_time,
        "lr": lr,
        "log_y_std": math.log(task.y_std),
    }
    if isinstance(trainer, PyroTrainer):
        result.update(diagnostics(trainer))
    elif isinstance(trainer, IVONTrainer) and task.kind == "regression":
        result.update(trainer.diagnostics())
    if keep is not None:
        keep.append(trainer)
    return result


def diagnostics(trainer: PyroTrainer) -> dict:
    """The fitted guide: its noise scale, its weights' scales and a 64-draw ELBO estimate."""
    pyro.set_rng_seed(123)
    out: dict[str, float] = {}
    with torch.no_grad():
        medians = trainer.guide.median()
        if "noise_scale" in medians:
            out["noise_median"] = float(medians["noise_scale"])
        scale = describe_guide(trainer.guide).scale
        out["weight_scale_median"] = float(
            scale[:-1].median() if "noise_scale" in medians else scale.median()
        )
        task = trainer.task
        if task.kind != "regression":
            return out
        elbo = Trace_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1)
        out["neg_elbo"] = float(elbo.loss(trainer.bnn, trainer.guide, task.x_train, task.y_train))
        pred = predict(trainer.bnn, trainer.guide, task.x_train, num_samples=64)
        out["train_rmse_std"] = float(metrics.rmse(pred.mean.squeeze(-1), task.y_train))
    return out


# ----------------------------------------------------------------------------- the objective


@dataclass
class Posterior:
    """A mean-field Gaussian in the unconstrained space: site -> mean and standard deviation, for
    the net's parameters (in the net's order) and ``log sigma`` (the site ``"noise_scale"``)."""

    loc: dict[str, torch.Tensor]
    sd: dict[str, torch.Tensor]


def posterior_of(trainer: Trainer) -> Posterior:
    """The fitted posterior: the guide's sites, or IVON's as the Gaussian its ``sampled_params``
    draws from: the mean and ``1 / sqrt(ess (hess + weight_decay))`` per entry."""
    if isinstance(trainer, PyroTrainer):
        sites = {site.name: site for site in describe_guide(trainer.guide).sites}
        names = [*trainer.bnn.latent_parameters(), *[NOISE_SITE][: NOISE_SITE in sites]]
        return Posterior(
            {name: sites[name].loc.detach().clone() for name in names},
            {name: sites[name].scale.detach().clone() for name in names},
        )
    if isinstance(trainer.model, NoisyNet):
        names = [name for name, _ in trainer.model.net.named_parameters()] + [NOISE_SITE]
    else:
        names = [name for name, _ in trainer.model.named_parameters()]
    loc, sd = {}, {}
    for name, group in zip(names, trainer.opt.param_groups, strict=True):
        (param,) = group["params"]
        loc[name] = param.detach().clone()
        precision = group["ess"] * (group["hess"] + group["weight_decay"])
        sd[name] = precision.rsqrt().reshape(param.shape)
    return Posterior(loc, sd)


def ivon_spread(trainer: IVONTrainer, posterior: Posterior, num: int = 256) -> dict[str, float]:
    """IVON's own ``num`` draws (``sampled_params``) against ``posterior.sd``: quantiles over the
    entries of (sample standard deviation) / sd; 1 up to the sampling error ``1/sqrt(2 num)``."""
    model = trainer.model
    if isinstance(model, NoisyNet):  # IVON's groups: the net's parameters, then log sigma
        params = [*model.net.parameters(), model.log_noise]
    else:
        params = list(model.parameters())
    with torch.no_grad():
        draws = []
        for _ in range(num):
            with trainer.opt.sampled_params():
                draws.append(torch.cat([p.detach().flatten() for p in params]))
        ratio = torch.stack(draws).std(0) / torch.cat([v.flatten() for v in posterior.sd.values()])
    quantiles = ratio.quantile(torch.tensor([0.01, 0.5, 0.99]))
    return {f"spread_ratio_q{q}": float(v) for q, v in zip((1, 50, 99), quantiles, strict=True)}


def gaussian_kl(loc: torch.Tensor, sd: torch.Tensor, prior_sd: float) -> torch.Tensor:
    """``sum KL(N(loc, sd^2) || N(0, prior_sd^2))`` over the entries, in closed form."""
    ratio = (sd / prior_sd) ** 2
    return 0.5 * (ratio + (loc / prior_sd) ** 2 - 1.0 - ratio.log()).sum()


def objective(
    task: Task,
    net: nn.Module,
    posterior: Posterior,
    draws: int,
    seed: int,
    chunk: int = 64,
    prior: priors.Prior | None = None,
) -> dict[str, float]:
    """The model's ``-ELBO`` of ``posterior`` (regression: standardized targets) and its scores.

    ``-ELBO = -E_q[log p(y | w, ...)] + KL(q || p)`` (rasp paper, eq. 1), the model every method
    fits: ``BayesianModule(net, prior, likelihood)`` (``prior``: ``default_prior(task.kind)``
    unless given), for regression with the noise prior ``LogNormal(0, 1)``. The expected log
    likelihood of the training set by ``draws`` Monte Carlo draws (the same standard normal draws
    for every posterior given ``seed``: common random numbers; ``chunk`` draws at a time), the KL in
    closed form: per weight against its Gaussian prior, and ``N(0, 1)`` on ``log sigma`` (the exp's
    Jacobian cancels between ``p`` and ``q``). The same draws score the test set (Bayesian model
    average, as :func:`scores`); ``point_*``: the net at the means (regression: ``sigma = exp(mean
    of log sigma)``).
    """
    regression = task.kind == "regression"
    prior = default_prior(task.kind) if prior is None else prior
    # the module only names the latent parameters here (its likelihood is never evaluated: the
    # expected log likelihood is computed below from the task's own kind)
    bnn = BayesianModule(net, prior, likelihoods.Categorical(len(task.y_train)))
    generator = torch.Generator().manual_seed(seed)
    weights, kl = {}, 0.0
    for name, param in bnn.latent_parameters().items():
        loc, sd = posterior.loc[name], posterior.sd[name]
        weights[name] = loc + sd * torch.randn((draws, *loc.shape), generator=generator)
        kl += float(gaussian_kl(loc, sd, prior_sd(prior, net, name, param)))
    noise = point_noise = None
    if regression:
        loc, sd = posterior.loc[NOISE_SITE], posterior.sd[NOISE_SITE]
        noise = (loc + sd * torch.randn(draws, generator=generator)).exp()
        point_noise = loc.exp().reshape(1)
        kl += float(gaussian_kl(loc, sd, 1.0))

    def outputs(x: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        out = bnn.evaluate(values, x)
        return out.squeeze(-1) if regression else out

    def log_lik(i: int) -> torch.Tensor:
        part = outputs(task.x_train, {name: w[i : i + chunk] for name, w in weights.items()})
        if regression:
            return dist.Normal(part, noise[i : i + chunk, None]).log_prob(task.y_train).sum(-1)
        return dist.Categorical(logits=part).log_prob(task.y_train).sum(-1)

    with torch.no_grad():
        train = torch.cat([log_lik(i) for i in range(0, draws, chunk)])
        test = torch.cat(
            [
                outputs(task.x_test, {name: w[i : i + chunk] for name, w in weights.items()})
                for i in range(0, draws, chunk)
            ]
        )
        test = scores(task, test, noise)
        point = outputs(task.x_test, {name: posterior.loc[name] for name in weights})
        point = scores(task, point.unsqueeze(0), point_noise)
    ell = float(train.mean())
    sds = torch.cat([posterior.sd[name].flatten() for name in weights])
    out = {
        "neg_elbo": kl - ell,
        "neg_ell": -ell,
        "ell_se": float(train.std() / math.sqrt(draws)),
        "kl": kl,
        "sd_median": float(sds.median()),
        **{f"test_{key}": value for key, value in test.items()},
        **{f"point_{key}": value for key, value in point.items()},
    }
    if regression:
        out["noise"] = float(point_noise)
    return out


# ----------------------------------------------------------------------------- the cache


class Cache:
    """The JSON of every run, written after each one."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict = json.loads(path.read_text()) if path.exists() else {}

    def get_or_run(self, key: str, bar: tqdm, fn: Callable[..., dict], *args, **kwargs) -> dict:
        """The run ``key`` from the cache, or ``fn(*args, **kwargs)`` stored under it."""
        if key not in self.data:
            bar.set_description(key)
            self.put(key, fn(*args, **kwargs))
        bar.update()
        return self.data[key]

    def put(self, key: str, value: dict) -> None:
        """Store ``value`` under ``key`` and write the file."""
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True))


def tuned_lr(cache: Cache, prefix: str, method: str, grid: dict = LR_GRID) -> float:
    """The learning rate of lowest final validation NLL among the cached tuning runs."""
    runs = {lr: cache.data[f"{prefix}/{method}/lr={lr}"] for lr in grid[method]}
    return min(runs, key=lambda lr: nan_last(runs[lr]["final"]["nll"]))


def nan_last(value: float) -> float:
    return math.inf if not math.isfinite(value) else value


# ----------------------------------------------------------------------------- the parts


def regression_lrs(tune: Cache, s: dict, name: str, net_name: str) -> dict[str, float]:
    """Adam's and IVON's learning rates for a cell: the grid's runs on split 0's holdout at the
    budget ``s["evals"]``, read from ``tune`` (or run into it), the lowest validation NLL."""
    grid = eval_grid(s["evals"], s["grid_points"])
    tune_task = holdout(regression_task(name, 0))
    make = partial(regression_net, tune_task.x_train.shape[1], net_name)
    prefix = f"tune/{name}/{net_name}"
    bar = tqdm(total=sum(len(lrs) for lrs in LR_GRID.values()), desc=prefix, leave=False)
    for method in ("adam", "ivon"):
        for lr in LR_GRID[method]:
            key = f"{prefix}/{method}/lr={lr}"
            tune.get_or_run(key, bar, run, method, tune_task, make, lr, grid, s["draws"])
    bar.close()
    return {m: tuned_lr(tune, prefix, m) for m in ("adam", "ivon")}


def part_regression(cache: Cache, s: dict, tune: Cache, reuse: Cache | None = None) -> None:
    """Every cell and split: QNVB, its ``s["variants"]``, and Adam and IVON at the learning rates
    tuned on split 0 (tuning runs read from, or run into, ``tune``); ``s["methods"]``, when set,
    replaces that list. A run absent from ``cache`` is copied from ``reuse`` where ``reuse`` holds
    it at the same learning rate (same data, seed and budget; as recorded there), not rerun."""
    grid = eval_grid(s["evals"], s["grid_points"])
    methods = s.get("methods") or ("qnvb", *s["variants"], "adam", "ivon")
    total = len(s["datasets"]) * len(s["nets"]) * len(methods) * s["splits"]
    bar = tqdm(total=total, desc="regression")
    for name in s["datasets"]:
        for net_name in s["nets"]:
            lrs = regression_lrs(tune, s, name, net_name)
            make = partial(regression_net, regression_task(name, 0).x_train.shape[1], net_name)
            for split in range(s["splits"]):
                task = regression_task(name, split)
                for method in methods:
                    key = f"regression/{name}/{net_name}/{method}/split{split}"
                    args = (method, task, make, lrs.get(method), grid, s["draws"])
                    same = reuse.data.get(key) if reuse is not None else None
                    if key not in cache.data and same and same["lr"] == lrs.get(method):
                        cache.put(key, same)
                    cache.get_or_run(key, bar, run, *args, seed=split)
    bar.close()


#: The cells, methods and remedies of ``--part objective``, and the posteriors it swaps:
#: label -> (the means' method, the standard deviations' method).
OBJECTIVE_CELLS = (("diabetes", "1x50"), ("boston", "2x128"), ("concrete", "2x128"))
OBJECTIVE_METHODS = ("qnvb", "qnvb-trust1", "adam", "ivon")
REMEDIES = ("qnvb-kl0.1", "qnvb-trust1-kl0.1")
SWAPS = {
    "qnvb means, ivon sd": ("qnvb", "ivon"),
    "ivon means, qnvb sd": ("ivon", "qnvb"),
    "adam means, ivon sd": ("adam", "ivon"),
    "ivon means, adam sd": ("ivon", "adam"),
}
#: Monte Carlo draws of the objective's expected log likelihood (and of the long runs' curve)
OBJECTIVE_DRAWS = {"final": 256, "curve": 64}


def part_objective(cache: Cache, s: dict, tune: Cache) -> None:
    """Is QNVB's gap to IVON the objective or the optimizer? On :data:`OBJECTIVE_CELLS`, splits
    ``0 .. s["objective_splits"] - 1``: every method of :data:`OBJECTIVE_METHODS` and
    :data:`REMEDIES` trained as in ``part_regression`` (and stored under its keys), the
    :func:`objective` of each final posterior and of the :data:`SWAPS`, IVON's :func:`ivon_spread`,
    and QNVB (defaults) run to ``s["long_evals"]`` with its ``-ELBO`` along the way."""
    grid = eval_grid(s["evals"], s["grid_points"])
    long_grid = eval_grid(s["long_evals"], s["grid_points"] + 2)
    cells = [c for c in OBJECTIVE_CELLS if c[0] in s["datasets"] and c[1] in s["nets"]]
    bar = tqdm(total=len(cells) * s["objective_splits"], desc="objective")
    for name, net_name in cells:
        lrs = regression_lrs(tune, s, name, net_name)
        for split in range(s["objective_splits"]):
            key = f"objective/{name}/{net_name}/split{split}"
            if key in cache.data:
                bar.update()
                continue
            bar.set_description(key)
            task = regression_task(name, split)
            make = partial(regression_net, task.x_train.shape[1], net_name)
            seed = 1000 + split  # the objective's Monte Carlo draws, shared by every posterior
            posteriors, out = {}, {}
            for method in (*OBJECTIVE_METHODS, *REMEDIES):
                keep: list[Trainer] = []
                lr = lrs.get(method.split("-")[0])
                result = run(method, task, make, lr, grid, s["draws"], seed=split, keep=keep)
                run_key = f"regression/{name}/{net_name}/{method}/split{split}"
                if run_key not in cache.data:
                    cache.put(run_key, result)
                posteriors[method] = posterior_of(keep[0])
                if method == "ivon":
                    out["ivon spread"] = ivon_spread(keep[0], posteriors[method])
            for label, (means, sds) in SWAPS.items():
                posteriors[label] = Posterior(posteriors[means].loc, posteriors[sds].sd)
            for label, posterior in posteriors.items():
                out[label] = objective(task, make(), posterior, OBJECTIVE_DRAWS["final"], seed)

            def neg_elbo(trainer: Trainer, task=task, make=make, seed=seed) -> dict[str, float]:
                draws = OBJECTIVE_DRAWS["curve"]
                value = objective(task, make(), posterior_of(trainer), draws, seed)
                return {"neg_elbo": value["neg_elbo"], "kl": value["kl"]}

            args = ("qnvb", task, make, None, long_grid, s["draws"])
            long_run = run(*args, seed=split, more_scores=neg_elbo)
            cache.put(f"long/{name}/{net_name}/qnvb/split{split}", long_run)
            cache.put(key, out)
            bar.update()
    bar.close()


#: The step cap the diabetes runs point to (``QNVB``'s default ``lr`` is 1.0), on every cell.
PROPOSED_LR = 0.1


def part_qnvb_lr(cache: Cache, s: dict, data_dir: str | None) -> None:
    """QNVB with ``lr=PROPOSED_LR`` (all else default) on every regression cell and split, and
    on MNIST when its directory is given."""
    method = f"qnvb-lr{PROPOSED_LR:g}"
    qnvb_args = {"lr": PROPOSED_LR}
    if data_dir is not None or os.environ.get("PYRO_QUADVI_DATA"):
        task = mnist_task(data_dir, s["mnist_batch"])
        grid = eval_grid(s["mnist_evals"], s["mnist_grid"])
        bar = tqdm(total=len(s["mnist_nets"]), desc="qnvb lr, mnist")
        for net_name in s["mnist_nets"]:
            args = ("qnvb", task, partial(mnist_net, net_name), None, grid, s["mnist_draws"])
            cache.get_or_run(f"mnist/{net_name}/{method}", bar, run, *args, qnvb_args=qnvb_args)
        bar.close()
    grid = eval_grid(s["evals"], s["grid_points"])
    bar = tqdm(total=len(s["datasets"]) * len(s["nets"]) * s["splits"], desc="qnvb lr")
    for name in s["datasets"]:
        for net_name in s["nets"]:
            for split in range(s["splits"]):
                task = regression_task(name, split)
                make = partial(regression_net, task.x_train.shape[1], net_name)
                key = f"regression/{name}/{net_name}/{method}/split{split}"
                args = ("qnvb", task, make, None, grid, s["draws"])
                cache.get_or_run(key, bar, run, *args, seed=split, qnvb_args=qnvb_args)
    bar.close()


MAP_LR = 1e-3


#: ``--part objective-mnist``: the MNIST methods whose posteriors are scored, and the draws
MNIST_OBJECTIVE_METHODS = ("qnvb", "qnvb-trust1", "qnvb-trust1-kl0.1", "adam", "ivon")
MNIST_OBJECTIVE_DRAWS = 16


def objective_mnist_variants() -> tuple[str, ...]:
    """The QNVB variants among :data:`MNIST_OBJECTIVE_METHODS` (run by ``--part mnist``)."""
    return tuple(m for m in MNIST_OBJECTIVE_METHODS if m in VARIANTS)


def part_objective_mnist(cache: Cache, s: dict, data_dir: str | None) -> None:
    """:func:`objective` of the MNIST MLP's final posteriors (and the :data:`SWAPS`): each method
    of :data:`MNIST_OBJECTIVE_METHODS` trained again as ``part_mnist`` trained it (which must have
    run: its learning rates; the rerun's final test NLL is recorded beside the cached one)."""
    grid = eval_grid(s["mnist_evals"], s["mnist_grid"])
    task = mnist_task(data_dir, s["mnist_batch"])
    key = "objective/mnist/mlp/split0"
    if key in cache.data:
        return
    needed = [mnist_key("mlp", m) for m in MNIST_OBJECTIVE_METHODS] + [
        f"tune/mnist/mlp/{m}/lr={lr}" for m in ("adam", "ivon") for lr in MNIST_LR_GRID[m]
    ]
    missing = [k for k in needed if k not in cache.data]
    if missing:
        raise SystemExit(
            f"--part objective-mnist compares with the runs of --part mnist, missing from "
            f"{cache.path}: {', '.join(missing)}; run --part mnist --mnist-nets mlp --variants "
            f"{' '.join(objective_mnist_variants())} with the same --results first"
        )
    make = partial(mnist_net, "mlp")
    lrs = {m: tuned_lr(cache, "tune/mnist/mlp", m, MNIST_LR_GRID) for m in ("adam", "ivon")}
    posteriors, out = {}, {}
    bar = tqdm(total=len(MNIST_OBJECTIVE_METHODS), desc=key)
    for method in MNIST_OBJECTIVE_METHODS:
        keep: list[Trainer] = []
        result = run(method, task, make, lrs.get(method), grid, s["mnist_draws"], keep=keep)
        out[f"rerun {method}"] = {
            "nll": result["final"]["nll"],
            "cached_nll": cache.data[f"mnist/mlp/{method}"]["final"]["nll"],
        }
        posteriors[method] = posterior_of(keep[0])
        if method == "ivon":
            out["ivon spread"] = ivon_spread(keep[0], posteriors[method], num=64)
        bar.update()
    bar.close()
    for label, (means, sds) in SWAPS.items():
        posteriors[label] = Posterior(posteriors[means].loc, posteriors[sds].sd)
    for label, posterior in tqdm(posteriors.items(), desc="objective"):
        out[label] = objective(task, make(), posterior, MNIST_OBJECTIVE_DRAWS, 1000, chunk=4)
    cache.put(key, out)


def mnist_key(net_name: str, method: str, seed: int = 0) -> str:
    """The cache key of an MNIST run: ``mnist/<net>/<method>`` from seed 0 (the recorded runs),
    ``seed<k>/mnist/<net>/<method>`` from seed ``k``."""
    key = f"mnist/{net_name}/{method}"
    return key if seed == 0 else f"seed{seed}/{key}"


def part_mnist(
    cache: Cache, s: dict, data_dir: str | None, tune: Cache | None = None, seed: int = 0
) -> None:
    """Every MNIST network (from ``s["init"]``): Adam's and IVON's learning rates tuned on a
    validation split, then QNVB, its variants, Adam, IVON and the deterministic net.

    The tuning runs are always from seed 0, read from ``tune`` (default ``cache``) or run into it;
    ``seed`` (the net's initialization, the minibatch order, the Monte Carlo draws; the data split
    stays ``mnist_split``'s) applies to the final runs only, stored under :func:`mnist_key`. So
    another seed reuses seed 0's learning rates and does not retune.
    """
    tune = cache if tune is None else tune
    grid = eval_grid(s["mnist_evals"], s["mnist_grid"])
    task = mnist_task(data_dir, s["mnist_batch"])
    tune_task = holdout(task)
    runs = sum(len(grid) for grid in MNIST_LR_GRID.values()) + 4 + len(s["variants"])
    bar = tqdm(total=len(s["mnist_nets"]) * runs, desc="mnist")
    for net_name in s["mnist_nets"]:
        make = partial(mnist_net, net_name, s["init"])
        prefix = f"tune/mnist/{net_name}"
        for method in ("adam", "ivon"):
            for lr in MNIST_LR_GRID[method]:
                args = (method, tune_task, make, lr, grid, s["mnist_draws"])
                tune.get_or_run(f"{prefix}/{method}/lr={lr}", bar, run, *args)
        lrs = {
            "qnvb": None,
            **{variant: None for variant in s["variants"]},
            "adam": tuned_lr(tune, prefix, "adam", MNIST_LR_GRID),
            "ivon": tuned_lr(tune, prefix, "ivon", MNIST_LR_GRID),
            "map": MAP_LR,
        }
        for method, lr in lrs.items():
            if s.get("methods") and method not in s["methods"]:
                continue
            args = (method, task, make, lr, grid, s["mnist_draws"])
            cache.get_or_run(mnist_key(net_name, method, seed), bar, run, *args, seed=seed)
    bar.close()


#: The controlled runs on diabetes, 1x50: name -> (method, arguments).
DIAGNOSE = {
    "qnvb": ("qnvb", {}),
    "adam tuned": ("adam", {}),
    "ivon tuned": ("ivon", {}),
    "qnvb, lr 0.1": ("qnvb", {"qnvb_args": {"lr": 0.1}}),
    "qnvb, scale_max 2": ("qnvb", {"qnvb_args": {"scale_max": 2.0}}),
    "qnvb, noise fixed at 0.75": ("qnvb", {"noise": 0.75}),
    "qnvb, prior N(0, 1)": ("qnvb", {"prior": priors.Normal(1.0)}),
    "adam lr 0.01, prior N(0, 1)": ("adam", {"prior": priors.Normal(1.0), "lr": 0.01}),
    "ivon lr 0.1, prior N(0, 1)": ("ivon", {"prior": priors.Normal(1.0), "lr": 0.1}),
    "qnvb, lr 0.1, prior N(0, 1)": (
        "qnvb",
        {"prior": priors.Normal(1.0), "qnvb_args": {"lr": 0.1}},
    ),
    "qnvb, annealing from 0.01 over half the budget": ("qnvb", {"anneal": True}),
}


def part_diagnose(cache: Cache, s: dict) -> None:
    name, net_name = "diabetes", "1x50"
    lrs = {m: tuned_lr(cache, f"tune/{name}/{net_name}", m) for m in ("adam", "ivon")}
    bar = tqdm(total=len(DIAGNOSE) * s["diagnose_splits"], desc="diagnose")
    evals = s["diagnose_evals"]
    for label, (method, extra) in DIAGNOSE.items():
        grid = eval_grid(evals, s["grid_points"] + 1)
        for split in range(s["diagnose_splits"]):
            task = regression_task(name, split)
            d = task.x_train.shape[1]
            kwargs = dict(extra)
            run_lr = kwargs.pop("lr", lrs.get(method))
            if kwargs.get("anneal"):
                dim = sum(p.numel() for p in regression_net(d, net_name).parameters()) + 1
                steps = evals // 2 // QuadratureELBO().rule.num_nodes(dim)
                kwargs["qnvb_args"] = {"annealing": geometric_annealing(0.01, num_steps=steps)}
            make = partial(regression_net, d, net_name)
            args = (method, task, make, run_lr, grid, s["draws"])
            cache.get_or_run(
                f"diagnose/{label}/split{split}", bar, run, *args, seed=split, **kwargs
            )
    bar.close()


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=(
            "regression",
            "mnist",
            "diagnose",
            "qnvb-lr",
            "objective",
            "objective-mnist",
            "all",
        ),
        default="regression",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (its own JSON)")
    parser.add_argument("--report", action="store_true", help="markdown and figures from the JSON")
    parser.add_argument("--results", type=Path, help="the JSON (default benchmarks/results/...)")
    parser.add_argument(
        "--data-dir", help="the MNIST directory (default: $PYRO_QUADVI_DATA/mnist-t10k)"
    )
    parser.add_argument("--evals", type=int, help="regression budget in gradient evaluations")
    parser.add_argument("--splits", type=int, help="regression splits")
    parser.add_argument("--mnist-evals", type=int, help="MNIST budget in gradient evaluations")
    parser.add_argument("--mnist-grid", type=int, help="MNIST scoring points")
    parser.add_argument("--mnist-nets", nargs="+", choices=("mlp", "cnn"), help="MNIST networks")
    parser.add_argument("--long-evals", type=int, help="budget of --part objective's long run")
    parser.add_argument(
        "--variants", nargs="+", choices=sorted(VARIANTS), help="QNVB variants run beside it"
    )
    parser.add_argument(
        "--init",
        choices=("default", "kaiming"),
        help="the MNIST networks' initialization (--part mnist; default: PyTorch's)",
    )
    parser.add_argument(
        "--reuse-tuning",
        type=Path,
        help="the JSON the tuning runs (regression; --part mnist: MNIST's, from the same --init) "
        "are read from (and run into); default --results",
    )
    parser.add_argument(
        "--seed0-results",
        type=Path,
        nargs="+",
        help="--report: the JSONs whose seed-0 MNIST runs go beside the other seeds' runs of "
        "--results (one network's at a time)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="--part mnist only: the seed of the final runs (the net's initialization, the "
        "minibatches, the Monte Carlo draws; the data split stays fixed); the learning rates are "
        "tuned from seed 0 (pass --reuse-tuning to read them from the seed-0 JSON); default 0",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=("qnvb", "adam", "ivon", *sorted(VARIANTS)),
        help="--part regression or mnist: run only these methods (default: qnvb, --variants, "
        "adam, ivon; and map on MNIST)",
    )
    parser.add_argument(
        "--isolated-scores",
        action="store_true",
        help="score from a saved and restored random state, so that the scoring grid does not "
        "change training (off in the recorded runs; use its own --results)",
    )
    parser.add_argument(
        "--reuse-runs",
        type=Path,
        help="--part regression: copy a run from this JSON where it has the same key and lr",
    )
    options = parser.parse_args(argv)
    for seed0_path in options.seed0_results or []:
        if not seed0_path.exists():
            parser.error(f"--seed0-results: no such file {seed0_path}")
    if options.seed < 0:
        parser.error(f"--seed must be a non-negative integer, got {options.seed}")
    if options.seed != 0 and (options.part != "mnist" or options.report):
        parser.error(
            "--seed applies to --part mnist only (the other parts and --report are seed 0); "
            "drop --seed or pass --part mnist without --report"
        )
    global ISOLATED_SCORES
    ISOLATED_SCORES = options.isolated_scores
    torch.set_num_threads(1)
    pyro.enable_validation(False)  # Pyro's argument checks cost every method alike; off for all
    s = dict(SETTINGS["quick" if options.quick else "full"])
    for name in (
        "evals",
        "splits",
        "mnist_evals",
        "mnist_grid",
        "mnist_nets",
        "long_evals",
        "init",
    ):
        if getattr(options, name) is not None:
            s[name] = getattr(options, name)
    if options.variants:
        s["variants"] = tuple(options.variants)
    if options.methods:
        s["methods"] = tuple(options.methods)
    path = options.results or (
        RESULTS.with_name("bnn_quality_quick.json") if options.quick else RESULTS
    )
    cache = Cache(path)
    tune = Cache(options.reuse_tuning) if options.reuse_tuning else cache
    if options.report:
        from bnn_quality_report import report, seed0_runs

        # a smoke run's figures go to the temporary directory, not over the docs' figures
        img = Path(tempfile.gettempdir()) if options.quick else IMG
        seed0 = seed0_runs([Cache(p).data for p in options.seed0_results or []])
        print(report(cache.data, s, img, stem=path.stem, seed0=seed0))
        return
    if options.part in ("objective", "all"):
        part_objective(cache, s, tune)
    if options.part in ("regression", "diagnose", "all"):
        part_regression(cache, s, tune, Cache(options.reuse_runs) if options.reuse_runs else None)
    if options.part == "mnist":
        part_mnist(cache, s, options.data_dir, tune, options.seed)
    if options.part == "all":  # with the variants that --part objective-mnist compares with
        variants = s["variants"] + tuple(
            v for v in objective_mnist_variants() if v not in s["variants"]
        )
        part_mnist(cache, {**s, "variants": variants}, options.data_dir, tune, options.seed)
    if options.part in ("objective-mnist", "all"):
        part_objective_mnist(cache, s, options.data_dir)
    if options.part in ("diagnose", "all"):
        part_diagnose(cache, s)
    if options.part in ("qnvb-lr", "all"):
        part_qnvb_lr(cache, s, options.data_dir)


if __name__ == "__main__":
    main()
