"""Conversion of labelled draws to an ArviZ 0.x ``InferenceData``.

All that depends on ArviZ 0.x lives here; an ArviZ 1.x (``DataTree``) conversion of the same
labelled groups would sit beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import pyro

from .labels import Variable

if TYPE_CHECKING:
    from arviz import InferenceData

__all__ = ["to_inference_data_v0"]


def to_inference_data_v0(
    groups: Mapping[str, Mapping[str, Variable]],
    coords: Mapping[str, np.ndarray],
    attrs: Mapping[str, str | int],
) -> InferenceData:
    """An ``arviz.InferenceData`` with one ``xarray.Dataset`` per group.

    Each group is converted on its own (``arviz.dict_to_dataset``) so that a variable may have
    different dims in different groups: an observed site with event dims has them in
    ``posterior_predictive`` but not in ``log_likelihood``. ``observed_data`` is built with xarray
    directly: ``dict_to_dataset`` turns a 0-d array into shape ``(1,)``, and a scalar observation
    stays 0-d, as its draws in ``posterior_predictive`` are.
    """
    import arviz as az

    datasets = {}
    for group, variables in groups.items():
        if group == "observed_data":
            datasets[group] = _observed_dataset(variables, coords, attrs)
            continue
        datasets[group] = az.dict_to_dataset(
            {name: variable.values for name, variable in variables.items()},
            attrs=dict(attrs),
            library=pyro,
            coords=dict(coords),
            dims={name: variable.dims for name, variable in variables.items()},
        )
    return az.InferenceData(**datasets)


def _observed_dataset(
    variables: Mapping[str, Variable],
    coords: Mapping[str, np.ndarray],
    attrs: Mapping[str, str | int],
):
    """The ``observed_data`` group: each variable with its own dims (none for a scalar), the
    given coordinates, and ``0..n-1`` for a dim without any (as ``dict_to_dataset`` gives)."""
    import xarray as xr
    from arviz.data.base import make_attrs

    arrays = {}
    for name, variable in variables.items():
        dim_coords = {
            dim: coords[dim] if dim in coords else np.arange(size)
            for dim, size in zip(variable.dims, variable.values.shape, strict=True)
        }
        arrays[name] = xr.DataArray(variable.values, dims=variable.dims, coords=dim_coords)
    return xr.Dataset(arrays, attrs=make_attrs(dict(attrs), library=pyro))
