"""QNVB under ``poutine.scale`` on model and guide with Pyro's Monte Carlo ELBO, for the guides
described without a trace (Pyro's ``AutoNormal`` and ``AutoDiagonalNormal``): the gradients carry
the scale, which QNVB must divide out (rasp paper, eq. 7-8, ``s`` the site's scale). It used to
read them with ``s = 1``: ``h`` was ``s h - (s - 1) / sigma^2``, and at ``s = 1/8`` the sds came
out 96% off the mean field's with no warning."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoNormal

from pyro_quadvi import QNVB
from pyro_quadvi.guides import describe_guide
from pyro_quadvi.guides.adapters import scale_factor
from pyro_quadvi.guides.interface import run_scale

# the eight-schools model with a known tau: a Gaussian posterior over (mu, theta), so the
# mean field's optimum is in closed form (exact means, sds 1 / sqrt(diagonal of the precision))
Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]
TAU, PRIOR_SD = 5.0, 10.0


def _schools():
    mu = pyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    with pyro.plate("schools", len(Y)):
        theta = pyro.sample("theta", dist.Normal(mu, TAU))
        pyro.sample("obs", dist.Normal(theta, torch.tensor(SIGMA)), obs=torch.tensor(Y))


def _mean_field_optimum() -> tuple[torch.Tensor, torch.Tensor]:
    """Means and sds of the mean field's optimum over ``(mu, theta_1..8)``, by hand."""
    n = len(Y)
    sigma, y = torch.tensor(SIGMA), torch.tensor(Y)
    precision = torch.zeros(n + 1, n + 1)
    precision[0, 0] = 1 / PRIOR_SD**2 + n / TAU**2
    precision[0, 1:] = precision[1:, 0] = -1 / TAU**2
    precision[1:, 1:] = torch.diag(1 / TAU**2 + 1 / sigma**2)
    shift = torch.cat([torch.zeros(1), y / sigma**2])
    return torch.linalg.solve(precision, shift), precision.diag().rsqrt()


def _moments(guide) -> tuple[torch.Tensor, torch.Tensor]:
    """The guide's means and sds over ``(mu, theta)``, flat."""
    if isinstance(guide, AutoDiagonalNormal):
        return guide.loc.detach().clone(), guide.scale.detach().clone()
    locs = torch.cat([guide.locs.mu.detach().reshape(1), guide.locs.theta.detach()])
    scales = torch.cat([guide.scales.mu.detach().reshape(1), guide.scales.theta.detach()])
    return locs, scales


def _fit(guide_class, scale: float | None, steps: int = 300):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = guide_class(_schools)
    model = _schools if scale is None else poutine.scale(_schools, scale=scale)
    scaled_guide = guide if scale is None else poutine.scale(guide, scale=scale)
    elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(model, scaled_guide, QNVB(), elbo)
    for _ in range(steps):
        svi.step()
    return _moments(guide)


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
def test_scaled_fit_is_the_unscaled_fit_bit_for_bit(float64_store, guide_class):
    # 1/8 is a power of two: every gradient is exactly 1/8 of the unscaled one, and dividing the
    # scale out is exact, so the two fits agree to the last bit
    loc, sd = _fit(guide_class, None)
    scaled_loc, scaled_sd = _fit(guide_class, 1 / 8)
    assert torch.equal(scaled_loc, loc)
    assert torch.equal(scaled_sd, sd)
    # and the fit is the mean field's optimum: the sds within 5% (read with s = 1: 96% off), the
    # means within the wander of the last iterate of an 8-particle Monte Carlo gradient (up to
    # 1.7 sds here, along the direction mu and the thetas share; read with s = 1: 3.7 sds)
    exact_loc, exact_sd = _mean_field_optimum()
    assert ((scaled_sd - exact_sd) / exact_sd).abs().max() < 0.05
    assert ((scaled_loc - exact_loc) / exact_sd).abs().max() < 2.5


def test_a_scale_that_is_not_a_power_of_two_agrees_to_rounding(float64_store):
    # 0.3 * g / 0.3 differs from g by an ulp or so: the fits agree to rounding, not bit for bit
    loc, sd = _fit(AutoNormal, None, steps=50)
    scaled_loc, scaled_sd = _fit(AutoNormal, 0.3, steps=50)
    torch.testing.assert_close(scaled_loc, loc, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(scaled_sd, sd, rtol=1e-9, atol=1e-9)


def test_descriptions_take_the_scale_of_the_handlers_around_the_last_run(float64_store):
    normal, diagonal = AutoNormal(_schools), AutoDiagonalNormal(_schools)
    QNVB()  # installs the hook that watches the guides run
    with poutine.scale(scale=0.5):
        poutine.scale(normal, scale=0.25)()
        poutine.scale(diagonal, scale=torch.tensor(0.125))()
    assert [s.scale_factor for s in describe_guide(normal).sites] == [0.125, 0.125]
    assert describe_guide(diagonal).sites[0].scale_factor == 0.0625
    # the guide's own subsampled plates are not in it (QNVB refuses those for AutoNormal)
    subsampled = AutoNormal(
        _schools, create_plates=lambda: pyro.plate("schools", len(Y), subsample_size=2)
    )
    poutine.scale(subsampled, scale=0.5)()
    assert run_scale(subsampled) == 0.5
    # a run without autograd (Predictive, SVI.evaluate_loss) makes no gradients: not recorded
    Predictive(_schools, guide=normal, num_samples=2)()
    assert run_scale(normal) == 0.125


def test_parts_of_a_guide_each_have_their_own_scale(float64_store):
    globals_part = AutoNormal(poutine.block(_schools, expose=["mu"]))
    locals_part = AutoNormal(poutine.block(_schools, hide=["mu"]))

    def guide():
        globals_part()
        with poutine.scale(scale=0.5):
            locals_part()

    QNVB()
    guide()
    assert [s.scale_factor for s in describe_guide(globals_part).sites] == [1.0]
    assert [s.scale_factor for s in describe_guide(locals_part).sites] == [0.5]
    # an AutoGuideList's parts run inside it, under the handlers around it
    parts = AutoGuideList(_schools)
    parts.append(AutoNormal(poutine.block(_schools, expose=["mu"])))
    parts.append(AutoDiagonalNormal(poutine.block(_schools, hide=["mu"])))
    poutine.scale(parts, scale=0.25)()
    assert describe_guide(parts[0]).sites[0].scale_factor == 0.25
    assert describe_guide(parts[1]).sites[0].scale_factor == 0.25


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
def test_steps_at_different_scales_and_a_monitoring_loss_between_them(float64_store, guide_class):
    """Each step at its own scale (0.5, then 0.25, as a ragged last minibatch scaled by N / B
    would be), and Pyro's ``Trace_ELBO.loss`` of the unscaled model between steps (it runs the
    guide with gradients on): the last run before each update is the loss's own, whose scale is
    read, so the fit equals the same steps and monitoring unscaled, bit for bit. (A first version
    refused every step after the first change of scale.)"""

    def fit(scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = guide_class(_schools)
        elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
        qnvb = QNVB()
        for step in range(40):
            scale = (0.5, 0.25)[step % 2] if scaled else None
            model = _schools if scale is None else poutine.scale(_schools, scale=scale)
            run = guide if scale is None else poutine.scale(guide, scale=scale)
            SVI(model, run, qnvb, elbo).step()
            Trace_ELBO().loss(_schools, guide)  # monitoring, unscaled, gradients on
        return _moments(guide)

    scaled, plain = fit(True), fit(False)
    assert torch.equal(scaled[0], plain[0]) and torch.equal(scaled[1], plain[1])
    assert (plain[1] - 0.1).abs().min() > 1.0  # the sds moved from their start, 0.1


def _local_schools():
    with pyro.plate("schools", len(Y)):
        theta = pyro.sample("theta", dist.Normal(0.0, TAU))
        pyro.sample("obs", dist.Normal(theta, torch.tensor(SIGMA)), obs=torch.tensor(Y))


def test_a_scale_by_a_tensor_of_several_elements_is_refused(float64_store):
    guide = AutoNormal(_local_schools)
    weights = torch.linspace(0.5, 1.0, len(Y))  # a weight per school: no one number
    elbo = Trace_ELBO(max_plate_nesting=1)
    scaled = poutine.scale(_local_schools, scale=weights)
    svi = SVI(scaled, poutine.scale(guide, scale=weights), QNVB(), elbo)
    with pytest.raises(ValueError, match=r"AutoNormal 'AutoNormal'.*tensor of shape \(8,\)"):
        svi.step()
    # a traced site with such a scale (what QuadratureELBO describes) is refused by its name
    trace = poutine.trace(poutine.scale(guide, scale=weights)).get_trace()
    with pytest.raises(ValueError, match=r"site 'theta_unconstrained'.*shape \(8,\)"):
        scale_factor(trace.nodes["theta_unconstrained"])


def test_a_site_hint_that_is_not_a_dict_is_refused_naming_the_site(float64_store):
    # infer={"qnvb": "lr=0.1"} raised "dictionary update sequence element #0 has length 1"
    def model():
        pyro.sample("w", dist.Normal(0.0, 1.0), infer={"qnvb": "lr=0.1"})

    guide = AutoNormal(model)
    guide()
    with pytest.raises(TypeError, match=r"^site 'w' has infer=\{'qnvb': 'lr=0.1'\}: QNVB's"):
        describe_guide(guide)
    diagonal = AutoDiagonalNormal(model)
    diagonal()
    with pytest.raises(TypeError, match=r"^site 'w' has infer="):
        describe_guide(diagonal)
