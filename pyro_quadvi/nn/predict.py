"""Bayesian model averages of a :class:`~pyro_quadvi.nn.BayesianModule` under a guide."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine

from ..guides import describe_guide
from ..quadrature import QuadratureRule, make_rule
from .likelihoods import Bernoulli, Categorical

__all__ = ["Prediction", "predict"]

_PREDICT_PLATE = "_quadvi_predict"


@dataclass
class Prediction:
    """The predictive distribution of a network, summarized over weight draws or nodes.

    Attributes:
        outputs: the net's outputs at each draw or quadrature node, ``(S, B, ...)``.
        weights: the weight of each draw (``1/S``) or node (the rule's weights), ``(S,)``.
        mean: the weighted mean of ``outputs``, ``(B, ...)``: the Bayesian model average of the
            net's output (for a Gaussian likelihood, the predictive mean).
        probs: for ``Categorical`` (softmax over the last dim) and ``Bernoulli`` (sigmoid)
            likelihoods, the weighted mean of the per-draw probabilities, ``(B, ...)``; ``None``
            otherwise.
    """

    outputs: torch.Tensor
    weights: torch.Tensor
    mean: torch.Tensor
    probs: torch.Tensor | None = None


def predict(
    bnn,
    guide: Callable,
    x: torch.Tensor,
    num_samples: int = 64,
    quadrature: str | QuadratureRule | None = None,
    num_points: int | None = None,
) -> Prediction:
    """The Bayesian model average of ``bnn``'s net on ``x`` under the posterior ``guide``.

    Args:
        bnn: a :class:`~pyro_quadvi.nn.BayesianModule`.
        guide: its guide (after training).
        x: the inputs, ``B`` rows.
        num_samples: the number of random draws from the guide (ignored with ``quadrature``).
        quadrature: ``None``: random draws of the guide, run once under a vectorized plate of
            ``num_samples`` (like ``Predictive(parallel=True)``). A rule name (``"hadamard"``,
            ``"gauss_hermite"``, ...) or rule: the rule's nodes ``description.affine(x_k)`` on the
            guide's description (:func:`~pyro_quadvi.guides.describe_guide`, so a Gaussian guide),
            weighted by the rule's weights, at step 0 of its sequence.
        num_points: the rule's ``num_points`` (with a rule name).

    All draws or nodes go through the net in one vectorized pass, under ``torch.no_grad()``.
    With a rule of negative weights, ``probs`` is a signed average and may leave ``[0, 1]``.
    """
    with torch.no_grad():
        if getattr(guide, "prototype_trace", True) is None:
            guide(x)  # an AutoGuide builds itself on its first run, outside our plate
        if quadrature is None:
            if num_samples < 1:
                raise ValueError(f"num_samples must be >= 1, got {num_samples}")
            values = _guide_draws(bnn, guide, x, num_samples)
            any_value = next(iter(values.values()), x)
            weights = torch.full(
                (num_samples,), 1.0 / num_samples, dtype=any_value.dtype, device=x.device
            )
        else:
            values, weights = _quadrature_nodes(bnn, guide, x, quadrature, num_points)
        outputs = bnn.evaluate(values, x)
        weights = weights.to(outputs.dtype)
        mean = _average(outputs, weights)
        probs = None
        if isinstance(bnn.likelihood, Categorical):
            probs = _average(torch.softmax(outputs, dim=-1), weights)
        elif isinstance(bnn.likelihood, Bernoulli):
            probs = _average(torch.sigmoid(outputs), weights)
        return Prediction(outputs, weights, mean, probs)


def _average(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.tensordot(weights, values, dims=([0], [0]))


def _guide_draws(bnn, guide, x, num_samples) -> dict[str, torch.Tensor]:
    """``num_samples`` draws of each latent parameter, ``(S, 1) + shape``, in one guide run."""
    with pyro.plate(_PREDICT_PLATE, num_samples, dim=-2):
        trace = poutine.trace(guide).get_trace(x)
    values = {}
    for name, param in bnn.latent_parameters().items():
        if name not in trace.nodes:
            raise ValueError(f"the guide does not sample the latent parameter {name!r}")
        value = trace.nodes[name]["value"]
        values[name] = value.expand((num_samples, 1, *param.shape))
    return values


def _quadrature_nodes(bnn, guide, x, quadrature, num_points):
    """The rule's nodes on the guide's Gaussian, ``(K, 1) + shape`` per parameter, and weights."""
    rule = make_rule(quadrature, num_points) if isinstance(quadrature, str) else quadrature
    if not isinstance(rule, QuadratureRule):
        raise TypeError(f"quadrature must be a rule name or a QuadratureRule, got {quadrature!r}")
    trace = poutine.trace(guide).get_trace(x)
    description = describe_guide(guide, trace)
    loc = description.loc
    nodes = rule.draw(description.dim, step=0, dtype=loc.dtype, device=loc.device)
    z = description.affine(nodes.matrix())
    K = z.shape[0]
    params = bnn.latent_parameters()
    values, start = {}, 0
    for site in description.latent_sites:
        chunk = z[:, start : start + site.numel].reshape((K, *site.shape))
        start += site.numel
        if site.name in params:
            value = site.transform(chunk)
            values[site.name] = value.reshape((K, 1, *params[site.name].shape))
    missing = sorted(set(params) - set(values))
    if missing:
        raise ValueError(f"the guide's description has no latent parameter {missing}")
    return values, nodes.weights
