"""Session 25: a ``poutine.mask`` around the guide (trial t8).

``QuadratureELBO`` ignored it: ``mask=False`` gave the unmasked loss, where Pyro's ELBOs drop the
guide's log density (its entropy, and a constrained site's log-Jacobian) for masked entries. The
ELBO now masks them as Pyro's ``scale_and_mask`` does, a tensor mask broadcast over the site's
batch shape; QNVB, whose update holds the scale up as the entropy would, refuses such a site.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoMultivariateNormal, AutoNormal
from torch.distributions import transform_to

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.infer import GumbelSpikeSlabELBO

Y = torch.tensor([0.5, 1.7, -0.3], dtype=torch.float64)
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def linear_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("d", 3):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(z, 1.0), obs=y)


def expected_log_joint(m: torch.Tensor, cov: torch.Tensor) -> float:
    """``E_q[log p]`` of `linear_model` under ``q = N(m, cov)`` over ``(mu, z_0, z_1, z_2)``:
    each factor is ``N(a.x + b; 0, 1)``, so its expectation is
    ``-log(2 pi) / 2 - ((a.m + b)^2 + a' cov a) / 2``."""
    rows, offsets = [[1.0, 0, 0, 0]], [0.0]
    for i in range(3):
        a = [0.0] * 4
        a[0], a[i + 1] = -1.0, 1.0  # z_i - mu
        rows.append(a)
        offsets.append(0.0)
        a = [0.0] * 4
        a[i + 1] = 1.0  # z_i - y_i
        rows.append(a)
        offsets.append(-float(Y[i]))
    A = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(offsets, dtype=torch.float64)
    mean = A @ m + b
    return float(-HALF_LOG_2PI * len(rows) - 0.5 * (mean**2 + ((A @ cov) * A).sum(-1)).sum())


def normal_entropy(sd: torch.Tensor) -> torch.Tensor:
    return 0.5 * math.log(2 * math.pi * math.e) + sd.log()


def spread_mean_field(guide) -> tuple[torch.Tensor, torch.Tensor]:
    """Give the guide's sites distinct locs and scales; return them, flat ``(mu, z)``."""
    sites = {s.name: s for s in guide.mean_field_sites()}
    values = {"mu": (0.3, 0.5), "z": ([0.2, 0.9, -0.1], [0.3, 0.6, 0.8])}
    for name, (loc, sd) in values.items():
        site = sites[name]
        site.params["loc"].data.copy_(torch.tensor(loc))
        to_leaf = transform_to(site.param_constraints["scale"]).inv
        site.params["scale"].data.copy_(to_leaf(torch.tensor(sd, dtype=torch.float64)))
    loc = torch.tensor([0.3, 0.2, 0.9, -0.1], dtype=torch.float64)
    sd = torch.tensor([0.5, 0.3, 0.6, 0.8], dtype=torch.float64)
    return loc, sd


@pytest.fixture
def mean_field():
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(linear_model)
    guide(Y)
    loc, sd = spread_mean_field(guide)
    yield guide, loc, sd
    pyro.clear_param_store()


def test_masked_mean_field_guide_drops_its_entropy(mean_field):
    guide, loc, sd = mean_field
    elbo = QuadratureELBO("gauss_hermite", num_points=3)
    cross = -expected_log_joint(loc, torch.diag(sd**2))
    entropy = normal_entropy(sd)
    plain = elbo.loss(linear_model, guide, Y)  # (float32 parameters)
    assert plain == pytest.approx(cross - float(entropy.sum()), abs=1e-5)
    # mask=False: no entropy at all (the trial's 11.632 stayed: it should be 8.098 there)
    masked = elbo.loss(linear_model, poutine.mask(guide, mask=False), Y)
    assert masked == pytest.approx(cross, abs=1e-5)
    # a mask over the plate's rows drops z_1's entropy; mu's, which it broadcasts, counts twice
    # (Pyro's scale_and_mask on mu's scalar log density, summed)
    rows = poutine.mask(guide, mask=torch.tensor([True, False, True]))
    expected = cross - float(2 * entropy[0] + entropy[1] + entropy[3])  # entropy[2]: z_1's
    assert elbo.loss(linear_model, rows, Y) == pytest.approx(expected, abs=1e-5)


def test_masked_guide_matches_trace_elbo(mean_field):
    guide, _, _ = mean_field
    masked = poutine.mask(guide, mask=torch.tensor([True, False, True]))
    pyro.set_rng_seed(0)
    mc = Trace_ELBO(num_particles=20000, vectorize_particles=True, max_plate_nesting=1)
    reference = mc.loss(linear_model, masked, Y)
    quad = QuadratureELBO("gauss_hermite", num_points=3).loss(linear_model, masked, Y)
    assert quad == pytest.approx(reference, abs=0.05)  # the sd of 20,000 draws is about 0.01


def test_masked_guide_drops_a_constrained_sites_jacobian():
    """A positive site's guide density holds the log-Jacobian of ``exp``: masked with it."""

    def model():
        pyro.sample("s", dist.HalfNormal(1.0))

    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model)
    guide()
    (site,) = guide.mean_field_sites()
    site.params["loc"].data.fill_(0.3)
    to_leaf = transform_to(site.param_constraints["scale"]).inv
    site.params["scale"].data.copy_(to_leaf(torch.tensor(0.4)))
    m, s = 0.3, 0.4
    # -E[log HalfNormal(exp(u))], u ~ N(m, s^2): E[exp(2u)] = exp(2m + 2s^2)
    cross = -(math.log(2.0) - HALF_LOG_2PI - 0.5 * math.exp(2 * m + 2 * s * s))
    elbo = QuadratureELBO("gauss_hermite", num_points=20)
    assert elbo.loss(model, poutine.mask(guide, mask=False)) == pytest.approx(cross, abs=1e-5)
    pyro.clear_param_store()


@pytest.mark.parametrize("cls", [AutoDiagonalNormal, AutoMultivariateNormal])
def test_masked_joint_guides_drop_their_entropy(cls):
    pyro.clear_param_store()
    guide = cls(linear_model)
    guide(Y)
    posterior = guide.get_posterior()
    if cls is AutoDiagonalNormal:
        cov = torch.diag(posterior.variance)
    else:
        cov = posterior.covariance_matrix
    cross = -expected_log_joint(posterior.mean.detach().double(), cov.detach().double())
    elbo = QuadratureELBO("gauss_hermite", num_points=3)
    masked = elbo.loss(linear_model, poutine.mask(guide, mask=False), Y)
    assert masked == pytest.approx(cross, abs=1e-5)
    pyro.clear_param_store()


def spike_model(y):
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))  # a Gaussian factor in AutoSpikeSlab
    with pyro.plate("d", 3):
        w = pyro.sample("w", SpikeSlab(torch.tensor(0.3), torch.tensor(1.0)))
        pyro.sample("y", dist.Normal(w, sigma), obs=y)


@pytest.mark.parametrize("elbo", ["quadrature", "gumbel"])
def test_masked_spike_slab_guide_drops_its_entropy(elbo):
    pyro.clear_param_store()
    guide = AutoSpikeSlab(spike_model)
    guide(Y)
    sites = guide.quadrature_description().sites
    entropy = float(sum(site.entropy() for site in sites))
    # sigma's log-Jacobian is u (exp): E_q[u] is its loc
    jacobian = float(next(site.loc for site in sites if site.name == "sigma"))
    if elbo == "quadrature":
        loss, tolerance = QuadratureELBO("gauss_hermite", num_points=3), 1e-5
    else:  # E_q[u] from 4,000 draws of sd 0.1
        loss, tolerance = GumbelSpikeSlabELBO(num_particles=4000), 0.01
    pyro.set_rng_seed(1)
    plain = loss.loss(spike_model, guide, Y)
    pyro.set_rng_seed(1)
    masked = loss.loss(spike_model, poutine.mask(guide, mask=False), Y)
    # Pyro drops log q = log N(u) - log|J|: the loss rises by the entropy and E_q[log|J|]
    assert masked == pytest.approx(plain + entropy + jacobian, abs=tolerance)
    pyro.clear_param_store()


@pytest.mark.parametrize(
    "elbo, mask", [(QuadratureELBO, torch.tensor([True, False, True])), (Trace_ELBO, False)]
)
def test_qnvb_refuses_a_masked_guide_site(mean_field, elbo, mask):
    """QuadratureELBO publishes the traced site; with Pyro's ELBO QNVB reads the guide's record
    of its last run. (Pyro's Trace_ELBO refuses a tensor mask wider than mu's scalar density.)"""
    guide, _, _ = mean_field
    before = [p.detach().clone() for p in guide.parameters()]
    svi = SVI(linear_model, poutine.mask(guide, mask=mask), QNVB(), elbo())
    with pytest.raises(
        ValueError, match=r"site 'mu' runs under a poutine\.mask.*poutine\.mask\(model"
    ):
        svi.step(Y)
    assert all(torch.equal(p, q) for p, q in zip(guide.parameters(), before, strict=True))


@pytest.mark.parametrize(
    "cls, site", [(AutoNormal, "mu"), (AutoDiagonalNormal, "_AutoDiagonalNormal_latent")]
)
def test_qnvb_refuses_a_masked_adapter_guide_under_pyros_elbo(cls, site):
    """Without a trace (Pyro's ELBOs) an adapter-described guide's blocks take the mask of the
    handlers around its last run, as they take its scale: QNVB updated these guides silently."""
    pyro.clear_param_store()
    guide = cls(linear_model)
    guide(Y)
    before = [p.detach().clone() for p in guide.parameters()]
    svi = SVI(linear_model, poutine.mask(guide, mask=False), QNVB(), Trace_ELBO())
    with pytest.raises(ValueError, match=rf"site '{site}' runs under a poutine\.mask"):
        svi.step(Y)
    assert all(torch.equal(p, q) for p, q in zip(guide.parameters(), before, strict=True))
    unmasked = SVI(linear_model, poutine.mask(guide, mask=True), QNVB(), Trace_ELBO())
    assert math.isfinite(unmasked.step(Y))  # a later run without a mask steps again
    pyro.clear_param_store()


def test_qnvb_takes_a_mask_that_masks_nothing(mean_field):
    guide, _, _ = mean_field
    svi = SVI(
        linear_model,
        poutine.mask(guide, mask=torch.ones(3, dtype=torch.bool)),
        QNVB(),
        QuadratureELBO(),
    )
    assert math.isfinite(svi.step(Y))
