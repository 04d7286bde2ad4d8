"""Optimizers: QNVB for Pyro mean-field guides and for plain PyTorch networks.

* :class:`QNVB`: a ``pyro.optim.PyroOptim`` for ``SVI``.
* :class:`QNVBOptimizer`: a ``torch.optim.Optimizer`` evaluating its closure at quadrature nodes.
* :func:`qnvb_update`: the pure, elementwise update both use.
"""

from .annealing import AnnealLikelihoodMessenger, anneal_likelihood, geometric_annealing
from .qnvb import QNVB
from .qnvb_functional import (
    QNVBHyperparameters,
    QNVBResult,
    QNVBState,
    init_qnvb_state,
    qnvb_update,
)
from .torch_qnvb import QNVBOptimizer

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
    "qnvb_update",
]
