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
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable

import pyro
import torch
from pyro.nn import PyroModule
from torch import nn
from torch.distributions import constraints
from torch.func import functional_call, vmap

from .likelihoods import Likelihood
from .priors import LayerwiseNormal

__all__ = ["BayesianModule"]


class BayesianModule(PyroModule):
    """A Pyro model ``bnn(x, y=None)`` from a network, a prior and a likelihood.

    Args:
        net: any ``torch.nn.Module`` taking one input tensor ``x`` of ``B`` rows; it is used
            unmodified, and put in eval mode (see below).
        prior: a callable ``(name, param) -> distribution`` of the parameter's shape
            (:mod:`pyro_quadvi.nn.priors`); all its dims become event dims.
        likelihood: how the outputs explain ``y`` (:mod:`pyro_quadvi.nn.likelihoods`).
        hide: parameter names (as in ``net.named_parameters()``) that stay deterministic: they are
            registered with ``pyro.param`` under ``"net.<name>"`` (as ``pyro.module`` would name
            them), so ``SVI``'s optimizer (QNVB's fallback) point-estimates them in place.

    Every other parameter of ``net`` is a latent ``pyro.sample(name, prior(name, p).to_event())``.

    **Buffers** (batch-norm running statistics) are passed to the net unchanged: the net runs in
    eval mode, so batch norm normalizes with its running statistics as they are and never updates
    them, and dropout is off. ``bnn.train()`` leaves the net in eval mode.

    Call it as a Pyro model (``SVI(bnn, guide, ...)``, ``Predictive(bnn, ...)``); it returns the
    net's outputs (``batch + (B,) + row``). :meth:`predict` gives a Bayesian model average.
    """

    def __init__(
        self,
        net: nn.Module,
        prior: Callable,
        likelihood: Likelihood,
        hide: Iterable[str] = (),
    ):
        super().__init__()
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if not callable(prior):
            raise TypeError(f"prior must be callable (name, param) -> distribution, got {prior!r}")
        names = [name for name, _ in net.named_parameters()]
        hide = tuple(hide)
        unknown = sorted(set(hide) - set(names))
        if unknown:
            raise ValueError(
                f"hide names {unknown}, which are not parameters of the net ({', '.join(names)})"
            )
        net.eval()
        self.net = net
        self.prior = prior
        self.likelihood = likelihood
        self.hide = hide
        if isinstance(prior, LayerwiseNormal):
            prior.bind(net.named_parameters())

    # -- the pieces -----------------------------------------------------------------------------

    @property
    def _net(self) -> nn.Module:
        # self._modules, not self.net: PyroModule.__getattr__ would issue pyro.module(net),
        # making every parameter of the net a pyro.param.
        return self._modules["net"]

    def train(self, mode: bool = True):
        """Sets this module's mode; the net stays in eval mode (running statistics as they are)."""
        super().train(mode)
        self._net.eval()
        return self

    def latent_parameters(self) -> dict[str, nn.Parameter]:
        """The net's parameters that are latent sites, by name, in the net's order."""
        return {n: p for n, p in self._net.named_parameters() if n not in self.hide}

    def prior_of(self, name: str, param: torch.Tensor):
        """The prior of one parameter, all its dims event dims."""
        fn = self.prior(name, param)
        shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
        if shape != tuple(param.shape):
            if fn.event_shape == () and fn.batch_shape == ():
                fn = fn.expand(param.shape)
            else:
                raise ValueError(
                    f"the prior of {name!r} has shape {shape} (batch + event), the parameter "
                    f"{tuple(param.shape)}"
                )
        return fn.to_event(len(fn.batch_shape))

    def hidden_values(self) -> dict[str, torch.Tensor]:
        """The deterministic (hidden) parameters, as ``pyro.param`` sites ``"net.<name>"``."""
        values = {}
        params = dict(self._net.named_parameters())
        for name in self.hide:
            param = params[name]
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
                values[name] = pyro.param(fullname, param)
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
        hidden = self.hidden_values()
        fixed = {**hidden, **dict(self._net.named_buffers())}
        leads = {name: _lead(name, value, params[name]) for name, value in values.items()}
        lead = torch.broadcast_shapes(*leads.values()) if leads else torch.Size()
        if len(lead) == 0:
            flat = {name: value.reshape(params[name].shape) for name, value in values.items()}
            return functional_call(self._net, {**flat, **fixed}, (x,)), 0
        n = math.prod(lead)
        flat = {}
        for name, value in values.items():
            shape = params[name].shape
            value = value.reshape(leads[name] + shape)
            flat[name] = value.expand(lead + shape).reshape((n, *shape))

        def one(weights):
            return functional_call(self._net, {**weights, **fixed}, (x,))

        out = vmap(one)(flat)
        return out.reshape(lead + out.shape[1:]), len(lead)

    # -- the model --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Sample the parameters, run the net on ``x`` and observe ``y`` (or sample it)."""
        values = {}
        for name, param in self.latent_parameters().items():
            values[name] = pyro.sample(name, self.prior_of(name, param))
        outputs, batch_dims = self._evaluate(values, x)
        self.likelihood(outputs, y, batch_dims)
        return outputs

    def predict(self, guide: Callable, x: torch.Tensor, num_samples: int = 64, **kwargs):
        """The Bayesian model average under ``guide``: :func:`~pyro_quadvi.nn.predict`."""
        from .predict import predict

        return predict(self, guide, x, num_samples=num_samples, **kwargs)


def _lead(name: str, value: torch.Tensor, param: torch.Tensor) -> torch.Size:
    """The leading (particle) dims of a latent value, without the data plate's size-1 dim."""
    if value.dim() < param.dim() or value.shape[value.dim() - param.dim() :] != param.shape:
        raise ValueError(
            f"the value of {name!r} has shape {tuple(value.shape)}; expected the parameter's "
            f"shape {tuple(param.shape)} after any batch dims"
        )
    lead = value.shape[: value.dim() - param.dim()]
    if len(lead) > 0 and lead[-1] == 1:
        return lead[:-1]  # the module's data plate (dim -1), of size 1
    return lead  # Predictive(parallel=True) drops the plate's dim: (num_samples,) + shape
