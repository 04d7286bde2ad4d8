"""``DistributedOptimizer``: any ``PyroOptim`` (``QNVB`` above all) stepping on averaged inputs.

In the spirit of Pyro's ``HorovodOptimizer``, on ``torch.distributed``: before the wrapped
optimizer steps, the gradients of the parameters ``SVI`` hands it and the moments ``g``, ``h`` that
``QuadratureELBO`` published for them (:func:`~pyro_quadvi.guides.interface.published_moments`)
are replaced by their means over the ranks. With
:class:`~pyro_quadvi.distributed.DistributedQuadratureELBO` those means are the single-process
values (its module docstring says why), so every rank takes the same step.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import pyro
import torch
import torch.distributed as dist
from pyro.optim import PyroOptim

from ..guides.interface import PublishedMoments, publish_moments, published_moments
from .comm import all_reduce_mean_, check_agreement, world

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(PyroOptim):
    """Average gradients and published moments over the ranks, then step ``optim``.

    Args:
        optim: a ``QNVB`` or any ``pyro.optim`` optimizer.
        group: the process group (``None``: the default group).

    Each step makes three all-reduces: one that checks that every rank received the same
    parameters (their number and names), one of two flags per parameter (has a gradient, has
    published moments), and one fused sum per dtype of every gradient and moment. A parameter
    without a gradient on some rank (its shard did not touch it) counts as a zero gradient there;
    moments must be published on all ranks or none (they are, when every rank runs the same model
    and guide).

    Attribute look-ups it does not know go to ``optim`` (``num_steps``, ``anneal``, ...);
    ``get_state`` / ``set_state`` (and ``save`` / ``load``) are ``optim``'s: every rank holds the
    same state, so rank 0 saves it (:func:`~pyro_quadvi.distributed.save_checkpoint`).

    Raises (on every rank together):
        RuntimeError: when the ranks received different parameters or disagree on which
            parameters have moments.
        ValueError: for a block of a subsampled plate (local latents) with moments: its rows
            differ between ranks, which a mean cannot combine.
    """

    def __init__(self, optim: PyroOptim, *, group: dist.ProcessGroup | None = None):
        if not isinstance(optim, PyroOptim):
            raise TypeError(
                "DistributedOptimizer wraps a pyro.optim optimizer (QNVB(), pyro.optim.Adam(...)), "
                f"got {type(optim).__name__}"
            )
        # PyroOptim.__init__ is not called: every PyroOptim attribute is optim's (__getattr__)
        self.optim = optim
        self.group = group

    def __getattr__(self, name: str):
        if name in ("optim", "group"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optim, name)

    def __call__(self, params: Iterable[torch.Tensor], *args, **kwargs) -> None:
        """Average the gradients and moments of ``params`` over the ranks; step the optimizer."""
        params = list(params)
        if world(self.group)[1] > 1 and params:
            self._reduce(params)
        self.optim(params, *args, **kwargs)

    @torch.no_grad()
    def _reduce(self, params: list[torch.Tensor]) -> None:
        store = pyro.get_param_store()
        named = sorted(((store.param_name(p) or "", p) for p in params), key=lambda n: n[0])
        device = params[0].device
        names = "\n".join(name for name, _ in named).encode()
        check_agreement(
            torch.tensor([len(named), zlib.crc32(names)], dtype=torch.float64, device=device),
            "the parameters to update (their number and names)",
            self.group,
        )
        moments = [published_moments(p) for _, p in named]
        flags = torch.tensor(
            [[p.grad is not None, m is not None] for (_, p), m in zip(named, moments)],
            dtype=torch.int64,
            device=device,
        ).reshape(-1, 2)
        both = torch.cat([flags, -flags], dim=1)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        any_grad, any_moments, all_moments = both[:, 0], both[:, 1], -both[:, 3]
        mixed = (any_moments != all_moments).nonzero()
        if mixed.numel():
            raise RuntimeError(
                f"DistributedOptimizer: QuadratureELBO published moments for "
                f"{named[int(mixed[0])][0]!r} on some ranks only; every rank must run the same "
                "model and guide with the same ELBO"
            )
        tensors = []
        for (_, p), has_grad in zip(named, any_grad.tolist()):
            if has_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                tensors.append(p.grad)
        for m in moments:
            if m is None:
                continue
            if m.site.rows:
                raise ValueError(
                    f"DistributedOptimizer: site {m.site.name!r} lies in a subsampled plate (a "
                    "local latent): each rank updates different rows of it, which averaging "
                    "cannot combine; keep local latents out of data-parallel runs (or fit them "
                    "in one process)"
                )
            tensors += [m.g, m.h]
        all_reduce_mean_(tensors, self.group)
        for m in moments:
            if m is not None:
                publish_moments(PublishedMoments(m.site, m.g, m.h, m.version))

    def get_state(self) -> dict:
        """The wrapped optimizer's state (the same on every rank)."""
        return self.optim.get_state()

    def set_state(self, state_dict: dict) -> None:
        """Restore the wrapped optimizer's state."""
        self.optim.set_state(state_dict)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optim!r})"
