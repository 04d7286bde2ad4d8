"""``DistributedQuadratureELBO``: ``QuadratureELBO`` shared across ranks, by data or by nodes.

The loss is (1) of `pyro_quadvi.infer.quadrature_elbo`, the quadrature estimate of the
negative ELBO (rasp paper, eq. 9 and 13). Every rank draws the same quadrature of the step (same
sequence position, same random state; the nodes are checked across ranks when ``check_nodes``).
What a rank evaluates depends on the mode:

* ``parallel="data"``: all ``K`` nodes, on the rank's shard of the minibatch. With the model's
  data plate scaled by ``N / B_r`` (its own rows ``B_r``), rank ``r``'s loss ``L_r`` is an
  estimate of the whole loss and the weighted mean ``sum_r (B_r / B) L_r`` with ``B = sum_r B_r``
  is the full-batch loss (1) of `pyro_quadvi.infer.quadrature_elbo`: prior and entropy are
  the same on every rank, and the likelihood terms add up to ``N / B`` times the batch's.
* ``parallel="nodes"``: nodes ``r, r + W, r + 2 W, ...`` on the whole minibatch. Rank ``r`` forms
  ``L_r = -W sum_{k = r mod W} w_k log p(x, z_k) - H[q]``, so that the mean over ranks is (1).

In both modes the mean over ranks of the losses, of their gradients and of the moments ``g``, ``h``
they publish is the single-process value: `DistributedOptimizer`
averages gradients and moments, and `loss_and_grads` reports the averaged loss.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from pyro.distributions.util import is_identically_one
from pyro.poutine.messenger import Messenger

from ..guides.interface import first_rows
from ..infer import QuadratureELBO
from ..infer.log_joint import _NODE_PLATE, is_data_site
from ..quadrature import QuadratureRule
from .comm import (
    MODEL_FIX,
    arguments_section,
    gather_rows,
    host_values,
    node_sections,
    projection,
    projections,
    refuse_disagreement,
    same_world,
    world,
)

__all__ = ["PARALLEL_MODES", "DistributedQuadratureELBO"]

PARALLEL_MODES = ("data", "nodes")
"""How ranks share a step: shards of the minibatch, or subsets of the nodes."""

START_FIX = (
    "every rank must start from the same values: seed every rank identically (pyro.set_rng_seed) "
    "before the guide's first run, or load one checkpoint"
)
UNWRAPPED_FIX = (
    "they agreed at this ELBO's previous step, so the optimizer's step since moved them "
    "differently on the ranks. Either it is not wrapped, and each rank stepped on its own "
    "gradients: wrap it, SVI(model, guide, DistributedOptimizer(QNVB()), elbo), so that every "
    "rank takes the same step from the means over the ranks; or the wrapped optimizer (or the "
    "fallback QNVB hands the blocks without moments) has other settings on some rank, "
    "pyro.optim.Adam({'lr': ...}) with another lr (DistributedOptimizer compares QNVB's own "
    "settings, not another optimizer's): build the same optimizer on every rank"
)
WORLD_FIX = (
    "Build a new DistributedQuadratureELBO (and DistributedOptimizer) after "
    "init_process_group; to evaluate in one process, use a plain QuadratureELBO with the same "
    "rule"
)


class DistributedQuadratureELBO(QuadratureELBO):
    """`QuadratureELBO` on ``torch.distributed``, data- or node-parallel.

    Args:
        rule: as for `QuadratureELBO`.
        num_points: as for ``QuadratureELBO``.
        vectorize: as for ``QuadratureELBO``.
        max_plate_nesting: as for ``QuadratureELBO``.
        generator: as for ``QuadratureELBO``; it (or torch's global generator) must hold the
            same state on every rank (`broadcast_generator`).
        name: as for ``QuadratureELBO``.
        parallel: ``"data"`` (each rank passes its shard of the minibatch to ``svi.step``) or
            ``"nodes"`` (each rank passes the whole minibatch and evaluates every ``W``-th node).
        check_nodes: compare fingerprints of the step's nodes and weights (and, with
            ``parallel="nodes"``, of the minibatch) across ranks every step, in the step's one
            small collective, and raise on every rank if they differ. (A projection of the
            guide's parameters is compared in any case.)
        group: the process group (``None``: the default group); a ``RuntimeError`` when this
            process is not a member. Built with one, the ELBO cannot be deep-copied or pickled
            (torch cannot pickle a ``ProcessGroup``).
        vectorize_particles: as for `QuadratureELBO`: ``True`` refused naming ``vectorize``,
            ``False`` changes nothing.

    Attributes:
        share: with ``parallel="data"``, this rank's fraction ``B_r / B`` of the minibatch's rows;
            ``None`` (default) means equal shards, ``1 / W``. Set it before each step when shards
            differ in size (the remainder of a batch that ``W`` does not divide). Where any rank
            sets it, each rank's must be its rows over all ranks' rows (to ``1e-9``): other
            shares, or a share left from other shards, are refused on every rank.

    Use it with `DistributedOptimizer` around ``QNVB`` (or any
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
        vectorize_particles: bool | None = None,
    ):
        world(group)  # refuses a group this process is not a member of
        super().__init__(
            rule,
            num_points,
            vectorize,
            max_plate_nesting,
            generator,
            name,
            vectorize_particles=vectorize_particles,
        )
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        if not isinstance(check_nodes, bool):
            raise TypeError(f"check_nodes must be True or False, got {check_nodes!r}")
        self.parallel = parallel
        self.check_nodes = check_nodes
        self.group = group
        self.share: float | None = None
        self._node_sections: list | None = None
        self._whole_plates: dict[str, tuple[str, torch.Tensor]] = {}
        self._plate_sizes: dict[str, int] = {}
        self._closed_priors: dict[str, tuple[float, float, float]] = {}
        self._minibatch_rows = math.nan
        self._world_size: int | None = None  # at the first step (`same_world`)

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
        """This rank's nodes and weights (all of them, or every ``W``-th times ``W``); with
        ``check_nodes``, keeps their fingerprint for the step's one collective.

        Raises:
            ValueError: in node mode, when there are fewer nodes than ranks.
        """
        rank, size = world(self.group)
        if size == 1:
            return x, weights
        if self.check_nodes:
            self._node_sections = node_sections(x, weights)
        if self.parallel == "data":
            return x, weights
        if x.shape[0] < size:
            raise ValueError(
                f"DistributedQuadratureELBO(parallel='nodes'): the rule has {x.shape[0]} nodes "
                f"for {size} ranks; use at least as many nodes as ranks (num_points) or "
                "parallel='data'"
            )
        return x[rank::size], weights[rank::size] * size

    def _quadrature_loss(self, model: Callable, guide: Callable, args, kwargs):
        """``QuadratureELBO``'s loss; with several ranks, watching the full sizes of the
        model's subsampled data plates and, in data mode, its observed sites in data plates that
        are not subsampled and the size of the minibatch of those that are
        (`_WholePlateObservations`)."""
        self._whole_plates, self._plate_sizes, self._minibatch_rows = {}, {}, math.nan
        self._closed_priors = {}
        if world(self.group)[1] == 1:
            return super()._quadrature_loss(model, guide, args, kwargs)
        with _WholePlateObservations() as watch:
            result = super()._quadrature_loss(model, guide, args, kwargs)
        self._plate_sizes = watch.full_sizes
        if self.parallel == "data":
            self._whole_plates, self._minibatch_rows = watch.found, watch.minibatch_rows
        return result

    def _log_joint(self, *args, **kwargs):
        """``QuadratureELBO``'s, keeping the priors it left to the closed form (`LogJoint`'s
        ``closed_priors``: ``(loc, scale, site scale)`` by site) for `_model_sections`."""
        log_joint, priors = super()._log_joint(*args, **kwargs)
        self._closed_priors = priors
        return log_joint, priors

    def _model_sections(self) -> list:
        """What every rank's model must hold alike and its loss would hide: the full sizes of
        its subsampled data plates (the first by name, then a fingerprint of every name and
        size) and the Gaussian priors integrated in closed form (a fingerprint of each site's
        name, loc, scale and site scale)."""
        plates = sorted(self._plate_sizes.items())
        priors = sorted(self._closed_priors.items())
        sizes = torch.tensor(
            [[zlib.crc32(name.encode()), size] for name, size in plates], dtype=torch.float64
        )
        shown = ", ".join(f"{name!r}: {size}" for name, size in plates)
        listed = ", ".join(f"{name!r}: {prior}" for name, prior in priors[:2])
        more = f" and {len(priors) - 2} more" if len(priors) > 2 else ""
        return [
            (
                torch.stack(
                    [
                        torch.tensor(float(plates[0][1] if plates else 0), dtype=torch.float64),
                        projection(sizes.reshape(-1, 2)),
                    ]
                ),
                "the full sizes of the model's subsampled data plates (the N by which a "
                f"minibatch's likelihood is scaled; this rank's: {{{shown}}}, where a plate "
                "given all its rows is no subsampled one)",
                f"{MODEL_FIX}: give every rank's data plate the size of the whole data set, "
                "pyro.plate('data', N, subsample=idx) (likelihoods.X(dataset_size=N) in a "
                "BayesianModule)",
            ),
            (
                projection(
                    torch.tensor(
                        [[zlib.crc32(name.encode()), *prior] for name, prior in priors],
                        dtype=torch.float64,
                    ).reshape(-1, 4)
                )[None],
                "the Gaussian priors integrated in closed form ((loc, scale, site scale) by "
                f"site; this rank's: {{{listed}{more}}})",
                f"{MODEL_FIX}: build every rank's priors alike",
            ),
        ]

    def _shard_rows(self, args: tuple, kwargs: dict) -> float:
        """This rank's rows: the size of the minibatch of the model's subsampled data plate, as
        the model ran it; for a model without one, dim 0 of the first tensor argument of
        ``svi.step`` (`first_rows`)."""
        if not math.isnan(self._minibatch_rows):
            return self._minibatch_rows
        return first_rows(args, kwargs)[1]

    def _whole_plates_section(self) -> torch.Tensor:
        """The number of unscaled observed sites in full-size plates and a fingerprint of their
        values (by name): equal on every rank when each rank observes the same rows there."""
        found = sorted(self._whole_plates.items())
        return torch.stack(
            [
                torch.tensor(float(len(found)), dtype=torch.float64),
                projections([value for _, (_, value) in found]),
            ]
        )

    def _refuse_whole_plates(self, columns: torch.Tensor) -> None:
        """Raise when the ranks observe different values at a site that sits in a full-size
        plate with nothing scaling it (no subsampled plate, no ``poutine.scale``): each rank's
        likelihood then counts its own rows at scale 1, and the mean over the ranks weights
        every row by ``1 / W`` (the sparse-VI paper's eq. 1: a minibatch's term is scaled by
        ``n / m``, here ``N / B``)."""
        bits = columns.contiguous().view(torch.int64)
        if not bool((bits != bits[:1]).any()):
            return
        if self._whole_plates:
            site, (plate, _) = sorted(self._whole_plates.items())[0]
            where = f"the observed site {site!r} sits in the plate {plate!r}"
        else:
            where = "some rank's observed site sits in a plate"
        raise ValueError(
            f"DistributedQuadratureELBO(parallel='data'): {where}, which is not subsampled (its "
            "size is the rows this rank was given), and the ranks observe different values "
            "there, so each rank's likelihood counts its shard at scale 1 and the mean over the "
            "ranks weights every row by 1 / world size (not the fit of the whole data set). Give "
            "the data plate the size N of the whole data set and this rank's rows, "
            "pyro.plate('data', N, subsample=idx) (in a BayesianModule, "
            "likelihoods.X(dataset_size=N)); no rank has "
            "changed anything"
        )

    def _refuse_empty(self, args: tuple, kwargs: dict) -> None:
        if self.parallel != "data":
            return
        where, rows = first_rows(args, kwargs)
        if rows == 0:
            raise ValueError(
                f"DistributedQuadratureELBO(parallel='data'): this rank's shard is empty "
                f"({_argument(where)} of svi.step has 0 rows); give every rank at least one row "
                "(shard(num_rows) does) and set share to its fraction of the rows"
            )

    def _evaluate(self, model: Callable, guide: Callable, args: tuple, kwargs: dict, grad: bool):
        """This rank's loss ``L_r`` (and the guide's description) and the mean over ranks, after
        one collective that every rank reaches whatever happened locally: it carries the loss,
        the share, the rows, whether this rank's evaluation raised, the model's data plates and
        closed-form priors (`_model_sections`), the guide's parameters and (``check_nodes``) the
        fingerprints of the nodes and, in node mode, of the minibatch. An error on any rank is
        raised on every rank (the local error where it happened), before anything is accumulated
        or advanced."""
        first = self._world_size is None
        _, size = same_world(self._world_size, "DistributedQuadratureELBO", WORLD_FIX, self.group)
        self._world_size = size
        self._node_sections = None
        sections = []
        if self.check_nodes and size > 1 and self.parallel == "nodes":
            sections.append(
                arguments_section(
                    [*args, *kwargs.values()],
                    "the minibatch (the shapes and values of the tensors passed to svi.step)",
                    "with parallel='nodes' every rank passes the whole minibatch, the same on "
                    "every rank; to give each rank its own rows use parallel='data'",
                )
            )
        error, loss, description, share = None, None, None, 1.0 / size
        params = torch.tensor(math.nan, dtype=torch.float64)
        try:
            self._refuse_empty(args, kwargs)
            factor = self._factor()
            share = factor / size
            with contextlib.nullcontext() if grad else torch.no_grad():
                loss, description = self._quadrature_loss(model, guide, args, kwargs)
            if factor != 1.0:
                loss = loss * factor
            value = loss.item()
            if size > 1:
                params = projections(description.leaves())
        except Exception as caught:  # raised below, after every rank has heard of it
            error, value = caught, 0.0
        if size == 1:
            if error is not None:
                raise error
            return loss, description, value
        if self.check_nodes:
            nan = torch.full((1, 1), float("nan"), dtype=torch.float64)
            sections = (self._node_sections or node_sections(nan, nan[0])) + sections
        sections += self._model_sections()
        fix = START_FIX if first else UNWRAPPED_FIX
        sections.append((params[None], "the values of the guide's parameters", fix))
        status = torch.tensor(
            [
                value,
                share,
                isinstance(error, ValueError),
                error is not None,
                self._shard_rows(args, kwargs),
                self.share is not None,
            ],
            dtype=torch.float64,
        )
        rows = gather_rows(
            host_values([status, self._whole_plates_section(), *(v for v, _, _ in sections)]),
            self.group,
        )
        if error is not None:
            raise error
        failed = rows[:, 3].nonzero().reshape(-1).tolist()
        if failed:
            kind = ValueError if bool(rows[:, 2].any()) else RuntimeError
            raise kind(
                f"DistributedQuadratureELBO: the evaluation raised on rank(s) {failed} (see their "
                "error); no rank accumulated gradients or advanced, so catching the error on every "
                "rank skips the step everywhere"
            )
        self._refuse_whole_plates(rows[:, 6:8])
        refuse_disagreement(rows[:, 8:], sections)
        counts = rows[:, 4]
        unequal = bool((counts != counts[0]).any()) and not bool(counts.isnan().any())
        if self.parallel == "data" and unequal and not bool(rows[:, 5].any()):
            raise ValueError(
                "DistributedQuadratureELBO(parallel='data'): the ranks' shards hold different "
                f"numbers of rows ({[int(c) for c in counts.tolist()]}: the minibatch of the "
                "model's subsampled data plate, or without one the first tensor argument of "
                "svi.step) and no share is set, so the plain mean over ranks would weight each "
                "rank's rows wrongly. Set elbo.share = this rank's rows / the minibatch's rows "
                "on every rank before the step"
            )
        total = rows[:, 1].sum().item()
        if abs(total - 1.0) > 1e-9:
            raise ValueError(
                f"DistributedQuadratureELBO.share: the ranks' shares add up to {total!r}, not 1 "
                f"(shares by rank: {rows[:, 1].tolist()}); set each rank's share to its rows / the "
                "minibatch's rows, or None on every rank for equal shards"
            )
        if self.parallel == "data" and bool(rows[:, 5].any()) and not bool(counts.isnan().any()):
            self._refuse_shares(rows[:, 1], counts, self._rows_read(args, kwargs))
        return loss, description, rows[:, 0].sum().item() / size

    def _rows_read(self, args: tuple, kwargs: dict) -> str:
        """Where `_shard_rows` read this rank's rows, for `_refuse_shares`: ``""`` from the
        model's subsampled data plate; otherwise the argument of ``svi.step``, and the fix."""
        if not math.isnan(self._minibatch_rows):
            return ""
        return (
            " The model has no subsampled data plate, so each rank's rows were read from "
            f"{_argument(first_rows(args, kwargs)[0])} of svi.step, its first tensor argument: "
            "pass the data first, or give the model the data plate pyro.plate('data', N, "
            "subsample=idx)."
        )

    @staticmethod
    def _refuse_shares(shares: torch.Tensor, counts: torch.Tensor, read: str) -> None:
        """Raise unless every rank's share is its rows over all ranks' rows (to rounding): each
        rank's plate scales its likelihood by ``N / B_r``, so only ``B_r / B`` makes the
        weighted mean the full batch's loss. ``read``: where the rows came from, where that is
        not the data plate (`_rows_read`)."""
        wanted = counts / counts.sum()
        if not bool(((shares - wanted).abs() > 1e-9).any()):
            return
        raise ValueError(
            "DistributedQuadratureELBO.share: the ranks' shares do not match their rows (shares "
            f"by rank: {shares.tolist()}; rows by rank: {[int(c) for c in counts.tolist()]}, so "
            f"the shares must be {wanted.tolist()}).{read} A share weights its rank's loss, whose "
            "likelihood the data plate already scales by N / this rank's rows: any share but "
            "this rank's rows / the minibatch's rows weights the ranks' rows wrongly. Set "
            "elbo.share = this rank's rows / the minibatch's rows on every rank before each step "
            "(a share left from a batch of other shards is stale), or None on every rank for "
            "equal shards; no rank has changed anything"
        )

    def differentiable_loss(
        self, model: Callable, guide: Callable, *args, **kwargs
    ) -> torch.Tensor:
        """This rank's term ``L_r`` (differentiable); the mean over ranks is the negative ELBO.

        A collective call (every rank makes it): the ranks check their nodes, shares and errors
        together (see `loss_and_grads`).
        """
        loss, description, _ = self._evaluate(model, guide, args, kwargs, grad=True)
        self._advance(description)
        return loss

    def loss(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """The negative ELBO (the mean over ranks), without gradients.

        A collective call: **every** rank must make it, with its own shard (data parallel) or the
        same batch (node parallel); called under ``if rank == 0`` it waits for the others until
        the process group's timeout. To evaluate on one rank only, use a plain
        `QuadratureELBO` with the same rule there: it communicates
        nothing.
        """
        return self._evaluate(model, guide, args, kwargs, grad=False)[2]

    def loss_and_grads(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """Accumulate this rank's gradients; return the negative ELBO (mean over ranks).

        One collective per step (an ``all_gather`` of a few numbers) carries the rank's loss, its
        share, whether its evaluation raised, fingerprints of the model's subsampled data plates
        and closed-form priors, a projection of the guide's parameters and, with
        ``check_nodes``, fingerprints of the nodes (and of the minibatch with
        ``parallel="nodes"``). Before any gradient is accumulated or
        the sequence advanced, every rank raises together when

        * the evaluation raised on some rank (a non-finite loss there, an empty shard): that rank
          raises its own error, the others a ``ValueError`` (``RuntimeError`` if no failing rank's
          error was one) saying so, so ``except ValueError`` on every rank skips the step
          everywhere;
        * the ranks drew different nodes, or have models of different dimensions, or (node
          parallel) were given different minibatches (``RuntimeError``);
        * the ranks' models differ in the full size of a subsampled data plate or in a Gaussian
          prior integrated in closed form, whatever ``check_nodes`` (``RuntimeError``);
        * the guide's parameters differ between the ranks, whatever ``check_nodes``: ranks
          seeded differently (at the first step), or an optimizer not wrapped in
          `DistributedOptimizer` or built with other settings on some rank (at the next)
          (``RuntimeError``);
        * the world size is not that of the first step: the process group was destroyed or
          replaced (``RuntimeError``, before the collective);
        * the shares do not add up to 1, or (data parallel) are not each rank's rows over all
          ranks' rows (``ValueError``).
        """
        loss, description, mean = self._evaluate(model, guide, args, kwargs, grad=True)
        self._advance(description)  # before the backward: a rank's refusal keeps them in step
        if loss.requires_grad:
            self._backward(loss, model, guide)
        return mean

    def __repr__(self) -> str:
        return (
            f"DistributedQuadratureELBO(rule={self.rule!r}, vectorize={self.vectorize}, "
            f"parallel={self.parallel!r})"
        )


def _argument(where: int | str | None) -> str:
    """An argument of ``svi.step`` by `first_rows`'s ``where``: ``"argument 0"``, ``"x="``."""
    return f"argument {where}" if isinstance(where, int) else f"{where}="


class _WholePlateObservations(Messenger):
    """Notes each observed sample site that holds data (`is_data_site`: not a
    ``pyro.deterministic`` site, nor one a reparameterizer leaves, whose values the rank computes)
    inside a vectorized plate that is not subsampled (its frame's ``size`` is its ``full_size``;
    the ELBO's own node plate aside) with nothing that scales it: no subsampled plate around it
    (a full plate of features inside the subsampled data plate is scaled by the latter) and no
    ``poutine.scale`` (a minibatch scaled by hand).
    ``found`` maps the site's name to that plate's name and the observed value (the last
    run's). ``minibatch_rows`` is the most rows of an observed site in subsampled plates (the
    product of their minibatch sizes): the shard this rank was given; NaN without one.
    ``full_sizes`` maps each subsampled plate around an observed site to its full size.

    A site that something scales is trusted: a shard-sized data plate around a subsampled plate
    of features, or under a ``poutine.scale`` that is not ``N / B``, is not caught.

    Entered around the whole loss, it is the outermost handler, so it sees each site's plates
    and its whole scale.
    """

    def __init__(self):
        super().__init__()
        self.found: dict[str, tuple[str, torch.Tensor]] = {}
        self.minibatch_rows = math.nan
        self.full_sizes: dict[str, int] = {}

    def _process_message(self, msg) -> None:
        if msg["type"] != "sample" or not is_data_site(msg):
            return
        plates = [
            frame
            for frame in msg["cond_indep_stack"]
            if frame.vectorized and frame.name != _NODE_PLATE
        ]
        subsampled = [frame for frame in plates if frame.size != frame.full_size]
        if subsampled:  # a subsampled plate scales the site by N / B
            self.full_sizes.update((frame.name, frame.full_size) for frame in subsampled)
            rows = float(math.prod(frame.size for frame in subsampled))
            if math.isnan(self.minibatch_rows) or rows > self.minibatch_rows:
                self.minibatch_rows = rows
            return
        if not is_identically_one(msg["scale"]):
            return  # a poutine.scale around the site: a minibatch scaled by hand
        full = [frame for frame in plates if frame.size == frame.full_size]
        if full:
            self.found[msg["name"]] = (full[0].name, torch.as_tensor(msg["value"]).detach())
