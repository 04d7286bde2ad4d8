"""Bayesian model averages of a `BayesianModule` under a guide.

For a Gaussian likelihood ``y = f(x; theta) + noise``, with the noise independent of the weights,
the predictive distribution has (law of total variance)

    E[y] = E_q[f],        Var[y] = Var_q[f] + E_q[noise_scale^2],

each expectation the weighted average over the draws or quadrature nodes of ``q``: the
variational-predictive integral of the rasp paper's eq. 1, taken by a quadrature as in its eq. 9.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyro
import torch
from pyro import poutine

from ..guides import describe_guide
from ..guides.interface import trace_for_description, unwrap_guide
from ..infer.batched import DecisionCache, check_vectorize, evaluate_batch
from ..quadrature import QuadratureRule, make_rule
from ..quadrature.base import as_index
from ..store import follow_param_store
from .likelihoods import NOISE_SITE, Bernoulli, Categorical, Gaussian
from .module import check_inputs

if TYPE_CHECKING:
    from .module import BayesianModule

__all__ = ["Prediction", "predict"]

_PREDICT_PLATE = "_quadvi_predict"
_DECISIONS = DecisionCache()  # vectorize=None: decided once per BayesianModule


@dataclass
class Prediction:
    """The predictive distribution of a network, summarized over weight draws or nodes.

    Attributes:
        outputs: the net's outputs at each draw or quadrature node, ``(S, B, ...)``.
        weights: the weight of each draw (``1/S``) or node (the rule's weights, divided by the
            number of steps averaged), ``(S,)``.
        mean: the weighted mean of ``outputs``, ``(B, ...)``: the Bayesian model average of the
            net's output (for a Gaussian likelihood, the predictive mean).
        probs: for ``Categorical`` (softmax over the last dim) and ``Bernoulli`` (sigmoid)
            likelihoods, the weighted mean of the per-draw probabilities, ``(B, ...)``, clamped
            to ``[0, 1]`` where no weight is negative (a float32 mean of 30 draws of 1 is
            1.0000004 unclamped); ``None`` otherwise.
        variance: for a ``Gaussian`` likelihood, the predictive variance of ``y``: the weighted
            variance of ``outputs`` about ``mean`` (the model-average part) plus
            ``noise_variance``, ``(B, ...)`` like ``mean``; ``None`` otherwise.
        noise_variance: for a ``Gaussian`` likelihood, the noise variance: ``scale^2`` for a
            fixed scale, the weighted mean of ``noise_scale^2`` over the draws or nodes for a
            learned one; ``(B, ...)`` like ``mean``; ``None`` otherwise.
    """

    outputs: torch.Tensor
    weights: torch.Tensor
    mean: torch.Tensor
    probs: torch.Tensor | None = None
    variance: torch.Tensor | None = None
    noise_variance: torch.Tensor | None = None


def predict(
    bnn: BayesianModule,
    guide: Callable,
    x: torch.Tensor,
    num_samples: int = 64,
    quadrature: str | QuadratureRule | None = None,
    num_points: int | None = None,
    vectorize: bool | None = None,
    *,
    batch_size: int | None = None,
    steps: int | str = 1,
) -> Prediction:
    """The Bayesian model average of ``bnn``'s net on ``x`` under the posterior ``guide``.

    Args:
        bnn: a `BayesianModule`.
        guide: its guide (after training).
        x: the inputs, ``B`` rows.
        num_samples: the number of random draws from the guide (ignored with ``quadrature``).
        quadrature: ``None``: random draws of the guide, run once under a vectorized plate of
            ``num_samples`` (like ``Predictive(parallel=True)``). A rule name (``"hadamard"``,
            ``"gauss_hermite"``, ...) or rule: the rule's nodes ``description.affine(x_k)`` on the
            guide's description (`describe_guide`, so a Gaussian guide),
            weighted by the rule's weights, at steps ``0, ..., steps - 1`` of its sequence. A
            spike-and-slab guide
            (`AutoSpikeSlab`) is refused: its nodes would sit on the
            moment-matched Gaussian, not the mixture; predict it with ``num_samples``.
        num_points: the rule's ``num_points`` (with a rule name).
        vectorize: as everywhere in the package (`evaluate_batch`):
            ``True`` runs all draws or nodes through the net in one ``torch.func.vmap`` pass,
            checked on the first call for a ``bnn`` against the first and last draw run alone (a
            disagreement raises `BatchMismatch` naming the
            reason and the ways out; later calls are not checked); ``False`` one at a time;
            ``None`` tries the pass, checks it the same way (to the square root of the dtype's
            machine epsilon, relative and absolute: a batched product rounds differently) and
            falls back to the loop, with one warning, where ``vmap`` cannot batch the net (an
            ``nn.GRU``, say). The decision is kept per ``bnn``.
        steps: with ``quadrature``, how many consecutive steps of the rule's sequence to
            average: the nodes of steps ``0, ..., steps - 1`` together, each step's weights
            divided by ``steps`` (``steps * K`` passes of the net). One step of ``"hadamard"`` or
            ``"blocked_simplex"`` integrates each coordinate's quadratic exactly but not the
            cross terms ``x_i x_j``, which a network's output variance needs (``Var[a . z] =
            sum_ij a_i a_j s_i s_j sum_k w_k x_ki x_kj``): one step's variance is biased.
            ``"period"`` takes the rule's ``period(dim)`` steps, for a rule that has one
            (``"hadamard"``: averaged over its period, every quadratic is exact; sequence paper,
            Theorem 3.3). Without ``quadrature`` only ``1`` is accepted.
        batch_size: ``None``: all ``B`` rows of ``x`` go through the net in one pass. An int:
            the draws or nodes are taken once, then ``x`` goes through the net ``batch_size``
            rows at a time (each piece at all draws or nodes, vectorized or looped as
            ``vectorize`` says), and the pieces' outputs are joined: the same prediction, in
            memory for the activations of ``batch_size`` rows times the number of draws instead
            of ``B`` rows times it. ``outputs`` (``(S, B, ...)``) is kept whole either way.

    Under ``torch.no_grad()``.
    With a rule of negative weights, ``probs`` is a signed average and may leave ``[0, 1]``, and
    ``variance`` may be negative.

    Raises:
        ValueError: for an AutoGuide that has not run yet (built from ``bnn(x)`` alone it would
            take the observations for a latent), for ``quadrature`` with a guide that has
            non-Gaussian (``"dirac_gauss"``) sites, for a guide whose site has another shape
            than the net's parameter of that name (a guide of another network), or
            ``num_samples < 1`` without it.
        TypeError, ValueError: for an ``x`` that is no tensor, or holds a NaN or an infinity
            (the rows named; `BayesianModule` refuses such an ``x`` as the model, too).
        ValueError: for one example ``x`` of shape ``(F,)`` (the fix: ``x[None]``), as the model
            refuses it; for a ``vectorize`` other than ``True``, ``False`` or ``None`` (``1``
            and ``0`` too).
        TypeError, ValueError: for a ``batch_size`` that is not an int or ``None`` (a bool, a
            float), or an int below 1; for ``steps`` that is not an int >= 1 or ``"period"``,
            that is not 1 without ``quadrature``, or ``"period"`` with a rule that has none.
    """
    check_inputs(x, "predict", "predicting")
    check_vectorize(vectorize, "predict: ")
    if batch_size is not None:
        wanted = "a positive int (rows of x per pass through the net) or None (all rows at once)"
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"predict: batch_size must be {wanted}, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"predict: batch_size must be {wanted}, got {batch_size!r}")
    _check_steps(steps, quadrature)
    if quadrature is None:
        count = as_index(num_samples)
        if count is None:
            raise TypeError(f"predict: num_samples must be an int >= 1, got {num_samples!r}")
        num_samples = count
        if num_points is not None:
            raise ValueError(
                f"predict: num_points={num_points!r} is the size of a quadrature rule, given "
                "without quadrature=...: pass quadrature='hadamard' (say) with it, or "
                "num_samples for random draws"
            )
    with torch.no_grad():
        if getattr(guide, "prototype_trace", True) is None:
            # built from bnn(x) alone, an AutoGuide would take the observations for a latent
            raise ValueError(
                "predict: the guide has not run yet, so it holds no posterior. Train it first "
                "(svi.step(x, y)), or build it with guide(x, y) on any batch of training data "
                "(at its initialization, or before loading a saved param store or state dict)"
            )
        follow_param_store(unwrap_guide(guide))  # a restored param store's values, not stale ones
        noise = NOISE_SITE if _learned_noise(bnn) else None
        if quadrature is None:
            if num_samples < 1:
                raise ValueError(f"num_samples must be >= 1, got {num_samples}")
            values, noise_scales = _guide_draws(bnn, guide, x, num_samples, noise)
            any_value = next(iter(values.values()), x)
            weights = torch.full(
                (num_samples,), 1.0 / num_samples, dtype=any_value.dtype, device=x.device
            )
        else:
            values, noise_scales, weights = _quadrature_nodes(
                bnn, guide, x, quadrature, num_points, noise, steps
            )
        known = _DECISIONS.get(bnn) if vectorize is not False else None
        mode = known.vectorized if vectorize is None and known is not None else vectorize
        pieces = (x,) if batch_size is None else x.split(batch_size)
        if len(pieces) <= 1:
            pieces = (x,)  # one pass (also for an x of no rows)

        def net_on(draws: dict[str, torch.Tensor], row_dim: int) -> torch.Tensor:
            """The net at ``draws`` on every piece of ``x``, joined along the rows' dim."""
            return torch.cat([bnn.evaluate(draws, piece) for piece in pieces], dim=row_dim)

        outputs, decision = evaluate_batch(
            lambda _: net_on(values, 1),
            lambda k: net_on({name: value[k] for name, value in values.items()}, 0),
            torch.arange(len(weights)),
            mode,
            # a pass checked on an earlier call for this bnn is not checked again
            probe=() if mode and known is not None and known.vectorized else (0, len(weights) - 1),
            what="predict",
        )
        # an explicit False decides nothing; a pass checked under True replaces a loop decided
        # before, so that later calls take it unchecked
        if vectorize is not False and (known is None or decision.vectorized > known.vectorized):
            _DECISIONS.set(bnn, decision=decision)
        weights = weights.to(outputs.dtype)
        mean = _average(outputs, weights)
        probs = variance = noise_variance = None
        likelihood = bnn.likelihood
        if isinstance(likelihood, Categorical):
            probs = _average_probs(torch.softmax(outputs, dim=-1), weights)
        elif isinstance(likelihood, Bernoulli):
            probs = _average_probs(torch.sigmoid(outputs), weights)
        elif isinstance(likelihood, Gaussian):
            if noise_scales is None:
                noise_variance = torch.full_like(mean, likelihood.scale**2)
            else:
                expected = _average(noise_scales.to(outputs.dtype) ** 2, weights)
                noise_variance = expected.expand_as(mean).clone()
            variance = _average((outputs - mean) ** 2, weights) + noise_variance
        return Prediction(outputs, weights, mean, probs, variance, noise_variance)


def _average(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.tensordot(weights, values, dims=([0], [0]))


def _average_probs(probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted mean of per-draw probabilities, clamped to ``[0, 1]`` where no weight is
    negative: there only rounding leaves the range (a float32 mean of ones at 1/30 each is
    1.0000004). A signed average of a rule with negative weights is kept as it is."""
    mean = _average(probs, weights)
    return mean.clamp(0, 1) if bool((weights >= 0).all()) else mean


def _learned_noise(bnn) -> bool:
    likelihood = bnn.likelihood
    return isinstance(likelihood, Gaussian) and likelihood.scale is None


def _guide_draws(bnn, guide, x, num_samples, noise: str | None):
    """``num_samples`` draws of each latent parameter, ``(S, 1) + shape``, in one guide run, and
    of the learned noise scale ``(S,)`` (``None`` without one)."""
    with pyro.plate(_PREDICT_PLATE, num_samples, dim=-2):
        trace = poutine.trace(guide).get_trace(x)
    values = {}
    for name, param in bnn.latent_parameters().items():
        if name not in trace.nodes:
            raise ValueError(f"the guide does not sample the latent parameter {name!r}")
        value = trace.nodes[name]["value"]
        _check_shape(name, value.shape[max(value.dim() - param.dim(), 0) :], param)
        values[name] = value.expand((num_samples, 1, *param.shape))
    noise_scales = None
    if noise is not None:
        if noise not in trace.nodes:
            raise ValueError(f"the guide does not sample the learned noise scale {noise!r}")
        noise_scales = trace.nodes[noise]["value"].expand((num_samples, 1)).reshape(num_samples)
    return values, noise_scales


def _check_shape(name: str, shape: torch.Size, param: torch.Tensor) -> None:
    """Refuse a guide whose site ``name`` does not have the net's parameter's shape."""
    if tuple(shape) != tuple(param.shape):
        raise ValueError(
            f"predict: the guide's site {name!r} has shape {tuple(shape)}, but the net's "
            f"parameter {name!r} has shape {tuple(param.shape)}: the guide was built for another "
            "network. Predict with a guide built and trained on this bnn "
            "(AutoMeanFieldNormal(bnn))"
        )


def _check_steps(steps, quadrature) -> None:
    wanted = 'an int >= 1 (steps of the rule to average) or "period"'
    if isinstance(steps, str):
        if steps != "period":
            raise ValueError(f"predict: steps must be {wanted}, got {steps!r}")
    elif isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"predict: steps must be {wanted}, got {steps!r}")
    elif steps < 1:
        raise ValueError(f"predict: steps must be {wanted}, got {steps!r}")
    if quadrature is None and steps != 1:
        raise ValueError(
            f"predict: steps={steps!r} averages steps of a quadrature rule, but quadrature=None "
            "takes random draws: pass quadrature=... (a rule name or rule), or raise num_samples"
        )


def _quadrature_nodes(bnn, guide, x, quadrature, num_points, noise: str | None, steps):
    """The rule's nodes on the guide's Gaussian over ``steps`` steps, ``(K, 1) + shape`` per
    parameter, the learned noise scale at each node ``(K,)`` (``None`` without one), and the
    weights (each step's divided by the number of steps)."""
    rule = make_rule(quadrature, num_points) if isinstance(quadrature, str) else quadrature
    if not isinstance(rule, QuadratureRule):
        raise TypeError(f"quadrature must be a rule name or a QuadratureRule, got {quadrature!r}")
    trace = trace_for_description(guide, x)
    description = describe_guide(guide, trace)
    mixtures = [site.name for site in description.sites if site.family != "gaussian"]
    if mixtures:
        families = sorted({site.family for site in description.sites} - {"gaussian"})
        raise ValueError(
            f"predict(quadrature=...) needs a Gaussian guide, but sites {mixtures} are {families} "
            "mixtures (AutoSpikeSlab): nodes on their moment-matched Gaussian are not draws of the "
            "guide and bias the average. Use quadrature=None with num_samples (exact draws)."
        )
    loc = description.loc
    if steps == "period":
        period = getattr(rule, "period", None)
        if period is None:
            raise ValueError(
                f"predict: steps='period', but the rule {rule.name!r} has no period: pass an int "
                "number of steps, or a rule that has one (quadrature='hadamard')"
            )
        steps = period(description.dim)
    node_sets = [
        rule.draw(description.dim, step=step, dtype=loc.dtype, device=loc.device)
        for step in range(steps)
    ]
    weights = torch.cat([nodes.weights for nodes in node_sets]) / steps
    z = description.affine(torch.cat([nodes.matrix() for nodes in node_sets]))
    K = z.shape[0]
    params = bnn.latent_parameters()
    values, start, noise_scales = {}, 0, None
    for site in description.latent_sites:
        chunk = z[:, start : start + site.numel].reshape((K, *site.shape))
        start += site.numel
        if site.name in params:
            _check_shape(site.name, site.shape, params[site.name])
            value = site.transform(chunk)
            values[site.name] = value.reshape((K, 1, *params[site.name].shape))
        elif site.name == noise:
            noise_scales = site.transform(chunk).reshape(K)
    missing = sorted(set(params) - set(values))
    if missing:
        raise ValueError(f"the guide's description has no latent parameter {missing}")
    if noise is not None and noise_scales is None:
        raise ValueError(f"the guide's description has no learned noise scale {noise!r}")
    return values, noise_scales, weights
