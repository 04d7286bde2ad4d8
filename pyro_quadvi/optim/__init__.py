"""Optimizers: QNVB for Pyro mean-field guides and for plain PyTorch networks.

* `QNVB`: a ``pyro.optim.PyroOptim`` for ``SVI``.
* `QNVBOptimizer`: a ``torch.optim.Optimizer`` evaluating its closure at quadrature nodes.
* `qnvb_update`: the pure, elementwise update (the reference); `qnvb_update_many`:
  the same on one flat buffer for many tensors, which both optimizers run.
* `module_loss`: a ``loss_fn`` for ``QNVBOptimizer.step(loss_fn=..., batch=...)``.
* `SparseQNVBOptimizer`: the sparsifying QNVB (Dirac-Gauss mixtures and the sieve) for plain
  PyTorch networks; `SparseQNVB`: the same for ``AutoSpikeSlab`` guides in ``SVI``;
  `sparse_qnvb_update`: their pure update.
"""

from .annealing import AnnealLikelihoodMessenger, anneal_likelihood, geometric_annealing
from .qnvb import QNVB
from .qnvb_functional import (
    QNVBHyperparameters,
    QNVBResult,
    QNVBState,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)
from .sparse_functional import (
    SparseQNVBBlock,
    SparseQNVBCounters,
    SparseQNVBHyperparameters,
    SparseQNVBResult,
    sparse_qnvb_update,
)
from .sparse_qnvb import SparseQNVB
from .sparse_torch import SparseQNVBOptimizer
from .torch_qnvb import ModuleLoss, QNVBOptimizer, module_loss

__all__ = [
    "QNVB",
    "AnnealLikelihoodMessenger",
    "ModuleLoss",
    "QNVBHyperparameters",
    "QNVBOptimizer",
    "QNVBResult",
    "QNVBState",
    "SparseQNVB",
    "SparseQNVBBlock",
    "SparseQNVBCounters",
    "SparseQNVBHyperparameters",
    "SparseQNVBOptimizer",
    "SparseQNVBResult",
    "anneal_likelihood",
    "geometric_annealing",
    "init_qnvb_state",
    "module_loss",
    "qnvb_update",
    "qnvb_update_many",
    "sparse_qnvb_update",
]
