"""Data- and node-parallel ``QuadratureELBO`` and ``QNVB`` on ``torch.distributed``.

* `DistributedQuadratureELBO`: every rank draws the same nodes; ``parallel="data"``
  evaluates them all on the rank's shard of the minibatch, ``parallel="nodes"`` every ``W``-th
  node on the whole minibatch.
* `DistributedOptimizer`: wraps ``QNVB`` (or any ``PyroOptim``); averages gradients and the
  published moments ``g``, ``h`` over the ranks before the step.
* `NodeParallelQNVBOptimizer`: the plain-torch ``QNVBOptimizer`` with each step's nodes
  divided between the ranks, their weighted sums added up by one all-reduce.
* `save_checkpoint` / `load_checkpoint`: one copy, written by rank 0.
* `world`, `shard`, `broadcast_generator`, `check_agreement`: plain helpers.

Data parallel in plain PyTorch needs nothing of its own: ``QNVBOptimizer`` steps a
``DistributedDataParallel`` network as it steps any network (see the guide page "Scaling out").
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .comm import (
    all_reduce_mean_,
    all_reduce_sum_,
    broadcast_generator,
    check_agreement,
    shard,
    world,
)
from .elbo import PARALLEL_MODES, DistributedQuadratureELBO
from .optim import DistributedOptimizer
from .torch_optim import NodeParallelQNVBOptimizer

__all__ = [
    "PARALLEL_MODES",
    "DistributedOptimizer",
    "DistributedQuadratureELBO",
    "NodeParallelQNVBOptimizer",
    "all_reduce_mean_",
    "all_reduce_sum_",
    "broadcast_generator",
    "check_agreement",
    "load_checkpoint",
    "save_checkpoint",
    "shard",
    "world",
]
