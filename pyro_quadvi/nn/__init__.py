"""Bayesian neural networks from any ``torch.nn.Module``.

``BayesianModule(net, prior, likelihood)`` is a Pyro model whose latent sites are the net's
parameters; `priors` and `likelihoods` hold the pieces,
`predict` the Bayesian model average, `fit` the SVI
loop of the tutorials, `sparse_network` the realized network of a
spike-and-slab fit.
"""

from . import likelihoods, priors
from .module import NETWORK_QNVB_SETTINGS, BayesianModule
from .predict import Prediction, predict
from .sparse import SparseNetwork, sparse_network
from .training import History, fit
from .whvi import WHVILinear, setup_dimensions, whvi

__all__ = [
    "NETWORK_QNVB_SETTINGS",
    "BayesianModule",
    "History",
    "Prediction",
    "SparseNetwork",
    "WHVILinear",
    "fit",
    "likelihoods",
    "predict",
    "priors",
    "setup_dimensions",
    "sparse_network",
    "whvi",
]
