"""The Gaussian weight of the OPQA expansion: where it is centred and how it is scaled.

OPQA expands the square root of the joint density in polynomials orthonormal under a Gaussian
weight (opqa paper, eq. 4-9). The paper fixes the weight to ``exp(-theta^2)``; here it is any
``N(loc, L L^T)`` on Pyro's unconstrained latent space, written through standard offsets
``z = loc + L x`` with ``x ~ N(0, I)``. Three choices:

- `laplace_weight`: a Laplace approximation, ``N(mode, H^-1)`` with the MAP mode found by
  L-BFGS and the Hessian ``H`` of the negative log joint by autograd;
- `guide_weight`: the loc and scale of a fitted Gaussian guide;
- `fixed_weight`: the paper's ``exp(-theta^2)``, i.e. ``loc = 0`` and ``L = I / sqrt(2)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import torch
from pyro import poutine

from ..guides.interface import describe_guide
from ..infer.batched import user_stacklevel
from ..infer.log_joint import LatentSite, LogJoint

__all__ = ["GaussianWeight", "fixed_weight", "guide_weight", "laplace_weight"]


@dataclass
class GaussianWeight:
    """The weight ``N(loc, scale_tril scale_tril^T)`` on the flat unconstrained latents.

    Attributes:
        loc: the centre, shape ``(dim,)``, float64.
        scale_tril: a lower-triangular factor ``L`` of the covariance, shape ``(dim, dim)``.
        evaluations: log-joint evaluations spent finding it (the MAP search and the Hessian).
        info: what the construction reports (e.g. the gradient norm at the mode).
    """

    loc: torch.Tensor
    scale_tril: torch.Tensor
    evaluations: int = 0
    info: dict = field(default_factory=dict)

    @property
    def log_abs_det(self) -> float:
        """``log |det L|``, the log-Jacobian of ``x -> loc + L x``."""
        return float(self.scale_tril.diagonal().abs().log().sum())

    def to(self, device: torch.device | str) -> GaussianWeight:
        """The same weight with ``loc`` and ``scale_tril`` on ``device``."""
        return GaussianWeight(
            self.loc.to(device), self.scale_tril.to(device), self.evaluations, self.info
        )


def fixed_weight(dim: int, device: torch.device | str | None = None) -> GaussianWeight:
    """The paper's fixed weight ``exp(-|theta|^2)`` (eq. 4): ``N(0, I / 2)``, ``L = I / sqrt(2)``.

    With ``theta = x / sqrt(2)`` the coefficients ``a_tau`` of the expansion are exactly the paper's
    eq. 9 (its normalized physicists' Hermite ``h_n(theta)`` is ``pi^(-1/4) psi_n(x)``).
    """
    eye = torch.eye(dim, dtype=torch.float64, device=device)
    return GaussianWeight(
        torch.zeros(dim, dtype=torch.float64, device=device), eye / math.sqrt(2.0)
    )


def laplace_weight(
    log_joint: LogJoint,
    start: torch.Tensor,
    args: tuple,
    kwargs: dict,
    max_iter: int = 500,
    tolerance_grad: float = 1e-9,
    from_guide: bool = False,
    newton_steps: int = 10,
) -> GaussianWeight:
    """Laplace approximation ``N(mode, H^-1)`` of the unconstrained posterior.

    The mode maximizes ``log p(x, T(z)) + log|J_T(z)|`` over the unconstrained ``z`` (L-BFGS with a
    strong Wolfe line search, from ``start``); ``H`` is the Hessian of its negative at the mode, by
    autograd, and ``L`` the lower Cholesky factor of ``H^-1``; all on the device of ``start``
    (the model's: each step of the search evaluates the model). ``from_guide``: whether ``start``
    is a fitted guide's loc (for the advice of an error).

    L-BFGS's stopping tests are absolute, so on badly scaled data (a loss of 1e12 at the start)
    it can stop hundreds of posterior standard deviations short. The distance left is measured
    scale-free, in weight standard deviations: ``m = sqrt(g^T H^-1 g)``, the Newton step's length
    in the whitened coordinates ``x``. While ``m > 1e-6``, up to ``newton_steps`` Newton steps
    ``z -= H^-1 g`` follow (halved until the negative log joint does not rise; one step is exact
    for a Gaussian posterior), each with a new gradient and Hessian; below ``m = 1e-2`` a step
    that does not halve ``m`` ends them (the gradient's rounding is all that is left); an ``m``
    still above ``1e-4`` (an error of about ``m^2 / 2`` nats at one point) is warned of. ``info``
    reports ``map_distance_sd`` (``m``), ``map_gradient_norm`` and ``newton_steps``.

    Raises:
        ValueError: where the log joint is not finite along the search (naming the coordinate
            that moved farthest: no mode may exist), or ``H`` is not positive
            definite at the point found (no isolated mode).
    """

    def negative_log_joint(z: torch.Tensor) -> torch.Tensor:
        return -log_joint(z[None], args, kwargs, vectorize=False)[0]

    point = start.detach().clone().to(torch.float64).requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [point],
        lr=1.0,
        max_iter=max_iter,
        max_eval=2 * max_iter,
        tolerance_grad=tolerance_grad,
        tolerance_change=1e-15,
        history_size=50,
        line_search_fn="strong_wolfe",
    )
    evaluations = 0

    def closure() -> torch.Tensor:
        nonlocal evaluations
        optimizer.zero_grad()
        evaluations += 1
        loss = negative_log_joint(point)
        loss.backward()
        return loss

    try:
        optimizer.step(closure)
    except ValueError as error:
        # LogJoint's first clause names the site and the point; its advice is a guide's
        reached = point.detach()
        farthest = int((reached - start).abs().argmax())
        origin = f"{float(start[farthest]):.4g}" + (", the guide's loc," if from_guide else "")
        raise ValueError(
            "opqa_evidence(center='laplace'): the MAP search met a log joint that is not finite "
            f"({str(error).partition(';')[0]}), having moved farthest along "
            f"{_coordinate(log_joint.sites, farthest)} (unconstrained, from {origin} to "
            f"{float(reached[farthest]):.4g}): the log joint may grow without bound that way, so "
            "that no mode exists (a centred hierarchical model's funnel, whose density grows "
            "without bound as a group scale goes to 0), or the search stepped out of a support "
            "that a latent sets. Write the model non-centred (theta = mu + tau * theta_raw with "
            "theta_raw ~ Normal(0, 1)), or fit a Gaussian guide and use center='guide'"
        ) from None
    mode = point.detach()
    at_mode, grad = _value_and_grad(negative_log_joint, mode)
    hessian, factor = _hessian_factor(negative_log_joint, mode)
    evaluations += 2
    if factor is None:
        _refuse_hessian(log_joint.sites, mode, hessian)
    # L-BFGS's tests are absolute (from a loss of 1e12 it stopped hundreds of weight standard
    # deviations short): measure the distance left in those sds, the length of the Newton step
    # in the weight's whitened coordinates, and take Newton steps while it is not negligible;
    # one step is exact for a Gaussian posterior
    distance = _newton_length(grad, factor)
    steps = 0
    # derivatives that autograd gets wrong (a detached term, a kink at the mode) measure no
    # distance and steer no Newton step: checked first, at the point L-BFGS found
    evaluations += 2  # the check of the derivatives
    scale_tril = torch.linalg.cholesky(torch.cholesky_inverse(factor))
    smooth = _check_derivatives(negative_log_joint, mode, at_mode, grad, scale_tril)
    while smooth and distance > _NEWTON_TARGET and steps < newton_steps:
        point, value, grad_there, tries = _newton_step(
            negative_log_joint, mode, at_mode, grad, factor, distance
        )
        evaluations += tries
        if point is None:  # no decrease along the step, within the rounding of the log joint
            break
        factor_there = _hessian_factor(negative_log_joint, point)[1]
        evaluations += 1
        if factor_there is None:  # not positive definite there: keep the last point
            break
        distance_there = _newton_length(grad_there, factor_there)
        # near the mode a step leaves about the square of the distance: one that does not
        # halve it measures the gradient's rounding (a log joint partly in float32), which
        # further steps only follow; the nearer point is kept, and the steps end
        rounding = distance < _QUADRATIC and distance_there > distance / 2
        if rounding and distance_there >= distance:
            break
        mode, at_mode, grad, factor = point, value, grad_there, factor_there
        distance = distance_there
        steps += 1
        if rounding:
            break
    if steps:
        scale_tril = torch.linalg.cholesky(torch.cholesky_inverse(factor))
    grad_norm = float(grad.abs().max())
    if smooth and distance > _DISTANCE_WARNING:
        warnings.warn(
            f"opqa_evidence(center='laplace'): the MAP search (L-BFGS, then {steps} Newton "
            f"steps) stopped {distance:.3g} weight standard deviations from the mode, as far as "
            "the Newton step sqrt(g^T H^-1 g) measures it (gradient norm "
            f"{grad_norm:.3g}), so the weight is off-centre: for a Gaussian posterior the "
            f"evidence at 1 point is low by about {distance**2 / 2:.3g} nats (half the square), "
            "and more points help only while the offset is a few standard deviations (the "
            "outermost of K nodes lies under 2 sqrt(K) of them out); far beyond, the evidence "
            "is wrong at any feasible number of points. Centre and scale the data (targets "
            "near 0, features near unit scale), or pass a fitted guide= to start the search "
            "near the mode",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    info = {"map_gradient_norm": grad_norm, "map_distance_sd": distance, "newton_steps": steps}
    return GaussianWeight(mode, scale_tril, evaluations, info)


# the Newton steps go on while the mode is farther than this many weight standard deviations (an
# error of m^2 / 2 = 5e-13 nats at 1 point for a Gaussian posterior), for at most ``newton_steps``
# steps; farther than _DISTANCE_WARNING at the end is warned of: an error of up to 5e-9 nats at 1
# point, the 1e-8 nats that the evidence is meant to reach
_NEWTON_TARGET = 1e-6
_DISTANCE_WARNING = 1e-4
# the step halvings of a Newton step that does not lower the negative log joint
_MAX_HALVINGS = 20
# below this distance a Newton step leaves about the distance's square (a third derivative of
# order 1 in weight sds): a step that does not halve it is following the gradient's rounding
_QUADRATIC = 1e-2


def _value_and_grad(
    negative_log_joint: Callable[[torch.Tensor], torch.Tensor], point: torch.Tensor
) -> tuple[float, torch.Tensor]:
    with torch.enable_grad():
        value = point.clone().requires_grad_(True)
        loss = negative_log_joint(value)
        (grad,) = torch.autograd.grad(loss, value)
    return float(loss.detach()), grad


def _hessian_factor(
    negative_log_joint: Callable[[torch.Tensor], torch.Tensor], point: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (symmetrized) Hessian at ``point`` by autograd, and its lower Cholesky factor (None
    where it is not positive definite).

    Its D rows are taken in one batched backward (``vectorize=True``: at 400 sites 1.95 s
    where D backward passes took 11.8 s, the cost growing as D^2), or, where torch cannot batch
    the backward of the model's operations, one row a pass."""
    try:
        hessian = torch.autograd.functional.hessian(negative_log_joint, point, vectorize=True)
    except RuntimeError:  # a backward vmap cannot batch
        hessian = torch.autograd.functional.hessian(negative_log_joint, point)
    hessian = 0.5 * (hessian + hessian.T)
    factor, info = torch.linalg.cholesky_ex(hessian)
    if info.item() != 0 or not torch.isfinite(factor).all():
        return hessian, None
    return hessian, factor


def _newton_length(grad: torch.Tensor, factor: torch.Tensor) -> float:
    """``sqrt(g^T H^-1 g)`` with ``H = F F^T``: the Newton step's length in weight sds."""
    whitened = torch.linalg.solve_triangular(factor, grad[:, None], upper=False)
    return float(whitened.norm())


def _newton_step(
    negative_log_joint: Callable[[torch.Tensor], torch.Tensor],
    point: torch.Tensor,
    value: float,
    grad: torch.Tensor,
    factor: torch.Tensor,
    distance: float,
) -> tuple[torch.Tensor | None, float, torch.Tensor | None, int]:
    """The Newton step ``-H^-1 g`` from ``point`` (``distance`` weight sds long), halved until
    the negative log joint does not rise above ``value`` by more than its rounding, while it is
    longer than ``_NEWTON_TARGET`` (a shorter one is not worth a try): the point reached (None
    where no try did), its value and gradient, and the evaluations spent (one a try; a log
    joint that is not finite counts as a rise)."""
    step = torch.cholesky_solve(grad[:, None], factor)[:, 0]
    rounding = 64 * torch.finfo(torch.float64).eps * (1.0 + abs(value))
    halvings = min(_MAX_HALVINGS, max(0, math.floor(math.log2(distance / _NEWTON_TARGET))))
    for halving in range(halvings + 1):
        candidate = point - step / 2**halving
        try:
            reached, grad_there = _value_and_grad(negative_log_joint, candidate)
        except ValueError:  # LogJoint's refusal of a value that is not finite
            continue
        if reached <= value + rounding:
            return candidate, reached, grad_there, halving + 1
    return None, value, None, halvings + 1


def _refuse_hessian(
    sites: Sequence[LatentSite], mode: torch.Tensor, hessian: torch.Tensor
) -> NoReturn:
    """Refuse a Hessian that is not positive definite at the point found, naming the flat
    sites where there are."""
    flat = _flat_sites(sites, hessian)
    if flat:
        raise ValueError(
            "opqa_evidence(center='laplace'): the log joint does not depend on "
            f"{', '.join(flat)} near the point found (z = {mode.tolist()}): a flat direction "
            "(a latent with an improper prior that no term informs), along which the integral "
            "is infinite, so the evidence does not exist and no weight (center='guide' "
            "neither) gives it; give the latent a proper prior, or remove it"
        )
    raise ValueError(
        "opqa_evidence(center='laplace'): the Hessian of the negative log joint at the point "
        f"found (z = {mode.tolist()}) is not positive definite, so there is no isolated mode "
        "to centre the weight on; fit a Gaussian guide and use center='guide'"
    )


# the finite difference's step, in weight standard deviations: large enough that a log joint
# computed partly in float32 (``dist.HalfCauchy(1.)`` casts its value to its float32 scale: about
# 1e-7 nats of rounding) moves the curvature by about 4e-5, not the 0.35 it did at a step of 1e-3
_STEP = 0.1


def _check_derivatives(
    negative_log_joint: Callable[[torch.Tensor], torch.Tensor],
    mode: torch.Tensor,
    at_mode: float,
    grad: torch.Tensor,
    scale_tril: torch.Tensor,
) -> bool:
    """Warn where autograd's derivatives at the mode disagree with finite differences, and
    say whether they agree (``True`` also where the check cannot be made).

    Along ``v = L u`` (``u`` the unit diagonal: one weight standard deviation) autograd gives the
    slope ``grad . v`` and, by the construction of ``L``, the curvature ``v^T H v = 1``; central
    differences of the log joint at ``mode +- h v`` (two evaluations, ``h = 0.1``) give both
    again. They agree to about ``h^2 = 1e-2`` times a third or fourth derivative in weight
    standard deviations (about ``1e-3`` for a smooth log joint); a term that autograd does not
    see (a detached latent, ``.item()`` or ``float()``) leaves the weight on the rest of the
    model, often the prior, and the evidence needs far more points. A point of the check where
    the log joint is not finite skips it.
    """
    direction = scale_tril.sum(-1) / math.sqrt(len(mode))
    try:
        with torch.no_grad():
            ahead = float(negative_log_joint(mode + _STEP * direction))
            behind = float(negative_log_joint(mode - _STEP * direction))
    except ValueError:
        return True
    slope = (ahead - behind) / (2 * _STEP)
    curvature = (ahead - 2 * at_mode + behind) / _STEP**2
    # central differences: h^2 times a third or fourth derivative, and the rounding of the values
    tolerance = 1e-2 + 1e3 * torch.finfo(torch.float64).eps * abs(at_mode) / _STEP**2
    expected = float(grad @ direction)
    if abs(slope - expected) <= tolerance and abs(curvature - 1.0) <= tolerance:
        return True
    warnings.warn(
        "opqa_evidence(center='laplace'): autograd's derivatives of the log joint disagree with "
        "its values: along one weight standard deviation from the mode found, the slope is "
        f"{-slope:.4g} by finite differences and {0.0 - expected:.4g} by autograd, the curvature "
        f"{-curvature:.4g} and -1. A term of the log joint is not differentiable by autograd, "
        "likely a latent detached on its way to a distribution (x.detach(), x.item(), float(x), "
        "x.numpy(), torch.tensor(x)), so the weight is centred and scaled on the rest of the "
        "model and the evidence needs many more points; keep the latents as tensors in the "
        "model's arithmetic. Or the log joint has a kink at the mode (abs, a Laplace density, "
        "relu, clamp), whose curvature autograd does not see: there the Laplace weight is too "
        "wide or too narrow and more points, or center='guide' with a fitted guide, are needed",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
    return False


def _flat_sites(sites: Sequence[LatentSite], hessian: torch.Tensor) -> list[str]:
    """The sites (`_coordinate`) of the coordinates whose Hessian row is 0."""
    flat = (hessian == 0).all(-1).nonzero().flatten().tolist()
    return [_coordinate(sites, index) for index in flat]


def _coordinate(sites: Sequence[LatentSite], index: int) -> str:
    """``'name'`` or ``'name' (entry k)``: the site of coordinate ``index`` of the flat latents."""
    for site in sites:
        if index < site.numel:
            return f"{site.name!r}" + (f" (entry {index})" if site.numel > 1 else "")
        index -= site.numel
    raise IndexError(index)


def guide_weight(
    guide: Callable, sites: Sequence[LatentSite], args: tuple, kwargs: dict
) -> GaussianWeight:
    """The weight given by a fitted Gaussian guide's unconstrained mean and covariance.

    The guide is read through `describe_guide` from one run: a mean
    field gives a diagonal ``L``; a joint Gaussian (``AutoMultivariateNormal``,
    ``AutoLowRankMultivariateNormal``) the Cholesky factor of its covariance.

    Raises:
        ValueError: for a guide whose posterior the package cannot read, a subsampled guide, or
            one whose latents do not match the model's.
    """
    with torch.no_grad():
        trace = poutine.trace(guide).get_trace(*args, **kwargs)
        try:
            description = describe_guide(guide, trace)
        except TypeError as error:
            raise ValueError(
                f"opqa_evidence(center='guide') needs a Gaussian AutoGuide: {error}; use "
                "center='laplace' otherwise"
            ) from None
    layout = [(site.name, tuple(site.shape)) for site in description.latent_sites]
    expected = [(site.name, tuple(site.shape)) for site in sites]
    if layout != expected:
        raise ValueError(
            f"opqa_evidence(center='guide'): the guide's latents {layout} do not match the "
            f"model's {expected}; fit the guide on this model with these arguments"
        )
    for site in description.sites:
        if site.rows:
            raise ValueError(
                f"opqa_evidence(center='guide'): the guide subsamples site {site.name!r}; OPQA "
                "needs every latent in full: run it without subsampling"
            )
    loc = description.loc.detach().to(torch.float64)
    if description.joint is None:  # a mean field: the factor is diagonal
        scale_tril = torch.diag(description.scale.detach().to(torch.float64))
    else:
        scale_tril = torch.linalg.cholesky(description.covariance().detach().to(torch.float64))
    return GaussianWeight(loc, scale_tril, 0, {"guide": description.guide})
