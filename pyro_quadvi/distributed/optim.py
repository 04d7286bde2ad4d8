"""``DistributedOptimizer``: any ``PyroOptim`` (``QNVB`` above all) stepping on averaged inputs.

In the spirit of Pyro's ``HorovodOptimizer``, on ``torch.distributed``: before the wrapped
optimizer steps, the gradients of the parameters ``SVI`` hands it and the moments ``g``, ``h`` that
``QuadratureELBO`` published for them (`published_moments`)
are replaced by their means over the ranks. With
`DistributedQuadratureELBO` those means are the single-process
values (its module docstring says why), so every rank takes the same step.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict

import pyro
import torch
import torch.distributed as dist
from pyro.optim import PyroOptim

from ..guides.interface import (
    GuideDescription,
    MeanFieldSite,
    PublishedMoments,
    live_guides,
    publish_moments,
    published_moments,
    run_rows,
    run_scale,
)
from ..optim import QNVB, SparseQNVB
from ..optim.qnvb import minibatch_refusal
from ..optim.qnvb_functional import QNVBHyperparameters
from .comm import (
    all_reduce_mean_,
    differing_setting,
    gather_rows,
    global_rank,
    projections,
    raise_together,
    refuse_disagreement,
    same_world,
    settings_fingerprint,
    world,
)

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(PyroOptim):
    """Average gradients and published moments over the ranks, then step ``optim``.

    The moments are the quadrature estimates of ``E[dU/dz]`` and ``E[d^2U/dz^2]`` (rasp paper,
    eq. 7, 8 and 11), linear in the node evaluations, so their mean over ranks is the estimate of
    all the rows (data parallel) or all the nodes (node parallel) that QNVB's update (eq. 4-8)
    takes.

    Args:
        optim: a ``QNVB`` or any ``pyro.optim`` optimizer.
        shard_update: with ``QNVB``, divide its block updates between the ranks (largest block to
            the least loaded rank): each rank updates its blocks and broadcasts their new values
            (one broadcast per rank), instead of every rank updating every block. The result is
            the same bit for bit (the update is elementwise); each block's QNVB state then lives
            on its rank only, and `get_state` gathers it (with the settings each block
            was updated with, which a restore checks).
        group: the process group (``None``: the default group).

    Each step makes three collectives: one that checks that every rank received the same parameters
    (their number and names, and a projection of their values: ranks seeded differently start from
    different values) and that their QNVBs give each block with moments the same hyperparameters (a
    checksum), one of three flags per parameter (has a gradient, has published moments, is a block
    QNVB refuses: see below), and one fused sum per dtype of every gradient and moment. A refusal
    costs one more collective, to name its cause on every rank. A parameter without a gradient on
    some rank (its shard did not touch it) counts as a zero gradient there; moments must be
    published on all ranks or none (they are, when every rank runs the same model and guide). With
    ``shard_update``, one broadcast per rank (and dtype) follows the update.

    Attribute look-ups it does not know go to ``optim`` (``num_steps``, ``anneal``, ...);
    ``get_state`` / ``set_state`` (and ``save`` / ``load``) are ``optim``'s, the same on every
    rank (gathered first with ``shard_update``), so rank 0 saves them
    (`save_checkpoint`).

    Raises (on every rank together):
        ValueError: QNVB's refusal of a block it would update from gradients alone (Pyro's
            ``AutoNormal`` under Pyro's ELBOs) whose guide does not record its minibatch, when
            some of its entries have no gradient on some rank (checked before the mean, which
            would give them the other ranks' gradients); and when the ranks' guides last ran on
            minibatches of different sizes (`run_rows`)
            and no rank's ELBO published moments (Pyro's ELBOs, which cannot weight a rank by
            its rows).
        RuntimeError: when the ranks' guides last ran under different scales (a
            ``poutine.scale`` per rank; `run_scale`); when
            the ranks received different parameters or different values of them
            (ranks seeded differently: a projection of the values is compared), when their QNVBs
            give a block other hyperparameters (naming the block and the setting), disagree on which
            parameters have moments, or on the rows of a block in a subsampled plate (a local
            latent, data parallel: a mean cannot combine different rows; node parallel, where every
            rank has the whole minibatch, fits local latents), or for a parameter without a name in
            Pyro's param store (``module_local_params=True``): names order the reduction; and
            in the constructor, when this process is not a member of ``group``.

    Built with ``group=`` (a ``ProcessGroup``), it cannot be deep-copied or pickled (torch
    cannot pickle a ``ProcessGroup``): save and restore it with
    `save_checkpoint` and
    `load_checkpoint`.
    """

    def __init__(
        self,
        optim: PyroOptim,
        *,
        shard_update: bool = False,
        group: dist.ProcessGroup | None = None,
    ):
        if not isinstance(optim, PyroOptim):
            raise TypeError(
                "DistributedOptimizer wraps a pyro optimizer (QNVB(), pyro.optim.Adam(...)), "
                f"got {type(optim).__name__}"
            )
        if not isinstance(shard_update, bool):
            raise TypeError(f"shard_update must be True or False, got {shard_update!r}")
        if shard_update and (not isinstance(optim, QNVB) or isinstance(optim, SparseQNVB)):
            raise TypeError(
                "shard_update=True divides QNVB's block updates between the ranks; it needs a QNVB "
                f"optimizer, got {type(optim).__name__}"
                + (
                    " (SparseQNVB's sieve ranks all blocks together, so every rank must update "
                    "all of them: use shard_update=False)"
                    if isinstance(optim, QNVB)
                    else ""
                )
            )
        world(group)  # refuses a group this process is not a member of
        # PyroOptim.__init__ is not called: every PyroOptim attribute is optim's (__getattr__)
        self.optim = optim
        self.shard_update = shard_update
        self.group = group
        self._owners: dict[str, int] = {}  # loc parameter name -> the rank updating its block
        self._world_size: int | None = None  # at the first step (`same_world`)

    def __getattr__(self, name: str):
        # unpickling: no recursion
        if name in ("optim", "shard_update", "group", "_owners", "_world_size"):
            raise AttributeError(name)
        return getattr(self.optim, name)

    def __call__(self, params: Iterable[torch.Tensor], *args, **kwargs) -> None:
        """Average the gradients and moments of ``params`` over the ranks; step the optimizer."""
        params = list(params)
        _, size = same_world(
            self._world_size,
            "DistributedOptimizer",
            "Build a new DistributedOptimizer after init_process_group; to step in one process, "
            "use the wrapped optimizer itself",
            self.group,
        )
        self._world_size = size
        if size == 1 or not params:
            self.optim(params, *args, **kwargs)
            return
        blocks, descriptions = self._reduce(params)
        if descriptions is not None:  # described for the checks: QNVB pairs with them
            kwargs = {**kwargs, "descriptions": descriptions}
        if not self.shard_update:
            self.optim(params, *args, **kwargs)
            return
        rank, _ = world(self.group)
        elsewhere = {id(leaf) for owner, leaves in blocks if owner != rank for leaf in leaves}
        mine = [p for p in params if id(p) not in elsewhere]
        self.optim(mine, *args, part_of_step=True, **kwargs)
        self._share_blocks(blocks)

    @torch.no_grad()
    def _share_blocks(self, blocks: list[tuple[int, list[torch.Tensor]]]) -> None:
        """Each block's owner broadcasts its new leaves: one broadcast per rank and dtype."""
        _, size = world(self.group)
        for owner in range(size):
            leaves = [leaf for rank, block in blocks if rank == owner for leaf in block]
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for leaf in leaves:
                by_dtype.setdefault(leaf.dtype, []).append(leaf)
            for bucket in by_dtype.values():
                flat = torch.cat([leaf.detach().reshape(-1) for leaf in bucket])
                dist.broadcast(flat, src=global_rank(owner, self.group), group=self.group)
                start = 0
                for leaf in bucket:  # through .data, as QNVB writes: no version bump
                    stop = start + leaf.numel()
                    leaf.data.copy_(flat[start:stop].view_as(leaf))
                    start = stop

    @torch.no_grad()
    def _reduce(
        self, params: list[torch.Tensor]
    ) -> tuple[
        list[tuple[int, list[torch.Tensor]]], list[tuple[Callable, GuideDescription]] | None
    ]:
        """Average gradients and moments; return the moment blocks as ``(owner, leaves)``, and
        the descriptions of the live guides made for the checks (`_gradient_sites`;
        ``None`` when none were needed)."""
        store = pyro.get_param_store()
        named = sorted(((store.param_name(p), p) for p in params), key=lambda n: n[0] or "")
        if any(name is None for name, _ in named):
            raise RuntimeError(
                "DistributedOptimizer lays the gradients of every rank out in the order of their "
                "names in Pyro's param store, and a parameter it received has none (under "
                "pyro.settings.set(module_local_params=True)?); use the global param store"
            )
        device = params[0].device
        moments = [published_moments(p) for _, p in named]
        names = "\n".join(name for name, _ in named).encode()
        read_from_gradients, descriptions = self._gradient_sites(named, moments)
        settings = self._block_settings(
            [m.site for m in moments if m is not None] + read_from_gradients
        )
        sections = [
            (
                torch.cat(
                    [
                        torch.tensor([len(named), zlib.crc32(names)], dtype=torch.float64),
                        _rows_fingerprint(
                            [m.site for m in moments if m is not None] + read_from_gradients
                        ).cpu(),
                    ]
                ),
                "the parameters to update (their number and names) or the rows of their "
                "local latents (sites in subsampled plates: a data-parallel run gives each "
                "rank other rows, which a mean cannot combine; fit them with "
                "parallel='nodes' or in one process)",
                "every rank must run the same model and guide",
            ),
            (
                projections([p for _, p in named])[None],
                "the values of the parameters to update",
                "every rank must start from the same values: seed every rank identically "
                "(pyro.set_rng_seed) before the guide's first run, or load one checkpoint",
            ),
        ]
        scales, minibatch = _guide_runs(named)
        sections.append(
            (
                scales,
                "the scale of the guides' last run (the poutine.scale around the guide, times "
                "the scale of any subsampled plate around it)",
                "every rank must run the model and guide under the same poutine.scale (the "
                "mean over the ranks weights them equally); weight the data by the data plate "
                "alone, pyro.plate('data', N, subsample=idx), which scales each rank's rows by "
                "N / B",
            )
        )
        fingerprint = settings_fingerprint({name: asdict(hp) for name, hp in settings.items()})
        published = float(any(m is not None for m in moments))
        rows = gather_rows(
            torch.cat(
                [torch.tensor([minibatch, published], dtype=torch.float64)]
                + [v.reshape(-1) for v, _, _ in sections]
                + [fingerprint]
            ),
            self.group,
        )
        refuse_disagreement(rows[:, 2:], sections)
        if bool((rows[:, -1] != rows[0, -1]).any()):
            self._refuse_settings(settings)  # (every rank: each sees every rank's fingerprint)
        unknown = _unknown_minibatches(read_from_gradients)
        flags = torch.tensor(
            [
                [p.grad is not None, m is not None, name in unknown]
                for (name, p), m in zip(named, moments)
            ],
            dtype=torch.int64,
            device=device,
        ).reshape(-1, 3)
        both = torch.cat([flags, -flags[:, 1:2]], dim=1)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        any_grad, any_moments, all_moments = both[:, 0], both[:, 1], -both[:, 3]
        if bool(both[:, 2].any()):  # before the mean hides the entries no rank's rows reached
            raise_together(next(iter(unknown.values()), None), "QNVB", self.group)
        _refuse_unequal_minibatches(rows[:, 0], bool(rows[:, 1].any()))  # (QNVB's cause first)
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
            if m is not None:
                tensors += [m.g, m.h]
        all_reduce_mean_(tensors, self.group, check_shapes=False)  # (names compared above)
        rank, size = world(self.group)
        named_blocks = [(name, m) for (name, _), m in zip(named, moments) if m is not None]
        if self.shard_update:
            self._owners = _balance([(n, m.site.loc.numel()) for n, m in named_blocks], size)
        blocks = []
        for name, m in named_blocks:
            owner = self._owners[name] if self.shard_update else rank
            if owner == rank:  # moments a rank will not use are dropped, never left stale
                publish_moments(PublishedMoments(m.site, m.g, m.h, m.version))
            blocks.append((owner, [m.site.params[role] for role in sorted(m.site.params)]))
        return blocks, descriptions

    def _qnvb(self) -> QNVB | None:
        """The wrapped optimizer if it is QNVB's block update (``SparseQNVB`` updates its blocks
        by its own rules, only from published moments); else ``None``."""
        if isinstance(self.optim, QNVB) and not isinstance(self.optim, SparseQNVB):
            return self.optim
        return None

    def _block_settings(self, sites: list[MeanFieldSite]) -> dict[str, QNVBHyperparameters]:
        """The hyperparameters QNVB gives each block this step (by loc name): those with
        moments, and those read from gradients (`_gradient_sites`)."""
        qnvb = self._qnvb()
        if qnvb is None:
            return {}
        return {
            site.param_names["loc"]: qnvb.block_hyperparameters(site.param_names["loc"], site.hints)
            for site in sites
        }

    def _refuse_settings(self, settings: dict[str, QNVBHyperparameters]) -> None:
        """Name the first block and setting in which the ranks' QNVBs differ (one
        ``all_gather_object``, made by every rank once the fingerprints differed)."""
        differing = differing_setting(
            {name: asdict(hp) for name, hp in settings.items()}, self.group
        )
        if differing is not None:
            name, field, values = differing
            raise RuntimeError(
                f"DistributedOptimizer: the ranks' QNVBs give the block {name!r} other "
                f"settings: {field} = {values} on ranks 0..{len(values) - 1}; every rank must "
                "build QNVB with the same settings (optim_args, keyword arguments, the "
                "model's infer['qnvb'])"
            )
        # otherwise blocks have moments on some ranks only: the flags below name that

    def _gradient_sites(
        self, named: list[tuple[str, torch.Tensor]], moments: list[PublishedMoments | None]
    ) -> tuple[list[MeanFieldSite], list[tuple[Callable, GuideDescription]] | None]:
        """The sites of the blocks QNVB would update from their gradients alone (no moments
        published): their rows, where the guide records them (``AutoMeanFieldNormal``), join the
        rows compared across the ranks; where it does not, `_unknown_minibatches`. And the
        descriptions of the live guides they came from, which QNVB's step then takes instead of
        describing the guides again (``None``: none were made)."""
        qnvb = self._qnvb()
        if qnvb is None or all(m is not None for m in moments):
            return [], None
        params = [p for _, p in named]
        descriptions = qnvb.describe(params)
        # the moments were taken (_reduce): every block found comes from the descriptions, those
        # with moments too (QNVB's step takes the moments again, they are not read from gradients)
        blocks, _ = qnvb.find_blocks(params, descriptions)
        with_moments = {id(m.site.params["loc"]) for m in moments if m is not None}
        sites = [block.site for block in blocks if id(block.site.params["loc"]) not in with_moments]
        return sites, descriptions

    def get_state(self) -> dict:
        """The wrapped optimizer's state, the same on every rank.

        With ``shard_update`` each rank holds the QNVB state of its own blocks, and the settings
        it updated them with: this is then a collective call (every rank must make it) that
        gathers both, each block's from its owner.
        """
        state = self.optim.get_state()
        _, size = world(self.group)
        if not self.shard_update or size == 1:
            return state
        everyone: list = [None] * size
        qnvb = state["qnvb"]
        dist.all_gather_object(
            everyone, (qnvb["pairs"], qnvb.get("settings", {})), group=self.group
        )
        for part, key in enumerate(("pairs", "settings")):
            gathered = {}
            for rank, held in enumerate(everyone):
                for name, record in held[part].items():
                    # the owner's copy; before the first step (a restore) every copy is the same
                    if name not in gathered or self._owners.get(name) == rank:
                        gathered[name] = record
            qnvb[key] = gathered
        return state

    def set_state(self, state_dict: dict) -> None:
        """Restore the wrapped optimizer's state."""
        self.optim.set_state(state_dict)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optim!r})"


def _guide_runs(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, float]:
    """The run scales (`run_scale`) of the live guides that
    hold one of the parameters, as their sum and position-weighted sum (in the order of their
    first parameter's name), and the sum of their run rows
    (`run_rows`; NaN where some guide's are unknown)."""
    names = {id(p): name for name, p in named}
    found = []
    for guide in live_guides():
        if not isinstance(guide, torch.nn.Module):
            continue
        held = [names[id(p)] for p in guide.parameters() if id(p) in names]
        if not held:
            continue
        try:  # (the live guides are the guides themselves, never their wrappers)
            scale = float(run_scale(guide))
        except ValueError:  # a tensor scale: QNVB's own step names it
            scale = math.nan
        found.append((min(held), scale, run_rows(guide)))
    found.sort()
    scales = [scale for _, scale, _ in found]
    weighted = sum((scale * (i + 1) for i, scale in enumerate(scales)), 0.0)
    return (
        torch.tensor([sum(scales, 0.0), weighted], dtype=torch.float64),
        sum((minibatch for _, _, minibatch in found), 0.0),
    )


def _refuse_unequal_minibatches(minibatches: torch.Tensor, published: bool) -> None:
    """Raise on every rank when the ranks' guides ran on minibatches of different numbers of
    rows and no rank's ELBO published moments (Pyro's ELBOs): each rank's gradients carry its
    own plate scale ``N / B_r``, and their plain mean weights the ranks' rows unequally (the
    sparse-VI paper's eq. 1 scales a minibatch by ``n / m``: ``N / B`` on every row).
    ``DistributedQuadratureELBO`` publishes moments and weights its shards itself (its
    ``share``)."""
    if published or bool(minibatches.isnan().any()):
        return
    if bool((minibatches != minibatches[0]).any()):
        raise ValueError(
            "DistributedOptimizer: the ranks' guides ran on minibatches of different sizes "
            f"({[int(b) for b in minibatches.tolist()]} rows by rank, the first tensor argument "
            "of svi.step) under an ELBO that publishes no moments (Pyro's Trace_ELBO, say): each "
            "rank's gradients carry its own plate scale N / B_r, so their plain mean over the "
            "ranks weights the ranks' rows unequally (not the whole data set's fit). Give every "
            "rank the same number of rows (a minibatch size the world size divides), or fit with "
            "DistributedQuadratureELBO and set its share to this rank's rows / the minibatch's "
            "rows. (The rows are dim 0 of the first tensor argument: if yours is not the data, "
            "pass the data first.) No rank has changed anything"
        )


def _unknown_minibatches(sites: list[MeanFieldSite]) -> dict[str, ValueError]:
    """QNVB's refusal (`minibatch_refusal`) of each block it would
    update from gradients alone whose guide does not record its minibatch and that has entries
    without gradients on this rank (by loc name): the mean over the ranks would give those
    entries the other ranks' gradients, and QNVB's own check would then pass."""
    refused = {}
    for site in sites:
        refusal = minibatch_refusal(site)
        if refusal is not None:
            refused[site.param_names["loc"]] = refusal
    return refused


def _rows_fingerprint(sites: list[MeanFieldSite]) -> torch.Tensor:
    """Count, sum, sum of squares and position-weighted sum of the subsampled rows of ``sites``
    (those of the blocks with moments, and of the blocks read from gradients whose guide records
    them): equal on every rank when (almost surely only when) the rows are. Four float64 numbers
    on the device of the first site's rows (a plate's indices on CUDA stay there), the CPU
    without rows."""
    indices = [
        index.reshape(-1) for site in sites if site.rows for _, index in sorted(site.rows.items())
    ]
    device = indices[0].device if indices else torch.device("cpu")
    flat = torch.cat(
        [index.to(device, torch.float64) for index in indices]
        or [torch.zeros(0, dtype=torch.float64)]
    )
    position = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device)
    count = torch.tensor(float(flat.numel()), dtype=torch.float64, device=device)
    return torch.stack([count, flat.sum(), (flat * flat).sum(), (flat * position).sum()])


def _balance(sizes: list[tuple[str, int]], size: int) -> dict[str, int]:
    """Blocks to ranks, largest first to the least loaded rank (ties: the lower rank)."""
    load = [0] * size
    owners = {}
    for name, numel in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += numel
    return owners
