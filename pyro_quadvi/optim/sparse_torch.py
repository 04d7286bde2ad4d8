"""The sparsifying QNVB as a ``torch.optim.Optimizer`` for plain PyTorch networks.

Every weight ``theta_i`` of the network becomes a Dirac-Gauss mixture (sequence paper, eq. 4.1),
trained by Algorithms 5.1-5.3 (`sparse_functional`). A step sets the
weights to the quadrature nodes ``mu + sigma * x_k`` of the mixture's moments (eq. 4.2), evaluates
the closure (the mean loss per case of a minibatch, and its backward) at each, forms
(Algorithm 4.1)

    g = sum_k w_k grad_k,        h = sum_k w_k grad_k * x_k / sigma,

and hands the minibatch's term to `sparse_qnvb_update`:
``(n_c / S) g + (h_p / S) mu`` and ``(n_c / S) h + h_p / S`` for ``n_c`` training cases in ``S``
steps per epoch and a Gaussian slab prior of precision ``h_p`` (each case carries ``1 / n_c`` of
it, Section 5.1.2). After a step the weights hold the mixture mean ``mu = p_nonzero nu``; once the
final epoch has realized the pattern, its zeros are exact zeros.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from ..infer.batched import user_stacklevel
from ..quadrature import make_rule
from ..quadrature.base import draw_device
from ..quadrature.hadamard import HadamardRule
from ..store import shortened
from .qnvb_functional import (
    IDLE_STEPS_REFUSED,
    _check_number,
    cast_state_to,
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
    epoch_progress,
    init_sparse_block,
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
from .torch_qnvb import (
    CheckpointHooks,
    _parameter_label,
    changed_parameters,
    check_finite_loss,
    check_generator,
    check_representable,
    check_saved_parameters,
    checked_parameters,
    closure_moments,
    data_moments,
    drop_autocast_copies,
    group_params,
    refuse_added_guide_parameters,
    refuse_duplicate_parameters,
    refuse_grad_scaler,
    refuse_half_precision,
    refuse_inference_mode,
    refuse_run_guides,
    restore_means,
    sampled_values,
    standard_normal,
    weight_decay_conversion,
    written_marks,
)

__all__ = ["SparseQNVBOptimizer"]

_BLOCK_NAMES = SparseQNVBBlock._fields


class _SparseGroup(dict):
    """A parameter group of `SparseQNVBOptimizer`: it holds only ``params``, and reading
    any setting (torch's lr schedulers read ``"lr"``) is a ``KeyError`` that says why."""

    def __missing__(self, key: object):
        raise KeyError(
            f"SparseQNVBOptimizer's parameter groups hold no {key!r}: the optimizer runs its own "
            "learning-rate schedule (initial_lr up to max_lr, Algorithm 5.3), so torch's lr "
            "schedulers do not apply; set max_lr, initial_lr and num_epochs in the constructor"
        )


def check_ranges(
    owner: str,
    hp: SparseQNVBHyperparameters,
    dtype: torch.dtype,
    cases_per_step: float,
    prior_share: float,
) -> None:
    """Refuse settings that a step in ``dtype`` would turn into an infinity, or into a 0 that
    lifts a floor: the cases per step ``num_cases / steps_per_epoch`` and the prior's share
    ``prior_precision / steps_per_epoch`` beyond its range, and a ``tau_max`` or
    ``late_tau_max`` whose square or inverse square is (`SparseQNVBHyperparameters.check_widths`).
    ``owner``: ``"SparseQNVBOptimizer: "`` or ``"SparseQNVB: "``."""
    check_representable(owner, "num_cases / steps_per_epoch", cases_per_step, dtype)
    check_representable(owner, "prior_precision / steps_per_epoch", prior_share, dtype)
    hp.check_widths(owner, dtype)


class SparseQNVBOptimizer(CheckpointHooks, torch.optim.Optimizer):
    """Sparsifying quasi-Newton variational Bayes for ``torch.nn`` parameters (sequence paper,
    Algorithms 5.1-5.3).

    Args:
        params: the network's parameters (one group: the sieve ranks all of them together, so no
            hyperparameter is set per group), in float32 or float64 (half precision is refused:
            keep the parameters in float32 and use ``torch.autocast`` for the forward).
        num_cases: ``n_c``, the number of training cases: the closure returns a mean per case.
        steps_per_epoch: ``S``, steps (minibatches) per epoch, e.g. ``len(loader)``.
        late_tau_max: an extension (``None``: off, the paper's algorithm): the curvature floor
            ``1 / late_tau_max^2`` from epoch ``late_epoch`` on, the slab still at most
            ``tau_max`` (see
            `SparseQNVBHyperparameters`).
        late_epoch: the epoch from which ``late_tau_max`` holds.
        prior_precision: ``h_p``, precision of the Gaussian slab prior on a nonzero; ``None``:
            ``1 / tau_max^2``, the precision eq. 4.6 assumes in the zero logits.
        generator: random generator for the initial position in the quadrature sequence (torch's
            global generator when ``None``); when given, its state is saved with
            `state_dict`.
        weight_decay: refused (a ``TypeError``, and a group's ``"weight_decay"`` a
            ``ValueError``): the prior is the slab's ``prior_precision``, and torch's coupled
            ``weight_decay`` is ``prior_precision = weight_decay * num_cases``.

    The keyword arguments ``num_epochs``, ``target_sparsity``, ``target_free``, ``max_lr``,
    ``initial_lr``, ``tau_max``, ``p_nonzero_low``, ``p_nonzero_high`` and ``num_pairs`` are the
    fields of `SparseQNVBHyperparameters`
    (defaults: the paper's Table 1).

    Nodes come from the Hadamard cross-polytope sequence (sequence paper, Algorithm 3.1):
    ``num_pairs`` antithetic pairs, ``2 num_pairs`` closure evaluations per step, starting at a
    random iterate (Algorithm 5.1, line 2) and moving ``num_pairs`` iterates per step.
    ``optimizer.state[p]`` holds the mixture's state (`SparseQNVBBlock` fields:
    ``nu``, ``tau``, ``p_nonzero``, ``mu``, ``sigma``, the sums, ``pattern``). Between steps
    the parameters hold the mixture means ``mu``; a change made to them there (a
    ``net.load_state_dict``, ``p.data = ...``, a zeroed layer) is taken by the next step (or
    `sampled_params`, or `state_dict`) as the new mean of the coordinates it
    changed (`_take_edits`).

    The closure runs once per node, at perturbed weights: a ``BatchNorm`` (any layer with running
    state) in train mode updates its running statistics ``2 num_pairs`` times per step at those
    weights, and its own ``weight`` and ``bias``, if passed here, enter the sieve and can be
    zeroed. Keep such layers in eval mode while training, or leave their parameters out of
    ``params`` (and train them with another optimizer).

    The learning rate follows the optimizer's own schedule (``initial_lr`` rising to
    ``max_lr``, Algorithm 5.3): its groups hold no ``"lr"``, and torch's lr schedulers
    (``StepLR``, ``OneCycleLR``, ...) are refused with a ``KeyError`` that says so.
    `sampled_params` sets the weights to a draw of the mixtures (predictions);
    ``copy.deepcopy`` and ``pickle`` keep the whole optimizer (not its hooks).

    Example:

        optimizer = SparseQNVBOptimizer(
            net.parameters(), num_cases=len(dataset), steps_per_epoch=len(loader)
        )
        for epoch in range(optimizer.hyperparameters.num_epochs):
            for x, y in loader:
                def closure():
                    loss = criterion(net(x), y)      # mean over the batch
                    loss.backward()
                    return loss
                optimizer.step(closure)
    """

    def __init__(
        self,
        params: Iterable,
        *,
        num_cases: int,
        steps_per_epoch: int,
        num_epochs: int = 10,
        target_sparsity: float = 0.97,
        target_free: float = 0.01,
        max_lr: float = 0.1,
        initial_lr: float = 1e-5,
        tau_max: float = 0.3,
        p_nonzero_low: float = 0.001,
        p_nonzero_high: float = 0.999,
        late_tau_max: float | None = None,
        late_epoch: int = 3,
        num_pairs: int = 2,
        prior_precision: float | None = None,
        generator: torch.Generator | None = None,
        weight_decay: float | None = None,
    ):
        _check_number("num_cases", num_cases, lambda v: 0 < v < math.inf, "> 0")
        if weight_decay is not None:
            raise TypeError(
                "SparseQNVBOptimizer takes no weight_decay. "
                + _weight_decay_conversion(weight_decay, float(num_cases), prior_precision)
            )
        self.hyperparameters = SparseQNVBHyperparameters(
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
            num_pairs=num_pairs,
        )
        if prior_precision is None:
            prior_precision = tau_max**-2
        _check_number("prior_precision", prior_precision, lambda v: 0 <= v < math.inf, ">= 0")
        check_generator("SparseQNVBOptimizer", generator)
        self.counters = init_sparse_counters(self.hyperparameters, steps_per_epoch)
        # before the groups: add_param_group's messages and range checks read them
        self.num_cases = float(num_cases)
        self.prior_precision = float(prior_precision)
        self.steps_per_epoch = steps_per_epoch
        super().__init__(params, {})
        self.rule = make_rule("hadamard", 2 * num_pairs)
        self.generator = generator
        self.sequence_offset: int | None = None
        self.first_loss: float | None = None
        self._warned: set[str] = set()
        self._written: dict[int, tuple[int, int]] = {}  # id(p) -> (_version, data_ptr)
        self._loaded: dict | None = None  # the "sparse_qnvb" entry being loaded (_check_loaded)
        # steps in a row whose terms the guard dropped everywhere (count_idle_step; saved)
        self._idle_steps = 0
        self._register_checkpoint_hooks()

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; hyperparameters cannot differ per group (the sieve is global), and a
        half-precision parameter is refused by name. A refused group is not added."""
        group = group_params(param_group)
        if isinstance(group, dict):
            extra = sorted(set(group) - {"params", "param_names"})
            if "weight_decay" in extra:
                raise ValueError(
                    "SparseQNVBOptimizer: a parameter group does not take weight_decay. "
                    + _weight_decay_conversion(
                        group["weight_decay"], self.num_cases, self.prior_precision
                    )
                )
            if extra:
                raise ValueError(
                    f"SparseQNVBOptimizer: parameter groups take no options ({extra} given): the "
                    "sieve ranks all parameters together, so every hyperparameter is global; "
                    "pass them to the constructor"
                )
            group = _SparseGroup(group)
        position = sum(len(g["params"]) for g in self.param_groups)
        refuse_half_precision(group, position, "SparseQNVBOptimizer")
        refuse_duplicate_parameters(group, position, "SparseQNVBOptimizer")
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            for dtype in {p.dtype for p in group["params"] if isinstance(p, torch.Tensor)}:
                self._check_ranges(dtype)
            refuse_added_guide_parameters("SparseQNVBOptimizer", group["params"], position)
        super().add_param_group(group)
        self._guides_unchecked = True

    def _check_ranges(self, dtype: torch.dtype) -> None:
        """Refuse settings that the step's terms in ``dtype`` would turn into an infinity
        (`check_ranges`), and an ``initial_lr`` whose curvature ``1 / initial_lr`` rounds to 0
        there (``sigma = (1 / initial_lr)^(-1/2)`` would start infinite)."""
        if not dtype.is_floating_point:
            return
        owner, steps = "SparseQNVBOptimizer: ", self.steps_per_epoch
        hp = self.hyperparameters
        check_ranges(owner, hp, dtype, self.num_cases / steps, self.prior_precision / steps)
        initial_lr = hp.initial_lr
        tiny = torch.finfo(dtype).tiny
        if 1.0 / initial_lr < tiny:
            raise ValueError(
                f"{owner}initial_lr={initial_lr!r} gives the initial curvature 1 / initial_lr "
                f"= {1.0 / initial_lr:.3g}, below the smallest normal number of {dtype} "
                f"({tiny:.3g}), so sigma = (1 / initial_lr)^(-1/2) would start infinite: pass "
                f"an initial_lr below {1.0 / tiny:.3g} (Algorithm 5.3 starts at 1e-5), or use "
                "float64 parameters"
            )

    @property
    def epoch(self) -> int:
        """The epoch of the next step (1-based, at most ``num_epochs``)."""
        return epoch_progress(self.counters.step, self.hyperparameters, self.steps_per_epoch)[0]

    @property
    def finished(self) -> bool:
        """Whether the final epoch has begun, i.e. the pattern is realized: step
        ``(num_epochs - 1) steps_per_epoch + 1`` has been taken, and from then on the pattern's
        zeros are exact zeros of the weights. A loop that takes fewer steps per epoch than the
        declared ``steps_per_epoch`` ends before this: check it after training."""
        hp = self.hyperparameters
        return self.counters.step > (hp.num_epochs - 1) * self.steps_per_epoch

    def _params(self) -> list[torch.Tensor]:
        """Every parameter that requires grad, its state made on first use; a parameter changed
        since the optimizer last wrote it gives its mixture (`_take_edits`)."""
        out = [p for p, _ in checked_parameters(self, "SparseQNVBOptimizer")]
        if not out:
            raise ValueError("SparseQNVBOptimizer has no parameter that requires grad")
        for p in out:
            if not self.state[p]:
                self.state[p].update(init_sparse_block(p, self.hyperparameters)._asdict())
        self._take_edits(out)
        return out

    def _take_edits(self, params: list[torch.Tensor]) -> None:
        """Take the value of every coordinate changed since the optimizer last wrote it as the
        mean of its mixture (sequence paper, eq. 4.2: ``mu = p_nonzero nu``).

        A parameter changed as a tensor (`changed_parameters`: its version or storage) is
        compared with its mean coordinate by coordinate, and only the coordinates whose value
        differs change: a written ``v != 0`` becomes a certain nonzero, ``p_nonzero = 1`` and
        ``nu = v``; a written exact zero a certain zero, ``p_nonzero = 0`` (and ``nu = 0``).
        Either way ``mu = v`` and eq. 4.2 gives ``sigma`` (``tau``, or ``0``), ``tau`` and the
        sums stay, and once the pattern is realized (`finished`) it follows (``1``, or
        ``0``). A parameter cast or moved (``net.float()``) takes its whole state along
        (`cast_state_to`). Parameters without a state yet
        are left alone.
        """
        realized = self.finished
        for p in changed_parameters(params, self._written):
            state = self.state.get(p)
            if not state:
                continue
            cast_state_to(p, state)
            value = p.detach()
            changed = value != state["mu"]
            nonzero = (value != 0).to(value.dtype)
            nu = torch.where(changed, value, state["nu"])
            p_nonzero = torch.where(changed, nonzero, state["p_nonzero"])
            mu, sigma = mixture_moments(p_nonzero, nu, state["tau"])
            state["nu"], state["p_nonzero"] = nu, p_nonzero
            state["mu"] = torch.where(changed, mu, state["mu"])
            state["sigma"] = torch.where(changed, sigma, state["sigma"])
            if realized:
                state["pattern"] = torch.where(changed, nonzero, state["pattern"])
            self._written.update(written_marks([p]))

    def _block(self, p: torch.Tensor) -> SparseQNVBBlock:
        return SparseQNVBBlock(*(self.state[p][name] for name in _BLOCK_NAMES))

    def _optimized(self) -> list[torch.Tensor]:
        """The parameters optimized, in the groups' order: those holding a state, frozen ones
        too (the states made and the edits taken first)."""
        self._params()
        return [p for group in self.param_groups for p in group["params"] if self.state.get(p)]

    def p_nonzero(self) -> torch.Tensor:
        """The probabilities of a nonzero of the parameters optimized (frozen ones too, as
        `sparsity` counts them), flat in the groups' order (the paper's Fig. 4)."""
        return torch.cat([self._block(p).p_nonzero.reshape(-1) for p in self._optimized()])

    def sparsity(self) -> float:
        """The fraction of parameters (of those optimized: holding a state, frozen ones too)
        that are exactly zero now."""
        params = self._optimized()
        zeros = sum(int((p == 0).sum()) for p in params)
        return zeros / sum(p.numel() for p in params)

    @contextmanager
    def sampled_params(self, generator: torch.Generator | None = None) -> Iterator[None]:
        """Set every weight to one draw of its Dirac-Gauss mixture (sequence paper, eq. 4.1):
        exactly zero with probability ``1 - p_nonzero``, else ``nu + tau * eps`` with
        ``eps ~ N(0, 1)``; back to the mixture means ``mu`` on exit (also when the block raises).

        Args:
            generator: the random generator of the draw (torch's global one when ``None``).

        Once the final epoch has realized the pattern, its zeros are drawn as zeros; before
        (`finished` is false) a ``UserWarning``, once, says that the draw is not yet of the
        sparse posterior. See
        `QNVBOptimizer.sampled_params`
        for a Bayesian model average.
        """
        params = self._params()
        if not self.finished and "unfinished" not in self._warned:
            self._warned.add("unfinished")
            hp = self.hyperparameters
            warnings.warn(
                f"SparseQNVBOptimizer.sampled_params: the sieve has not finished (step "
                f"{self.counters.step}; the pattern is realized at step "
                f"{(hp.num_epochs - 1) * self.steps_per_epoch + 1} = (num_epochs - 1) * "
                f"steps_per_epoch + 1, with num_epochs={hp.num_epochs}, steps_per_epoch="
                f"{self.steps_per_epoch}), so these draws are not of the sparse posterior. "
                "Expected during training; if training is over, steps_per_epoch is more than the "
                "steps your loop takes per epoch: set it to len(loader) (this warning is shown "
                "once; `finished` tells)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        draws = []
        for p in params:
            block = self._block(p)
            at = draw_device(generator, p.device)
            u = torch.rand(p.shape, generator=generator, dtype=p.dtype, device=at).to(p.device)
            gauss = block.nu + block.tau * standard_normal(p, generator)
            draws.append(torch.where(u < block.p_nonzero, gauss, torch.zeros_like(gauss)))
        with sampled_values(params, draws, [self.state[p]["mu"] for p in params], self._written):
            yield

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Evaluate ``closure`` at every quadrature node and update the mixtures (one term).

        Args:
            closure: computes the mean loss per case of a minibatch at the current parameter
                values, calls ``backward()`` on it and returns it. Required: ``None`` (torch's
                default, which ``torch.amp.GradScaler.step(optimizer)`` passes) is refused
                with a ``TypeError``, after the scaler's refusal (`refuse_grad_scaler`).

        Returns:
            The quadrature average of the closure's loss.

        Every step's term counts ``num_cases / steps_per_epoch`` cases, whatever its minibatch's
        size, as `QNVBOptimizer` weighs every minibatch's mean by
        ``likelihood_weight``: a short last batch of ``b`` cases counts each of them
        ``(num_cases / steps_per_epoch) / b`` times (see the docs). A step whose average loss
        exceeds the first step's by more than 1000 times the first's magnitude gets a
        ``RuntimeWarning`` (once): the means may be diverging. The third step in a row whose
        terms the guard dropped at every coordinate is refused with a ``ValueError``
        (`_refuse_if_idle`).
        """
        refuse_grad_scaler(self)
        refuse_inference_mode(self)
        if closure is None:
            raise TypeError(
                "SparseQNVBOptimizer.step takes a closure (step(closure)): it evaluates the "
                "loss itself at every quadrature node"
            )
        self._refuse_group_settings()
        self._refuse_frozen_at_realization()
        params = self._params()
        first = params[0]
        dim = sum(p.numel() for p in params)
        if self.sequence_offset is None:  # Algorithm 5.1, line 2
            positions = max(1, HadamardRule.sequence_length(dim) // self.hyperparameters.num_pairs)
            at = draw_device(self.generator, None)  # the generator's device (a CUDA one too)
            self.sequence_offset = int(
                torch.randint(positions, (), generator=self.generator, device=at)
            )
        nodes = self.rule.draw(
            dim,
            step=self.sequence_offset + self.counters.step,
            dtype=first.dtype,
            device=first.device,
        )
        blocks = [self._block(p) for p in params]
        mus, sigmas = [b.mu for b in blocks], [b.sigma for b in blocks]
        try:
            loss_avg, moments = closure_moments(
                params, mus, sigmas, nodes, closure, "SparseQNVBOptimizer"
            )
            if getattr(self, "_guides_unchecked", True):
                refuse_run_guides(self, params, mus)
            value = check_finite_loss(
                loss_avg,
                params,
                mus,
                "SparseQNVBOptimizer",
                sigmas=sigmas,
                field_hint=(
                    " The mixtures' moments went out of the parameters' range: check "
                    "initial_lr, max_lr and tau_max (sigma starts at initial_lr^(1/2)), or use "
                    "float64 parameters"
                ),
            )
            self._check_growth(value, [p.dtype for p in params])
            scale = self.num_cases / self.steps_per_epoch
            prior = self.prior_precision / self.steps_per_epoch
            g_terms, h_terms = [], []
            for block, moment in zip(blocks, moments):
                g, gx = data_moments(moment, block.mu)
                sigma = block.sigma
                g_terms.append(scale * g + prior * block.mu)
                h_terms.append(scale * torch.where(sigma > 0, gx / sigma, 0.0) + prior)
            realized = realization_message(
                blocks, self.counters, self.hyperparameters, self.steps_per_epoch
            )
            result = sparse_qnvb_update(
                blocks,
                self.counters,
                g_terms,
                h_terms,
                self.hyperparameters,
                self.steps_per_epoch,
                cases_per_step=scale,
            )
            counts = result_count_values(result)
            self._refuse_if_idle(params, mus, kept_coordinates([counts], SPARSE_COUNT_KINDS))
            self.counters = result.counters
            for p, block in zip(params, result.blocks):
                self.state[p].update(block._asdict())
                p.copy_(block.mu)
                p.grad = None
            drop_autocast_copies()
            self._written.update(written_marks(params))
        except BaseException:  # whatever failed, the parameters are left at their means
            restore_means(params, [self.state[p]["mu"] for p in params])
            raise
        for message in result_messages(result, self._warned, self._step_cap, counts):
            warnings.warn(
                f"SparseQNVBOptimizer: {message} (this warning is shown once)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        if realized is not None and "realization" not in self._warned:
            self._warned.add("realization")
            warnings.warn(
                f"SparseQNVBOptimizer: {realized}", RuntimeWarning, stacklevel=user_stacklevel()
            )
        return loss_avg

    def _refuse_frozen_at_realization(self) -> None:
        """Refuse the realization step (the first of the final epoch, Algorithm 5.2 line 5)
        while a parameter that holds state is frozen (``requires_grad_(False)``): the step sets
        the weights it updates to their realized values and the sieve ranks those alone, so a
        frozen one would keep its mixture means (no exact zeros, although `finished` is then
        true) and the pattern's budget would be spent on the others. Writing realized values
        into a frozen parameter is no answer either: freezing says "leave it as it is". Nothing
        is evaluated or changed before the refusal."""
        hp = self.hyperparameters
        if self.counters.step != (hp.num_epochs - 1) * self.steps_per_epoch:
            return
        frozen, position = [], 0
        for group in self.param_groups:
            names = group.get("param_names")
            for k, p in enumerate(group["params"]):
                if not p.requires_grad and self.state.get(p):
                    frozen.append(_parameter_label(position, None if names is None else names[k]))
                position += 1
        if frozen:
            raise ValueError(
                f"SparseQNVBOptimizer.step: this step (step {self.counters.step + 1} = "
                "(num_epochs - 1) * steps_per_epoch + 1) realizes the sparsity pattern, setting "
                "every weight the optimizer holds to an exact zero or its nonzero value; a "
                "frozen parameter (requires_grad=False) would keep its mixture means, not exact "
                f"zeros, and these are frozen: {shortened(frozen, 5, None)}. Unfreeze them for "
                "this step (requires_grad_(True)) and freeze them again after it (a realized "
                "weight stays as it is while frozen), or give this optimizer only the "
                "parameters it sparsifies. Nothing was changed"
            )

    def _refuse_group_settings(self) -> None:
        """Refuse a step whose parameter groups hold a setting put there after they were added
        (``optimizer.param_groups[0]["lr"] = 0.01``, by hand or by a scheduler that writes
        without reading), which the step would ignore: the learning rate follows the optimizer's
        own schedule and every hyperparameter is global (`add_param_group` refuses the same
        keys). Nothing is evaluated or changed before the refusal."""
        for index, group in enumerate(self.param_groups):
            extra = sorted(set(group) - {"params", "param_names"})
            if extra:
                delete = (
                    f"it (del optimizer.param_groups[{index}][{extra[0]!r}])"
                    if len(extra) == 1
                    else f"them (for key in {extra}: del optimizer.param_groups[{index}][key])"
                )
                raise ValueError(
                    f"SparseQNVBOptimizer: parameter group {index} holds {extra}, set after it "
                    "was added, which this optimizer does not read: its learning rate follows "
                    "its own schedule (initial_lr rising to max_lr, Algorithm 5.3) and every "
                    f"hyperparameter is global. Delete {delete} and set max_lr, initial_lr and "
                    "num_epochs in the constructor; nothing was evaluated or changed by this step"
                )

    def _refuse_if_idle(
        self, params: list[torch.Tensor], mus: list[torch.Tensor], kept: int
    ) -> None:
        """Refuse the `IDLE_STEPS_REFUSED`-th step in a row whose terms the guard dropped at every
        coordinate (``kept`` of them: a gradient or curvature not finite, or a step that
        overflowed), the rule of every QNVB optimizer (`count_idle_step`). Refused before
        the mixtures and counters take the step: the parameters go back to their means ``mus``,
        their gradients cleared, and the next step evaluates the same nodes (the sequence
        position follows the counters)."""
        total = sum(p.numel() for p in params)
        self._idle_steps = count_idle_step(self._idle_steps, kept, total)
        if self._idle_steps < IDLE_STEPS_REFUSED:
            return
        restore_means(params, mus)
        self._written.update(written_marks(params))
        raise idle_step_refusal(
            "SparseQNVBOptimizer",
            self._idle_steps,
            total,
            [f"a parameter of shape {tuple(p.shape)}" for p in params],
            [p.dtype for p in params],
            unit="parameter",
            words=SPARSE_IDLE,
            untaken="the mixtures and counters are as before it, the parameters at their means",
        )

    def _check_growth(self, value: float, dtypes: list[torch.dtype]) -> None:
        """Warn once where the loss grew beyond ``first + 1000 |first|``
        (`loss_growth_message`). ``value`` is the step's average loss as `check_finite_loss`
        read it (no second host sync); ``dtypes``: the parameters'."""
        if "growth" in self._warned:
            return
        if self.first_loss is None:
            self.first_loss = value
            return
        what = "the loss averaged over the quadrature nodes"
        step = self.counters.step + 1
        message = loss_growth_message(
            self.first_loss, value, step, what, cap=self._step_cap, dtypes=dtypes
        )
        if message is not None:
            self._warned.add("growth")
            warnings.warn(
                f"SparseQNVBOptimizer: {message}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def _step_cap(self) -> str:
        """Which setting bounds the steps on the means now (`step_cap_message`)."""
        hp, steps = self.hyperparameters, self.steps_per_epoch
        return step_cap_message(self.counters, hp, steps, self.num_cases / steps)

    def _settings(self) -> dict:
        return run_settings(
            self.hyperparameters, self.steps_per_epoch, self.num_cases, self.prior_precision
        )

    def state_dict(self) -> dict:
        """Torch's state dict plus a ``"sparse_qnvb"`` entry: the counters, the count of idle
        steps in a row (`count_idle_step`), the sequence offset, the first step's loss, the
        generator's state and the settings of the run (`run_settings`), added by a state-dict
        post-hook the optimizer registers first, so that a post-hook registered without
        ``prepend=True`` sees it (`CheckpointHooks`). The mixtures saved take a change of the
        parameters since the last step (`_take_edits`)."""
        return super().state_dict()

    _entry_key = "sparse_qnvb"

    def _checkpoint_entry(self) -> dict:
        return {
            "counters": tuple(self.counters),
            "idle_steps": self._idle_steps,
            "sequence_offset": self.sequence_offset,
            "first_loss": self.first_loss,
            "generator": None if self.generator is None else self.generator.get_state(),
            "settings": self._settings(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict` saved, into an optimizer built with the same settings
        (hyperparameters, ``num_cases``, ``steps_per_epoch``, ``prior_precision``) over
        parameters of the saved shapes and names (where both the saved groups and this
        optimizer's have ``param_names``): a ``ValueError`` names any that differs, and nothing
        is loaded.

        The ``"sparse_qnvb"`` entry is checked by a load pre-hook that runs after the user's
        (which may migrate it) and restored (the counters included) by a post-hook that runs
        before those registered without ``prepend=True``, which also sets every parameter with
        a saved state to its saved mean ``mu``: a network state
        loaded after it is a change of the means (`_take_edits`)."""
        super().load_state_dict(state_dict)

    def _check_loaded(self, state_dict: dict) -> None:
        """Refuse a state dict that `load_state_dict` cannot load, before torch loads
        anything; keep its ``"sparse_qnvb"`` entry for `_restore_loaded`."""
        extra = self._saved_entry(
            state_dict,
            "SparseQNVBOptimizer",
            "the counters, sequence offset, generator state and settings",
        )
        check_settings("SparseQNVBOptimizer.load_state_dict", extra["settings"], self._settings())
        if extra["generator"] is not None and self.generator is None:
            raise ValueError(
                "SparseQNVBOptimizer.load_state_dict: the saved state holds a generator state; "
                "construct the optimizer with a generator to restore it"
            )
        check_saved_parameters("SparseQNVBOptimizer.load_state_dict", state_dict, self.param_groups)
        self._loaded = extra

    def _restore_loaded(self) -> None:
        """The counters, count of idle steps, offset, first loss and generator state of the
        entry just loaded, and the loaded means into the parameters."""
        self.param_groups = [_SparseGroup(group) for group in self.param_groups]
        self._write_means()
        extra, self._loaded = self._loaded, None
        self.counters = SparseQNVBCounters(*extra["counters"])
        self._idle_steps = extra.get("idle_steps", 0)  # (absent from earlier states)
        self.sequence_offset = extra["sequence_offset"]
        self.first_loss = extra.get("first_loss")  # absent from states saved before it was kept
        if extra["generator"] is not None:
            self.generator.set_state(extra["generator"])


def _weight_decay_conversion(
    weight_decay: object, num_cases: float, prior_precision: float | None
) -> str:
    """`weight_decay_conversion` for the slab's
    ``prior_precision`` (this optimizer's, or ``None`` before it is set) and ``num_cases``,
    with ``weight_decay * num_cases`` worked out where ``weight_decay`` is a number."""
    now = "1 / tau_max^2" if prior_precision is None else f"{float(prior_precision):g}"
    number = isinstance(weight_decay, (int, float)) and not isinstance(weight_decay, bool)
    value = f" = {weight_decay * num_cases:g}" if number else ""
    prior = (
        "Its prior on a nonzero weight is the slab, a zero-mean Gaussian of precision "
        f"prior_precision (this optimizer's: {now}), set in the constructor for all parameters."
    )
    return weight_decay_conversion(prior, "num_cases", f"{weight_decay!r} * {num_cases:g}{value}")
