"""Likelihoods of a `BayesianModule`: the observation site of the data.

A likelihood receives the network's outputs of shape ``batch + (B,) + row`` (``batch``: the
particle or quadrature-node dims of a vectorized pass, empty otherwise; ``B``: the rows of the
minibatch; ``row``: the net's output per row) and observes ``y`` inside
``pyro.plate("data", dataset_size, subsample=arange(B))`` at dim -1, so the log likelihood of a
minibatch is scaled by ``dataset_size / B``: subsampling is whatever ``x`` and ``y`` the caller
passes. Without ``y`` (sampled, for prediction) the plate is ``pyro.plate("data", B)``, unscaled.
"""

from __future__ import annotations

import math
import numbers

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from ..infer.batched import check_value_dtype
from ..optim.torch_qnvb import check_representable, where_entries
from ..quadrature.base import as_index

DATA_PLATE = "data"
"""The name of the plate `Likelihood.plate` puts a batch's rows in."""

_MADE_BY_LIKELIHOOD = "quadvi_likelihood_plate"
"""The key `Likelihood.plate` sets (``True``) in its plate's subsample site's ``infer``."""


def made_by_likelihood(site: dict) -> bool:
    """Whether a plate's subsample site (a trace node or a message) is the data plate of a
    `Likelihood`: the plate of a `BayesianModule`, of ``dataset_size`` rows, given the rows of the
    ``x`` and ``y`` passed. The mark is on the site, so it is seen whatever wraps the module
    (a handler, a lambda, a ``PyroModule`` holding it)."""
    return bool(site["infer"].get(_MADE_BY_LIKELIHOOD))


__all__ = ["Bernoulli", "Categorical", "Gaussian", "Likelihood"]

NOISE_SITE = "noise_scale"
"""The latent site of the noise scale that `Gaussian` learns with ``scale=None``."""


class Likelihood:
    """Base class: a data plate of ``dataset_size`` rows and one observed site ``"obs"``.

    Args:
        dataset_size: the number of rows of the whole data set; ``None``: the rows passed (no
            minibatch scaling).
        name: the observed site's name.
    """

    squeeze_single_output = False  # a net output of one column is one number per row

    def __init__(self, dataset_size: int | None = None, name: str = "obs"):
        if dataset_size is not None:
            size = as_index(dataset_size)  # a NumPy integer or a 0-d integer tensor too
            if size is None or size < 1:
                raise ValueError(
                    f"dataset_size must be a positive int or None, got {dataset_size!r}"
                )
            dataset_size = size
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"{type(self).__name__}: name must be a non-empty string (the observed site's "
                f"name, 'obs' by default), got {name!r}"
            )
        self.dataset_size = dataset_size
        self.name = name

    def plate(self, rows: int, device: torch.device, observed: bool = True) -> pyro.plate:
        """The data plate: ``dataset_size`` rows of which these ``rows`` are observed.

        Unobserved (``y=None``, as in ``Predictive``), the plate is the ``rows`` given, unscaled:
        the sampled ``y`` do not depend on the plate's scale, and a test set may have more rows
        than ``dataset_size``.
        """
        if observed and rows == 0:
            raise ValueError(
                f"{type(self).__name__} likelihood: the batch has no rows (x and y of 0 rows); "
                "the data plate scales a batch's log likelihood by dataset_size / rows. Skip "
                "empty batches (a filter of the loader, or DataLoader(drop_last=True) where the "
                "last batch comes out empty)"
            )
        size = rows if self.dataset_size is None or not observed else self.dataset_size
        if rows > size:
            raise ValueError(
                f"a minibatch of {rows} rows is larger than dataset_size={size}: pass the size "
                "of the whole training set as dataset_size (y=None, to sample predictions, "
                "takes any number of rows)"
            )
        index = torch.arange(rows, device=device)
        # the plate's subsample site is sampled as it is built: mark it (made_by_likelihood)
        with poutine.infer_config(config_fn=lambda msg: {_MADE_BY_LIKELIHOOD: True}):
            return pyro.plate(DATA_PLATE, size, subsample=index, dim=-1, device=device)

    def sample_latents(self, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The likelihood's own latent sites (sampled before the data plate); none by default."""
        return {}

    def observation(self, y: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """``y`` as the observed site takes it (rows already shaped); unchanged by default."""
        return y

    def distribution(
        self, outputs: torch.Tensor, latents: dict[str, torch.Tensor], row_dims: int
    ) -> dist.Distribution:
        """The distribution of one row's observation given the net's ``outputs``."""
        raise NotImplementedError

    def row_shape(self, outputs: torch.Tensor, batch_dims: int) -> torch.Size:
        """The observation's shape per row for these outputs."""
        row = outputs.shape[batch_dims + 1 :]
        if self.squeeze_single_output and row == (1,):
            return torch.Size()
        return torch.Size(row)

    def invalid_observations(
        self, y: torch.Tensor, outputs: torch.Tensor
    ) -> tuple[torch.Tensor, str, str] | None:
        """The entries of ``y`` outside the observation's support, for a message that names
        them: ``(mask, what y must hold, the likely fix)``, or ``None`` (the default: no
        check). `BayesianModule.forward` reads the mask with its check of ``x``, in one host
        sync, before the site (Pyro's validation would name the distribution's support only,
        and without validation a label out of range fails in an index or a fraction is
        truncated); `check_observations` raises."""
        return None

    def check_observations(self, y: torch.Tensor, outputs: torch.Tensor) -> None:
        """Refuse a ``y`` with entries outside the support (`invalid_observations`),
        naming the likelihood, the rows, the first value and the fix."""
        found = self.invalid_observations(y, outputs)
        if found is None:
            return
        bad, wanted, fix = found
        if bool(bad.any()):
            raise ValueError(
                f"{type(self).__name__} likelihood (site {self.name!r}): y must hold {wanted}, "
                f"but not at {where_entries(y, bad, 'y')}. {fix}"
            )

    def _layout(self, outputs: torch.Size, row: torch.Size, y: torch.Size) -> str:
        """What the net's ``outputs`` (``(B,) + ...``, one draw) observe, for the message that
        refuses a ``y`` of shape ``y``."""
        return (
            f"the network's outputs {tuple(outputs)} observe rows of shape {tuple(row)}: y must "
            f"be {(outputs[0], *row)}"
        )

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor | None, batch_dims: int
    ) -> torch.Tensor:
        """Sample the likelihood's latents, then observe ``y`` (or sample it) in the data plate.

        Args:
            outputs: the net's outputs, ``batch + (B,) + row``.
            y: the observations, ``B`` rows (``None``: sampled, as for prediction).
            batch_dims: ``len(batch)``.
        """
        latents = self.sample_latents(outputs.dtype, outputs.device)
        rows = outputs.shape[batch_dims]
        row = self.row_shape(outputs, batch_dims)
        if self.squeeze_single_output and outputs.shape[batch_dims + 1 :] == (1,):
            outputs = outputs.squeeze(-1)
        if y is not None:
            if y.shape[0] != rows:
                raise ValueError(
                    f"{type(self).__name__} likelihood: y has {y.shape[0]} rows, x gave {rows}: "
                    "pass the x and y of the same rows (a minibatch's x with its own y)"
                )
            # the same sizes in the same order, size-1 dims aside ((B, 1) for one number a row,
            # (B, H, W) for outputs (B, 1, H, W)): a reshape pairs each value with its output
            if [n for n in y.shape[1:] if n != 1] != [n for n in row if n != 1]:
                layout = self._layout(outputs.shape[batch_dims:], row, y.shape)
                raise ValueError(
                    f"{type(self).__name__} likelihood: y has shape {tuple(y.shape)}, but "
                    f"{layout}. Make the net's outputs match y's layout (a y of the same size in "
                    "another layout would pair values with the wrong outputs)"
                )
            y = self.observation(y.reshape((rows, *row)), outputs)
        fn = self.distribution(outputs, latents, len(row))
        with self.plate(rows, outputs.device, observed=y is not None):
            return pyro.sample(self.name, fn, obs=y)


def _expand_to_rows(value: torch.Tensor, row_dims: int) -> torch.Tensor:
    """A latent (``batch + (1,)`` or scalar) aligned with outputs ``batch + (B,) + row``."""
    if value.dim() == 0:
        return value
    return value.reshape(value.shape + (1,) * row_dims)


def _check_noise_prior(prior: object) -> None:
    """Refuse a ``noise_prior`` that is no distribution of one positive number: not a
    distribution, of a batch or event shape (one scale per output would pair with the batch's
    rows), or with a support reaching below 0 (``init_to_feasible`` starts a real-valued site at
    0, a noise scale of 0)."""
    if not isinstance(prior, dist.Distribution):
        raise TypeError(
            f"Gaussian: noise_prior must be a distribution of the noise scale (e.g. "
            f"dist.HalfNormal(1.0)), got {prior!r} ({type(prior).__name__})"
        )
    shape = prior.batch_shape + prior.event_shape
    if shape != ():
        raise ValueError(
            f"Gaussian: noise_prior {prior!r} has batch_shape {tuple(prior.batch_shape)} and "
            f"event_shape {tuple(prior.event_shape)}; the learned noise scale is one scalar for "
            "all outputs (a scale per output is not supported: one would be paired with the "
            "batch's rows). Pass a scalar distribution, e.g. dist.HalfNormal(1.0), or write a "
            "likelihood of your own (docs/nn.md)"
        )
    support = prior.support
    lower = getattr(support, "lower_bound", None)
    positive = (
        not support.is_discrete
        and isinstance(lower, numbers.Real | torch.Tensor)
        and bool((torch.as_tensor(lower) >= 0).all())
    )
    if not positive:
        raise ValueError(
            f"Gaussian: noise_prior {prior!r} has support {support}, which is not within the "
            "positive reals; the noise scale is a standard deviation, > 0 (a guide started at "
            "a value <= 0 gives a likelihood of scale <= 0). Pass a distribution on the "
            "positive reals: dist.HalfNormal(s), dist.LogNormal(m, s), dist.Gamma(a, b) (a "
            "Normal(m, s) around a guess m: dist.LogNormal(math.log(m), s / m))"
        )


class Gaussian(Likelihood):
    """``y ~ Normal(net(x), scale)`` per entry, each row's entries one event.

    Args:
        dataset_size: rows of the whole data set (see `Likelihood`).
        scale: the noise standard deviation; ``None`` learns it: a latent site
            ``"noise_scale"`` with prior ``noise_prior`` (default ``HalfNormal(1.0)``), sampled
            outside the data plate.
        noise_prior: the prior of the learned noise scale: a scalar distribution (one scale for
            all outputs) on the positive reals (its support's lower bound ``>= 0``), in the
            network's dtype.

    A net with one output column models one number per row: ``y`` may be ``(B,)`` or ``(B, 1)``.
    """

    squeeze_single_output = True

    def __init__(
        self,
        dataset_size: int | None = None,
        scale: float | None = 1.0,
        noise_prior: dist.Distribution | None = None,
        name: str = "obs",
    ):
        super().__init__(dataset_size, name)
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = scale.item()
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
            raise TypeError(
                f"Gaussian: scale must be a number > 0 (the noise standard deviation) or None "
                f"(learned), got {scale!r} ({type(scale).__name__})"
            )
        if scale is not None and not 0 < scale < math.inf:
            raise ValueError(f"scale must be > 0 and finite, or None (learned), got {scale!r}")
        if scale is not None and noise_prior is not None:
            raise ValueError("noise_prior goes with scale=None (a learned noise scale)")
        if noise_prior is not None:
            _check_noise_prior(noise_prior)
        self.scale = None if scale is None else float(scale)
        self.noise_prior = noise_prior

    def sample_latents(self, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The learned noise scale ``"noise_scale"`` (with ``scale=None``); none otherwise."""
        if self.scale is not None:
            return {}
        prior = self.noise_prior
        if prior is None:
            prior = dist.HalfNormal(torch.ones((), dtype=dtype, device=device))
        value = pyro.sample(NOISE_SITE, prior)
        example = f"noise_prior=dist.HalfNormal(torch.tensor(1.0, dtype={dtype})), say"
        check_value_dtype(NOISE_SITE, value, dtype, "the net", "noise_prior", example)
        return {NOISE_SITE: value}

    def distribution(
        self, outputs: torch.Tensor, latents: dict[str, torch.Tensor], row_dims: int
    ) -> dist.Distribution:
        """``Normal(outputs, scale)``, each row's entries one event."""
        if self.scale is None:
            scale = _expand_to_rows(latents[NOISE_SITE], row_dims)
        else:
            check_representable("Gaussian likelihood: ", "scale", self.scale, outputs.dtype)
            scale = torch.full((), self.scale, dtype=outputs.dtype, device=outputs.device)
        return dist.Normal(outputs, scale).to_event(row_dims)

    def invalid_observations(
        self, y: torch.Tensor, outputs: torch.Tensor
    ) -> tuple[torch.Tensor, str, str] | None:
        """The entries of ``y`` that are NaN or infinite."""
        if not y.is_floating_point():
            return None
        fix = (
            "Drop or impute those rows (keep = torch.isfinite(y).flatten(1).all(1); x[keep], "
            "y[keep])"
        )
        return ~torch.isfinite(y), "finite numbers", fix


class Categorical(Likelihood):
    """``y ~ Categorical(logits=net(x))``: the net's last output dim holds the class logits."""

    def row_shape(self, outputs: torch.Tensor, batch_dims: int) -> torch.Size:
        """The outputs' shape per row without the last dim (the classes): one label per vector."""
        return torch.Size(outputs.shape[batch_dims + 1 : -1])

    def _layout(self, outputs: torch.Size, row: torch.Size, y: torch.Size) -> str:
        classes = (
            f"the classes are the last dim of the network's outputs {tuple(outputs)} "
            f"({outputs[-1]} classes)"
        )
        if len(outputs) == 4 and tuple(y) == (outputs[0], *outputs[2:]):
            B, C, H, W = outputs
            return (
                f"{classes}, and y looks like labels (B, H, W) for logits (B, C, H, W) with the "
                f"classes in dim 1. Return logits.permute(0, 2, 3, 1) from the net: "
                f"{(B, H, W, C)} logits observe y of shape {(B, H, W)}"
            )
        return f"{classes}, so y must be {(outputs[0], *row)}, one label per vector of logits"

    def distribution(
        self, outputs: torch.Tensor, latents: dict[str, torch.Tensor], row_dims: int
    ) -> dist.Distribution:
        """``Categorical(logits=outputs)``, each row's labels one event."""
        return dist.Categorical(logits=outputs).to_event(row_dims)

    def invalid_observations(
        self, y: torch.Tensor, outputs: torch.Tensor
    ) -> tuple[torch.Tensor, str, str] | None:
        """The labels that are no class index ``0, ..., C - 1`` (``C``: the outputs' last dim):
        out of range, or not whole numbers (NaN included)."""
        classes = outputs.shape[-1]
        bad = (y < 0) | (y >= classes)
        if y.is_floating_point():
            bad = bad | (y != y.floor())  # a fraction, or NaN
        wanted = (
            f"class indices, whole numbers 0 to {classes - 1} (the {classes} classes of the "
            "network's outputs' last dim)"
        )
        fix = (
            "Labels 1 to C: pass y - 1. More classes than the net has outputs: widen its last "
            "layer to the number of classes. Missing labels (NaN): drop those rows. Soft or "
            "one-hot targets are not labels: pass y.argmax(-1)"
        )
        return bad, wanted, fix


class Bernoulli(Likelihood):
    """``y ~ Bernoulli(logits=net(x))``; a net with one output column gives one label per row.

    ``y`` holds 0 / 1 labels, as floats, integers or booleans."""

    squeeze_single_output = True

    def observation(self, y: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """Integer or boolean labels are taken as 0 / 1 in the outputs' dtype."""
        return y if y.is_floating_point() else y.to(outputs.dtype)

    def distribution(
        self, outputs: torch.Tensor, latents: dict[str, torch.Tensor], row_dims: int
    ) -> dist.Distribution:
        """``Bernoulli(logits=outputs)``, each row's labels one event."""
        return dist.Bernoulli(logits=outputs).to_event(row_dims)

    def invalid_observations(
        self, y: torch.Tensor, outputs: torch.Tensor
    ) -> tuple[torch.Tensor, str, str] | None:
        """The labels that are neither 0 nor 1 (NaN included)."""
        fix = (
            "Labels -1 / 1: pass (y + 1) / 2. Missing labels (NaN): drop those rows. "
            "Probabilities (soft targets) are not labels: threshold them (y > 0.5), or write a "
            "likelihood of your own (docs/nn.md)"
        )
        return (y != 0) & (y != 1), "0 / 1 labels", fix
