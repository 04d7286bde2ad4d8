"""Quality of Bayesian networks at equal gradient evaluations (issue 11, "Quality").

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part regression
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part mnist --data-dir D
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part diagnose
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_bnn_quality.py --part qnvb-lr --data-dir D
    python benchmarks/bench_bnn_quality.py --report          # tables and figures from the JSON
    python benchmarks/bench_bnn_quality.py --quick --part all --data-dir D   # smoke run

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

``bnn`` is ``BayesianModule(net, default_prior(kind), likelihood)`` (regression:
``priors.LayerwiseNormal("radford")``; MNIST: ``priors.Normal(1.0)``), the guide
``AutoMeanFieldNormal(bnn, init_loc_fn=init_to_value(the net's own initialization))``, so every
method starts at the same weights (PyTorch's default initialization, seeded). Regression uses a
learned homoscedastic noise: ``likelihoods.Gaussian(N, scale=None, noise_prior=LogNormal(0, 1))``,
a Gaussian prior ``N(0, 1)`` on ``log sigma``, which is exactly what IVON's weight decay puts on a
``log sigma`` parameter trained alongside the net; so the three methods fit the same model.

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
from pyro_quadvi.optim.annealing import geometric_annealing
from pyro_quadvi.testing.datasets import mnist_split, regression_split

RESULTS = Path(__file__).parent / "results" / "bnn_quality.json"
IMG = Path(__file__).parent.parent / "docs" / "img"
LR_GRID = {"adam": (1e-3, 3e-3, 1e-2, 3e-2), "ivon": (1e-2, 3e-2, 1e-1, 3e-1)}
#: MNIST's grids: two values each, for the CPU budget
MNIST_LR_GRID = {"adam": (3e-3, 1e-2), "ivon": (1e-1, 3e-1)}


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


def mnist_net(name: str) -> nn.Sequential:
    """``"mlp"``: 784-400-400-10 with ReLU; ``"cnn"``: :func:`table2_cnn`."""
    if name == "cnn":
        return table2_cnn()
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 400),
        nn.ReLU(),
        nn.Linear(400, 400),
        nn.ReLU(),
        nn.Linear(400, 10),
    )


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
    ):
        super().__init__(task, seed)
        n = len(task.y_train)
        if task.kind == "regression":
            noise_prior = None if noise else dist.LogNormal(0.0, 1.0)
            likelihood = likelihoods.Gaussian(n, scale=noise, noise_prior=noise_prior)
        else:
            likelihood = likelihoods.Categorical(n)
        prior = default_prior(task.kind) if prior is None else prior
        self.bnn = BayesianModule(net, prior, likelihood)
        start = {name: p.detach().clone() for name, p in net.named_parameters()}
        start["noise_scale"] = torch.tensor(NOISE_INIT)
        pyro.clear_param_store()
        self.guide = AutoMeanFieldNormal(self.bnn, init_loc_fn=init_to_value(values=start))
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


def make_trainer(method: str, task: Task, net: nn.Module, seed: int, lr: float | None, **extra):
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


def run(
    method: str,
    task: Task,
    make_net: Callable[[], nn.Module],
    lr: float | None,
    grid: list[int],
    draws: int,
    seed: int = 0,
    **extra,
) -> dict:
    """Train one method up to ``grid[-1]`` evaluations, scoring at every point of ``grid``."""
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
        outputs, noise = trainer.draws(draws)
        curve["evals"].append(trainer.evals)
        for name, value in scores(task, outputs, noise).items():
            curve.setdefault(name, []).append(value)
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
            self.data[key] = fn(*args, **kwargs)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        bar.update()
        return self.data[key]


def tuned_lr(cache: Cache, prefix: str, method: str, grid: dict = LR_GRID) -> float:
    """The learning rate of lowest final validation NLL among the cached tuning runs."""
    runs = {lr: cache.data[f"{prefix}/{method}/lr={lr}"] for lr in grid[method]}
    return min(runs, key=lambda lr: nan_last(runs[lr]["final"]["nll"]))


def nan_last(value: float) -> float:
    return math.inf if not math.isfinite(value) else value


# ----------------------------------------------------------------------------- the parts


def part_regression(cache: Cache, s: dict) -> None:
    grid = eval_grid(s["evals"], s["grid_points"])
    total = len(s["datasets"]) * len(s["nets"]) * (8 + 3 * s["splits"])
    bar = tqdm(total=total, desc="regression")
    for name in s["datasets"]:
        for net_name in s["nets"]:
            tune_task = holdout(regression_task(name, 0))
            make = partial(regression_net, tune_task.x_train.shape[1], net_name)
            prefix = f"tune/{name}/{net_name}"
            for method in ("adam", "ivon"):
                for lr in LR_GRID[method]:
                    key = f"{prefix}/{method}/lr={lr}"
                    cache.get_or_run(key, bar, run, method, tune_task, make, lr, grid, s["draws"])
            lrs = {"qnvb": None, **{m: tuned_lr(cache, prefix, m) for m in ("adam", "ivon")}}
            for split in range(s["splits"]):
                task = regression_task(name, split)
                for method, lr in lrs.items():
                    key = f"regression/{name}/{net_name}/{method}/split{split}"
                    args = (method, task, make, lr, grid, s["draws"])
                    cache.get_or_run(key, bar, run, *args, seed=split)
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


def part_mnist(cache: Cache, s: dict, data_dir: str | None) -> None:
    grid = eval_grid(s["mnist_evals"], s["mnist_grid"])
    task = mnist_task(data_dir, s["mnist_batch"])
    tune_task = holdout(task)
    bar = tqdm(total=len(s["mnist_nets"]) * 8, desc="mnist")
    for net_name in s["mnist_nets"]:
        make = partial(mnist_net, net_name)
        prefix = f"tune/mnist/{net_name}"
        for method in ("adam", "ivon"):
            for lr in MNIST_LR_GRID[method]:
                args = (method, tune_task, make, lr, grid, s["mnist_draws"])
                cache.get_or_run(f"{prefix}/{method}/lr={lr}", bar, run, *args)
        lrs = {
            "qnvb": None,
            "adam": tuned_lr(cache, prefix, "adam", MNIST_LR_GRID),
            "ivon": tuned_lr(cache, prefix, "ivon", MNIST_LR_GRID),
            "map": MAP_LR,
        }
        for method, lr in lrs.items():
            args = (method, task, make, lr, grid, s["mnist_draws"])
            cache.get_or_run(f"mnist/{net_name}/{method}", bar, run, *args)
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
        choices=("regression", "mnist", "diagnose", "qnvb-lr", "all"),
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
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    pyro.enable_validation(False)  # Pyro's argument checks cost every method alike; off for all
    s = dict(SETTINGS["quick" if options.quick else "full"])
    for name in ("evals", "splits", "mnist_evals"):
        if getattr(options, name) is not None:
            s[name] = getattr(options, name)
    path = options.results or (
        RESULTS.with_name("bnn_quality_quick.json") if options.quick else RESULTS
    )
    cache = Cache(path)
    if options.report:
        from bnn_quality_report import report

        # a smoke run's figures go to the temporary directory, not over the docs' figures
        print(report(cache.data, s, Path(tempfile.gettempdir()) if options.quick else IMG))
        return
    if options.part in ("regression", "diagnose", "all"):
        part_regression(cache, s)
    if options.part in ("mnist", "all"):
        part_mnist(cache, s, options.data_dir)
    if options.part in ("diagnose", "all"):
        part_diagnose(cache, s)
    if options.part in ("qnvb-lr", "all"):
        part_qnvb_lr(cache, s, options.data_dir)


if __name__ == "__main__":
    main()
