"""``QNVBOptimizer``: QNVB for torch parameters, evaluating the closure at quadrature nodes."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from pyro_quadvi.optim import QNVBOptimizer
from pyro_quadvi.testing import linear_regression, logistic_regression

DTYPE = torch.float64


def _orthogonal_regression(n=64, d=4, seed=0):
    """Centered, orthogonal columns of norm sqrt(n): with the bias, X^T X = n I."""
    generator = torch.Generator().manual_seed(seed)
    columns = torch.randn(n, d + 1, generator=generator, dtype=DTYPE)
    columns[:, 0] = 1.0
    basis, _ = torch.linalg.qr(columns)  # the first column is constant, the others centered
    x = basis[:, 1:] * math.sqrt(n)
    y = x @ torch.tensor([0.5, -0.3, 0.8, 0.1], dtype=DTYPE) + 0.2
    y = y + 0.5 * torch.randn(n, generator=generator, dtype=DTYPE)
    return x, y


def _linear_net(d):
    net = torch.nn.Linear(d, 1).to(DTYPE)
    with torch.no_grad():
        net.weight.zero_()
        net.bias.zero_()
    return net


def _closure(net, optimizer, x, y):
    def closure():
        loss = 0.5 * ((net(x).squeeze(-1) - y) ** 2).mean()  # per case, noise variance 1
        loss.backward()
        return loss

    return closure


def _exact_posterior(x, y, prior_precision, weight=1.0):
    design = torch.cat([x, torch.ones(len(x), 1, dtype=DTYPE)], dim=1)
    precision = weight * design.T @ design + prior_precision * torch.eye(design.shape[1])
    mean = torch.linalg.solve(precision, weight * design.T @ y)
    return mean, precision.diagonal().rsqrt()


def _mean_field(net, optimizer):
    state_w, state_b = optimizer.state[net.weight], optimizer.state[net.bias]
    mu = torch.cat([state_w["mu"].reshape(-1), state_b["mu"]])
    sigma = torch.cat([state_w["sigma"].reshape(-1), state_b["sigma"]])
    return mu, sigma


def test_linear_network_reaches_the_optimal_mean_field_in_a_handful_of_steps():
    # Bayesian linear regression, orthogonal design: sigma_i = (n + prior)^(-1/2) exactly
    x, y = _orthogonal_regression()
    net = _linear_net(4)
    optimizer = QNVBOptimizer(net.parameters(), likelihood_weight=len(x), prior_precision=1.0)
    mean, sd = _exact_posterior(x, y, 1.0)
    errors = []
    for _ in range(6):
        optimizer.step(_closure(net, optimizer, x, y))
        mu, sigma = _mean_field(net, optimizer)
        errors.append(float(torch.maximum((mu - mean).abs() / sd, (sigma / sd - 1).abs()).max()))
    assert errors[-1] < 1e-2, errors
    # the parameters hold the mean after a step
    torch.testing.assert_close(net.weight.detach().reshape(-1), mu[:4], rtol=0, atol=0)


def test_annealing_factor_multiplies_the_likelihood_weight():
    x, y = _orthogonal_regression()
    net = _linear_net(4)
    optimizer = QNVBOptimizer(
        net.parameters(),
        likelihood_weight=len(x),
        prior_precision=2.0,
        annealing=lambda step: 0.25,
        init_sigma=0.2,
    )
    optimizer.step(_closure(net, optimizer, x, y))
    _, sd = _exact_posterior(x, y, 2.0, weight=0.25)
    torch.testing.assert_close(_mean_field(net, optimizer)[1], sd, rtol=1e-12, atol=0)
    assert optimizer.weight == 0.25 * len(x)


@pytest.mark.parametrize("rho, steps", [(0.5, 100), (0.9, 400)])
def test_correlated_regression_converges_without_diverging(rho, steps):
    problem, _, _ = linear_regression(10, rho, seed=1)
    z = torch.nn.Parameter(torch.zeros(10, dtype=DTYPE))
    optimizer = QNVBOptimizer([z], quadrature="hadamard", init_sigma=0.1)
    errors = []
    for _ in range(steps):

        def closure():
            loss = problem.neg_log_joint(z)
            loss.backward()
            return loss

        optimizer.step(closure)
        errors.append(problem.error(optimizer.state[z]["mu"], optimizer.state[z]["sigma"]))
    start = problem.error(torch.zeros(10), torch.full((10,), 0.1))
    assert max(errors) <= 2 * start
    assert errors[-1] < 1e-2, errors[-1]


def test_logistic_regression_matches_the_tightly_converged_reference():
    problem, _, _ = logistic_regression(5, 200, seed=2)
    z = torch.nn.Parameter(torch.zeros(5, dtype=DTYPE))
    optimizer = QNVBOptimizer([z], init_sigma=0.1, generator=torch.Generator().manual_seed(0))
    for _ in range(300):

        def closure():
            loss = problem.neg_log_joint(z)
            loss.backward()
            return loss

        optimizer.step(closure)
    # rasp_simplex 3 integrates univariate quadratics exactly; the rest is a bias of about 1%
    assert problem.error(optimizer.state[z]["mu"], optimizer.state[z]["sigma"]) < 0.05


def _train(optimizer, net, x, y, steps):
    losses = []
    for _ in range(steps):
        losses.append(optimizer.step(_closure(net, optimizer, x, y)))
    return torch.stack(losses)


@pytest.mark.parametrize("use_generator", [True, False])
def test_state_dict_resumes_a_run_bit_for_bit(use_generator):
    x, y = _orthogonal_regression(seed=3)

    def make():
        net = _linear_net(4)
        generator = torch.Generator().manual_seed(5) if use_generator else None
        optimizer = QNVBOptimizer(
            net.parameters(), likelihood_weight=len(x), prior_precision=1.0, generator=generator
        )
        return net, optimizer

    torch.manual_seed(11)
    net, optimizer = make()
    _train(optimizer, net, x, y, 7)
    saved = (copy.deepcopy(optimizer.state_dict()), copy.deepcopy(net.state_dict()))
    rng = torch.get_rng_state()
    uninterrupted = _train(optimizer, net, x, y, 7)

    resumed_net, resumed = make()
    resumed.load_state_dict(saved[0])
    resumed_net.load_state_dict(saved[1])
    torch.set_rng_state(rng)
    continued = _train(resumed, resumed_net, x, y, 7)
    assert torch.equal(continued, uninterrupted)
    for p, q in zip(net.parameters(), resumed_net.parameters()):
        assert torch.equal(p, q)
        for key in optimizer.state[p]:
            assert torch.equal(optimizer.state[p][key], resumed.state[q][key])


def test_non_finite_gradients_leave_coordinates_unchanged_and_warn_once():
    w = torch.nn.Parameter(torch.tensor([0.5, 1.0, -1.0], dtype=DTYPE))
    unused = torch.nn.Parameter(torch.tensor([3.0], dtype=DTYPE))
    optimizer = QNVBOptimizer([w, unused], init_sigma=0.1)

    def closure():
        loss = (w**2).sum()
        loss.backward()
        w.grad[0] = math.inf  # the first coordinate's gradient is infinite at every node
        return loss

    with pytest.warns(RuntimeWarning, match="non-finite"):
        optimizer.step(closure)
    assert w[0] == 0.5 and torch.isfinite(w).all() and w[1] != 1.0
    assert unused.item() == 3.0 and "sigma" in optimizer.state[unused]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step(closure)  # warned once only
    assert w[0] == 0.5 and torch.isfinite(w).all()


def test_overflow_and_sigma_at_its_bound_are_told_apart_and_warned_once_each():
    # float32: w[0]'s gradient 1e20 is finite but its square is not; w[1] sits in a well of
    # curvature 2e14, whose sigma 7e-8 lies below sigma_min = 1e-6 (reached from 1e-5 by the rate
    # limit in one step, pinned from the second)
    w = torch.nn.Parameter(torch.zeros(2))
    optimizer = QNVBOptimizer([w], init_sigma=1e-5)

    def closure():
        loss = 1e20 * w[0] + 1e14 * w[1] ** 2
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            optimizer.step(closure)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == [
        "QNVBOptimizer: the update overflowed while the gradient was finite (e.g. g^2 beyond the "
        "dtype's range) at 1 coordinate (first: a parameter of shape (2,)); they were left "
        "unchanged: rescale the loss or use float64. If the loss has been growing, the means "
        "have diverged: cap their steps (trust_region=0.3, the network settings a "
        "BayesianModule declares, or a smaller lr) (this warning is shown once)",
        "QNVBOptimizer: sigma pinned at sigma_min=1e-06 at 1 coordinate (first: a parameter of "
        "shape (2,)): the curvature asks for a smaller sigma; lower sigma_min if that is wanted "
        "(this warning is shown once)",
    ]
    assert w[0] == 0.0 and optimizer.state[w]["sigma"][1] == pytest.approx(1e-6)


def test_sigma_pinned_at_sigma_max_is_warned():
    # started at sigma = 1e4, the rate limit (a factor 0.1 at most) leaves 1e3 > sigma_max = 100
    w = torch.nn.Parameter(torch.zeros(3, dtype=DTYPE))
    optimizer = QNVBOptimizer([w], init_sigma=1e4)

    def closure():
        loss = (w**2).sum()
        loss.backward()
        return loss

    with pytest.warns(RuntimeWarning) as caught:
        optimizer.step(closure)
    assert [str(w.message) for w in caught] == [
        "QNVBOptimizer: sigma pinned at sigma_max=100, or rising to it at the scale rate limit "
        "(scale_max=10 a step), at 3 coordinates (first: a parameter of "
        "shape (3,)): the curvature asks for a wider sigma (too small a likelihood weight, a "
        "parameter the loss hardly depends on without a prior, or a curvature estimate still "
        "near 0 in the first steps), or sigma started above it; raise sigma_max if a wider "
        "posterior is wanted. The posterior sd itself may be above 100: the coefficient of a "
        "feature on a small scale (1e-3, say) has an sd a thousand times that of a standardized "
        "one; standardize the inputs, or raise sigma_max above that sd (this warning is shown "
        "once)"
    ]
    assert torch.equal(optimizer.state[w]["sigma"], torch.full((3,), 100.0, dtype=DTYPE))


@pytest.mark.parametrize(
    "returned, expected",
    [
        (lambda loss: None, "it returned None (NoneType)"),
        (lambda loss: loss * torch.ones(3), "it returned a tensor of shape (3,)"),
        (lambda loss: float(loss), "it returned 0.0 (float)"),
    ],
)
def test_a_closure_must_return_the_scalar_loss(returned, expected):
    z = torch.nn.Parameter(torch.zeros(2, dtype=DTYPE))
    optimizer = QNVBOptimizer([z], init_sigma=0.1)

    def closure():
        loss = (z**2).sum()
        loss.backward()
        return returned(loss.detach() * 0)

    with pytest.raises(TypeError) as info:
        optimizer.step(closure)
    assert str(info.value) == (
        "QNVBOptimizer: the closure must return the scalar loss tensor (mean per case) after "
        f"calling backward() on it; {expected}"
    )
    assert torch.equal(z.detach(), torch.zeros(2, dtype=DTYPE))  # back at the mean


def test_a_closure_without_backward_is_refused():
    z = torch.nn.Parameter(torch.ones(2, dtype=DTYPE))
    optimizer = QNVBOptimizer([z], init_sigma=0.1)
    with pytest.raises(
        RuntimeError, match="none of the 1 parameters this optimizer holds received a gradient"
    ):
        optimizer.step(lambda: (z**2).sum())
    assert torch.equal(z.detach(), torch.ones(2, dtype=DTYPE)) and optimizer.num_steps == 0


def test_bad_arguments_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="likelihood_weight"):
        QNVBOptimizer(p, likelihood_weight=0.0)
    with pytest.raises(ValueError, match="init_sigma"):
        QNVBOptimizer(p, init_sigma=-1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        QNVBOptimizer(p, prior_precision=-1.0)
    with pytest.raises(ValueError, match="unknown quadrature rule"):
        QNVBOptimizer(p, quadrature="simpson")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(betas=0.9),
            TypeError,
            "betas must be a pair (beta1, beta2) of numbers in [0, 1), got 0.9 (float)",
        ),
        (dict(lr="1"), TypeError, "lr must be a real number >= 0, got '1' (str)"),
        (
            dict(likelihood_weight="10"),
            TypeError,
            "likelihood_weight must be a real number > 0, got '10' (str)",
        ),
        (
            dict(annealing=0.5),
            TypeError,
            "annealing must be a callable step -> factor, such as "
            "geometric_annealing(0.01, num_steps=500), got 0.5 (float)",
        ),
        (
            dict(annealing=lambda step: None),
            TypeError,
            "annealing(0) must return a real number > 0, got None (NoneType)",
        ),
    ],
)
def test_bad_argument_types_are_refused_at_construction_by_name(kwargs, error, message):
    with pytest.raises(error) as info:
        QNVBOptimizer([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    assert str(info.value) == message


def test_a_bad_parameter_group_is_refused_when_added():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="damping_recovery must be finite and > 0, got -1"):
        QNVBOptimizer([{"params": [a]}, {"params": [b], "damping_recovery": -1}])
