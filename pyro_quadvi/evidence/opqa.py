"""OPQA: the model evidence as the squared norm of Hermite coefficients (opqa paper).

The evidence ``p(x) = int f(z) dz`` with ``f(z) = p(x, T(z)) |J_T(z)|`` on Pyro's unconstrained
latent space is written through standard offsets ``z = m + L x`` (the Gaussian weight of
`weight`) as

    p(x) = E_{x ~ N(0, I)}[g(x)],     g(x) = |det L| f(m + L x) / phi(x),

i.e. the squared ``L^2(N(0, I))`` norm of ``sqrt(g)``. Expanding ``sqrt(g)`` in the orthonormal
probabilists' Hermite polynomials ``psi_tau(x) = prod_k psi_{tau_k}(x_k)`` gives coefficients

    a_tau = E[sqrt(g(x)) psi_tau(x)]                       (eq. 9, eq. 42)

and, by Parseval, ``p(x) = sum_tau a_tau^2`` (eq. 10-11). The coefficients are computed by tensor
Gauss-Hermite quadrature on ``Gamma = num_points`` points per coordinate,

    a_tau ~= sum_j Pi_j Phi_tau,j,   Pi_j = w_j sqrt(g(x_j)),   Phi_tau,j = psi_tau(x_j)
                                                                   (eq. 12, 29-32)

where ``Phi`` is assembled from the ``Gamma x Gamma`` table of ``psi_k`` at the 1-D nodes (the
paper's set ``V_d``, eq. 13) by one contraction per coordinate. The nodes are those of the weight
itself, so the ``psi_tau`` with every ``tau_k <= Gamma - 1`` are orthonormal on the grid and the
full sum of ``a_tau^2`` equals plain Gauss-Hermite quadrature of the evidence on the same nodes.
(The paper integrates eq. 9 against ``exp(-theta^2 / 2)`` on nodes ``sqrt(2) r_i``, eq. 24-26,
which keeps the coefficients' definition but not this identity.) With the paper's fixed weight
(``m = 0``, ``L = I / sqrt(2)``) the exact coefficients are the paper's eq. 9; centring and scaling
the weight on the posterior makes ``g`` nearly constant, so few coefficients carry the evidence.
Everything is done in log space with a max shift.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import tqdm
from pyro import poutine
from pyro.distributions import MaskedDistribution
from pyro.infer.autoguide import AutoLowRankMultivariateNormal
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from pyro.poutine.util import site_is_subsample

from ..export.draws import all_rows_refusal, check_guide_was_run, check_observed_not_nan
from ..guides.interface import unwrap_guide
from ..guides.rows import GivenRows
from ..infer.batched import (
    BatchDecision,
    DtypeMismatch,
    check_vectorize,
    evaluate_batch,
    first_line,
)
from ..infer.log_joint import (
    LatentSite,
    LogJoint,
    check_callable,
    cuda_devices,
    is_improper,
    latent_sites_of_model,
)
from ..quadrature.hermite import gauss_hermite, orthonormal_hermite
from ..store import follow_param_store, shortened
from .posterior import OPQAPosterior, multi_indices
from .weight import GaussianWeight, fixed_weight, guide_weight, laplace_weight

__all__ = ["OPQAResult", "opqa_evidence"]

CENTERS = ("laplace", "guide", "none")
_MAX_AXES = 64  # torch's limit on a tensor's number of axes


@dataclass
class OPQAResult:
    """What `opqa_evidence` returns.

    Attributes:
        log_evidence: ``log p(x) = log sum_{tau in T} a_tau^2`` (eq. 11), in nats.
        coefficients: the ``a_tau`` of ``sqrt(g)`` (eq. 9), a tensor of shape
            ``(num_points,) * dim`` indexed by the multi-index ``tau`` (``coefficients[tau]``);
            above 64 coordinates (torch's limit on a tensor's axes; only ``num_points=1`` gets
            there) the flat tensor of ``num_points ** dim`` entries, first coordinate slowest;
            entries outside the truncation set ``T`` (total degree above ``max_degree``) are 0.
            They equal ``exp(log_evidence / 2) * normalized_coefficients`` and underflow to 0
            where ``log_evidence`` is below about -1400; use ``normalized_coefficients`` then.
        normalized_coefficients: ``a_tau / sqrt(sum_T a^2)``, unit norm (the paper's ``p_T``
            coefficients, Section 2.1).
        posterior: the density ``p_T(x)^2 phi(x)`` mapped to the model's latents
            (`OPQAPosterior`).
        num_evaluations: every evaluation of the log joint, the grid's and the weight's (the MAP
            search and the Hessian for ``center="laplace"``).
        diagnostics: see `opqa_evidence`.
    """

    log_evidence: float
    normalized_coefficients: torch.Tensor
    posterior: OPQAPosterior
    num_evaluations: int
    diagnostics: dict = field(default_factory=dict)

    @property
    def coefficients(self) -> torch.Tensor:
        return self.normalized_coefficients * math.exp(0.5 * self.log_evidence)


def _leaves_random_state(evidence: Callable) -> Callable:
    """``evidence`` run inside a fork of torch's random state. The evidence does not depend on it,
    but the model's runs that find its latent sites draw from the prior: forked, a call between a
    fit's steps does not move the fit. Forked are the CPU's state, the CUDA devices' of the
    model's, the guide's and the arguments' tensors, and the current CUDA device's if CUDA is in
    use (a model that makes its tensors there, a ``pyro.param`` in the param store)."""

    @functools.wraps(evidence)
    def forked(model: Callable, *args: Any, **kwargs: Any) -> OPQAResult:
        devices = set(cuda_devices(model, args, kwargs))
        if torch.cuda.is_initialized():
            devices.add(torch.cuda.current_device())
        with torch.random.fork_rng(devices=sorted(devices)):
            return evidence(model, *args, **kwargs)

    return forked


@_leaves_random_state
def opqa_evidence(
    model: Callable,
    *args: Any,
    num_points: int = 8,
    max_degree: int | None = None,
    center: str = "laplace",
    guide: Callable | None = None,
    max_nodes: int = 2**20,
    chunk_size: int = 4096,
    vectorize: bool | None = None,
    progress: bool | None = None,
    **kwargs: Any,
) -> OPQAResult:
    """The evidence ``p(x)`` of a Pyro model with a few continuous latents, and its posterior.

    Implements the OPQA (opqa paper, Section 2.1 and Algorithm 1) with a Gaussian weight centred
    and scaled on the posterior: ``z = m + L x`` on Pyro's unconstrained latent space (all
    continuous latent sites, flattened, with the log-Jacobian of their transforms), the
    coefficients ``a_tau`` of ``sqrt(g(x))``, ``g = |det L| f(m + L x) / phi(x)``, in the
    orthonormal Hermite basis by tensor Gauss-Hermite quadrature (eq. 9-12, 29-32), and
    ``p(x) = sum a_tau^2`` by Parseval (eq. 11).

    With all coefficients (``max_degree=None``) the sum equals plain Gauss-Hermite quadrature of
    the evidence on the same ``num_points^dim`` nodes (the discrete orthogonality of the Hermite
    polynomials at the nodes); a ``max_degree`` keeps the multi-indices of total degree
    ``<= max_degree`` and can only lower the sum.

    Args:
        model: a Pyro model whose latents are continuous (discrete ones are refused) and whose
            plates are not subsampled.
        *args: the model's arguments.
        num_points: Gauss-Hermite points per latent coordinate (the paper's ``Gamma``); the grid
            has ``num_points ** dim`` nodes.
        max_degree: keep the coefficients of total degree ``|tau| <= max_degree``; ``None`` keeps
            them all (degree ``<= num_points - 1`` in each coordinate).
        center: ``"laplace"`` (the weight ``N(mode, H^-1)`` from the MAP mode and the Hessian),
            ``"guide"`` (a fitted Gaussian guide's loc and scale) or ``"none"`` (the paper's fixed
            weight ``exp(-|z|^2)``, for comparison).
        guide: the fitted Gaussian AutoGuide for ``center="guide"`` (a guide never run, or whose
            scales all still equal its ``init_scale``, is refused: it was not fitted); with
            ``center="laplace"`` its loc starts the MAP search (otherwise it starts at ``z = 0``).
        max_nodes: the largest grid allowed.
        chunk_size: grid nodes per evaluation of the model.
        vectorize: ``None`` (default) evaluates the first chunk in one run of the model under a
            particle plate, checks it against node-by-node runs at three nodes and, if the model
            does not broadcast (a shape error, or values that differ), loops over the nodes with
            one warning; ``True`` runs every chunk vectorized, checking the first chunk the same
            way (their errors propagate, and a disagreement raises
            `BatchMismatch` naming the reason and the ways
            out); ``False`` always loops. Errors of the model itself propagate in every case.
        progress: show a progress bar over the chunks (``None``: for grids of several chunks, on
            a terminal).
        **kwargs: the model's keyword arguments (the names above are taken).

    The model is evaluated in float64, which the accuracy of about ``1e-8`` nats needs: the
    floating-point tensors among ``args`` and ``kwargs`` are cast to float64, the prior draws that
    find the latent sites are float64, and the grid nodes are float64 (a ``PyroModule`` built in
    float32 with ``PyroSample`` priors runs so). A model holding float32 tensors that do not mix
    with float64 ones (an ``nn.Linear`` with fixed float32 weights) is refused with the fix:
    build it in float64.

    Devices. The model is evaluated on the device of its latents, the one the prior draws them
    on (where Pyro's AutoGuides put their parameters): the MAP search and its Hessian, the
    weight, the Gauss-Hermite nodes and the grid points are made there, and a fitted guide's
    loc and scale are moved there. The grid's log-joint values are then copied to the CPU once,
    and the coefficients, the evidence and the posterior are computed and returned there (a
    float and CPU tensors, as for a CPU model); the posterior copies the tensors of its sites'
    transforms (a ``Uniform`` prior's bounds) to the CPU too. Latents drawn on two devices, or
    away from the CUDA device of the model's tensors, are refused, naming the sites.

    Returns:
        An `OPQAResult`. Its ``diagnostics`` hold ``center``, ``dim``, ``num_points``,
        ``max_degree``, ``grid_size``, ``loc`` and ``scale_tril`` (the weight),
        ``log_joint_at_center``, ``quadrature_log_evidence`` (plain Gauss-Hermite, all nodes),
        ``laplace_log_evidence`` (for ``center="laplace"``), ``energy_by_degree`` (the share of
        ``sum a^2`` at each total degree: it should fall off), ``edge_fraction`` (the share of
        the coefficients with a coordinate at degree ``num_points - 1``: large means too few
        points or a weight that misses the posterior, but small is no error estimate; compare
        the evidence at two values of ``num_points`` for that), ``vectorized`` (and
        ``vectorize_fallback``, why not), ``dtype`` (``torch.float64``), the evaluation counts
        and ``time_s``.

    Raises:
        ValueError: for discrete or enumerated latents, a latent with masked-out entries
            (``poutine.mask``, ``Distribution.mask``, the ``*_unobserved`` latent of
            ``obs_mask``: the evidence is not defined), a subsampled plate, a model without
            latents, a grid above ``max_nodes`` (use fewer points), an unknown ``center``, a
            guide that was not fitted, a log joint that is not finite at the centre of the weight
            or at a grid node, a model that does not run in float64, a model whose latents and
            tensors are on different devices, or a weight that cannot be built.
    """
    start_time = time.perf_counter()
    _check_arguments(
        num_points, max_degree, center, guide, max_nodes, chunk_size, vectorize, progress
    )
    # a restored param store's values, not the stale ones of plain parameters (store.py)
    follow_param_store(unwrap_guide(model))
    if guide is not None:
        follow_param_store(unwrap_guide(guide))
    args, kwargs = _to_float64(args), _to_float64(kwargs)
    sites, device = _latent_sites_and_device(model, args, kwargs)
    _check_sample_sites(_Float64Prior()(model), args, kwargs)
    dim = sum(site.numel for site in sites)
    if dim == 0:
        raise ValueError(
            "opqa_evidence: the model has no continuous latent sites; its evidence is "
            "exp(log p(x)) with nothing to integrate"
        )
    # the grid's size compared without writing out num_points**dim where it has more digits than
    # a message can hold (10^6 latents: 8^1000000)
    if (
        num_points > 1 and dim * math.log2(num_points) > max_nodes.bit_length() + 1
    ) or num_points**dim > max_nodes:
        raise ValueError(_grid_too_large(sites, dim, num_points, max_nodes))
    grid_size = num_points**dim

    log_joint = LogJoint(model, sites)
    weight = _build_weight(center, guide, log_joint, sites, dim, device, args, kwargs)
    log_joint_at_center = _log_joint_at_center(log_joint, weight, center, args, kwargs)

    nodes, weights = gauss_hermite(num_points)
    log_weights = weights.log()
    log_f, decision = _evaluate_grid(
        log_joint, weight, nodes.to(device), dim, args, kwargs, vectorize, chunk_size, progress
    )
    # the model's part is done: the coefficients are a few contractions of the grid's values,
    # made on the CPU from one copy of them (and of the weight), as in a CPU run
    log_f, weight = log_f.cpu(), weight.to("cpu")

    # log Pi_j = log w_j + (log|det L| + log f(z_j) - log phi(x_j)) / 2   (eq. 31)
    log_w = torch.zeros(grid_size, dtype=torch.float64)
    log_phi = torch.full((grid_size,), -0.5 * dim * math.log(2 * math.pi), dtype=torch.float64)
    indices = multi_indices(num_points, dim)  # (dim, grid_size)
    for digit in indices:
        log_w += log_weights[digit]
        log_phi -= 0.5 * nodes[digit] ** 2
    log_g = weight.log_abs_det + log_f - log_phi
    log_pi = log_w + 0.5 * log_g
    shift = log_pi.max()
    pi = (log_pi - shift).exp()

    # a_tau = Pi . Phi_tau (eq. 30): one contraction with the (node x degree) table per
    # coordinate, on the flat grid (first coordinate slowest): each contracts the slowest
    # coordinate and appends its degree as the fastest, so after dim of them the order is back
    table = orthonormal_hermite(nodes, num_points - 1)
    scaled = pi
    for _ in range(dim):
        scaled = (scaled.reshape(num_points, -1).T @ table).reshape(-1)
    degree = indices.sum(0)
    keep = degree <= (max_degree if max_degree is not None else dim * (num_points - 1))
    truncated = torch.where(keep, scaled, torch.zeros_like(scaled))
    energy = truncated.square()
    total = energy.sum()
    log_evidence = float(2.0 * shift + total.log())
    normalized = truncated / total.sqrt()
    if dim <= _MAX_AXES:
        normalized = normalized.reshape((num_points,) * dim)

    quadrature_log_evidence = float(torch.logsumexp(log_w + log_g, 0))
    top = dim * (num_points - 1)
    energy_by_degree = [float(energy[degree == k].sum() / total) for k in range(top + 1)]
    edge = (indices.amax(0) == num_points - 1) & keep
    diagnostics = {
        "center": center,
        "dim": dim,
        "num_points": num_points,
        "max_degree": max_degree,
        "grid_size": grid_size,
        "loc": weight.loc,
        "scale_tril": weight.scale_tril,
        "log_joint_at_center": log_joint_at_center,
        "quadrature_log_evidence": quadrature_log_evidence,
        "energy_by_degree": energy_by_degree,
        "edge_fraction": float(energy[edge].sum() / total) if num_points > 1 else 1.0,
        "vectorized": decision.vectorized,
        "vectorize_fallback": decision.reason,
        "dtype": torch.float64,
        "grid_evaluations": grid_size,
        "weight_evaluations": weight.evaluations,
        "probe_evaluations": decision.probe_evaluations,
        **weight.info,
    }
    if center == "laplace":
        diagnostics["laplace_log_evidence"] = (
            log_joint_at_center + 0.5 * dim * math.log(2 * math.pi) + weight.log_abs_det
        )
    posterior = OPQAPosterior(sites, weight.loc, weight.scale_tril, normalized)
    num_evaluations = grid_size + weight.evaluations + decision.probe_evaluations + 1
    diagnostics["time_s"] = time.perf_counter() - start_time
    return OPQAResult(log_evidence, normalized, posterior, num_evaluations, diagnostics)


def _grid_too_large(sites: list[LatentSite], dim: int, num_points: int, max_nodes: int) -> str:
    """The refusal of a grid of more than ``max_nodes`` nodes, with the largest ``num_points``
    that fits, or, where not even 2 points fit, what to use instead."""
    names = shortened((site.name for site in sites), 5, "sites")
    size = f"{num_points}^{dim}"
    if dim * math.log2(num_points) <= 64:
        size += f" = {num_points**dim}"
    fewer = 1 if dim >= max_nodes.bit_length() else math.floor(max_nodes ** (1.0 / dim) + 1e-9)
    while fewer > 1 and fewer**dim > max_nodes:  # the root's rounding may overshoot by one
        fewer -= 1
    if fewer >= 2:
        way = f"use num_points <= {fewer} or raise max_nodes"
    else:
        way = (
            f"even num_points=2 needs 2^{dim} nodes: OPQA suits models with a handful of latents "
            f"(at most {max_nodes.bit_length() - 1} with 2 points and max_nodes={max_nodes}); "
            "fit this model with an ELBO (QuadratureELBO)"
        )
    return (
        f"opqa_evidence: {dim} latent coordinates ({names}) with num_points={num_points} need a "
        f"grid of {size} log-joint evaluations, more than max_nodes={max_nodes}; {way}"
    )


def _check_arguments(
    num_points, max_degree, center, guide, max_nodes, chunk_size, vectorize, progress
) -> None:
    if isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 1:
        raise ValueError(f"opqa_evidence: num_points must be an int >= 1, got {num_points!r}")
    if max_degree is not None and (
        isinstance(max_degree, bool) or not isinstance(max_degree, int) or max_degree < 0
    ):
        raise ValueError(
            f"opqa_evidence: max_degree must be None or an int >= 0, got {max_degree!r}"
        )
    if center not in CENTERS:
        raise ValueError(f"opqa_evidence: center must be one of {CENTERS}, got {center!r}")
    if guide is not None:
        check_callable("opqa_evidence", "guide", guide, "a fitted guide (a callable), or None")
    if center == "guide" and guide is None:
        raise ValueError("opqa_evidence(center='guide') needs the fitted guide: guide=...")
    if center == "none" and guide is not None:
        raise ValueError(
            "opqa_evidence(center='none') uses the fixed weight and no guide; drop guide=... or "
            "use center='guide'"
        )
    for name, value in (("max_nodes", max_nodes), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"opqa_evidence: {name} must be an int >= 1, got {value!r}")
    check_vectorize(vectorize, "opqa_evidence: ")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"opqa_evidence: progress must be None, True or False, got {progress!r}")


def _to_float64(value):
    """``value`` with its floating-point tensors (also inside tuples, lists, dicts) in float64."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_float64(item) for item in value))
    if isinstance(value, tuple | list):
        return type(value)(_to_float64(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_float64(item) for key, item in value.items()}
    return value


class _Float64Prior(Messenger):
    """Draws the latent sites from the prior in float64 (a float32 prior's draws are cast), and
    records the device of each draw in `devices` (site -> device, in the model's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: dict[str, torch.device] = {}

    def _pyro_sample(self, msg) -> None:
        if msg["is_observed"] or msg["value"] is not None or isinstance(msg["fn"], _Subsample):
            return
        if is_improper(msg["fn"]):
            raise ValueError(
                f"opqa_evidence: latent site {msg['name']!r} has an improper prior "
                "(ImproperUniform), and the evidence, the integral of likelihood times prior, "
                "is defined for proper priors only. Give the site a proper prior (a wide Normal; "
                "for ordered cut points, a Normal transformed by OrderedTransform)"
            )
        value = msg["fn"](*msg["args"], **msg["kwargs"])
        msg["value"] = value.to(torch.float64) if value.is_floating_point() else value
        msg["done"] = True
        self.devices[msg["name"]] = value.device


_DTYPE_ERRORS = ("dtype", "expected scalar type", "Double and Float", "Float and Double")
# torch's words for an operation between tensors on two devices (CUDA's, and the meta device's)
_DEVICE_ERRORS = ("same device", "expected device")
_DEVICE_FIX = (
    "opqa_evidence evaluates the latents on the device where the prior draws them, as Pyro's "
    "AutoGuides place their parameters. Put the model's data and its priors' parameters on one "
    "device: build each prior from tensors on the data's device, e.g. "
    "dist.Normal(torch.zeros(3, device=X.device), 1.0) rather than dist.Normal(0.0, 1.0)"
    ".expand([3]), or move the data (X.to(device))"
)


def _latent_sites_and_device(
    model: Callable, args: tuple, kwargs: dict
) -> tuple[list[LatentSite], torch.device]:
    """The model's latent sites, from a run in float64, and the device its latents live on.

    The device is the one the prior draws its latents on, the device of the prototype values
    from which Pyro's AutoGuides (and so `QuadratureELBO`'s nodes)
    take theirs. Refuses a model that cannot run in float64, latents drawn on two devices, and
    latents drawn away from the CUDA device holding the model's tensors
    (`cuda_devices` of the model and its arguments), each
    named, with the fix.
    """
    prior = _Float64Prior()
    try:
        sites = latent_sites_of_model(prior(model), *args, **kwargs)
    except (RuntimeError, DtypeMismatch) as error:
        if isinstance(error, RuntimeError) and any(t in str(error) for t in _DEVICE_ERRORS):
            if not prior.devices:  # the model mixes devices before any latent: its own business
                raise
            raise ValueError(
                f"opqa_evidence: the model mixes devices ({first_line(error)}) after drawing "
                f"{_drawn_on(prior.devices)}. {_DEVICE_FIX}"
            ) from None
        if isinstance(error, RuntimeError) and not any(t in str(error) for t in _DTYPE_ERRORS):
            raise
        raise ValueError(
            f"opqa_evidence evaluates the model in float64 (its 1e-8 accuracy needs it), and the "
            f"model does not run in float64 ({first_line(error)}): it holds float32 tensors of its "
            "own. Build it in float64: torch.set_default_dtype(torch.float64) before creating the "
            "model (or module.double() for a PyroModule's fixed parameters; net.double() before "
            "wrapping it in a BayesianModule)"
        ) from None
    devices = {prior.devices[site.name] for site in sites if site.name in prior.devices}
    if len(devices) > 1:
        raise ValueError(
            f"opqa_evidence: the model's latents are drawn on {len(devices)} devices: "
            f"{_drawn_on(prior.devices)}. {_DEVICE_FIX}"
        )
    device = devices.pop() if devices else torch.device("cpu")
    elsewhere = [
        torch.device("cuda", index)
        for index in cuda_devices(model, args, kwargs)
        if torch.device("cuda", index) != device
    ]
    if elsewhere:
        raise ValueError(
            f"opqa_evidence: the model's tensors (its arguments, or a module's parameters) are on "
            f"{', '.join(map(str, elsewhere))}, but its latents are drawn on {device} "
            f"({_drawn_on(prior.devices)}). {_DEVICE_FIX}"
        )
    return sites, device


def _drawn_on(devices: dict[str, torch.device]) -> str:
    """``'a' on cuda:0, 'b' on cpu``: the latent sites and where the prior drew them."""
    return ", ".join(f"{name!r} on {device}" for name, device in devices.items())


def _check_sample_sites(model: Callable, args: tuple, kwargs: dict) -> None:
    """Refuse what would change the integrand unseen: a plate that does not run on each of its
    rows once (with the fix for how its rows came: `all_rows_refusal`; every such plate in one
    message), a masked latent (the integral over it is infinite), a sample site scaled by
    ``poutine.scale`` (a tempered likelihood), observed data with NaN; each named."""
    given = GivenRows()  # the plates whose rows the caller gave (subsample=...)
    blocked = poutine.block(given(model), hide_types=["param"])
    trace = poutine.trace(blocked).get_trace(*args, **kwargs)
    for name, site in trace.nodes.items():
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site):
            _check_latent_not_masked(name, site, trace)
    refusals = {}  # every plate in one message: a user who fixes one does not meet the next
    for name, site in trace.nodes.items():
        if site["type"] == "sample" and site_is_subsample(site):
            refusal = all_rows_refusal(site, name in given.given, "the evidence")
            if refusal:
                refusals[name] = refusal
    if len(refusals) == 1:
        raise ValueError(f"opqa_evidence: {refusals.popitem()[1]}")
    if refusals:
        names = [repr(name) for name in refusals]
        listed = " ".join(f"({k}) {refusal}." for k, refusal in enumerate(refusals.values(), 1))
        raise ValueError(
            f"opqa_evidence: {len(refusals)} plates do not run on each of their rows once, "
            f"{', '.join(names[:-1])} and {names[-1]}: {listed}"
        )
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        scale = torch.as_tensor(site["scale"])
        if (scale != 1).any():
            shown = (
                float(scale) if scale.numel() == 1 else f"a tensor of shape {tuple(scale.shape)}"
            )
            raise ValueError(
                f"opqa_evidence: sample site {name!r} is scaled by {shown} (poutine.scale): the "
                "evidence is the integral of the model's unscaled joint density, and a tempered "
                "term would change it (the ArviZ export drops the scale too); remove the "
                "poutine.scale, or write the tempering into the model's distributions"
            )
        if site["is_observed"]:
            try:
                check_observed_not_nan(site, before="computing the evidence (and the fit)")
            except ValueError as error:
                raise ValueError(f"opqa_evidence: {error}") from None


_NO_EVIDENCE = (
    "so the evidence is not defined: a log density of 0 is Lebesgue measure, not a probability, "
    "and the integral over those entries is infinite (the support's volume on a bounded one)"
)


def _check_latent_not_masked(name: str, site: dict, trace) -> None:
    """Refuse a latent with masked-out entries (``poutine.mask``, ``Distribution.mask`` or the
    ``*_unobserved`` latent of ``obs_mask``): the log joint does not depend on them, so the
    evidence integral over them is improper, and any finite grid gives a finite, wrong value."""
    masks = [] if site["mask"] is None else [torch.as_tensor(site["mask"])]
    fn = site["fn"]
    while hasattr(fn, "base_dist"):  # Independent, MaskedDistribution
        if isinstance(fn, MaskedDistribution):
            masks.append(torch.as_tensor(fn._mask))
        fn = fn.base_dist
    if all(bool(mask.all()) for mask in masks):
        return
    base = name.removesuffix("_unobserved")
    if base != name and f"{base}_observed" in trace.nodes:
        raise ValueError(
            f"opqa_evidence: latent site {name!r}, made by pyro.sample({base!r}, ..., obs=..., "
            "obs_mask=...), has its observed entries masked out: the model gives them no density, "
            f"{_NO_EVIDENCE}. Drop the "
            "missing rows from the data; or fill them with any finite value and, instead of "
            f"obs_mask, observe {base!r} under poutine.mask(mask=obs_mask), so the missing rows "
            "count 0"
        )
    raise ValueError(
        f"opqa_evidence: latent site {name!r} has masked-out entries (a False in its mask, by "
        "poutine.mask or Distribution.mask): the model gives them no density, "
        f"{_NO_EVIDENCE}. Mask only the likelihood of "
        "observed sites, and give every latent its density (or remove the latent)"
    )


def _build_weight(center, guide, log_joint, sites, dim, device, args, kwargs) -> GaussianWeight:
    """The weight on ``device`` (the model's): the MAP search and the Hessian of
    ``center="laplace"`` run there, since every step evaluates the model; a guide fitted on
    another device gives its loc and scale, moved."""
    if center == "none":
        return fixed_weight(dim, device)
    if center == "guide":
        _check_guide_was_fitted(guide, args, kwargs)
        weight = guide_weight(guide, sites, args, kwargs)
        _check_scales_moved(guide, weight)
        return weight.to(device)
    start = torch.zeros(dim, dtype=torch.float64, device=device)
    if guide is not None:
        start = guide_weight(guide, sites, args, kwargs).loc.to(device)
    start_weight = GaussianWeight(start, torch.eye(dim, dtype=torch.float64, device=device))
    _log_joint_at_center(log_joint, start_weight, "MAP start", args, kwargs)
    weight = laplace_weight(log_joint, start, args, kwargs, from_guide=guide is not None)
    weight.evaluations += 1  # the check at the start
    return weight


def _log_joint_at_center(log_joint, weight, center, args, kwargs) -> float:
    """``log f`` at the weight's centre; refuses a value that is not finite."""
    with torch.no_grad():
        try:
            value = log_joint(weight.loc[None], args, kwargs, vectorize=False)[0]
        except ValueError as error:
            named = [*enumerate(args), *kwargs.items()]  # position or keyword, value
            lists = [f"{key!r}" for key, value in named if type(value) is list]
            if lists:  # Pyro's "the value argument to log_prob must be a Tensor", not a NaN
                raise ValueError(
                    f"opqa_evidence: the model failed at the centre of the weight ({center}) "
                    f"with a list as its argument {', '.join(lists)}: pass a tensor "
                    f"(torch.tensor(...)) where the model expects one; the error: {error}"
                ) from None
            raise ValueError(
                f"opqa_evidence: the log joint is not finite at the centre of the weight "
                f"({center}, z = {weight.loc.tolist()}): {error}"
            ) from None
    return float(value)


def _evaluate_grid(
    log_joint, weight, nodes, dim, args, kwargs, vectorize, chunk_size, progress
) -> tuple[torch.Tensor, BatchDecision]:
    """``log f(m + L x_j)`` on the tensor grid, in chunks; the first chunk decides ``vectorize``
    (`evaluate_batch`) for all of them. The points are made on
    the device of ``nodes`` and of the weight (the model's), and so are the values."""
    num_points = len(nodes)
    grid_size = num_points**dim
    starts = range(0, grid_size, chunk_size)
    # progress=None: a bar for grids of several chunks, on a terminal only (tqdm's None)
    disable = (True if len(starts) < 2 else None) if progress is None else not progress
    bar = tqdm.tqdm(starts, desc="OPQA grid", unit="chunk", disable=disable)

    def batched(z: torch.Tensor) -> torch.Tensor:
        return log_joint(z, args, kwargs, vectorize=True)

    def single(z: torch.Tensor) -> torch.Tensor:
        return log_joint(z[None], args, kwargs, vectorize=False)[0]

    values, decision = [], None
    with torch.no_grad():
        for start in bar:
            digits = multi_indices(
                num_points,
                dim,
                torch.arange(start, min(start + chunk_size, grid_size), device=nodes.device),
            )
            z = weight.loc + nodes[digits.T] @ weight.scale_tril.T
            mode = vectorize if decision is None else decision.vectorized
            try:
                chunk, chosen = evaluate_batch(
                    batched,
                    single,
                    z,
                    mode,
                    probe=None if decision is None else (),  # the first chunk checks the pass
                    what="opqa_evidence",
                )
            except ValueError as error:
                far = ""
                if "not finite" in str(error):  # LogJoint's account of a log joint out of range
                    far = (
                        f". The outermost nodes lie {float(nodes.abs().max()):.3g} weight "
                        "standard deviations from the centre; fewer points keep them closer"
                    )
                raise ValueError(
                    f"opqa_evidence: at the grid chunk starting at node {start}: {error}{far}"
                ) from None
            decision = decision or chosen
            values.append(chunk.to(torch.float64))
    return torch.cat(values), decision


def _check_guide_was_fitted(guide: Callable, args: tuple, kwargs: dict) -> None:
    """Refuse a guide that was never run (its weight would be its initial loc and scale)."""
    try:
        check_guide_was_run(guide, args, kwargs)
    except RuntimeError as error:
        raise ValueError(
            f"opqa_evidence(center='guide'): {error}; or use center='laplace', which needs no guide"
        ) from None


def _check_scales_moved(guide: Callable, weight: GaussianWeight) -> None:
    """Refuse a guide whose scales all still equal its ``init_scale`` (run, but never fitted).

    Only guides that record an ``init_scale`` (Pyro's AutoGuides, AutoMeanFieldNormal) are
    checked. ``AutoLowRankMultivariateNormal`` starts its covariance factor at random, but its
    diagonal ``scale`` at exactly ``init_scale / sqrt(2)`` in every coordinate: that ``scale``
    is checked instead of the weight (a fit moves every coordinate of it).
    """
    init_scale = getattr(guide, "_init_scale", None)
    if not isinstance(init_scale, int | float):
        return
    if isinstance(guide, AutoLowRankMultivariateNormal):
        with torch.no_grad():
            scales = guide.scale.detach().to(torch.float64)
        at_init = torch.full_like(scales, 0.5**0.5 * init_scale)
        what = (
            f"every entry of the diagonal scale of the {type(guide).__name__} still equals its "
            f"start, init_scale / sqrt(2) with init_scale={init_scale}"
        )
    else:
        scales = weight.scale_tril
        at_init = init_scale * torch.eye(
            len(weight.loc), dtype=weight.scale_tril.dtype, device=weight.scale_tril.device
        )
        what = f"every scale of the {type(guide).__name__} still equals its init_scale={init_scale}"
    if torch.allclose(scales, at_init, rtol=1e-6, atol=0.0):
        raise ValueError(
            f"opqa_evidence(center='guide'): {what}: the guide was never fitted, and a weight that "
            "misses the posterior gives a wrong evidence. Fit it first (svi.step(*args, "
            "**kwargs) until the loss settles), or use center='laplace'"
        )
