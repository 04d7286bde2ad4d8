"""Plates whose rows the model picks itself, ``pyro.plate(name, N, subsample=idx)``.

Such a plate around a local latent needs the guide to use the same rows. An AutoGuide built
without ``create_plates`` makes its own plate ``pyro.plate(name, N, subsample_size=len(idx))``,
which draws random rows; the ELBO replays the guide's trace into the model, so the model's plate
takes the guide's rows while its data are still indexed by ``idx``: the posterior of row ``i`` is
fitted to another row's data, without any error (Pyro's ``Trace_ELBO`` does the same). A plate
that holds only observed sites is not in the guide, keeps the model's ``idx``, and is left alone.
A model that reads its data by the plate's own rows (``with pyro.plate(...) as ind``,
``obs=y[ind]``) takes the guide's rows with its data, and is right.

`GivenRows` sees, in a run of the model, which plates the model gave their rows and whether a
handler around the model (a replay of the guide's trace) replaced them; where it did,
`check_data_follow_rows` runs the model once more with its own rows to see whether its data
moved with them; `replaced_rows_message` says what happened and the ways out.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import pyro
import torch
from pyro import poutine
from pyro.poutine import Trace
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from ..infer.log_joint import cuda_devices, is_data_site

__all__ = [
    "GivenRows",
    "check_data_follow_rows",
    "replaced_rows_message",
    "same_rows",
]


class GivenRows(Messenger):
    """Records the rows a model gives its plates, and refuses a run where they were replaced
    while the model's data stayed at its own rows.

    Wrap the model itself, inside any replay: ``poutine.replay(GivenRows(guide, trace)(model),
    ...)``. The handler then sees each plate's subsample message before the replay does, so a
    value already set is the model's own ``subsample=`` (or a handler of the model's own); after
    the replay it compares that value with the rows the plate ends up with. Where they differ,
    the run is checked once more after it ends (`check_data_follow_rows`): a model that reads
    its data by the plate's rows (``with pyro.plate(..., subsample=idx) as ind``,
    ``obs=y[ind]``) fits each row to its own data, and is accepted.

    Args:
        guide: the guide, for the message (``None``: a run without a replay).
        guide_trace: the trace the replay around this handler replays (``None``: a run without
            a replay, which only records the rows given).
        follow: names of the plates whose data were found to follow their rows; the check adds
            to it, and skips them (the caller keeps it for one model).

    Attributes:
        given: plate name -> ``(full size, rows)`` for each plate the model gave its rows in the
            runs seen.
    """

    def __init__(
        self,
        guide: object | None = None,
        guide_trace: Trace | None = None,
        follow: set[str] | None = None,
    ):
        super().__init__()
        self.guide = guide
        self.guide_trace = guide_trace
        self.follow = set() if follow is None else follow
        self.given: dict[str, tuple[int, Sequence[int] | torch.Tensor]] = {}
        self._replaced: dict[str, torch.Tensor] = {}

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self._replaced = {}
            with self:
                result = fn(*args, **kwargs)
            for name, rows in self._replaced.items():
                full_size, given = self.given[name]
                check_data_follow_rows(
                    fn, args, kwargs, self.guide_trace, name, full_size, given, rows, self.guide
                )
                self.follow.add(name)
            return result

        return run

    def _pyro_sample(self, msg) -> None:
        if not isinstance(msg["fn"], _Subsample):
            return
        if msg["value"] is None:  # a plate that draws its rows (in this run)
            self.given.pop(msg["name"], None)
        else:
            self.given[msg["name"]] = (msg["fn"].size, msg["value"])

    def _pyro_post_sample(self, msg) -> None:
        name = msg["name"]
        given = self.given.get(name)
        if given is None or name in self.follow or not isinstance(msg["fn"], _Subsample):
            return
        if self.guide_trace is None:  # no replay: the rows are the model's (or its handlers')
            return
        if not same_rows(given[1], msg["value"]):
            self._replaced[name] = msg["value"]


def check_data_follow_rows(
    model: Callable,
    args: tuple,
    kwargs: dict,
    guide_trace: Trace,
    name: str,
    full_size: int,
    given: Sequence[int] | torch.Tensor,
    rows: torch.Tensor,
    guide: object | None,
) -> None:
    """Refuse a model whose plate ``name`` was given its rows (``subsample=given``) and took the
    guide's ``rows`` instead, if an observed site inside that plate keeps its values (and log
    density) when the plate's rows change: its data stay at ``given`` while its local latents
    are the guide's rows, and each row would be fitted to another row's data. Only sites that
    hold data count (`is_data_site`): a ``pyro.deterministic`` site, or the one a reparameterizer
    leaves, takes its values from the replayed latents, which do not move with the rows.

    The model runs with the latents of ``guide_trace`` replayed and the plate's rows set to
    ``rows``, to ``given``, and, for the sites that did not change, to ``rows`` shifted by half
    the plate (data equal at two sets of rows by chance), each run hidden from the handlers
    around it. A site whose values change with the rows reads its data by them (``as ind``).

    Equal values do not show that the data stayed put (a 0/1 outcome with few ones is all zeros
    at most sets of rows), so a site left unchanged by those three runs is decided by one more
    (`_follows_probed_rows`): the model with the plate's rows set to both sets of rows at once, a
    number of rows other than the model's.
    """

    def observed(plate_rows) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        replayed = guide_trace.copy()
        node = replayed.nodes.get(name, {"type": "sample", "name": name, "infer": {}})
        replayed.nodes[name] = {**node, "is_observed": False, "value": plate_rows}
        with poutine.block():
            trace = poutine.trace(poutine.replay(model, trace=replayed)).get_trace(*args, **kwargs)
        return {
            site: (node["value"], node["fn"].log_prob(node["value"]))
            for site, node in trace.nodes.items()
            if node["type"] == "sample"
            and is_data_site(node)
            and any(frame.name == name for frame in node["cond_indep_stack"])
        }

    def same(a, b) -> bool:
        return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))

    taken = observed(rows)
    own = observed(given)
    # a site seen only at the model's rows has changed with the rows
    unchanged = [site for site in own if site in taken and same(taken[site], own[site])]
    if unchanged:
        other = observed((torch.as_tensor(rows) + full_size // 2) % full_size)
        unchanged = [site for site in unchanged if site in other and same(taken[site], other[site])]
    if unchanged:
        ends = {site: (taken[site][0], own[site][0]) for site in unchanged}
        follow = _follows_probed_rows(model, args, kwargs, name, full_size, given, rows, ends)
        unchanged = [site for site in unchanged if site not in follow]
    if unchanged or not taken:
        raise ValueError(replaced_rows_message(name, full_size, len(given), guide, unchanged))


def _follows_probed_rows(
    model: Callable,
    args: tuple,
    kwargs: dict,
    name: str,
    full_size: int,
    given: Sequence[int] | torch.Tensor,
    rows: torch.Tensor,
    values: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> set[str]:
    """The observed sites among ``values`` (site -> its observed value at the guide's ``rows``
    and at the model's ``given`` rows) whose data follow the rows of plate ``name``.

    The model runs once with the plate's rows set to `_probe_rows`: the rows of both sets, in
    order, and one more where they are the same rows, or one fewer where they are all the
    plate's rows, so that their number is not the model's ``len(given)``. The guide's latents
    are not replayed (its local latents are at other rows): the model draws them from its
    priors, under a forked random state, with validation off, hidden from the handlers around
    it; a run that fails decides nothing. A site follows the rows iff its value there has an
    entry per probed row along the plate's dim and, at the places of the rows of ``rows`` and of
    ``given`` among them, equals its values at those rows. A model reading ``y[idx]`` gives
    ``len(idx)`` entries there, whatever its data. The run costs what a step's run of the model
    does at ``len(given) + len(rows)`` rows at most: at all ``full_size`` rows, as it ran before,
    it cost a pass over the whole data set, twice at the guide's set-up
    (`benchmarks/bench_rows_scale.py`).
    """
    device = torch.as_tensor(rows).device
    indices = [torch.as_tensor(index, device=device).long() for index in (rows, given)]
    probed = _probe_rows(*indices, len(given), full_size)
    plate_rows = Trace()
    plate_rows.add_node(name, type="sample", name=name, is_observed=False, infer={})
    plate_rows.nodes[name]["value"] = probed
    try:
        devices = cuda_devices(rows, args, kwargs)
        with poutine.block(), torch.random.fork_rng(devices), pyro.validation_enabled(False):
            trace = poutine.trace(poutine.replay(model, trace=plate_rows)).get_trace(
                *args, **kwargs
            )
    except Exception:  # a model that cannot take the probed rows shows nothing
        return set()
    # the rows of each set among the probed (all of them, unless the probe left one out) and
    # their places there
    kept = [torch.isin(index, probed).nonzero().squeeze(-1) for index in indices]
    places = [torch.searchsorted(probed, index[k]) for index, k in zip(indices, kept)]
    follow = set()
    for site, (at_rows, at_given) in values.items():
        node = trace.nodes.get(site)
        if node is None or node["type"] != "sample" or not is_data_site(node):
            continue
        frame = next((f for f in node["cond_indep_stack"] if f.name == name), None)
        if frame is None or frame.dim is None:
            continue
        value = torch.as_tensor(node["value"])
        dim = frame.dim - node["fn"].event_dim
        lowest = min(v.dim() for v in (value, at_rows, at_given))
        if lowest < -dim or value.shape[dim] != len(probed):
            continue
        picked = [value.index_select(dim, place.to(value.device)) for place in places]
        expected = [v.index_select(dim, k.to(v.device)) for v, k in zip((at_rows, at_given), kept)]
        if all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(picked, expected)):
            follow.add(site)
    return follow


def _probe_rows(rows: torch.Tensor, given: torch.Tensor, size: int, full_size: int) -> torch.Tensor:
    """The rows `_follows_probed_rows` gives the plate, in order: those of ``rows`` and ``given``,
    and, where they are ``size`` rows (the model's number: one set holds the other), the first
    row of the plate outside them, or, where there is none (the model's rows are all
    ``full_size`` rows, in some order), all of them but the last. Probed at ``size`` rows, data
    kept at the model's rows (``y[idx]``, ``size`` entries) would show as many entries as data
    that follow the plate's rows."""
    probed = torch.unique(torch.cat([rows, given]))
    if len(probed) == size and size < full_size:
        # (of the first size + 1 rows, one at least is not among the size probed)
        first = torch.arange(size + 1, device=probed.device)
        extra = first[~torch.isin(first, probed)][:1]
        probed = torch.unique(torch.cat([probed, extra]))
    elif len(probed) == size > 1:  # all the plate's rows: a strict subset of them
        probed = probed[:-1]
    return probed


def same_rows(a: Sequence[int] | torch.Tensor, b: Sequence[int] | torch.Tensor) -> bool:
    """Whether two plates' indices are the same rows in the same order: the same object (a
    guide's ``create_plates`` passing the model's tensor on), else equal values (read from the
    device only then)."""
    if a is b:
        return True
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and torch.equal(a, b.to(a.device))


def replaced_rows_message(
    name: str, full_size: int, size: int, guide: object, sites: Sequence[str] = ()
) -> str:
    """Why a plate whose rows the model gives (``size`` of ``full_size``) cannot take a guide's
    other rows while its observed ``sites`` keep the model's data (none: no observed site inside
    the plate shows that its data follow the rows), and the three ways out; a guide class that
    takes no ``create_plates`` (``AutoDiagonalNormal``) is pointed to ``AutoMeanFieldNormal``,
    which does."""
    cls = type(guide).__name__
    takes_plates = "create_plates" in inspect.signature(type(guide)).parameters
    build = cls if takes_plates else "AutoMeanFieldNormal"
    aside = "" if takes_plates else f" ({cls} takes no create_plates)"
    kept = (
        f"its observed sites {', '.join(map(repr, sites))} keep the same data with the guide's "
        "rows as with the model's"
        if sites
        else "no observed site inside it reads its data by the plate's rows"
    )
    return (
        f"plate {name!r}: the model picks its rows, pyro.plate({name!r}, {full_size}, "
        f"subsample=...) with {size} of {full_size}, but the guide ({cls}) uses other rows "
        f"in its own plate {name!r}, and the model's plate takes the guide's rows while {kept}: "
        "each row's local latents would be fitted to another row's data. "
        "An AutoGuide draws random rows for a subsampled plate unless create_plates gives it "
        f"the model's plate: build the guide as {build}(model, create_plates=lambda *args, "
        f"**kwargs: pyro.plate({name!r}, {full_size}, subsample=idx)){aside}, with idx the rows "
        "the model takes from those same arguments (the model's plate: same name, size and "
        f"dim), or let the model's plate draw its rows, pyro.plate({name!r}, {full_size}, "
        f"subsample_size={size}), or read the data by the plate's rows, with "
        f"pyro.plate({name!r}, {full_size}, subsample=idx) as rows: ... obs=y[rows]"
    )
