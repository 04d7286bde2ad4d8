"""Optimizers: QNVB for Pyro mean-field guides and for plain PyTorch networks.

* :class:`QNVB`: a ``pyro.optim.PyroOptim`` for ``SVI``.
* :class:`QNVBOptimizer`: a ``torch.optim.Optimizer`` evaluating its closure at quadrature nodes.
* :func:`qnvb_update`: the pure, elementwise update (the reference); :func:`qnvb_update_many`:
  the same on one flat buffer for many tensors, which both optimizers run.
* :func:`module_loss`: a ``loss_fn`` for ``QNVBOptimizer.step(loss_fn=..., batch=...)``.
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
from .torch_qnvb import QNVBOptimizer, module_loss

__all__ = [
    "QNVB",
    "AnnealLikelihoodMessenger",
    "QNVBHyperparameters",
    "QNVBOptimizer",
    "QNVBResult",
    "QNVBState",
    "anneal_likelihood",
    "geometric_annealing",
    "init_qnvb_state",
    "module_loss",
    "qnvb_update",
    "qnvb_update_many",
]
