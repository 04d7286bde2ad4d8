"""Session 27, helper f24: a BayesianModule under torch.autocast, and torch.utils.checkpoint in
the node loops (trial t29's items 2, 3, 5, 6, 7 and 9)."""

from __future__ import annotations

import math
import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI
from torch import nn
from torch.utils.checkpoint import checkpoint

from pyro_quadvi.distributed import DistributedQuadratureELBO
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVB, QNVBOptimizer, module_loss

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


@pytest.mark.parametrize(
    "dtype, owner", [(torch.float16, "QuadratureELBO"), (torch.bfloat16, "QNVB")]
)
def test_a_half_precision_net_is_refused_naming_its_dtype(dtype, owner):
    """A float16 net of 10^4 rows: its log likelihood overflowed at the first node, and the
    step blamed the model's support ("the log density of site 'obs' is not finite"), not the
    dtype; the ELBO now names the guide's half-precision loc there, with autocast. In bfloat16
    (float32's range) the log joint is finite, and QNVB refuses the guide at its step."""
    x, y = _data()
    pyro.clear_param_store()
    net = _Linear().to(dtype)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(N, scale=0.5))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO())
    with pytest.raises(TypeError, match=rf"{owner}: site 'l.weight' is {dtype}; .*autocast"):
        svi.step(x.to(dtype), y.to(dtype))


def test_a_bfloat16_guide_whose_log_joint_is_finite_trains_under_pyros_adam():
    """QuadratureELBO itself takes a half-precision guide whose log joint is finite: Pyro's
    Adam steps it, as at session 26 (a refusal of every half-precision guide by the ELBO, made
    for QNVB's sake, refused this too)."""
    x, y = _data()
    pyro.clear_param_store()
    net = _Linear().to(torch.bfloat16)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(N, scale=0.5))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    svi = SVI(bnn, guide, pyro.optim.Adam({"lr": 0.01}), QuadratureELBO())
    losses = [svi.step(x.to(torch.bfloat16), y.to(torch.bfloat16)) for _ in range(3)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


class _Checkpointed(nn.Module):
    """``l2(tanh(l1(x)))``, its first part checkpointed: the layer ``l1`` (``"layer"``), the
    ``tanh`` alone (``"free"``, no parameters inside), or nothing (``None``)."""

    def __init__(self, part: str | None = None, reentrant: bool = False):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 8), nn.Linear(8, 1)
        self.part, self.reentrant = part, reentrant

    def forward(self, x):
        if self.part == "layer":
            h = checkpoint(lambda z: torch.tanh(self.l1(z)), x, use_reentrant=self.reentrant)
        elif self.part == "free":
            h = checkpoint(torch.tanh, self.l1(x), use_reentrant=self.reentrant)
        else:
            h = torch.tanh(self.l1(x))
        return self.l2(h)


def _regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, dtype=torch.float64, generator=g)
    return x, torch.sin(x.sum(1)) + 0.1 * torch.randn(64, dtype=torch.float64, generator=g)


def _bnn_fit(part, vectorize, steps: int = 3, reentrant: bool = False, elbo=QuadratureELBO):
    x, y = _regression()
    pyro.clear_param_store()
    torch.manual_seed(1)
    bnn = BayesianModule(
        _Checkpointed(part, reentrant).double(), priors.Normal(1.0), likelihoods.Gaussian(64, 0.1)
    )
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    guide(x, y)  # its parameters, in the store before the steps
    svi = SVI(bnn, guide, QNVB(), elbo(vectorize=vectorize))
    losses = [svi.step(x, y) for _ in range(steps)]
    return losses, {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


@pytest.mark.parametrize("vectorize", [False, None, True])
def test_quadrature_elbo_refuses_a_checkpointed_layer_and_leaves_the_guide(vectorize):
    """checkpoint(..., use_reentrant=False) around a layer of a BayesianModule's net: its
    backward recomputes the layer at the net's own parameters (the nodes are swapped in only
    while the forward runs). The loop's fit was silently wrong (loss 776.2 for 700.8); the
    vectorized pass failed with torch's bare CheckpointError. Refused, naming the checkpoint and
    the fix, before the optimizer moves the guide."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vectorize=None's fallback warning, when it falls back
        _, start = _bnn_fit("layer", vectorize, steps=0)
        with pytest.raises(
            RuntimeError,
            match=r"QuadratureELBO: the Linear layer of the net ran "
            r"its forward again in the backward pass: a torch.utils.checkpoint",
        ) as e:
            _bnn_fit("layer", vectorize, steps=1)
    assert "Remove the checkpoint" in str(e.value)
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), start[name]), name


def test_the_distributed_elbo_refuses_a_checkpointed_layer_too():
    """`DistributedQuadratureELBO` (here without a process group: one process) ran its own
    backward, and the loop's gradients were the means' there too, silently; it now takes
    QuadratureELBO's backward with the refusal."""
    _, start = _bnn_fit("layer", False, steps=0)
    with pytest.raises(
        RuntimeError,
        match=r"DistributedQuadratureELBO: the Linear layer of the net ran its forward again",
    ):
        _bnn_fit("layer", False, steps=1, elbo=DistributedQuadratureELBO)
    for name, value in pyro.get_param_store().items():
        if not name.endswith(".step"):  # the position moved, as on every rank (scaling.md)
            assert torch.equal(value.detach(), start[name]), name


def test_a_checkpoint_without_parameters_runs_in_the_loop_and_is_named_in_the_pass():
    """``checkpoint(torch.tanh, h)``: the recomputation reads no parameter, so the loop
    (vectorize=False) gives the fit without the checkpoint to rounding; the vectorized pass's
    backward cannot recompute outside vmap, and its error now names the checkpoint and
    vectorize=False (it was torch's alone)."""
    reference, ref_params = _bnn_fit(None, False)
    losses, params = _bnn_fit("free", False)
    assert losses == pytest.approx(reference, rel=1e-12)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-12)
    with pytest.raises(
        RuntimeError,
        match=r"QuadratureELBO: the backward of the vectorized pass "
        r"over the nodes failed \(a torch.utils.checkpoint .*vectorize=False",
    ):
        _bnn_fit("free", True, steps=1)


def test_a_reentrant_checkpoint_is_named_in_the_warning_of_unused_layers():
    """checkpoint(..., use_reentrant=True) of the first layer, whose input ``x`` does not require
    grad: the part runs under no_grad, so the outputs do not depend on ``l1``; the warning said
    "a head or a branch the forward does not use" only."""
    with pytest.warns(RuntimeWarning, match=r"'l1.weight', 'l1.bias'\]: their posterior") as w:
        _bnn_fit("layer", False, steps=1, reentrant=True)
    said = [str(m.message) for m in w if "BayesianModule" in str(m.message)]
    assert len(said) == 1
    assert "The layers of ['l1.weight', 'l1.bias'] ran with gradients off" in said[0]
    assert "use_reentrant=True" in said[0] and "remove it" in said[0]


def _optimizer(part):
    torch.manual_seed(1)
    net = _Checkpointed(part).double()
    opt = QNVBOptimizer(net.named_parameters(), likelihood_weight=64, quadrature="hadamard")
    return net, opt, module_loss(net, lambda out, t: 0.5 * ((out.squeeze(-1) - t) ** 2).mean())


def _optimizer_fit(part, vectorize, steps: int = 3):
    net, opt, loss = _optimizer(part)
    for _ in range(steps):
        opt.step(loss_fn=loss, batch=_regression(), vectorize=vectorize)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("vectorize", [False, None])
def test_qnvb_optimizer_refuses_a_checkpointed_layer_in_the_one_pass_step(vectorize):
    """step(loss_fn=...) over the nodes, one at a time or in one vmap pass: the checkpoint
    recomputes ``l1`` at the means in the backward. The loop's means ended 2.02 off those of
    the net without the checkpoint after 10 steps (sigma 0.2 to 32 times), silently; the pass
    fell back to that loop. Refused at the first step, the means where they were."""
    net, opt, loss = _optimizer("layer")
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            RuntimeError,
            match=r"QNVBOptimizer.step\(loss_fn=...\): the Linear "
            r"layer of the net ran its forward again in the backward pass",
        ) as e:
            opt.step(loss_fn=loss, batch=_regression(), vectorize=vectorize)
    assert "opt.step(closure)" in str(e.value)
    for name, p in net.named_parameters():
        assert torch.equal(p.detach(), start[name]), name


def test_qnvb_optimizer_loop_takes_a_checkpoint_without_parameters():
    """The loop with ``checkpoint(torch.tanh, h)`` (nothing to read at the means) gives the
    means of the net without the checkpoint, to rounding: the refusal is of layers only."""
    reference = _optimizer_fit(None, False)
    params = _optimizer_fit("free", False)
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-12)
