"""``BayesianModule``: any ``torch.nn.Module`` as a Pyro model with its parameters as latents.

The network is never rewritten. Each forward pass samples one value per parameter (a site named by
the parameter's path in the net, ``"0.weight"``) and runs the net on them with
``torch.func.functional_call(net, {**params, **buffers}, (x,))``.

**One pass for all nodes.** Under a particle plate (``QuadratureELBO``'s nodes,
``Trace_ELBO(vectorize_particles=True)``, ``Predictive(parallel=True)``) the sampled values carry
leading dims ``batch + (1,) + param.shape``: the ``(1,)`` is the module's own data plate (dim -1).
The module strips it, flattens ``batch`` into one axis of ``n`` points, evaluates
``torch.func.vmap(functional_call)`` over it and reshapes the outputs to ``batch + (B,) + row`` so
that the data plate lines up at dim -1 and the particle plate at its own dim.

**Layers that declare their parameters.** A submodule may define a method
``bayesian_parameters() -> Mapping[str, "deterministic" | Distribution]`` over (some of) its own
parameters, by their names in the module (``"s1"``, not ``"0.s1"``): ``"deterministic"`` makes
the parameter a point estimate (a hidden ``pyro.param``), a distribution of its shape is its prior,
in place of the network's prior. `WHVILinear` declares its ``s1``, ``s2``
deterministic and ``g ~ N(0, prior_scale^2)`` (Rossi et al. 2020, Sec. 2).
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import TYPE_CHECKING

import pyro
import torch
from pyro.infer.autoguide.initialization import init_to_feasible, init_to_value
from pyro.nn import PyroModule
from pyro.poutine import Trace
from torch import nn
from torch.distributions import Distribution, constraints
from torch.func import vmap
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm as SpectralNormHook

from ..infer.batched import (
    call_by_place,
    check_value_dtype,
    first_line,
    is_vmap_refusal,
    sum_is_finite,
    user_stacklevel,
    vmap_safe_attention,
)
from ..optim.qnvb_functional import QNVBHyperparameters
from ..optim.torch_qnvb import (
    BufferSnapshot,
    check_tensor_output,
    nonfinite_data,
    refuse_script_module,
)
from ..quadrature import QuadratureRule
from ..store import follow_store, shortened, uncompiled
from .likelihoods import Likelihood
from .priors import LayerwiseNormal

if TYPE_CHECKING:
    from .predict import Prediction

__all__ = ["NETWORK_QNVB_SETTINGS", "BayesianModule"]

DETERMINISTIC = "deterministic"  # a declared role: a point estimate (see the module docstring)

NETWORK_QNVB_SETTINGS: Mapping[str, float] = MappingProxyType(
    {"trust_region": 0.3, "scale_max": 2.0, "significance": 1.0}
)
"""What a `BayesianModule` declares for QNVB at each of its weights (``qnvb_settings``):
the mean moves at most ``0.3 sigma`` a step, ``sigma`` at most doubles a step and holds until the
curvature is significant (``docs/nn.md``, "Quality: what to expect against IVON and Adam";
``docs/benchmarks.md``). Read-only."""


class BayesianModule(PyroModule):
    """A Pyro model ``bnn(x, y=None)`` from a network, a prior and a likelihood.

    Args:
        net: any ``torch.nn.Module`` taking one input tensor ``x`` of ``B`` rows; it is used
            unmodified, and put in eval mode (see below). A ``torch.compile`` wrapper is looked
            through: the module it holds is the net (its sites named as the eager net's, so a
            store saved from one restores into the other), since the vectorized pass runs under
            ``vmap``, where dynamo compiles nothing. A TorchScript module (``torch.jit.script``,
            ``torch.jit.trace``) is refused with a ``TypeError``: pass the eager net. Its
            forward must use the weights swapped in: a net whose outputs depend on none of them
            (it reads a dict of its parameters captured in ``__init__``, or detached copies)
            is refused at its first run with a ``ValueError``, one that misses some (an unused
            head) gets one ``RuntimeWarning`` naming them.
        prior: a callable ``(name, param) -> distribution`` of the parameter's shape
            (`pyro_quadvi.nn.priors`); all its dims become event dims.
        likelihood: how the outputs explain ``y`` (`pyro_quadvi.nn.likelihoods`).
        hide: parameter names (as in ``net.named_parameters()``) that stay deterministic: they are
            registered with ``pyro.param`` under ``"net.<name>"`` (as ``pyro.module`` would name
            them), so ``SVI``'s optimizer (QNVB's fallback) point-estimates them in place.
            ``None`` (the default): the parameters the net's layers declare ``"deterministic"``
            (see below). A given ``hide`` is the whole hidden set: it replaces those declarations.
        declarations: read the layers' declarations (``bayesian_parameters()``); ``False``
            ignores them, so that ``prior`` and ``hide`` alone decide every parameter.
        qnvb_settings: the QNVB hyperparameters each weight's site declares
            (``infer={"qnvb": ...}``, `hints`), which
            `QNVB` takes in place of its own defaults for those blocks
            (settings passed to ``QNVB(...)`` still win): `NETWORK_QNVB_SETTINGS` by
            default; ``{}`` declares none.

    Every other parameter of ``net`` is a latent ``pyro.sample(name, prior(name, p).to_event())``.

    **Declarations.** Any submodule of ``net`` may define ``bayesian_parameters()``, returning a
    mapping from some of its own parameter names (``module.named_parameters(recurse=False)``) to
    ``"deterministic"`` or to a distribution of the parameter's shape, its prior. Precedence: a
    parameter is hidden if it is in ``hide``, or, with ``hide=None``, if its layer declares it
    ``"deterministic"``; a latent parameter's prior is its layer's declared distribution if there
    is one (and ``declarations=True``), else ``prior(name, param)``. A declaration naming a
    parameter the layer does not have, or a role that is neither, raises at construction.

    **Buffers** (batch-norm running statistics) are passed to the net unchanged: the net runs in
    eval mode, so batch norm normalizes with its running statistics as they are and never updates
    them, and dropout is off. ``bnn.train()`` leaves the net in eval mode. For the same reason
    spectral normalization of a sampled or trained weight is refused (its ``u``, ``v`` stay those
    of the build-time weight).

    **Padding.** An ``nn.Embedding(padding_idx=p)`` whose weight is latent runs with the layer's
    own row ``p`` (a constant, as in plain torch, where that row gets no gradient); the sampled
    row ``p`` is a dummy the likelihood never sees. A weight tied to another layer is sampled whole.

    Call it as a Pyro model (``SVI(bnn, guide, ...)``, ``Predictive(bnn, ...)``); it returns the
    net's outputs (``batch + (B,) + row``). `predict` gives a Bayesian model average.
    """

    def __init__(
        self,
        net: nn.Module,
        prior: Callable,
        likelihood: Likelihood,
        hide: Iterable[str] | None = None,
        declarations: bool = True,
        qnvb_settings: Mapping[str, object] | None = None,
    ):
        super().__init__()
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        net = uncompiled(net)
        refuse_script_module(
            net, "BayesianModule", "Pass the eager net (the module you scripted or traced)"
        )
        if not callable(prior):
            raise TypeError(f"prior must be callable (name, param) -> distribution, got {prior!r}")
        if not isinstance(likelihood, Likelihood):
            raise TypeError(
                f"likelihood must be a pyro_quadvi.nn.likelihoods.Likelihood (Gaussian(N, "
                f"scale=...), Categorical(N), Bernoulli(N), or a subclass of your own), got "
                f"{_brief(likelihood)}"
            )
        names = [name for name, _ in net.named_parameters()]
        declared_hidden, declared_priors = _declarations(net) if declarations else ((), {})
        if hide is None:
            hide = declared_hidden
        elif isinstance(hide, str):
            raise TypeError(f"hide must be an iterable of parameter names, got the string {hide!r}")
        elif not isinstance(hide, Iterable):
            raise TypeError(
                f"hide must be an iterable of parameter names (a list of str, as in "
                f"net.named_parameters()), got {_brief(hide)}"
            )
        hide = tuple(hide)
        odd = [name for name in hide if not isinstance(name, str)]
        if odd:
            raise TypeError(
                f"hide must hold parameter names (str, as in net.named_parameters()), got {odd}"
            )
        unknown = sorted(set(hide) - set(names))
        first = {id(p): name for name, p in net.named_parameters()}
        tied = {
            alias: first[id(p)]
            for alias, p in net.named_parameters(remove_duplicate=False)
            if alias in unknown
        }
        if tied:
            alias, name = next(iter(tied.items()))
            raise ValueError(
                f"hide names {alias!r}, which is tied to {name!r} (the same Parameter): a tied "
                f"parameter is one site, named by its first name; hide {name!r}"
            )
        if unknown:
            raise ValueError(
                f"hide names {unknown}, which are not parameters of the net ({', '.join(names)})"
            )
        _refuse_batch_statistics(net)
        _refuse_spectral_norm(net)
        net.eval()
        self.net = net
        self.prior = prior
        self.likelihood = likelihood
        self.hide = hide
        # the store's tensor of each hidden parameter, as last installed (follow_store)
        self._installed: dict[str, torch.Tensor] = {}
        settings = NETWORK_QNVB_SETTINGS if qnvb_settings is None else qnvb_settings
        if not isinstance(settings, Mapping):
            raise TypeError(f"qnvb_settings must be a dict of QNVB settings, got {settings!r}")
        unknown = sorted(set(settings) - {f.name for f in fields(QNVBHyperparameters)})
        if unknown:
            raise TypeError(
                f"qnvb_settings names unknown QNVB settings {unknown}; QNVB takes "
                f"{[f.name for f in fields(QNVBHyperparameters)]}"
            )
        QNVBHyperparameters(**settings)  # the values: checked now, not at the first step
        self.qnvb_settings = dict(settings)
        # the latent parameters whose use by the net was checked (_check_reached), once
        self._reached: tuple[str, ...] | None = None
        # latent parameter name -> (module path, name in the module) of its declared prior
        self._declared = {n: where for n, where in declared_priors.items() if n not in hide}
        if isinstance(prior, LayerwiseNormal):  # bound to this net: a copy, so that the
            # same prior object can serve another network with other shapes
            self.prior = prior = copy.copy(prior)
            prior.bind(net.named_parameters(), net.named_modules())

    def __setstate__(self, state: dict) -> None:
        # a module pickled before modules declared QNVB settings declares none, as it did then
        state.setdefault("qnvb_settings", {})
        state.setdefault("_reached", None)
        super().__setstate__(state)

    # -- the pieces -----------------------------------------------------------------------------

    @property
    def _net(self) -> nn.Module:
        # self._modules, not self.net: PyroModule.__getattr__ would issue pyro.module(net),
        # making every parameter of the net a pyro.param.
        return self._modules["net"]

    def train(self, mode: bool = True) -> BayesianModule:
        """Sets this module's mode; the net stays in eval mode (running statistics as they are)."""
        super().train(mode)
        self._net.eval()
        return self

    def latent_parameters(self) -> dict[str, nn.Parameter]:
        """The net's parameters that are latent sites, by name, in the net's order: all but the
        hidden and the frozen ones (``requires_grad=False``)."""
        return {
            n: p for n, p in self._net.named_parameters() if n not in self.hide and p.requires_grad
        }

    def frozen_parameters(self) -> dict[str, nn.Parameter]:
        """The net's frozen parameters (``requires_grad=False``), by name: constants, passed to
        the net as they are, like buffers; neither latent nor trained, hidden or not."""
        return {n: p for n, p in self._net.named_parameters() if not p.requires_grad}

    def init_to_net(self, fallback: Callable | None = init_to_feasible) -> Callable:
        """An ``init_loc_fn`` that starts a guide at the net's current parameters.

        ``AutoMeanFieldNormal(bnn)`` (Pyro's default ``init_to_feasible``) starts every weight at
        the prior's centre, 0: a network whose units are all alike (a ReLU net without bias is
        dead). ``AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())`` starts each latent
        parameter at its value in the net now (PyTorch's initialization, or a pretrained fit), as
        Pyro's ``init_to_value``; other sites (a learned noise scale) go to ``fallback``.
        """
        values = {name: p.detach().clone() for name, p in self.latent_parameters().items()}
        return init_to_value(values=values, fallback=fallback)

    def invalid_start_hint(self, trace: Trace) -> str | None:
        """The likely cause of a log density that is not finite at a guide's initial values,
        read from the run's ``trace`` (the one `QuadratureELBO` makes to
        name the site), or ``None``: latent weights of a parametrized layer (``weight_norm``'s
        ``original0``, ``original1``) that start at 0 everywhere, where a layer that divides its
        weight by a norm computes 0/0. Weights of plain layers at 0 are no cause (Pyro's default
        start puts every weight there): the general advice stands then."""
        shown = [
            name
            for name in self.latent_parameters()
            if ".parametrizations." in f".{name}"
            and name in trace.nodes
            and not bool((trace.nodes[name]["value"] != 0).any())
        ]
        if not shown:
            return None
        listed = shortened(map(repr, shown), 4, None)
        return (
            f"the BayesianModule's weights {listed} start at 0 everywhere (the guide's "
            "init_loc_fn; Pyro's default init_to_feasible puts a weight at its prior's centre), "
            "and a layer that divides its weight by a norm (weight_norm, another "
            "parametrization) divides 0 by 0 there. Start the guide at the net's weights: "
            "AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())"
        )

    def prior_of(self, name: str, param: torch.Tensor) -> Distribution:
        """The prior of one parameter, all its dims event dims: its layer's declared prior if it
        has one, else the network's ``prior(name, param)``."""
        if name in self._declared:
            path, local = self._declared[name]
            module = self._net.get_submodule(path)
            fn = _declared_role(module, path, local, _declared(module, path))
            if not isinstance(fn, Distribution):
                raise ValueError(
                    f"{_where(module, path)} now declares {local!r} {fn!r}; it declared a prior "
                    "when the BayesianModule was built: build a new one"
                )
        else:
            fn = self.prior(name, param)
            if not isinstance(fn, Distribution):
                raise TypeError(
                    f"the prior callable returned {_brief(fn)} for the parameter {name!r}; it "
                    "must return a distribution of the parameter's shape (or a scalar one), "
                    "e.g. dist.Normal(torch.zeros_like(param), 1.0), not a tensor or a value"
                )
        return _as_event(name, fn, param)

    def hidden_values(self) -> dict[str, torch.Tensor]:
        """The deterministic (hidden) parameters, as ``pyro.param`` sites ``"net.<name>"``.

        The param store holds the net's own Parameter, which its optimizer updates in place.
        Where the store holds another tensor under that name (restored by ``set_state`` or
        ``load``, or assigned), its value is copied into the net's Parameter and the store takes
        the Parameter back, so that the net (``net.state_dict()``, `init_to_net`, an
        export) follows what is trained.
        """
        values = {}
        params = dict(self._net.named_parameters())
        for name in self.hide:
            param = params[name]
            if not param.requires_grad:  # frozen: a constant (pyro.param would unfreeze it)
                continue
            fullname = f"net.{name}" if not self._pyro_name else f"{self._pyro_name}.net.{name}"
            if pyro.settings.get("module_local_params"):
                # no param store: a param statement for the handlers (SVI collects the leaf
                # through ``value.unconstrained()``, as for a PyroModule's own parameters)
                value = param.view_as(param)
                value.unconstrained = weakref.ref(param)
                values[name] = pyro.poutine.runtime.effectful(type="param")(
                    lambda *_, value=value, **__: value
                )(fullname, value, constraint=constraints.real, name=fullname)
            else:
                follow_store(fullname, param, self._installed)
                values[name] = pyro.param(fullname, param)
                self._installed[fullname] = pyro.get_param_store()[fullname]
        return values

    def evaluate(self, values: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The net on ``x`` with the latent parameters set to ``values``; batched when they are.

        Args:
            values: name -> value of every latent parameter, each ``param.shape`` (one net) or
                ``lead + (1,) + param.shape``, the ``(1,)`` being the module's data plate (dim
                -1), as sample sites under a particle plate are; a lead whose last dim is not 1
                is taken whole (``Predictive(parallel=True)`` passes ``(S,) + param.shape``).
            x: the inputs, ``B`` rows.

        Returns:
            The outputs ``lead + (B,) + row``, ``lead`` the broadcast of the values' leads.
        """
        return self._evaluate(values, x)[0]

    def _evaluate(self, values, x) -> tuple[torch.Tensor, int]:
        params = self.latent_parameters()
        missing = sorted(set(params) - set(values))
        if missing:
            raise ValueError(f"no values for the latent parameters {missing}")
        extra = sorted(set(values) - set(params))
        if extra:
            raise ValueError(
                f"values for {extra}, which are not latent parameters of the net (those are "
                f"{list(params)}); leave other sites (a learned noise scale) out"
            )
        # the innermost modules in training mode (the layers, not the containers above them)
        training = [
            _where(m, path)
            for path, m in self._net.named_modules()
            if m.training and not any(child.training for child in m.children())
        ]
        if training:
            shown = shortened(training, 6, None)
            raise ValueError(
                f"BayesianModule: {shown} of the network {'is' if len(training) == 1 else 'are'} "
                "in training mode; "
                "the net runs in eval mode (batch norm with its running statistics as they are, "
                "no dropout), which net.train() undid. Call bnn.net.eval() (bnn.train() keeps "
                "the net in eval mode)"
            )
        hidden = self.hidden_values()
        fixed = {**self.frozen_parameters(), **hidden, **dict(self._net.named_buffers())}
        leads = {name: _lead(name, value, params[name]) for name, value in values.items()}
        lead = torch.broadcast_shapes(*leads.values()) if leads else torch.Size()
        padding = _padding_rows(self._net, params)
        first = _first_layer(self._net) if x.dim() == 1 else None  # only a 1-D x is checked
        fed: list[torch.Size] = []  # what a first nn.Linear was given, for a 1-D x

        def one(weights):
            for name, (rows, own) in padding.items():  # the layer's own padding row, a constant
                weights = {**weights, name: torch.where(rows, own, weights[name])}
            watch = None
            if x.dim() == 1 and isinstance(first, nn.Linear):
                watch = first.register_forward_pre_hook(
                    lambda _, inputs: fed.extend(a.shape for a in inputs[:1])
                )
            try:
                out = call_by_place(self._net, {**weights, **fixed}, (x,))
            except RuntimeError as error:
                _name_an_input_dtype(self._net, x, error)
                raise
            finally:
                if watch is not None:
                    watch.remove()
            check_tensor_output(out, self._net, "BayesianModule", "the likelihood")
            return out

        if len(lead) == 0:
            out = one({name: value.reshape(params[name].shape) for name, value in values.items()})
        else:
            out = self._vectorized(one, values, params, leads, lead)
        _refuse_one_example(first, x, x.shape in fed, out, len(lead))
        self._check_reached(x, params, fixed)
        return out, len(lead)

    def _vectorized(self, one, values, params, leads, lead) -> torch.Tensor:
        """``one`` over every weight set of ``values`` (``lead`` of them) in one ``vmap`` pass,
        the outputs ``lead + (B,) + row``."""
        n = math.prod(lead)
        flat = {}
        for name, value in values.items():
            shape = params[name].shape
            value = value.reshape(leads[name] + shape)
            flat[name] = value.expand(lead + shape).reshape((n, *shape))
        try:
            with vmap_safe_attention():
                out = vmap(one)(flat)
        except RuntimeError as error:
            if not is_vmap_refusal(error):
                raise
            # dropout that eval mode does not turn off: the loop runs it, a new mask each time
            noise = (
                " The net draws random numbers in eval mode (F.dropout(x, p), whose training "
                "defaults to True, or scaled_dot_product_attention with dropout_p > 0): one at "
                "a time, every evaluation gets its own dropout mask, a noisy loss; pass "
                "training=self.training, or dropout_p=p if self.training else 0.0, to turn it "
                "off."
                if "random operation" in str(error)
                else ""
            )
            raise RuntimeError(
                f"{first_line(error)} (BayesianModule: the network "
                f"{type(self._net).__name__} cannot run {n} weight draws or nodes in one "
                "torch.func.vmap pass). Evaluate them one at a time: QuadratureELBO and predict "
                "fall back by themselves with vectorize=None (the default), or pass "
                "vectorize=False; Trace_ELBO(vectorize_particles=False); "
                f"Predictive(parallel=False).{noise}"
            ) from error
        return out.reshape(lead + out.shape[1:])

    def _check_reached(
        self, x: torch.Tensor, params: Mapping[str, nn.Parameter], fixed: Mapping
    ) -> None:
        """Refuse a net whose outputs depend on none of the latent parameters it is given, and
        warn where they miss some; checked once per module (and set of latent parameters), a
        refusal at every run (one caught would let the next step fit the prior silently).

        The net runs with each parameter swapped in by ``functional_call``. A net that reads
        its weights from elsewhere (a dict of its parameters captured in ``__init__``, detached
        copies) ignores the sampled values: the likelihood never reaches their guide, which
        stays at the prior, a silent wrong fit. One more pass of the net on ``x`` at its own
        weights, detached copies that require grad, and ``autograd.grad(allow_unused=True)``
        tell which it reaches (the global random state and the net's buffers kept, any Pyro
        statement inside blocked).
        Skipped while ``torch.jit`` traces or dynamo compiles and under
        ``torch.inference_mode()`` (no tensor there can require grad): the next run checks."""
        names = tuple(params)
        if not names or self._reached == names or _tracing() or torch.is_inference_mode_enabled():
            return
        probes = {name: p.detach().requires_grad_() for name, p in params.items()}
        devices = [x.device] if x.device.type == "cuda" else []
        buffers = BufferSnapshot(self._net)
        quiet: set[int] = set()  # the modules run with gradients off (a reentrant checkpoint)
        watch = nn.modules.module.register_module_forward_pre_hook(
            lambda module, _: None if torch.is_grad_enabled() else quiet.add(id(module))
        )
        with torch.enable_grad(), torch.random.fork_rng(devices), pyro.poutine.block():
            try:
                out = call_by_place(self._net, {**probes, **fixed}, (x,))
                grads = (
                    torch.autograd.grad(
                        out, list(probes.values()), torch.ones_like(out), allow_unused=True
                    )
                    if out.requires_grad
                    else [None] * len(names)
                )
            finally:  # the extra pass leaves the buffers as it found them (a net in train
                # mode), once its backward, which may read them, is done
                buffers.undo()
                watch.remove()
        missed = [name for name, grad in zip(names, grads) if grad is None]
        if len(missed) < len(names):  # a refused net is refused again at its next run
            self._reached = names
        if not missed:
            return
        net = type(self._net).__name__
        if len(missed) == len(names):
            raise ValueError(
                f"BayesianModule: the outputs of the network {net} do not depend on its "
                f"parameters [{shortened(map(repr, missed), 6, None)}], the weights each pass "
                "samples and swaps into the net with torch.func.functional_call: the net reads "
                "its weights from elsewhere (a dict of its parameters captured in __init__, "
                "detached copies, p.detach() or p.data), so the likelihood never reaches them "
                "and the guide would stay at the prior. Let the forward use the module's own "
                "parameters as it runs (self.layer(x); or functional_call(self.inner, "
                "dict(self.inner.named_parameters()), (x,)) with the dict made in forward, not "
                "detached)"
            )
        without_grad = [name for name in missed if _ran_without_grad(self._net, name, quiet)]
        checkpointed = (
            f". The layers of [{shortened(map(repr, without_grad), 6, None)}] ran with "
            "gradients off inside the forward: torch.utils.checkpoint(..., use_reentrant=True) "
            "runs its part so where its input does not require grad (torch warns 'None of the "
            "inputs have requires_grad=True'). A BayesianModule cannot train through a "
            "checkpoint (its recomputation in the backward reads the net's own parameters, "
            "not the sampled ones; QuadratureELBO refuses use_reentrant=False): remove it"
            if without_grad
            else ""
        )
        warnings.warn(
            f"BayesianModule: the outputs of the network {net} on this batch do not depend on "
            f"its latent parameters [{shortened(map(repr, missed), 6, None)}]: their posterior "
            "is their prior (a head or a branch the forward does not use). If the forward does "
            "use them, it reads them from elsewhere (captured in __init__, detached), and they "
            "are not learned: let it use the module's own parameters. If it does not, freeze "
            f"them (requires_grad_(False)) and they are constants, not latent sites{checkpointed}",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    # -- the model --------------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, **kwargs: object
    ) -> torch.Tensor:
        """Sample the parameters, run the net on ``x`` and observe ``y`` (or sample it).

        The net gets ``x`` alone: keyword arguments are refused (a ``TypeError`` naming them).
        Under ``torch.jit.trace`` (Pyro's ``JitTrace_ELBO`` and the other ``Jit*`` ELBOs) it
        raises a ``NotImplementedError``: torch refuses ``functional_call`` while tracing.
        """
        if torch.jit.is_tracing():
            raise NotImplementedError(
                "BayesianModule cannot run under torch.jit.trace, which Pyro's JitTrace_ELBO, "
                "JitTraceMeanField_ELBO, JitTraceGraph_ELBO, JitTraceEnum_ELBO and "
                "JitTraceTMC_ELBO compile the model with: it runs the net with the sampled "
                "weights through torch.func.functional_call, which torch refuses while tracing. "
                "Use the ELBO without Jit (Trace_ELBO, TraceMeanField_ELBO) or QuadratureELBO"
            )
        if kwargs:
            raise TypeError(
                f"BayesianModule takes bnn(x, y=None) and passes only x to the net; keyword "
                f"arguments ({', '.join(kwargs)}) are not supported. Fix them in the net (an "
                "attribute its forward reads, or a wrapper module whose forward takes x alone)"
            )
        if not isinstance(x, torch.Tensor):
            check_inputs(x, "BayesianModule", "the step")  # the TypeError
        values = {}
        for name, param in self.latent_parameters().items():
            infer = {"qnvb": self.qnvb_settings} if self.qnvb_settings else {}
            values[name] = pyro.sample(name, self.prior_of(name, param), infer=infer)
            example = (
                "a scalar prior from tensors of that dtype, e.g. "
                "dist.Normal(torch.tensor(0.0, dtype=param.dtype), 1.0)"
            )
            check_value_dtype(
                name, values[name], param.dtype, "the parameter", "the prior", example
            )
        outputs, batch_dims = self._evaluate(values, x)
        observed = _widened(outputs, self._net)
        _check_data(x, y, observed, self.likelihood)
        self.likelihood(observed, y, batch_dims)
        return outputs

    def predict(
        self,
        guide: Callable,
        x: torch.Tensor,
        num_samples: int = 64,
        quadrature: str | QuadratureRule | None = None,
        num_points: int | None = None,
        vectorize: bool | None = None,
        *,
        batch_size: int | None = None,
        steps: int | str = 1,
    ) -> Prediction:
        """The Bayesian model average under ``guide``: `predict`
        (``batch_size``: rows of ``x`` per pass through the net, ``None`` all; ``steps``: steps
        of the quadrature rule averaged, ``"period"`` a full period)."""
        from .predict import predict

        return predict(
            self,
            guide,
            x,
            num_samples,
            quadrature,
            num_points,
            vectorize,
            batch_size=batch_size,
            steps=steps,
        )


def _brief(value: object, depth: int = 0) -> str:
    """``value`` for a message: a tensor by its shape, a tuple or list by its type and items (the
    first 4, two levels deep), never a tensor's entries."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        kind = f"a {type(value).__name__} of {len(value)} item(s)"
        if depth == 2 or not value:
            return kind
        items = [_brief(v, depth + 1) for v in value[:4]] + ["..."] * (len(value) > 4)
        return f"{kind} ({', '.join(items)})"
    return f"{value!r} ({type(value).__name__})"


def _tracing() -> bool:
    """Whether ``torch.jit`` traces or dynamo compiles: a data check would fix the branch of
    the traced inputs there, so none is made."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _check_data(x: torch.Tensor, y: object, outputs: torch.Tensor, likelihood: Likelihood) -> None:
    """The model's data check, before the observed site: ``x`` finite (`check_inputs`) and
    ``y`` in the likelihood's support (`Likelihood.invalid_observations`), read together
    in one host sync (a sum of ``x``, `sum_is_finite`, and the mask of ``y``); each is looked at
    again, to name the rows, only where that fails. Always made, as Pyro's validation is not:
    an ELBO that names a site runs the model again without validation."""
    if _tracing():
        return
    flags = [sum_is_finite(x)] if x.is_floating_point() else []
    found = likelihood.invalid_observations(y, outputs) if isinstance(y, torch.Tensor) else None
    if found is not None:
        flags.append(~found[0].any())
    if flags and not bool(torch.stack(flags).all()):
        check_inputs(x, "BayesianModule", "the step")
        likelihood.check_observations(y, outputs)


def _widened(outputs: torch.Tensor, net: nn.Module) -> torch.Tensor:
    """The net's ``outputs`` as the likelihood takes them: in the dtype of its floating
    parameters where they are narrower (bfloat16 or float16 under ``torch.autocast``, the
    parameters float32), as they are otherwise. The likelihood's constants (``Gaussian``'s
    ``log scale``, the learned noise scale) and its sum over the rows are then in the
    parameters' dtype: built in bfloat16, ``log 0.5`` rounded to ``-0.6914``, 17 nats off on
    10^4 rows."""
    if not outputs.is_floating_point():
        return outputs
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), None)
    if dtype is None or torch.finfo(outputs.dtype).bits >= torch.finfo(dtype).bits:
        return outputs
    return outputs.to(dtype)


def _ran_without_grad(net: nn.Module, name: str, quiet: set[int]) -> bool:
    """Whether the layer holding the parameter ``name``, or a module above it inside ``net``,
    is one of the modules ``quiet`` (ids) that ran their forward with gradients off."""
    path = name.split(".")[:-1]
    return any(id(net.get_submodule(".".join(path[:i]))) in quiet for i in range(1, len(path) + 1))


def _first_layer(net: nn.Module) -> nn.Module | None:
    """The net's first module with parameters of its own (``None``: none has any)."""
    return next((m for m in net.modules() if next(m.parameters(False), None) is not None), None)


def _refuse_one_example(
    first: nn.Module | None, x: torch.Tensor, takes: bool, outputs: torch.Tensor, batch_dims: int
) -> None:
    """Refuse a 1-D ``x`` that is one example of ``F`` features, not ``F`` rows: its outputs
    (``(C,)`` from a first ``nn.Linear(F, C)``) would be read as ``C`` rows. It is one where the
    outputs' rows are not ``x``'s, or where ``takes``: the net's first layer with parameters
    (``first``), an ``nn.Linear``, was given a tensor of ``x``'s shape ``(F,)``. A net that
    makes rows of ``x``'s scalars before it (``x[:, None]``, Fourier features) gives it
    ``(F, k)``: its batch of ``F`` scalars is taken whatever ``F``."""
    if x.dim() != 1:
        return
    shape = tuple(outputs.shape[batch_dims:])
    if shape[:1] == x.shape[:1] and not takes:
        return
    why = (
        f"the net's first layer, nn.Linear({first.in_features}, {first.out_features}), takes "
        f"{first.in_features} features"
        if takes
        else f"the net's outputs, of shape {shape}, do not have its {x.shape[0]} rows"
    )
    raise ValueError(
        f"BayesianModule: x of shape {tuple(x.shape)} is one example, not a batch of rows: "
        f"{why}. The net takes x of B rows (its first dim); pass one example as a batch of one "
        "row, x[None] (x.unsqueeze(0))"
    )


def check_inputs(x: object, owner: str, before: str) -> None:
    """Refuse inputs ``x`` that are no tensor, or floating inputs with a NaN or an infinity,
    naming the rows (one reduction over ``x`` and one host sync, `nonfinite_data`; skipped
    while ``torch.jit`` traces or dynamo compiles).

    A NaN row gives NaN outputs; an infinite input saturates (``tanh``) or overflows, and its
    gradient is NaN (``0 * inf``), which QNVB's guard drops with a warning only. `predict`
    checks ``x`` here, the model with its ``y`` (`_check_data`); ``before`` names what is
    refused (``"the step"``, ``"predicting"``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{owner}: x must be a tensor of B rows (the net's inputs), got {_brief(x)}"
        )
    if _tracing():
        return
    where = nonfinite_data(x, "x")
    if where is not None:
        raise ValueError(
            f"{owner}: x holds NaN or infinite values at {where}; the net's outputs there are "
            "not numbers, or an infinite input saturates and its gradient is NaN. Drop or "
            f"impute those rows before {before} (keep = torch.isfinite(x).flatten(1).all(1); "
            "x[keep], y[keep]), or replace the values (torch.nan_to_num)"
        )


def _where(module: nn.Module, path: str) -> str:
    return f"the {type(module).__name__} at {path!r}" if path else f"the {type(module).__name__}"


def _refuse_batch_statistics(net: nn.Module) -> None:
    """Refuse a batch norm that normalizes with each batch's statistics in eval mode.

    A ``_BatchNorm`` without running statistics (``track_running_stats=False``: torch sets
    ``running_mean`` and ``running_var`` to ``None``, and then normalizes with the batch's own
    statistics in eval mode too) makes each row's output depend on the rows passed with it.
    """
    for path, module in net.named_modules():
        batch_norm = isinstance(module, nn.modules.batchnorm._BatchNorm)
        if batch_norm and module.running_mean is None and module.running_var is None:
            raise ValueError(
                f"BayesianModule: {_where(module, path)} has no running statistics "
                "(track_running_stats=False), so even in eval mode it normalizes each batch "
                "with that batch's own mean and variance: a row's prediction would depend on "
                "the rows passed with it (and a single row could not be predicted). Use "
                "nn.LayerNorm or nn.GroupNorm (each row normalized by itself), or a batch norm "
                "with track_running_stats=True, its running statistics pretrained"
            )


def _name_an_input_dtype(net: nn.Module, x: torch.Tensor, error: RuntimeError) -> None:
    """Raise, from ``error``, a ``ValueError`` naming the likely cause when the net failed on
    floating inputs of another dtype than its floating parameters (NumPy's float64 beside a
    float32 net: torch says "expected scalar type Float but found Double" from inside the net),
    or on integer inputs to a net that looks nothing up (no ``nn.Embedding``: torch says "mat1
    and mat2 must have the same dtype"). Checked only after a failure: a net that converts its
    input itself runs as it is."""
    floating = next((p.dtype for p in net.parameters() if p.is_floating_point()), None)
    if floating is None:
        return
    if x.is_floating_point() and x.dtype != floating:
        numpy = " (NumPy's float64, say)" if x.dtype == torch.float64 else ""
        raise ValueError(
            f"x is {x.dtype}{numpy} but the net's parameters are {floating}, and the net "
            f"failed on it: convert the inputs, x.to({floating}), or the net, "
            f"net.to({x.dtype}), before building the BayesianModule"
        ) from error
    lookup = any(isinstance(m, nn.Embedding | nn.EmbeddingBag) for m in net.modules())
    if not x.is_floating_point() and not x.is_complex() and not lookup:
        raise ValueError(
            f"x is {x.dtype} (integers) but the net's parameters are {floating}, and the net, "
            f"which looks nothing up (no nn.Embedding), failed on it: convert the inputs, "
            f"x.to({floating}) (NumPy's or pandas' integer columns, say)"
        ) from error


def _refuse_spectral_norm(net: nn.Module) -> None:
    """Refuse spectral normalization of a weight that is sampled or trained.

    Both forms (``torch.nn.utils.parametrizations.spectral_norm`` and the older hook
    ``torch.nn.utils.spectral_norm``) divide the weight by ``sigma = u^T W v``, where ``u`` and
    ``v`` are buffers that a power iteration refines only in training mode. The net runs in eval
    mode, so ``u`` and ``v`` stay those of the weight the layer had when it was built, and for
    any other ``W`` (a draw, or a point estimate that moved) ``sigma`` is not ``||W||_2``: it can
    be near 0 or negative. A frozen weight is a constant, for which eval mode is plain torch's.
    """
    for path, module in net.named_modules():
        found = []  # (the tensor's name in the layer, a parameter behind it, its local name)
        if parametrize.is_parametrized(module):
            for tensor, chain in module.parametrizations.items():
                if any(isinstance(p, _SpectralNorm) for p in chain):
                    for local, param in chain.named_parameters(recurse=False):
                        found.append((tensor, f"parametrizations.{tensor}.{local}", param))
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, SpectralNormHook):
                local = f"{hook.name}_orig"
                found.append((hook.name, local, getattr(module, local)))
        for tensor, local, param in found:
            if not param.requires_grad:
                continue
            name = f"{path}.{local}" if path else local
            raise ValueError(
                f"BayesianModule: {_where(module, path)} has spectral_norm on its {tensor!r} (the "
                f"parameter {name!r}). The net runs in eval mode, where spectral_norm divides by "
                "u^T W v with u and v frozen at their values for the weight the layer was built "
                "with: for a sampled or trained weight that is not its spectral norm (it can be "
                "near 0 or negative), so the layer is not normalized. Remove it (torch.nn.utils."
                f"parametrize.remove_parametrizations(layer, {tensor!r}), or torch.nn.utils."
                "remove_spectral_norm(layer) for the hook, keeps the normalized weight as a "
                "plain parameter), use weight_norm (computed from the sampled weight itself), or "
                "freeze that weight (requires_grad_(False)); hide does not help: a point "
                "estimate trained in eval mode moves away from u, v too"
            )


def _padding_rows(
    net: nn.Module, latent: Mapping[str, nn.Parameter]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The padding rows of the latent embedding weights: name -> (row mask, the net's weight).

    ``nn.Embedding(padding_idx=p)`` looks row ``p`` up like any other, but its backward gives that
    row no gradient, so in plain torch it is a constant (zero unless set). A latent weight's row
    ``p`` would be sampled: the likelihood never shapes it, so its guide stays at the prior and
    every padded row would get prior noise. The net runs with the layer's own row ``p`` instead
    (the mask selects it; the weight is detached), and the sampled row is a dummy. A weight also
    used by a layer that is not such an embedding (an output layer tied to it) is left as it is:
    that layer's use of the row lets the likelihood see it, as it trains it in plain torch.
    """
    if not any(isinstance(m, nn.Embedding) and m.padding_idx is not None for m in net.modules()):
        return {}  # the common case: one pass over the modules, none over their parameters
    owners: dict[int, list[nn.Module]] = {}
    for _, module in net.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    padding = {}
    for name, param in latent.items():
        users = owners.get(id(param), [])
        if not users or not all(isinstance(m, nn.Embedding) for m in users):
            continue
        pads = {m.padding_idx for m in users}
        if len(pads) != 1 or None in pads:
            continue  # no padding row, or embeddings sharing the weight disagree on it
        rows = torch.zeros(param.shape[0], 1, dtype=torch.bool, device=param.device)
        rows[pads.pop()] = True
        padding[name] = (rows, param.detach())
    return padding


def _declared(module: nn.Module, path: str) -> Mapping:
    """A layer's ``bayesian_parameters()``, checked to be a mapping."""
    declare = module.bayesian_parameters
    if not callable(declare):
        raise TypeError(f"{_where(module, path)}: bayesian_parameters must be a method")
    declared = declare()
    if not isinstance(declared, Mapping):
        raise TypeError(
            f"{_where(module, path)}: bayesian_parameters() must return a mapping from parameter "
            f"names to {DETERMINISTIC!r} or a distribution, got {type(declared).__name__}"
        )
    return declared


def _declared_role(module: nn.Module, path: str, local: str, declared: Mapping) -> object:
    """The role a layer declares for its parameter ``local``, checked."""
    role = declared[local]
    if not (isinstance(role, Distribution) or (isinstance(role, str) and role == DETERMINISTIC)):
        raise TypeError(
            f"{_where(module, path)} declares {local!r} as {role!r} in bayesian_parameters(); "
            f"a role is {DETERMINISTIC!r} or a distribution of the parameter's shape"
        )
    return role


def _declarations(net: nn.Module) -> tuple[tuple[str, ...], dict[str, tuple[str, str]]]:
    """The hidden parameters and the declared priors of ``net``'s layers, by parameter name.

    Returns the names declared ``"deterministic"`` (in ``net.named_parameters()`` order) and, for
    each name declared with a prior, the ``(module path, name in the module)`` to fetch it from.
    """
    names = {id(p): name for name, p in net.named_parameters()}
    order = {name: i for i, name in enumerate(names.values())}
    hidden, priors = [], {}
    for path, module in net.named_modules():
        if not hasattr(module, "bayesian_parameters"):
            continue
        declared = _declared(module, path)
        own = dict(module.named_parameters(recurse=False))
        for local in declared:
            if local not in own:
                raise ValueError(
                    f"{_where(module, path)} declares {local!r} in bayesian_parameters(), which is "
                    f"not one of its parameters ({', '.join(own) or 'none'}): declare only the "
                    "names of module.named_parameters(recurse=False)"
                )
            role = _declared_role(module, path, local, declared)
            name = names[id(own[local])]
            if name in priors or name in hidden:
                raise ValueError(
                    f"{_where(module, path)} declares {local!r}, the net's {name!r}, which another "
                    "layer sharing it declares too: declare a shared parameter in one layer only"
                )
            if isinstance(role, Distribution):
                _as_event(name, role, own[local], f" (declared by {_where(module, path)})")
                priors[name] = (path, local)
            else:
                hidden.append(name)
    return tuple(sorted(hidden, key=order.__getitem__)), priors


def _as_event(name: str, fn, param: torch.Tensor, source: str = ""):
    """A prior of the parameter's shape (a scalar one expanded), all its dims event dims."""
    shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    if shape != tuple(param.shape):
        if fn.event_shape == () and fn.batch_shape == ():
            fn = fn.expand(param.shape)
        else:
            raise ValueError(
                f"the prior of {name!r}{source} has shape {shape} (batch + event), the parameter "
                f"{tuple(param.shape)}"
            )
    return fn.to_event(len(fn.batch_shape))


def _lead(name: str, value: torch.Tensor, param: torch.Tensor) -> torch.Size:
    """The leading (particle) dims of a latent value, without the data plate's size-1 dim."""
    if value.dim() < param.dim() or value.shape[value.dim() - param.dim() :] != param.shape:
        raise ValueError(
            f"the value of {name!r} has shape {tuple(value.shape)}; expected the parameter's "
            f"shape {tuple(param.shape)} after any batch dims (if a guide gave it: a guide of "
            "another network, or a parameter of that name left in Pyro's param store by another "
            "model; call pyro.clear_param_store() before building this model's guide)"
        )
    lead = value.shape[: value.dim() - param.dim()]
    if len(lead) > 0 and lead[-1] == 1:
        return lead[:-1]  # the module's data plate (dim -1), of size 1
    return lead  # Predictive(parallel=True) drops the plate's dim: (num_samples,) + shape
