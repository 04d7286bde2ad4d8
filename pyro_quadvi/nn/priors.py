"""Priors over a network's parameters: ``(name, param) -> distribution`` of the parameter's shape.

A prior is any callable taking a parameter's path in the network (``"0.weight"``) and the
parameter itself, and returning a Pyro distribution whose ``batch_shape + event_shape`` is the
parameter's shape, in its dtype and on its device. `BayesianModule` makes
every dim an event dim (``.to_event``), so each parameter is one sample site.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import pyro.distributions as dist
import torch
from torch.nn.init import _calculate_fan_in_and_fan_out

from .. import distributions
from ..distributions.iid_normal import IidNormal
from ..optim.qnvb_functional import _check_number, _check_scalar, _finite_positive
from ..optim.sparse_functional import _check_int

__all__ = [
    "LayerwiseNormal",
    "Normal",
    "Prior",
    "SpikeSlab",
    "fan_in_and_fan_out",
    "theorem_inclusion",
]


class Prior:
    """Base class of the priors here: ``prior(name, param)`` is the parameter's distribution."""

    def __call__(self, name: str, param: torch.Tensor) -> dist.Distribution:
        raise NotImplementedError


def _check_fits(prior: Prior, numbers: dict[str, float], name: str, param: torch.Tensor) -> None:
    """Refuse a finite number of ``prior`` (``numbers``: by setting) beyond the largest of
    ``param``'s floating dtype: ``scale=1e300`` is finite in float64 but not in a float32
    network, where torch refused to convert it with no word of the prior or the parameter (an
    infinite one is `IidNormal.of`'s to refuse)."""
    if not param.is_floating_point():
        return
    largest = torch.finfo(param.dtype).max
    for setting, value in numbers.items():
        if largest < abs(value) < math.inf:
            raise ValueError(
                f"{prior!r}: {setting}={value!r} for parameter {name!r} is beyond the largest "
                f"{param.dtype} number ({largest:.4g}); use a smaller one, or a float64 network"
            )


def _as_float(owner: str, name: str, value: object, expected: str) -> float:
    """``value``, a real number or a one-element real tensor, as a float, refused naming the
    prior, the argument and ``expected`` where it is of another type (``None``, a string, a list,
    a tensor of two entries: Python's and torch's comparison errors named neither;
    `_check_scalar`). Its range is the caller's to check."""
    _check_scalar(owner, name, value, lambda v: True, expected)
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


class Normal(Prior):
    """An iid ``Normal(loc, scale)`` on every entry of every parameter.

    Args:
        scale: the standard deviation (positive).
        loc: the mean.
    """

    def __init__(self, scale: float = 1.0, loc: float = 0.0):
        self.scale = _as_float("priors.Normal", "scale", scale, "finite and > 0")
        self.loc = _as_float("priors.Normal", "loc", loc, "(finite)")
        if not (0 < self.scale < math.inf and math.isfinite(self.loc)):
            raise ValueError(
                f"priors.Normal needs a finite loc and scale > 0, got scale={scale!r}, loc={loc!r}"
            )

    def __call__(self, name: str, param: torch.Tensor) -> dist.Distribution:
        _check_fits(self, {"loc": self.loc, "scale": self.scale}, name, param)
        return IidNormal.of(self.loc, self.scale, param)

    def __repr__(self) -> str:
        return f"priors.Normal(scale={self.scale}, loc={self.loc})"


def fan_in_and_fan_out(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a weight of this shape, as ``torch.nn.init`` computes them.

    A weight of shape ``(a, b, *kernel)`` has ``fan_in = b * prod(kernel)`` and
    ``fan_out = a * prod(kernel)``: for ``nn.Linear`` and ``nn.Conv*d`` (``(out, in / groups,
    *kernel)``) ``fan_in = in / groups * prod(kernel)``; for ``nn.ConvTranspose*d``, whose weight
    is ``(in, out / groups, *kernel)``, ``fan_in = out / groups * prod(kernel)`` and ``fan_out =
    in * prod(kernel)``, as torch's own initialization takes them.

    Raises:
        TypeError: for a ``shape`` that is not a sequence of ints (``None``, an int, a string, a
            float entry: torch's message named no argument).
        ValueError: for a sequence of ints that is no weight's shape: fewer than 2 dims (as
            torch raised) or a negative size.
    """
    expected = "a weight's shape, a tuple of at least 2 ints >= 0 (out, in, *kernel)"
    if not isinstance(shape, (tuple, list)) or any(
        isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in shape
    ):
        raise TypeError(
            f"fan_in_and_fan_out: shape must be {expected}, got {shape!r} ({type(shape).__name__})"
        )
    if len(shape) < 2 or any(n < 0 for n in shape):
        raise ValueError(
            f"fan_in_and_fan_out: shape must be {expected}, got {shape!r}; a parameter of fewer "
            "dims has no fans of its own"
        )
    return _calculate_fan_in_and_fan_out(torch.empty(tuple(shape), device="meta"))


class LayerwiseNormal(Prior):
    """A zero-mean Normal per parameter with a standard deviation set by its layer's fan-in/out.

    With the method names of TyXe's ``LayerwiseNormalPrior``:

    - ``"radford"``: ``1 / sqrt(fan_in)`` (Radford Neal's scaling),
    - ``"kaiming"``: ``sqrt(2 / fan_in)``,
    - ``"xavier"``: ``sqrt(2 / (fan_in + fan_out))``,

    with ``fan_in`` and ``fan_out`` from the weight's shape (`fan_in_and_fan_out`, i.e.
    ``torch.nn.init._calculate_fan_in_and_fan_out``). A weight's radford and kaiming scales are
    TyXe's; two differ, as the layer's fans are torch's: a bias takes its layer weight's fans
    (TyXe: the bias's own, ``fan_in = 1``, sd 1.0 under radford; here 0.447 for
    ``nn.Linear(5, 6)``), and xavier has no gain and ``fan_out = out * prod(kernel)`` (TyXe:
    ``sqrt(2)``, the relu gain, and ``fan_out = out``; ``nn.Linear(5, 6)``: 0.426 here, 0.603 in
    TyXe).

    **Biases and other parameters of fewer than 2 dims** take the fans of their layer's weight:
    the parameter of the same module named with ``weight`` for ``bias`` (``"0.bias"`` ->
    ``"0.weight"``, an ``nn.GRU``'s ``"bias_ih_l0"`` -> ``"weight_ih_l0"``), else the module's
    ``weight``, found in the network the prior is bound to by
    `BayesianModule` (`bind`, on its own copy of the prior, so that
    one prior object may serve several networks), or, for a layer that stores no ``weight``
    parameter, the tensor its ``weight`` computes (a layer parametrized on ``weight``:
    ``weight_norm(nn.Conv2d(3, 4, 3))``'s bias takes the fans of a ``(4, 3, 3, 3)`` weight),
    else, where it has ``in_features`` and ``out_features`` (a WHVI layer), the dense
    ``(out_features, in_features)`` weight it stands for. A 1-d parameter without such a weight
    (a layer-norm's gain, say) falls back to ``fan_in = fan_out = 1`` (a standard normal for
    ``radford``).

    Args:
        method: ``"radford"``, ``"kaiming"`` or ``"xavier"``.
        scale: a factor on every standard deviation.
    """

    METHODS = ("radford", "kaiming", "xavier")

    def __init__(self, method: str = "radford", scale: float = 1.0):
        if method not in self.METHODS:
            raise ValueError(f"method must be one of {self.METHODS}, got {method!r}")
        owner = "priors.LayerwiseNormal"
        self.scale = _as_float(owner, "scale", scale, "finite and > 0")
        if not 0 < self.scale < math.inf:
            raise ValueError(f"{owner}: scale must be finite and > 0, got {scale!r}")
        self.method = method
        self._shapes: dict[str, torch.Size] | None = None  # None: not bound to a network yet

    def bind(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        named_modules: Iterable[tuple[str, torch.nn.Module]] = (),
    ) -> None:
        """Remember the shapes of a network's weights (to find a bias's fans).

        Args:
            named_parameters: ``(name, param)`` pairs, as ``net.named_parameters()`` gives.
            named_modules: ``(path, module)`` pairs, as ``net.named_modules()`` gives: a layer
                without a ``weight`` parameter but with a tensor ``weight`` (computed by a
                parametrization, ``weight_norm``'s ``g v / |v|``) records that tensor's shape;
                one with int ``in_features`` and ``out_features`` instead (a `WHVILinear`)
                stands for a dense ``(out_features, in_features)`` weight. Its bias takes
                those fans.
        """
        self._shapes = {name: param.shape for name, param in named_parameters}
        for path, module in named_modules:
            weight = f"{path}.weight" if path else "weight"
            if weight in self._shapes:
                continue
            with torch.no_grad():  # a parametrization computes it (weight_norm's g v / |v|)
                computed = getattr(module, "weight", None)
            sizes = (getattr(module, "out_features", None), getattr(module, "in_features", None))
            if isinstance(computed, torch.Tensor):
                self._shapes[weight] = computed.shape
            elif all(type(n) is int for n in sizes):
                self._shapes[weight] = torch.Size(sizes)

    def fans(self, name: str, param: torch.Tensor) -> tuple[int, int]:
        """``(fan_in, fan_out)`` used for the parameter ``name``.

        Raises:
            ValueError: for a parameter of fewer than 2 dims when the prior was never bound to a
                network (`bind`), which its layer's weight would have to come from.
        """
        if param.dim() >= 2:
            return fan_in_and_fan_out(param.shape)
        if self._shapes is None:
            raise ValueError(
                f"LayerwiseNormal: the prior of {name!r} ({param.dim()}-d) takes its layer "
                "weight's fans, but this prior was never bound to a network. Pass it to "
                "BayesianModule as prior=..., or call prior.bind(net.named_parameters(), "
                "net.named_modules()) before wrapping it in a function"
            )
        module, _, local = name.rpartition(".")
        prefix = f"{module}." if module else ""
        # "0.bias" -> "0.weight"; a layer of several weights names them alike: nn.GRU's
        # "bias_ih_l0" -> "weight_ih_l0", nn.MultiheadAttention's "in_proj_bias" -> "in_proj_weight"
        for weight in dict.fromkeys((local.replace("bias", "weight"), "weight")):
            shape = self._shapes.get(prefix + weight)
            if shape is not None and len(shape) >= 2:
                return fan_in_and_fan_out(shape)
        return 1, 1

    def std(self, name: str, param: torch.Tensor) -> float:
        """The prior standard deviation of every entry of ``name``."""
        fan_in, fan_out = self.fans(name, param)
        if self.method == "radford":
            std = 1.0 / math.sqrt(fan_in)
        elif self.method == "kaiming":
            std = math.sqrt(2.0 / fan_in)
        else:
            std = math.sqrt(2.0 / (fan_in + fan_out))
        return self.scale * std

    def __call__(self, name: str, param: torch.Tensor) -> dist.Distribution:
        std = self.std(name, param)
        _check_fits(self, {"scale * std": std}, name, param)
        return IidNormal.of(0.0, std, param)

    def __repr__(self) -> str:
        return f"priors.LayerwiseNormal(method={self.method!r}, scale={self.scale})"


class SpikeSlab(Prior):
    """An iid spike-and-slab on every entry: zero with probability ``1 - inclusion``, else
    ``N(0, slab_scale^2)`` (`pyro_quadvi.distributions.SpikeSlab`; the sparse-VI paper's
    prior). Fit it with `AutoSpikeSlab`.

    Args:
        inclusion: the prior probability of a nonzero weight, in ``(0, 1)`` (the paper's
            ``lambda``; `theorem_inclusion` gives its theorem's choice).
        slab_scale: the slab's standard deviation (the paper's ``sigma_0``).
    """

    def __init__(self, inclusion: float, slab_scale: float = 1.0):
        owner = "priors.SpikeSlab"
        self.inclusion = _as_float(owner, "inclusion", inclusion, "in (0, 1)")
        if not 0.0 < self.inclusion < 1.0:
            raise ValueError(f"{owner}: inclusion must lie in (0, 1), got {inclusion!r}")
        self.slab_scale = _as_float(owner, "slab_scale", slab_scale, "finite and > 0")
        if not 0 < self.slab_scale < math.inf:
            raise ValueError(f"{owner}: slab_scale must be finite and > 0, got {slab_scale!r}")

    def __call__(self, name: str, param: torch.Tensor) -> distributions.SpikeSlab:
        _check_fits(self, {"slab_scale": self.slab_scale}, name, param)
        inclusion = torch.full_like(param, self.inclusion).detach()
        return distributions.SpikeSlab(inclusion, torch.full_like(inclusion, self.slab_scale))

    def __repr__(self) -> str:
        return f"priors.SpikeSlab(inclusion={self.inclusion}, slab_scale={self.slab_scale})"


def theorem_inclusion(
    num_params: int,
    hidden_layers: int,
    width: int,
    num_data: int,
    num_inputs: int,
    delta: float = 0.1,
) -> float:
    """The sparse-VI paper's prior inclusion probability (its main theorem):

        -log lambda = log T + delta [(L + 1) log N + log(sqrt(n) p)]

    Args:
        num_params: ``T``, the number of weights and biases.
        hidden_layers: ``L``.
        width: ``N``, the hidden layers' width.
        num_data: ``n``, the training set's size.
        num_inputs: ``p``, the input dimension.
        delta: the theorem's constant, any finite ``delta > 0`` (0.1 in the paper's
            experiment); the larger, the smaller ``lambda`` (at most ``1 / T`` for any).

    Raises:
        TypeError, ValueError: naming the argument, for a count that is not an integer ``>= 1``
            (a NaN made the result NaN, a network of no hidden layer or a count of 0 is not one
            the theorem speaks of), a ``delta`` that is not finite and ``> 0`` (``delta = -1``
            returned an "inclusion probability" of 17224), or one so large that ``lambda``
            underflows to 0 in float64 (``-log lambda > 745``).
    """
    counts = {"num_params": num_params, "hidden_layers": hidden_layers, "width": width}
    counts.update(num_data=num_data, num_inputs=num_inputs)
    for name, value in counts.items():
        _check_int(f"theorem_inclusion: {name}", value, 1)
    _check_number("theorem_inclusion: delta", delta, _finite_positive, "finite and > 0")
    log_n = (hidden_layers + 1) * math.log(width) + math.log(math.sqrt(num_data) * num_inputs)
    neg_log_lambda = math.log(num_params) + delta * log_n
    inclusion = math.exp(-neg_log_lambda)
    if inclusion == 0:
        raise ValueError(
            f"theorem_inclusion: delta={delta} gives -log lambda = {neg_log_lambda:.4g}, so "
            "lambda underflows to 0 in float64 (an inclusion probability of 0 keeps no weight); "
            f"take delta < {(745 - math.log(num_params)) / log_n:.4g}"
        )
    return inclusion
