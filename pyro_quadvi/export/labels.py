"""Named dimensions and coordinates for exported draws (independent of the ArviZ version).

A dim of a site is named after the model's plate that indexes it (a site inside
``pyro.plate("school", 8)`` gets the dim ``"school"``, with coordinates ``0..7``). A batch dim of
size 1 that no plate indexes is the padding Pyro adds to line a site up with deeper plates (as in
``Predictive``): it is removed. Any other dim (event dims, batch dims outside plates) gets a
generic name ``{site}_dim_{k}``, numbered from 0 per site.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .draws import Draws, SiteSpec

__all__ = ["GROUPS", "Variable", "label"]

GROUPS = (
    "posterior",
    "posterior_predictive",
    "log_likelihood",
    "observed_data",
    "prior",
    "prior_predictive",
)


@dataclass
class Variable:
    """One exported variable: its values (``(chain, draw, *dims)``, or ``dims`` alone for observed
    data) and the names of its dims after chain and draw."""

    values: np.ndarray
    dims: list[str]


def site_dims(site: SiteSpec, full_sizes: Mapping[str, int]) -> list[str | None]:
    """Names of the dims of one draw of ``site`` over the full data (``None``: a dim to drop)."""
    shape = site.full_shape(full_sizes)
    frames = {dim: (plate, size) for plate, dim, size in site.frames}
    names: list[str | None] = []
    generic = 0
    for i, size in enumerate(shape):
        dim = i - site.batch_ndim  # negative for batch dims, as a plate's dim
        frame = frames.get(dim) if dim < 0 else None
        if frame is not None and frame[1] == size:
            names.append(frame[0])
        elif dim < 0 and size == 1:
            names.append(None)
        else:
            names.append(f"{site.name}_dim_{generic}")
            generic += 1
    return names


def _named(
    name: str,
    values: torch.Tensor,
    names: list[str | None],
    draw_axes: int,
    user_dims: Mapping[str, Sequence[str]],
) -> Variable:
    array = values.detach().cpu().numpy()
    drop = tuple(draw_axes + i for i, dim in enumerate(names) if dim is None)
    array = np.squeeze(array, axis=drop) if drop else array
    if draw_axes == 1:
        array = array[None]  # one chain
    dims = [dim for dim in names if dim is not None]
    if name in user_dims:
        given = list(user_dims[name])
        if len(given) < len(dims):
            raise ValueError(
                f"dims[{name!r}] names {len(given)} dims but the exported {name!r} has "
                f"{len(dims)} after chain and draw ({', '.join(dims)})"
            )
        dims = given[: len(dims)]  # a log likelihood takes the leading (batch) names
    return Variable(array, dims)


def label(
    draws: Draws,
    log_likelihood: bool = True,
    coords: Mapping[str, Sequence] | None = None,
    dims: Mapping[str, Sequence[str]] | None = None,
) -> tuple[dict[str, dict[str, Variable]], dict[str, np.ndarray]]:
    """The groups of ``draws`` as named variables, and the coordinates of their dims.

    Args:
        draws: the draws to export.
        log_likelihood: whether to include the ``log_likelihood`` group.
        coords: coordinates that replace or add to the plates' ``0..n-1``.
        dims: ``variable -> dim names`` that replace the names of the variable's dims (after chain
            and draw, and after singleton plate padding is removed); a log likelihood takes the
            leading names.

    Raises:
        ValueError: if ``dims`` names a variable the export does not have, too few dims, or more
            dims than the variable has (a log likelihood takes the leading names of its site's
            full dims, so only those count); if ``coords`` names a dim that no exported variable
            has (a misspelt plate name would otherwise be ignored).
    """
    user_dims = dict(dims or {})
    unknown = sorted(set(user_dims) - set(draws.sites))
    if unknown:
        raise ValueError(
            f"dims names {unknown}, which are not sites of the model; its sites are "
            f"{sorted(draws.sites)}"
        )
    for name, given in user_dims.items():
        full = [dim for dim in site_dims(draws.sites[name], draws.full_sizes) if dim is not None]
        if len(given) > len(full):
            raise ValueError(
                f"dims[{name!r}] names {len(given)} dims ({', '.join(map(str, given))}) but "
                f"the exported {name!r} has {len(full)} after chain and draw "
                f"({', '.join(full)}); drop {list(given[len(full) :])}"
            )
    groups: dict[str, dict[str, Variable]] = {}
    plate_sizes: dict[str, int] = {}
    for group in GROUPS:
        tensors = getattr(draws, group)
        if not tensors or (group == "log_likelihood" and not log_likelihood):
            continue
        variables = {}
        for name, values in tensors.items():
            site = draws.sites[name]
            names = site_dims(site, draws.full_sizes)
            if group == "log_likelihood":
                names = names[: site.batch_ndim]
            draw_axes = 0 if group == "observed_data" else 1
            variables[name] = _named(name, values, names, draw_axes, user_dims)
            for plate, _, size in site.frames:
                plate_sizes[plate] = size
        groups[group] = variables
    exported = {dim for variables in groups.values() for v in variables.values() for dim in v.dims}
    exported |= {"chain", "draw"}  # ArviZ's own dims, which a user may label too
    unknown = sorted(set(coords or {}) - exported)
    if unknown:
        raise ValueError(
            f"coords names {unknown}, which are not dims of any exported variable; the dims are "
            f"{sorted(exported)} (a plate's dim is the plate's name; rename others with dims=)"
        )
    all_coords = {plate: np.arange(size) for plate, size in plate_sizes.items()}
    all_coords.update({name: np.asarray(values) for name, values in (coords or {}).items()})
    return groups, all_coords
