"""Draws of a fitted guide and of its model over the full data set, for export.

For ``S`` draws ``theta_s ~ q`` of the guide this module computes, with the conventions of Pyro's
``Predictive``:

- the latent sites ``theta_s`` (constrained) and the model's deterministic sites,
- the pointwise log likelihood ``log p(y_i | theta_s)`` of every observed site, without minibatch
  scale factors (masks apply as in Pyro: a masked entry contributes 0), and the pointwise values
  of the ``pyro.factor`` sites the caller names (a factor is a term of the log joint: a likelihood,
  or a penalty, a prior or a Jacobian, which only the user can tell apart),
- posterior predictive draws ``y_rep ~ p(y | theta_s)``: the model with its observed sites released,
  run on the same ``theta_s``,
- optionally prior draws ``theta_s ~ p(theta)`` and prior predictive draws.

Every pass runs on the full data. A plate that subsamples (``pyro.plate(name, N,
subsample_size=B)``) is swept in chunks of ``B`` consecutive rows: Pyro requires ``B`` indices per
run, so the rows ``0..N-1`` are cut into chunks of ``B`` (the last one ending at ``N``, overlapping
its neighbour) and each chunk is set as the plate's subsample. Latents outside the chunked plates
are drawn once per draw and held fixed over the chunks (`poutine.condition`); a local latent
is drawn once per row. The guide's local latents are thus drawn for every row.

A pass is *vectorized* when the model and guide broadcast over a draw plate left of their own plates
(one run for all ``S`` draws, as ``Predictive(parallel=True)``), and *looped* otherwise (one run per
draw, e.g. a ``PyroModule`` network whose ``nn.Linear`` cannot take a batch of weights).
`evaluate_batch` chooses, with the package's one meaning of
``vectorize``: with ``None`` the vectorized pass is tried first (on two draws, then on all of them,
so that a model which broadcasts the draws against each other fails before it makes ``(S, S, ...)``
tensors) and accepted only if every site has
the expected shape and two of its draws (the first and the last) reproduce, site by site, the log
densities and deterministic values of an unbatched run of the model at the same values; a
broadcasting error or a mismatch loops over the draws (with one warning), any other error
propagates.

The pointwise log likelihood is float64 whatever the model's dtype: ArviZ computes LOO and WAIC in
the dtype it is given, and float32 overflows there (``az.loo`` returns nan).
"""

from __future__ import annotations

import itertools
import math
import numbers
import reprlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.distributions import Delta, MaskedDistribution
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide import AutoGuide
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample
from tqdm.auto import tqdm

from ..guides.interface import unwrap_guide
from ..infer.batched import BatchMismatch, add_hint, evaluate_batch
from ..infer.log_joint import (
    _layers,
    check_observed_not_nan,
    cuda_devices,
    is_improper,
    look_through,
    model_max_plate_nesting,
)
from ..nn.likelihoods import made_by_likelihood
from ..quadrature.base import format_bytes
from ..store import follow_param_store, shortened

__all__ = ["Draws", "SiteSpec", "all_rows_refusal", "check_observed_not_nan", "draw"]

_DRAW_PLATE = "_quadvi_draws"
_TRIAL_DRAWS = 2  # the batched trial run before the run over all the draws (`_all_draws`)


@dataclass(frozen=True)
class SiteSpec:
    """A site of the model as the export sees it, from one unbatched run.

    Attributes:
        name: the sample site.
        kind: ``"latent"``, ``"deterministic"``, ``"observed"`` or ``"factor"`` (a
            ``pyro.factor`` site exported as a log likelihood term).
        shape: the site's value in one draw and one chunk of the subsampled plates (batch + event
            dims; for observed sites the distribution's ``batch_shape + event_shape``; for a
            factor its log factor's shape).
        batch_ndim: how many leading dims of ``shape`` are batch dims (those plates can index).
        frames: ``(plate name, dim, full size)`` of the vectorized plates the site is in; ``dim``
            counts from the right of the batch dims, as in Pyro.
        itemsize: the bytes of one entry of the site's value (for observed sites, the data's).
        guided: a latent site that the guide draws (the export refuses any other latent).
        chunked: ``plate name -> axis`` (negative, from the right of ``shape``) of the subsampled
            plates the site is in.
    """

    name: str
    kind: str
    shape: torch.Size
    batch_ndim: int
    frames: tuple[tuple[str, int, int], ...]
    itemsize: int
    guided: bool = False
    chunked: tuple[tuple[str, int], ...] = ()

    @property
    def event_ndim(self) -> int:
        return len(self.shape) - self.batch_ndim

    def full_shape(self, full_sizes: Mapping[str, int]) -> torch.Size:
        """The site's shape over the full data (subsampled plates at their full size)."""
        shape = list(self.shape)
        for plate, axis in self.chunked:
            shape[axis] = full_sizes[plate]
        return torch.Size(shape)

    def batch_axes(self) -> tuple[tuple[str, int], ...]:
        """``chunked`` for the batch dims alone (the shape of a pointwise log likelihood)."""
        return tuple((plate, axis + self.event_ndim) for plate, axis in self.chunked)


@dataclass
class Draws:
    """Draws for export, over the full data. Each tensor has a leading draw axis of size ``S``
    except ``observed_data``; sizes of subsampled plates are their full sizes.
    """

    sites: dict[str, SiteSpec]
    full_sizes: dict[str, int]
    posterior: dict[str, torch.Tensor]
    log_likelihood: dict[str, torch.Tensor]
    posterior_predictive: dict[str, torch.Tensor]
    observed_data: dict[str, torch.Tensor]
    prior: dict[str, torch.Tensor] | None
    prior_predictive: dict[str, torch.Tensor] | None
    vectorized: bool
    factors_left_out: tuple[str, ...] = ()


class _Refused(ValueError):
    """A refusal raised inside a run of the model or the guide: `_Runner._probe` raises its
    message as a `ValueError`, without the trace shapes Pyro's ``poutine.trace`` appends to an
    error on its way out (and the same message again, as the cause)."""


def all_rows_refusal(site: Mapping, given: bool, needs: str, by: str = "model") -> str | None:
    """Why the plate of the subsample site ``site`` (a message or a trace node) does not run on
    each of its rows once, and how to make it, by where its run's rows came from; ``None`` where
    it does. ``needs``: who needs all the rows, ``"the evidence"`` or ``"the export"``. The rows
    come from a `BayesianModule`'s likelihood (`made_by_likelihood`: its plate `DATA_PLATE` of
    ``dataset_size`` rows, given ``subsample=arange(B)`` for the ``B`` rows of ``x`` and ``y``
    passed), from indices the ``by`` (``"model"`` or ``"guide"``) gives (``subsample=...``,
    ``given``; repeated indices and indices outside the plate are named), or from a random draw
    (``subsample_size=...``). The refusals of `opqa_evidence` and `to_inference_data` end with it.
    """
    name, size, index = site["name"], site["fn"].size, site["value"]
    # Pyro's draws and a likelihood's arange(B) are distinct rows; indices given are read (a sync)
    checked = given and not made_by_likelihood(site)
    rows, wrong = len(index), _rows_not_once(index, size) if checked else ""
    if rows == size and not wrong:
        return None
    plate = f"pyro.plate({name!r}, {size}, subsample=...)"
    if wrong:
        return (
            f"plate {name!r} is given {rows} indices of its {size} rows, {wrong}; {needs} needs "
            f"each row once: the {by} gives them ({plate}): pass each of the {size} rows once "
            f"(subsample=torch.arange({size})), or no subsample"
        )
    if not given:
        return (
            f"plate {name!r} is subsampled ({rows} of {size}); {needs} needs the full data: the "
            f"plate draws {rows} of its {size} rows at random in each run "
            f"(subsample_size={rows}): drop subsample_size (or pass subsample_size=None)"
        )
    if made_by_likelihood(site):
        fix = (
            f"the BayesianModule's likelihood has dataset_size={size}, so x and y of {rows} rows "
            f"are a minibatch of its data set: pass all {size} rows of x and y (or, for these "
            f"{rows} rows alone, a likelihood with dataset_size={rows} or None)"
        )
    else:
        fix = (
            f"the {by} gives it these {rows} indices ({plate}): pass all {size} of them "
            f"(subsample=torch.arange({size})), or no subsample"
        )
    return f"plate {name!r} is given {rows} of its {size} indices; {needs} needs every row: {fix}"


def _rows_not_once(index: torch.Tensor | list, size: int) -> str:
    """What keeps the indices ``index`` from being distinct rows of ``0..size-1``: the rows given
    more than once, the indices outside the plate and, where there are ``size`` or more of them,
    the rows left out; ``""`` where none."""
    index = torch.as_tensor(index).reshape(-1).cpu()
    inside = (index >= 0) & (index < size)
    counts = torch.bincount(index[inside], minlength=size)
    found = [
        ("row", torch.nonzero(counts > 1).flatten(), "more than once"),
        ("index", index[~inside], f"outside 0..{size - 1}"),
    ]
    if len(index) >= size:
        found.append(("row", torch.nonzero(counts == 0).flatten(), "not at all"))
    return ", ".join(_listed(noun, x.tolist()) + " " + what for noun, x, what in found if len(x))


def _listed(noun: str, values: list[int], most: int = 5) -> str:
    """``"row 9"``, ``"rows 0, 3"``, ``"rows 3, 4, 5, 6, 7, ... (997 in all)"``."""
    if len(values) == 1:
        return f"{noun} {values[0]}"
    plural = "indices" if noun == "index" else noun + "s"
    return f"{plural} {shortened(map(str, values), most)}"


class _PlateRows(Messenger):
    """Sets the subsample indices of the model's (or guide's) subsampling plates.

    A plate ``pyro.plate(name, N, subsample_size=B)`` whose name is in ``rows`` takes
    ``rows[name]`` (``B`` indices) instead of a random subsample. Every subsampling plate seen is
    recorded in ``subsampled`` as ``name -> (N, B)``.

    In a probe (`_Runner._probe`, ``by`` the ``"guide"`` or the ``"model"`` it runs), every
    plate is recorded in ``plates`` as ``name -> (N, rows per run)``, and refused, raising
    `_Refused`: a plate given its indices (``subsample=...``) other than each of its ``N`` rows
    once (its rows cannot be swept here; `all_rows_refusal`), and a plate of the model that does
    not match the guide's plate of that name in ``guide_plates`` (`_check_guide_plate`).
    """

    def __init__(
        self,
        rows: Mapping[str, torch.Tensor],
        by: str | None = None,
        guide_plates: Mapping[str, _GuidePlate] | None = None,
    ):
        super().__init__()
        self.rows = rows
        self.by = by
        self.guide_plates = guide_plates or {}
        self.plates: dict[str, tuple[int, int]] = {}
        self.subsampled: dict[str, tuple[int, int]] = {}

    def _pyro_sample(self, msg) -> None:
        fn = msg["fn"]
        if not isinstance(fn, _Subsample):
            return
        name, given = msg["name"], msg["value"]
        if given is not None:
            per_run = len(given)
        elif fn.subsample_size is None:
            per_run = fn.size
        else:
            per_run = min(fn.subsample_size, fn.size)
        if self.by is not None:
            refusal = given is not None and all_rows_refusal(msg, True, "the export", self.by)
            if refusal:
                raise _Refused(f"to_inference_data: {refusal}")
            if name in self.guide_plates:
                _check_guide_plate(name, self.guide_plates[name], (fn.size, per_run))
            self.plates[name] = (fn.size, per_run)
        if given is None and per_run < fn.size:
            self.subsampled[name] = (fn.size, per_run)
            if name in self.rows:
                msg["value"] = self.rows[name]


@dataclass(frozen=True)
class _GuidePlate:
    """A plate of the guide's run, for `_check_guide_plate`: its full size, its rows per run,
    whether it holds a latent the guide draws, and who built it, for the message."""

    size: int
    per_run: int
    local: bool
    built_by: str


def _check_guide_plate(name: str, guide: _GuidePlate, model: tuple[int, int]) -> None:
    """Refuse a plate whose rows in the model (``model``: its full size and rows per run) do not
    match the guide's ``guide``, where that breaks the export: a plate of the guide's local
    latents must have the same size (the guide holds those latents for the rows it was fitted
    on, none other) and rows per run (the draws pair the guide's latents with the model's rows);
    a plate without latents that the guide subsamples must be swept as the model's is."""
    if (guide.size, guide.per_run) == model:
        return

    def rows(size: int, batch: int) -> str:
        return f"{batch} of its {size}" if batch < size else f"all {size}"

    fit = "export with the model's arguments of the fit (those given to svi.step)"
    if not guide.local:
        if guide.per_run == guide.size:
            return  # the guide's run holds no latent there, and takes the plate whole
        raise _Refused(
            f"to_inference_data: plate {name!r} takes {rows(guide.size, guide.per_run)} rows per "
            f"run in the guide but {rows(*model)} in the model with these arguments; the guide "
            f"holds no latent in it ({guide.built_by}), and the export sweeps a "
            "plate's rows once for the guide and the model: give the guide's plate the model's "
            "size and subsample size, or leave it out of the guide (an AutoGuide's create_plates "
            "need not return a plate that holds none of its latents)"
        )
    if guide.size != model[0]:
        raise _Refused(
            f"to_inference_data: the guide's local latents are of a plate {name!r} of "
            f"{guide.size} rows, but the model's plate {name!r} has {model[0]} with these "
            f"arguments: a guide of local latents holds them for the rows it was fitted on and "
            f"for no other. {fit[0].upper() + fit[1:]}; on new data only a guide of global "
            "latents exports (fit a guide to the new data for its local latents)"
        )
    if guide.per_run < guide.size:
        how = (
            f"The guide was fitted on minibatches of {guide.per_run}: {fit}; the export then "
            f"sweeps all {guide.size} rows in chunks of {guide.per_run} and draws the local "
            f"latents of every row (the guide holds them for all {guide.size} rows, each fitted "
            "on the steps whose minibatch held it)"
        )
    else:
        how = f"The guide was fitted on all {guide.size} rows: {fit}, without subsampling"
    raise _Refused(
        f"to_inference_data: plate {name!r} takes {rows(guide.size, guide.per_run)} rows per run "
        f"in the guide but {rows(*model)} in the model with these arguments, so the guide's "
        f"local latents do not line up with the model's rows ({guide.built_by}). {how}"
    )


class _ReleaseObserved(Messenger):
    """Samples the named observed sites from their distribution instead of observing the data.

    Unlike `pyro.poutine.uncondition`, it leaves deterministic and factor sites alone (those
    are observed sites too in Pyro, and resampling an expanded ``Delta`` changes its shape).
    """

    def __init__(self, names: Iterable[str]):
        super().__init__()
        self.names = frozenset(names)

    def _pyro_sample(self, msg) -> None:
        if msg["is_observed"] and msg["name"] in self.names:
            msg["is_observed"] = False
            msg["infer"] = {**msg["infer"], "was_observed": True}
            msg["value"] = None
            msg["done"] = False


def _grid(indices: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Index tensors of an outer-product selection (``numpy.ix_``) over all dims."""
    ndim = len(indices)
    return tuple(
        idx.reshape([-1 if j == k else 1 for j in range(ndim)]) for k, idx in enumerate(indices)
    )


class _Assembly:
    """One quantity over the full data, written chunk by chunk of the subsampled plates.

    Args:
        axes: ``(plate, axis)`` of the subsampled plates in the quantity (negative axes).
        full_sizes: the full size of every subsampled plate.
    """

    def __init__(self, axes: Iterable[tuple[str, int]], full_sizes: Mapping[str, int]):
        self.axes = tuple(axes)
        self.full_sizes = full_sizes
        self.value: torch.Tensor | None = None
        self.written = torch.zeros([full_sizes[plate] for plate, _ in self.axes], dtype=torch.bool)

    def _index(self, rows: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        dims = {self.value.dim() + axis: rows[plate] for plate, axis in self.axes}
        return _grid([dims.get(d, torch.arange(n)) for d, n in enumerate(self.value.shape)])

    def scatter(self, rows: Mapping[str, torch.Tensor], chunk: torch.Tensor) -> None:
        """Write the values of the rows ``rows`` (one index tensor per subsampled plate)."""
        if not self.axes:
            self.value = chunk
            self.written.fill_(True)
            return
        if self.value is None:
            shape = list(chunk.shape)
            for plate, axis in self.axes:
                shape[axis] = self.full_sizes[plate]
            self.value = chunk.new_zeros(shape)
        self.value[self._index(rows)] = chunk
        self.written[_grid([rows[plate] for plate, _ in self.axes])] = True

    def gather(self, rows: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The values at ``rows``, or ``None`` unless all of them were written before."""
        if self.value is None or not self.written[_grid([rows[p] for p, _ in self.axes])].all():
            return None
        return self.value[self._index(rows)] if self.axes else self.value


def _log_density(node: dict) -> torch.Tensor:
    """The site's log density; refuses observed data with NaN, naming the site."""
    check_observed_not_nan(node, before="the export (and the fit)")
    return node["fn"].log_prob(node["value"])


def _is_deterministic(node: dict) -> bool:
    """Whether a sample site holds a value the model computes rather than data.

    That is a ``pyro.deterministic`` site (``infer["_deterministic"]``), or the site a Pyro
    reparameterizer leaves in place of the latent it reparameterizes (`poutine.reparam` with
    ``LocScaleReparam``, ``TransformReparam``, ``AutoReparam``, ...): Pyro marks that one
    observed and leaves the flag off, but builds its distribution as ``pyro.deterministic``
    does, a ``Delta`` at the value with its density masked off (``Delta(value).mask(False)``,
    "simulate a pyro.deterministic() site" in Pyro's source). That mask is what tells it from
    data: an observed ``Delta`` the user wrote (``pyro.sample("x", dist.Delta(v), obs=data)``)
    has a density, so it stays observed, and an observation masked off entirely carries no data.
    Narrower than `is_data_site` (every ``Delta`` is no data to annealing, the rows check and
    the distributed ELBO) on purpose: the export keeps an unmasked ``Delta`` as observed data and
    refuses it where its value changes with the draw (`_not_data`).
    """
    if node["infer"].get("_deterministic"):
        return True
    if not node["is_observed"]:
        return False
    layers = list(_layers(node["fn"]))
    masked_off = any(isinstance(fn, MaskedDistribution) and fn._mask is False for fn in layers)
    return masked_off and isinstance(layers[-1], Delta)


def _unguided_refusal(names: list[str], model_trace: Trace) -> str:
    """Why latent sites ``names`` of the model, which the guide does not sample, are refused:
    the export has no posterior draws of them (drawn from the prior, as `Predictive` fills them,
    they would be prior draws labelled ``posterior``, and the log likelihood would be
    conditional on them). An enumerated site (``infer["enumerate"]``, summed out by
    ``TraceEnum_ELBO``) is named apart, with the fix that gives LOO its marginal likelihood."""
    enumerated = [n for n in names if model_trace.nodes[n]["infer"].get("enumerate")]
    others = [n for n in names if n not in enumerated]
    found, fixes = [], []
    if others:
        found.append(f"the guide does not sample the latent site(s) {others} of the model")
        fixes.append(
            "let the guide sample every latent site (an AutoGuide built from the model itself, "
            "not from poutine.block(model, hide=...))"
        )
    if enumerated:
        found.append(
            f"the enumerated site(s) {enumerated} (infer['enumerate'], summed out by "
            "TraceEnum_ELBO) have no draws in the guide, and the pointwise log likelihood given "
            "prior draws of them is not the marginal one LOO needs"
        )
        fixes.append(
            "marginalize each enumerated site in the model (a mixture as "
            "dist.MixtureSameFamily), so that log_likelihood is the marginal likelihood"
        )
    return (
        f"to_inference_data: {'; '.join(found)}. The export draws the posterior from the guide "
        "only: drawn from the prior, these sites would be prior draws labelled posterior. "
        f"Fix: {'; '.join(fixes)}"
    )


def _plates_built_by(guide: Callable) -> str:
    """Who builds the plates of ``guide``, for `_check_guide_plate`'s message."""
    guide = unwrap_guide(guide)
    if not isinstance(guide, AutoGuide):
        return "the guide's own code builds its plates"
    if getattr(guide, "create_plates", None) is None:
        return (
            "an AutoGuide builds its plates on its first run and keeps that run's rows per run, "
            "whatever the model is given later"
        )
    return (
        "the guide's create_plates builds its plates, or, for a plate it does not return, the "
        "AutoGuide on its first run"
    )


class _Runner:
    """Runs the guide and the model for the draws of one export (see the module docstring)."""

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        args: tuple,
        kwargs: dict,
        factors: str | Collection[str] | None = None,
    ):
        self.model, self.guide, self.args, self.kwargs = model, guide, args, kwargs
        self.built_by = _plates_built_by(guide)
        # a first run finds the subsampled plates and checks every plate's rows
        _, _, subsampled = self._probe({}, check=True)
        self.full_sizes = {name: size for name, (size, _) in subsampled.items()}
        chunks = {name: _chunks(size, batch) for name, (size, batch) in sorted(subsampled.items())}
        self.combos = [dict(zip(chunks, combo)) for combo in itertools.product(*chunks.values())]
        guide_trace, model_trace, _ = self._probe(self.combos[0], check=False)
        for name in _guide_latents(guide_trace):
            if name not in model_trace.nodes:
                model_sites = [
                    n for n, node in model_trace.nodes.items() if node["type"] == "sample"
                ]
                raise ValueError(
                    f"the guide samples a latent site {name!r} that the model does not have (the "
                    f"model's sample sites: {', '.join(model_sites) or 'none'}); export a guide "
                    "built from this model"
                )
        self.factors_left_out = _factors_left_out(model_trace, factors)
        self.sites = self._site_specs(guide_trace, model_trace)
        self.improper = [
            s.name for s in self.sites.values() if is_improper(model_trace.nodes[s.name]["fn"])
        ]
        self.max_plate_nesting = max(
            model_max_plate_nesting(guide_trace), model_max_plate_nesting(model_trace)
        )
        self.observed = [s.name for s in self.sites.values() if s.kind == "observed"]
        self.latents = [s for s in self.sites.values() if s.kind == "latent"]
        unguided = [s.name for s in self.latents if not s.guided]
        if unguided:
            raise ValueError(_unguided_refusal(unguided, model_trace))

    # -- one unbatched run: the chunked plates and the sites ---------------------------------

    def _probe(self, rows: Mapping[str, torch.Tensor], check: bool) -> tuple[Trace, Trace, dict]:
        """One run of the guide and the model at the chunks ``rows``, with ``check`` checking
        their plates (`_PlateRows`; the rows given and the plates' sizes are the same in every
        probe, so the first checks them): the traces, and the subsampled plates of both,
        ``name -> (N, B)``."""
        guide_rows = _PlateRows(rows, by="guide" if check else None)
        try:
            guide_trace = poutine.trace(guide_rows(self.guide)).get_trace(*self.args, **self.kwargs)
            latents = _guide_latents(guide_trace)
            local = {
                frame.name
                for name in latents
                for frame in guide_trace.nodes[name]["cond_indep_stack"]
            }
            guide_plates = {
                name: _GuidePlate(size, per_run, name in local, self.built_by)
                for name, (size, per_run) in guide_rows.plates.items()
            }
            model_rows = _PlateRows(rows, by="model" if check else None, guide_plates=guide_plates)
            conditioned = poutine.condition(model_rows(self.model), data=latents)
            model_trace = poutine.trace(conditioned).get_trace(*self.args, **self.kwargs)
        except _Refused as refused:
            # each poutine.trace on the way out raised a copy with its trace shapes appended,
            # from the one before: the first is the refusal as written, said once
            while isinstance(refused.__cause__, _Refused):
                refused = refused.__cause__
            raise ValueError(str(refused)) from None
        except Exception as error:  # the model's own error, kept, with the lists named
            listed = [
                f"argument {i} ({reprlib.repr(a)})"
                for i, a in enumerate(self.args)
                if isinstance(a, list)
            ]
            listed += [
                f"{k}={reprlib.repr(a)}" for k, a in self.kwargs.items() if isinstance(a, list)
            ]
            if listed:
                add_hint(
                    error,
                    f"to_inference_data passed {', '.join(listed)} to the model and the guide "
                    "as a Python list, as svi.step and Predictive do (none of them converts "
                    "it): where the model takes a tensor, pass torch.as_tensor(...) instead",
                )
            raise
        return guide_trace, model_trace, {**guide_rows.subsampled, **model_rows.subsampled}

    def _site_specs(self, guide_trace: Trace, model_trace: Trace) -> dict[str, SiteSpec]:
        guided = _guide_latents(guide_trace)
        sites = {}
        for name, node in model_trace.nodes.items():
            if node["type"] != "sample" or site_is_subsample(node) or name in self.factors_left_out:
                continue
            fn, value = node["fn"], node["value"]
            if name in guided or not node["is_observed"]:
                kind, shape, event_ndim = "latent", value.shape, fn.event_dim
            elif _is_deterministic(node):
                # pyro.deterministic makes every dim an event dim by default; plates index them
                kind, shape = "deterministic", value.shape
                event_ndim = 0 if fn.event_dim >= value.dim() else fn.event_dim
            elif _is_factor(node):  # its log factor, pointwise
                kind, shape, event_ndim = "factor", fn.batch_shape, 0
            else:
                kind, shape, event_ndim = "observed", fn.batch_shape + fn.event_shape, fn.event_dim
                _check_data_fits(name, fn, value)
            frames = tuple(
                (f.name, f.dim, f.full_size or f.size)
                for f in node["cond_indep_stack"]
                if f.vectorized
            )
            batch_ndim = len(shape) - event_ndim
            chunked = []
            for plate, dim, _ in frames:
                if plate in self.full_sizes:
                    axis = dim - event_ndim
                    if -axis > len(shape) or shape[axis] != len(self.combos[0][plate]):
                        raise ValueError(
                            f"site {name!r} is in the subsampled plate {plate!r} but its shape "
                            f"{tuple(shape)} has no dim of the subsample size at dim {dim}; give "
                            "the site's value the plate's dim (pyro.deterministic(..., "
                            "event_dim=...) for a deterministic site)"
                        )
                    chunked.append((plate, axis))
            sites[name] = SiteSpec(
                name,
                kind,
                shape,
                batch_ndim,
                frames,
                value.dtype.itemsize,
                name in guided,
                tuple(chunked),
            )
        return sites

    # -- batched or unbatched runs ----------------------------------------------------------

    def _trace(self, fn: Callable, particles: int | None) -> Trace:
        if particles is None:
            return poutine.trace(fn).get_trace(*self.args, **self.kwargs)
        with pyro.plate(_DRAW_PLATE, particles, dim=-self.max_plate_nesting - 1):
            return poutine.trace(fn).get_trace(*self.args, **self.kwargs)

    def _per_draw(self, x: torch.Tensor, shape: torch.Size, particles: int | None, what: str):
        """``x`` of a run as ``(S, *shape)`` (batched) or ``shape`` (unbatched)."""
        if particles is None:
            if x.shape != shape:
                raise ValueError(
                    f"{what} has shape {tuple(x.shape)} in one run and {tuple(shape)} in another; "
                    "the export needs the model's sites to keep their shapes"
                )
            return x
        if x.shape == shape:  # the same in every draw (a constant deterministic site)
            return x.expand((particles, *shape))
        lead = x.shape[: x.dim() - len(shape)]
        if (
            x.dim() <= len(shape)
            or x.shape[len(lead) :] != shape
            or lead[0] != particles
            or any(n != 1 for n in lead[1:])
        ):
            raise BatchMismatch(
                f"{what} has shape {tuple(x.shape)} in the batched run, expected "
                f"({particles}, 1, ..., {', '.join(map(str, shape))})"
            )
        return x.reshape((particles, *shape))

    def _pad(self, x: torch.Tensor, site: SiteSpec, particles: int | None) -> torch.Tensor:
        """A draw (``shape``) or draws (``(S, *shape)``) as a batched run's value of the site."""
        if particles is None:
            return x
        pad = self.max_plate_nesting - site.batch_ndim
        if pad < 0:
            raise BatchMismatch(f"site {site.name!r} has batch dims outside of any plate")
        return x.reshape((particles,) + (1,) * pad + site.shape)

    def _fixed(self, assemblies: Mapping[str, _Assembly], rows, particles) -> dict:
        """The values already drawn at ``rows``, to hold fixed (condition on) in this run."""
        data = {}
        for name, assembly in assemblies.items():
            value = assembly.gather(rows)
            if value is not None:
                data[name] = self._pad(value, self.sites[name], particles)
        return data

    def _new(self, sites: Iterable[SiteSpec], loglik: bool = False) -> dict[str, _Assembly]:
        return {
            s.name: _Assembly(s.batch_axes() if loglik else s.chunked, self.full_sizes)
            for s in sites
        }

    def _collect(self, trace: Trace, assemblies, rows, particles, loglik=False) -> None:
        for name, assembly in assemblies.items():
            site, node = self.sites[name], trace.nodes[name]
            if loglik:
                value = scale_and_mask(_log_density(node), mask=node["mask"]).to(torch.float64)
                shape, what = site.shape[: site.batch_ndim], f"the log likelihood of {name!r}"
            else:
                value, shape, what = node["value"], site.shape, f"site {name!r}"
            assembly.scatter(rows, self._per_draw(value, shape, particles, what))

    # -- the draws --------------------------------------------------------------------------

    def posterior(
        self, particles: int | None, trial: bool = False
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Posterior, log likelihood, posterior predictive and observed data over the full data;
        ``trial``: over the first rows' chunk only (`_all_draws`'s trial run)."""
        combos = self.combos[:1] if trial else self.combos
        latents = self._new(self.latents)  # all drawn by the guide (`_unguided_refusal`)
        for rows in combos:
            guide = poutine.condition(
                _PlateRows(rows)(self.guide), data=self._fixed(latents, rows, particles)
            )
            self._collect(self._trace(guide, particles), latents, rows, particles)
        deterministic = self._new(s for s in self.sites.values() if s.kind == "deterministic")
        observed = [self.sites[name] for name in self.observed]
        factors = [s for s in self.sites.values() if s.kind == "factor"]
        loglik = self._new(observed + factors, loglik=True)
        predictive, data = self._new(observed), {}
        for i, rows in enumerate(combos):
            model = _PlateRows(rows)(self.model)
            conditioned = poutine.condition(model, data=self._fixed(latents, rows, particles))
            trace = self._trace(conditioned, particles)
            if particles is not None and i == 0:
                self._verify(model, trace, particles, [s.name for s in self.latents])
            self._collect(trace, {**latents, **deterministic}, rows, particles)
            self._collect(trace, loglik, rows, particles, loglik=True)
            for name in self.observed:
                value = trace.nodes[name]["value"]
                if value.dim() > len(self.sites[name].shape):  # a dim of the draws
                    raise _not_data(name)
                value = value.expand(self.sites[name].shape)
                data.setdefault(name, _Assembly(self.sites[name].chunked, self.full_sizes))
                data[name].scatter(rows, value)
            released = _ReleaseObserved(self.observed)(model)
            fixed = self._fixed(latents, rows, particles)
            trace = self._trace(poutine.condition(released, data=fixed), particles)
            if particles is not None and i == 0:
                self._verify(released, trace, particles, list(fixed) + self.observed)
            self._collect(trace, predictive, rows, particles)
        return {
            "posterior": _values({**latents, **deterministic}),
            "log_likelihood": _values(loglik),
            "posterior_predictive": _values(predictive),
            "observed_data": _values(data),
        }

    def prior(
        self, particles: int | None, trial: bool = False
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Prior and prior predictive draws over the full data; ``trial``: as in `posterior`."""
        combos = self.combos[:1] if trial else self.combos
        latents = self._new(self.latents)
        deterministic = self._new(s for s in self.sites.values() if s.kind == "deterministic")
        predictive = self._new(self.sites[name] for name in self.observed)
        for i, rows in enumerate(combos):
            released = _ReleaseObserved(self.observed)(_PlateRows(rows)(self.model))
            conditioned = poutine.condition(released, data=self._fixed(latents, rows, particles))
            trace = self._trace(conditioned, particles)
            if particles is not None and i == 0:
                names = [s.name for s in self.latents] + self.observed
                self._verify(released, trace, particles, names)
            self._collect(trace, {**latents, **deterministic}, rows, particles)
            self._collect(trace, predictive, rows, particles)
        return {
            "prior": _values({**latents, **deterministic}),
            "prior_predictive": _values(predictive),
        }

    def _verify(self, model: Callable, trace: Trace, particles: int, names: list[str]) -> None:
        """Check draws ``0`` and ``S - 1`` of a batched run against unbatched runs of ``model``
        conditioned on the same values of the sites ``names``: every site's log density and every
        deterministic value must agree (to ``sqrt(eps)`` of the dtype).
        """
        batched = {}  # per site: (S, ...) log densities, or values of deterministic sites
        for name, node in trace.nodes.items():
            if node["type"] == "sample" and not site_is_subsample(node) and name != _DRAW_PLATE:
                batched[name] = node["value"] if _is_deterministic(node) else _log_density(node)
        for s in sorted({0, particles - 1}):
            data = {
                name: self._per_draw(
                    trace.nodes[name]["value"], self.sites[name].shape, particles, f"site {name!r}"
                )[s]
                for name in names
            }
            single = self._trace(poutine.condition(model, data=data), None)
            for name, node in single.nodes.items():
                if node["type"] != "sample" or site_is_subsample(node):
                    continue
                expected = node["value"] if _is_deterministic(node) else _log_density(node)
                got = self._per_draw(batched[name], expected.shape, particles, f"site {name!r}")[s]
                tol = torch.finfo(expected.dtype).eps ** 0.5 if expected.is_floating_point() else 0
                if not torch.allclose(got, expected, rtol=tol, atol=tol, equal_nan=True):
                    raise BatchMismatch(
                        f"draw {s} of site {name!r} differs between the batched run and an "
                        "unbatched run"
                    )


def _check_data_fits(name: str, fn: torch.distributions.Distribution, data: torch.Tensor) -> None:
    """Refuse an observed site whose distribution is narrower than its data: an Independent
    whose event shape is ``(1,)`` where the data's rows are ``(n,)``, a batch dim of 1 (or none)
    where the data have more. Its log density broadcasts over the data (``Normal.log_prob`` of a
    value wider than its loc), so a fit and `opqa_evidence` run on the right density, but its
    draws have the distribution's shape: the ``posterior_predictive`` draws would be of another
    shape than ``observed_data`` (one replicate where the data hold ``n``), a wrong answer, not a
    shape to take. The refusal names both shapes and the rewrite that gives the distribution the
    data's shape (`_widening`)."""
    shape = fn.batch_shape + fn.event_shape
    try:
        full = torch.broadcast_shapes(shape, data.shape)
    except RuntimeError:
        return  # no broadcast: the log density raises, naming both shapes, as in the fit
    if full == shape:
        return
    padded = (1,) * (len(full) - len(shape)) + tuple(shape)
    widened = [i for i in range(len(full)) if padded[-1 - i] != full[-1 - i]]  # from the right
    base = look_through(fn)
    while isinstance(base, MaskedDistribution):
        base = look_through(base.base_dist)
    if full == data.shape:
        density = "its log density broadcasts over the data, so the fit and opqa_evidence run"
    else:  # the data broadcast too: neither shape is the density's
        density = f"its log density broadcasts with the data to {tuple(full)}"
    if widened:
        fix = f"Give the distribution the data's shape: {_widening(fn, base, full, widened)}"
    else:  # only leading dims of size 1 that the distribution lacks
        fix = (
            f"Pass data of the distribution's shape: the data's {len(full) - len(shape)} leading "
            f"dim(s) of size 1 are not the distribution's (data.reshape({tuple(shape)}))"
        )
    raise ValueError(
        f"to_inference_data: observed site {name!r} has data of shape {tuple(data.shape)}, but "
        f"its distribution is of shape {tuple(shape)} (batch_shape {tuple(fn.batch_shape)}, "
        f"event_shape {tuple(fn.event_shape)}): {density}, but its draws have the "
        f"distribution's shape, and the posterior_predictive draws of {name!r} would not match "
        f"its observed_data. {fix}"
    )


def _widening(
    fn: torch.distributions.Distribution,
    base: torch.distributions.Distribution,
    full: torch.Size,
    widened: list[int],
) -> str:
    """The rewrite of `_check_data_fits`, for the dims ``widened`` (from the right) that the data
    ``full`` have and the distribution ``fn`` lacks. An event dim: ``base`` (``fn`` without its
    ``to_event``, ``expand`` and masks) expanded to the data's shape, then ``to_event`` as before;
    the shape is written from ``d.batch_shape``, whose leading dims a batch of draws widens
    (`QuadratureELBO`'s nodes, the export's draws), where a fixed one (``expand([6, 4])``) does
    not broadcast. A batch dim: a plate over it (an event dim made of it would move the plates'
    dims)."""
    fixes = []
    kind, base_event = type(base).__name__, base.event_dim
    events = [i for i in widened if i < fn.event_dim]
    if events and min(events) < base_event:  # the base's own event dim: expand cannot widen it
        fixes.append(f"a {kind} of event shape {tuple(full[len(full) - base_event :])}")
    elif events:
        end = len(full) - base_event
        set_dims = max(events) + 1 - base_event  # the base's batch dims from the right to set
        to_event = f".to_event({fn.event_dim - base_event})"  # >= 1: an event dim is widened
        fixes.append(
            f"with d = dist.{kind}(...), write d.expand(d.batch_shape[:-{set_dims}] + "
            f"{tuple(full[end - set_dims : end])}){to_event} in place of d{to_event} (that is "
            f"d.expand({list(full[:end])}){to_event} in one run; a fixed shape does not broadcast "
            "over a batch of draws, d.batch_shape keeps its leading dims)"
        )
    plates = [
        f"pyro.plate(..., {full[-1 - i]}, dim={fn.event_dim - i - 1})"
        for i in reversed(widened)
        if i >= fn.event_dim
    ]
    if plates:
        fixes.append(f"observe it inside {' and '.join(plates)}")
    return "; and ".join(fixes)


def _not_data(name: str) -> ValueError:
    """The refusal of an observed site whose value changes with the posterior draw."""
    return ValueError(
        f"to_inference_data: site {name!r} is observed, but its value changes from one "
        "posterior draw to the next: the model computes it from the latents, so it is no data. "
        "Pyro's reparameterizers that leave the site an unmasked Delta do this "
        "(UnitJacobianReparam, HaarReparam, DiscreteCosineReparam, SplitReparam, NeuTraReparam, "
        "ConjugateReparam, StructuredReparam; those that mask it "
        "off, as pyro.deterministic does, export fine: LocScaleReparam, TransformReparam). "
        f"Write the transform into the model, pyro.deterministic({name!r}, value), or use a "
        "reparameterizer of the second kind"
    )


def check_factors_argument(factors: object) -> None:
    """Refuse a ``factors`` argument of `to_inference_data` that is not ``None``, ``"all"`` or a
    collection of site names, before any draw."""
    if factors is None or factors == "all":
        return
    if isinstance(factors, str):
        raise TypeError(
            f"to_inference_data: factors must be None, 'all' or a collection of pyro.factor site "
            f"names: pass factors=[{factors!r}] for the one site, got {factors!r}"
        )
    if not isinstance(factors, Collection) or not all(isinstance(name, str) for name in factors):
        raise TypeError(
            "to_inference_data: factors must be None, 'all' or a collection of pyro.factor site "
            f"names (e.g. ['cens']), got {factors!r}"
        )


def _is_factor(node: dict) -> bool:
    """Whether an observed sample site is a ``pyro.factor`` (Pyro marks it auxiliary), not a
    value the model computes (`_is_deterministic`): the sites ``factors`` chooses from."""
    return (
        node["is_observed"]
        and bool(node["infer"].get("is_auxiliary"))
        and not _is_deterministic(node)
    )


def _factors_left_out(model_trace: Trace, factors: str | Collection[str] | None) -> tuple[str, ...]:
    """The ``pyro.factor`` sites of ``model_trace`` left out of the log likelihood under
    ``factors``; names that are no factor site of the model are refused, naming those that are."""
    model_factors = [
        name
        for name, node in model_trace.nodes.items()
        if node["type"] == "sample" and _is_factor(node)
    ]
    if isinstance(factors, str):  # "all", checked by check_factors_argument
        return ()
    chosen = set(factors or ())
    unknown = sorted(chosen - set(model_factors))
    if unknown:
        raise ValueError(
            f"to_inference_data: factors names {unknown}, which are not pyro.factor sites of the "
            f"model; its factor sites are {model_factors or 'none'}"
        )
    return tuple(name for name in model_factors if name not in chosen)


def _values(assemblies: Mapping[str, _Assembly]) -> dict[str, torch.Tensor]:
    return {name: assembly.value for name, assembly in assemblies.items()}


def _guide_latents(guide_trace: Trace) -> dict[str, torch.Tensor]:
    """The values the guide drew for the model's latent sites (not its auxiliary sites)."""
    return {
        name: node["value"]
        for name, node in guide_trace.nodes.items()
        if node["type"] == "sample"
        and not node["is_observed"]
        and not site_is_subsample(node)
        and not node["infer"].get("is_auxiliary")
    }


def _chunks(size: int, batch: int) -> list[torch.Tensor]:
    """Rows ``0..size-1`` in chunks of exactly ``batch`` consecutive indices (the last one ends at
    ``size`` and may overlap the one before)."""
    starts = [*range(0, size - batch, batch), size - batch]
    return [torch.arange(start, start + batch) for start in starts]


class _RefuseNewParams(Messenger):
    """Raises at a ``pyro.param`` that is not in the param store yet (a guide never run)."""

    def _pyro_param(self, msg) -> None:
        if msg["name"] not in pyro.get_param_store():
            raise RuntimeError(
                f"the guide's parameter {msg['name']!r} does not exist yet: the guide was never "
                "run. Fit it first (svi.step(*args, **kwargs)), or at least run it once with the "
                "model's arguments"
            )


def check_guide_was_run(guide: Callable, args: tuple, kwargs: dict) -> None:
    """Refuse a guide that was never run (an AutoGuide without prototype trace, or a guide whose
    parameters are not in Pyro's param store).

    Raises:
        RuntimeError: naming the fix (run ``svi.step`` first).
    """
    if isinstance(guide, AutoGuide):
        if guide.prototype_trace is None:
            raise RuntimeError(
                f"{type(guide).__name__} was never run, so it has no parameters to draw from: fit "
                "it first (svi.step(*args, **kwargs)), or at least call guide(*args, **kwargs) once"
            )
        return
    with torch.no_grad(), _RefuseNewParams():
        poutine.trace(guide).get_trace(*args, **kwargs)


def draw(
    model: Callable,
    guide: Callable,
    args: tuple,
    kwargs: dict,
    num_samples: int,
    prior: bool,
    vectorize: bool | None = None,
    max_bytes: int | None = None,
    factors: str | Collection[str] | None = None,
) -> Draws:
    """Draw the posterior, log likelihood, posterior predictive, observed data and (with
    ``prior``) the prior and prior predictive, batched over the draws if the model allows it
    (``vectorize``: ``None`` tries, ``True`` forces, ``False`` loops). The points are random
    draws, so `evaluate_batch` has no single evaluation to
    compare them with (``probe=()``): the batched run checks itself instead, on every call, against
    unbatched runs at its first and last draws, and under ``True`` a disagreement raises
    `BatchMismatch` naming the ways out. Groups that would hold more than ``max_bytes`` in all
    (``None``: the memory available now, where the platform says) are refused before any draw.
    ``factors`` names the ``pyro.factor`` sites whose values go into the log likelihood
    (``"all"``, or names; ``None`` and ``()``: none); the others are ``Draws.factors_left_out``.
    """
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral) or max_bytes < 1
    ):
        raise ValueError(
            f"to_inference_data: max_bytes must be None or an integer >= 1, got {max_bytes!r}"
        )
    check_factors_argument(factors)
    check_guide_was_run(guide, args, kwargs)
    follow_param_store(unwrap_guide(guide))  # a restored param store's values, not stale ones
    follow_param_store(unwrap_guide(model))
    devices = cuda_devices(model, guide, args, kwargs)
    with torch.no_grad():
        runner = _Runner(model, guide, args, kwargs, factors)
        if prior and runner.improper:
            raise ValueError(
                f"to_inference_data: the latent sites {runner.improper} have an ImproperUniform "
                "prior, which has no sampler, so the prior and prior_predictive groups cannot be "
                "drawn: pass prior=False (the posterior groups need no prior draw)"
            )
        _check_size(runner, num_samples, prior, max_bytes)
        groups, vectorized = _all_draws(
            runner.posterior, num_samples, vectorize, "posterior", devices
        )
        prior_groups = {"prior": None, "prior_predictive": None}
        if prior:
            prior_groups, _ = _all_draws(runner.prior, num_samples, vectorize, "prior", devices)
    return Draws(
        sites=runner.sites,
        full_sizes=runner.full_sizes,
        vectorized=vectorized,
        **groups,
        **prior_groups,
        factors_left_out=runner.factors_left_out,
    )


def _check_size(runner: _Runner, num_samples: int, prior: bool, max_bytes: int | None) -> None:
    """Refuse an export whose groups would exceed ``max_bytes`` (``None``: the memory available
    now): per draw, the latent and deterministic sites (``posterior``, and ``prior``), the
    observed sites (``posterior_predictive``, and ``prior_predictive``, counted in the data's
    dtype) and their pointwise log likelihood in float64, over the full data (the draws' own size;
    a batched run holds about as much again while it runs)."""
    values = log_likelihood = 0  # a draw of every site's value; the pointwise log likelihood
    for site in runner.sites.values():
        shape = site.full_shape(runner.full_sizes)
        if site.kind != "factor":  # a factor has a log likelihood and no value
            values += math.prod(shape) * site.itemsize
        if site.kind in ("observed", "factor"):
            log_likelihood += math.prod(shape[: site.batch_ndim]) * torch.float64.itemsize
    per_draw = (2 if prior else 1) * values + log_likelihood  # the prior's groups again
    limit, what = max_bytes, "max_bytes"
    if limit is None:
        limit, what = available_memory(), "the memory available now"
        if limit is None:  # the platform does not say
            return
    needed = num_samples * per_draw
    if needed > limit:
        ways = [f"num_samples <= {limit // per_draw}"] if limit >= per_draw else []
        if prior:
            ways.append(f"prior=False ({format_bytes(values + log_likelihood)} a draw)")
        ways.append("a larger max_bytes" if max_bytes is not None else "max_bytes=...")
        raise ValueError(
            f"to_inference_data: {num_samples} draws need {format_bytes(needed)} "
            f"({format_bytes(per_draw)} a draw: the sites over the full data"
            f"{', with the prior groups' if prior else ''}), more than {what} "
            f"({format_bytes(limit)}); pass {', or '.join(ways)}"
        )


def available_memory() -> int | None:
    """The memory available for new allocations now, in bytes (Linux's ``MemAvailable``), or
    ``None`` where the platform does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _all_draws(
    run: Callable, num_samples: int, vectorize: bool | None, label: str, devices: list[int]
):
    """``run(S)`` (one batched pass that checks itself) or ``run(None)`` once per draw. Looped,
    the observed data must be the same in every run (a site the model computes from the latents
    is refused, `_not_data`); ``devices``: the CUDA devices whose random states the runs draw
    from (`cuda_devices`)."""
    bar = None

    def one_draw(_) -> dict:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=num_samples, desc=f"{label} draws", disable=None)
        bar.update()
        return run(None)

    def batched(draws: torch.Tensor) -> dict:
        try:
            if len(draws) > _TRIAL_DRAWS:
                # a model that does not broadcast over the draws can make a site of (S, S, ...)
                # values before the check sees it: a trial on a few draws and the first rows'
                # chunk finds it at a small cost, from a forked random state (the draws after
                # it are as without it)
                with torch.random.fork_rng(devices=devices):
                    try:
                        run(_TRIAL_DRAWS, trial=True)
                    except BatchMismatch as error:
                        raise BatchMismatch(
                            f"in a trial batched run of {_TRIAL_DRAWS} draws, {error}"
                        ) from error
            return run(len(draws))
        except BatchMismatch as error:
            if vectorize is not True:
                raise  # vectorize=None falls back to the loop
            raise BatchMismatch(
                f"to_inference_data(vectorize=True): the batched run of the {label} draws cannot "
                f"be trusted: {error}. Pass vectorize=None to fall back to a loop over the draws "
                "(with one warning), or vectorize=False to loop without trying the batched run"
            ) from error

    groups, decision = evaluate_batch(
        batched,
        one_draw,
        torch.arange(num_samples),
        vectorize,
        probe=(),  # random draws: the batched run compares itself with unbatched runs (_verify)
        what=f"to_inference_data ({label} draws)",
    )
    if bar is not None:
        bar.close()
    if not decision.vectorized and "observed_data" in groups:
        # the data are the same in every looped run: no draw axis
        observed = groups["observed_data"]
        if num_samples == 1:
            # one draw has none to be compared with: one more run, for this check only, from a
            # forked random state (the export and the random state after it stay as they are)
            with torch.random.fork_rng(devices=devices):
                again = run(None)["observed_data"]
            observed = {name: torch.cat([v, again[name][None]]) for name, v in observed.items()}
        for name, values in observed.items():
            first = values[:1].expand_as(values)  # NaN under a mask(False) is the same data
            if not torch.allclose(values, first, rtol=0, atol=0, equal_nan=True):
                raise _not_data(name)
        groups["observed_data"] = {name: v[0] for name, v in groups["observed_data"].items()}
    return groups, decision.vectorized
