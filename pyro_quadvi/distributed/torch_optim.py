"""``NodeParallelQNVBOptimizer``: the plain-torch ``QNVBOptimizer`` with each step's nodes divided
between the ranks.

Rank ``r`` of ``W`` evaluates nodes ``S_r = {r, r + W, r + 2 W, ...}`` of the step's quadrature on
the whole minibatch (closure loop or one pass) and forms its part of the weighted sums of rasp
paper eq. 11,

    L_r = sum_{k in S_r} w_k loss_k,   g_r = sum_{k in S_r} w_k grad_k,
    gx_r = sum_{k in S_r} w_k grad_k x_k;

one all-reduce adds them up, ``g = sum_r g_r`` and ``h = sum_r gx_r / sigma``, the moments of all
``K`` nodes, and every rank applies the same QNVB update (eq. 4-8) to the same bits.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..optim import QNVBOptimizer
from ..optim.torch_qnvb import LossFunction, data_moments
from ..quadrature import NodeSet
from .comm import (
    MODEL_FIX,
    SEED_FIX,
    all_reduce_sum_,
    arguments_section,
    broadcast_generator,
    check_sections,
    differing_setting,
    gather_rows,
    global_rank,
    host_values,
    node_sections,
    projections,
    raise_together,
    refuse_disagreement,
    same_world,
    settings_fingerprint,
    world,
)

__all__ = ["NodeParallelQNVBOptimizer"]

STATE_FIX = (
    "every rank must hold the same parameters and optimizer state: change them on every rank "
    "alike (net.load_state_dict and optimizer.load_state_dict on every rank), or before "
    "building the optimizer, whose constructor gives every rank rank 0's parameters; nothing "
    "was evaluated or changed by this step"
)
SETTINGS_FIX = (
    "every rank must build NodeParallelQNVBOptimizer with the same settings (keyword arguments, "
    "parameter groups) and change them alike (a scheduler on every rank, or none); nothing was "
    "evaluated or changed by this step"
)


class _NodeShare(NodeSet):
    """Nodes ``rank, rank + size, ...`` of ``nodes``, with their weights as in the full rule."""

    def __init__(self, nodes: NodeSet, rank: int, size: int):
        super().__init__(
            nodes.dim, nodes.weights[rank::size], name=nodes.name, max_bytes=nodes.max_bytes
        )
        self.nodes = nodes
        self.rank = rank
        self.size = size

    def node(self, k: int) -> torch.Tensor:
        return self.nodes.node(self.rank + self.size * self._check_index(k))


class NodeParallelQNVBOptimizer(QNVBOptimizer):
    """`QNVBOptimizer` whose nodes are divided between the ranks.

    Every rank passes the **whole** minibatch to `step` (a closure, or ``loss_fn`` and
    ``batch``); rank ``r`` evaluates nodes ``r, r + W, ...`` of the step. The weighted sums of the
    loss, of the gradients and of the gradients times the offsets (rasp paper, eq. 11) are summed
    over the ranks in one all-reduce per dtype, so every rank takes the same QNVB step (eq. 4-8),
    bit for bit, and `step` returns the quadrature average of the loss over all ``K`` nodes
    on every rank. Without an initialized process group it is a ``QNVBOptimizer``.

    Args:
        params: as for ``QNVBOptimizer`` (``net.named_parameters()`` for ``step(loss_fn=...)``).
            The network is a plain module on every rank, **not** wrapped in
            ``DistributedDataParallel`` (which would average the gradients of different nodes).
        check_nodes: compare the step's count, the dimension, number of nodes, weights, the first
            node, a one-pass step's batch, the parameters' means and standard deviations
            (projections of them) and the settings the update reads (a checksum of the
            optimizer's and every group's) across the ranks every step (one small collective),
            and raise on every rank if they differ.
        group: the process group (``None``: the default group); a ``RuntimeError`` when this
            process is not a member. Built with one, the optimizer cannot be deep-copied or
            pickled (torch cannot pickle a ``ProcessGroup``): save its ``state_dict()``.
        **kwargs: the keyword arguments of ``QNVBOptimizer`` (``likelihood_weight``,
            ``quadrature``, ``num_eval``, ``generator``, the hyperparameters).

    The constructor makes every rank start from rank 0's: it broadcasts the parameters (as
    ``DistributedDataParallel`` does) and the state of ``generator`` when one is given (random
    rules draw their nodes from it; without one they draw from torch's global generator, which
    the ranks must then seed alike or share with
    `broadcast_generator`). ``state_dict`` is the same on every
    rank: rank 0 saves it, every rank loads it, and the run continues bit for bit.

    Raises:
        RuntimeError: in the constructor, on every rank, when the ranks' parameters differ in
            number, shapes or names ("the models differ").
        ValueError: at a step, on every rank, when the rule has fewer nodes than ranks.
        RuntimeError: at a step, on every rank, before anything changes, when the ranks drew
            different nodes, were given different batches, hold different means or standard
            deviations, or other settings (``lr``, ``likelihood_weight``, ...: the message names
            the setting and every rank's value) (``check_nodes``).
        RuntimeError: at a step in another world than the constructor's (the process group
            destroyed or replaced), before anything changes.
        Exception: at a step, on every rank, when the closure or ``loss_fn`` raised on some rank:
            that rank raises its error, the others one of its type (a ``RuntimeError`` where the
            type takes other arguments) naming the failing rank and its message. The flag rides
            in the step's all-reduce of the gradient flags (no collective more; the messages cost
            one ``all_gather_object``, on a refusal only). The step is not taken: the
            parameters, the QNVB state, the step count and the generator's state are as before
            it on every rank, so catching the error on every rank lets training go on in step.
    """

    def __init__(
        self,
        params: Iterable,
        *,
        check_nodes: bool = True,
        group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ):
        if not isinstance(check_nodes, bool):
            raise TypeError(f"check_nodes must be True or False, got {check_nodes!r}")
        super().__init__(params, **kwargs)
        self.check_nodes = check_nodes
        self.group = group
        self._batch: tuple | None = None
        self._failure: Exception | None = None  # this rank's error evaluating the step's nodes
        self._generator_state: torch.Tensor | None = None  # the generator's before the step
        _, self._world_size = world(group)  # the world it was built in (`same_world`)
        if self._world_size > 1:
            self._check_model()
            with torch.no_grad():
                for param_group in self.param_groups:
                    for p in param_group["params"]:
                        dist.broadcast(p.data, src=global_rank(0, group), group=group)
            if self.generator is not None:
                broadcast_generator(self.generator, group=group)

    def _check_model(self) -> None:
        """Every rank holds parameters of the same number, shapes (and names, when given): checked
        before the constructor's broadcasts, which would otherwise fail or mix unlike tensors."""
        tensors = [p for group in self.param_groups for p in group["params"]]
        names = [group.get("param_names") for group in self.param_groups]
        layout = repr(([tuple(p.shape) for p in tensors], names)).encode()
        numel = sum(p.numel() for p in tensors)
        numbers = torch.tensor(
            [float(len(tensors)), float(numel), float(zlib.crc32(layout))],
            dtype=torch.float64,
        )
        check_sections(
            [(numbers, "the parameters (their number, sizes, shapes and names)", MODEL_FIX)],
            self.group,
        )

    def step(  # type: ignore[override]
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        *,
        loss_fn: LossFunction | None = None,
        batch: tuple = (),
        vectorize: bool | None = None,
    ) -> torch.Tensor:
        """`QNVBOptimizer.step`, this rank's nodes.

        With ``check_nodes``, a one-pass step's ``batch`` is part of the step's agreement check
        (its tensors' shapes and a projection of their values): node parallel needs the same
        whole minibatch on every rank. A closure reads its data itself, unchecked.

        Raises:
            RuntimeError: before anything changes, when the world is not the one the optimizer
                was built in (after ``torch.distributed.destroy_process_group()``, each rank
                would otherwise fit alone).
        """
        same_world(
            self._world_size,
            "NodeParallelQNVBOptimizer",
            "Build a new NodeParallelQNVBOptimizer after init_process_group; to step in one "
            "process, use a QNVBOptimizer (either takes this one's state_dict())",
            self.group,
        )
        if loss_fn is not None:
            self._batch = tuple(batch) if isinstance(batch, tuple | list) else (batch,)
        # (restored if the step is refused: one copy of a few kilobytes per step, no collective)
        self._generator_state = None if self.generator is None else self.generator.get_state()
        try:
            return super().step(closure, loss_fn=loss_fn, batch=batch, vectorize=vectorize)
        finally:
            self._batch = None
            self._failure = None
            self._generator_state = None

    def _local_nodes(self, nodes: NodeSet) -> NodeSet:
        """Nodes ``r, r + W, ...`` of the step (checked to be the same step, on the same batch,
        on every rank)."""
        rank, size = world(self.group)
        if size == 1:
            return nodes
        if self.check_nodes:
            try:
                self._check_step(nodes)
            except RuntimeError:  # nothing changed: the generator back to its state
                if self._generator_state is not None:
                    self.generator.set_state(self._generator_state)
                raise
        if len(nodes) < size:
            raise ValueError(
                f"NodeParallelQNVBOptimizer: the rule has {len(nodes)} nodes for {size} ranks; "
                "use at least as many nodes as ranks (num_eval)"
            )
        return _NodeShare(nodes, rank, size)

    def _check_step(self, nodes: NodeSet) -> None:
        """Refuse the step on every rank unless every rank takes the same one: the same step
        count, nodes and batch, means and standard deviations (`projections`), and settings
        (`settings_fingerprint`), in one ``all_gather``; settings that differ are named (one
        ``all_gather_object`` more, on a refusal only)."""
        tensors = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        sections = [
            (
                torch.tensor([float(self.num_steps)], dtype=torch.float64),
                "the step count",
                SEED_FIX,
            ),
            *node_sections(nodes.node(0)[None], nodes.weights),
            arguments_section(
                self._batch or (),
                "the batch of step(loss_fn=..., batch=...) (the shapes and values of its tensors)",
                "NodeParallelQNVBOptimizer divides the nodes, not the data: pass the same "
                "whole minibatch on every rank (for shards of the data use "
                "DistributedDataParallel and QNVBOptimizer)",
            ),
            (
                projections([self.state[p]["mu"] for p in tensors])[None],
                "the parameters' means",
                STATE_FIX,
            ),
            (
                projections([self.state[p]["sigma"] for p in tensors])[None],
                "the parameters' standard deviations",
                STATE_FIX,
            ),
        ]
        settings = self._rank_settings()
        rows = gather_rows(
            host_values([v for v, _, _ in sections] + [settings_fingerprint(settings)]),
            self.group,
        )
        refuse_disagreement(rows[:, :-1], sections)
        if bool((rows[:, -1] != rows[0, -1]).any()):  # (every rank: each sees every row)
            differing = differing_setting(settings, self.group)
            if differing is not None:  # (None: equal values written apart, 1 and 1.0)
                name, field, values = differing
                raise RuntimeError(
                    f"NodeParallelQNVBOptimizer: the ranks differ in {field} of {name}: "
                    f"{values} on ranks 0..{len(values) - 1}; {SETTINGS_FIX}"
                )

    def _rank_settings(self) -> dict[str, dict[str, Any]]:
        """What the step's update reads besides the moments: the optimizer's settings
        (`_settings`) and its likelihood weight at this step, and every parameter group's."""
        return {
            "the optimizer": {**self._settings(), "weight": self.weight},
            **{
                f"parameter group {index}": {key: group[key] for key in self.defaults}
                for index, group in enumerate(self.param_groups)
            },
        }

    def _closure_moments(self, params, nodes, closure):
        """`QNVBOptimizer._closure_moments`, an error kept for `_combine` to raise on
        every rank."""
        return self._caught(super()._closure_moments, params, nodes, closure)

    def _one_pass_moments(self, params, nodes, loss_fn, batch, vectorize):
        """`QNVBOptimizer._one_pass_moments`, an error kept for `_combine` to raise on
        every rank."""
        return self._caught(super()._one_pass_moments, params, nodes, loss_fn, batch, vectorize)

    def _caught(self, evaluate: Callable, params, *args):
        """``evaluate(params, *args)``; with several ranks, an error it raises is kept
        (`_failure`) and the step goes on to `_combine` with no moments, so that the
        other ranks, waiting there, hear of it instead of waiting for the process group's timeout.
        """
        if world(self.group)[1] == 1:
            return evaluate(params, *args)
        try:
            return evaluate(params, *args)
        except Exception as error:  # raised on every rank by _combine
            self._failure = error
            first = params[0][0]
            return torch.zeros((), dtype=first.dtype, device=first.device), [None] * len(params)

    @torch.no_grad()
    def _combine(self, params, loss_avg: torch.Tensor, moments: list):
        """Sum the ranks' weighted sums; a parameter with a gradient on some rank only counts as
        a zero gradient on the others.

        The flags of which parameters have gradients carry one more: whether this rank's
        evaluation raised. If any rank's did, every rank refuses the step (`_refuse`)."""
        _, size = world(self.group)
        if size == 1:
            return loss_avg, moments
        seen = torch.tensor(
            [m is not None for m in moments] + [self._failure is not None],
            dtype=torch.int64,
            device=loss_avg.device,
        )
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        flags = seen.tolist()
        if flags.pop():
            self._refuse(params)
        moments = [
            data_moments(m, p) if any_rank else None
            for (p, _), m, any_rank in zip(params, moments, flags)
        ]
        loss_avg = loss_avg.clone()
        tensors = [loss_avg] + [t for m in moments if m is not None for t in m]
        all_reduce_sum_(tensors, self.group, check_shapes=False)  # (shapes checked when built)
        return loss_avg, moments

    def _refuse(self, params) -> None:
        """Refuse the step on every rank: the parameters back to their means (gradients cleared)
        and the generator back to its state before the step, so the optimizer's state is as it
        was; then the failing rank raises its error, the others one of its type naming it (one
        ``all_gather_object`` of the messages, made only here)."""
        for p, _ in params:
            p.copy_(self.state[p]["mu"])
            p.grad = None
        if self._generator_state is not None:
            self.generator.set_state(self._generator_state)
        raise_together(
            self._failure,
            "NodeParallelQNVBOptimizer.step: evaluating the loss (the closure or loss_fn)",
            self.group,
        )
