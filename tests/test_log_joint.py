"""LogJoint: one minibatch per evaluation, priors without rsample, and errors that name the site."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample
from scipy import integrate
from torch import nn
from torch.distributions import biject_to

from pyro_quadvi import AutoMeanFieldNormal, QuadratureELBO, opqa_evidence
from pyro_quadvi.infer import LogJoint, latent_sites_of_model
from pyro_quadvi.infer.batched import evaluate_batch

F64 = torch.float64
N, B, K = 40, 8, 6


@pytest.fixture(autouse=True)
def float64():
    pyro.clear_param_store()
    old = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(old)
    pyro.clear_param_store()


def logistic_data():
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(N, 2, generator=generator)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([1.0, -2.0]) + 0.5), generator=generator)
    return X, y


class MinibatchLogistic(PyroModule):
    """Global weights of an ``nn.Linear`` (it cannot take a batch of weights: it never
    vectorizes) and a subsampled data plate that only the model has. Records the rows it sees."""

    def __init__(self):
        super().__init__()
        self.fc = PyroModule[nn.Linear](2, 1)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 2]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        self.seen: list[torch.Tensor] = []

    def forward(self, X, y):
        logits = self.fc(X).squeeze(-1)
        with pyro.plate("data", N, subsample_size=B) as rows:
            self.seen.append(rows)
            pyro.sample("y", dist.Bernoulli(logits=logits[rows]), obs=y[rows])


def minibatch_log_joint(weight, bias, X, y, rows) -> float:
    """By hand: the priors and the minibatch likelihood scaled by N / B."""
    log_prior = dist.Normal(0.0, 1.0).log_prob(weight).sum() + dist.Normal(0.0, 1.0).log_prob(bias)
    logits = X[rows] @ weight + bias
    log_lik = dist.Bernoulli(logits=logits).log_prob(y[rows]).sum()
    return float(log_prior + N / B * log_lik)


def test_all_nodes_of_a_looped_evaluation_see_one_minibatch():
    pyro.set_rng_seed(0)
    X, y = logistic_data()
    model = MinibatchLogistic()
    sites = latent_sites_of_model(model, X, y)
    z = torch.randn(K, 3, generator=torch.Generator().manual_seed(1))
    model.seen.clear()
    values = LogJoint(model, sites)(z, (X, y), vectorize=False)
    rows = model.seen[0]
    assert all(torch.equal(seen, rows) for seen in model.seen)  # K + 1 runs, one subsample
    assert len(model.seen) == K + 1
    for k in range(K):
        expected = minibatch_log_joint(z[k, :2], z[k, 2], X, y, rows)
        assert abs(values[k].item() - expected) < 1e-12


def vectorizable_logistic(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as rows:
        pyro.sample("y", dist.Bernoulli(logits=(X[rows] * w).sum(-1)), obs=y[rows])


def test_vectorized_and_looped_passes_share_the_minibatch():
    pyro.set_rng_seed(2)
    X, y = logistic_data()
    sites = latent_sites_of_model(vectorizable_logistic, X, y)
    z = torch.randn(K, 2, generator=torch.Generator().manual_seed(4))
    log_joint = LogJoint(vectorizable_logistic, sites)
    vectorized = log_joint(z, (X, y), vectorize=True)
    looped = log_joint(z, (X, y), vectorize=False)
    assert torch.allclose(vectorized, looped, rtol=1e-12, atol=1e-12)
    # so the check of the vectorized pass passes, with no warning
    values, decision = evaluate_batch(
        lambda points: log_joint(points, (X, y), vectorize=True),
        lambda point: log_joint(point[None], (X, y), vectorize=False)[0],
        z,
        None,
    )
    assert decision.vectorized and decision.reason is None
    assert torch.equal(values, vectorized)


def test_quadrature_elbo_checks_its_vectorized_pass_on_one_minibatch():
    """The check of the vectorized pass compared nodes of different minibatches and fell back."""
    pyro.set_rng_seed(5)
    X, y = logistic_data()
    guide = AutoMeanFieldNormal(vectorizable_logistic, init_scale=0.5)
    guide(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert math.isfinite(
                QuadratureELBO("rasp_cross").loss(vectorizable_logistic, guide, X, y)
            )


# ---------------------------------------------------------------- LKJCholesky (no rsample)


def lkj_model(y):
    """Pyro's LKJ example (examples/lkj.py) in dimension 3."""
    d = y.shape[-1]
    theta = pyro.sample("theta", dist.HalfCauchy(torch.ones(d)).to_event(1))
    L_omega = pyro.sample("L_omega", dist.LKJCholesky(d, torch.tensor(2.0)))
    L_Omega = theta.sqrt().diag_embed() @ L_omega
    with pyro.plate("observations", y.shape[0]):
        pyro.sample("obs", dist.MultivariateNormal(torch.zeros(d), scale_tril=L_Omega), obs=y)


LKJ_Y = torch.tensor([[0.3, -1.2, 0.8], [1.1, -0.4, 0.2], [-0.5, 0.9, -1.3], [0.7, 0.1, 0.4]])


def test_lkj_latent_is_accepted_and_its_log_joint_is_exact():
    sites = latent_sites_of_model(lkj_model, LKJ_Y)
    assert [(s.name, tuple(s.shape)) for s in sites] == [("theta", (3,)), ("L_omega", (3,))]
    z = torch.tensor([[0.2, -0.3, 0.5, 0.4, -0.7, 0.1]])
    got = LogJoint(lkj_model, sites)(z, (LKJ_Y,), vectorize=False)[0].item()
    # by hand, with torch.distributions
    z_theta, z_l = z[0, :3], z[0, 3:]
    theta = z_theta.exp()
    corr = biject_to(torch.distributions.constraints.corr_cholesky)
    L = corr(z_l)
    log_p = torch.distributions.HalfCauchy(torch.ones(3)).log_prob(theta).sum() + z_theta.sum()
    log_p = log_p + torch.distributions.LKJCholesky(3, 2.0).log_prob(L)
    log_p = log_p + corr.log_abs_det_jacobian(z_l, L)
    scale_tril = theta.sqrt().diag_embed() @ L
    log_p = (
        log_p
        + torch.distributions.MultivariateNormal(torch.zeros(3), scale_tril=scale_tril)
        .log_prob(LKJ_Y)
        .sum()
    )
    assert abs(got - log_p.item()) < 1e-12
    # the quadrature ELBO and its vectorized pass run it too
    guide = AutoMeanFieldNormal(lkj_model)
    assert math.isfinite(QuadratureELBO(vectorize=True).loss(lkj_model, guide, LKJ_Y))


def lkj_as_written(y):
    """Pyro's examples/lkj.py as it is written (``torch.mm`` and ``torch.diag``, which take one
    matrix, not a batch), with ``theta``'s dims declared an event."""
    d = y.shape[1]
    theta = pyro.sample("theta", dist.HalfCauchy(torch.ones(d)).to_event(1))
    L_omega = pyro.sample("L_omega", dist.LKJCholesky(d, torch.ones(())))
    L_Omega = torch.mm(torch.diag(theta.sqrt()), L_omega)
    with pyro.plate("observations", y.shape[0]):
        pyro.sample("obs", dist.MultivariateNormal(torch.zeros(d), scale_tril=L_Omega), obs=y)


def test_lkj_example_as_written_falls_back_to_the_loop_with_one_warning():
    """The vectorized pass meets ``torch.diag`` of a batch ("Supports 1D or 2D tensors"), which
    was not known as a broadcasting error: the default ``vectorize=None`` raised it. It now
    loops over the points, warning once, and the loss is the looped pass's."""
    guide = AutoMeanFieldNormal(lkj_as_written)
    guide(LKJ_Y)
    looped = QuadratureELBO("hadamard", vectorize=False).loss(lkj_as_written, guide, LKJ_Y)
    elbo = QuadratureELBO("hadamard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = elbo.loss(lkj_as_written, guide, LKJ_Y)
        second = elbo.loss(lkj_as_written, guide, LKJ_Y)
    assert first == second == looped and math.isfinite(looped)
    fallbacks = [w for w in caught if "Supports 1D or 2D tensors" in str(w.message)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]


def lkj_2d(y):
    L = pyro.sample("L", dist.LKJCholesky(2, torch.tensor(1.5)))
    with pyro.plate("observations", y.shape[0]):
        pyro.sample("obs", dist.MultivariateNormal(torch.zeros(2), scale_tril=L), obs=y)


def test_opqa_evidence_of_an_lkj_model_matches_the_integral_over_the_correlation():
    y = LKJ_Y[:, :2]
    eta = 1.5

    def integrand(r: float) -> float:
        # the correlation of LKJ(2, eta) is 2 Beta(eta, eta) - 1
        prior = dist.Beta(eta, eta).log_prob(torch.tensor((r + 1) / 2)) - math.log(2)
        cov = torch.tensor([[1.0, r], [r, 1.0]])
        lik = dist.MultivariateNormal(torch.zeros(2), cov).log_prob(y).sum()
        return math.exp(prior + lik)

    expected = math.log(integrate.quad(integrand, -1, 1, epsabs=0, epsrel=1e-13, limit=200)[0])
    result = opqa_evidence(lkj_2d, y, num_points=64)  # one coordinate: tanh(z) = r
    assert abs(result.log_evidence - expected) < 1e-8
    # the posterior density on L, through the correlation r = L[1, 0], integrates to 1
    r = torch.linspace(-0.999, 0.999, 4001)
    L = torch.zeros(4001, 2, 2)
    L[:, 0, 0], L[:, 1, 0], L[:, 1, 1] = 1.0, r, (1 - r**2).sqrt()
    density = result.posterior.log_prob({"L": L}).exp()
    assert abs(float(torch.trapezoid(density, r)) - 1.0) < 1e-4


# ---------------------------------------------------------------- errors that name the site


def test_guide_site_the_model_lacks_is_named():
    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    def bigger():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    guide = AutoMeanFieldNormal(bigger)
    guide()
    with pytest.raises(
        ValueError, match=r"the guide has a latent site 'b' that the model does not"
    ):
        QuadratureELBO(vectorize=False).loss(model, guide)


def test_delta_latent_is_refused_as_a_point_mass():
    def model():
        z = pyro.sample("z", dist.Delta(torch.tensor(1.0)))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.0))

    with pytest.raises(
        ValueError, match=r"latent site 'z' is a Delta .* point mass.*deterministic"
    ):
        latent_sites_of_model(model)
    guide = AutoMeanFieldNormal(model)
    with pytest.raises(ValueError, match=r"latent site 'z' is a Delta"):
        QuadratureELBO().loss(model, guide)


def factor_model(data):
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    pyro.factor("penalty", -(a * data).square().sum())


def test_nan_in_a_factor_names_the_factor():
    data = torch.tensor([1.0, math.nan])
    with pytest.raises(ValueError, match=r"site 'penalty' is not finite \(nan\).*pyro.factor"):
        QuadratureELBO().loss(factor_model, AutoMeanFieldNormal(factor_model), data)
    # a guide set up on clean data, then NaN data: the point is named too
    guide = AutoMeanFieldNormal(factor_model)
    guide(torch.ones(2))
    with pytest.raises(ValueError, match=r"pyro.factor 'penalty' is NaN"):
        QuadratureELBO(vectorize=False).loss(factor_model, guide, data)
