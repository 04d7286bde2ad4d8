"""A guide written by hand, described to pyro-quadvi through its one hook.

``ExpScaleGuide`` is an ordinary ``nn.Module``: a Gaussian mean field per latent site in the
unconstrained space, with its scales stored as logarithms (not Pyro's softplus). It implements
``quadrature_description``, so ``QuadratureELBO`` integrates against it, ``QNVB`` updates its
``(loc, log_scale)`` pairs and ``opqa_evidence(center="guide")`` centres its weight on it.

Run ``python examples/custom_guide.py``: one QNVB step with an exact quadrature lands on the exact
posterior of a conjugate model, and OPQA reproduces its exact evidence.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from pyro.poutine import Trace
from torch import nn
from torch.distributions import biject_to, constraints

from pyro_quadvi import QNVB, QuadratureELBO, opqa_evidence
from pyro_quadvi.guides import GuideDescription, MeanFieldSite
from pyro_quadvi.infer import LatentSite

DTYPE = torch.float64
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=DTYPE)
Y = torch.tensor([0.9, -0.4, 1.3, 0.2], dtype=DTYPE)
R = torch.tensor([1.5, 0.7, 2.2], dtype=DTYPE)  # positive data for the log-normal rate


def model():
    """Bayesian linear regression (noise 0.5) and a log-normal rate: both conjugate."""
    zero = torch.zeros(2, dtype=DTYPE)
    w = pyro.sample("w", dist.Normal(zero, 1.0).to_event(1))
    with pyro.plate("data", len(Y)):
        pyro.sample("y", dist.Normal((X * w).sum(-1), 0.5), obs=Y)
    rate = pyro.sample("rate", dist.LogNormal(torch.tensor(0.0, dtype=DTYPE), 1.0))
    with pyro.plate("rates", len(R)):
        pyro.sample("r", dist.LogNormal(rate.log(), 1.0), obs=R)


SUPPORTS = {"w": constraints.real_vector, "rate": constraints.positive}
SHAPES = {"w": (2,), "rate": ()}


# --8<-- [start:guide]
class ExpScaleGuide(nn.Module):
    """``q = prod_site N(loc, exp(log_scale)^2)`` in the unconstrained space of each site."""

    def __init__(self, init_log_scale: float = -2.0):
        super().__init__()
        self.locs = nn.ParameterDict(
            {name: nn.Parameter(torch.zeros(shape, dtype=DTYPE)) for name, shape in SHAPES.items()}
        )
        self.log_scales = nn.ParameterDict(
            {
                name: nn.Parameter(torch.full(shape, init_log_scale, dtype=DTYPE))
                for name, shape in SHAPES.items()
            }
        )

    def forward(self):
        pyro.module("exp_scale_guide", self)  # SVI hands these parameters to the optimizer
        for name, shape in SHAPES.items():
            base = dist.Normal(self.locs[name], self.log_scales[name].exp()).to_event(len(shape))
            pyro.sample(name, dist.TransformedDistribution(base, [biject_to(SUPPORTS[name])]))

    def quadrature_description(self, trace: Trace | None = None) -> GuideDescription:
        """The hook: one ``"gaussian"`` site per latent, the leaves by role, the transforms."""
        sites, latent = [], []
        for name, shape in SHAPES.items():
            loc, log_scale = self.locs[name], self.log_scales[name]
            transform = biject_to(SUPPORTS[name])
            sites.append(
                MeanFieldSite(
                    name=name,
                    family="gaussian",
                    loc=loc,
                    scale=log_scale.exp(),
                    params={"loc": loc, "scale": log_scale},
                    param_constraints={"loc": constraints.real, "scale": constraints.positive},
                    param_names={"loc": f"locs.{name}", "scale": f"log_scales.{name}"},
                    transform=transform,
                    event_dim=len(shape),
                    constraint=SUPPORTS[name],
                )
            )
            latent.append(LatentSite(name, torch.Size(shape), len(shape), transform))
        return GuideDescription("ExpScaleGuide", latent, sites=sites)


# --8<-- [end:guide]


def exact_posterior() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Posterior mean and standard deviation of ``w`` and of ``log rate`` (conjugate updates)."""
    precision_w = 1.0 + (X**2).sum(0) / 0.25  # the design's columns are orthogonal
    mean_w = (X * Y[:, None]).sum(0) / 0.25 / precision_w
    precision_u = 1.0 + len(R)
    mean_u = R.log().sum() / precision_u
    return {
        "w": (mean_w, precision_w.rsqrt()),
        "rate": (mean_u, torch.tensor(precision_u, dtype=DTYPE).rsqrt()),
    }


def exact_log_evidence() -> float:
    """``log p(Y, R)``: a Gaussian marginal for ``Y`` and one for ``log R`` (with its Jacobian)."""
    cov_y = X @ X.T + 0.25 * torch.eye(len(Y), dtype=DTYPE)
    log_y = torch.distributions.MultivariateNormal(torch.zeros_like(Y), cov_y).log_prob(Y)
    log_r = R.log()
    cov_r = torch.ones(len(R), len(R), dtype=DTYPE) + torch.eye(len(R), dtype=DTYPE)
    log_r_density = torch.distributions.MultivariateNormal(torch.zeros_like(R), cov_r).log_prob(
        log_r
    )
    return float(log_y + log_r_density - log_r.sum())


def fit(num_steps: int = 1) -> ExpScaleGuide:
    """QNVB with an exact (Gauss-Hermite) quadrature: one step reaches the optimal mean field."""
    pyro.clear_param_store()
    guide = ExpScaleGuide()
    svi = SVI(model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
    for _ in range(num_steps):
        svi.step()
    return guide


def _digits(values: torch.Tensor) -> str:
    """12 significant digits: the fit is exact to rounding, whose last digits vary by machine."""
    if values.dim() == 0:
        return f"{float(values):.12g}"
    return "[" + ", ".join(f"{v:.12g}" for v in values.tolist()) + "]"


def main() -> None:
    guide = fit()
    for name, (mean, std) in exact_posterior().items():
        loc = guide.locs[name].detach()
        scale = guide.log_scales[name].detach().exp()
        print(f"{name}: loc {_digits(loc)} (exact {_digits(mean)})")
        print(f"{' ' * len(name)}  scale {_digits(scale)} (exact {_digits(std)})")
    result = opqa_evidence(model, center="guide", guide=guide)
    print(f"log evidence: OPQA {result.log_evidence:.10f}, exact {exact_log_evidence():.10f}")
    assert math.isclose(result.log_evidence, exact_log_evidence(), abs_tol=1e-8)


if __name__ == "__main__":
    main()
