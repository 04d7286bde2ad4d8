"""Session 14 user trials: reproducibility given a seed.

``opqa_evidence`` does not depend on torch's random state, but the model's runs that find its
latent sites drew from the prior: a call between the steps of a fit with a random rule moved
the fit (by up to 2.3 in the loss over 10 steps in the trial).
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, opqa_evidence, to_inference_data
from pyro_quadvi.export import draws
from pyro_quadvi.optim import QNVBOptimizer, module_loss
from pyro_quadvi.testing.evidence_models import normal_normal, normal_normal_log_evidence

Y = torch.tensor([0.3, -1.2, 2.1, 0.8, 1.5], dtype=torch.float64)
X0 = torch.tensor(0.7, dtype=torch.float64)  # the opqa paper's example (Section 5.1)


def test_opqa_evidence_leaves_the_random_state(fresh_param_store):
    pyro.set_rng_seed(3)
    before = torch.get_rng_state()
    result = opqa_evidence(normal_normal, X0, num_points=4, progress=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert abs(result.log_evidence - normal_normal_log_evidence(0.7)) < 1e-9


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


def _wide_model(dim: int):
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(dim, dtype=torch.float64), 1.0).to_event(1))

    return model


def test_opqa_evidence_refuses_a_million_latents_by_name(fresh_param_store):
    # 8^1000000 has more digits than Python will write: the refusal said nothing about the model
    with pytest.raises(
        ValueError, match=r"8\^1000000 log-joint.*even num_points=2.*QuadratureELBO"
    ):
        opqa_evidence(_wide_model(10**6), progress=False)


def test_opqa_evidence_names_the_largest_num_points_that_fits(fresh_param_store):
    # 8^14 = 2^42 nodes; 2^14 = 16384 fit under max_nodes = 2^20, 3^14 = 4782969 do not
    with pytest.raises(ValueError, match=r"8\^14 = 4398046511104 .* num_points <= 2 or raise"):
        opqa_evidence(_wide_model(14), progress=False)
    # 3^20 > 3^20 - 1: the root 3^20^(1/20) rounds to 3 and advised a grid over the limit
    with pytest.raises(ValueError, match=r"num_points <= 2 or raise"):
        opqa_evidence(_wide_model(20), progress=False, max_nodes=3**20 - 1)
    # 30 latents: not even 2 points fit, and 1 point is no grid to advise silently
    with pytest.raises(ValueError, match=r"even num_points=2 needs 2\^30 nodes"):
        opqa_evidence(_wide_model(30), progress=False)


X = torch.randn(100, 10, generator=torch.Generator().manual_seed(0))


def regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(10), 1.0).to_event(1))
    pyro.deterministic("f", (x * w.unsqueeze(-2)).sum(-1), event_dim=1)
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal((x * w.unsqueeze(-2)).sum(-1), 1.0), obs=y)


# a draw holds w (10) and f (100) in the posterior and again in the prior, y (100) in both
# predictive groups, all float32, and y's pointwise log likelihood (100) in float64
BYTES_PER_DRAW = 2 * (10 + 100) * 4 + 2 * 100 * 4 + 100 * 8


def test_export_size_is_what_the_groups_hold(fresh_param_store):
    guide = AutoMeanFieldNormal(regression)
    guide(X, X[:, 0])
    idata = to_inference_data(regression, guide, X, X[:, 0], num_samples=7, vectorize=False)
    groups = ["posterior", "posterior_predictive", "log_likelihood", "prior", "prior_predictive"]
    held = sum(v.values.nbytes for g in groups for v in getattr(idata, g).data_vars.values())
    assert held == 7 * BYTES_PER_DRAW
    # exactly at the limit it runs; one byte under, it is refused before any draw; without the
    # prior groups a draw holds w, f, y and y's log likelihood once: 110 * 4 + 100 * 4 + 100 * 8
    to_inference_data(regression, guide, X, X[:, 0], num_samples=7, max_bytes=held, vectorize=False)
    expected = r"need 17360 bytes .* pass num_samples <= 6, or prior=False \(1640 bytes "
    with pytest.raises(ValueError, match=expected):
        to_inference_data(regression, guide, X, X[:, 0], num_samples=7, max_bytes=held - 1)


def test_export_is_checked_against_the_memory_available_by_default(fresh_param_store, monkeypatch):
    guide = AutoMeanFieldNormal(regression)
    guide(X, X[:, 0])
    monkeypatch.setattr(draws, "available_memory", lambda: 5 * BYTES_PER_DRAW)
    with pytest.raises(ValueError, match=r"more than the memory available now .* max_bytes=\.\.\."):
        to_inference_data(regression, guide, X, X[:, 0], num_samples=7)
    monkeypatch.setattr(draws, "available_memory", lambda: None)  # the platform does not say
    idata = to_inference_data(regression, guide, X, X[:, 0], num_samples=7, vectorize=False)
    assert idata.posterior["w"].shape == (1, 7, 10)


def test_export_of_a_million_latents_is_refused_by_size(fresh_param_store):
    # 1000 draws of 10^6 float32 latents, twice (posterior, prior): 8 GB, over 4 GiB; torch's
    # "can't allocate" came after Pyro printed its trace shapes
    def wide():
        pyro.sample("w", dist.Normal(torch.zeros(10**6), 1.0).to_event(1))

    guide = AutoMeanFieldNormal(wide)
    guide()
    with pytest.raises(ValueError, match=r"8000000000 bytes .* num_samples <= 536, or prior=False"):
        to_inference_data(wide, guide, max_bytes=2**32)


class _Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(2, 3, batch_first=True)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def test_the_fallback_warning_does_not_advise_the_setting_in_use():
    # under vectorize=None the reason a GRU falls back to the loop advised "vectorize=None to try
    # the pass and fall back": what the run was already doing
    torch.manual_seed(0)
    net = _Recurrent()
    x, y = torch.randn(4, 5, 2), torch.randint(0, 2, (4,))
    optimizer = QNVBOptimizer(net.named_parameters(), likelihood_weight=10)
    with pytest.warns(UserWarning) as record:
        optimizer.step(loss_fn=module_loss(net, F.cross_entropy), batch=(x, y))
    (message,) = [str(w.message) for w in record if "QNVBOptimizer" in str(w.message)]
    assert "aten::gru.input" in message
    assert "vectorize=None" not in message
    assert "vectorize=False" in message  # the fallback's own way out
    assert optimizer.num_steps == 1


def _normal_mean(y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(w, 1.0), obs=y)


def test_a_diverged_fit_is_named_as_such(fresh_param_store):
    # a SparseQNVB fit whose locs reached 1e127 was told to check the model's support
    y = torch.tensor([0.3, -1.2, 2.1])
    guide = AutoMeanFieldNormal(_normal_mean)
    guide(y)
    with torch.no_grad():
        guide.locs.w.fill_(1e20)  # (1e20)^2 overflows float32: the log density is -inf
    diverged = r"is 1e\+20 in the unconstrained .* likely diverged.* SparseQNVB's tau_max"
    with pytest.raises(ValueError, match=diverged):
        QuadratureELBO().loss(_normal_mean, guide, y)
    with torch.no_grad():
        guide.locs.w.fill_(1e9)  # finite, and below the threshold: the support advice stands
    assert math.isfinite(QuadratureELBO().loss(_normal_mean, guide, y))
