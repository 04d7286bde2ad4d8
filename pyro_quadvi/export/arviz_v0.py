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
    ``posterior_predictive`` but not in ``log_likelihood``.
    """
    import arviz as az

    datasets = {}
    for group, variables in groups.items():
        datasets[group] = az.dict_to_dataset(
            {name: variable.values for name, variable in variables.items()},
            attrs=dict(attrs),
            library=pyro,
            coords=dict(coords),
            dims={name: variable.dims for name, variable in variables.items()},
            default_dims=[] if group == "observed_data" else None,
        )
    return az.InferenceData(**datasets)
