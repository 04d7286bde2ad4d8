"""The OPQA posterior density ``p_T(x)^2 phi(x)`` (opqa paper, Section 2.1), on the model's latents.

With normalized coefficients ``b_tau = a_tau / sqrt(sum_T a^2)`` the polynomial
``p_T(x) = sum_{tau in T} b_tau psi_tau(x)`` has unit norm under ``N(0, I)``, so
``q(x) = p_T(x)^2 phi(x)`` is a probability density of the standard offsets. It is carried to the
unconstrained latents by ``z = m + L x`` (dividing by ``|det L|``) and to the model's constrained
latents by ``theta = T(z)`` (dividing by ``|det dT/dz|``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributions.constraints import Constraint
from torch.distributions.transforms import (
    CatTransform,
    ComposeTransform,
    IndependentTransform,
    SigmoidTransform,
    StackTransform,
    StickBreakingTransform,
    TanhTransform,
    Transform,
)

from ..infer.log_joint import LatentSite
from ..optim.sparse_functional import _check_int
from ..quadrature.hermite import GaussHermiteRule, orthonormal_hermite

__all__ = ["Marginal", "OPQAPosterior"]

_BATCH_ELEMENTS = 2**22  # points x coefficients evaluated at once in p_T
_MAX_COMPLEMENT_NODES = 4096  # Gauss-Hermite nodes over the other coordinates, per marginal value


@dataclass
class Marginal:
    """The one-dimensional marginal densities of the coordinates of a latent site, on a grid.

    Attributes:
        values: the grid of each coordinate, shape ``(num, *shape)``: constrained values, or the
            unconstrained ones where ``constrained`` is false.
        density: the marginal density at ``values``, same shape.
        unconstrained_values, unconstrained_density: the same in Pyro's unconstrained space.
        constrained: whether ``values`` are constrained; false for sites whose transform is not
            elementwise (a simplex, say), where a constrained coordinate is not a function of one
            unconstrained coordinate.
        exact: whether the integral over the other coordinates was exact (always, unless the
            expansion has a high degree in many dimensions; see `OPQAPosterior.marginals`).
    """

    values: torch.Tensor
    density: torch.Tensor
    unconstrained_values: torch.Tensor
    unconstrained_density: torch.Tensor
    constrained: bool
    exact: bool


class OPQAPosterior:
    """The density ``p_T(x)^2 phi(x)`` of the OPQA expansion, in the model's latent spaces.

    Args:
        sites: the latent sites laid out in the flat unconstrained vector.
        loc: the weight's center: ``z = loc + scale_tril @ x``.
        scale_tril: the weight's lower-triangular scale.
        coefficients: the normalized coefficients ``b_tau``, shape ``(num_points,) * dim`` or
            the flat ``(num_points ** dim,)`` (first coordinate slowest: above 64 coordinates,
            torch's limit on a tensor's axes), ``sum b^2 = 1``.

    The posterior lives on the device of ``loc``: ``scale_tril`` and ``coefficients`` are copied
    there, and so are the tensors inside the sites' transforms (the bounds of a ``Uniform``
    prior's ``Sigmoid`` and ``Affine`` parts, say), into copies of the sites: the sites of a model
    on a GPU hold transforms built from its priors there. Every density, moment and marginal is
    computed there, and values passed to the densities may be on any device: they are copied to
    it too. `opqa_evidence` gives ``loc`` on the CPU whatever the
    model's device (the densities and moments are small computations, and a posterior on the CPU
    is the same object for a CPU model and a GPU one); a CPU model's transforms hold CPU tensors
    already, and its posterior computes with the same numbers as before the copy.
    """

    def __init__(
        self,
        sites: Sequence[LatentSite],
        loc: torch.Tensor,
        scale_tril: torch.Tensor,
        coefficients: torch.Tensor,
    ):
        device = loc.device
        self.sites = [
            dataclasses.replace(site, transform=_on_device(site.transform, device))
            for site in sites
        ]
        self.loc = loc
        self.scale_tril = scale_tril.to(device)
        self.coefficients = coefficients.to(device)
        self.dim = loc.shape[0]
        # the computations run on the flat tensor: it holds any dim
        self._flat = self.coefficients.reshape(-1)
        self.num_points = round(self._flat.numel() ** (1.0 / self.dim))
        self._moments: tuple[torch.Tensor, torch.Tensor] | None = None

    def polynomial(self, x: torch.Tensor) -> torch.Tensor:
        """``p_T(x)`` at standard offsets ``x`` of shape ``(..., dim)`` (on any device; the value
        is on the posterior's)."""
        batch = x.shape[:-1]
        flat = x.reshape(-1, self.dim).to(self.coefficients.device, torch.float64)
        step = max(1, _BATCH_ELEMENTS // self.num_points ** max(self.dim - 1, 1))
        return torch.cat([self._polynomial(chunk) for chunk in flat.split(step)]).reshape(batch)

    def _polynomial(self, x: torch.Tensor) -> torch.Tensor:
        m = self.num_points
        psi = orthonormal_hermite(x, m - 1)  # (B, dim, m)
        out = psi[:, 0] @ self._flat.reshape(m, -1)  # (B, m ** (dim - 1))
        for k in range(1, self.dim):
            out = torch.einsum("bi,bir->br", psi[:, k], out.reshape(len(x), m, -1))
        return out.reshape(len(x))

    def log_prob_unconstrained(self, z: torch.Tensor) -> torch.Tensor:
        """Log density at flat unconstrained latents ``z`` of shape ``(..., dim)`` (on any
        device; the density is on the posterior's)."""
        z = torch.as_tensor(z, dtype=torch.float64, device=self.loc.device)
        if z.shape[-1:] != (self.dim,):
            raise ValueError(
                f"expected unconstrained latents of shape (..., {self.dim}), got {tuple(z.shape)}"
            )
        centred = (z - self.loc).reshape(-1, self.dim).T
        x = torch.linalg.solve_triangular(self.scale_tril, centred, upper=False).T
        log_phi = -0.5 * (x**2).sum(-1) - 0.5 * self.dim * math.log(2 * math.pi)
        log_det = self.scale_tril.diagonal().abs().log().sum()
        log_q = 2.0 * self.polynomial(x).abs().log() + log_phi - log_det
        return log_q.reshape(z.shape[:-1])

    def log_prob(self, values: Mapping[str, torch.Tensor] | torch.Tensor | float) -> torch.Tensor:
        """Log density at the model's constrained latents.

        Args:
            values: ``{site: value}`` with every latent site, each of shape
                ``batch + constrained site shape`` (a common ``batch``) and anything
                ``torch.as_tensor`` takes (a tensor, a number, a list, a NumPy array); for a model
                with one latent site, the value itself.

        Returns:
            The log density of shape ``batch``, with the log-Jacobian of ``theta -> z``. NaN where
            a value is NaN; ``-inf`` where a value is infinite, outside its site's support, or on
            the boundary of the support (the open image of the site's transform): ``p_T^2 phi``
            decays faster than any Jacobian there (a Gaussian tail in ``z``), so the density's
            limit at the boundary is 0 even where the true posterior's is not.
        """
        if not isinstance(values, Mapping):
            if len(self.sites) != 1:
                raise ValueError(
                    "log_prob needs a dict {site: value} for a model with several latent sites: "
                    f"{[site.name for site in self.sites]}"
                )
            values = {self.sites[0].name: values}
        flats, log_jacobian, batch, inside, nan = [], 0.0, None, True, False
        for site in self.sites:
            if site.name not in values:
                raise ValueError(f"log_prob: no value for the latent site {site.name!r}")
            value = _as_float64(values[site.name], site.name, self.loc.device)
            shape = tuple(site.transform.forward_shape(site.shape))
            if tuple(value.shape[value.dim() - len(shape) :]) != shape:
                raise ValueError(
                    f"log_prob: site {site.name!r} takes values of shape (..., {shape}), got "
                    f"{tuple(value.shape)}"
                )
            site_batch = value.shape[: value.dim() - len(shape)]
            if batch is not None and site_batch != batch:
                raise ValueError(
                    f"log_prob: the sites' batch shapes differ ({tuple(batch)} and "
                    f"{tuple(site_batch)} at {site.name!r})"
                )
            batch = site_batch
            nan = torch.isnan(value).reshape((*batch, -1)).any(-1) | nan
            infinite = torch.isinf(value).reshape((*batch, -1)).any(-1)
            inside = _in_image(site.transform, value, batch) & ~infinite & inside
            z = site.transform.inv(value)
            # a value on the boundary has an infinite inverse where the inverse does not clamp
            inside = torch.isfinite(z).reshape((*batch, -1)).all(-1) & inside
            ladj = site.transform.log_abs_det_jacobian(z, value)
            log_jacobian = log_jacobian + ladj.reshape((*batch, -1)).sum(-1)
            flats.append(z.reshape((*batch, site.numel)))
        # the points outside are evaluated at the centre, so no inf or NaN enters the solve
        flat = torch.where(inside[..., None], torch.cat(flats, -1), self.loc)
        log_q = self.log_prob_unconstrained(flat) - log_jacobian
        log_q = torch.where(inside, log_q, -math.inf)
        return torch.where(nan, math.nan, log_q)

    def _x_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact mean and covariance of ``x`` under ``p_T^2 phi``.

        ``x_k psi_n = sqrt(n + 1) psi_{n+1} + sqrt(n) psi_{n-1}`` maps the coefficients of
        ``p_T`` to those of ``x_k p_T``; ``E[x_k] = <p_T, x_k p_T>`` and
        ``E[x_k x_l] = <x_k p_T, x_l p_T>`` by orthonormality. Only ``x_k p_T`` reaches degree
        ``m`` in coordinate ``k``, so that part adds to ``E[x_k^2]`` alone,
        ``m sum_{tau_k = m - 1} b_tau^2``; the rest lies on the coefficients' own grid.
        """
        if self._moments is None:
            m, d = self.num_points, self.dim
            root = torch.arange(m, dtype=torch.float64, device=self.loc.device).sqrt()[1:, None]
            times, spill = [], []
            for k in range(d):
                moved = self._flat.reshape(m**k, m, -1)  # coordinate k in the middle
                up = torch.zeros_like(moved)
                up[:, 1:] = root * moved[:, :-1]  # sqrt(n) b_{n-1}
                up[:, :-1] += root * moved[:, 1:]  # sqrt(n + 1) b_{n+1}
                times.append(up.reshape(-1))
                spill.append(m * moved[:, -1].square().sum())
            products = torch.stack(times)  # (d, m^d)
            mean = products @ self._flat
            second = products @ products.T + torch.diag(torch.stack(spill))
            self._moments = (mean, second - torch.outer(mean, mean))
        return self._moments

    @property
    def mean_unconstrained(self) -> torch.Tensor:
        """The exact mean of the flat unconstrained latents under the density, shape ``(dim,)``."""
        return self.loc + self.scale_tril @ self._x_moments()[0]

    @property
    def covariance_unconstrained(self) -> torch.Tensor:
        """The exact covariance of the flat unconstrained latents, shape ``(dim, dim)``."""
        return self.scale_tril @ self._x_moments()[1] @ self.scale_tril.T

    def marginals(self, num: int = 201, width: float = 6.0) -> dict[str, Marginal]:
        """One-dimensional marginal densities of every latent coordinate, on a grid.

        The grid of a coordinate spans its exact mean plus or minus ``width`` exact standard
        deviations in the unconstrained space (``num`` equally spaced values there, mapped through
        the site's transform). A coordinate ``z_i = m_i + s u`` depends on the standard offsets
        through one direction ``u = e^T x``; its density is ``phi(u) E_y[p_T(u e + Q y)^2] / s``
        with ``Q`` an orthonormal basis of the complement of ``e``, and the expectation is a
        tensor Gauss-Hermite quadrature over ``y``, exact for the degree of ``p_T`` (capped at
        4096 nodes: ``Marginal.exact`` is false if the cap cut it).
        """
        _check_int("OPQAPosterior.marginals: num", num, 2)
        mean, covariance = self._x_moments()
        complement_rule, exact = self._complement_rule()
        device = self.loc.device
        densities, grids = [], []
        for i in range(self.dim):
            row = self.scale_tril[i]
            scale = row.norm()
            direction = row / scale
            basis = torch.linalg.qr(
                torch.cat(
                    [direction[:, None], torch.eye(self.dim, dtype=torch.float64, device=device)],
                    1,
                )
            ).Q[:, 1:]
            centre = float(direction @ mean)
            spread = math.sqrt(float(direction @ covariance @ direction))
            u = torch.linspace(
                centre - width * spread,
                centre + width * spread,
                num,
                dtype=torch.float64,
                device=device,
            )
            if complement_rule is None:
                squared = self.polynomial(u[:, None] * direction).square()
            else:
                y, w = complement_rule
                x = u[:, None, None] * direction + y @ basis.T  # (num, K, dim)
                squared = self.polynomial(x).square() @ w
            log_phi = -0.5 * u**2 - 0.5 * math.log(2 * math.pi)
            densities.append(log_phi.exp() * squared / scale)
            grids.append(self.loc[i] + scale * u)
        grid = torch.stack(grids, -1)
        density = torch.stack(densities, -1)
        result, start = {}, 0
        for site in self.sites:
            z = grid[:, start : start + site.numel].reshape((num, *site.shape))
            dz = density[:, start : start + site.numel].reshape((num, *site.shape))
            start += site.numel
            elementwise = _elementwise(site.transform)
            if elementwise is not None:
                theta = elementwise(z)
                dtheta = dz * (-elementwise.log_abs_det_jacobian(z, theta)).exp()
            else:
                theta, dtheta = z, dz
            result[site.name] = Marginal(theta, dtheta, z, dz, elementwise is not None, exact)
        return result

    def _complement_rule(self) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, bool]:
        """A Gauss-Hermite rule over ``dim - 1`` coordinates, and whether it is exact.

        ``p_T(u e + Q y)^2`` has degree ``<= 2 top`` in each ``y`` coordinate (``top``: the highest
        total degree of ``p_T``, counting coefficients above ``1e-12`` of the norm), integrated
        exactly by ``top + 1`` points per coordinate.
        """
        m, d = self.num_points, self.dim
        if d == 1:
            return None, True
        degree = multi_indices(m, d).sum(0).to(self.coefficients.device)
        significant = self._flat.abs() > 1e-12
        top = int(degree[significant].max()) if significant.any() else 0
        cap = max(1, math.floor(_MAX_COMPLEMENT_NODES ** (1.0 / (d - 1)) + 1e-9))
        points = min(top + 1, cap)
        y, w = GaussHermiteRule(points).nodes(d - 1, dtype=torch.float64, device=self.loc.device)
        return (y, w), points == top + 1


def multi_indices(num_points: int, dim: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """The multi-index ``tau`` of entries of a flat coefficient tensor of ``num_points ** dim``
    entries (the grid's order: the first coordinate slowest).

    Args:
        num_points: the entries per coordinate.
        dim: the number of coordinates.
        index: the flat entries (an integer tensor, on any device); ``None``: all of them.

    Returns:
        A tensor of shape ``(dim, len(index))`` on the device of ``index``: entry ``[k, j]`` is
        ``tau_k`` of entry ``index[j]``. Flat, it holds any ``dim`` (torch's tensors have at most
        64 axes, so a ``(num_points,) * dim`` layout does not).
    """
    if index is None:
        index = torch.arange(num_points**dim)
    return torch.stack(
        [
            torch.div(index, num_points ** (dim - 1 - k), rounding_mode="floor") % num_points
            for k in range(dim)
        ]
    )


def _elementwise(transform: Transform) -> Transform | None:
    """The elementwise transform behind ``transform`` (unwrapping ``IndependentTransform``)."""
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return transform if transform.domain.event_dim == 0 else None


def _on_device(item, device: torch.device, memo: dict[int, object] | None = None):
    """A copy of a transform or constraint, and of the transforms and constraints inside it, with
    every tensor of theirs moved to ``device``; other items as they are (a tensor held by a
    distribution or a module inside a transform is not moved: ``biject_to`` makes none such).

    Copies are made once per object (``memo``, as in ``copy.deepcopy``): a transform and the
    inverse it caches refer to each other, and their copies do too. A weak reference (torch's
    cache of an inverse) is dropped; torch makes the inverse again on demand.
    """
    memo = {} if memo is None else memo
    if id(item) in memo:
        return memo[id(item)]
    if isinstance(item, torch.Tensor):
        return item.to(device)
    if isinstance(item, weakref.ref):
        return None
    if isinstance(item, list | tuple):
        return type(item)(_on_device(part, device, memo) for part in item)
    if isinstance(item, Transform | Constraint):
        moved = copy.copy(item)
        memo[id(item)] = moved
        for key, value in vars(item).items():
            setattr(moved, key, _on_device(value, device, memo))
        return moved
    return item


def _in_image(transform: Transform, value: torch.Tensor, batch: torch.Size) -> torch.Tensor:
    """Whether each value (shape ``batch + event``) lies in the image of ``transform``.

    The codomain of a composition is its last part's, which can be wider than the image: the
    ``Affine`` part of ``biject_to(interval(a, b))`` has the real line as codomain. So a
    composition is checked part by part, from the last: the value in the last part's image, its
    inverse in the image of the part before, and so on. A ``CatTransform`` or ``StackTransform``
    is checked piece by piece, each in its own transform's image.
    """
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    if isinstance(transform, CatTransform | StackTransform):
        if isinstance(transform, CatTransform):
            pieces = value.split(transform.lengths, dim=transform.dim)
        else:
            pieces = value.unbind(transform.dim)
        inside = torch.ones(batch, dtype=torch.bool, device=value.device)
        for part, piece in zip(transform.transforms, pieces):
            inside = inside & _in_image(part, piece, batch)
        return inside
    if not isinstance(transform, ComposeTransform):
        return _in_open_image(transform, value).reshape((*batch, -1)).all(-1)
    inside = torch.ones(batch, dtype=torch.bool, device=value.device)
    for part in reversed(transform.parts):
        inside = inside & _in_image(part, value, batch)
        value = part.inv(value)
    return inside


def _in_open_image(transform: Transform, value: torch.Tensor) -> torch.Tensor:
    """Whether ``value`` lies in the image of a transform that is not composed.

    The image is the codomain, except where the codomain is closed and the image open: a
    ``Sigmoid`` reaches ``(0, 1)`` and a ``Tanh`` ``(-1, 1)``, never the bounds, and a
    ``StickBreaking`` the simplex with every entry above 0, never its faces. The ``Sigmoid``'s
    inverse clamps the bounds to finite values, so without this a bound would get a finite (and
    huge, negative) density instead of the limit 0.
    """
    inside = transform.codomain.check(value)
    if isinstance(transform, SigmoidTransform):
        return inside & (value > 0) & (value < 1)
    if isinstance(transform, TanhTransform):
        return inside & (value > -1) & (value < 1)
    if isinstance(transform, StickBreakingTransform):
        return inside & (value > 0).all(-1)
    return inside


def _as_float64(value, name: str, device: torch.device) -> torch.Tensor:
    """``value`` (a tensor, a number, a list, a NumPy array) as a float64 tensor on ``device``."""
    try:
        return torch.as_tensor(value, dtype=torch.float64, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"log_prob: the value of site {name!r} must be a tensor, a number or an array-like "
            f"that torch.as_tensor takes, got {type(value).__name__} ({error})"
        ) from None
