"""A Normal prior's log density at the points, a slice of the points at a time.

At ``K`` points ``z_k`` of a latent site with a Normal prior of constant parameters, torch's
``Normal.log_prob``

    log N(z | m, s^2) = -(z - m)^2 / (2 s^2) - log s - log(2 pi) / 2

makes five tensors of ``K`` times the site's size, one after the other, and keeps ``z - m`` for the
backward pass, whose chain makes five more (``IidNormal.log_prob``, the same density with numbers
for ``m`` and ``s``, makes two and keeps one, with three more in its backward): on a site of
``D = 10^7`` coordinates and ``K = 3``, up to 9 ``D`` floats held at once by the prior alone, for an
answer of ``K`` numbers. `NodeByNodeNormal` runs the same operations, in the same order, on a
slice of dim 0 at a time (a point: dim 0 is the points' dim in a vectorized pass), writing into
one output; its backward recomputes ``z - m`` slice by slice and applies torch's own backward
formulas of the chain to it (``Div``: ``grad / other``, ``Mul``: ``grad * other``, ``Neg``,
``Pow`` with exponent 2: ``grad * (2 (z - m))``; the subtractions pass the gradient on). Each
element goes through the same floating-point operations as in torch, so the log density and its
gradient are torch's, bit for bit; the intermediates exist for one slice at a time, and the output
and the gradient are the only tensors of all points' size.

Only ``QuadratureELBO`` uses it (`LogJoint`'s ``node_by_node``), on sites of more than one slice
(`SLICE_ELEMENTS`): its backward has no derivative of its own, so a ``create_graph=True``
backward through it is refused (as through the node points' ``once_differentiable`` backward),
and a Hessian of the log joint (``opqa_evidence``'s Laplace weight) keeps torch's graph.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch.distributions import Independent
from torch.distributions.utils import _sum_rightmost

from ..distributions.iid_normal import _HALF_LOG_2PI, IidNormal

__all__ = ["SLICE_ELEMENTS", "NodeByNodeNormal"]

#: the constant of torch's ``Normal.log_prob``, computed as torch computes it
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))

#: the elements of one slice: at least one row of dim 0 (one point), more for small sites
SLICE_ELEMENTS = 2**16

_NORMALS = (torch.distributions.Normal, dist.Normal)  # exactly these (a subclass has its own)


class NodeByNodeNormal:
    """A site's distribution whose ``log_prob`` evaluates its ``Normal`` a slice of the points at
    a time (the module); every other attribute is the distribution's.

    `of` gives one for torch's ``Normal`` whose ``loc`` and ``scale`` need no gradient and
    have the value's dtype and device, and for an `IidNormal` (numbers), inside any number of
    ``Independent`` (``to_event``), where the value has the broadcast shape of the batch.
    """

    def __init__(self, fn: torch.distributions.Distribution):
        self.fn = fn

    @classmethod
    def of(
        cls, fn: torch.distributions.Distribution, value: torch.Tensor
    ) -> NodeByNodeNormal | None:
        """``fn`` made to evaluate a slice at a time, or ``None``: for another distribution, or
        a value of one slice (torch's ``log_prob`` then holds no more than a slice's)."""
        if not isinstance(value, torch.Tensor) or value.numel() <= SLICE_ELEMENTS:
            return None
        base = fn
        while isinstance(base, Independent):
            base = base.base_dist
        if isinstance(base, IidNormal) and base.iid is not None:
            shapes = [base.batch_shape]
        elif type(base) in _NORMALS:
            params = (base.loc, base.scale)
            like = (value.dtype, value.device)
            if any(p.requires_grad or (p.dtype, p.device) != like for p in params):
                return None
            shapes = [param.shape for param in params]
        else:
            return None
        return cls(fn) if torch.broadcast_shapes(value.shape, *shapes) == value.shape else None

    def __getattr__(self, name: str):
        return getattr(self.fn, name)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``fn.log_prob(value)``, bit for bit, with its gradient (the module)."""
        return _log_prob(self.fn, value)


def _log_prob(fn: torch.distributions.Distribution, value: torch.Tensor) -> torch.Tensor:
    """torch's ``Independent.log_prob`` around the Normal's, a slice at a time."""
    if isinstance(fn, Independent):
        return _sum_rightmost(_log_prob(fn.base_dist, value), fn.reinterpreted_batch_ndims)
    if fn._validate_args:
        fn._validate_sample(value)
    if isinstance(fn, IidNormal):
        return _IidNormalLogDensity.apply(value, *fn.iid)
    return _NormalLogDensity.apply(value, fn.loc.expand(value.shape), fn.scale.expand(value.shape))


def _refuse_second_order() -> None:
    """Raise where a backward pass builds a graph (``create_graph=True``: a Hessian, a gradient
    penalty): the slices' backward formulas are not differentiable, and torch's
    ``once_differentiable`` would return a gradient without a graph, silently dropping the
    prior's curvature."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "the node-by-node Normal log density (LogJoint(node_by_node=True), as QuadratureELBO "
            "evaluates a Normal prior) has no second derivative: for a create_graph=True "
            "backward use LogJoint(node_by_node=False), torch's own log_prob"
        )


def _slices(value: torch.Tensor) -> list[slice]:
    """Slices of dim 0, each at least one row and about `SLICE_ELEMENTS` elements."""
    step = max(1, SLICE_ELEMENTS // max(1, value[0].numel()))
    return [slice(start, start + step) for start in range(0, len(value), step)]


def _new_like(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value, memory_format=torch.contiguous_format)


class _NormalLogDensity(torch.autograd.Function):
    """torch's ``Normal(loc, scale).log_prob(value)``, a slice of dim 0 at a time, for ``loc``
    and ``scale`` (expanded to ``value``'s shape) that need no gradient."""

    @staticmethod
    def forward(ctx, value, loc, scale):
        ctx.save_for_backward(value, loc, scale)
        out = _new_like(value)
        for part in _slices(value):
            _normal_slice(value[part], loc[part], scale[part], out[part])
        return out

    @staticmethod
    def backward(ctx, grad):
        _refuse_second_order()
        value, loc, scale = ctx.saved_tensors
        grad_value = _new_like(value)
        for part in _slices(value):
            _normal_slice_backward(
                grad[part], value[part], loc[part], scale[part], grad_value[part]
            )
        return grad_value, None, None


# (one function a slice: its temporaries are freed before the next slice makes its own)


def _normal_slice(value, loc, scale, out) -> None:
    """``-((value - loc) ** 2) / (2 * scale ** 2) - log(scale) - log(sqrt(2 pi))`` into ``out``
    (an in-place operation rounds as the one it stands for)."""
    torch.sub(value, loc, out=out)
    out.pow_(2).neg_().div_(_twice_variance(scale))
    out.sub_(scale.log()).sub_(_LOG_SQRT_2PI)


def _normal_slice_backward(grad, value, loc, scale, out) -> None:
    """The gradient of `_normal_slice` into ``out``: Div, ``grad / (2 var)``; Neg; Pow,
    ``* (2 (value - loc))``."""
    twice_variance = _twice_variance(scale)
    divided = torch.div(grad, twice_variance, out=twice_variance)
    torch.sub(value, loc, out=out)
    out.mul_(2.0).mul_(divided.neg_())


def _twice_variance(scale: torch.Tensor) -> torch.Tensor:
    """``2 * scale ** 2`` as torch's ``Normal.log_prob`` computes it, in one new tensor."""
    return (scale**2).mul_(2)


class _IidNormalLogDensity(torch.autograd.Function):
    """``IidNormal.log_prob(value)`` (numbers ``loc`` and ``scale``), a slice of dim 0 at a
    time."""

    @staticmethod
    def forward(ctx, value, loc, scale):
        ctx.save_for_backward(value)
        ctx.iid = (loc, scale)
        out = _new_like(value)
        for part in _slices(value):
            # (value - loc).square().mul(-0.5 / scale ** 2).sub_(log(scale) + log(2 pi) / 2)
            _centre(value[part], loc, out[part])
            out[part].pow_(2).mul_(-0.5 / scale**2).sub_(math.log(scale) + _HALF_LOG_2PI)
        return out

    @staticmethod
    def backward(ctx, grad):
        _refuse_second_order()
        (value,) = ctx.saved_tensors
        loc, scale = ctx.iid
        grad_value = _new_like(value)
        for part in _slices(value):
            _iid_slice_backward(grad[part], value[part], loc, scale, grad_value[part])
        return grad_value, None, None


def _iid_slice_backward(grad, value, loc: float, scale: float, out) -> None:
    """The gradient of a slice of ``IidNormal.log_prob`` into ``out``: Mul,
    ``grad * (-0.5 / scale ** 2)``; Pow, ``* (2 (value - loc))``."""
    _centre(value, loc, out)
    out.mul_(2.0).mul_(grad * (-0.5 / scale**2))


def _centre(value: torch.Tensor, loc: float, out: torch.Tensor) -> None:
    """``value - loc`` into ``out`` (``value`` itself for ``loc = 0``, as `IidNormal`)."""
    if loc != 0:
        torch.sub(value, loc, out=out)
    else:
        out.copy_(value)
