"""``QuadratureELBO``: the ELBO and its gradients from quadrature nodes instead of random draws.

For a Gaussian guide ``q(z) = N(loc, A A^T)`` in Pyro's unconstrained space and a rule with offsets
``x_k`` and weights ``w_k`` (`pyro_quadvi.quadrature`),

    loss = -sum_k w_k [log p(x, T(loc + A x_k)) + log|det J_T(loc + A x_k)|] - H[q]     (1)

where ``T`` maps each site to its support and the entropy ``H[q]`` is analytic (rasp paper, eq. 9
and 13; sequence paper, Section 4.2). For a mean field (``A = diag(sigma)``), with
``L = -log p - log|J|``, the gradients of (1) are the quadrature estimates

    dloss/dloc   = sum_k w_k grad L(z_k)                       = g        (rasp paper, eq. 7, 11)
    dloss/dsigma = sum_k w_k grad L(z_k) * x_k - 1 / sigma      = sigma h - 1 / sigma  (eq. 8, 11)

of the expected gradient ``g`` and, by Stein's identity, the expected Hessian diagonal ``h``: the
quantities a QNVB step needs. The nodes span all latent coordinates of the model laid end to end,
so a rule's exactness holds across sites, not only within one.

The guide is read through `describe_guide` (its
``quadrature_description`` hook, or the adapter of its class). During the backward pass the node
points ``z_k`` receive ``dloss/dz_k``, from which the ELBO publishes, per elementwise site, the
moments it integrated (the same two sums over the nodes make the gradients of ``loc`` and
``sigma``) (`publish_moments`):

    g = sum_k dloss/dz_k / s,        h = sum_k dloss/dz_k * x_k / (sigma s)

with ``s`` the site's minibatch scale, plus, for a Normal prior integrated in closed form
(`_ClosedPriors`), its parts ``W c (mu - m) / s^2`` and ``W c / s^2``: ``QNVB`` uses them
directly, so a family whose parameter gradients do not carry ``g`` and ``h`` (a mixture) is
updated all the same.

**Spike-and-slab sites** (family ``"dirac_gauss"``, `AutoSpikeSlab`):
the nodes sit at each mixture's mean and standard deviation (sequence paper, eq. 4.2), where the
likelihood and every smooth prior term are integrated. The site's own prior, a
`SpikeSlab`, meets the guide in their closed-form KL (the
sparse-VI paper's KL term), which also holds the site's entropy:

    loss = -sum_k w_k log p_smooth(x, T(z_k)) - H[gaussian sites] + sum_ss KL(q_ss || p_ss)

This is a deterministic **moment-matched surrogate**: the expectations are taken under the
Gaussian with the mixture's two moments, not under the mixture. A sigma-point rule integrates
univariate quadratics exactly against any distribution with those moments, so for a likelihood
that is a sum of quadratics, one per coordinate, the surrogate equals the negative ELBO of
`GumbelSpikeSlabELBO` (without its noise); for a network it is a
different objective and not a bound on the evidence: do not compare the two losses. The
published ``g`` and ``h`` of such a site are those of the smooth loss under the moment-matched
Gaussian, which is what the sequence paper's eq. 4.6 takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import ELBO
from pyro.poutine import Trace
from pyro.poutine.util import site_is_subsample
from torch.utils.checkpoint import CheckpointError

from ..distributions.iid_normal import expected_log_density
from ..guides.interface import (
    ELEMENTWISE_FAMILIES,
    GuideDescription,
    PublishedMoments,
    check_model_samples,
    describe_guide,
    publish_moments,
    trace_for_description,
    unwrap_guide,
)
from ..guides.rows import GivenRows
from ..quadrature import QuadratureRule, make_rule
from ..quadrature.base import generator_kept
from ..store import follow_param_store
from .batched import (
    BatchDecision,
    DecisionCache,
    RecomputedForward,
    add_hint,
    called_by_place,
    check_vectorize,
    evaluate_batch,
    first_line,
    is_broadcast_error,
    product_advice,
    refuse_recomputed_forward,
    without_autocast,
)
from .log_joint import (
    LogJoint,
    PlateCollision,
    RandomState,
    check_max_plate_nesting,
    cuda_devices,
    first_observed_by_the_model,
    latent_sites_of_model,
    name_the_invalid_initial_site,
    observed_by_the_model,
    total_of,
)

__all__ = ["PointsELBO", "QuadratureELBO"]

SEQUENCE_POSITION = "quadrature_elbo_step"
"""The buffer of a guide module that keeps its own sequence position (`position_holder`)."""


def position_holder(guide: Callable) -> torch.nn.Module | None:
    """The guide module that keeps its own position in `QuadratureELBO`'s rule sequence, as
    the buffer `SEQUENCE_POSITION`: under ``pyro.settings.set(module_local_params=True)``, a
    guide that is a ``torch.nn.Module``, whose parameters are its own (``state_dict()``), not
    the param store's; ``None`` otherwise (the position lives in the param store,
    `QuadratureELBO.step_key`).

    Two instances of one model have guides of the same name and sites, which would share a
    param store key: in local mode each keeps its own position, and a checkpoint of the guide
    (``state_dict()``) holds it.
    """
    if not pyro.settings.get("module_local_params"):
        return None
    module = unwrap_guide(guide)
    return module if isinstance(module, torch.nn.Module) else None


def take_saved_position(
    module: torch.nn.Module, state_dict: dict, prefix: str, *rest: object
) -> None:
    """A ``load_state_dict`` pre-hook that makes ``module``'s position buffer
    (`SEQUENCE_POSITION`) follow the saved state (torch runs it before collecting the buffers).

    A saved state holding a position gives the buffer to a guide the ELBO has not met yet (a new
    guide, set up by one call), which then loads it instead of refusing the key. A saved state
    without one (taken before the ELBO met the guide, or written by an earlier version, which
    kept the position in the param store) removes the buffer: the guide is new to the ELBO
    again, which at its next loss takes the param store's position under the guide's key, or 0
    (`QuadratureELBO._meet`), instead of the load refusing the missing key.
    """
    key = prefix + SEQUENCE_POSITION
    if key in state_dict and SEQUENCE_POSITION not in module._buffers:
        module.register_buffer(SEQUENCE_POSITION, torch.zeros((), dtype=torch.int64))
    elif key not in state_dict and SEQUENCE_POSITION in module._buffers:
        del module._buffers[SEQUENCE_POSITION]


def _follow_saved_positions(module: torch.nn.Module) -> None:
    """Register `take_saved_position` on ``module``, unless it has it (`AutoMeanFieldNormal`
    registers it when made; a Pyro guide gets it here, with its buffer)."""
    hooks = module._load_state_dict_pre_hooks.values()
    if not any(getattr(hook, "hook", None) is take_saved_position for hook in hooks):
        module.register_load_state_dict_pre_hook(take_saved_position)


@dataclass
class _Fit:
    """What the ELBO learns about one (model, guide) pair on its first call."""

    max_plate_nesting: int | None
    decision: BatchDecision | None = None
    # plates whose rows the model gives and whose data were seen to follow the guide's rows
    # (`GivenRows`): not checked again
    rows_follow: set[str] = field(default_factory=set)


class PointsELBO(ELBO):
    """What the package's ELBOs share: the guide described from a trace of one run, and the
    model's log joint (`LogJoint`, closed-form KLs included) at a batch
    of points, vectorized or looped as decided once per model and guide.

    Args:
        num_particles: as in Pyro's ``ELBO``.
        vectorize: ``True`` (one pass, checked on the first call for a model and guide: a
            disagreement raises), ``False`` or ``None`` (try, check, fall back once with a
            warning).
        max_plate_nesting: as in Pyro's ELBOs, an int ``>= 0``; ``inf`` finds it from a run of
            each model (again if a later call nests deeper). Anything else is refused here.
        vectorize_particles: ``True`` is refused (a ``TypeError``): Pyro's switch is
            ``vectorize`` here, with the meaning it has everywhere in the package. ``False``,
            Pyro's default, is accepted and changes nothing (``vectorize`` decides).
    """

    def __init__(
        self,
        num_particles: int = 1,
        vectorize: bool | None = None,
        max_plate_nesting: float = float("inf"),
        *,
        vectorize_particles: bool | None = None,
    ):
        if vectorize_particles:  # Trace_ELBO's argument, as a user porting code passes
            raise TypeError(
                f"{type(self).__name__} takes no vectorize_particles: its switch is vectorize, "
                "as everywhere in the package. vectorize=True evaluates all its points (the "
                "rule's nodes, or the Monte Carlo draws) in one pass of the model under a "
                "particle plate, checked on the first call; False evaluates them one at a time; "
                "None (the default) tries the pass, checks it, and falls back to the loop once, "
                "with a warning, where the model cannot broadcast over the points"
            )
        check_max_plate_nesting(type(self).__name__, max_plate_nesting, math.inf)
        super().__init__(num_particles=num_particles, max_plate_nesting=max_plate_nesting)
        check_vectorize(vectorize, f"{type(self).__name__}: ")
        self.vectorize = vectorize
        self._fits = DecisionCache()

    def _described_run(
        self, model: Callable, guide: Callable, args, kwargs
    ) -> tuple[Trace, GuideDescription]:
        """One run of the guide, traced, and its description."""
        auto_guide = unwrap_guide(guide)
        set_up = getattr(auto_guide, "prototype_trace", True) is None
        if set_up:
            # Before an AutoGuide's first run: refuse discrete or enumerated latents by name,
            # without disturbing the random state a seeded run depends on.
            # (the CPU's state, and the CUDA devices' that the model's tensors live on)
            devices = cuda_devices(model, args, kwargs)
            with torch.random.fork_rng(devices=devices):
                sites = latent_sites_of_model(model, *args, **kwargs)
            state = RandomState.get(devices)
        # a restored param store holds other tensors than a guide's plain nn.Parameters (an
        # AutoDiagonalNormal's loc) or a PyroModule model's: they take the store's values and
        # go back into it
        follow_param_store(auto_guide)
        follow_param_store(unwrap_guide(model))
        try:
            guide_trace = trace_for_description(guide, *args, **kwargs)
        except NotImplementedError as error:  # an init_loc_fn drawing from an improper prior?
            improper = [site.name for site in sites if site.improper] if set_up else []
            if improper:
                raise ValueError(
                    f"{type(self).__name__}: latent site(s) {improper} have an improper prior "
                    "(ImproperUniform), which cannot be sampled, and the guide's init_loc_fn "
                    f"draws its start from the prior ({first_line(error)}): pass "
                    "init_loc_fn=init_to_value(values={...}) with a point of each site's support"
                ) from error
            raise
        except ValueError as error:  # Pyro's validation, at the set-up's initial values?
            if set_up and not is_broadcast_error(error):
                name_the_invalid_initial_site(auto_guide, args, kwargs, error, state)
            raise
        description = describe_guide(guide, guide_trace)
        check_model_samples(model, description)
        if description.dim == 0:
            raise ValueError(
                f"{type(self).__name__}: the model has no latent sample site, so there is nothing "
                "to integrate; its log likelihood is the whole objective (use MAP or fit "
                "pyro.param values with an ordinary optimizer)"
            )
        return guide_trace, description

    def _fit(self, model: Callable, guide: Callable) -> _Fit:
        fit = self._fits.get(model, unwrap_guide(guide))
        if fit is None:
            mpn = None if math.isinf(self.max_plate_nesting) else int(self.max_plate_nesting)
            fit = _Fit(mpn)
            self._fits.set(model, unwrap_guide(guide), decision=fit)
        return fit

    def vectorized(self, model: Callable, guide: Callable) -> bool | None:
        """Whether this model and guide evaluate all points in one pass (``None``: not known)."""
        if self.vectorize is not None:
            return self.vectorize
        fit = self._fits.get(model, unwrap_guide(guide))
        return None if fit is None or fit.decision is None else fit.decision.vectorized

    def _log_joint(
        self,
        model,
        guide,
        description: GuideDescription,
        z,
        args,
        kwargs,
        guide_trace,
        expected_log_priors: frozenset[str] = frozenset(),
        after_steps: bool | None = None,
    ) -> tuple[torch.Tensor, dict[str, tuple[float, float, float]]]:
        """The log joint at the points ``z``, and the priors of ``expected_log_priors`` left to
        the caller (`closed_priors`); ``after_steps``: whether steps of an optimizer have moved
        the guide, ``None`` where not known (`LogJoint`'s, for its advice on a log density that
        is not finite)."""
        fit = self._fit(model, guide)
        # one LogJoint per step: all points of the step see one minibatch. Where the guide has
        # subsampled plates, whose rows the LogJoint replays into the model, the model runs
        # inside GivenRows, inside that replay: a plate given its rows by the model
        # (subsample=idx) whose rows the guide's plate replaced is refused
        # (`replaced_rows_message`) unless the model's data follow the plate's rows (checked
        # once per plate, `check_data_follow_rows`). Every sized plate has a subsample site:
        # a guide with any plate runs the model in GivenRows
        if any(site_is_subsample(node) for node in guide_trace.nodes.values()):
            model = GivenRows(unwrap_guide(guide), guide_trace, fit.rows_follow)(model)
        log_joint = LogJoint(
            model,
            description.latent_sites,
            max_plate_nesting=fit.max_plate_nesting,
            closed_form=description.closed_form_sites(),
            expected_log_priors=expected_log_priors,
            node_by_node=True,
            after_steps=after_steps,
        )
        given = not math.isinf(self.max_plate_nesting)
        if fit.decision is None and given:
            log_joint.check_plate_nesting(z, args, kwargs, guide_trace)  # a given one, once
        vectorize, cached = self.vectorize, False
        if vectorize is not False and fit.decision is not None:
            # a vectorized pass checked on an earlier call runs without the probes (under None
            # it falls back to the loop with one warning, as on a first call, if this call takes
            # a branch of the model that cannot broadcast); under None a loop stays a loop
            cached = fit.decision.vectorized
            if vectorize is None and not cached:
                vectorize = False

        def single(point: torch.Tensor) -> dict[str, torch.Tensor]:
            terms = log_joint(point[None], args, kwargs, guide_trace, vectorize=False, by_site=True)
            return {name: term[0] for name, term in terms.items()}

        def evaluate() -> tuple[dict[str, torch.Tensor], BatchDecision]:
            # the probes compare each site's term: a wrong term of a few nats (a factor that sums
            # over the points' dim) is far outside its own rounding, and hidden in the total's
            return evaluate_batch(
                lambda points: log_joint(
                    points, args, kwargs, guide_trace, vectorize=True, by_site=True
                ),
                single,
                z,
                vectorize,
                probe=() if cached else (0, z.shape[0] - 1),
                what=type(self).__name__,
            )

        try:
            try:
                values, decision = evaluate()
            except PlateCollision:
                if given:  # name the deepest plate, if this run of the model shows it
                    log_joint.check_plate_nesting(z, args, kwargs, guide_trace)
                    raise
                log_joint.max_plate_nesting = None  # found again, from a run of this call
                values, decision = evaluate()
        except Exception as error:
            # (a message that names the ways out already, as the probes' BatchMismatch, is kept)
            if self.vectorize is True and is_broadcast_error(error) and not _names_ways_out(error):
                add_hint(
                    error,
                    f"{type(self).__name__}(vectorize=True): the model does not evaluate all "
                    f"{z.shape[0]} points in one pass; pass vectorize=None (try the pass, fall "
                    "back to a loop over the points with one warning) or vectorize=False."
                    f"{product_advice(str(error))}",
                )
            raise
        if fit.decision is None or decision.vectorized != fit.decision.vectorized:
            fit.decision = decision
        fit.max_plate_nesting = log_joint.max_plate_nesting  # kept, found again if need be
        return total_of(values, z), log_joint.closed_priors

    def _get_trace(self, model, guide, args, kwargs):
        raise NotImplementedError(f"{type(self).__name__} evaluates the log joint at points")


class QuadratureELBO(PointsELBO):
    """The evidence lower bound integrated by a quadrature rule for Gaussian guides; for
    spike-and-slab guides, its moment-matched surrogate (see the module: exact only for
    likelihoods quadratic in each coordinate, not a bound otherwise).

    Args:
        rule: a rule name for `make_rule` (``"rasp_simplex"``,
            ``"rasp_cross"``, ``"hadamard"``, ``"blocked_simplex"``, ``"gauss_hermite"``, ``"mc"``,
            ``"vrmc1"``, ``"vrmc2"``) or a `QuadratureRule`.
        num_points: the rule's ``num_points`` (``None``: its default); only with a rule name.
        vectorize: ``True`` evaluates all nodes in one pass of the model under a particle plate,
            compared on the first call for a model and guide with single evaluations of two
            nodes (a disagreement raises `BatchMismatch`
            naming the reason and the ways out; later calls are not checked); ``False`` loops
            over nodes; ``None`` tries the vectorized pass on the first call, checks it the
            same way, and falls back to the loop with one warning if the model cannot broadcast
            over nodes (``PyroModule[nn.Linear]`` networks, say). The decision is kept per model
            and guide; a later call on a branch of the model that cannot broadcast falls back
            the same way. With ``True``, a broadcasting error propagates with a hint added to
            its message.
        max_plate_nesting: as in Pyro's ELBOs; ``inf`` finds it from a run of each model, and
            again on a later call that nests its plates deeper; a given value below the model's
            plates is refused, naming the plate.
        generator: the ``torch.Generator`` of random rules; ``None`` draws from torch's global
            generator, so ``pyro.set_rng_seed`` makes runs reproducible.
        name: key of the sequence position in Pyro's param store (``"{name}.step"``), for one
            guide; ``None`` (default) keeps one position per guide (`step_key`). Not used for
            a guide module under ``module_local_params=True``, which keeps its own.
        num_particles: refused (a ``TypeError``): the points are the rule's nodes.
        vectorize_particles: ``True`` is refused (a ``TypeError``): the switch is ``vectorize``
            (above); ``False`` changes nothing.

    Raises:
        ValueError: for a rule that cannot fit the scales (``gauss_hermite`` with one point); on
            a call, for a second guide under the same ``name``.

    The default rule, ``blocked_simplex`` with 3 nodes, was chosen on the benchmark suite and on
    models of Pyro's examples at equal gradient evaluations (``docs/benchmarks.md``, "The default
    rule"): as cheap as ``rasp_simplex`` per step and far closer to the optimum on hierarchical
    models.

    The sequence position (which matters for the ``hadamard`` rule) advances once per
    `loss_and_grads` or `differentiable_loss` call, never on `loss` (that is,
    not on ``SVI.evaluate_loss``). It lives in Pyro's param store, so saving and restoring the
    param store resumes the sequence where it stopped; ``pyro.clear_param_store()`` restarts it.
    Guides of two models fitted side by side each follow their own sequence. Under
    ``pyro.settings.set(module_local_params=True)`` a guide module keeps its position in its
    own buffer ``quadrature_elbo_step`` (`position_holder`): two instances of one model each
    follow their own sequence, and the guide's ``state_dict()`` saves and restores it.
    """

    def __init__(
        self,
        rule: str | QuadratureRule = "blocked_simplex",
        num_points: int | None = None,
        vectorize: bool | None = None,
        max_plate_nesting: float = float("inf"),
        generator: torch.Generator | None = None,
        name: str | None = None,
        num_particles: None = None,
        *,
        vectorize_particles: bool | None = None,
    ):
        if num_particles is not None:  # Trace_ELBO's argument, as a user porting code passes it
            raise TypeError(
                "QuadratureELBO takes no num_particles: its points are the rule's nodes. Set "
                "their number with num_points (e.g. QuadratureELBO('hadamard', num_points=8)), "
                "or draw Monte Carlo points with rule='mc' (or 'vrmc2')"
            )
        super().__init__(1, vectorize, max_plate_nesting, vectorize_particles=vectorize_particles)
        if isinstance(rule, str):
            rule = make_rule(rule, num_points)
        elif not isinstance(rule, QuadratureRule):
            raise TypeError(
                f"rule must be a rule name or a QuadratureRule, got {type(rule).__name__}"
            )
        elif num_points is not None:
            raise ValueError("num_points goes with a rule name; a rule object has its own")
        rule.check_sees_curvature()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string or None, got {type(name).__name__}")
        self.rule = rule
        self.generator = generator
        self.name = name
        self._name_owner: tuple[str, tuple[str, ...]] | None = None  # the guide of "{name}.step"
        # the description of the last loss and the guide module keeping its position (local
        # mode), for `_advance`
        self._met: tuple[GuideDescription, torch.nn.Module | None] | None = None

    # -- the sequence position: in Pyro's param store, or in a local-mode guide module --------

    def step_key(self, guide: Callable | GuideDescription) -> str:
        """The param store key holding ``guide``'s position in the rule's sequence.

        With ``name=None``: ``"QuadratureELBO.{guide name}.{first latent site}.step"``, so guides
        of different models keep their own positions; two guides with the same name and the same
        first site share one (as they share their parameters in Pyro's global param store).
        Under ``pyro.settings.set(module_local_params=True)`` a guide that is a module keeps its
        position itself (`position_holder`); the key is then only read once, when the ELBO
        first meets the guide (a checkpoint of an earlier version kept the position there).
        """
        if self.name is not None:
            return f"{self.name}.step"
        description = guide if isinstance(guide, GuideDescription) else describe_guide(guide)
        first = description.latent_sites[0].name if description.latent_sites else ""
        return f"QuadratureELBO.{description.guide}.{first}.step"

    def step(self, guide: Callable | GuideDescription) -> int:
        """The current position of ``guide`` in the rule's sequence (0 before its first run).

        Raises:
            TypeError: for a description under ``module_local_params=True``, where the
                position of a module guide is the guide's own: pass the guide.
        """
        if isinstance(guide, GuideDescription):
            if pyro.settings.get("module_local_params"):
                raise TypeError(
                    "QuadratureELBO.step: under pyro.settings.set(module_local_params=True) a "
                    "guide module keeps its own sequence position; pass the guide, not its "
                    "description"
                )
            holder = None
        else:
            holder = position_holder(guide)
        try:
            return self._position(guide, holder)
        except RuntimeError:  # the guide has not run yet
            return 0

    def _position(self, guide: Callable | GuideDescription, holder: torch.nn.Module | None) -> int:
        """The position kept by ``holder`` (its buffer `SEQUENCE_POSITION`), else in the param
        store (0 where neither has one)."""
        if holder is not None and SEQUENCE_POSITION in holder._buffers:
            return int(holder._buffers[SEQUENCE_POSITION])
        key = self.step_key(guide)
        store = pyro.get_param_store()
        return int(store[key].item()) if key in store else 0

    def _claim_name(self, description: GuideDescription) -> None:
        """Refuse a second guide under one ``name``: the two would read and advance one
        position, each seeing only some steps of the rule's sequence.

        The guide is known by its name and its latent sites (as Pyro's param store knows its
        parameters), recorded while ``"{name}.step"`` is not in the param store; a guide made
        again for the same model (after restoring the store) is the same guide.
        """
        if self.name is None:
            return
        owner = (description.guide, tuple(site.name for site in description.latent_sites))
        if self._name_owner is None or self.step_key(description) not in pyro.get_param_store():
            self._name_owner = owner
        elif owner != self._name_owner:
            raise ValueError(
                f"QuadratureELBO(name={self.name!r}) keeps the sequence position of one guide "
                f"in the param store ({self.step_key(description)!r}), that of "
                f"{_guide_words(self._name_owner)}; {_guide_words(owner)} would read and "
                "advance the same position, so each guide would see only some steps of the "
                "rule's sequence. Give each guide its own QuadratureELBO(name=...), or pass "
                "name=None (a position per guide)"
            )

    def _meet(self, guide: Callable, description: GuideDescription) -> int:
        """``guide``'s position for this call, recorded for `_advance`. A local-mode guide
        module met for the first time gets its position buffer here (`position_holder`), so
        that its ``state_dict()`` holds the position from then on, and the load pre-hook
        `take_saved_position`, so that a saved state with or without a position loads."""
        holder = position_holder(guide)
        if holder is None:
            self._claim_name(description)
        elif SEQUENCE_POSITION not in holder._buffers:
            start = torch.tensor(self._position(description, None), dtype=torch.int64)
            holder.register_buffer(SEQUENCE_POSITION, start)
            _follow_saved_positions(holder)
        self._met = (description, holder)
        return self._position(description, holder)

    def _advance(self, description: GuideDescription) -> None:
        met, self._met = self._met, None
        holder = met[1] if met is not None and met[0] is description else None
        if holder is not None:
            # a new tensor, on the CPU: a state_dict taken before keeps its value, and the next
            # read needs no device sync
            position = torch.tensor(int(holder._buffers[SEQUENCE_POSITION]) + 1)
            holder.register_buffer(SEQUENCE_POSITION, position)
            return
        position = torch.tensor(float(self._position(description, None) + 1), dtype=torch.float64)
        store, key = pyro.get_param_store(), self.step_key(description)
        if key in store:  # the store maps every tensor ever set to its name: drop the old one
            del store[key]
        store[key] = position

    # -- the loss ------------------------------------------------------------------------------

    def _quadrature_loss(
        self, model: Callable, guide: Callable, args, kwargs
    ) -> tuple[torch.Tensor, GuideDescription]:
        if torch._C._are_functorch_transforms_active():
            raise RuntimeError(
                "QuadratureELBO cannot run under a torch.func transform (grad, vjp, vmap, "
                "jacrev, ...): its backward publishes the moments g, h that QNVB reads, which "
                "no transform can carry out, and a Pyro guide reads its parameters from Pyro's "
                "param store, which torch.func.functional_call does not replace (Pyro's "
                "Trace_ELBO gets zero gradients there). Take the gradients with loss.backward() "
                "or torch.autograd.grad(loss, list(guide.parameters()))"
            )
        guide_trace, description = self._described_run(model, guide, args, kwargs)
        position = self._meet(guide, description)
        entropy = description.entropy_outside_kl()
        try:
            with without_autocast(entropy.device.type):  # a rotation's matmul in entropy.dtype
                nodes = self.rule.draw(
                    description.dim,
                    step=position,
                    generator=self.generator,
                    dtype=entropy.dtype,
                    device=entropy.device,
                )
        except ValueError as error:  # too many nodes: for sites the guide should not have?
            names = [site.name for site in description.latent_sites]
            observed = first_observed_by_the_model(model, names, args, kwargs)
            if observed is not None:
                raise observed_by_the_model(observed) from error
            raise
        x, node_weights = self.local_nodes(nodes.matrix(), nodes.weights)
        expected = frozenset()
        if description.joint is None:
            closed = _ClosedPriors(description)
            z = _NodePoints.apply(description.loc, description.scale, x, closed)
            if self.rule.exact_coordinate_quadratics:
                expected = frozenset(s.name for s in description.sites if s.family == "gaussian")
        else:
            z = description.affine(x)
        try:
            log_joint, priors = self._log_joint(
                model,
                guide,
                description,
                z,
                args,
                kwargs,
                guide_trace,
                expected,
                # past 0, steps of this ELBO moved the guide; at 0 it may still have moved
                # (fitted by another ELBO, a state_dict loaded, an ELBO of another name): both
                # advices
                True if position > 0 else None,
            )
        except ValueError as error:  # not finite: a half-precision guide is the likelier cause
            _refuse_half_precision(description, error)
            raise
        # float64 data with float32 latents give a float64 log joint, as in Trace_ELBO
        weights = node_weights.to(torch.promote_types(node_weights.dtype, log_joint.dtype))
        with without_autocast(log_joint.device.type):  # the sum in the log joint's dtype
            loss = -(weights @ log_joint) - entropy
        if priors:
            loss = loss - closed.expected_log_prior(priors, weights.sum().detach())
        if not torch.isfinite(loss):
            _refuse_unpositive_scales(description)
            raise ValueError(
                f"QuadratureELBO: the loss is not finite ({loss.item()}); the guide's entropy is "
                f"{entropy.item()}: a scale collapsed to zero or overflowed"
            )
        if description.joint is None:
            closed.loss = loss.detach()  # published with the moments (SparseQNVB's check)
        return loss, description

    def local_nodes(
        self, x: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The nodes ``(K, dim)`` this process evaluates, and their weights: all of them.

        The hook of node-parallel evaluation
        (`DistributedQuadratureELBO`), which keeps a share.
        """
        return x, weights

    def loss(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """The negative ELBO, without gradients; does not advance the sequence."""
        with torch.no_grad():
            value = self._quadrature_loss(model, guide, args, kwargs)[0].item()
        self._met = None  # nothing to advance
        return value

    def differentiable_loss(
        self, model: Callable, guide: Callable, *args, **kwargs
    ) -> torch.Tensor:
        """The negative ELBO as a differentiable tensor; advances the sequence by one step.

        Its backward pass publishes the moments ``g``, ``h`` of every elementwise site.
        """
        with generator_kept(self.generator):  # a call that fails has drawn nothing
            loss, description = self._quadrature_loss(model, guide, args, kwargs)
        self._advance(description)
        return loss

    def loss_and_grads(self, model: Callable, guide: Callable, *args, **kwargs) -> float:
        """The negative ELBO; accumulates its gradients; advances the sequence by one step.

        Raises:
            RuntimeError: under ``torch.no_grad()`` or ``torch.inference_mode()`` (a step that
                could change nothing: `loss` evaluates), and where no parameter of the guide
                can take a gradient (`_untrainable`).
        """
        if not torch.is_grad_enabled():
            raise step_without_grad_refusal("QuadratureELBO.loss_and_grads (svi.step)")
        with generator_kept(self.generator):  # a step that fails has drawn nothing
            loss, description = self._quadrature_loss(model, guide, args, kwargs)
            if loss.requires_grad:
                self._backward(loss, model, guide)
            else:
                refusal = _untrainable(guide)
                if refusal is not None:
                    raise refusal
            self._advance(description)  # once the backward ran: a refused step keeps the position
        return loss.item()

    def _backward(self, loss: torch.Tensor, model: Callable, guide: Callable) -> None:
        """``loss.backward()``, refusing a layer of a `BayesianModule`'s net that a
        ``torch.utils.checkpoint`` recomputes in it (`refuse_recomputed_forward`: its gradients
        would be the means', not the nodes'), and naming the checkpoint where the backward of a
        vectorized pass fails."""
        owner = type(self).__name__
        with refuse_recomputed_forward(owner, _CHECKPOINT_FIX, called_by_place):
            try:
                loss.backward()
            except RuntimeError as error:
                if self.vectorized(model, guide) and not isinstance(error, RecomputedForward):
                    add_hint(error, _vectorized_backward_hint(owner, error))
                raise

    def __repr__(self) -> str:
        return f"QuadratureELBO(rule={self.rule!r}, vectorize={self.vectorize})"


_CHECKPOINT_FIX = (
    "Remove the checkpoint (for memory, take fewer rows a step: a smaller minibatch, the "
    "likelihood's dataset_size kept); a checkpoint of a part without parameters, "
    "checkpoint(torch.tanh, h), runs with vectorize=False"
)


def _vectorized_backward_hint(owner: str, error: RuntimeError) -> str:
    """What to do where the backward of a vectorized pass failed (the pass itself ran): loop
    over the nodes; a ``torch.utils.checkpoint`` recomputing outside ``vmap`` (a tensor of
    other metadata, or one that escaped the vmap) is named."""
    said = str(error)
    checkpoint = isinstance(error, CheckpointError) or (
        "escaped from inside a function being vmapped" in said
    )
    why = (
        " (a torch.utils.checkpoint in the net's forward recomputes its part in the backward, "
        "outside torch.func.vmap, where the saved tensors carry the nodes' dim)"
        if checkpoint
        else ""
    )
    fix = f". {_CHECKPOINT_FIX}" if checkpoint else ""
    return (
        f"{owner}: the backward of the vectorized pass over the nodes failed{why}; pass "
        f"vectorize=False to evaluate the nodes one at a time{fix}"
    )


def grad_mode_words() -> str:
    """The context that turns gradients off where this is called, in words: torch cannot tell
    ``torch.no_grad()`` from ``torch.set_grad_enabled(False)``, so both are named."""
    if torch.is_inference_mode_enabled():
        return "torch.inference_mode()"
    return "torch.no_grad() (or torch.set_grad_enabled(False))"


def step_without_grad_refusal(caller: str) -> RuntimeError:
    """The refusal of a step ``caller`` (``"QuadratureELBO.loss_and_grads (svi.step)"``) called
    with gradients off, which would change nothing (QuadratureELBO's, and QNVB's under Pyro's
    ELBOs)."""
    return RuntimeError(
        f"{caller} was called under {grad_mode_words()}: no gradient and no moments reach the "
        "optimizer, so the step would change nothing. Take the step outside it; for the loss "
        "alone call svi.evaluate_loss(*args) or elbo.loss(model, guide, *args)"
    )


def inference_parameters_refusal(owner: str, names: list[str]) -> RuntimeError:
    """The refusal of a step on the parameters ``names``, inference tensors: the first run that
    made them (the guide's; under QNVB and Pyro's ELBOs, a model's ``pyro.param`` too) was under
    ``torch.inference_mode()`` (QuadratureELBO's, and QNVB's under Pyro's ELBOs)."""
    return RuntimeError(
        f"{owner}: the parameters {names} are inference tensors: the first run that made "
        "them (the guide's, or the model's for a pyro.param of the model) was under "
        "torch.inference_mode() (an svi.evaluate_loss or a Predictive before training, say), "
        "and no step can train them (the loss has no gradient through them, and torch updates "
        "no inference tensor outside inference_mode). Run the guide (and model) first outside "
        "inference_mode (torch.no_grad() is fine), or load its state_dict into a new guide run "
        "outside it"
    )


def _untrainable(guide: Callable) -> RuntimeError | None:
    """Why a loss of ``guide`` has no gradient, where its parameters cannot take one: they are
    inference tensors (the guide's first run, which makes them, was under
    ``torch.inference_mode()``: an ``evaluate_loss`` or ``Predictive`` before training), or none
    of them requires grad (``guide.requires_grad_(False)``). ``None`` for a guide that is no
    module, or one without parameters."""
    if not isinstance(guide, torch.nn.Module):
        return None
    named = list(guide.named_parameters())
    made_in_inference = [name for name, p in named if p.is_inference()]
    if made_in_inference:
        return inference_parameters_refusal("QuadratureELBO", made_in_inference)
    if named and not any(p.requires_grad for _, p in named):
        return RuntimeError(
            "QuadratureELBO: none of the guide's parameters requires grad "
            "(guide.requires_grad_(False)?), so no step can train them. Call "
            "guide.requires_grad_(True) to train it, or svi.evaluate_loss(*args) for the loss"
        )
    return None


def _guide_words(owner: tuple[str, tuple[str, ...]]) -> str:
    guide, sites = owner
    return f"the guide {guide!r} of the sites {', '.join(map(repr, sites))}"


def _names_ways_out(error: BaseException) -> bool:
    """Whether ``error``'s message already tells the user to pass ``vectorize=None`` (the
    probes' `BatchMismatch`, a ``BayesianModule``'s vmap refusal)."""
    return "vectorize=None" in str(error)


class _NodePoints(torch.autograd.Function):
    """The node points ``z = loc + scale * x`` of a mean field, ``(K, D)``; its
    backward computes the two sums the gradients of ``loc`` and ``scale`` are made of,

        dloss/dloc = sum_k dloss/dz_k,        dloss/dscale = sum_k dloss/dz_k * x_k,

    and publishes each elementwise site's moments ``g`` and ``h`` from the same two sums (the
    module's formulas; rasp paper, eq. 7, 8 and 11), so each is computed once, not once for the
    moments and again for the parameters' gradients.
    """

    @staticmethod
    def forward(ctx, loc, scale, x, closed):
        ctx.save_for_backward(loc, scale, x)
        ctx.closed = closed
        return loc + scale * x  # not addcmul: its fused rounding would change every result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        loc, scale, x = ctx.saved_tensors
        gx_all = (grad * x).sum(0)  # first: its product of all nodes is freed before g_all
        g_all = grad.sum(0)
        g_pub, gx_pub = ctx.closed.with_priors(g_all, gx_all, loc, scale)
        # (the priors' sums are new tensors, which the publication may overwrite)
        spare = gx_pub is not gx_all
        _publish(ctx.closed.description, g_pub, gx_pub, scale, ctx.closed.loss, spare)
        return g_all, gx_all, None, None


class _ClosedPriors:
    """The priors of Gaussian sites integrated in closed form, for a rule exact on ``1``,
    ``x_j``, ``x_j^2`` (`exact_coordinate_quadratics`).

    With ``U(z) = -c log N(z | m, s^2)`` per coordinate (``c`` the site's scale) and nodes
    ``z_k = mu + sigma x_k`` of total weight ``W``, such a rule gives exactly

        sum_k w_k U(z_k)        = W c [((mu - m)^2 + sigma^2) / (2 s^2) + log s + log(2 pi) / 2]
        sum_k w_k U'(z_k)       = W c (mu - m) / s^2
        sum_k w_k U'(z_k) x_k   = W c sigma / s^2,

    the prior's parts of the loss and of the two sums `_NodePoints` makes (rasp paper,
    eq. 7, 8 and 11, with the prior's Hessian ``1 / s^2``). So the prior is never evaluated at
    the K nodes (``K x D`` work, forward and backward, on a network's every weight): the loss
    takes the first line, differentiable in ``mu`` and ``sigma`` (its gradients in them are the
    second and the third line), and the node points' backward adds those two lines to the sums
    it publishes the moments from.
    """

    def __init__(self, description: GuideDescription):
        self.description = description
        self.pieces: list[tuple[int, int, float, float, float]] = []  # start, stop, m, s, c
        self.total_weight: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None  # the step's, detached: published with the moments

    def expected_log_prior(
        self, priors: dict[str, tuple[float, float, float]], total_weight: torch.Tensor
    ) -> torch.Tensor:
        """``W sum_sites c E_q[log N(z | m, s^2)]``, differentiable in the sites' ``mu`` and
        ``sigma``; records the pieces for `with_priors`."""
        self.total_weight = total_weight
        value = torch.zeros((), dtype=total_weight.dtype, device=total_weight.device)
        start = 0
        for site in self.description.sites:
            stop = start + site.loc.numel()
            if site.name in priors:
                m, s, c = priors[site.name]
                self.pieces.append((start, stop, m, s, c))
                value = value + c * expected_log_density(m, s, site.loc, site.scale)
            start = stop
        return total_weight * value

    def with_priors(
        self, g_all: torch.Tensor, gx_all: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The node sums with the priors' parts added (new tensors when there are any)."""
        if not self.pieces:
            return g_all, gx_all
        # g_all + factor * (loc - m) and gx_all + factor * scale, each part made in its slice of
        # the new tensors (no temporary of a site's size; a sum rounds alike in either order)
        g_pub, gx_pub = torch.empty_like(g_all), torch.empty_like(gx_all)
        done = 0
        for start, stop, m, s, c in self.pieces:
            g_pub[done:start].copy_(g_all[done:start])
            gx_pub[done:start].copy_(gx_all[done:start])
            factor = self.total_weight * (c / (s * s))
            part = g_pub[start:stop]
            if m != 0:
                torch.sub(loc[start:stop], m, out=part).mul_(factor)
            else:
                torch.mul(factor, loc[start:stop], out=part)
            part.add_(g_all[start:stop])
            torch.mul(factor, scale[start:stop], out=gx_pub[start:stop]).add_(gx_all[start:stop])
            done = stop
        g_pub[done:].copy_(g_all[done:])
        gx_pub[done:].copy_(gx_all[done:])
        return g_pub, gx_pub


def _publish(
    description: GuideDescription,
    g_all: torch.Tensor,
    gx_all: torch.Tensor,
    scale: torch.Tensor,
    loss: torch.Tensor | None,
    spare: bool = False,
) -> None:
    """Publish each elementwise site's ``g``, ``h`` from the node sums of `_NodePoints`,
    with the step's ``loss`` (detached); ``spare``: ``gx_all`` is no one else's, ``h`` is
    computed in it."""
    # a scale at zero (a collapsed mixture) has h = 0, not 0 / 0: torch.where(scale > 0,
    # gx_all / scale, 0), without its two (three) more tensors of the latent vector's size
    h_all = gx_all.div_(scale) if spare else gx_all / scale
    h_all.masked_fill_((scale > 0).logical_not_(), 0.0)
    start = 0
    for site in description.sites:
        stop = start + site.loc.numel()
        if site.family in ELEMENTWISE_FAMILIES:
            # views of g_all, h_all without a minibatch scale (x / 1 is x): QNVB then reads
            # the blocks as one buffer, without a copy; in the site's dtype, as the
            # gradient of its loc is (the points of a float32 and a float64 site are float64)
            dtype = site.loc.dtype
            g = g_all[start:stop].reshape(site.shape).to(dtype)
            h = h_all[start:stop].reshape(site.shape).to(dtype)
            if site.scale_factor != 1.0:
                g, h = g / site.scale_factor, h / site.scale_factor
            version = site.params["loc"]._version
            publish_moments(PublishedMoments(site, g, h, version, loss))
        start = stop


def _refuse_half_precision(description: GuideDescription, error: ValueError) -> None:
    """Where the log joint was refused as not finite, refuse instead a guide whose loc is
    narrower than float32 (`check_precision`, QNVB's refusal), naming the site: a float16 net's
    log likelihood of 10^4 rows overflowed, and the message blamed the model's support. A
    half-precision guide whose log joint is finite runs (under Pyro's optimizers; QNVB refuses
    it at its step)."""
    from ..optim.torch_qnvb import check_precision  # (the optimizers import this package)

    try:
        for site in description.sites:
            check_precision(site.loc, f"site {site.name!r}", "QuadratureELBO")
        if description.joint is not None:
            check_precision(description.joint.loc, "the joint Gaussian's loc", "QuadratureELBO")
    except TypeError as refusal:
        raise refusal from error


def _refuse_unpositive_scales(description: GuideDescription) -> None:
    """Raise for the first elementwise block whose declared ``scale`` is not positive or not
    finite, naming its site, its smallest value and the cause: a negative (or nan) scale is a
    declaration that is not positive (a hand-written guide's ``-softplus(raw)``, or a raw
    parameter under no map); 0 or inf, a scale that collapsed or overflowed. A Gaussian's
    scale must be > 0; another family's (a mixture's slab) may be 0, a collapsed mixture."""
    for site in description.sites:
        scale = site.scale.detach()
        low = scale <= 0 if site.family == "gaussian" else scale < 0
        bad = low | ~torch.isfinite(scale)
        if not bad.any():
            continue
        worst = scale[bad].min().item()  # nan where one is nan
        head = (
            f"QuadratureELBO: the loss is not finite: the guide {description.guide} declares at "
            f"site {site.name!r} a scale of {worst:.4g} ({int(bad.sum())} of {scale.numel()} "
            "entries not positive and finite), and a block's scale, the standard deviation of "
            "its nodes, must be > 0."
        )
        if worst < 0 or math.isnan(worst):
            raise ValueError(
                f"{head} Declare it positive, e.g. softplus(raw) or raw.exp() of the raw "
                "parameter, with the matching param_constraints['scale'] (softplus_positive or "
                "positive)"
            )
        raise ValueError(f"{head} It collapsed to zero or overflowed during the fit")
