"""``DistributedQuadratureELBO``: ``QuadratureELBO`` shared across ranks, by data or by nodes.

The loss is (1) of :mod:`pyro_quadvi.infer.quadrature_elbo`, the quadrature estimate of the
negative ELBO (rasp paper, eq. 9 and 13). Every rank draws the same quadrature of the step (same
sequence position, same random state; the nodes are checked across ranks when ``check_nodes``).
What a rank evaluates depends on the mode:

* ``parallel="data"``: all ``K`` nodes, on the rank's shard of the minibatch. With the model's
  data plate scaled by ``N / B_r`` (its own rows ``B_r``), rank ``r``'s loss ``L_r`` is an
  estimate of the whole loss and the weighted mean ``sum_r (B_r / B) L_r`` with ``B = sum_r B_r``
  is the full-batch loss (1) of :mod:`pyro_quadvi.infer.quadrature_elbo`: prior and entropy are
  the same on every rank, and the likelihood terms add up to ``N / B`` times the batch's.
* ``parallel="nodes"``: nodes ``r, r + W, r + 2 W, ...`` on the whole minibatch. Rank ``r`` forms
  ``L_r = -W sum_{k = r mod W} w_k log p(x, z_k) - H[q]``, so that the mean over ranks is (1).

In both modes the mean over ranks of the losses, of their gradients and of the moments ``g``, ``h``
they publish is the single-process value: :class:`~pyro_quadvi.distributed.DistributedOptimizer`
averages gradients and moments, and :meth:`loss_and_grads` reports the averaged loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..infer import QuadratureELBO
from ..quadrature import QuadratureRule
from .comm import check_agreement, collective_device, node_fingerprint, world

__all__ = ["PARALLEL_MODES", "DistributedQuadratureELBO"]

PARALLEL_MODES = ("data", "nodes")
"""How ranks share a step: shards of the minibatch, or subsets of the nodes."""


class DistributedQuadratureELBO(QuadratureELBO):
    """:class:`~pyro_quadvi.infer.QuadratureELBO` on ``torch.distributed``, data- or node-parallel.

    Args:
        rule, num_points, vectorize, max_plate_nesting, generator, name: as for
            :class:`~pyro_quadvi.infer.QuadratureELBO`; ``generator`` (or torch's global
            generator) must hold the same state on every rank
            (:func:`~pyro_quadvi.distributed.broadcast_generator`).
        parallel: ``"data"`` (each rank passes its shard of the minibatch to ``svi.step``) or
            ``"nodes"`` (each rank passes the whole minibatch and evaluates every ``W``-th node).
        check_nodes: compare a fingerprint of the step's nodes and weights across ranks every step
            (one small all-reduce) and raise on every rank if they differ.
        group: the process group (``None``: the default group).

    Attributes:
        share: with ``parallel="data"``, this rank's fraction ``B_r / B`` of the minibatch's rows;
            ``None`` (default) means equal shards, ``1 / W``. Set it before each step when shards
            differ in size (the remainder of a batch that ``W`` does not divide).

    Use it with :class:`~pyro_quadvi.distributed.DistributedOptimizer` around ``QNVB`` (or any
    ``PyroOptim``). Without an initialized process group it is a ``QuadratureELBO`` of one rank.
    """

    def __init__(
        self,
        rule: str | QuadratureRule = "blocked_simplex",
        num_points: int | None = None,
        vectorize: bool | None = None,
        max_plate_nesting: float = float("inf"),
        generator: torch.Generator | None = None,
        name: str | None = None,
        *,
        parallel: str = "data",
        check_nodes: bool = True,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__(rule, num_points, vectorize, max_plate_nesting, generator, name)
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        if not isinstance(check_nodes, bool):
            raise TypeError(f"check_nodes must be True or False, got {check_nodes!r}")
        self.parallel = parallel
        self.check_nodes = check_nodes
        self.group = group
        self.share: float | None = None

    def _factor(self) -> float:
        """What this rank's loss is multiplied by so that the plain mean over ranks is right."""
        _, size = world(self.group)
        share = self.share
        if share is not None and self.parallel == "nodes":
            raise ValueError(
                "DistributedQuadratureELBO.share is the rank's fraction of the rows in "
                "parallel='data'; with parallel='nodes' every rank has all rows: leave it None"
            )
        if share is None:
            return 1.0
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ValueError(
                f"DistributedQuadratureELBO.share must be a number in (0, 1] (this rank's rows / "
                f"the batch's rows), or None for equal shards; got {share!r}"
            )
        return size * float(share)

    def local_nodes(
        self, x: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's nodes and weights (all of them, or every ``W``-th times ``W``).

        Raises:
            RuntimeError: on every rank, when the ranks drew different nodes (``check_nodes``).
            ValueError: in node mode, when there are fewer nodes than ranks.
        """
        rank, size = world(self.group)
        if size == 1:
            return x, weights
        if self.check_nodes:
            check_agreement(node_fingerprint(x, weights), "the quadrature nodes", self.group)
        if self.parallel == "data":
            return x, weights
        if x.shape[0] < size:
            raise ValueError(
                f"DistributedQuadratureELBO(parallel='nodes'): the rule has {x.shape[0]} nodes "
                f"for {size} ranks; use at least as many nodes as ranks (num_points) or "
                "parallel='data'"
            )
        return x[rank::size], weights[rank::size] * size

    def _mean(self, value: float, device: torch.device) -> float:
        _, size = world(self.group)
        if size == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=self.group)
        return (total / size).item()

    def differentiable_loss(self, model: Callable, guide: Callable, *args, **kwargs):
        """This rank's term ``L_r`` (differentiable); the mean over ranks is the negative ELBO."""
        loss = super().differentiable_loss(model, guide, *args, **kwargs)
        factor = self._factor()
        return loss if factor == 1.0 else loss * factor

    def loss(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """The negative ELBO (the mean over ranks), without gradients; a collective call."""
        value = super().loss(model, guide, *args, **kwargs) * self._factor()
        return self._mean(value, collective_device(self.group))

    def loss_and_grads(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """Accumulate this rank's gradients; return the negative ELBO (mean over ranks)."""
        value = super().loss_and_grads(model, guide, *args, **kwargs)
        return self._mean(value, collective_device(self.group))

    def __repr__(self) -> str:
        return (
            f"DistributedQuadratureELBO(rule={self.rule!r}, vectorize={self.vectorize}, "
            f"parallel={self.parallel!r})"
        )
