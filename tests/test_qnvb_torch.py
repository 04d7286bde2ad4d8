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
