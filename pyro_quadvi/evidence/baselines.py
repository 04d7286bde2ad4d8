"""Reference evidence estimators to compare OPQA with: importance sampling and nested sampling.

- `importance_log_evidence`: Pyro's ``vectorized_importance_weights`` with any proposal (a
  fitted guide, or the prior through `prior_guide`), in batches;
- `nested_sampling_log_evidence`: dynesty's static nested sampler (the optional extra
  ``pip install "pyro-quadvi[evidence]"``).

Each returns an `EvidenceEstimate` with the number of likelihood evaluations it spent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from pyro import poutine
from pyro.infer.importance import vectorized_importance_weights

from ..infer.log_joint import check_callable, model_max_plate_nesting
from ..optim.qnvb_functional import _check_number
from ..optim.sparse_functional import _check_int

__all__ = [
    "EvidenceEstimate",
    "importance_log_evidence",
    "nested_sampling_log_evidence",
    "prior_guide",
]


@dataclass
class EvidenceEstimate:
    """A log-evidence estimate.

    Attributes:
        log_evidence: the estimate, in nats.
        std_error: its estimated standard error in nats (delta method for importance sampling,
            dynesty's ``logzerr`` for nested sampling).
        num_evaluations: likelihood evaluations spent.
        time_s: wall-clock seconds.
        info: method-specific figures (the effective sample size, the number of iterations).
    """

    log_evidence: float
    std_error: float
    num_evaluations: int
    time_s: float
    info: dict


def _finite_estimate(
    owner: str, estimate: float, std_error: float, cause: Callable[[], str]
) -> None:
    """Refuse a log evidence or standard error that is not finite, with ``cause()``: what the
    estimator saw (how many of its log weights or log likelihoods were not finite)."""
    if not (math.isfinite(estimate) and math.isfinite(std_error)):
        raise ValueError(
            f"{owner}: the estimate is not finite (log evidence {estimate}, standard error "
            f"{std_error}): {cause()}"
        )


def prior_guide(model: Callable) -> Callable:
    """A guide that draws the model's latents from their priors (observed sites hidden).

    With it, importance weights are likelihoods: ``p(x) = E_prior[p(x | theta)]``.
    """
    check_callable("prior_guide", "model", model, "a callable Pyro model")
    return poutine.block(model, hide_fn=lambda msg: bool(msg.get("is_observed")))


def importance_log_evidence(
    model: Callable,
    guide: Callable,
    *args,
    num_samples: int = 1000,
    batch_size: int = 10_000,
    **kwargs,
) -> EvidenceEstimate:
    """``log p(x) ~= log mean_k p(x, z_k) / q(z_k)`` with ``z_k ~ q``, Pyro's importance sampling.

    Draws ``num_samples`` proposals in batches of ``batch_size`` with
    `pyro.infer.importance.vectorized_importance_weights` (the model and the guide must run
    under a particle plate). Seed with ``pyro.set_rng_seed``.

    Raises:
        TypeError: for a ``model`` or ``guide`` that is not callable, named.
        TypeError, ValueError: for a ``num_samples`` that is not an integer ``>= 2`` (one sample
            has no standard error) or a ``batch_size`` that is not an integer ``>= 1``; and for
            an estimate that is not finite, with how many log weights were NaN, ``+inf`` and
            ``-inf`` (an infinite observation made every one ``-inf``).
    """
    check_callable("importance_log_evidence", "model", model, "a callable Pyro model")
    check_callable("importance_log_evidence", "guide", guide, "a callable Pyro guide")
    _check_int("importance_log_evidence: num_samples", num_samples, 2)
    _check_int("importance_log_evidence: batch_size", batch_size, 1)
    start = time.perf_counter()
    trace = poutine.trace(poutine.block(model, hide_types=["param"])).get_trace(*args, **kwargs)
    max_plate_nesting = model_max_plate_nesting(trace)
    chunks = []
    with torch.no_grad():
        for first in range(0, num_samples, batch_size):
            size = min(batch_size, num_samples - first)
            log_weights, _, _ = vectorized_importance_weights(
                model,
                guide,
                *args,
                num_samples=size,
                max_plate_nesting=max_plate_nesting,
                **kwargs,
            )
            chunks.append(log_weights.detach().reshape(-1).to(torch.float64))
    log_weights = torch.cat(chunks)
    log_mean = float(torch.logsumexp(log_weights, 0)) - math.log(num_samples)
    ratios = (log_weights - log_weights.max()).exp()
    ess = float(ratios.sum() ** 2 / ratios.square().sum())
    std_error = float(ratios.std() / ratios.mean()) / math.sqrt(num_samples)
    _finite_estimate(
        "importance_log_evidence",
        log_mean,
        std_error,
        lambda: (
            f"of the {num_samples} log weights log p(x, z) - log q(z), "
            f"{int(log_weights.isnan().sum())} are NaN, {int(log_weights.isposinf().sum())} "
            f"+inf and {int(log_weights.isneginf().sum())} -inf; check the data for an infinite "
            "or NaN observation, and that the guide proposes within the model's support"
        ),
    )
    return EvidenceEstimate(
        log_evidence=log_mean,
        std_error=std_error,
        num_evaluations=num_samples,
        time_s=time.perf_counter() - start,
        info={"effective_sample_size": ess},
    )


def nested_sampling_log_evidence(
    log_likelihood: Callable[[np.ndarray], float],
    prior_transform: Callable[[np.ndarray], np.ndarray],
    ndim: int,
    *,
    nlive: int = 500,
    dlogz: float = 0.01,
    seed: int = 0,
) -> EvidenceEstimate:
    """dynesty's static nested sampler on ``log_likelihood`` under the prior ``prior_transform``.

    Args:
        log_likelihood: ``theta -> log p(x | theta)`` for a parameter vector of length ``ndim``.
        prior_transform: maps a point of the unit cube to the prior (dynesty's convention).
        ndim: the number of parameters (an integer ``>= 1``).
        nlive: live points (an integer ``>= 1``).
        dlogz: the stopping criterion on the remaining evidence (finite and ``>= 0``).
        seed: seeds dynesty's generator (an integer ``>= 0``).

    Raises:
        ImportError: if dynesty is not installed.
        TypeError, ValueError: naming the argument, for a ``log_likelihood`` or
            ``prior_transform`` that is not callable, the integers and ``dlogz`` out of their
            ranges (checked before dynesty sees them), and for an estimate that is not finite.
    """
    owner = "nested_sampling_log_evidence"
    check_callable(owner, "log_likelihood", log_likelihood, "a callable theta -> log p(x | theta)")
    check_callable(owner, "prior_transform", prior_transform, "a callable unit cube -> prior")
    _check_int(f"{owner}: ndim", ndim, 1)
    _check_int(f"{owner}: nlive", nlive, 1)
    _check_int(f"{owner}: seed", seed, 0)
    _check_number(
        "nested_sampling_log_evidence: dlogz", dlogz, lambda v: 0 <= v < math.inf, "finite and >= 0"
    )
    try:
        import dynesty
    except ImportError as error:
        raise ImportError(
            'nested sampling needs dynesty: pip install "pyro-quadvi[evidence]"'
        ) from error
    start = time.perf_counter()
    sampler = dynesty.NestedSampler(
        log_likelihood, prior_transform, ndim, nlive=nlive, rstate=np.random.default_rng(seed)
    )
    sampler.run_nested(dlogz=dlogz, print_progress=False)
    results = sampler.results
    log_evidence, std_error = float(results.logz[-1]), float(results.logzerr[-1])
    logl = np.asarray(results.logl)
    _finite_estimate(
        "nested_sampling_log_evidence",
        log_evidence,
        std_error,
        lambda: (
            f"{int(np.sum(~np.isfinite(logl)))} of the {logl.size} log likelihoods dynesty kept "
            "are not finite; check log_likelihood and prior_transform"
        ),
    )
    return EvidenceEstimate(
        log_evidence=log_evidence,
        std_error=std_error,
        num_evaluations=int(np.sum(results.ncall)),
        time_s=time.perf_counter() - start,
        info={"iterations": int(results.niter)},
    )
