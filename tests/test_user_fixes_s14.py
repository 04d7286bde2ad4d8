"""Session 14 user trials: reproducibility given a seed.

``opqa_evidence`` does not depend on torch's random state, but the model's runs that find its
latent sites drew from the prior: a call between the steps of a fit with a random rule moved
the fit (by up to 2.3 in the loss over 10 steps in the trial).
"""

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, opqa_evidence

Y = torch.tensor([0.3, -1.2, 2.1, 0.8, 1.5], dtype=torch.float64)
N = len(Y)


def model(y):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


# mu ~ N(0, 1), y_i ~ N(mu, 1): the evidence is N(y | 0, I + 1 1^T), whose determinant is n + 1
# and whose inverse is I - 1 1^T / (n + 1)
EXACT_LOG_EVIDENCE = -0.5 * (
    N * math.log(2 * math.pi) + math.log(N + 1) + float(Y @ Y) - float(Y.sum()) ** 2 / (N + 1)
)


def test_opqa_evidence_leaves_the_random_state(fresh_param_store):
    pyro.set_rng_seed(3)
    before = torch.get_rng_state()
    result = opqa_evidence(model, Y, num_points=4, progress=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert abs(result.log_evidence - EXACT_LOG_EVIDENCE) < 1e-9


def two_latent_model(y):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 1.0))
    noise = pyro.sample("noise", dist.LogNormal(torch.tensor(0.0, dtype=y.dtype), 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, noise), obs=y)


def _fit(with_evidence: bool) -> list[float]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(two_latent_model)
    svi = SVI(two_latent_model, guide, QNVB(), QuadratureELBO(rule="rasp_simplex"))
    losses = []
    for step in range(6):
        losses.append(svi.step(Y))
        if with_evidence and step == 2:
            opqa_evidence(two_latent_model, Y, num_points=4, progress=False)
    return losses


def test_opqa_evidence_between_steps_leaves_a_random_rule_fit(fresh_param_store):
    assert _fit(with_evidence=True) == _fit(with_evidence=False)
