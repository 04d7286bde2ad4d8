"""Why float32 runs of QNVBOptimizer's closure and one-pass forms part ways (session 13 trial).

Part 1, the first step's Stein estimate ``h = sum_k w_k grad_k x_k / sigma`` (rasp paper,
eq. 11) of a 3-16-3 tanh network in float32 against float64: its error relative to the whole
loss's curvature ``640 h + 1``, in two summation orders and with float64 sums of the float32
gradients. Part 2, 40 steps of both forms in both dtypes: how far the means and sigmas part.

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/qnvb_float32_forms.py
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from pyro_quadvi.optim import QNVBOptimizer, module_loss
from pyro_quadvi.quadrature import make_rule

WEIGHT, PRIOR = 640.0, 1.0


def _setup():
    torch.manual_seed(0)
    x = torch.randn(64, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (64,))
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    return x, y, net


def node_gradients(net0, x, y, dtype, sigma, rule):
    """The loss's gradient at each node of the first step, the nodes and their weights."""
    names = [n for n, _ in net0.named_parameters()]
    shapes = [p.shape for p in net0.parameters()]
    mu = torch.cat([p.detach().flatten() for p in net0.parameters()]).to(dtype)
    generator = torch.Generator().manual_seed(3)
    nodes = make_rule(rule).draw(mu.numel(), step=0, generator=generator, dtype=dtype)
    net, xb = copy.deepcopy(net0).to(dtype), x[:16].to(dtype)

    def loss(flat):
        params = dict(
            zip(names, (t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes)))
        )
        return F.cross_entropy(functional_call(net, params, (xb,)), y[:16])

    matrix = nodes.matrix()
    grads = torch.stack([grad(loss)(mu + sigma * matrix[k]) for k in range(len(nodes.weights))])
    return grads, matrix, nodes.weights


def stein_errors(x, y, net0) -> None:
    for rule in ("rasp_simplex", "hadamard"):
        for sigma in (1e-3, 1e-2):
            g64, x64, w64 = node_gradients(net0, x, y, torch.float64, sigma, rule)
            g32, x32, w32 = node_gradients(net0, x, y, torch.float32, sigma, rule)
            h64 = (w64[:, None] * g64 * x64).sum(0) / sigma
            total = WEIGHT * h64 + PRIOR
            cancel = (w64[:, None] * (g64 * x64).abs()).sum(0) / sigma / h64.abs()
            print(
                f"{rule} sigma={sigma:g}: gradient error median "
                f"{(g32.double() - g64).abs().median():.1e} (|grad| median "
                f"{g64.abs().median():.1e}); terms / |h| median {cancel.median():.0f}"
            )
            estimates = {
                "float32": (w32[:, None] * g32 * x32).sum(0) / sigma,
                "float32, reversed order": (w32[:, None] * g32 * x32).flip(0).sum(0) / sigma,
                "float32 gradients, float64 sums": (w64[:, None] * g32.double() * x64).sum(0)
                / sigma,
            }
            for label, h in estimates.items():
                error = (h.double() - h64).abs() * WEIGHT / total
                median, worst = error.median(), error.max()
                print(f"  {label:32s} error / curvature: median {median:.2e}, max {worst:.2e}")


def forty_steps(x, y, net0) -> dict:
    out = {}
    for dtype in (torch.float64, torch.float32):
        for form in ("closure", "onepass"):
            net, xd = copy.deepcopy(net0).to(dtype), x.to(dtype)
            optimizer = QNVBOptimizer(
                net.named_parameters(),
                likelihood_weight=WEIGHT,
                prior_precision=PRIOR,
                generator=torch.Generator().manual_seed(3),
            )
            for step in range(40):
                start = (step * 16) % 64
                xb, yb = xd[start : start + 16], y[start : start + 16]
                if form == "closure":

                    def closure(net=net, xb=xb, yb=yb):
                        loss = F.cross_entropy(net(xb), yb)
                        loss.backward()
                        return loss

                    optimizer.step(closure)
                else:
                    optimizer.step(loss_fn=module_loss(net, F.cross_entropy), batch=(xb, yb))
            state = {
                key: torch.cat(
                    [optimizer.state[p][key].double().flatten() for p in net.parameters()]
                )
                for key in ("mu", "sigma", "h_avg")
            }
            with torch.no_grad():
                state["loss"] = float(F.cross_entropy(net(xd), y))
            out[(str(dtype).removeprefix("torch."), form)] = state
            print(f"{dtype} {form}: loss of the means on the 64 cases {state['loss']:.4f}")
    return out


def compare(out: dict) -> None:
    pairs = [
        (("float64", "closure"), ("float64", "onepass")),
        (("float32", "closure"), ("float32", "onepass")),
        (("float32", "closure"), ("float64", "closure")),
        (("float32", "onepass"), ("float64", "onepass")),
    ]
    for a, b in pairs:
        ratio = out[a]["sigma"] / out[b]["sigma"]
        apart = (ratio > 2) | (ratio < 0.5)
        print(
            f"{a} vs {b}: max |mu difference| {(out[a]['mu'] - out[b]['mu']).abs().max():.2e}; "
            f"sigma more than 2x apart {int(apart.sum())}/{apart.numel()} (max ratio "
            f"{max(ratio.max(), 1 / ratio.min()):.3g})"
        )
    ratio = out[("float32", "closure")]["sigma"] / out[("float32", "onepass")]["sigma"]
    apart = (ratio > 2) | (ratio < 0.5)
    h = WEIGHT * out[("float64", "closure")]["h_avg"].abs()
    share = h / (h + PRIOR)  # the likelihood's share of the curvature (float64 run)
    print(
        f"likelihood's share of the curvature, median: {share[apart].median():.3g} where the "
        f"float32 forms are 2x apart, {share[~apart].median():.3g} elsewhere"
    )


def main() -> None:
    warnings.simplefilter("ignore")
    x, y, net = _setup()
    stein_errors(x, y, net)
    compare(forty_steps(x, y, net))


if __name__ == "__main__":
    main()
