"""Session 27, helper f23: the plain-torch optimizers (`QNVBOptimizer`, `SparseQNVBOptimizer`)
under an enclosing ``torch.autocast``. Autocast keeps its half-precision copy of each weight until
the outermost autocast exits, and the optimizers write the nodes, draws and means into the
parameters in place: the copy must be dropped after each write. The float32-resolution warning
measures the spacing in the autocast dtype, which is the one the forward sees. And what
docs/qnvb_torch.md says of the forms with ``hadamard`` in float32."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_quadvi.optim import QNVBOptimizer, SparseQNVBOptimizer, module_loss
from pyro_quadvi.optim.qnvb_functional import _unresolved

NOISE = 0.5


def linear_gaussian(n: int, weights: list[float]):
    """Rows, targets, and the exact mean-field posterior (no prior): the least-squares mean and
    ``sigma_i = 1 / sqrt(A_ii)``, ``A = X^T X / s^2``, computed in float64."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, len(weights), dtype=torch.float64, generator=g)
    y = x @ torch.tensor(weights, dtype=torch.float64) + NOISE * torch.randn(
        n, dtype=torch.float64, generator=g
    )
    precision = x.T @ x / NOISE**2
    mean = torch.linalg.solve(precision, x.T @ y / NOISE**2)
    return x.float(), y.float(), mean, precision.diag().rsqrt()


def criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out.squeeze(-1) - target) ** 2).mean() / NOISE**2


def bf16(on: bool):
    """A bfloat16 autocast where ``on``, else nothing (``enabled=False`` would switch off an
    enclosing one)."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def fitted(x, y, steps: int, autocast_around: str, one_pass: bool = False):
    """A zero-started ``Linear`` fitted by `QNVBOptimizer` (hadamard) under bfloat16 autocast
    entered around each step (``"step"``), around the whole loop (``"loop"``) or inside the
    closure (``"closure"``); returns the optimizer's mean and sigma."""
    net = nn.Linear(x.shape[1], 1, bias=False)
    with torch.no_grad():
        net.weight.zero_()
    optimizer = QNVBOptimizer(
        net.named_parameters(), likelihood_weight=len(x), quadrature="hadamard"
    )

    def closure():
        optimizer.zero_grad()
        with bf16(autocast_around == "closure"):
            loss = criterion(net(x), y)
        loss.backward()
        return loss

    with bf16(autocast_around == "loop"):
        for _ in range(steps):
            with bf16(autocast_around == "step"):
                if one_pass:
                    optimizer.step(loss_fn=module_loss(net, criterion), batch=(x, y))
                else:
                    optimizer.step(closure)
    state = optimizer.state[net.weight]
    return state["mu"].double().flatten(), state["sigma"].double().flatten()


@pytest.mark.parametrize("around", ["step", "loop"])
def test_the_closure_form_under_autocast_reaches_the_exact_sigma(around):
    """Weights small enough for bfloat16 to resolve the nodes (``|mu| / 128`` below ``sigma``):
    the closure fit under an autocast around the step or the loop ends as the float32 fit does,
    near the closed form, where every node used to run with node 0's weights (``h = 0``:
    ``sigma`` held at ``init_sigma = 1e-3``, ``0.089`` of exact, the means 50 sds off)."""
    x, y, mean, sigma = linear_gaussian(2000, [0.3, -0.2, 0.1, 0.25])
    mu, sig = fitted(x, y, 60, around)
    assert torch.all((sig / sigma - 1).abs() < 0.05), sig / sigma
    assert torch.all(((mu - mean) / sigma).abs() < 0.1), (mu - mean) / sigma


def test_autocast_around_the_step_equals_autocast_inside_the_closure_bit_for_bit():
    """The nodes see the weights they are set to: entering autocast around the step is the same
    computation as entering it inside the closure (which casts afresh at each node)."""
    x, y, _, _ = linear_gaussian(256, [1.5, -0.7, 0.3, 2.0])
    around = fitted(x, y, 5, "step")
    inside = fitted(x, y, 5, "closure")
    assert torch.equal(around[0], inside[0]) and torch.equal(around[1], inside[1])


def sparse_state(x, y, around: bool) -> dict[str, torch.Tensor]:
    """`SparseQNVBOptimizer`'s state after two steps under one bfloat16 autocast (``around``),
    or with the closure entering autocast itself."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1, bias=False)
    optimizer = SparseQNVBOptimizer(
        net.parameters(), num_cases=64, steps_per_epoch=1, initial_lr=1e-2
    )

    def closure():
        optimizer.zero_grad()
        with bf16(not around):
            loss = criterion(net(x), y)
        loss.backward()
        return loss

    with bf16(around):
        optimizer.step(closure)
        optimizer.step(closure)
    return {k: v.clone() for k, v in optimizer.state[net.weight].items()}


def test_sparse_optimizer_under_autocast_equals_autocast_inside_the_closure():
    """`SparseQNVBOptimizer`'s node loop and its means: two steps under one autocast give the
    state of two steps whose closure enters autocast itself."""
    x, y, _, _ = linear_gaussian(64, [1.5, -0.7, 0.3, 2.0])
    around, inside = sparse_state(x, y, True), sparse_state(x, y, False)
    assert around.keys() == inside.keys()
    for key in around:
        assert torch.equal(around[key], inside[key]), key


def test_sampled_params_under_autocast_give_each_draw_and_then_the_means():
    """Each draw of `sampled_params` inside an enclosing autocast gives that draw's output (as
    with autocast entered per draw; it used to give the first draw's every time), and the
    network after the block, in the same autocast, the means'."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=64, init_sigma=0.3)
    generator = torch.Generator()

    def outputs(outer: bool) -> torch.Tensor:
        generator.manual_seed(0)
        outs = []
        with torch.no_grad(), bf16(outer):
            net(x)  # autocast caches the weights at their means
            for _ in range(4):
                with optimizer.sampled_params(generator=generator), bf16(not outer):
                    outs.append(net(x))
            outs.append(net(x))
        return torch.stack(outs)

    around, inside = outputs(True), outputs(False)
    assert torch.equal(around[:4], inside[:4])
    assert (around[1:4] - around[0]).abs().amax() > 0.1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(around[4], net(x))


def test_the_resolution_warning_counts_the_autocast_dtype_spacing():
    """sd 0.0050 at a mean of 2.0: float32 resolves the nodes (no warning), bfloat16, whose
    spacing at 2.0 is 0.0156, does not: the fit under autocast is warned of, naming bfloat16,
    its spacing and autocast, and advising against float64 nowhere."""
    x, y, _, sigma = linear_gaussian(10_000, [1.5, -0.7, 0.3, 2.0])
    assert 0.0049 < float(sigma[3]) < 0.0051
    for autocast in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fitted(x, y, 8, "step" if autocast else "none", one_pass=True)
        messages = [str(w.message) for w in caught if "round back" in str(w.message)]
        if not autocast:
            assert messages == []
            continue
        assert len(messages) == 1, messages
        assert "at 1 coordinate of parameter 'weight' of shape (1, 4)" in messages[0]
        spacing = "torch.bfloat16's spacing at the mean (0.00781 times the largest power of 2"
        assert spacing in messages[0]
        assert "run the forward without autocast, or keep the layer" in messages[0]
        assert "float64" not in messages[0]


def test_the_spacing_is_that_at_the_mean_not_eps_times_the_mean():
    """bfloat16's spacing at 0.1341 (in [1/8, 1/4)) is 2^-3 / 128 = 0.000977, below a sigma of
    0.001 that ``eps |mu|`` (0.00105) took as unresolved; at -0.2741 it is 0.00195, above it."""
    mu = torch.tensor([0.1341, -0.2741, 0.0])
    sigma = torch.full((3,), 1e-3)
    assert _unresolved(mu, sigma, torch.bfloat16).tolist() == [False, True, False]
    assert _unresolved(mu, torch.full((3,), 9.7e-4), torch.bfloat16).tolist() == [
        True,
        True,
        False,
    ]
    # in float32 and float64 the same rule, at the mean's own dtype: 2^-3 * 1.19e-7 = 1.49e-8
    for dtype in (torch.float32, torch.float64):
        eps = torch.finfo(dtype).eps
        at = torch.tensor([0.1341], dtype=dtype)
        assert not _unresolved(at, torch.tensor([eps / 8 * 1.01], dtype=dtype)).item()
        assert _unresolved(at, torch.tensor([eps / 8 * 0.99], dtype=dtype)).item()


def test_the_docs_autocast_example_warns_only_of_the_weight_bfloat16_does_not_resolve():
    """docs/qnvb_torch.md's autocast block after its one-pass loop (trial t33): 0.weight's
    coordinate (mu 0.1341, sigma 0.001) is resolved in bfloat16 and not warned of; 2.weight's
    (mu -0.2741, spacing 0.00195) is, named by its name."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    dataset = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=len(dataset))
    loss_fn = module_loss(net, F.cross_entropy)
    for x, y in DataLoader(dataset, batch_size=16):  # (its iterator draws a seed: the nodes')
        optimizer.step(loss_fn=loss_fn, batch=(x, y))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=True)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "QNVBOptimizer: the nodes mu + sigma * x_k round back to (near) mu at 1 coordinate of "
        "parameter '2.weight' of shape (3, 8): sigma is below torch.bfloat16's spacing"
    )


def test_a_float64_parameter_under_autocast_is_counted_in_float64():
    """Autocast leaves float64 tensors uncast: a float64 weight of mean 2.0 and sigma 0.005,
    resolved in float64, is not warned of under a bfloat16 autocast."""
    net = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        net.weight.fill_(2.0)
    optimizer = QNVBOptimizer(net.parameters(), likelihood_weight=1e4, init_sigma=0.005)
    x = torch.ones(8, 1, dtype=torch.float64)

    def closure():
        optimizer.zero_grad()
        loss = criterion(net(x), 2 * x.squeeze(-1))
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught, bf16(True):
        warnings.simplefilter("always")
        optimizer.step(closure)
    assert not [w for w in caught if "round back" in str(w.message)]


def test_with_hadamard_the_closure_and_the_loop_stay_bit_for_bit_equal_in_float32():
    """A 192-16-4 tanh network (where the vectorized pass parts from the closure in float32
    after one step): the closure and ``vectorize=False`` give the same means and sigmas, bit
    for bit, over five steps (``w_k = 1/4``: the weighted sums are exact in both)."""
    generator = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(32, 192, generator=generator),
        torch.randint(0, 4, (32,), generator=generator),
    )
    runs = []
    for form in ("closure", "loop"):
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(192, 16), nn.Tanh(), nn.Linear(16, 4))
        optimizer = QNVBOptimizer(
            net.named_parameters(), likelihood_weight=32, quadrature="hadamard"
        )

        def closure(net=net, optimizer=optimizer):
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        for _ in range(5):
            if form == "closure":
                optimizer.step(closure)
            else:
                optimizer.step(
                    loss_fn=module_loss(net, F.cross_entropy), batch=(x, y), vectorize=False
                )
        runs.append([optimizer.state[p][k] for p in net.parameters() for k in ("mu", "sigma")])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
