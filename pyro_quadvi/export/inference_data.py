"""``to_inference_data``: a fitted guide and its model as an ArviZ ``InferenceData``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

import torch

from ..infer.batched import check_vectorize, user_stacklevel
from ..infer.log_joint import check_callable
from .arviz_v0 import to_inference_data_v0
from .draws import draw
from .labels import label

if TYPE_CHECKING:
    from arviz import InferenceData

__all__ = ["to_inference_data"]


def to_inference_data(
    model: Callable,
    guide: Callable,
    *args: Any,
    num_samples: int = 1000,
    prior: bool = True,
    log_likelihood: bool = True,
    coords: Mapping[str, Sequence] | None = None,
    dims: Mapping[str, Sequence[str]] | None = None,
    vectorize: bool | None = None,
    max_bytes: int | None = None,
    factors: str | Collection[str] | None = None,
    **kwargs: Any,
) -> InferenceData:
    """Export a fitted variational posterior to ArviZ: summaries, LOO, predictive checks, plots.

    ``model``, ``guide``, ``*args`` and ``**kwargs`` are what was passed to ``svi.step``; the
    observed sites and their data are read from the model's trace. The groups are

    - ``posterior``: ``num_samples`` draws of the guide (one chain), the model's latent sites in
      their constrained space and its deterministic sites (``pyro.deterministic``'s, and those a
      Pyro reparameterizer leaves, ``theta`` beside ``theta_decentered``);
    - ``posterior_predictive``: for each posterior draw, new values of the observed sites from the
      model with its observations released;
    - ``log_likelihood`` (with ``log_likelihood=True``): ``log p(y_i | theta_s)`` pointwise per
      observation, without minibatch scale factors, as ``arviz.loo`` and ``arviz.waic`` need, and
      the pointwise log factor of each ``pyro.factor`` site named by ``factors``, under the
      site's name;
    - ``observed_data``: the data of the observed sites;
    - ``prior`` and ``prior_predictive`` (with ``prior=True``): draws of the model's prior.

    Everything covers the full data: a plate that subsamples (``subsample_size=B``) is swept in
    chunks of ``B`` rows, with the guide's local latents drawn for every row. Dims are named after
    the model's plates, with coordinates ``0..n-1``; other dims are ``{site}_dim_{k}``, and the
    singleton dims that line sites up with deeper plates are removed.

    The draws are computed in one batched run of the guide and the model when they broadcast over a
    draw dim (checked against unbatched runs), and one draw at a time otherwise (``PyroModule``
    networks, with one warning); ``idata.posterior.attrs["vectorized"]`` records which (1 or 0).
    The pointwise log likelihood is float64 whatever the model's dtype (LOO in float32 gives nan).

    Args:
        model: the Pyro model.
        guide: the fitted guide, any ``AutoGuide`` (Pyro's or pyro-quadvi's) or guide function.
        *args: the model's positional arguments, with the full data.
        num_samples: the number of posterior (and prior) draws.
        prior: also draw the ``prior`` and ``prior_predictive`` groups.
        log_likelihood: include the ``log_likelihood`` group.
        coords: coordinates that replace or add to the plates' ``0..n-1``, ``dim -> values``.
        dims: ``variable -> dim names`` that replace a variable's dim names (after chain and draw;
            a log likelihood takes the leading ones).
        vectorize: ``None`` (default) tries the batched run and loops over the draws if the model
            does not broadcast (a shape error, or draws that differ from unbatched runs); ``True``
            forces the batched run (its errors propagate, and draws that differ from unbatched
            runs raise `BatchMismatch` naming the ways out);
            ``False`` always loops. Errors of the model itself propagate in every case.
        max_bytes: the most the groups' draws may hold; ``None`` (default): the memory
            available now (Linux's ``MemAvailable``; no check where the platform does not say).
            Counted are the latent and deterministic sites over the full data in their dtypes,
            the observed sites in the data's dtype, per posterior draw and again per prior draw,
            and the pointwise log likelihood in float64. A larger export is refused before any
            draw, naming the largest ``num_samples`` that fits.
        factors: the ``pyro.factor`` sites whose values are log likelihood terms, exported in
            ``log_likelihood`` under their names: a collection of site names, or ``"all"``. A
            factor is a term of the log joint that may be a likelihood (a censored row's log
            survival) or a penalty, a prior or a Jacobian, which only the model's author can
            tell. ``None`` (default) exports none and warns, naming the factor sites left out
            (LOO would count their rows' likelihood as 0); ``()`` exports none, silently.
        **kwargs: the model's keyword arguments.

    Returns:
        An ``arviz.InferenceData``.

    Raises:
        RuntimeError: if the guide was never run (fit it with ``svi.step`` first).
        TypeError: before anything is drawn, for a ``guide`` that is not callable, a ``prior``
            or ``log_likelihood`` that is not a bool, ``coords`` that are not a mapping ``dim ->
            values``, ``dims`` that are not a mapping ``variable -> dim names`` (str), or
            ``factors`` that are not ``None``, ``"all"`` or a collection of names.
        ValueError: for a bad ``num_samples``, ``dims``, ``vectorize`` or ``max_bytes``, an
            export larger than ``max_bytes``, a plate given only some of its indices by the
            model's arguments, ``factors`` naming a site that is no ``pyro.factor`` site of the
            model, observed data with NaN (naming the site), an observed site whose
            value changes from draw to draw (computed from the latents, naming it), a latent
            site the guide does not sample (enumerated or hidden from it, naming it), or a log
            likelihood that is not finite.
        NotImplementedError: with ArviZ 1.x.
    """
    check_callable("to_inference_data", "guide", guide, "the fitted guide (a callable)")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    for name, flag in (("prior", prior), ("log_likelihood", log_likelihood)):
        if not isinstance(flag, bool):
            raise TypeError(
                f"to_inference_data: {name} must be True or False, got {flag!r} "
                f"({type(flag).__name__})"
            )
    check_vectorize(vectorize, "to_inference_data: ")
    _check_labels(coords, dims)
    arviz_major = int(version("arviz").split(".")[0])
    if arviz_major >= 1:
        raise NotImplementedError(
            f"to_inference_data supports ArviZ 0.x; ArviZ {version('arviz')} is installed: "
            "install arviz<1"
        )
    draws = draw(model, guide, args, kwargs, num_samples, prior, vectorize, max_bytes, factors)
    if log_likelihood and factors is None and draws.factors_left_out:
        left_out = ", ".join(map(repr, draws.factors_left_out))
        warnings.warn(
            f"to_inference_data: the log_likelihood group leaves out the model's pyro.factor "
            f"sites {left_out}, so az.loo and az.waic count nothing of them. Pass "
            f"factors=[{left_out}] (or factors='all') to export those that are likelihood terms "
            "pointwise, and sum a factor with the observed site of its plate into one log "
            "likelihood per row before az.loo (docs/arviz.md, 'Factor sites'); pass factors=() "
            "where they are priors or penalties",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if log_likelihood:
        for name, values in draws.log_likelihood.items():
            bad = ~torch.isfinite(values)
            if bad.any():
                s = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"the log likelihood of {name!r} is not finite at posterior draw {s}: the "
                    "guide puts mass where the model's density is zero or undefined; check the "
                    "supports of the model's and the guide's distributions"
                )
    groups, all_coords = label(draws, log_likelihood, coords, dims)
    attrs = {"vectorized": int(draws.vectorized), "guide": type(guide).__name__}
    return to_inference_data_v0(groups, all_coords, attrs)


def _check_labels(coords: object, dims: object) -> None:
    """`to_inference_data`'s refusal of ``coords`` and ``dims`` of another type, before the
    draws (Python's "'int' object is not iterable" or "dictionary update sequence element #0
    has length 1" came after them, naming neither)."""
    if coords is not None and not isinstance(coords, Mapping):
        raise TypeError(
            "to_inference_data: coords must be a mapping dim -> coordinate values (e.g. "
            f"{{'data': years}}), or None, got {coords!r} ({type(coords).__name__})"
        )
    if dims is None:
        return
    wrong = not isinstance(dims, Mapping) or any(
        isinstance(names, str)
        or not isinstance(names, Collection)
        or not all(isinstance(name, str) for name in names)
        for names in dims.values()
    )
    if wrong:
        raise TypeError(
            "to_inference_data: dims must be a mapping variable -> a sequence of dim names "
            f"(e.g. {{'w': ['feature']}}), or None, got {dims!r}"
        )
