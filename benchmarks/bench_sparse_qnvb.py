"""Sparsifying QNVB (issue 13, benchmark 1) on the sequence paper's Table 2 network.

The network keeps Table 2's layer sizes (five 2x2 stride-2 convolutions without bias, 1 -> 12 ->
48 -> 192 -> 192 -> 192 channels, then a 64 -> 10 linear layer; 112,048 weights) on 32 x 32 inputs.
The paper's ternary logic activations, which map 3k channels to k, are replaced by a ReLU followed
by the maximum over each group of 3 channels (no parameters; the ternary layers' 1,696 are gone).
``--activation ternary`` puts our reading of them back (:class:`Ternary`: 8 parameters per output
channel, 113,744 in all, as in Table 2).

Methods, each for ``--epochs`` epochs on the same split and minibatches:

* ``sparse``: :class:`~pyro_quadvi.optim.SparseQNVBOptimizer`, Table 1 defaults (4 evaluations
  per case: 2 antithetic Hadamard pairs);
* ``adam``: the same network dense with Adam (lr 1e-3, 1 evaluation per case);
* ``qnvb``: dense mean-field :class:`~pyro_quadvi.optim.QNVBOptimizer` (Hadamard, 4 nodes);
* ``gumbel``: the sparse-VI paper's Gumbel spike-and-slab estimator
  (:class:`~pyro_quadvi.infer.GumbelSpikeSlabELBO`, ``AutoSpikeSlab``, Adam lr 5e-3) on the same
  network as a :class:`~pyro_quadvi.nn.BayesianModule` with a ``SpikeSlab(0.5, 0.3)`` prior; its
  sparse network is the guide's median. ``gumbel10x`` runs it for 10 times the epochs. Its slab
  means start at the network's initialization; ``--kl-warmup`` and ``--init-inclusion`` give it
  a KL warm-up and another initial inclusion (not the paper's recipe).

Per epoch: test accuracy of the realized point (the mixture mean; after the final epoch the sparse
pattern; with ``--validation`` the accuracy on the last eighth of the training set, the model
trained on the rest), the fraction of exact zeros, and for ``sparse`` the histogram of the
probabilities of a nonzero (the paper's Fig. 4). At the end: nonzeros per layer, wall time, and
the network's size on disk dense and sparse (``torch.save`` of the state dict, sparse tensors
for the sparse one).

Usage::

    python benchmarks/bench_sparse_qnvb.py --dataset digits --methods sparse adam qnvb gumbel
    python benchmarks/bench_sparse_qnvb.py --dataset mnist --net mlp --data-dir /path/to/mnist

``--net mlp`` swaps in a one-hidden-layer ReLU network (64 units) for the Table 2 network.
``--init kaiming`` redraws every weight from Kaiming's normal for ReLU (all methods);
``--init scaled`` is the same network in a scaled parametrization (each parameter ``N(0, 1)``,
Kaiming's ``sqrt(2 / fan_in)`` applied in the forward pass), in which every layer's parameters
have scale 1. ``--tau-max`` is the sparse optimizer's slab width and dense QNVB's ``sigma_max``;
``--prior-scale`` (default: ``--tau-max``) the standard deviation of every method's slab prior;
``--target-sparsity`` and ``--target-free`` the sieve's targets; ``--late-tau-max`` and
``--late-epoch`` the sparse optimizer's extension (a lower curvature floor, so longer Newton steps,
from that epoch on, the slab still at most ``--tau-max``). The Table 2 rows of
``docs/benchmarks.md`` use ``--init kaiming --tau-max 0.03 --prior-scale 0.3`` or ``--init scaled
--tau-max 0.3 --prior-scale 1``: with PyTorch's default initialization and ``tau_max = 0.3`` this
network stays at chance (see there).

``--integration`` runs benchmark 3 instead (the paper's Appendix A.2, Fig. 7): signed errors of
MC, VRMC-1, VRMC-2, the blocked 2-simplex and the Hadamard sequence against the Dirac-Gauss mixture
``q = prod_i (delta(theta_i) / 2 + N(theta_i | 2, 1) / 2)`` on products of its orthonormal
polynomials (exact integral 0), 90% intervals over ``--trials`` trials, against the number of
evaluations. The quadratures place their nodes at the mixture's mean and standard deviation
(eq. 4.2); the Monte Carlo methods draw from the mixture itself.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pyro
import torch
from pyro.poutine.messenger import Messenger
from torch import nn
from torch.nn.utils import parametrize
from tqdm import tqdm

from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer
from pyro_quadvi.testing.datasets import digits_split, mnist_split


class GroupMax(nn.Module):
    """ReLU, then the maximum over each group of 3 consecutive channels (3k -> k)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(x)
        return x.unflatten(-3, (x.shape[-3] // 3, 3)).amax(-3)


class Ternary(nn.Module):
    """A ternary logic activation (3k -> k channels) with 8 parameters per output channel, as
    Table 2 counts them: each group of 3 channels gives probabilities ``p = sigmoid(x)`` of 3
    independent Boolean inputs, and the output is the expected value of a learned truth table
    ``T`` (``2^3`` entries per output channel) under them, ``sum_b T[b] prod_i p_i^b_i (1 -
    p_i)^(1 - b_i)``: the multilinear extension of a 3-input logic function. This is our reading
    of the paper's "ternary logical activation functions" ([14] there, not at hand); the table
    starts at ``N(0, 1)`` draws."""

    def __init__(self, out_channels: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(out_channels, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(x).unflatten(-3, (x.shape[-3] // 3, 3))
        p0, p1, p2 = (p.select(-3, i) for i in range(3))  # (..., k, H, W) each
        corners = [
            (p0 if b0 else 1 - p0) * (p1 if b1 else 1 - p1) * (p2 if b2 else 1 - p2)
            for b0 in (0, 1)
            for b1 in (0, 1)
            for b2 in (0, 1)
        ]
        weights = torch.stack(corners, -1)  # (..., k, H, W, 8)
        return (weights * self.table[:, None, None, :]).sum(-1)


def table2_net(activation: str = "groupmax") -> nn.Sequential:
    """Table 2's convolutions and linear layer, with GroupMax (no parameters) or the
    :class:`Ternary` activation (Table 2's 8 parameters per output channel) between them."""
    layers: list[nn.Module] = []
    for c_in, c_out in ((1, 12), (4, 48), (16, 192), (64, 192), (64, 192)):
        act = Ternary(c_out // 3) if activation == "ternary" else GroupMax()
        layers += [nn.Conv2d(c_in, c_out, 2, stride=2, bias=False), act]
    layers += [nn.Flatten(), nn.Linear(64, 10, bias=False)]
    return nn.Sequential(*layers)


def mlp(num_inputs: int) -> nn.Sequential:
    """A one-hidden-layer ReLU network, ``num_inputs -> 64 -> 10`` with biases."""
    return nn.Sequential(nn.Linear(num_inputs, 64), nn.ReLU(), nn.Linear(64, 10))


def load(dataset: str, data_dir: str | None, net: str, validation: bool = False):
    """``(x_train, y_train, x_test, y_test)``, images in [0, 1]: ``(n, 1, 32, 32)`` for the Table 2
    network (digits upsampled 4x, MNIST padded by 2), flat for the MLP. With ``validation`` the
    test set is never read: the last eighth of the training set (MNIST: the last 1,000 of the
    8,000) is returned in its place, and the first seven eighths train."""
    if dataset == "digits":
        x_tr, y_tr, x_te, y_te = digits_split()
        x_tr, x_te = x_tr.reshape(-1, 1, 8, 8), x_te.reshape(-1, 1, 8, 8)
        if net == "table2":  # 8x8 -> 32x32
            x_tr, x_te = (v.repeat_interleave(4, -1).repeat_interleave(4, -2) for v in (x_tr, x_te))
    else:
        x_tr, y_tr, x_te, y_te = mnist_split(data_dir)
        x_tr, x_te = (torch.as_tensor(v, dtype=torch.float32) for v in (x_tr, x_te))
        if x_tr.max() > 1:
            x_tr, x_te = x_tr / 255, x_te / 255
        x_tr, x_te = x_tr.reshape(-1, 1, 28, 28), x_te.reshape(-1, 1, 28, 28)
        if net == "table2":
            x_tr, x_te = (nn.functional.pad(v, (2, 2, 2, 2)) for v in (x_tr, x_te))
        y_tr, y_te = torch.as_tensor(y_tr), torch.as_tensor(y_te)
    if net == "mlp":
        x_tr, x_te = x_tr.flatten(1), x_te.flatten(1)
    if validation:
        cut = len(y_tr) - len(y_tr) // 8
        return x_tr[:cut], y_tr[:cut], x_tr[cut:], y_tr[cut:]
    return x_tr, y_tr, x_te, y_te


class Gain(nn.Module):
    """Multiplies a weight by a constant in the forward pass (a parametrization)."""

    def __init__(self, gain: float):
        super().__init__()
        self.gain = gain

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.gain


def make_net(net: str, data, init: str = "default", activation: str = "groupmax") -> nn.Sequential:
    """The network; ``init="kaiming"`` redraws every weight matrix from Kaiming's normal for ReLU
    (``std = sqrt(2 / fan_in)``) and zeroes the biases; ``init="scaled"`` gives the same network
    in a scaled parametrization: the parameter holds ``N(0, 1)`` draws and the layer multiplies
    it by Kaiming's ``sqrt(2 / fan_in)`` in the forward pass, so every layer's parameters have
    scale 1 and one ``tau_max`` is the same fraction of each layer's weights."""
    module = table2_net(activation) if net == "table2" else mlp(data[0].shape[1])
    if init in ("kaiming", "scaled"):
        for layer in module.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                if init == "kaiming":
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                else:
                    fan_in = layer.weight[0].numel()
                    nn.init.normal_(layer.weight)
                    parametrize.register_parametrization(
                        layer, "weight", Gain(math.sqrt(2 / fan_in))
                    )
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
    return module


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net(x).argmax(-1) == y).float().mean())


def zeros_of(tensors) -> tuple[float, dict[str, int]]:
    tensors = dict(tensors)
    total = sum(t.numel() for t in tensors.values())
    zeros = sum(int((t == 0).sum()) for t in tensors.values())
    return zeros / total, {name: int((t != 0).sum()) for name, t in tensors.items()}


def disk_bytes(state: dict[str, torch.Tensor], sparse: bool) -> int:
    buffer = io.BytesIO()
    torch.save({k: v.to_sparse() if sparse else v for k, v in state.items()}, buffer)
    return buffer.getbuffer().nbytes


def prior_scale(args) -> float:
    """The slab prior's standard deviation: ``--prior-scale``, by default ``--tau-max``."""
    return args.tau_max if args.prior_scale is None else args.prior_scale


def batches(n: int, batch_size: int, generator: torch.Generator):
    order = torch.randperm(n, generator=generator)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def run_torch(method, data, args):
    x_tr, y_tr, x_te, y_te = data
    epochs, batch_size, seed, tau_max = args.epochs, args.batch_size, args.seed, args.tau_max
    prior_precision = prior_scale(args) ** -2
    torch.manual_seed(seed)
    net = make_net(args.net, data, args.init, args.activation)
    n = len(y_tr)
    steps = -(-n // batch_size)
    loss_fn = nn.CrossEntropyLoss()
    if method == "adam":
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    elif method == "qnvb":
        optimizer = QNVBOptimizer(
            net.parameters(), likelihood_weight=n, prior_precision=prior_precision,
            quadrature="hadamard", num_eval=4, init_sigma=1e-3, sigma_max=tau_max, lr=args.qnvb_lr,
        )  # fmt: skip
    else:
        optimizer = SparseQNVBOptimizer(
            net.parameters(), num_cases=n, steps_per_epoch=steps,
            num_epochs=epochs, tau_max=tau_max, prior_precision=prior_precision,
            target_sparsity=args.target_sparsity, target_free=args.target_free,
            late_tau_max=args.late_tau_max, late_epoch=args.late_epoch,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    record = {"accuracy": [], "zeros": [], "histograms": [], "train_loss": [], "skipped_steps": 0}
    bins = np.linspace(0, 1, 21)
    start = time.perf_counter()
    for _ in tqdm(range(epochs), desc=method, leave=False):
        total = 0.0
        for rows in batches(n, batch_size, generator):

            def closure(rows=rows):
                loss = loss_fn(net(x_tr[rows]), y_tr[rows])
                loss.backward()
                return loss

            if method == "adam":
                optimizer.zero_grad()
                total += float(closure().detach())
                optimizer.step()
            else:
                try:
                    total += float(optimizer.step(closure))
                except ValueError as error:  # the loss not finite at some node: step not taken
                    if "is not finite at some node" not in str(error):
                        raise
                    record["skipped_steps"] += 1
        record["train_loss"].append(total / steps)
        record["accuracy"].append(accuracy(net, x_te, y_te))
        record["zeros"].append(zeros_of(net.named_parameters())[0])
        if method == "sparse":
            counts, _ = np.histogram(optimizer.p_nonzero().numpy(), bins=bins)
            record["histograms"].append(counts.tolist())
    record["wall_s"] = time.perf_counter() - start
    record["evaluations_per_case"] = 1 if method == "adam" else 4
    state = {k: v.detach() for k, v in net.state_dict().items()}
    record["nonzeros_per_layer"] = zeros_of(state)[1]
    record["bytes_dense"] = disk_bytes(state, sparse=False)
    record["bytes_sparse"] = disk_bytes(state, sparse=True)
    return record


class ScaleLatents(Messenger):
    """Multiplies the log density of every latent (unobserved) sample site by ``factor()``.

    Under :class:`~pyro_quadvi.infer.GumbelSpikeSlabELBO` a spike-and-slab site's term is its
    closed-form ``-KL(q || prior)`` times the site's scale, so this weights the KL by ``factor()``:
    the KL warm-up ``loss = -log-likelihood + beta KL``. (The mirror image of
    :class:`~pyro_quadvi.optim.annealing.AnnealLikelihoodMessenger`, which scales the observed
    sites.)"""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def _process_message(self, msg):
        if msg["type"] == "sample" and not msg["is_observed"]:
            msg["scale"] = self.factor() * msg["scale"]


def run_gumbel(data, epochs, args):
    """The Gumbel baseline. Its slab means start at the network's initialization (the same as every
    other method's, through ``bnn.init_to_net()``; ``AutoSpikeSlab``'s default would start them at
    0), its inclusion
    probabilities at ``--init-inclusion``. With ``--kl-warmup W`` the KL is weighted by ``beta =
    min(1, (t + 1) / (W * steps_per_epoch))`` at step ``t`` (0-based): a linear warm-up over the
    first ``W`` epochs, not the sparse-VI paper's recipe."""
    from pyro.infer import SVI
    from pyro.optim import Adam

    from pyro_quadvi.distributions import SpikeSlab
    from pyro_quadvi.guides import AutoSpikeSlab
    from pyro_quadvi.infer import GumbelSpikeSlabELBO
    from pyro_quadvi.nn import BayesianModule
    from pyro_quadvi.nn.likelihoods import Categorical

    x_tr, y_tr, x_te, y_te = data
    batch_size, seed = args.batch_size, args.seed
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    net = make_net(args.net, data, args.init, args.activation)
    n = len(y_tr)
    steps = -(-n // batch_size)
    prior = SpikeSlab(0.5, prior_scale(args))
    bnn = BayesianModule(net, lambda name, p: prior, Categorical(dataset_size=n))
    guide = AutoSpikeSlab(
        bnn, init_loc_fn=bnn.init_to_net(), init_scale=1e-3,
        init_inclusion=args.init_inclusion,
    )  # fmt: skip
    step = [0]

    def beta() -> float:
        if args.kl_warmup <= 0:
            return 1.0
        return min(1.0, (step[0] + 1) / (args.kl_warmup * steps))

    def model(*model_args):
        with ScaleLatents(beta):
            return bnn(*model_args)

    svi = SVI(model, guide, Adam({"lr": 5e-3}), GumbelSpikeSlabELBO(temperature=0.5))
    generator = torch.Generator().manual_seed(seed)
    record = {"accuracy": [], "zeros": [], "histograms": [], "train_loss": []}
    start = time.perf_counter()
    for _ in tqdm(range(epochs), desc="gumbel", leave=False):
        total, count = 0.0, 0
        for rows in batches(n, batch_size, generator):
            total += svi.step(x_tr[rows], y_tr[rows]) / n
            count += 1
            step[0] += 1
        record["train_loss"].append(total / count)
        median = guide.median()
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(median[name])
        record["accuracy"].append(accuracy(net, x_te, y_te))
        record["zeros"].append(zeros_of(net.named_parameters())[0])
    record["wall_s"] = time.perf_counter() - start
    record["evaluations_per_case"] = 1
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    record["nonzeros_per_layer"] = zeros_of(state)[1]
    record["bytes_dense"] = disk_bytes(state, sparse=False)
    record["bytes_sparse"] = disk_bytes(state, sparse=True)
    return record


def figures(results: dict, dataset: str, fig_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax_acc, ax_zero) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_zero.set_ylim(-0.02, 1.02)
    for method, record in results.items():
        epochs = np.arange(1, len(record["accuracy"]) + 1)
        ax_acc.plot(epochs, record["accuracy"], marker="o", label=method)
        line = ax_zero.plot(epochs, record["zeros"], marker="o", label=method)[0]
        if record["histograms"]:  # the pattern rounding would realize now: p_nonzero < 1/2
            counts = np.asarray(record["histograms"])
            below = counts[:, :10].sum(1) / counts.sum(1)
            ax_zero.plot(epochs, below, ls="--", color=line.get_color(), label="p_nonzero < 1/2")
    ax_zero.legend(fontsize=8)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title=f"{dataset}: accuracy")
    ax_zero.set(xlabel="epoch", ylabel="fraction of exact zeros", title="sparsity")
    ax_acc.legend()
    fig.tight_layout()
    path = fig_dir / f"sparse_qnvb_{dataset}_epochs.png"
    fig.savefig(path, dpi=120)
    paths.append(str(path))
    plt.close(fig)
    if "sparse" in results:
        histograms = results["sparse"]["histograms"]
        fig, axes = plt.subplots(2, (len(histograms) + 1) // 2, figsize=(12, 4.5), sharey=True)
        edges = np.linspace(0, 1, 21)
        for ax, (epoch, counts) in zip(axes.flat, enumerate(histograms, 1)):
            counts = np.asarray(counts)
            shown = counts > 0  # a log axis: empty bins are left out
            ax.bar(edges[:-1][shown], counts[shown], width=0.05, align="edge")
            ax.set_yscale("log")
            ax.set_xlim(0, 1)
            ax.set_title(f"epoch {epoch}", fontsize=9)
        fig.supxlabel("probability of a nonzero")
        fig.supylabel("weights")
        fig.tight_layout()
        path = fig_dir / f"sparse_qnvb_{dataset}_sieve.png"
        fig.savefig(path, dpi=120)
        paths.append(str(path))
        plt.close(fig)
    return paths


MIXTURE_ZERO, SLAB_LOC, SLAB_SCALE = 0.5, 2.0, 1.0
BASIS = {  # label -> ((coordinate, degree), ...)
    "phi1(t0)": ((0, 1),),
    "phi2(t0)": ((0, 2),),
    "phi3(t0)": ((0, 3),),
    "phi1(t0) phi1(t1)": ((0, 1), (1, 1)),
    "phi1(t0) phi1(t2)": ((0, 1), (2, 1)),
    "phi1(t0) phi1(t7)": ((0, 1), (7, 1)),
    "phi2(t0) phi1(t1)": ((0, 2), (1, 1)),
    "phi1(t0) phi1(t1) phi1(t2)": ((0, 1), (1, 1), (2, 1)),
}


def mixture_polynomials() -> np.ndarray:
    """Coefficients ``C[d, j]`` of the mixture's orthonormal polynomials ``phi_d = sum_j C theta^j``
    (d <= 3), from the Cholesky factor of its moment (Hankel) matrix: orthonormal under q."""
    slab = [1.0, 2.0, 5.0, 14.0, 43.0, 142.0, 499.0]  # raw moments of N(2, 1)
    moments = [1.0] + [(1 - MIXTURE_ZERO) * m for m in slab[1:]]
    hankel = np.array([[moments[i + j] for j in range(4)] for i in range(4)])
    return np.linalg.inv(np.linalg.cholesky(hankel))


def integration_errors(trials: int, seed: int) -> dict:
    """Per method and number of evaluations: the 5%, 50%, 95% quantiles of each basis function's
    signed integration error over ``trials`` trials."""
    from pyro_quadvi.quadrature import make_rule

    dim = 8
    coefficients = torch.tensor(mixture_polynomials())
    powers = torch.arange(4, dtype=torch.float64)
    p = 1 - MIXTURE_ZERO
    mean = p * SLAB_LOC
    sd = math.sqrt(MIXTURE_ZERO * p * SLAB_LOC**2 + p * SLAB_SCALE**2)  # eq. 4.2

    def basis_means(points: torch.Tensor) -> torch.Tensor:  # points (..., n, dim)
        phi = (points.unsqueeze(-1) ** powers) @ coefficients.T  # (..., n, dim, degree)
        values = []
        for factors in BASIS.values():
            value = 1.0
            for coordinate, degree in factors:
                value = value * phi[..., coordinate, degree]
            values.append(value.mean(-1))
        return torch.stack(values, -1)

    generator = torch.Generator().manual_seed(seed)
    results: dict[str, dict[int, list]] = {}

    def record(method: str, n: int, errors: torch.Tensor) -> None:
        quantiles = torch.quantile(errors, torch.tensor([0.05, 0.5, 0.95], dtype=errors.dtype), 0)
        results.setdefault(method, {})[n] = quantiles.T.tolist()  # (basis, 3)

    for n in (2, 4, 8, 16, 32):
        zero = torch.rand(trials, n, dim, generator=generator) < MIXTURE_ZERO
        slab = SLAB_LOC + SLAB_SCALE * torch.randn(trials, n, dim, generator=generator)
        draws = torch.where(zero, 0.0, slab).double()
        record("MC", n, basis_means(draws))
        shifted = draws - draws.mean(1, keepdim=True) + mean
        record("VRMC-1", n, basis_means(shifted))
        spread = draws.std(1, unbiased=False, keepdim=True)
        scaled = torch.where(
            spread > 0, (draws - draws.mean(1, keepdim=True)) / spread * sd + mean, shifted
        )  # a coordinate drawn equal n times cannot match the variance: mean only
        record("VRMC-2", n, basis_means(scaled))
        hadamard = make_rule("hadamard", n)
        positions = max(1, (2 * dim) // n)  # random start, a multiple of n / 2 (Algorithm 5.1)
        starts = torch.randint(positions, (trials,), generator=generator).tolist()
        nodes = torch.stack(
            [hadamard.draw(dim, step=s, dtype=torch.float64).matrix() for s in starts]
        )
        record("Hadamard", n, basis_means(mean + sd * nodes))
        simplex = make_rule("blocked_simplex", 3)
        blocks = n // 2  # 3 n / 2 evaluations
        nodes = torch.stack(
            [
                torch.cat(
                    [
                        simplex.draw(dim, generator=generator, dtype=torch.float64).matrix()
                        for _ in range(blocks)
                    ]
                )
                for _ in range(trials)
            ]
        )
        record("blocked simplex", 3 * blocks, basis_means(mean + sd * nodes))
    return results


def integration_figure(results: dict, fig_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(14, 6), sharex=True)
    offsets = {
        "MC": -0.12,
        "VRMC-1": -0.06,
        "VRMC-2": 0.0,
        "blocked simplex": 0.06,
        "Hadamard": 0.12,
    }
    for b, (ax, label) in enumerate(zip(axes.flat, BASIS)):
        for method, by_n in results.items():
            ns = sorted(by_n)
            low, mid, high = (np.array([by_n[n][b][i] for n in ns]) for i in range(3))
            x = np.log2(ns) + offsets[method]
            ax.errorbar(x, mid, yerr=[mid - low, high - mid], fmt="o", ms=3, capsize=2,
                        label=method)  # fmt: skip
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(label, fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("evaluations (log2)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Signed integration errors against a Dirac-Gauss mixture, 90% intervals")
    fig.tight_layout()
    path = fig_dir / "sparse_qnvb_integration.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    parser.add_argument("--net", choices=["table2", "mlp"], default="table2")
    parser.add_argument("--data-dir", default=None, help="MNIST dir (or PYRO_QUADVI_DATA)")
    parser.add_argument("--methods", nargs="+", default=["sparse", "adam", "qnvb", "gumbel"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tau-max", type=float, default=0.3,
        help="SparseQNVB's tau_max and dense QNVB's sigma_max",
    )  # fmt: skip
    parser.add_argument(
        "--prior-scale", type=float, default=None,
        help="standard deviation of every method's slab prior (default: --tau-max)",
    )  # fmt: skip
    parser.add_argument("--target-sparsity", type=float, default=0.97, help="sparse's s0_tgt")
    parser.add_argument("--target-free", type=float, default=0.01, help="sparse's s1_tgt")
    parser.add_argument(
        "--late-tau-max", type=float, default=None,
        help="sparse's late_tau_max (an extension: the curvature floor 1 / late_tau_max^2 from "
        "--late-epoch on, the slab still at most --tau-max); default: off, the paper's rule",
    )  # fmt: skip
    parser.add_argument("--late-epoch", type=int, default=3, help="sparse's late_epoch")
    parser.add_argument(
        "--qnvb-lr", type=float, default=1.0,
        help="dense QNVB's lr (the cap on its Adam-sized step; QNVBOptimizer's default 1.0)",
    )  # fmt: skip
    parser.add_argument(
        "--init", choices=["default", "kaiming", "scaled"], default="default",
        help="PyTorch's default initialization, Kaiming's normal for ReLU, or Kaiming's scale "
        "as a gain in the forward pass over N(0, 1) parameters (all methods)",
    )  # fmt: skip
    parser.add_argument(
        "--activation", choices=["groupmax", "ternary"], default="groupmax",
        help="the Table 2 network's activations: ReLU and a maximum over groups of 3, or Ternary",
    )  # fmt: skip
    parser.add_argument(
        "--kl-warmup", type=float, default=0.0,
        help="gumbel: weight the KL by beta rising linearly from 0 to 1 over this many epochs "
        "(default 0: no warm-up, the paper's loss)",
    )  # fmt: skip
    parser.add_argument(
        "--init-inclusion", type=float, default=0.99,
        help="gumbel: the guide's initial probability of a nonzero (AutoSpikeSlab's default 0.99)",
    )  # fmt: skip
    parser.add_argument(
        "--validation", action="store_true",
        help="for choosing settings: train on the first 7/8 of the training set, report accuracy "
        "on its last 1/8 (MNIST: 7,000 / 1,000), never touching the test set",
    )  # fmt: skip
    parser.add_argument("--fig-dir", default="docs/img")
    parser.add_argument("--out", default=None, help="JSON file for the records")
    parser.add_argument("--integration", action="store_true", help="benchmark 3 (Fig. 7)")
    parser.add_argument("--trials", type=int, default=5000)
    args = parser.parse_args(argv)
    if "sparse" in args.methods and args.epochs < 3:
        parser.error(
            f"--epochs must be >= 3 with the sparse method (its sieve's schedule), got "
            f"{args.epochs}"
        )
    torch.set_num_threads(1)
    fig_dir = Path(args.fig_dir)
    fig_dir.mkdir(parents=True, exist_ok=True)
    if args.integration:
        results = integration_errors(args.trials, args.seed)
        results["figure"] = integration_figure(results, fig_dir)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return results
    data = load(args.dataset, args.data_dir, args.net, args.validation)
    results = {}
    for method in args.methods:
        if method in ("gumbel", "gumbel10x"):
            epochs = args.epochs * (10 if method == "gumbel10x" else 1)
            results[method] = run_gumbel(data, epochs, args)
        else:
            results[method] = run_torch(method, data, args)
        record = results[method]
        print(
            f"{method:10s} acc {record['accuracy'][-1]:.4f} zeros {record['zeros'][-1]:.4f} "
            f"wall {record['wall_s']:.1f}s nonzeros {record['nonzeros_per_layer']} "
            f"bytes dense {record['bytes_dense']} sparse {record['bytes_sparse']}"
            + (
                f" skipped steps (loss not finite) {record['skipped_steps']}"
                if record.get("skipped_steps")
                else ""
            ),
            flush=True,
        )
    results["figures"] = figures(
        {k: v for k, v in results.items() if k != "figures"}, f"{args.dataset}_{args.net}", fig_dir
    )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
