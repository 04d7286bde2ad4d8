"""The package on a device other than the CPU, checked on PyTorch's ``meta`` device.

No GPU is lent to the test machine. On ``meta`` (:mod:`pyro_quadvi.testing.meta`), a tensor
left on the CPU among device tensors raises as it would on CUDA, and :class:`FakeSync` fakes and
counts the host syncs. Data, network and guide live on ``meta``; every result and every parameter
must stay there.
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, metrics
from pyro_quadvi.distributed import checkpoint, comm
from pyro_quadvi.infer.log_joint import RandomState, cuda_devices
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer
from pyro_quadvi.optim.qnvb_functional import _device_scalars
from pyro_quadvi.optim.torch_qnvb import module_loss
from pyro_quadvi.quadrature import make_rule
from pyro_quadvi.quadrature.hadamard import fwht
from pyro_quadvi.testing.meta import FakeSync

META = torch.device("meta")


@pytest.fixture(autouse=True)
def _fresh():
    pyro.clear_param_store()
    with pyro.validation_enabled(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    pyro.clear_param_store()


def _data():
    return torch.randn(32, 3, device=META), torch.randn(32, 1, device=META)


def _all_on_meta():
    store = pyro.get_param_store()
    assert len(store.keys()) > 0
    for name, value in store.items():
        # the ELBO's position in its rule's sequence is a host counter, read without a sync
        assert value.device == (torch.device("cpu") if name.endswith(".step") else META), name


def _network(out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, out)).to(META)


@pytest.mark.parametrize(
    "likelihood, prior, classes",
    [
        (likelihoods.Gaussian(32, scale=0.3), priors.Normal(1.0), None),
        (likelihoods.Gaussian(32, scale=None), priors.Normal(1.0), None),  # learned noise
        (likelihoods.Categorical(32), priors.LayerwiseNormal("radford"), 4),
    ],
    ids=["gaussian", "gaussian-learned-noise", "categorical"],
)
def test_bayesian_module_trains_on_meta(likelihood, prior, classes):
    """Guide set-up, the loss and two QNVB steps: Pyro's plate bookkeeping sites made their zero
    log density on the CPU, which was added to the device's total (log_joint.py)."""
    x, y = _data()
    if classes:
        y = torch.zeros(32, dtype=torch.long, device=META)
    bnn = BayesianModule(_network(classes or 1), prior, likelihood)
    guide = AutoMeanFieldNormal(bnn, init_scale=0.05)
    elbo = QuadratureELBO("blocked_simplex")
    with FakeSync():
        guide(x, y)
        _all_on_meta()
        assert elbo.differentiable_loss(bnn, guide, x, y).device == META
        svi = SVI(bnn, guide, QNVB(lr=0.5), elbo)
        svi.step(x, y)
        svi.step(x, y)
    _all_on_meta()
    assert elbo.vectorized(bnn, guide)


def test_plain_model_with_subsampled_latents_on_meta():
    """A global latent and local latents in a subsampled plate, in one vectorized pass."""
    x, y = _data()

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, device=META), 1.0).to_event(1))
        with pyro.plate("data", 32, subsample_size=8, device=META) as idx:
            z = pyro.sample("z", dist.Normal(torch.zeros((), device=META), 1.0))
            mean = (x[idx] * w).sum(-1) + z  # w: (nodes, 1, 3) in the vectorized pass
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y[idx, 0])

    guide = AutoMeanFieldNormal(model)
    elbo = QuadratureELBO("rasp_simplex", vectorize=True)
    with FakeSync():
        svi = SVI(model, guide, QNVB(), elbo)
        svi.step(x, y)
        svi.step(x, y)
        assert elbo.differentiable_loss(model, guide, x, y).device == META
    _all_on_meta()


def test_predict_on_meta():
    x, y = _data()
    bnn = BayesianModule(_network(1), priors.Normal(1.0), likelihoods.Gaussian(32))
    guide = AutoMeanFieldNormal(bnn)
    with FakeSync():
        guide(x, y)
        by_samples = bnn.predict(guide, x, num_samples=4)
        by_rule = bnn.predict(guide, x, quadrature="hadamard")
    for prediction in (by_samples, by_rule):
        assert prediction.mean.device == META
        assert prediction.mean.shape[-2:] == (32, 1)


@pytest.mark.parametrize("rule", ["blocked_simplex", "hadamard", "rasp_simplex"])
def test_qnvb_optimizer_on_meta(rule):
    x, y = _data()
    for use_closure in (False, True):
        net = _network(1)
        opt = QNVBOptimizer(net.named_parameters(), quadrature=rule, likelihood_weight=32)
        with FakeSync():
            if use_closure:

                def closure(net=net):
                    loss = nn.functional.mse_loss(net(x), y)
                    loss.backward()
                    return loss

                loss = opt.step(closure)
            else:
                loss = opt.step(loss_fn=module_loss(net, nn.functional.mse_loss), batch=(x, y))
        assert loss.device == META
        assert all(p.device == META for p in net.parameters())
        for state in opt.state.values():
            assert all(v.device == META for v in state.values() if isinstance(v, torch.Tensor))


RULES = ["rasp_simplex", "rasp_cross", "hadamard", "blocked_simplex", "gauss_hermite"]
RULES += ["mc", "vrmc1", "vrmc2"]
# Each rule's CPU nodes from torch.Generator().manual_seed(3), dim 10 (3 for gauss_hermite), step
# 2, float64, computed before the device changes: (shape, sum of matrix * sin(1..K*dim), the next
# randint(0, 1000) from the generator). The changes leave the CPU draws bit for bit as they were.
CPU_DRAWS = {
    "rasp_simplex": ((3, 10), -5.935834298275, 514),
    "rasp_cross": ((6, 10), 13.160357933652, 514),
    "hadamard": ((4, 10), -0.36351061259, 986),
    "blocked_simplex": ((3, 10), 0.827099233154, 149),
    "gauss_hermite": ((27, 3), -1.139374549074, 986),
    "mc": ((3, 10), 5.955429589281, 737),
    "vrmc1": ((3, 10), 5.355711962665, 737),
    "vrmc2": ((3, 10), 6.214056366748, 737),
}


@pytest.mark.parametrize("name", RULES)
def test_rules_draw_on_meta_from_a_cpu_generator(name):
    """A CPU generator serves a device rule (rasp_* and blocked_simplex drew on the rule's device
    with it: torch refuses a CPU generator for a CUDA tensor; so does meta's randint/rand)."""
    dim = 3 if name == "gauss_hermite" else 10
    shape, checksum, after = CPU_DRAWS[name]
    rule = make_rule(name, None)
    # mc and vrmc make their nodes empty on meta (they raised "META device type not an
    # accelerator" from a generator made on the rule's device)
    for generator in (None, torch.Generator().manual_seed(3)):
        with FakeSync():
            nodes = rule.draw(dim, step=2, generator=generator, dtype=torch.float32, device=META)
            matrix = nodes.matrix()
            node = nodes.node(1)
        assert matrix.device == node.device == nodes.weights.device == META
        assert matrix.shape == shape and node.shape == (dim,)
    generator = torch.Generator().manual_seed(3)
    cpu = rule.draw(dim, step=2, generator=generator, dtype=torch.float64).matrix()
    weights = torch.arange(1, cpu.numel() + 1, dtype=torch.float64).reshape(cpu.shape).sin()
    assert round(float((cpu * weights).sum()), 12) == checksum
    assert int(torch.randint(0, 1000, (), generator=generator)) == after


@pytest.mark.parametrize("name", ["hadamard", "gauss_hermite"])
def test_nodes_are_built_without_host_tensors(name, monkeypatch):
    """A node of a deterministic rule takes no ``torch.tensor(int, device=...)`` (a copy from
    the host on CUDA, twice per Hadamard pair, once per Gauss-Hermite node)."""
    rule = make_rule(name, None)
    nodes = rule.draw(3, step=5, dtype=torch.float64)
    expected = nodes.matrix()

    def refuse(*args, **kwargs):
        raise AssertionError("torch.tensor called while building a node")

    monkeypatch.setattr(torch, "tensor", refuse)
    for k in range(len(nodes)):
        assert torch.equal(nodes.node(k), expected[k])
    meta_nodes = rule.draw(3, step=5, dtype=torch.float64, device=META)
    assert meta_nodes.node(1).device == META


def test_fwht_on_meta():
    for shape in [(4, 64), (3, 2048)]:
        x = torch.ones(shape, device=META, requires_grad=True)
        with FakeSync() as syncs:
            y = fwht(x)
            y.sum().backward()
        assert y.device == x.grad.device == META and y.shape == shape
        assert syncs.total == 0


def test_metrics_on_meta_and_device_errors():
    probs = torch.full((8, 3), 1 / 3, device=META)
    labels = torch.zeros(8, dtype=torch.long, device=META)
    mean = torch.zeros(10, device=META)
    with FakeSync():
        results = [
            metrics.categorical_nll(probs, labels),
            metrics.accuracy(probs, labels),
            metrics.brier_score(probs, labels),
            metrics.expected_calibration_error(probs, labels),
            metrics.gaussian_nll(mean, 0.5, mean),
            metrics.gaussian_nll(mean, torch.tensor(0.5), mean),  # one level, moved
            metrics.rmse(mean, mean),
        ]
        assert metrics.calibration_bins(probs, labels).edges.device == META
    assert all(r.device == META and r.dim() == 0 for r in results)
    with FakeSync():  # (the finiteness checks read meta values)
        with pytest.raises(ValueError, match=r"y is on cpu but pred is on meta; move it there"):
            metrics.rmse(mean, torch.zeros(10))
        with pytest.raises(ValueError, match=r"y is on cpu but mean is on meta"):
            metrics.gaussian_nll(mean, 0.5, torch.zeros(10))
        with pytest.raises(ValueError, match=r"scale is on cpu but mean is on meta"):
            metrics.gaussian_nll(mean, torch.full((10,), 0.5), mean)


def test_cuda_devices_are_found_in_models_and_arguments():
    net = nn.Linear(2, 1)
    assert cuda_devices(net, (torch.zeros(2),), {"x": [torch.zeros(1, device=META)]}) == []
    # without CUDA, a CUDA tensor cannot be made: the devices are read from tensors' .device
    fake = type("T", (torch.Tensor,), {"device": torch.device("cuda", 1)})
    one = torch.zeros(1).as_subclass(fake)
    assert cuda_devices((3, [one]), {"y": one}) == [1]


def test_random_state_restores_cpu_and_cuda_states(monkeypatch):
    """The state replayed for a failing guide set-up holds each CUDA device's state too."""
    cuda_states = {0: torch.tensor([7], dtype=torch.uint8), 2: torch.tensor([9], dtype=torch.uint8)}
    restored = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i: cuda_states[i].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.__setitem__(i, s))
    torch.manual_seed(5)
    state = RandomState.get([0, 2])
    first = torch.rand(3)
    state.restore()
    assert torch.equal(torch.rand(3), first)
    assert {i: int(s) for i, s in restored.items()} == {0: 7, 2: 9}


def test_checkpoint_and_broadcast_carry_the_cuda_state(tmp_path, monkeypatch):
    """Where CUDA has started, the checkpoint saves every device's random state and restores it;
    broadcast_generator() sends the current device's (faked: no GPU here)."""
    saved = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in saved])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: saved[0].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i=0: restored.__setitem__(i, s))
    optim = pyro.optim.Adam({"lr": 0.1})
    path = tmp_path / "fit.pt"
    checkpoint.save_checkpoint(path, optim)
    checkpoint.load_checkpoint(path, optim)
    assert {i: s.tolist() for i, s in restored.items()} == {0: [1, 2], 1: [3, 4]}
    cpu, cuda = comm._global_states()
    assert torch.equal(cpu, torch.get_rng_state()) and cuda.tolist() == [1, 2]


def test_device_scalars_are_filled_in_place():
    like = torch.zeros(3, dtype=torch.float64, device=META)
    first = _device_scalars(like, 2.0, 0.5)
    again = _device_scalars(like, 3.0, 0.0)
    assert all(a is b for a, b in zip(first, again))
    assert all(t.device == META and t.dtype == torch.float64 for t in again)
    cpu = _device_scalars(torch.zeros(3, dtype=torch.float64), 3.0, 0.25)
    assert cpu[0].item() == 3.0 and cpu[1].item() == 0.25


def test_host_syncs_of_a_steady_state_step():
    """Host syncs per step on a GPU, validation off, after the first steps have decided how to
    evaluate the model (vectorized)."""
    x, y = _data()
    bnn = BayesianModule(_network(1), priors.Normal(1.0), likelihoods.Gaussian(32, scale=0.3))
    guide = AutoMeanFieldNormal(bnn, init_scale=0.05)
    svi = SVI(bnn, guide, QNVB(lr=0.5), QuadratureELBO("blocked_simplex"))
    net = _network(1)
    opt = QNVBOptimizer(net.named_parameters(), quadrature="blocked_simplex", likelihood_weight=32)
    loss_fn = module_loss(net, nn.functional.mse_loss)
    with pyro.validation_enabled(False), FakeSync():
        for _ in range(2):
            svi.step(x, y)
            opt.step(loss_fn=loss_fn, batch=(x, y))
    with pyro.validation_enabled(False), FakeSync() as pyro_step:
        svi.step(x, y)
    # infer/log_joint.py: bool(isfinite(total).all()), the one finiteness check of the nodes;
    # infer/quadrature_elbo.py: `if not torch.isfinite(loss)` and SVI's loss.item();
    # optim/qnvb_functional.py: the counts' .tolist() (a copy to the host); the update writes
    # its results in place (donated), so off the CPU it selects in every chunk, reading nothing;
    # nn/module.py: the data check (x finite, y in the likelihood's support), one read of both;
    # optim/qnvb.py: the published moments checked against the gradients, one read of every
    # block's checked coordinates (session 27; the zeros FakeSync reads give a weight of 0, so
    # these steps read the blocks from their gradients)
    assert pyro_step.by_file() == {
        "nn/module.py": 1,
        "infer/log_joint.py": 1,
        "infer/quadrature_elbo.py": 2,
        "optim/qnvb.py": 1,
        "optim/qnvb_functional.py": 1,
    }
    with pyro.validation_enabled(False), FakeSync() as torch_step:
        opt.step(loss_fn=loss_fn, batch=(x, y))
    # the loss's finiteness check and the counts' copy to the host (the update, in place on the
    # optimizer's own state, reads nothing back)
    assert torch_step.total == 2, torch_step.counts


def test_fit_moves_cpu_batches_to_the_device_and_subsampled_2d_rows_stay_there():
    """``fit(device=)`` moves a DataLoader's CPU batches to the model's device (without it the
    step mixes devices); QNVB's row index of a subsampled parameter is made on its device."""
    from pyro_quadvi.nn import fit

    bnn = BayesianModule(_network(1), priors.Normal(1.0), likelihoods.Gaussian(64, scale=0.3))
    guide = AutoMeanFieldNormal(bnn, init_scale=0.05)
    x, y = torch.randn(16, 3), torch.randn(16, 1)  # on the CPU, as a DataLoader yields them
    svi = SVI(bnn, guide, QNVB(lr=0.5), QuadratureELBO("hadamard", num_points=4))
    with FakeSync():
        with pytest.raises(RuntimeError, match="device"):
            fit(svi, [(x, y)], 1, progress=False)
        history = fit(svi, [(x, y)], 2, progress=False, device=META)
    assert len(history.loss) == 2
    _all_on_meta()
    from pyro_quadvi.optim.qnvb import _row_index

    index = _row_index(torch.Size([5, 3]), {0: torch.tensor([1, 3], device=META)})
    assert [t.device for t in index] == [META, META]
    assert [tuple(t.shape) for t in index] == [(2, 1), (1, 3)]


def _sparse_closure(net: nn.Module, x: torch.Tensor, y: torch.Tensor):
    def closure():
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        return loss

    return closure


def test_host_syncs_of_a_sparse_step_during_the_sieve():
    """A SparseQNVB step of the first epochs (the sieve runs): the loss's finiteness check is its
    one read of the loss (the loss-growth check reads that same number: it read the loss a
    second time), and the sieve ranks the logits without a read (``if isinf(upper)`` and
    ``elif width > 0`` were one each)."""
    x, y = _data()
    net = _network(1)
    opt = SparseQNVBOptimizer(net.parameters(), num_cases=32, num_epochs=3, steps_per_epoch=4)
    closure = _sparse_closure(net, x, y)
    with FakeSync():
        opt.step(closure)
    with FakeSync() as syncs:
        opt.step(closure)
    # torch_qnvb.py: check_finite_loss; sparse_functional.py: three guards per parameter tensor
    # (`if bad.any()`, `if overflow.any()`, the last guard's `if bad.any()`) and the counts'
    # .tolist() of the warnings
    assert syncs.by_file() == {"optim/torch_qnvb.py": 1, "optim/sparse_functional.py": 13}
    assert all(
        v.device == META for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )


def _state_on_meta(opt: torch.optim.Optimizer) -> bool:
    return all(
        v.device == META for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )


def test_optimizers_take_edits_and_load_state_on_meta():
    """A parameter changed between steps (in place, and by ``p.data = ...``) is taken as its mean,
    and a state dict loads its means into another net's parameters (``_write_means``), all on the
    device; sparse ``sampled_params`` draws there."""
    x, y = _data()
    net = _network(1)
    opt = QNVBOptimizer(net.named_parameters(), quadrature="blocked_simplex", likelihood_weight=32)
    sparse_net = _network(1)
    sparse = SparseQNVBOptimizer(
        sparse_net.parameters(), num_cases=32, num_epochs=3, steps_per_epoch=4
    )
    with FakeSync():
        opt.step(loss_fn=module_loss(net, nn.functional.mse_loss), batch=(x, y))
        sparse.step(_sparse_closure(sparse_net, x, y))
        for model in (net, sparse_net):
            with torch.no_grad():
                model[0].weight.mul_(2.0)
            model[2].bias.data = torch.zeros(1, device=META)
        opt.step(loss_fn=module_loss(net, nn.functional.mse_loss), batch=(x, y))
        sparse.step(_sparse_closure(sparse_net, x, y))
        with sparse.sampled_params():
            assert all(p.device == META for p in sparse_net.parameters())
        copies = _network(1), _network(1)
        opt2 = QNVBOptimizer(
            copies[0].named_parameters(), quadrature="blocked_simplex", likelihood_weight=32
        )
        opt2.load_state_dict(opt.state_dict())
        sparse2 = SparseQNVBOptimizer(
            copies[1].parameters(), num_cases=32, num_epochs=3, steps_per_epoch=4
        )
        sparse2.load_state_dict(sparse.state_dict())
        opt2.step(loss_fn=module_loss(copies[0], nn.functional.mse_loss), batch=(x, y))
        sparse2.step(_sparse_closure(copies[1], x, y))
    for optimizer in (opt, sparse, opt2, sparse2):
        assert _state_on_meta(optimizer)
    assert all(p.device == META for model in copies for p in model.parameters())


def test_signed_blocked_simplex_and_multi_step_prediction_on_meta():
    """``BlockedSimplexRule(random_signs=True)`` draws its signs on the generator's device and
    moves them; ``predict(steps=...)`` concatenates node sets made on the guide's device."""
    from pyro_quadvi.quadrature.rasp import BlockedSimplexRule

    rule = BlockedSimplexRule(3, random_signs=True)
    for generator in (None, torch.Generator().manual_seed(1)):
        with FakeSync() as syncs:
            nodes = rule.draw(10, step=1, generator=generator, device=META)
            assert nodes.matrix().device == nodes.node(2).device == META
        assert syncs.total == 0
    x, y = _data()
    bnn = BayesianModule(_network(1), priors.Normal(1.0), likelihoods.Gaussian(32, scale=0.3))
    guide = AutoMeanFieldNormal(bnn)
    with FakeSync():
        guide(x, y)
        for steps in (3, "period"):
            prediction = bnn.predict(guide, x, quadrature="hadamard", steps=steps)
            assert prediction.mean.device == META and prediction.mean.shape[-2:] == (32, 1)
        more_rows = bnn.predict(guide, torch.zeros(40, 3, device=META), num_samples=2)
    assert more_rows.mean.shape[-2:] == (40, 1)  # y=None: a plate of the rows, not dataset_size


def test_opqa_posterior_log_prob_on_meta():
    """An OPQA posterior on the device takes values on it, on the CPU, and numbers
    (``torch.as_tensor`` onto its device), and gives its densities there."""
    from pyro_quadvi import opqa_evidence
    from pyro_quadvi.evidence.posterior import OPQAPosterior

    def model(y):
        mu = pyro.sample("mu", dist.Uniform(torch.tensor(0.5, dtype=torch.float64), 3.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu, 0.5), obs=y)

    cpu = opqa_evidence(
        model, torch.tensor([1.2, 1.9, 1.4], dtype=torch.float64), num_points=6
    ).posterior
    posterior = OPQAPosterior(cpu.sites, cpu.loc.to(META), cpu.scale_tril, cpu.coefficients)
    values = [1.3, torch.tensor([0.4, 1.3, math.nan], dtype=torch.float64)]
    with FakeSync():
        for value in [*values, torch.zeros(2, device=META)]:
            assert posterior.log_prob({"mu": value}).device == META
        assert posterior.log_prob(1.3).device == META


def _one_qnvb_step(device: torch.device, dtype: torch.dtype, state: dict | None = None) -> QNVB:
    """One QNVB step of a 3-8-1 BayesianModule on ``device`` in ``dtype``, after restoring
    ``state`` (a saved ``QNVB.get_state()``) if given."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, dtype=dtype), torch.randn(32, 1, dtype=dtype)
    x, y = x.to(device), y.to(device)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(device, dtype)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(32, scale=0.3))
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net(), init_scale=0.05)
    optim = QNVB(lr=0.5)
    if state is not None:
        guide(x, y)
        optim.set_state(state)
    SVI(bnn, guide, optim, QuadratureELBO("hadamard")).step(x, y)
    return optim


def test_a_qnvb_state_saved_on_the_cpu_resumes_a_fit_on_the_device():
    """``QNVB.set_state`` of a CPU run's state, then a step on the device: each block's state
    binds on its parameter's device, as torch's optimizers load theirs (it raised "Tensor on
    device cpu is not on the expected device" in the update)."""
    saved = _one_qnvb_step(torch.device("cpu"), torch.float32).get_state()
    with FakeSync():
        resumed = _one_qnvb_step(META, torch.float32, saved).get_state()
    assert resumed["qnvb"]["num_steps"] == 2
    pairs = resumed["qnvb"]["pairs"]
    assert pairs.keys() == saved["qnvb"]["pairs"].keys() and len(pairs) == 4
    for name, state in pairs.items():
        assert all(value.device == META for value in state.values()), name
    _all_on_meta()


def test_a_qnvb_state_saved_in_float32_binds_in_the_parameters_float64():
    """The floating fields of a restored block state take their parameter's dtype, as torch's
    ``Optimizer.load_state_dict`` casts (they stayed float32 in a float64 fit)."""
    cpu = torch.device("cpu")
    saved = _one_qnvb_step(cpu, torch.float32).get_state()
    resumed = _one_qnvb_step(cpu, torch.float64, saved).get_state()
    for name, state in resumed["qnvb"]["pairs"].items():
        saved_state = saved["qnvb"]["pairs"][name]
        for key, value in state.items():
            if saved_state[key].is_floating_point():
                assert value.dtype == torch.float64, (name, key)
