"""``IidNormal``: a Normal prior with one loc and one scale for every entry of a parameter.

The priors of `pyro_quadvi.nn` build it, and `QuadratureELBO`
recognizes it to integrate the prior of a Gaussian guide's site in closed form
(`LogJoint`, ``expected_log_priors``).
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch.distributions import Distribution as TorchDistribution

__all__ = ["IidNormal", "expected_log_density"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class IidNormal(dist.Normal):
    """A ``Normal`` with one ``loc`` and one ``scale`` (numbers) for every entry of a parameter.

    Built by `of`: its ``loc`` and ``scale`` are those numbers expanded to the parameter's
    shape (one element in memory each), checked once there rather than entry by entry, and its
    log density

        log N(x | loc, scale^2) = -(x - loc)^2 / (2 scale^2) - log(scale) - log(2 pi) / 2

    takes them as numbers: three elementwise passes over a batch of values (``loc = 0``) where
    ``Normal.log_prob`` makes six, each with a backward. Equal to ``Normal.log_prob`` to
    rounding, bit for bit at ``loc = 0, scale = 1``. Sample validation is Pyro's, as for any
    distribution. Built with ``Normal``'s own arguments (as Pyro's reparameterizers rebuild a
    site's distribution, ``type(fn)(loc=..., scale=...)``) it is a plain ``Normal``, save that
    an integer ``loc`` or ``scale`` tensor (``torch.tensor(0)``) is taken in the floating dtype of
    the other, else torch's default dtype, as a Python number is: torch's ``Normal`` keeps it an
    integer tensor, whose draws fail ("normal_kernel_cpu not implemented for 'Long'") and which
    casts a float ``scale=1.5`` beside it to 1. A bool ``loc`` or ``scale`` (``True``, or
    ``torch.tensor(True)``, which would be taken as 1) is refused with a ``TypeError`` naming it.
    """

    iid: tuple[float, float] | None = None

    def __init__(
        self,
        loc: torch.Tensor | float,
        scale: torch.Tensor | float,
        validate_args: bool | None = None,
    ):
        for name, value in (("loc", loc), ("scale", scale)):
            if isinstance(value, bool) or (
                isinstance(value, torch.Tensor) and value.dtype == torch.bool
            ):
                raise TypeError(
                    f"IidNormal: {name} must be a real number or a floating or integer tensor, "
                    f"got a bool {'tensor' if isinstance(value, torch.Tensor) else 'value'} "
                    f"({value!r}), which would be taken as 1.0 or 0.0: pass the number itself"
                )
        dtypes = [t.dtype for t in (loc, scale) if _is_floating(t)]
        dtype = dtypes[0] if dtypes else torch.get_default_dtype()
        loc, scale = (_as_floating(value, dtype) for value in (loc, scale))
        super().__init__(loc, scale, validate_args=validate_args)

    @classmethod
    def of(cls, loc: float, scale: float, like: torch.Tensor) -> IidNormal:
        """The prior ``N(loc, scale^2)`` on every entry of a parameter shaped like ``like``."""
        if not (math.isfinite(loc) and 0 < scale < math.inf):
            raise ValueError(f"a Normal prior needs a finite loc and scale > 0, got {loc}, {scale}")
        if not like.is_floating_point():
            raise ValueError(f"a Normal prior is over a floating parameter, got {like.dtype}")

        def number(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=like.dtype, device=like.device).expand(like.shape)

        prior = cls(number(loc), number(scale), validate_args=False)
        prior._validate_args = TorchDistribution._validate_args  # Pyro's setting, for samples
        prior.iid = (float(loc), float(scale))
        return prior

    def expand(
        self,
        batch_shape: torch.Size | list[int] | tuple[int, ...],
        _instance: IidNormal | None = None,
    ) -> IidNormal:
        new = self._get_checked_instance(IidNormal, _instance)
        new.iid = self.iid
        return super().expand(batch_shape, _instance=new)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self.iid is None:
            return super().log_prob(value)
        if self._validate_args:
            self._validate_sample(value)
        loc, scale = self.iid
        centred = value - loc if loc != 0 else value
        out = centred.square().mul(-0.5 / scale**2).sub_(math.log(scale) + _HALF_LOG_2PI)
        shape = torch.broadcast_shapes(out.shape, self.batch_shape)
        return out if shape == out.shape else out.expand(shape)


def _is_floating(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _as_floating(value: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor | float:
    """An integer tensor in ``dtype``; any other value as it is."""
    if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
        return value.to(dtype)
    return value


def expected_log_density(
    loc: float, scale: float, mu: torch.Tensor, sigma: torch.Tensor
) -> torch.Tensor:
    """``sum E_q[log N(z | loc, scale^2)]`` over the entries of ``q = N(mu, diag(sigma^2))``, in
    closed form: ``-((mu - loc)^2 + sigma^2) / (2 scale^2) - log(scale) - log(2 pi) / 2`` each;
    differentiable in ``mu`` and ``sigma``."""
    centred = mu - loc if loc != 0 else mu
    square = centred.square().sum() + sigma.square().sum()
    return -(square / (2 * scale * scale) + (math.log(scale) + _HALF_LOG_2PI) * mu.numel())
