"""``QuadratureELBO``: the ELBO and its gradients from quadrature nodes instead of random draws.

For a Gaussian guide ``q(z) = N(loc, A A^T)`` in Pyro's unconstrained space and a rule with offsets
``x_k`` and weights ``w_k`` (:mod:`pyro_quadvi.quadrature`),

    loss = -sum_k w_k [log p(x, T(loc + A x_k)) + log|det J_T(loc + A x_k)|] - H[q]     (1)

where ``T`` maps each site to its support and the entropy ``H[q]`` is analytic (rasp paper, eq. 9
and 13; sequence paper, Section 4.2). For a mean field (``A = diag(sigma)``), with
``L = -log p - log|J|``, the gradients of (1) are the quadrature estimates

    dloss/dloc   = sum_k w_k grad L(z_k)                       = g        (rasp paper, eq. 7, 11)
    dloss/dsigma = sum_k w_k grad L(z_k) * x_k - 1 / sigma      = sigma h - 1 / sigma  (eq. 8, 11)

of the expected gradient ``g`` and, by Stein's identity, the expected Hessian diagonal ``h``: the
quantities a QNVB step needs. The nodes span all latent coordinates of the model laid end to end,
so a rule's exactness holds across sites, not only within one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from pyro.infer import ELBO

from ..quadrature import QuadratureRule, make_rule
from .gaussian_view import GaussianView, gaussian_view
from .log_joint import LogJoint, latent_sites_of_model

__all__ = ["QuadratureELBO"]


class QuadratureELBO(ELBO):
    """The evidence lower bound integrated by a quadrature rule, for Gaussian guides.

    Args:
        rule: a rule name for :func:`~pyro_quadvi.quadrature.make_rule` (``"rasp_simplex"``,
            ``"rasp_cross"``, ``"hadamard"``, ``"blocked_simplex"``, ``"gauss_hermite"``, ``"mc"``,
            ``"vrmc1"``, ``"vrmc2"``) or a :class:`~pyro_quadvi.quadrature.QuadratureRule`.
        num_points: the rule's ``num_points`` (``None``: its default); only with a rule name.
        vectorize: ``True`` evaluates all nodes in one pass of the model under a particle plate;
            ``False`` loops over nodes; ``None`` tries the vectorized pass on the first call,
            checks it against a looped evaluation of two nodes, and falls back to the loop with
            one warning if the model cannot broadcast over nodes (``PyroModule[nn.Linear]``
            networks, say).
        max_plate_nesting: as in Pyro's ELBOs; ``inf`` finds it from a run of the model.
        generator: the ``torch.Generator`` of random rules; ``None`` draws from torch's global
            generator, so ``pyro.set_rng_seed`` makes runs reproducible.
        name: key of the sequence position in Pyro's param store (``"{name}.step"``).

    The sequence position (which matters for the ``hadamard`` rule) advances once per
    :meth:`loss_and_grads` or :meth:`differentiable_loss` call, never on :meth:`loss` (that is,
    not on ``SVI.evaluate_loss``). It lives in Pyro's param store, so saving and restoring the
    param store resumes the sequence where it stopped; ``pyro.clear_param_store()`` restarts it.
    """

    def __init__(
        self,
        rule: str | QuadratureRule = "rasp_simplex",
        num_points: int | None = None,
        vectorize: bool | None = None,
        max_plate_nesting: float = float("inf"),
        generator: torch.Generator | None = None,
        name: str = "QuadratureELBO",
    ):
        super().__init__(num_particles=1, max_plate_nesting=max_plate_nesting)
        if isinstance(rule, str):
            rule = make_rule(rule, num_points)
        elif not isinstance(rule, QuadratureRule):
            raise TypeError(
                f"rule must be a rule name or a QuadratureRule, got {type(rule).__name__}"
            )
        elif num_points is not None:
            raise ValueError("num_points goes with a rule name; a rule object has its own")
        if vectorize not in (None, True, False):
            raise ValueError(f"vectorize must be True, False or None, got {vectorize!r}")
        self.rule = rule
        self.vectorize = vectorize
        self.generator = generator
        self.name = name

    # -- the sequence position, kept in Pyro's param store ------------------------------------

    @property
    def _step_key(self) -> str:
        return f"{self.name}.step"

    @property
    def step(self) -> int:
        """The current position in the rule's sequence."""
        store = pyro.get_param_store()
        return int(store[self._step_key].item()) if self._step_key in store else 0

    def _advance(self) -> None:
        pyro.get_param_store()[self._step_key] = torch.tensor(float(self.step + 1))

    # -- the loss ------------------------------------------------------------------------------

    def _quadrature_loss(self, model: Callable, guide: Callable, args, kwargs) -> torch.Tensor:
        if getattr(guide, "prototype_trace", True) is None:
            # Before an AutoGuide's first run: refuse discrete or enumerated latents by name,
            # without disturbing the random state a seeded run depends on.
            with torch.random.fork_rng(devices=[]):
                latent_sites_of_model(model, *args, **kwargs)
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        view = gaussian_view(guide, guide_trace)
        loc_dtype = view.entropy.dtype
        nodes = self.rule.draw(
            view.dim,
            step=self.step,
            generator=self.generator,
            dtype=loc_dtype,
            device=view.entropy.device,
        )
        z = view.affine(nodes.matrix())
        log_joint = self._log_joint(model, view, z, args, kwargs, guide_trace)
        loss = -(nodes.weights @ log_joint) - view.entropy
        if not torch.isfinite(loss):
            raise ValueError(
                f"QuadratureELBO: the loss is not finite ({loss.item()}); the guide's entropy is "
                f"{view.entropy.item()}: a scale collapsed to zero or overflowed"
            )
        return loss

    def _log_joint(self, model, view: GaussianView, z, args, kwargs, guide_trace) -> torch.Tensor:
        mpn = None if math.isinf(self.max_plate_nesting) else int(self.max_plate_nesting)
        log_joint = LogJoint(model, view.sites, max_plate_nesting=mpn)
        if self.vectorize is not None:
            values = log_joint(z, args, kwargs, guide_trace, vectorize=self.vectorize)
            self.max_plate_nesting = log_joint.max_plate_nesting  # found once, then kept
            return values
        # First call: try one vectorized pass and check it against a looped pass over the first
        # and the last node (a model that broadcasts wrongly over nodes shows up there).
        probe = torch.tensor(sorted({0, z.shape[0] - 1}))
        try:
            vectorized = log_joint(z, args, kwargs, guide_trace, vectorize=True)
        except (RuntimeError, ValueError, IndexError) as error:
            reason = f"it failed with {type(error).__name__}: {error}"
        else:
            looped = log_joint(z[probe], args, kwargs, guide_trace, vectorize=False)
            if torch.allclose(vectorized[probe], looped, rtol=1e-6, atol=1e-6):
                self.vectorize = True
                self.max_plate_nesting = log_joint.max_plate_nesting
                return vectorized
            reason = "its log densities differ from a looped evaluation"
        self.vectorize = False
        warnings.warn(
            "QuadratureELBO: the model does not evaluate all quadrature nodes in one vectorized "
            f"pass ({reason}); looping over nodes. Pass vectorize=False to silence this.",
            stacklevel=4,
        )
        values = log_joint(z, args, kwargs, guide_trace, vectorize=False)
        self.max_plate_nesting = log_joint.max_plate_nesting
        return values

    def _get_trace(self, model, guide, args, kwargs):
        raise NotImplementedError("QuadratureELBO integrates with quadrature nodes, not traces")

    def loss(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """The negative ELBO, without gradients; does not advance the sequence."""
        with torch.no_grad():
            return self._quadrature_loss(model, guide, args, kwargs).item()

    def differentiable_loss(self, model: Callable, guide: Callable, *args, **kwargs):
        """The negative ELBO as a differentiable tensor; advances the sequence by one step."""
        loss = self._quadrature_loss(model, guide, args, kwargs)
        self._advance()
        return loss

    def loss_and_grads(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """The negative ELBO; accumulates its gradients; advances the sequence by one step."""
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward()
        return loss.item()

    def __repr__(self) -> str:
        return f"QuadratureELBO(rule={self.rule!r}, vectorize={self.vectorize})"
