"""Annealing the likelihood: ``p(theta) p(x | theta)^a`` with a factor ``a`` that grows to 1.

A tempered likelihood widens the posterior early in training, which keeps the mean field from
settling into the first basin it meets (the reference QNVB grows its likelihood weight likewise).
In Pyro the factor multiplies the log density of every observed site that holds data (a
``Delta`` site, which Pyro's reparameterizers and ``pyro.deterministic`` leave, is not tempered:
`is_data_site`):

    qnvb = QNVB(annealing=geometric_annealing(0.01, num_steps=500))
    svi = SVI(qnvb.anneal(model), guide, qnvb, QuadratureELBO())

and `QNVBOptimizer` multiplies its likelihood weight by it.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.replay_messenger import ReplayMessenger
from pyro.poutine.runtime import _PYRO_STACK

from ..infer.log_joint import _layers, is_data_site
from .qnvb_functional import _is_real_scalar

__all__ = [
    "AnnealLikelihoodMessenger",
    "anneal_likelihood",
    "annealing_factor",
    "check_schedule",
    "geometric_annealing",
]


def _factor_value(factor: object) -> float | None:
    """A likelihood factor's value, if it is a real number (not a bool) or a one-element real
    tensor; else ``None``."""
    if isinstance(factor, torch.Tensor):
        return float(factor) if _is_real_scalar(factor) else None
    if isinstance(factor, numbers.Real) and not isinstance(factor, bool):
        return float(factor)
    return None


def annealing_factor(annealing: Callable[[int], float], step: int) -> float:
    """The factor ``annealing(step)``, refused unless it is a finite real number ``> 0``.

    Every step's factor is checked by the same rule (a Python number or a one-element tensor,
    finite and ``> 0``): a schedule that returns 0, a negative number, NaN or infinity at a later
    step is refused at that step, before the optimizer changes anything, rather than running on
    as a loss without likelihood, a negated one, or a step that overflows.

    Raises:
        TypeError: when the factor is not a real number.
        ValueError: when it is not finite and ``> 0``; the message names the step and the factor.
    """
    return _checked_factor(
        annealing(step),
        f"annealing({step}) must return",
        f" (the likelihood factor of step {step}); fix the schedule, e.g. "
        "geometric_annealing(0.01, 500)",
    )


def check_schedule(annealing: object) -> Callable[[int], float] | None:
    """Refuse an annealing schedule that is neither ``None`` nor a callable ``step -> factor``.

    The schedule is called once, at step 0 (`annealing_factor`): a wrong schedule is
    refused when the optimizer is built, not at its first step. Later steps are checked by the
    same rule as they come (``QNVBOptimizer.weight``, ``QNVB.annealing_factor``).

    Returns:
        ``annealing`` itself.

    Raises:
        TypeError: when ``annealing`` is not callable, or its factor is not a real number.
        ValueError: when its factor at step 0 is not finite and ``> 0``.
    """
    if annealing is None:
        return None
    if not callable(annealing):
        raise TypeError(
            "annealing must be a callable step -> factor, such as "
            f"geometric_annealing(0.01, num_steps=500), got {annealing!r} "
            f"({type(annealing).__name__})"
        )
    annealing_factor(annealing, 0)
    return annealing


def geometric_annealing(initial: float, num_steps: int) -> Callable[[int], float]:
    """The schedule ``step -> initial^(1 - step / num_steps)`` until ``num_steps``, then 1.

    The factor grows by the same ratio every step, from ``initial`` at step 0 to 1.

    Raises:
        TypeError: for an ``initial`` that is not a real number (``None``, a string, a tensor of
            two entries: Python's comparison error named neither).
        ValueError: unless ``0 < initial <= 1`` and ``num_steps >= 1``.
    """
    value = _factor_value(initial)
    if value is None:
        raise TypeError(
            "geometric_annealing: initial must be a real number in (0, 1], the factor of step "
            f"0, got {initial!r} ({type(initial).__name__})"
        )
    if not 0 < value <= 1:
        raise ValueError(f"geometric_annealing: initial must be in (0, 1], got {initial}")
    initial = value
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    return _GeometricSchedule(initial, num_steps)


class _GeometricSchedule:
    """`geometric_annealing`'s schedule: an object, not a closure, so that a ``QNVB``
    holding it pickles (``torch.save`` of the optimizer mid-fit, as docs/qnvb.md says)."""

    def __init__(self, initial: float, num_steps: int) -> None:
        self.initial = initial
        self.log_initial = math.log(initial)
        self.num_steps = num_steps

    def __call__(self, step: int) -> float:
        if step >= self.num_steps:
            return 1.0
        return math.exp(self.log_initial * (1.0 - step / self.num_steps))

    def __repr__(self) -> str:
        return f"geometric_annealing({self.initial!r}, {self.num_steps})"


def _checked_factor(factor: object, what: str, why: str) -> float:
    """The value of ``factor``, refused unless it is a likelihood factor: a finite real number
    ``> 0`` (a Python number or a one-element real tensor). ``what`` begins the message (``"...
    must return"``), ``why`` ends the ``ValueError``'s."""
    value = _factor_value(factor)
    if value is None:
        raise TypeError(f"{what} a real number > 0, got {factor!r} ({type(factor).__name__})")
    if not 0 < value < math.inf:
        raise ValueError(f"{what} a finite factor > 0, got {factor!r}{why}")
    return value


_EXPONENT = (
    " (the exponent a of the likelihood p(x | theta)^a: 0 drops the likelihood, a negative "
    "factor flips the ELBO's sign, NaN or infinity spoils it); e.g. a schedule growing from "
    "0.01 to 1"
)


class AnnealLikelihoodMessenger(Messenger):
    """Multiplies the log density of every observed sample site that holds data (`is_data_site`)
    by ``factor()``, which must return a finite number ``> 0`` (a ``ValueError`` at the site
    otherwise)."""

    def __init__(self, factor: Callable[[], float]):
        super().__init__()
        if not callable(factor):
            raise TypeError(
                "AnnealLikelihoodMessenger: factor must be a callable () -> number > 0, "
                f"got {factor!r} ({type(factor).__name__}); for a fixed factor a, pass "
                "lambda: a, or use anneal_likelihood(model, a)"
            )
        self.factor = factor
        # the sample messages this handler passed unobserved, until it postprocesses them
        self._unobserved: set[int] = set()

    def _process_message(self, msg):
        if msg["type"] != "sample":
            return
        if not is_data_site(msg):
            self._unobserved.add(id(msg))  # (`_postprocess_message`)
            return
        self._unobserved.discard(id(msg))  # (a message of an earlier run that raised)
        factor = self.factor()
        value = _checked_factor(
            factor, f"anneal_likelihood: factor() at site {msg['name']!r} must be", _EXPONENT
        )
        _check_representable(value, msg)
        msg["scale"] = factor * msg["scale"]

    def _postprocess_message(self, msg):
        """Refuse a data site that a handler outside this one observed after it ran (Pyro runs
        the handlers from the innermost out: ``pyro.condition(anneal_likelihood(model, a),
        data)`` observes ``x`` after the annealing passed it by, untempered), when the model
        runs against a guide's trace (``poutine.replay``: Pyro's ELBOs, ``QuadratureELBO``,
        ``Importance``), where the site's untempered density would enter the loss. Elsewhere
        an outer condition gives latent values (``Predictive``, MCMC's potential), which are no
        data: left alone, as they must be. The scale cannot be set here instead: an outer
        ``poutine.trace`` has copied the message by now."""
        if id(msg) not in self._unobserved:
            return
        self._unobserved.discard(id(msg))
        if is_data_site(msg) and any(isinstance(f, ReplayMessenger) for f in _PYRO_STACK):
            raise ValueError(
                f"anneal_likelihood: site {msg['name']!r} was observed by a handler outside the "
                "annealed model (pyro.condition(anneal_likelihood(model, a), data), or around "
                "qnvb.anneal(model)), after the annealing had passed it, so its log density "
                "would enter the loss untempered. Condition inside: "
                "anneal_likelihood(pyro.condition(model, data), a), or "
                "qnvb.anneal(pyro.condition(model, data)). (A latent fixed from outside cannot "
                "be told from data here; fixed inside, its prior term takes the factor, a "
                "constant in the fit)"
            )


def _check_representable(factor: float, msg: dict) -> None:
    """Refuse a ``factor`` beyond the largest number of the observed site's log density's dtype
    (`torch_qnvb.check_representable`): ``1e300`` is finite in float64 but infinite in float32,
    and the ELBO then blamed the model's support for the infinite log density. The log density
    takes the dtype of the distribution's parameters and of a floating value (integer counts
    under a float32 rate give float32)."""
    from .torch_qnvb import check_representable  # (torch_qnvb imports this module)

    tensors = [msg["value"]]
    for fn in _layers(msg["fn"]):
        tensors.extend(vars(fn).get(name) for name in getattr(fn, "arg_constraints", {}))
    dtypes = [t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if dtypes:
        dtype = functools.reduce(torch.promote_types, dtypes)
        check_representable(f"anneal_likelihood at site {msg['name']!r}: ", "factor", factor, dtype)


def anneal_likelihood(model: Callable, factor: float | Callable[[], float]) -> Callable:
    """``model`` with its observed sites' log densities multiplied by ``factor``: the tempered
    joint ``p(theta) p(x | theta)^a``. ``pyro.factor`` terms count as likelihood and are
    tempered; ``Delta`` sites (``pyro.deterministic``, the sites Pyro's reparameterizers leave,
    whose densities belong to the prior) are not (`is_data_site`).

    Args:
        model: a Pyro model.
        factor: a finite number ``> 0``, or a callable returning the current one (read at every
            observed site, so a schedule can change it between steps). An annealing schedule
            runs in ``(0, 1]``; a factor above 1 weights the likelihood up (a "cold" posterior),
            as `annealing_factor` allows for the optimizers' schedules.

    Raises:
        TypeError: for a ``model`` that is not callable, or a ``factor`` that is neither a real
            number nor a callable.
        ValueError: for a number that is not finite and ``> 0``; a callable's such value is
            refused at the observed site that reads it.
    """
    if not callable(model):
        raise TypeError(
            f"anneal_likelihood: model must be a callable Pyro model, got {model!r} "
            f"({type(model).__name__})"
        )
    if not callable(factor):
        _checked_factor(factor, "anneal_likelihood: factor must be", _EXPONENT)
    factor_fn = factor if callable(factor) else (lambda: factor)

    @functools.wraps(model)  # the model stays findable (``__wrapped__``): fit checks its batches
    def annealed(*args, **kwargs):
        with AnnealLikelihoodMessenger(factor_fn):
            return model(*args, **kwargs)

    return annealed
