"""Session 27, helper f24: a BayesianModule under torch.autocast (trial t29's items 2, 5 and 9)."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVB

N = 10_000
WEIGHTS = (1.5, -0.75, 0.25, 2.0)  # bfloat16 numbers: autocast rounds none of them


class _Linear(nn.Module):
    """``x @ w``, its outputs rounded to bfloat16 with ``rounded`` (what autocast's linear
    gives for inputs and weights that are bfloat16 numbers)."""

    def __init__(self, outputs: int = 1, rounded: bool = False):
        super().__init__()
        self.l = nn.Linear(4, outputs, bias=False)
        self.rounded = rounded

    def forward(self, x):
        out = self.l(x)
        return out.bfloat16().float() if self.rounded else out


def _data(classes: int | None = None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g).bfloat16().float()
    f = x @ torch.tensor(WEIGHTS)
    if classes is None:
        return x, f + 0.5 * torch.randn(N, generator=g)
    return x, torch.bucketize(f, torch.tensor([-1.0, 1.0]))


def _loss(likelihood, rounded: bool, autocast: bool, classes: int | None = None) -> float:
    """The -ELBO of a guide at ``WEIGHTS`` (scale 1e-6: the nodes round to the loc in
    bfloat16), its net's outputs rounded to bfloat16 or computed under bfloat16 autocast."""
    x, y = _data(classes)
    pyro.clear_param_store()
    net = _Linear(classes or 1, rounded)
    with torch.no_grad():
        net.l.weight.copy_(torch.tensor(WEIGHTS).expand(classes or 1, 4))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihood, qnvb_settings={})
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return SVI(bnn, guide, QNVB(), QuadratureELBO()).evaluate_loss(x, y)


@pytest.mark.parametrize(
    "likelihood, classes",
    [(likelihoods.Gaussian(N, scale=0.5), None), (likelihoods.Categorical(N), 3)],
    ids=["gaussian", "categorical"],
)
def test_the_loss_under_autocast_is_the_float32_loss_of_the_rounded_outputs(likelihood, classes):
    """Under bfloat16 autocast the net's outputs are bfloat16 (the net's linear layer): the
    likelihood takes them in the parameters' dtype, float32, and the -ELBO is the float32 one of
    the same (rounded) outputs. It was 17 nats off on 10^4 rows for Gaussian(scale=0.5) (its log
    scale built in bfloat16, -0.6914 for -0.6931; the sum over the nodes a bfloat16 matmul) and
    24 nats for Categorical."""
    reference = _loss(likelihood, rounded=True, autocast=False, classes=classes)
    under = _loss(likelihood, rounded=False, autocast=True, classes=classes)
    assert abs(under - reference) < 0.25, (under, reference)


def test_a_learned_noise_scale_under_autocast_is_sampled_in_the_parameters_dtype():
    """``Gaussian(scale=None)`` under autocast: the noise scale is float32 like the net (the
    first step raised a DtypeMismatch telling to build noise_prior in bfloat16, the net being
    float32), and the loss is the float32 one of the rounded outputs."""
    likelihood = likelihoods.Gaussian(N, scale=None)
    reference = _loss(likelihood, rounded=True, autocast=False)
    under = _loss(likelihood, rounded=False, autocast=True)
    assert abs(under - reference) < 0.25, (under, reference)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_net_is_refused_before_its_nodes_are_evaluated(dtype):
    """A float16 net of 10^4 rows: its log likelihood overflowed at the first node, and the
    step blamed the model's support ("the log density of site 'obs' is not finite"), not the
    dtype; the guide's loc is refused first, naming the site and autocast."""
    x, y = _data()
    pyro.clear_param_store()
    net = _Linear().to(dtype)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(N, scale=0.5))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO())
    with pytest.raises(TypeError, match=rf"QuadratureELBO: site 'l.weight' is {dtype}; .*autocast"):
        svi.step(x.to(dtype), y.to(dtype))
