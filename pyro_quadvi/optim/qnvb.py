"""``QNVB``: the quasi-Newton variational Bayes optimizer as a Pyro ``PyroOptim``.

``SVI(model, guide, QNVB(), loss)`` updates each ``(loc, scale)`` pair of a Gaussian mean-field
guide jointly, as a fixed point of the mean-field problem (rasp paper, eq. 4-8): the mean moves by
a quasi-Newton step ``g / h`` and the scale becomes ``h^(-1/2)``, where ``g`` and ``h`` are the
expected gradient and Hessian diagonal of the negative log joint.

Both are recovered from the gradients the loss leaves on the guide's parameters. For a loss of the
form ``-E_q[log p(x, z)] - entropy(q)`` with ``z = mu + sigma * x`` (``QuadratureELBO`` exactly;
``Trace_ELBO`` and ``TraceMeanField_ELBO`` in expectation)

    dL/dmu = E[dU/dz] = g,      dL/dsigma = E[dU/dz * x] - 1/sigma = sigma h - 1/sigma,

with ``U = -log p``, so ``h = (dL/dsigma + 1/sigma) / sigma``; ``dL/dsigma`` comes from the gradient
of the unconstrained scale parameter through its constraint's transform (softplus or exp). For a
local latent in a subsampled plate both gradients carry the minibatch scale ``s``: QNVB divides it
out, ``g = dL/dmu / s`` and ``h = (dL/dsigma / s + 1/sigma) / sigma``, and updates only the rows of
the minibatch.

Pairs are found in three ways:

* every live :class:`~pyro_quadvi.guides.MeanFieldGuide` (``AutoMeanFieldNormal``) reports its
  sites, parameter names, minibatch scale and rows after each run;
* Pyro's ``AutoNormal``: parameters named ``{prefix}.locs.{site}`` and ``{prefix}.scales.{site}``;
* Pyro's ``AutoDiagonalNormal``: ``{prefix}.loc`` and ``{prefix}.scale`` when they are the only
  parameters named ``{prefix}.*`` (``AutoMultivariateNormal`` and
  ``AutoLowRankMultivariateNormal`` have a ``loc`` and a ``scale`` too, but are not mean fields).

For the last two no minibatch scale is known: they are treated as unsubsampled, and an entry whose
loc and scale gradients are both exactly zero (a row outside the minibatch) is left unchanged.
Every other parameter (a model's ``pyro.param``, a network's weights, a non-mean-field guide) is
passed to the fallback optimizer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyro
import torch
from pyro.optim import PyroOptim
from torch.distributions import constraints, transform_to

from ..guides import live_mean_field_guides
from .annealing import anneal_likelihood
from .qnvb_functional import QNVBHyperparameters, QNVBState, init_qnvb_state, qnvb_update

__all__ = ["QNVB"]

_DEFAULT_FALLBACK = (torch.optim.Adam, {"lr": 1e-2})


@dataclass
class _Pair:
    loc: str
    scale: str
    scale_factor: float = 1.0
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    from_guide: bool = False


def _row_index(shape: torch.Size, rows: dict[int, torch.Tensor]) -> tuple | None:
    """An outer-product index selecting ``rows[dim]`` along each subsampled dim (None: all)."""
    if not rows:
        return None
    ndim = len(shape)
    index = []
    for d in range(ndim):
        picked = rows.get(d - ndim, rows.get(d))
        if picked is None:
            picked = torch.arange(shape[d])
        view = [1] * ndim
        view[d] = -1
        index.append(picked.reshape(view))
    return tuple(index)


def _is_positive(constraint) -> bool:
    return isinstance(constraint, constraints.greater_than) and constraint.lower_bound == 0


class QNVB(PyroOptim):
    """Quasi-Newton variational Bayes for Pyro mean-field guides (rasp paper, eq. 4-8).

    Args:
        lr, betas, eps, sigma_min, sigma_max, scale_min, scale_max, curvature, damping,
            drift_forgetting: the update's hyperparameters, see
            :class:`~pyro_quadvi.optim.qnvb_functional.QNVBHyperparameters` and the guide page
            ``docs/qnvb.md`` for their defaults and why.
        annealing: optional schedule ``step -> factor`` of the likelihood; it takes effect through
            the model returned by :meth:`anneal`.
        fallback: the optimizer of every parameter that is not a mean-field ``(loc, scale)`` pair:
            a ``pyro.optim`` optimizer such as ``pyro.optim.Adam({"lr": 1e-2})`` (its constructor
            and arguments are used), or a pair ``(torch optimizer class, arguments dict)``.
            Default: Adam with ``lr = 1e-2``.

    ``get_state()`` / ``set_state()`` (and so ``save()`` / ``load()``) hold the state of every pair,
    the step count and the fallback's state: together with Pyro's param store (and the random
    state, for random quadratures or Monte Carlo losses) a restored run continues exactly.
    """

    def __init__(
        self,
        lr: float = 1.0,
        betas: tuple[float, float] = (0.0, 0.999),
        eps: float = 1e-8,
        sigma_min: float = 1e-6,
        sigma_max: float = 1e2,
        scale_min: float = 0.1,
        scale_max: float = 10.0,
        curvature: str = "mean",
        damping: bool = True,
        drift_forgetting: float = 1.0,
        *,
        annealing: Callable[[int], float] | None = None,
        fallback: PyroOptim | tuple[type, dict] | None = None,
    ):
        self.hyperparameters = QNVBHyperparameters(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            sigma_min=sigma_min,
            sigma_max=sigma_max,
            scale_min=scale_min,
            scale_max=scale_max,
            curvature=curvature,
            damping=damping,
            drift_forgetting=drift_forgetting,
        )
        # PyroOptim's own machinery (one torch optimizer per parameter) is the fallback
        super().__init__(*self._fallback_arguments(fallback))
        self.annealing = annealing
        self.num_steps = 0
        self._bound: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._warned: set[str] = set()

    @staticmethod
    def _fallback_arguments(fallback) -> tuple:
        if fallback is None:
            return _DEFAULT_FALLBACK
        if type(fallback) is PyroOptim:
            return fallback.pt_optim_constructor, fallback.pt_optim_args, fallback.pt_clip_args
        if isinstance(fallback, tuple) and len(fallback) == 2 and isinstance(fallback[1], dict):
            return fallback
        raise ValueError(
            "fallback must be a pyro.optim optimizer such as pyro.optim.Adam({'lr': 0.01}) or a "
            f"pair (torch.optim class, arguments dict), got {fallback!r}"
        )

    # ----------------------------------------------------------------------------- annealing
    @property
    def annealing_factor(self) -> float:
        """The likelihood factor of the current step (1 without a schedule)."""
        return 1.0 if self.annealing is None else float(self.annealing(self.num_steps))

    def anneal(self, model: Callable) -> Callable:
        """``model`` with its likelihood multiplied by :attr:`annealing_factor` at every step."""
        return anneal_likelihood(model, lambda: self.annealing_factor)

    # ------------------------------------------------------------------------------- update
    def __call__(self, params: Iterable[torch.Tensor], *args, **kwargs) -> None:
        """Update the mean-field pairs among ``params``; pass the rest to the fallback."""
        store = pyro.get_param_store()
        by_name, unnamed = {}, []
        for p in params:
            name = store.param_name(p)
            if name is None:
                unnamed.append(p)
            else:
                by_name[name] = p
        store_constraints = store.get_state()["constraints"]
        paired = set()
        for pair in self._find_pairs(by_name, store_constraints):
            self._update_pair(pair, by_name, store_constraints[pair.scale])
            paired.update((pair.loc, pair.scale))
        rest = [by_name[name] for name in sorted(by_name) if name not in paired] + unnamed
        if rest:
            super().__call__(rest, *args, **kwargs)
        self.num_steps += 1

    def _find_pairs(self, by_name: dict, store_constraints: dict) -> list[_Pair]:
        pairs: dict[str, _Pair] = {}
        for guide in live_mean_field_guides():
            try:
                sites = guide.mean_field_sites()
            except RuntimeError:  # not run yet
                continue
            for site in sites:
                if (
                    site.loc_param in by_name
                    and site.scale_param in by_name
                    and site.loc_param not in pairs
                    and self._is_current(site, by_name[site.loc_param])
                ):
                    pairs[site.loc_param] = _Pair(
                        site.loc_param, site.scale_param, site.scale_factor, site.rows, True
                    )
        for name in by_name:
            scale = None
            if ".locs." in name:
                scale = name.replace(".locs.", ".scales.", 1)
            elif name.endswith(".loc"):
                prefix = name[: -len(".loc")]
                siblings = {n for n in store_constraints if n.startswith(prefix + ".")}
                if siblings == {name, prefix + ".scale"}:  # AutoDiagonalNormal's two parameters
                    scale = prefix + ".scale"
            if scale is not None and scale in by_name and name not in pairs:
                pairs[name] = _Pair(name, scale)
        accepted = []
        for name in sorted(pairs):
            pair = pairs[name]
            loc_ok = store_constraints[pair.loc] is constraints.real
            scale_ok = _is_positive(store_constraints[pair.scale])
            same_shape = by_name[pair.loc].shape == by_name[pair.scale].shape
            if loc_ok and scale_ok and same_shape:
                accepted.append(pair)
            else:
                self._warn_once(
                    pair.loc,
                    f"QNVB: {pair.loc!r} / {pair.scale!r} look like a mean-field pair but the loc "
                    "is not real, the scale not positive, or their shapes differ; they go to the "
                    "fallback optimizer",
                )
        return accepted

    @staticmethod
    def _is_current(site, loc_param: torch.Tensor) -> bool:
        """Whether the guide's last run used the current values (not a stale guide's run)."""
        index = _row_index(loc_param.shape, site.rows)
        current = loc_param.detach() if index is None else loc_param.detach()[index]
        used = site.loc.detach()  # expanded along vectorized particles, if any
        if used.shape[used.dim() - current.dim() :] != current.shape:
            return False
        return torch.equal(current.expand_as(used), used)

    def _state_for(self, name: str, loc_param: torch.Tensor) -> dict[str, torch.Tensor]:
        bound = self._bound.get(name)
        if bound is not None and bound[0] is loc_param:
            return bound[1]
        state = self._pending.pop(name, None)
        if state is None or state["g_avg"].shape != loc_param.shape:
            state = init_qnvb_state(loc_param.detach())._asdict()
        self._bound[name] = (loc_param, state)
        return state

    @torch.no_grad()
    def _update_pair(self, pair: _Pair, by_name: dict, scale_constraint) -> None:
        loc_param, scale_param = by_name[pair.loc], by_name[pair.scale]
        if loc_param.grad is None or scale_param.grad is None:
            return  # not used by this step's loss
        index = _row_index(loc_param.shape, pair.rows)

        def select(t: torch.Tensor) -> torch.Tensor:
            return t if index is None else t[index]

        transform = transform_to(scale_constraint)
        mu = select(loc_param.detach())
        u = select(scale_param.detach())
        sigma = transform(u)
        dsigma_du = transform.log_abs_det_jacobian(u, sigma).exp()
        loc_grad, scale_grad = select(loc_param.grad), select(scale_param.grad)
        s = pair.scale_factor
        g = loc_grad / s
        h = (scale_grad / dsigma_du / s + 1.0 / sigma) / sigma

        state = self._state_for(pair.loc, loc_param)
        old = QNVBState(*(select(state[name]) for name in QNVBState._fields))
        result = qnvb_update(mu, sigma, g, h, old, self.hyperparameters)
        new_mu, new_sigma, new_state = result.mu, result.sigma, result.state
        if not pair.from_guide:
            seen = (loc_grad != 0) | (scale_grad != 0)
            new_mu = torch.where(seen, new_mu, mu)
            new_sigma = torch.where(seen, new_sigma, sigma)
            new_state = QNVBState(*(torch.where(seen, a, b) for a, b in zip(new_state, old)))
        if result.num_nonfinite:
            self._warn_once(
                "nonfinite",
                f"QNVB: non-finite gradient at {result.num_nonfinite} coordinates of "
                f"{pair.loc!r}; they were left unchanged (this warning is shown once)",
            )
        # an unchanged sigma keeps its parameter bit for bit (no round trip through the transform);
        # sigma_min keeps the inverse finite, a coordinate it cannot represent stays unchanged
        new_u = transform.inv(new_sigma)
        new_u = torch.where((new_sigma == sigma) | ~torch.isfinite(new_u), u, new_u)
        for name, value in zip(QNVBState._fields, new_state):
            self._write(state[name], index, value)
        self._write(loc_param.data, index, new_mu)
        self._write(scale_param.data, index, new_u)

    @staticmethod
    def _write(target: torch.Tensor, index: tuple | None, value: torch.Tensor) -> None:
        if index is None:
            target.copy_(value)
        else:
            target[index] = value

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -------------------------------------------------------------------------------- state
    def get_state(self) -> dict:
        """Every pair's state, the step count and the fallback optimizers' states."""
        pairs = {name: dict(state) for name, state in self._pending.items()}
        for name, (_, state) in self._bound.items():
            pairs[name] = state
        return {
            "qnvb": {
                "num_steps": self.num_steps,
                "pairs": {
                    name: {key: value.clone() for key, value in state.items()}
                    for name, state in pairs.items()
                },
            },
            "fallback": super().get_state(),
        }

    def set_state(self, state_dict: dict) -> None:
        """Restore what :meth:`get_state` returned (pair states bind at their next use)."""
        qnvb = state_dict["qnvb"]
        self.num_steps = qnvb["num_steps"]
        self._bound.clear()
        self._pending = {
            name: {key: value.clone() for key, value in state.items()}
            for name, state in qnvb["pairs"].items()
        }
        super().set_state(state_dict["fallback"])
