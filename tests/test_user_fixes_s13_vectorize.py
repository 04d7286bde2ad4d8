"""``vectorize=True`` means one vectorized pass, checked against single evaluations at the probe
points on the first call for a model (a disagreement raises ``BatchMismatch`` naming the ways
out), unchecked on later calls: in ``evaluate_batch`` and in every caller (user trial t9)."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, opqa_evidence
from pyro_quadvi.export import to_inference_data
from pyro_quadvi.infer.batched import BatchDecision, BatchMismatch, evaluate_batch
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss

pytestmark = pytest.mark.usefixtures("fresh_param_store")

F64 = torch.float64
DATA = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
WAYS_OUT = r"vectorize=None.*vectorize=False"


def _right_dim_model(data):
    """t9: a latent with a batch dim outside every plate, summed away before use, beside two
    plates; under the particle plate the nodes land right of the dim the pass reads them at."""
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 1.0))
    with pyro.plate("groups", 4, dim=-2), pyro.plate("obs", 5, dim=-1):
        pyro.sample("x", dist.Normal(mu, 1.0), obs=data)
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=F64), 1.0))  # batch (2,), no plate
    pyro.sample("v", dist.Normal(w.sum(-1), 1.0), obs=torch.tensor(1.0, dtype=F64))


def _fitted_guide(model):
    guide = AutoMeanFieldNormal(model)
    guide(DATA)
    return guide


def _loss(model, guide, vectorize):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vectorize=None's fallback warning
        return QuadratureELBO("hadamard", vectorize=vectorize).loss(model, guide, DATA)


def test_evaluate_batch_true_checks_the_probes_and_raises_on_a_disagreement():
    points = torch.arange(5.0)
    probed = []

    def single(x):
        probed.append(float(x))
        return x**2

    values, decision = evaluate_batch(lambda p: p**2, single, points, True)
    assert torch.equal(values, points**2) and probed == [0.0, 2.0, 4.0]
    assert decision == BatchDecision(True, None, 6)  # and the three in the mixing check's pass
    # the pass mixes the points: the sum over all of them where each needs its own square
    with pytest.raises(BatchMismatch, match=rf"what\(vectorize=True\): .*point 0.*{WAYS_OUT}"):
        evaluate_batch(lambda p: p**2 + p.sum(), lambda x: x**2, points, True, what="what")
    # later calls (probe=()) are not checked: the caller has checked this model already
    probed.clear()
    values, decision = evaluate_batch(lambda p: p**2 + p.sum(), single, points, True, probe=())
    assert torch.equal(values, points**2 + 10.0) and probed == []
    assert decision == BatchDecision(True, None, 0)


def test_quadrature_elbo_refuses_t9_under_true_and_loops_under_none():
    guide = _fitted_guide(_right_dim_model)
    with pytest.raises(BatchMismatch, match=rf"QuadratureELBO\(vectorize=True\).*{WAYS_OUT}"):
        _loss(_right_dim_model, guide, True)
    looped = _loss(_right_dim_model, guide, False)
    assert _loss(_right_dim_model, guide, None) == looped
    # the loop's value is the sum of single evaluations: the pass's 51.62 was off by 4.29
    assert abs(looped - 47.3345) < 1e-3


def test_opqa_evidence_refuses_t9_under_true_and_loops_under_none():
    kwargs = {"num_points": 3, "center": "laplace"}
    with pytest.raises(BatchMismatch, match=rf"opqa_evidence\(vectorize=True\).*{WAYS_OUT}"):
        opqa_evidence(_right_dim_model, DATA, vectorize=True, **kwargs)
    looped = opqa_evidence(_right_dim_model, DATA, vectorize=False, **kwargs)
    with pytest.warns(UserWarning, match="values differ from single evaluations"):
        tried = opqa_evidence(_right_dim_model, DATA, vectorize=None, **kwargs)
    assert tried.log_evidence == looped.log_evidence
    assert not tried.diagnostics["vectorized"]


def test_to_inference_data_refuses_t9_under_true_naming_the_ways_out():
    guide = _fitted_guide(_right_dim_model)
    with pytest.raises(BatchMismatch, match=rf"to_inference_data\(vectorize=True\).*{WAYS_OUT}"):
        to_inference_data(_right_dim_model, guide, DATA, num_samples=6, vectorize=True)


def test_a_model_random_apart_from_its_latents_is_refused_with_that_reason_under_true():
    def noisy(data):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 1.0))
        shift = torch.randn((), dtype=F64)  # random besides the latents
        with pyro.plate("obs", 5, dim=-1):
            pyro.sample("x", dist.Normal(mu + shift, 1.0), obs=data[0])

    guide = _fitted_guide(noisy)
    with pytest.raises(BatchMismatch, match=r"other values at the same point when run twice"):
        _loss(noisy, guide, True)


class _CountingModel:
    """A deterministic model that counts its single (unbatched) and batched runs."""

    def __init__(self):
        self.single = self.batched = 0

    def __call__(self, data):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64), 1.0))
        if mu.dim() == 0:
            self.single += 1
        else:
            self.batched += 1
        with pyro.plate("groups", 4, dim=-2), pyro.plate("obs", 5, dim=-1):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=data)


def test_the_elbo_checks_once_and_later_steps_run_the_pass_alone_bit_for_bit():
    runs = {}
    for vectorize in (True, None):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = _CountingModel()
        guide = _fitted_guide(model)
        svi = SVI(model, guide, QNVB(lr=0.5), QuadratureELBO("hadamard", vectorize=vectorize))
        counts, losses = [], []
        for _ in range(3):
            model.single = model.batched = 0
            losses.append(svi.step(DATA))
            counts.append((model.single, model.batched))
        params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        runs[vectorize] = counts, losses, params
    counts, losses, params = runs[True]
    # first step: the guide's description run and the two probes (nodes 0 and K-1), and the
    # mixing check's pass over the probes; later: none
    assert counts == [(3, 2), (0, 1), (0, 1)]
    assert runs[None][0] == counts and runs[None][1] == losses
    assert all(torch.equal(params[k], runs[None][2][k]) for k in params)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).to(F64)


def test_qnvb_optimizer_checks_the_first_step_only_and_steps_as_under_none():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(16, 2, generator=generator, dtype=F64)
    y = torch.randn(16, 1, generator=generator, dtype=F64)
    runs = {}
    for vectorize in (True, None):
        net = _net()
        calls = []

        def loss_fn(params, x, y, net=net, calls=calls):
            calls.append(1)
            return F.mse_loss(torch.func.functional_call(net, params, (x,)), y)

        optimizer = QNVBOptimizer(
            net.named_parameters(),
            likelihood_weight=16,
            generator=torch.Generator().manual_seed(3),
            init_sigma=0.05,
        )
        counts, losses = [], []
        for _ in range(3):
            calls.clear()
            losses.append(optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=vectorize))
            counts.append(len(calls))
        runs[vectorize] = counts, losses, [p.detach().clone() for p in net.parameters()]
    counts, losses, params = runs[True]
    assert counts == [4, 1, 1]  # one vmap call, and three probes on the first step only
    assert runs[None][0] == counts
    assert all(torch.equal(a, b) for a, b in zip(losses, runs[None][1]))
    assert all(torch.equal(a, b) for a, b in zip(params, runs[None][2]))


def test_qnvb_optimizer_refuses_a_loss_that_changes_between_calls_under_true():
    net = _net()
    x, y = torch.ones(4, 2, dtype=F64), torch.zeros(4, 1, dtype=F64)
    calls = []

    def drifting(params, x, y):  # 0.1 more on each call: not a function of the parameters
        calls.append(1)
        out = torch.func.functional_call(net, params, (x,))
        return F.mse_loss(out, y) + 0.1 * len(calls)

    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=4, init_sigma=0.05)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(BatchMismatch, match=r"QNVBOptimizer\(vectorize=True\).*run twice"):
        optimizer.step(loss_fn=drifting, batch=(x, y), vectorize=True)
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # no step taken


def _counted_bnn(net: nn.Module):
    """Rows, a Gaussian ``BayesianModule`` of ``net``, its set-up guide, and the list a forward
    hook appends to at each call of ``net``."""
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(4), dtype=F64)
    forwards = []
    net.register_forward_hook(lambda *_: forwards.append(1))
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(5, scale=0.5))
    guide = AutoMeanFieldNormal(bnn)
    guide(x, torch.zeros(5, 1, dtype=F64))
    return x, bnn, guide, forwards


def test_predict_checks_the_first_call_for_a_bnn_only():
    net = _net()
    x, bnn, guide, forwards = _counted_bnn(net)
    outputs = []
    for _ in range(2):
        forwards.clear()
        pred = bnn.predict(guide, x, quadrature="hadamard", num_points=4, vectorize=True)
        outputs.append((len(forwards), pred.outputs))
    assert [count for count, _ in outputs] == [3, 1]  # the pass and two probes, then the pass
    assert torch.equal(outputs[0][1], outputs[1][1])
    forwards.clear()
    looped = bnn.predict(guide, x, quadrature="hadamard", num_points=4, vectorize=False)
    assert len(forwards) == 4
    torch.testing.assert_close(looped.outputs, outputs[0][1], rtol=1e-12, atol=1e-12)


def test_qnvb_optimizer_under_autocast_keeps_the_pass_under_true_and_none():
    # bfloat16 products round differently batched and alone (1.5e-4 relative here): the check
    # allows the square root of the autocast dtype's epsilon instead of 1e-5
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 20, generator=generator), torch.randn(64, 1, generator=generator)
    losses = {}
    for vectorize in (True, None):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 1))
        optimizer = QNVBOptimizer(
            net.named_parameters(),
            likelihood_weight=64,
            generator=torch.Generator().manual_seed(0),
            init_sigma=0.05,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning under None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses[vectorize] = [
                    optimizer.step(
                        loss_fn=module_loss(net, F.mse_loss), batch=(x, y), vectorize=vectorize
                    )
                    for _ in range(2)
                ]
    assert all(torch.equal(a, b) for a, b in zip(losses[True], losses[None]))


class _Switch(nn.Module):
    """A layer that reads a value to the host while ``host`` is set (no vmap then)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1).double()
        self.host = True

    def forward(self, x):
        out = self.linear(x)
        return out * (1.0 + 0.0 * out.sum().item()) if self.host else out


def test_predict_under_true_after_a_loop_decision_checks_once():
    # a net that cannot be vmapped makes None decide the loop; changed so that it can, a True
    # call's passed check replaces that decision, and the next True call is not probed again
    torch.manual_seed(0)
    net = _Switch()
    x, bnn, guide, forwards = _counted_bnn(net)
    with pytest.warns(UserWarning, match="one by one"):
        bnn.predict(guide, x, quadrature="hadamard", num_points=4, vectorize=None)
    net.host = False
    counts = []
    for _ in range(2):
        forwards.clear()
        bnn.predict(guide, x, quadrature="hadamard", num_points=4, vectorize=True)
        counts.append(len(forwards))
    assert counts == [3, 1]


def test_qnvb_optimizer_under_autocast_still_refuses_a_drifting_loss():
    # the autocast tolerance (the dtype's epsilon, 7.8e-3 in bfloat16) admits the batched
    # pass's rounding, not a loss that moves by 3% from one call to the next
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 20, generator=generator), torch.randn(64, 1, generator=generator)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 1))
    calls = []

    def drifting(params, x, y):
        calls.append(1)
        loss = F.mse_loss(torch.func.functional_call(net, params, (x,)), y)
        return loss * (1.0 + 0.03 * len(calls))

    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=64, init_sigma=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(BatchMismatch, match="run twice"):
            optimizer.step(loss_fn=drifting, batch=(x, y), vectorize=True)
