"""``SparseQNVB``: the sparsifying QNVB (sequence paper, Algorithms 5.1-5.3) as a Pyro optimizer.

``SVI(model, AutoSpikeSlab(model), SparseQNVB(...), QuadratureELBO(rule="hadamard",
num_points=4))`` trains every ``"dirac_gauss"`` block of the guide (slab mean ``nu``, slab scale
``tau``, zero logit ``zeta``) by `sparse_qnvb_update`,
all blocks together (the sieve ranks the logits of the whole model). ``QuadratureELBO`` publishes
``g`` and ``h`` of the smooth part of the loss per block at the mixture's moments (eq. 4.2); one
SVI step is one term of ``1 / steps_per_epoch`` of the data, so the term handed to the update is

    g / S + (h_p / S) mu,        h / S + h_p / S,

with ``h_p`` the slab's prior precision (the spike-and-slab prior itself enters ``QuadratureELBO``
as a closed-form KL, so its continuous part is added here, Section 5.1.2). Everything else (other
families, a model's ``pyro.param``, blocks without published moments) goes to the fallback
optimizer of `QNVB`, beside the spike-and-slab blocks; a step
with no spike-and-slab block at all (another guide, or another ELBO) is refused with a
``TypeError``: the fallback would train everything and nothing would be sparsified.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable

import torch
from pyro.infer.util import zero_grads
from pyro.optim import PyroOptim
from torch.distributions import transform_to

from ..guides.interface import MeanFieldSite, published_moments
from .qnvb import QNVB, parameters_given, settings_words, site_label
from .qnvb_functional import (
    IDLE_STEPS_REFUSED,
    _check_number,
    check_settings,
    count_idle_step,
    idle_step_refusal,
    kept_coordinates,
)
from .sparse_functional import (
    SPARSE_COUNT_KINDS,
    SPARSE_IDLE,
    SparseQNVBBlock,
    SparseQNVBCounters,
    SparseQNVBHyperparameters,
    _check_int,
    epoch_progress,
    init_sparse_counters,
    loss_growth_message,
    mixture_moments,
    realization_message,
    result_count_values,
    result_messages,
    run_settings,
    sparse_qnvb_update,
    step_cap_message,
)
from .sparse_torch import check_ranges
from .torch_qnvb import check_precision

__all__ = ["SparseQNVB"]

_LOGIT_BOUND = 30.0
"""The guide's zero logits are written within +-30 (a probability of 1e-13): the realized
pattern's exact zeros live in `SparseQNVB.pattern` and in the guide's median."""


class SparseQNVB(QNVB):
    """The sparsifying QNVB for ``"dirac_gauss"`` guides (``AutoSpikeSlab``) in ``SVI``.

    Args:
        num_epochs: ``n_e`` (Table 1: 10), an int; a dict of optim args (as ``pyro.optim``
            optimizers take) is refused: the settings are keyword arguments.
        steps_per_epoch: ``S``, SVI steps per epoch, e.g. ``len(loader)``.
        prior_precision: ``h_p``, the slab's prior precision, ``1 / slab_scale^2`` of the model's
            `SpikeSlab` prior; ``None``: ``1 / tau_max^2``.
        num_cases: ``n_c``, the number of training cases (the size the model's plate scales
            to). It sets the trust region per case as the paper does,
            ``h_min = 1 / (n_c 2^(1 - n_e) max_lr)``; ``None`` counts one case per step, which
            divides the maximum learning rate per epoch by ``n_c / steps_per_epoch``
            (`sparse_functional`).
        fallback: the optimizer of every other parameter, as for `QNVB`.

    The keyword arguments ``target_sparsity``, ``target_free``, ``max_lr``, ``tau_max``,
    ``p_nonzero_low``, ``p_nonzero_high``, ``late_tau_max`` and ``late_epoch`` are the fields of
    `SparseQNVBHyperparameters` (defaults: Table 1;
    the initial learning rate is the guide's start, see below). Any other keyword (Pyro's
    ``optim_args`` or ``clip_args``, an ``lr``) is refused with a ``TypeError`` that lists the
    arguments SparseQNVB takes (``clip_args=None`` or ``{}``, no clipping, is accepted, as by
    `QNVB`). Table 1's ``tau_max = 0.3`` suits the paper's ternary network: a
    ReLU network whose weights are small against it diverges (the nodes lie ``tau_max`` from every
    weight), so take ``tau_max`` near its smallest layer's weight scale ('Limits' in
    ``docs/sparse_qnvb.md``). The nodes are the ELBO's: Table
    1's ``n_q = 2`` antithetic pairs are ``QuadratureELBO(rule="hadamard", num_points=4)``.

    The run starts where the guide starts: Algorithm 5.1, line 5 (``sigma = h0^(-1/2)``), read
    from the guide's initial mixture, ``h0 = 1 / sigma^2`` per coordinate, since ``SVI`` has
    already integrated the first term there. Table 1's start (``initial_lr = 1e-5``, a nonzero
    for sure) is ``AutoSpikeSlab(model, init_scale=1e-5**0.5, init_inclusion=1 - 1e-9)``; the
    guide's defaults (``init_scale=0.1``, inclusion 0.99) start at ``h0`` about 100, a bolder
    first learning rate. Blocks in a subsampled plate (local latents) are
    refused: the sieve needs every coordinate at every step. ``get_state()`` / ``set_state()``
    hold the counters, every block's state, the fallback's state and the run's settings (restored
    only into an optimizer built with the same): with the param store, a restored run continues
    bit for bit.
    """

    def __init__(
        self,
        num_epochs: int = 10,
        steps_per_epoch: int | None = None,
        target_sparsity: float = 0.97,
        *,
        target_free: float = 0.01,
        max_lr: float = 0.1,
        tau_max: float = 0.3,
        p_nonzero_low: float = 0.001,
        p_nonzero_high: float = 0.999,
        late_tau_max: float | None = None,
        late_epoch: int = 3,
        prior_precision: float | None = None,
        num_cases: int | None = None,
        fallback: PyroOptim | tuple[type, dict] | None = None,
        **unexpected: object,
    ):
        given = parameters_given(num_epochs)
        if given is not None:  # how pyro.optim.ExponentialLR and the other schedulers build it
            raise TypeError(
                f"SparseQNVB got {given} as its first argument, the way a torch optimizer is "
                "built: Pyro's learning-rate schedulers (pyro.optim.ExponentialLR({'optimizer': "
                "SparseQNVB, ...}) and the others) build their optimizer so, one per parameter, "
                "and cannot wrap SparseQNVB. Its schedule is its own: pass it to SVI as "
                "SparseQNVB(num_epochs, steps_per_epoch=..., max_lr=...) (the settings: "
                "help(SparseQNVB))"
            )
        if isinstance(num_epochs, dict):  # pyro.optim's optim_args, as a user porting code passes
            _refuse_pyro_arguments(
                f"SparseQNVB's first argument is num_epochs, an int; got the dict {num_epochs!r}"
            )
        if unexpected.get("clip_args", 0) in (None, {}):  # no clipping asked for, as in QNVB
            del unexpected["clip_args"]
        if unexpected:  # optim_args={...}, clip_args, lr: a Pyro user's habits, or a typo
            what = "SparseQNVB got the unexpected keyword argument(s) " + ", ".join(
                f"{name}={value!r}" for name, value in unexpected.items()
            )
            if "initial_lr" in unexpected:  # SparseQNVBOptimizer's argument, here the guide's
                what += (
                    " (Table 1's initial_lr is the guide's start in the Pyro front end: "
                    "AutoSpikeSlab(model, init_scale=initial_lr**0.5, init_inclusion=1 - 1e-9))"
                )
            _refuse_pyro_arguments(what)
        _check_int("num_epochs", num_epochs, 3)
        if steps_per_epoch is None:
            raise TypeError(
                "SparseQNVB needs steps_per_epoch, the number of SVI steps per epoch (e.g. "
                "len(loader)): the annealing and the sieve are scheduled in epochs"
            )
        super().__init__(fallback=fallback)
        # no initial_lr here (the guide's start is it): the field, never read, keeps Table 1's
        # value unless a max_lr below it would have it refused
        initial_lr = SparseQNVBHyperparameters.initial_lr
        if isinstance(max_lr, numbers.Real) and 0 < max_lr < initial_lr:
            initial_lr = max_lr
        self.sparse_hyperparameters = SparseQNVBHyperparameters(
            target_sparsity=target_sparsity,
            target_free=target_free,
            max_lr=max_lr,
            initial_lr=initial_lr,
            tau_max=tau_max,
            p_nonzero_low=p_nonzero_low,
            p_nonzero_high=p_nonzero_high,
            late_tau_max=late_tau_max,
            late_epoch=late_epoch,
            num_epochs=num_epochs,
        )
        self.counters = init_sparse_counters(self.sparse_hyperparameters, steps_per_epoch)
        self.steps_per_epoch = steps_per_epoch
        if prior_precision is None:
            prior_precision = tau_max**-2
        _check_number("prior_precision", prior_precision, lambda v: 0 <= v < math.inf, ">= 0")
        self.prior_precision = float(prior_precision)
        if num_cases is not None:
            _check_number("num_cases", num_cases, lambda v: 0 < v < math.inf, "finite and > 0")
        self.num_cases = num_cases
        self.cases_per_step = 1.0 if num_cases is None else num_cases / steps_per_epoch
        self.blocks: dict[str, SparseQNVBBlock] = {}
        self.first_loss: float | None = None
        """The loss of the first step with spike-and-slab moments (`_check_growth`)."""
        self._sparse_warned: set[str] = set()

    def __repr__(self) -> str:
        hp = self.sparse_hyperparameters
        defaults = SparseQNVBHyperparameters()
        parts = []
        if hp.num_epochs != defaults.num_epochs:  # in the signature's order
            parts.append(f"num_epochs={int(hp.num_epochs)}")
        parts.append(f"steps_per_epoch={int(self.steps_per_epoch)}")
        parts += settings_words(hp, defaults, skip=("num_epochs", "initial_lr"))  # none here
        if self.prior_precision != hp.tau_max**-2:
            parts.append(f"prior_precision={self.prior_precision!r}")
        if self.num_cases is not None:
            parts.append(f"num_cases={self.num_cases!r}")
        parts += self._fallback_words()
        return f"SparseQNVB({', '.join(parts)})"

    @property
    def epoch(self) -> int:
        """The epoch of the next step (1-based, at most ``num_epochs``)."""
        hp = self.sparse_hyperparameters
        return epoch_progress(self.counters.step, hp, self.steps_per_epoch)[0]

    @property
    def finished(self) -> bool:
        """Whether the final epoch has begun, i.e. the pattern is realized: SVI step
        ``(num_epochs - 1) steps_per_epoch + 1`` has been taken. A loop that takes fewer steps
        per epoch than the declared ``steps_per_epoch`` ends before this: check it after
        training."""
        hp = self.sparse_hyperparameters
        return self.counters.step > (hp.num_epochs - 1) * self.steps_per_epoch

    def pattern(self) -> dict[str, torch.Tensor]:
        """Per block (loc parameter name, in the names' order), 1 where a coordinate is nonzero,
        0 where it is an exact zero: the realized pattern once `finished`, else where
        ``p_nonzero > 1/2`` (the pattern a realization now would give)."""
        realized = self.finished
        return {
            name: b.pattern if realized else (b.p_nonzero > 0.5).to(b.p_nonzero.dtype)
            for name, b in sorted(self.blocks.items())
        }

    def p_nonzero(self) -> torch.Tensor:
        """The probabilities of a nonzero of all blocks, flat (the paper's Fig. 4), the blocks in
        the order of their loc parameters' names (`pattern`'s keys)."""
        return torch.cat([self.blocks[name].p_nonzero.reshape(-1) for name in sorted(self.blocks)])

    def __call__(self, params: Iterable[torch.Tensor], *args, **kwargs) -> None:
        """Update the ``"dirac_gauss"`` blocks among ``params`` together; the rest: fallback.

        Raises:
            TypeError: when no ``"dirac_gauss"`` block came with moments in this step (a guide
                other than ``AutoSpikeSlab``, or an ELBO other than ``QuadratureELBO``); the
                message says which, and nothing is updated. Also for a block narrower than
                float32 (`check_precision`: a bfloat16 guide's means come out silently wrong).
            ValueError: for the third step in a row whose terms the guard dropped at every
                coordinate (`_refuse_if_idle`), or for a block with a frozen parameter
                (``requires_grad`` false: the sieve cannot hold a block out); nothing is updated.
        """
        params = list(params)
        received = {id(p) for p in params}
        sites: list[tuple[MeanFieldSite, torch.Tensor, torch.Tensor]] = []
        families: set[str] = set()  # of the blocks published in this step
        loss = None  # the step's, published with the moments (one loss for all blocks)
        for p in params:
            moments = published_moments(p)
            if moments is not None:
                families.add(moments.site.family)
            if moments is None or moments.site.family != "dirac_gauss":
                continue
            site = moments.site
            if any(id(leaf) not in received for leaf in site.params.values()):
                self._warn_once(
                    f"missing {site.name}",
                    f"SparseQNVB: site {site.name!r} came without all of its loc, scale and logit "
                    "parameters in this step (frozen or detached?); they go to the fallback",
                )
                continue
            frozen = [role for role, leaf in site.params.items() if not leaf.requires_grad]
            if frozen:
                raise ValueError(
                    f"SparseQNVB: site {site.name!r} has its {frozen} parameters frozen "
                    "(requires_grad=False), which SparseQNVB would update all the same: the sieve "
                    "ranks every coordinate of every block together at every step, so a site "
                    "cannot be held out of it. Unfreeze them (requires_grad_(True)), or fix the "
                    "site's values in the model (pyro.condition) and leave it out of the guide"
                )
            # rows: a subsampled plate (a poutine.scale alone is divided out of the moments)
            if site.rows or site.rows is None:
                raise ValueError(
                    f"SparseQNVB: site {site.name!r} is in a subsampled plate; the sieve ranks "
                    "every coordinate at every step, so only global sites can be sparsified. Fit "
                    "local latents with another guide (e.g. AutoMeanFieldNormal on a sub-model)"
                )
            check_precision(site.values["loc"], site_label(site.name), "SparseQNVB")
            sites.append((site, moments.g, moments.h))
            loss = moments.loss if loss is None else loss
        if params and "dirac_gauss" not in families:
            _refuse_unpaired(len(params), families)
        paired = {id(leaf) for site, _, _ in sites for leaf in site.params.values()}
        if loss is not None:
            self._check_growth(loss, [site.values["loc"].dtype for site, _, _ in sites])
        # in the loc parameters' names' order, not that of SVI's set of params (the tensors'
        # addresses): the sieve breaks ties by position, and p_nonzero() reads the blocks so
        sites.sort(key=lambda item: item[0].param_names["loc"])
        rest = [p for p in params if id(p) not in paired]
        with self._fallback_first(params, rest, *args, **kwargs):
            if sites:
                self._update(sites, params)
        self.num_steps += 1

    def _check_growth(self, loss: torch.Tensor, dtypes: list[torch.dtype]) -> None:
        """Warn once where the step's loss (published by ``QuadratureELBO`` with the moments)
        grew beyond ``first + 1000 |first|``, as `SparseQNVBOptimizer` does
        (`loss_growth_message`): the Gaussian means
        may be diverging. The first loss is kept in `get_state`; ``dtypes``: the means'."""
        if "growth" in self._warned:
            return
        value = float(loss)  # (one read from the device, this optimizer's only)
        if self.first_loss is None:
            self.first_loss = value
            return
        message = loss_growth_message(
            self.first_loss,
            value,
            self.counters.step + 1,
            "the loss (QuadratureELBO's)",
            cap=self._step_cap,
            dtypes=dtypes,
        )
        if message is not None:
            self._warn_once("growth", f"SparseQNVB: {message}")

    def _step_cap(self) -> str:
        """Which setting bounds the steps on the means now (`step_cap_message`)."""
        hp, steps = self.sparse_hyperparameters, self.steps_per_epoch
        return step_cap_message(self.counters, hp, steps, self.cases_per_step)

    @torch.no_grad()
    def _update(
        self,
        sites: list[tuple[MeanFieldSite, torch.Tensor, torch.Tensor]],
        params: list[torch.Tensor],
    ) -> None:
        """One term of `sparse_qnvb_update` for every spike-and-slab block, written into the
        blocks, the counters and the guide's parameters, unless `_refuse_if_idle` refuses it."""
        hp, steps = self.sparse_hyperparameters, self.steps_per_epoch
        blocks, g_terms, h_terms = [], [], []
        for site, g, h in sites:
            name = site.param_names["loc"]
            block = self.blocks.get(name)
            if block is None or block.nu.shape != g.shape:
                prior_share = self.prior_precision / steps
                dtype = site.values["loc"].dtype
                check_ranges("SparseQNVB: ", hp, dtype, self.cases_per_step, prior_share)
                block = self._initial_block(site)
            blocks.append(block)
            g_terms.append(g / steps + (self.prior_precision / steps) * block.mu)
            h_terms.append(h / steps + self.prior_precision / steps)
        realized = realization_message(blocks, self.counters, hp, steps)
        result = sparse_qnvb_update(
            blocks, self.counters, g_terms, h_terms, hp, steps, self.cases_per_step
        )
        counts = result_count_values(result)
        self._refuse_if_idle(sites, params, kept_coordinates([counts], SPARSE_COUNT_KINDS))
        self.counters = result.counters
        if realized is not None:
            self._warn_once("realization", f"SparseQNVB: {realized}")
        for message in result_messages(result, self._sparse_warned, self._step_cap, counts):
            self._warn_once(message, f"SparseQNVB: {message} (this warning is shown once)")
        for (site, _, _), block in zip(sites, result.blocks):
            self.blocks[site.param_names["loc"]] = block
            p = block.p_nonzero
            logit = (torch.log1p(-p) - torch.log(p)).clamp(-_LOGIT_BOUND, _LOGIT_BOUND)
            scale_leaf = site.params["scale"]
            new_u = transform_to(site.param_constraints["scale"]).inv(block.tau)
            site.params["loc"].data.copy_(block.nu)
            scale_leaf.data.copy_(torch.where(torch.isfinite(new_u), new_u, scale_leaf.data))
            site.params["logit"].data.copy_(logit)

    def _refuse_if_idle(
        self,
        sites: list[tuple[MeanFieldSite, torch.Tensor, torch.Tensor]],
        params: list[torch.Tensor],
        kept: int,
    ) -> None:
        """Refuse the `IDLE_STEPS_REFUSED`-th step in a row whose terms the guard dropped at every
        coordinate of every block (``kept`` of them), the rule of every QNVB optimizer
        (`count_idle_step`), before the blocks, the counters or the guide take the step and
        before the fallback steps: the gradients of ``params`` are zeroed, as ``SVI`` zeroes
        them after a step, so that a next step may go on."""
        total = sum(site.values["loc"].numel() for site, _, _ in sites)
        self._idle_steps = count_idle_step(self._idle_steps, kept, total)
        if self._idle_steps < IDLE_STEPS_REFUSED:
            return
        zero_grads(params)
        raise idle_step_refusal(
            "SparseQNVB",
            self._idle_steps,
            total,
            [site_label(site.name) for site, _, _ in sites],
            [site.values["loc"].dtype for site, _, _ in sites],
            unit="block",
            words=SPARSE_IDLE,
            untaken="the blocks, counters and guide are as before it and the fallback did not step",
        )

    def _initial_block(self, site: MeanFieldSite) -> SparseQNVBBlock:
        """Algorithm 5.1, lines 3-5, at the guide's current factor: ``g0 = 0`` and the curvature
        sums consistent with its standard deviations, ``h0 = 1 / sigma^2`` (line 5 read
        backwards: the first term was already integrated at the guide's ``sigma``)."""
        nu = site.values["loc"].detach().clone()
        tau = site.values["scale"].detach().clone()
        p = torch.sigmoid(-site.values["logit"].detach())
        mu, sigma = mixture_moments(p, nu, tau)
        h0 = sigma.pow(-2)
        if not bool(torch.isfinite(h0).all()):
            raise ValueError(
                f"SparseQNVB: site {site.name!r} starts with a mixture standard deviation of "
                f"{sigma.min().item():.3g}, whose curvature 1 / sigma^2 overflows; start the guide "
                "wider (AutoSpikeSlab(model, init_scale=...), e.g. 1e-5**0.5 as in Table 1)"
            )
        return SparseQNVBBlock(
            nu=nu,
            tau=tau,
            p_nonzero=p,
            mu=mu,
            sigma=sigma,
            g0=torch.zeros_like(nu),
            h0=h0,
            g1=torch.zeros_like(nu),
            h1=torch.zeros_like(nu),
            pattern=torch.ones_like(nu),
        )

    def _settings(self) -> dict:
        return run_settings(
            self.sparse_hyperparameters, self.steps_per_epoch, self.num_cases, self.prior_precision
        )

    def get_state(self) -> dict:
        """Deep copies of the counters, the count of idle steps in a row (`count_idle_step`),
        the first step's loss, every block's state and the fallback's state, and the settings
        of the run
        (`run_settings`)."""
        return {
            "sparse_qnvb": {
                "num_steps": self.num_steps,
                "idle_steps": self._idle_steps,
                "counters": tuple(self.counters),
                "first_loss": self.first_loss,
                "blocks": {
                    name: {k: v.clone() for k, v in b._asdict().items()}
                    for name, b in self.blocks.items()
                },
                "settings": self._settings(),
            },
            "fallback": self._fallback_state(),
        }

    def set_state(self, state_dict: dict) -> None:
        """Restore what `get_state` returned, into an optimizer built with the same
        settings (hyperparameters, ``steps_per_epoch``, ``num_cases``, ``prior_precision``): a
        ``ValueError`` names any that differs, and nothing is restored."""
        state = state_dict["sparse_qnvb"]
        check_settings("SparseQNVB.set_state", state["settings"], self._settings())
        self.num_steps = state["num_steps"]
        self._idle_steps = state.get("idle_steps", 0)  # (absent from earlier states)
        self.counters = SparseQNVBCounters(*state["counters"])
        self.first_loss = state.get("first_loss")  # absent from states saved before it was kept
        self.blocks = {
            name: SparseQNVBBlock(**{k: v.clone() for k, v in b.items()})
            for name, b in state["blocks"].items()
        }
        self._restore_fallback(state_dict["fallback"])


def _refuse_pyro_arguments(what: str) -> None:
    """Raise the ``TypeError`` for Pyro's ``optim_args`` (a dict, first or by keyword), its
    ``clip_args`` or any other keyword `SparseQNVB` does not take, naming those it takes."""
    names = [
        p.name if p.kind == p.POSITIONAL_OR_KEYWORD else f"{p.name}="
        for p in inspect.signature(SparseQNVB.__init__).parameters.values()
        if p.name != "self" and p.kind != p.VAR_KEYWORD
    ]
    raise TypeError(
        f"{what}. SparseQNVB takes its settings as keyword arguments, not as a dict of optim args "
        "like pyro.optim optimizers (and no clip_args: tau_max and max_lr bound its steps): "
        f"SparseQNVB({', '.join(names)}), e.g. SparseQNVB(steps_per_epoch=len(loader), "
        "num_cases=len(dataset)) (the settings: help(SparseQNVB))"
    )


def _refuse_unpaired(num_params: int, families: set[str]) -> None:
    """Raise the ``TypeError`` of a step in which no spike-and-slab block came with moments: the
    fallback would train every parameter and nothing would be sparsified."""
    if families:
        found = (
            f"the guide's blocks are {sorted(families)}, not 'dirac_gauss' (a spike-and-slab guide)"
        )
    else:
        found = (
            "no block came with the moments QuadratureELBO publishes (the ELBO is not "
            "QuadratureELBO, e.g. Trace_ELBO or GumbelSpikeSlabELBO, or the guide is not a mean "
            "field, e.g. AutoDelta or AutoMultivariateNormal)"
        )
    raise TypeError(
        f"SparseQNVB: none of the {num_params} parameters it received belongs to a spike-and-slab "
        f"block it can sparsify: {found}. SparseQNVB needs the guide AutoSpikeSlab(model) and the "
        "ELBO QuadratureELBO(rule='hadamard', num_points=4); for another guide or ELBO use QNVB "
        "or a Pyro optimizer such as pyro.optim.Adam"
    )
