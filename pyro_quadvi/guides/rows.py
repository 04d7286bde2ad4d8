"""Plates whose rows the model picks itself, ``pyro.plate(name, N, subsample=idx)``.

Such a plate around a local latent needs the guide to use the same rows. An AutoGuide built
without ``create_plates`` makes its own plate ``pyro.plate(name, N, subsample_size=len(idx))``,
which draws random rows; the ELBO replays the guide's trace into the model, so the model's plate
takes the guide's rows while its data are still indexed by ``idx``: the posterior of row ``i`` is
fitted to another row's data, without any error (Pyro's ``Trace_ELBO`` does the same). A plate
that holds only observed sites is not in the guide, keeps the model's ``idx``, and is left alone.

`GivenRows` sees, in a run of the model, which plates the model gave their rows and whether a
handler around the model (a replay of the guide's trace) replaced them; `replaced_rows_message`
says what happened and the two ways out.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

__all__ = ["GivenRows", "replaced_rows_message", "same_rows"]


class GivenRows(Messenger):
    """Records the rows a model gives its plates, and refuses a run where they were replaced.

    Wrap the model itself, inside any replay: ``poutine.replay(GivenRows(guide)(model), ...)``.
    The handler then sees each plate's subsample message before the replay does, so a value
    already set is the model's own ``subsample=`` (or a handler of the model's own); after the
    replay it compares that value with the rows the plate ends up with.

    Args:
        guide: the guide, for the message (``None``: a run without a replay).

    Attributes:
        given: plate name -> ``(full size, rows)`` for each plate the model gave its rows in the
            runs seen.
    """

    def __init__(self, guide: object | None = None):
        super().__init__()
        self.guide = guide
        self.given: dict[str, tuple[int, Sequence[int] | torch.Tensor]] = {}

    def _pyro_sample(self, msg) -> None:
        if not isinstance(msg["fn"], _Subsample):
            return
        if msg["value"] is None:  # a plate that draws its rows (in this run)
            self.given.pop(msg["name"], None)
        else:
            self.given[msg["name"]] = (msg["fn"].size, msg["value"])

    def _pyro_post_sample(self, msg) -> None:
        given = self.given.get(msg["name"])
        if given is None or not isinstance(msg["fn"], _Subsample):
            return
        full_size, rows = given
        if not same_rows(rows, msg["value"]):
            raise ValueError(replaced_rows_message(msg["name"], full_size, len(rows), self.guide))


def same_rows(a: Sequence[int] | torch.Tensor, b: Sequence[int] | torch.Tensor) -> bool:
    """Whether two plates' indices are the same rows in the same order: the same object (a
    guide's ``create_plates`` passing the model's tensor on), else equal values (read from the
    device only then)."""
    if a is b:
        return True
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and torch.equal(a, b.to(a.device))


def replaced_rows_message(name: str, full_size: int, size: int, guide: object | None) -> str:
    """Why a plate whose rows the model gives (``size`` of ``full_size``) cannot take a guide's
    other rows, and the two ways out; a guide class that takes no ``create_plates``
    (``AutoDiagonalNormal``) is pointed to ``AutoMeanFieldNormal``, which does."""
    cls = type(guide).__name__ if guide is not None else "AutoNormal"
    takes_plates = guide is None or "create_plates" in inspect.signature(type(guide)).parameters
    build = cls if takes_plates else "AutoMeanFieldNormal"
    aside = "" if takes_plates else f" ({cls} takes no create_plates)"
    return (
        f"plate {name!r}: the model picks its rows, pyro.plate({name!r}, {full_size}, "
        f"subsample=...) with {size} of {full_size}, but the guide ({cls}) uses other rows "
        f"in its own plate {name!r}, and the model's plate takes the guide's rows while its data "
        "keep the model's: each row's local latents would be fitted to another row's data. "
        "An AutoGuide draws random rows for a subsampled plate unless create_plates gives it "
        f"the model's plate: build the guide as {build}(model, create_plates=lambda *args, "
        f"**kwargs: pyro.plate({name!r}, {full_size}, subsample=idx)){aside}, with idx the rows "
        "the model takes from those same arguments (the model's plate: same name, size and "
        f"dim), or let the model's plate draw its rows, pyro.plate({name!r}, {full_size}, "
        f"subsample_size={size})"
    )
