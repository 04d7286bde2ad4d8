"""Why the sparse Table 2 network under-fits: the sparsifying QNVB instrumented per epoch.

One ``sparse`` run of :mod:`bench_sparse_qnvb` (the same network, split, initialization and
minibatches), reporting after every epoch:

* the training loss at the quadrature nodes (what the optimizer sees) and at the mixture mean
  ``mu`` over the whole training set (what the network fits), and the test accuracy at ``mu``;
* per layer, among the weights with ``p_nonzero > 1/2``: how many, the median of their previous
  curvature sum ``h0`` (the last completed stage of the annealing) over the floor (1: the floor,
  not the data, sets the Newton step), the median ``|nu| / tau`` (how far apart the nodes
  are relative to the weight) and the median ``|nu|`` and slab precision ``tau^-2`` (the hybrid
  sum: when both sums are at the floor it is ``(alpha_0 + alpha_1)`` times the floor).

``--adam-on-pattern`` then trains the realized sparse pattern (the exact zeros after the final
epoch held at zero) with Adam (lr 1e-3) for 10 more epochs, from the sparse weights and from a
fresh Kaiming draw: the training loss and test accuracy the pattern itself allows.

Usage::

    python benchmarks/bench_sparse_qnvb_diagnose.py --dataset digits --tau-max 0.04 \\
        --adam-on-pattern --out diag.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_sparse_qnvb import batches, load, make_net
from torch import nn
from tqdm import tqdm

from pyro_quadvi.optim import SparseQNVBOptimizer


def layer_stats(optimizer: SparseQNVBOptimizer, named) -> dict:
    floor = optimizer.hyperparameters.curvature_floor(optimizer.epoch)
    out = {}
    for name, p in named:
        state = optimizer.state[p]
        keep = state["p_nonzero"] > 0.5
        tau, nu, h0 = state["tau"][keep], state["nu"][keep], state["h0"][keep]
        stats = {"kept": int(keep.sum())}
        if keep.any():
            stats |= {
                "median_h0_over_floor": float((h0 / floor).median()),
                "median_snr": float((nu.abs() / tau).median()),
                "median_abs_nu": float(nu.abs().median()),
                "median_precision": float((tau**-2).median()),
            }
        out[name] = stats
    return out


def adam_on_pattern(net: nn.Module, data, args) -> dict:
    """Adam on the realized pattern, from the sparse weights and from a fresh Kaiming draw."""
    x_tr, y_tr, x_te, y_te = data
    masks = [(p != 0).to(p.dtype) for p in net.parameters()]
    loss_fn, out = nn.CrossEntropyLoss(), {}
    for start in ("sparse", "kaiming"):
        torch.manual_seed(args.seed + 100)
        fresh = make_net("table2", data, "kaiming")
        params = list(fresh.parameters())
        with torch.no_grad():
            for q, p, m in zip(params, net.parameters(), masks):
                q.copy_((p if start == "sparse" else q) * m)
        adam = torch.optim.Adam(params, lr=1e-3)
        generator = torch.Generator().manual_seed(args.seed)
        record = {"accuracy": [], "train_loss": []}
        for _ in tqdm(range(10), desc=f"adam on the pattern ({start})", leave=False):
            for rows in batches(len(y_tr), args.batch_size, generator):
                adam.zero_grad()
                loss_fn(fresh(x_tr[rows]), y_tr[rows]).backward()
                adam.step()
                with torch.no_grad():
                    for q, m in zip(params, masks):
                        q.mul_(m)
            with torch.no_grad():
                record["train_loss"].append(float(loss_fn(fresh(x_tr), y_tr)))
                record["accuracy"].append(float((fresh(x_te).argmax(-1) == y_te).float().mean()))
        out[start] = record
        print(f"adam on the pattern from {start}: accuracy {record['accuracy']}, train loss "
              f"{record['train_loss']}", flush=True)  # fmt: skip
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    parser.add_argument("--data-dir", default=None, help="MNIST dir (or PYRO_QUADVI_DATA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--tau-max", type=float, default=0.04)
    parser.add_argument("--prior-scale", type=float, default=0.3)
    parser.add_argument("--target-sparsity", type=float, default=0.989)
    parser.add_argument("--target-free", type=float, default=0.01)
    parser.add_argument("--late-tau-max", type=float, default=None)
    parser.add_argument("--late-epoch", type=int, default=3)
    parser.add_argument("--adam-on-pattern", action="store_true")
    parser.add_argument("--out", default=None, help="JSON file for the records")
    args = parser.parse_args(argv)
    if args.epochs < 3:
        parser.error(f"--epochs must be >= 3 (the sieve's schedule), got {args.epochs}")
    torch.set_num_threads(1)
    data = load(args.dataset, args.data_dir, "table2")
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(args.seed)
    net = make_net("table2", data, "kaiming")
    n = len(y_tr)
    steps = -(-n // args.batch_size)
    optimizer = SparseQNVBOptimizer(
        net.parameters(), num_cases=n, steps_per_epoch=steps, num_epochs=args.epochs,
        tau_max=args.tau_max, prior_precision=args.prior_scale**-2,
        target_sparsity=args.target_sparsity, target_free=args.target_free,
        late_tau_max=args.late_tau_max, late_epoch=args.late_epoch,
        generator=torch.Generator().manual_seed(args.seed),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed)
    loss_fn = nn.CrossEntropyLoss()
    records, start = [], time.perf_counter()
    for epoch in tqdm(range(args.epochs), desc="sparse", leave=False):
        total = 0.0
        for rows in batches(n, args.batch_size, generator):

            def closure(rows=rows):
                loss = loss_fn(net(x_tr[rows]), y_tr[rows])
                loss.backward()
                return loss

            total += float(optimizer.step(closure))
        with torch.no_grad():
            logits = net(x_tr)
            record = {
                "epoch": epoch + 1,
                "node_loss": total / steps,
                "train_loss_at_mu": float(loss_fn(logits, y_tr)),
                "train_accuracy_at_mu": float((logits.argmax(-1) == y_tr).float().mean()),
                "accuracy": float((net(x_te).argmax(-1) == y_te).float().mean()),
                "layers": layer_stats(optimizer, net.named_parameters()),
                "wall_s": time.perf_counter() - start,
            }
        records.append(record)
        layers = " ".join(
            f"{v['kept']}:{v.get('median_h0_over_floor', 0):.2f}/{v.get('median_snr', 0):.1f}"
            for v in record["layers"].values()
        )
        print(
            f"epoch {epoch + 1}: loss at nodes {record['node_loss']:.3f}, at mu "
            f"{record['train_loss_at_mu']:.3f}; accuracy {record['accuracy']:.3f}; per layer "
            f"kept:h0/floor/|nu|/tau {layers}",
            flush=True,
        )
    results = {"args": vars(args), "epochs": records}
    if args.adam_on_pattern:
        results["adam_on_pattern"] = adam_on_pattern(net, data, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
