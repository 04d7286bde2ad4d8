"""Walsh-Hadamard variational inference (WHVI): linear layers ``W = S1 H diag(g) H S2``.

Rossi, Marmin and Filippone, "Walsh-Hadamard Variational Inference for Bayesian Deep Learning"
(NeurIPS 2020), Section 2: a ``D x D`` weight is ``W = S1 H diag(g) H S2`` (eq. 2) with ``H`` the
Walsh-Hadamard matrix, ``S1``, ``S2`` diagonal and optimized, and only ``g`` (``D`` numbers)
variational. A Gaussian ``q(g)`` makes ``q(W)`` a matrix-variate Gaussian (eq. 3-5) with
``O(D)`` parameters, and ``W h`` costs ``O(D log D)`` by the fast transform
(`fwht`).

Here ``H`` is the orthonormal Walsh-Hadamard matrix (the Sylvester matrix times ``D^(-1/2)``, the
paper's "possibly scaled" option), so at ``S1 = S2 = I`` the entries of ``W`` have variance
``var(g) / D``: ``g ~ N(0, prior_scale^2)`` is Radford Neal's ``1 / fan_in`` prior scale for a
square layer.

With `BayesianModule` a WHVI layer's ``g`` (and its bias) are ordinary
latent sites, so ``AutoMeanFieldNormal``, ``QuadratureELBO`` and ``QNVB`` apply unchanged;
the layer declares (`WHVILinear.bayesian_parameters`) ``S1`` and ``S2`` point estimates and
the prior of ``g``, so ``BayesianModule(whvi(net), prior, likelihood)`` needs nothing more. All
quadrature nodes go through the layer in the module's one vectorized pass.
"""

from __future__ import annotations

import copy
import math
import operator

import numpy as np
import pyro.distributions as dist
import torch
from torch import nn

from ..linalg import fwht
from ..optim.torch_qnvb import check_representable
from ..quadrature.base import as_index

__all__ = ["WHVILinear", "setup_dimensions", "whvi"]


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def setup_dimensions(in_features: int, out_features: int) -> tuple[int, int, int]:
    """The square blocks of a non-square WHVI layer (paper, Algorithm 1): ``(D, padding, stack)``.

    The input is padded with ``padding`` zeros to ``D``, the next power of two of
    ``in_features``; ``stack = ceil(out_features / D)`` square ``D x D`` blocks are stacked by
    rows and the first ``out_features`` of their ``stack * D`` outputs kept. (The algorithm as
    printed pads only when the next power equals ``2 D_in``, which never happens; we implement its
    evident intent: pad whenever ``in_features`` is not a power of two.) The sizes are any
    integers ``nn.Linear`` takes (``operator.index``: numpy integers too), but not bools.
    """
    sizes = []
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        number = as_index(value)  # any integer nn.Linear takes (a numpy one too), not a bool
        if number is None or number < 1:
            raise ValueError(f"WHVILinear: {name} must be a positive integer, got {value!r}")
        sizes.append(number)
    size = _next_power_of_two(sizes[0])
    return size, size - sizes[0], -(-sizes[1] // size)


class WHVILinear(nn.Module):
    """A linear layer ``y = W x + b`` with the WHVI weight ``W = S1 H diag(g) H S2`` (paper eq. 2).

    Args:
        in_features: input size.
        out_features: output size.
        bias: ``True`` or ``False`` (a numpy bool or a 0-d bool tensor too, as ``nn.Linear``
            reads them; anything else is a ``TypeError``): add a bias ``b`` of
            ``out_features`` entries (a latent under ``BayesianModule``, with the network's
            prior; a ``LayerwiseNormal`` gives it the fans of the dense
            ``(out_features, in_features)`` weight).
        prior_scale: the prior standard deviation of every entry of ``g``, ``g ~ N(0, s^2)``
            (declared to ``BayesianModule`` by `bayesian_parameters`).
        dtype: of the parameters.
        device: of the parameters.

    **Matrix layers** (both sizes above 1) follow Algorithm 1 (`setup_dimensions`): the
    input is zero-padded to ``D = 2^ceil(log2 in_features)`` and ``stack`` independent ``D x D``
    blocks ``W_j = S1_j H diag(g_j) H S2_j`` are stacked by rows, the first ``out_features`` rows
    kept. ``g``, ``s1``, ``s2`` have shape ``(stack, D)``; ``W x`` costs ``2 stack`` transforms of
    size ``D`` per row.

    **Vector layers** (one size 1, the other ``n > 1``; Section 2.5, "reshaping") hold the ``n``
    weights as the first ``n`` entries of the row-major vectorization of one ``m x m`` WHVI
    matrix, ``m = 2^ceil(log2 ceil(sqrt n))``: ``g``, ``s1``, ``s2`` have shape ``(1, m)``, about
    ``sqrt(n)`` numbers each instead of ``n``.

    Parameters: ``g`` (variational), ``s1`` and ``s2`` (optimized: initialized to ones), ``bias``.
    The variational parameter count of the paper (a mean and a variance per latent entry, one
    value per optimized entry) is `num_variational_parameters` ``= 4 stack D (+ 2
    out_features for the bias)``, against ``2 (in_features + 1) out_features`` for a mean-field
    layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        prior_scale: float = 1.0,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        # nn.Linear's `if bias:` would read "yes" (and "no") as True; a numpy bool or a 0-d
        # bool tensor is a bool, as nn.Linear reads it
        if isinstance(bias, np.bool_) or (
            isinstance(bias, torch.Tensor) and bias.dtype == torch.bool and bias.dim() == 0
        ):
            bias = bool(bias)
        if not isinstance(bias, bool):
            raise TypeError(
                "WHVILinear: bias must be True or False (a numpy bool or a 0-d bool tensor "
                f"too), got {bias!r} ({type(bias).__name__})"
            )
        size, padding, stack = setup_dimensions(in_features, out_features)
        in_features, out_features = operator.index(in_features), operator.index(out_features)
        if (
            isinstance(prior_scale, bool)
            or not isinstance(prior_scale, int | float)
            or not 0 < prior_scale < math.inf
        ):
            raise ValueError(
                f"WHVILinear: prior_scale must be > 0 and finite (a number, not a bool), got "
                f"{prior_scale!r}"
            )
        # a scale the parameters' dtype holds (1e300 is inf in float32: g and its prior would be)
        check_representable(
            "WHVILinear: ", "prior_scale", prior_scale, dtype or torch.get_default_dtype()
        )
        self.in_features = in_features
        self.out_features = out_features
        self.prior_scale = float(prior_scale)
        self.vector = min(in_features, out_features) == 1 and max(in_features, out_features) > 1
        if self.vector:
            length = max(in_features, out_features)
            size, padding, stack = _next_power_of_two(math.isqrt(length - 1) + 1), 0, 1
        self.size, self.padding, self.stack = size, padding, stack
        factory = {"dtype": dtype, "device": device}
        self.g = nn.Parameter(self.prior_scale * torch.randn(stack, size, **factory))
        self.s1 = nn.Parameter(torch.ones(stack, size, **factory))
        self.s2 = nn.Parameter(torch.ones(stack, size, **factory))
        if bias:
            bound = 1.0 / math.sqrt(in_features)  # nn.Linear's initialization
            self.bias = nn.Parameter(torch.empty(out_features, **factory).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    def bayesian_parameters(self) -> dict[str, str | dist.Distribution]:
        """The roles of ``g``, ``s1``, ``s2`` for `BayesianModule`.

        ``s1`` and ``s2`` are ``"deterministic"`` (optimized point estimates, the paper's ``S1``,
        ``S2`` of eq. 2) and ``g ~ N(0, prior_scale^2)`` iid (Section 2); the bias, undeclared,
        takes the network's prior.
        """
        loc = torch.zeros_like(self.g).detach()
        prior = dist.Normal(loc, torch.full_like(loc, self.prior_scale))
        return {"g": prior, "s1": "deterministic", "s2": "deterministic"}

    @property
    def num_variational_parameters(self) -> int:
        """Mean and variance of every ``g`` and bias entry, plus the entries of ``s1``, ``s2``."""
        bias = 0 if self.bias is None else 2 * self.out_features
        return 4 * self.stack * self.size + bias

    def extra_repr(self) -> str:
        layout = "vector" if self.vector else f"padding={self.padding}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, D={self.size}, stack={self.stack}, {layout}, "
            f"prior_scale={self.prior_scale}"
        )

    def _check_like_g(self, method: str, name: str, value: torch.Tensor) -> None:
        """Refuse a ``value`` (in place of ``g``) that is not a tensor of ``g``'s shape."""
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        if shape != tuple(self.g.shape):
            raise ValueError(
                f"WHVILinear.{method}: {name} must be a tensor of g's shape (stack, D) = "
                f"{tuple(self.g.shape)}, got {shape}"
            )

    # -- the weight -------------------------------------------------------------------------------

    def _square(self, g: torch.Tensor) -> torch.Tensor:
        """The blocks ``S1 H diag(g) H S2``, ``(stack, D, D)``, for the weights ``g``."""
        eye = torch.eye(self.size, dtype=g.dtype, device=g.device)
        # fwht(Y) = Y H: fwht(I) = H, then (H diag(g)) H
        inner = fwht(fwht(eye, normalized=True) * g.unsqueeze(-2), normalized=True)
        return self.s1.unsqueeze(-1) * inner * self.s2.unsqueeze(-2)

    def _vector(self, g: torch.Tensor) -> torch.Tensor:
        """The ``n`` weights of a vector layer: the vectorized ``m x m`` WHVI matrix, truncated."""
        return self._square(g)[0].reshape(-1)[: max(self.in_features, self.out_features)]

    def weight(self, g: torch.Tensor | None = None) -> torch.Tensor:
        """The dense ``(out_features, in_features)`` weight ``W`` for ``g`` (default: ``self.g``).

        ``O(D^2 log D)`` per block: for inspection and tests; the forward pass never forms it.

        Raises:
            ValueError: for a ``g`` that is not a tensor of ``g``'s shape ``(stack, D)``.
        """
        if g is None:
            g = self.g
        self._check_like_g("weight", "g", g)
        if self.vector:
            w = self._vector(g)
            return w.unsqueeze(-1) if self.in_features == 1 else w.unsqueeze(0)
        blocks = self._square(g)  # (stack, D, D), stacked by rows
        return blocks.reshape(self.stack * self.size, self.size)[
            : self.out_features, : self.in_features
        ]

    # -- the forward pass -------------------------------------------------------------------------

    def _product(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``W x`` for every row of ``x`` (``(..., in_features)``), without the bias."""
        if self.vector:
            w = self._vector(g)
            return x * w if self.in_features == 1 else x @ w.unsqueeze(-1)
        if self.padding:
            x = nn.functional.pad(x, (0, self.padding))
        h = x.unsqueeze(-2) * self.s2  # (..., stack, D): S2 x for every block
        h = fwht(fwht(h, normalized=True) * g, normalized=True) * self.s1
        return h.flatten(-2)[..., : self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y = W x + b`` for the rows of ``x``: ``O(stack D log D)`` per row (paper, Sec. 2.3)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"WHVILinear: the input's last dim is {x.shape[-1]}, the layer takes "
                f"in_features={self.in_features}"
            )
        y = self._product(x, self.g)
        return y if self.bias is None else y + self.bias

    def output_moments(
        self, x: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and covariance factor of ``W x`` under ``g ~ N(loc, diag(scale^2))`` (eq. 6).

        ``W x ~ N(m, A A^T)`` with ``m = S1 H diag(mu) H S2 x`` and
        ``A = S1 H diag(H S2 x) Sigma^(1/2)`` (paper eq. 6: ``W x`` is linear in ``g``, and ``A``
        is its Jacobian times ``Sigma^(1/2)``); blocks are independent, so ``A`` is block
        diagonal. The local reparameterization draws ``m + A eps``.

        Args:
            x: inputs ``(..., in_features)``.
            loc: the mean of ``g``, of ``g``'s shape.
            scale: the standard deviation of ``g``, of ``g``'s shape.

        Returns:
            ``m`` of shape ``(..., out_features)`` (no bias) and ``A`` of shape
            ``(..., out_features, stack * D)`` (columns: the entries of ``g``, flattened).

        Raises:
            ValueError: for a ``loc`` or ``scale`` that is not a tensor of ``g``'s shape.
        """
        self._check_like_g("output_moments", "loc", loc)
        self._check_like_g("output_moments", "scale", scale)
        mean = self._product(x, loc)
        eye = torch.eye(self.size, dtype=x.dtype, device=x.device)
        hadamard = fwht(eye, normalized=True)
        if self.vector:
            length = max(self.in_features, self.out_features)
            # d w_(ij) / d g_k = s1_i H_ik H_kj s2_j, row-major (i, j)
            jac = torch.einsum("i,ik,kj,j->ijk", self.s1[0], hadamard, hadamard, self.s2[0])
            jac = jac.reshape(self.size * self.size, self.size)[:length]
            if self.in_features == 1:
                factor = x.unsqueeze(-1) * jac  # (..., n, m)
            else:
                factor = (x @ jac).unsqueeze(-2)  # (..., 1, m)
            return mean, factor * scale[0]
        if self.padding:
            x = nn.functional.pad(x, (0, self.padding))
        projected = fwht(x.unsqueeze(-2) * self.s2, normalized=True)  # H S2 x: (..., stack, D)
        # A_j = S1_j H diag(H S2_j x) Sigma_j^(1/2): (..., stack, D rows, D columns)
        blocks = self.s1.unsqueeze(-1) * hadamard * (projected * scale).unsqueeze(-2)
        eye_stack = torch.eye(self.stack, dtype=x.dtype, device=x.device)
        factor = torch.einsum("...jik,jl->...jilk", blocks, eye_stack)
        shape = (*factor.shape[:-4], self.stack * self.size, self.stack * self.size)
        return mean, factor.reshape(shape)[..., : self.out_features, :]


_READS_LINEAR_WEIGHTS = (nn.TransformerEncoderLayer, nn.MultiheadAttention)
"""Modules whose forward reads their ``nn.Linear`` children's ``.weight`` as a tensor (torch's
fast paths: ``linear1.weight.device``, ``out_proj.weight``); a `WHVILinear`'s ``weight`` is a
method, so `whvi` keeps those children as they are."""


def whvi(net: nn.Module, skip_last: bool = False, prior_scale: float = 1.0) -> nn.Module:
    """A copy of ``net`` with its ``nn.Linear`` layers replaced by `WHVILinear` layers.

    Args:
        net: any module; it is deep-copied, never modified.
        skip_last: keep the last ``nn.Linear`` (in ``net.modules()`` order) as it is, so that it
            stays mean-field under ``BayesianModule``: the paper's experiments (Section 3.2).
        prior_scale: of every new layer's ``g``.

    Replaced are the modules whose type is exactly ``nn.Linear``: a subclass (which may change
    the forward pass) and an ``nn.LazyLinear`` that has not run yet are kept, and so are the
    Linears of an ``nn.TransformerEncoderLayer`` or ``nn.MultiheadAttention``, whose forward reads
    their ``.weight`` as a tensor. A Linear used at several places (tied) becomes one
    `WHVILinear` at all of them. Each new layer has the old one's sizes, dtype, device, bias
    (copied) and ``requires_grad`` (a frozen Linear gives a frozen layer); ``g`` starts at a prior
    draw, ``s1 = s2 = 1``.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"whvi: net must be a torch.nn.Module, got {type(net).__name__}")
    net = copy.deepcopy(net)
    aliases: dict[int, list[str]] = {}  # every name of each Linear, in net.modules() order
    for name, module in net.named_modules(remove_duplicate=False):
        if type(module) is nn.Linear:
            aliases.setdefault(id(module), []).append(name)
    groups = list(aliases.values())
    if skip_last and groups:
        groups = groups[:-1]
    for names in groups:
        parents = [net.get_submodule(name.rpartition(".")[0]) for name in names if name]
        if any(isinstance(parent, _READS_LINEAR_WEIGHTS) for parent in parents):
            continue
        old = net.get_submodule(names[0])
        new = WHVILinear(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            prior_scale=prior_scale,
            dtype=old.weight.dtype,
            device=old.weight.device,
        )
        new.requires_grad_(old.weight.requires_grad)
        if old.bias is not None:
            with torch.no_grad():
                new.bias.copy_(old.bias)
            new.bias.requires_grad_(old.bias.requires_grad)
        if not parents:
            return new  # the net is one nn.Linear
        for parent, name in zip(parents, names, strict=True):
            setattr(parent, name.rpartition(".")[2], new)
    return net
