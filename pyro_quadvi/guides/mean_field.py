"""``AutoMeanFieldNormal``: the Gaussian mean-field AutoGuide of pyro-quadvi."""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.poutine import Trace
from pyro.poutine.messenger import Messenger

from ..distributions.guide_delta import GuideDelta
from ..infer.log_joint import check_callable
from ..infer.quadrature_elbo import take_saved_position
from .adapters import (
    _leaf,
    check_set_up,
    describe_auto_normal,
    scale_factor,
    site_mask,
    subsample_rows,
)
from .interface import GuideDescription, MeanFieldSite
from .rows import GivenRows, check_data_follow_rows, same_rows

__all__ = ["AutoMeanFieldNormal"]


def read_from_store(method: Callable) -> Callable:
    """Give a guide's ``PyroParam`` leaves the param store's tensors, then run its summary
    ``method``.

    A ``PyroModule`` takes the store's tensor for a ``PyroParam`` only when the parameter is read
    inside the module's Pyro context (while the guide runs); elsewhere it keeps the leaves of its
    last run. After ``pyro.get_param_store().set_state(...)`` (a checkpoint restored into a guide
    already run once, as the docs' recipe does) ``median()`` and ``quantiles()`` returned the
    values from before the restore. Each ``PyroParam`` is read here in that context, as a run
    would read it.
    """

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        store = pyro.get_param_store()
        with self._pyro_context:
            for part in self.modules():
                for name in part.__dict__.get("_pyro_params", ()):
                    if part._pyro_get_fullname(name) in store:  # else: nothing to take
                        getattr(part, name)
        return method(self, *args, **kwargs)

    return wrapped


class RunStamp(NamedTuple):
    """Which Python run of an `AutoMeanFieldNormal` recorded its minibatch (``_last_run``).

    Attributes:
        number: the run's place in one sequence shared by every such guide of the process, so
            two runs (of one guide or of two) never share a number within a process.
        grad: whether gradients were on (off: ``Predictive``, ``SVI.evaluate_loss``): a run
            without them cannot be the one whose gradients an optimizer reads.
    """

    number: int
    grad: bool


_RUN_NUMBERS = itertools.count(1)


class _KeepDensity(Messenger):
    """Samples a guide's own sites through `GuideDelta` in place of Pyro's ``Delta`` (the same
    value and density), so that ``TraceMeanField_ELBO`` counts a constrained site's change of
    variables. The model's sites in the guide's set-up run are left as they are."""

    def __init__(self, guide: AutoNormal) -> None:
        super().__init__()
        self.guide = guide

    def _pyro_sample(self, msg: dict) -> None:
        fn = msg["fn"]
        if type(fn) is dist.Delta and msg["name"] in self.guide._event_dims:
            msg["fn"] = GuideDelta(fn.v, log_density=fn.log_density, event_dim=fn.event_dim)


class AutoMeanFieldNormal(AutoNormal):
    """A Gaussian mean field over the unconstrained latents: one ``(loc, scale)`` pair per site.

    ``q(z) = prod_site N(z_site | loc_site, diag(scale_site^2))`` in Pyro's unconstrained space,
    pushed through ``biject_to(support)`` for constrained sites, exactly like Pyro's
    `AutoNormal`, from which it inherits ``Predictive`` support,
    ``median()``, ``quantiles()``, plates, subsampling (a local latent's parameters have the full
    plate size and each run uses the rows of its minibatch) and ``PyroModule`` models.

    In addition it remembers the minibatch of its last run (the rows and scale of each subsampled
    site; plain tensors, so the guide pickles and deep-copies like ``AutoNormal``), so that
    `quadrature_description` tells QNVB which rows to update and which minibatch scale to
    remove even under Pyro's own ELBOs (rasp paper, eq. 4-8). Each run is stamped: Pyro's
    ``JitTrace_ELBO`` replays the traced guide without running it in Python, and QNVB refuses
    rows no run of this step recorded.

    Args:
        model: a Pyro model with continuous latent sites.
        init_loc_fn: per-site initialization of the loc (in the constrained space), as in Pyro.
            The loc is the guide's own copy: the tensors of ``init_to_value(values=d)`` stay as
            they are (Pyro's ``AutoNormal`` fits a real site's tensor of ``d`` in place). A
            callable, as in Pyro: ``None`` or a name (``"median"``) is refused here, naming
            ``init_to_median``.
        init_scale: initial standard deviation in the unconstrained space.
        create_plates: as in Pyro's AutoGuides, to subsample local latents.
    """

    def __init__(
        self,
        model: Callable,
        *,
        init_loc_fn: Callable = init_to_feasible,
        init_scale: float = 0.1,
        create_plates: Callable | None = None,
    ):
        check_callable(
            "AutoMeanFieldNormal",
            "init_loc_fn",
            init_loc_fn,
            "a callable of a site, as in Pyro's AutoGuides (e.g. init_loc_fn=pyro.infer."
            "autoguide.init_to_median, not 'median')",
        )
        super().__init__(
            model,
            init_loc_fn=init_loc_fn,
            init_scale=_check_init_scale(init_scale),
            create_plates=create_plates,
        )
        # site -> (scale factor, rows, mask) of the last run (site_run)
        self._last_run: dict[str, tuple] | None = None
        self._last_run_stamp: RunStamp | None = None
        # a local-mode checkpoint holds QuadratureELBO's sequence position: a new guide set up by
        # one call (not yet met by the ELBO) takes it instead of refusing the key
        self.register_load_state_dict_pre_hook(take_saved_position)

    def __getstate__(self):
        # Pyro's AutoGuide drops its model reference from the pickle by clearing it on the guide
        # itself, which breaks a guide pickled before its first run; keep the original whole.
        model, master = self._model, self.master
        state = super().__getstate__()
        self._model, self.master = model, master
        return state

    def _setup_prototype(self, *args, **kwargs) -> None:
        # Pyro's set-up, with the model run inside GivenRows (inside the block that hides the
        # plates' subsample sites from the prototype): the plates the model gives their rows
        given = GivenRows()
        model = self._model
        if model is None:  # Pyro's __getstate__ left it out of the copy (see above)
            raise RuntimeError(
                f"{type(self).__name__}: this guide is a copy (copy.deepcopy, pickle, torch.save) "
                "made before the guide's first run, and Pyro's AutoGuide leaves the model out of "
                "a copy, so the copy cannot set itself up. Run the guide once before copying it "
                "(guide(*args), or a first svi.step), or build a new guide from the model for "
                "each run"
            )
        self._model = (given(model[0]),)
        try:
            super()._setup_prototype(*args, **kwargs)
        finally:
            self._model = model
        self._given_rows = given.given
        # Pyro's AutoNormal makes the loc of a real-valued site from the initial value itself
        # (biject_to(real) is the identity): an init_to_value(values=d) tensor of the user's,
        # which the fit then updated in place. The guide's loc is its own copy.
        for name in self._event_dims:
            leaf = _leaf(self.locs, name)[0]
            initial = self.prototype_trace.nodes[name]["value"]
            if leaf.untyped_storage().data_ptr() == initial.untyped_storage().data_ptr():
                leaf.data = leaf.data.clone()

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        tracer = poutine.trace(self._draw)
        initial = _InitialParams() if self.prototype_trace is None else None
        try:
            if initial is None:
                result = tracer(*args, **kwargs)
            else:  # the set-up run: record the shape and dtype each parameter is made with
                with initial:
                    result = tracer(*args, **kwargs)
        except Exception as error:  # a restored tensor of another shape fails inside torch
            refusal = self._restored_refusal(tracer.trace)
            if refusal is not None:
                raise refusal from error
            raise
        finally:  # set by this run's set-up, for this run only (a failed run leaves none)
            given = self.__dict__.pop("_given_rows", None)
            if initial is not None:
                self._initial_params = initial.made
        trace = tracer.trace
        refusal = self._restored_refusal(trace)
        if refusal is not None:
            raise refusal
        self._last_run = {}
        plates = self.master().plates if self.master is not None else None  # a list's part
        if given:
            self._check_rows(given, trace, plates, args, kwargs)
        for name in self._event_dims:
            aux = trace.nodes[name + "_unconstrained"]
            rows = subsample_rows(aux, trace, self._event_dims[name], plates)
            self._last_run[name] = (scale_factor(aux), rows, site_mask(aux))
        self._last_run_stamp = RunStamp(next(_RUN_NUMBERS), torch.is_grad_enabled())
        return result

    def _apply(self, fn: Callable, *args, **kwargs):
        """``nn.Module``'s conversion of every tensor by ``fn`` (``.double()``, ``.to(dtype)``),
        with the record of the parameters' set-up dtypes (`_restored_refusal`) converted by the
        same ``fn``: a guide the user converts reads parameters of the new dtype."""
        result = super()._apply(fn, *args, **kwargs)
        made = self.__dict__.get("_initial_params")
        if made:
            self._initial_params = {
                name: (shape, fn(torch.empty(0, dtype=dtype)).dtype)
                for name, (shape, dtype) in made.items()
            }
        return result

    def _restored_refusal(self, trace: Trace) -> ValueError | None:
        """The refusal of a run that read a parameter whose shape or dtype is not the one the
        guide's set-up made it with, naming the site, both shapes and dtypes and the cause (the
        param store holds a checkpoint of another model or guide); ``None`` if none. A shape
        comparison per parameter read, no read of the values."""
        made = self.__dict__.get("_initial_params")  # (a guide pickled before the record: none)
        if not made:
            return None
        for name, (shape, dtype) in made.items():
            node = trace.nodes.get(name)
            if node is None or node["type"] != "param":
                continue
            value = node["value"]
            if value.shape != shape or value.dtype != dtype:
                return ValueError(self._restored_message(name, value, shape, dtype))
        return None

    def _restored_message(
        self, name: str, value: torch.Tensor, shape: torch.Size, dtype: torch.dtype
    ) -> str:
        """Why the parameter ``name`` of the store cannot be this guide's, and the way out."""
        sites = [site for site in self._event_dims if name.endswith(f".{site}")]
        site = max(sites, key=len) if sites else None
        message = (
            f"{type(self).__name__}: the param store holds {name!r}"
            + (f" (site {site!r})" if site is not None else "")
            + f" with shape {tuple(value.shape)} and {value.dtype}, but the guide set "
            f"{'the site' if site is not None else 'it'} up with shape {tuple(shape)} and "
            f"{dtype}: the store holds a checkpoint of another model or guide (restored by "
            "set_state, load or set_weights_only_state), or a parameter of another model built "
            "under the same name. Restore a checkpoint saved from this model and guide, or call "
            "pyro.clear_param_store() before building this one"
        )
        if value.shape == shape:
            message += (
                f". To resume a fit saved in {value.dtype} in {dtype}, convert the checkpoint's "
                f"parameters before restoring it ({{name: t.to({dtype}) ...}}), or build the "
                f"model in {value.dtype}"
            )
        return message

    def _check_rows(
        self,
        given: dict[str, tuple[int, object]],
        trace: Trace,
        plates: dict | None,
        args: tuple,
        kwargs: dict,
    ) -> None:
        """Refuse, on the set-up run, a plate around a local latent whose rows the model gave
        (``subsample=idx``) and whose rows in the guide's own plate are others (no
        ``create_plates``, or one that draws), unless the model's data follow the plate's rows:
        the ELBO would replay the guide's rows into the model (`check_data_follow_rows`). A
        part of an ``AutoGuideList`` names the list, which makes the plates and takes
        ``create_plates``."""
        owner = self.master() if self.master is not None else self
        for name, (full_size, rows) in given.items():
            if name not in self._prototype_frames:
                continue  # a plate of observed sites only: not in the guide
            node = trace.nodes.get(name)
            own = node["value"] if node is not None else plates[name].indices
            if not same_rows(rows, own):
                check_data_follow_rows(
                    self.model, args, kwargs, trace, name, full_size, rows, own, owner
                )

    @read_from_store
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Pyro's ``AutoNormal.median``, after a check that the guide has run; of the param
        store's values (a restored store's too)."""
        check_set_up(self)
        return super().median(*args, **kwargs)

    @read_from_store
    def quantiles(
        self, quantiles: Sequence[float] | torch.Tensor, *args, **kwargs
    ) -> dict[str, torch.Tensor]:
        """Pyro's ``AutoNormal.quantiles``, after checks that the guide has run and that the
        probabilities lie in ``[0, 1]``; of the param store's values."""
        check_set_up(self)
        check_probabilities(quantiles)
        return super().quantiles(quantiles, *args, **kwargs)

    def _draw(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """One draw of every latent site (Pyro's ``AutoNormal``, each site's ``Delta`` a
        `GuideDelta`); subclasses change the family."""
        with _KeepDensity(self):
            return AutoNormal.forward(self, *args, **kwargs)

    def quadrature_description(self, trace: Trace | None = None) -> GuideDescription:
        """The guide's ``"gaussian"`` sites: of the run in ``trace``, else of its last run.

        Raises:
            RuntimeError: if the guide has not been run yet.
        """
        return describe_auto_normal(self, trace, self._last_run)

    @read_from_store
    def mean_field_sites(self) -> list[MeanFieldSite]:
        """The sites of `quadrature_description`: the param store's current parameters,
        the last run's rows."""
        return self.quadrature_description().sites


class _InitialParams(Messenger):
    """Records, during a guide's set-up, the shape and dtype of the initial value of each
    ``pyro.param`` made with one (``made``): the parameters as the guide makes them for this
    model, whatever a restored param store holds under their names."""

    def __init__(self):
        super().__init__()
        self.made: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def _pyro_param(self, msg: dict) -> None:
        if len(msg["args"]) > 1 and isinstance(msg["args"][1], torch.Tensor):
            self.made[msg["name"]] = (msg["args"][1].shape, msg["args"][1].dtype)


def last_run_stamp(guide: object) -> RunStamp | None:
    """The stamp of the Python run whose minibatch ``guide`` recorded (an
    `AutoMeanFieldNormal`, subclasses included, that has run); ``None`` for any other
    guide."""
    if not isinstance(guide, AutoMeanFieldNormal):
        return None
    return getattr(guide, "_last_run_stamp", None)  # a guide pickled before stamps: None


def _check_init_scale(init_scale: object) -> float:
    """``init_scale`` as a float: a finite number > 0 (a 0-d tensor too), or a clear error."""
    number = isinstance(init_scale, numbers.Real) and not isinstance(init_scale, bool)
    tensor = isinstance(init_scale, torch.Tensor) and init_scale.numel() == 1
    value = float(init_scale) if number or tensor else math.nan  # numpy numbers are Real
    if not (0 < value < math.inf):
        raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
    return value


def check_probabilities(quantiles: object) -> None:
    """Refuse quantile probabilities outside ``[0, 1]`` (they would give NaN or infinity)."""
    probs = torch.as_tensor(quantiles, dtype=torch.float64)
    if not bool(((probs >= 0) & (probs <= 1)).all()):
        raise ValueError(f"quantiles must be probabilities in [0, 1], got {quantiles!r}")
