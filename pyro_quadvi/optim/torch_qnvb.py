"""QNVB as a ``torch.optim.Optimizer`` for plain PyTorch networks (the reference's use case).

Every parameter ``p`` becomes a Gaussian mean field ``N(mu, sigma^2)``. :meth:`QNVBOptimizer.step`
sets the parameters to the quadrature nodes ``mu + sigma * x_k`` itself, evaluates the closure
(loss and backward) at each, and forms (rasp paper, eq. 11)

    g = sum_k w_k grad_k,        h = sum_k w_k grad_k * x_k / sigma,

then applies :func:`~pyro_quadvi.optim.qnvb_functional.qnvb_update` to the loss

    likelihood_weight * annealing(step) * closure() + prior_precision * |theta|^2 / 2,

where ``closure()`` is the mean loss per training case, as in the reference. After a step the
parameters hold the mean ``mu``; ``optimizer.state[p]["sigma"]`` holds the standard deviation.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import fields

import torch

from ..quadrature import make_rule
from .annealing import check_schedule
from .qnvb_functional import (
    QNVBHyperparameters,
    QNVBState,
    _check_number,
    count_messages,
    init_qnvb_state,
    qnvb_update,
    result_counts,
)

__all__ = ["QNVBOptimizer"]

_HP_NAMES = tuple(f.name for f in fields(QNVBHyperparameters))
_STATE_NAMES = QNVBState._fields


def _checked_loss(loss: object) -> torch.Tensor:
    """The closure's loss as a detached 0-d tensor, or a clear error for anything else."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else f"{loss!r} ({type(loss).__name__})"
        )
        raise TypeError(
            "QNVBOptimizer: the closure must return the scalar loss tensor (mean per case) after "
            f"calling backward() on it; it returned {got}"
        )
    return loss.detach().reshape(())


class QNVBOptimizer(torch.optim.Optimizer):
    """Quasi-newton variational Bayes for ``torch.nn`` parameters (rasp paper, eq. 4-8).

    Args:
        params: parameters or parameter groups; a group may override any hyperparameter below
            but ``likelihood_weight``, ``annealing``, ``quadrature``, ``num_eval``, ``generator``.
        likelihood_weight: the number of training cases: the closure returns a mean per case.
        prior_precision: precision of a zero-mean Gaussian prior on every parameter (0: flat,
            like the reference).
        annealing: optional schedule ``step -> factor`` multiplying the likelihood weight
            (e.g. :func:`~pyro_quadvi.optim.annealing.geometric_annealing`).
        quadrature: a rule name of :func:`pyro_quadvi.quadrature.make_rule`.
        num_eval: its number of nodes (closure evaluations per step); ``None``: the rule's default.
        init_sigma: the standard deviation of every parameter before the first step.
        generator: random generator of random rules (torch's global generator when ``None``);
            when given, its state is saved with :meth:`state_dict`.
        lr, betas, eps, sigma_min, sigma_max, scale_min, scale_max, curvature, significance,
            damping, damping_recovery, drift_forgetting, recent_fraction: see
            :class:`~pyro_quadvi.optim.qnvb_functional.QNVBHyperparameters`.

    Every argument is checked when the optimizer (or a parameter group) is built, and a wrong
    type or value is refused by name. Steps warn once per kind, with the number of coordinates
    concerned: a non-finite gradient or curvature, an update that overflowed while the gradient
    was finite (both leave the coordinates unchanged), a ``sigma`` pinned at ``sigma_min``, a
    ``sigma`` pinned at ``sigma_max``. Reading the counts is the step's only host-device sync, and
    it stops once all four kinds have been warned about.

    Example::

        optimizer = QNVBOptimizer(net.parameters(), likelihood_weight=len(dataset))
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
        likelihood_weight: float = 1.0,
        prior_precision: float = 0.0,
        annealing: Callable[[int], float] | None = None,
        quadrature: str = "rasp_simplex",
        num_eval: int | None = None,
        init_sigma: float = 1e-3,
        generator: torch.Generator | None = None,
        lr: float = 1.0,
        betas: tuple[float, float] = (0.0, 0.999),
        eps: float = 1e-8,
        sigma_min: float = 1e-6,
        sigma_max: float = 1e2,
        scale_min: float = 0.1,
        scale_max: float = 10.0,
        curvature: str = "mean",
        significance: float = 0.0,
        damping: bool = True,
        damping_recovery: float = 0.5,
        drift_forgetting: float = 1.0,
        recent_fraction: float = 1.0,
    ):
        _check_number("likelihood_weight", likelihood_weight, lambda v: 0 < v < math.inf, "> 0")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            sigma_min=sigma_min,
            sigma_max=sigma_max,
            scale_min=scale_min,
            scale_max=scale_max,
            curvature=curvature,
            significance=significance,
            damping=damping,
            damping_recovery=damping_recovery,
            drift_forgetting=drift_forgetting,
            recent_fraction=recent_fraction,
            prior_precision=prior_precision,
            init_sigma=init_sigma,
        )
        self.annealing = check_schedule(annealing)
        super().__init__(params, defaults)  # checks every group (add_param_group)
        self.likelihood_weight = float(likelihood_weight)
        self.rule = make_rule(quadrature, num_eval)
        self.generator = generator
        self.num_steps = 0
        self._warned: set[str] = set()

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch's rule), refusing a bad hyperparameter at once, by name."""
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    @staticmethod
    def _check_group(group: dict) -> QNVBHyperparameters:
        _check_number(
            "prior_precision", group["prior_precision"], lambda v: 0 <= v < math.inf, ">= 0"
        )
        _check_number("init_sigma", group["init_sigma"], lambda v: 0 < v < math.inf, "> 0")
        return QNVBHyperparameters(**{name: group[name] for name in _HP_NAMES})

    @property
    def weight(self) -> float:
        """The current likelihood weight: ``likelihood_weight * annealing(num_steps)``."""
        if self.annealing is None:
            return self.likelihood_weight
        return self.likelihood_weight * float(self.annealing(self.num_steps))

    def _params(self) -> list[tuple[torch.Tensor, dict]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    state = self.state[p]
                    if not state:
                        state["mu"] = p.detach().clone()
                        state["sigma"] = torch.full_like(state["mu"], group["init_sigma"])
                        state.update(init_qnvb_state(state["mu"])._asdict())
                    out.append((p, group))
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        """Evaluate ``closure`` at every quadrature node and update the mean field.

        Args:
            closure: computes the mean loss per case at the current parameter values, calls
                ``backward()`` on it and returns it (gradients are zeroed before each call).

        Returns:
            The quadrature average of the closure's loss.
        """
        params = self._params()
        if not params:
            raise ValueError("QNVBOptimizer has no parameter that requires grad")
        first = params[0][0]
        dim = sum(p.numel() for p, _ in params)
        nodes = self.rule.draw(
            dim,
            step=self.num_steps,
            generator=self.generator,
            dtype=first.dtype,
            device=first.device,
        )
        g_sum = [torch.zeros_like(p) for p, _ in params]
        gx_sum = [torch.zeros_like(p) for p, _ in params]
        seen = [False] * len(params)
        loss_avg = torch.zeros((), dtype=first.dtype, device=first.device)
        try:
            for k in range(len(nodes)):
                x = nodes.node(k)
                weight_k = nodes.weights[k]
                offsets = self._set_to_node(params, x)
                with torch.enable_grad():
                    loss = _checked_loss(closure())
                loss_avg += weight_k * loss
                for i, (p, _) in enumerate(params):
                    if p.grad is None:
                        continue
                    seen[i] = True
                    g_sum[i] += weight_k * p.grad
                    gx_sum[i] += weight_k * p.grad * offsets[i]
            if not any(seen):
                raise RuntimeError(
                    "QNVBOptimizer: no parameter received a gradient; the closure must call "
                    "backward() on the loss before returning it"
                )
        except BaseException:  # the parameters go back to their means, unchanged
            for p, _ in params:
                p.copy_(self.state[p]["mu"])
                p.grad = None
            raise
        weight = self.weight
        counts = []
        for i, (p, group) in enumerate(params):
            state = self.state[p]
            if seen[i]:
                hp = self._check_group(group)
                qnvb_state = QNVBState(*(state[name] for name in _STATE_NAMES))
                result = qnvb_update(
                    state["mu"],
                    state["sigma"],
                    g_sum[i],
                    gx_sum[i] / state["sigma"],
                    qnvb_state,
                    hp,
                    weight=weight,
                    prior_precision=group["prior_precision"],
                )
                state["mu"], state["sigma"] = result.mu, result.sigma
                state.update(result.state._asdict())
                counts.append((f"a parameter of shape {tuple(p.shape)}", hp, result_counts(result)))
            p.copy_(state["mu"])
            p.grad = None
        self.num_steps += 1
        self._warn(counts)
        return loss_avg

    def _warn(self, counts: list[tuple[str, QNVBHyperparameters, torch.Tensor]]) -> None:
        """Warn once per kind of count (:func:`count_messages`: at most one host sync)."""
        for message in count_messages(counts, self._warned):
            warnings.warn(
                f"QNVBOptimizer: {message} (this warning is shown once)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _set_to_node(self, params, x: torch.Tensor) -> list[torch.Tensor]:
        """Set every parameter to ``mu + sigma * x`` (its slice of ``x``); zero its gradient."""
        offsets, start = [], 0
        for p, _ in params:
            state = self.state[p]
            x_p = x[start : start + p.numel()].view_as(p)
            start += p.numel()
            p.copy_(state["mu"] + state["sigma"] * x_p)
            p.grad = None
            offsets.append(x_p)
        return offsets

    def state_dict(self) -> dict:
        """Torch's state dict plus the step count and the generator's state."""
        state = super().state_dict()
        state["qnvb"] = {
            "num_steps": self.num_steps,
            "generator": None if self.generator is None else self.generator.get_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("qnvb")
        super().load_state_dict(state_dict)
        self.num_steps = extra["num_steps"]
        if extra["generator"] is not None:
            if self.generator is None:
                raise ValueError(
                    "the saved state holds a generator state; construct the optimizer with a "
                    "generator to restore it"
                )
            self.generator.set_state(extra["generator"])
