"""The one interface from guide to ELBO to optimizer: descriptions, published moments, routing."""

from __future__ import annotations

import functools
import gc
import math
import weakref
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_value,
)

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO, opqa_evidence
from pyro_quadvi.guides import GuideDescription, MeanFieldSite, describe_guide, register_guide
from pyro_quadvi.guides.interface import published_moments
from pyro_quadvi.infer import LatentSite

DTYPE = torch.float64
DATA = torch.tensor([0.9, 0.1, 1.4, 0.6, 0.3, 1.1, 0.2, 0.8], dtype=DTYPE)


pytestmark = pytest.mark.usefixtures("fresh_param_store")


def conjugate_model():
    z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 2.0))
    with pyro.plate("data", len(DATA)):
        pyro.sample("x", dist.Normal(z, 1.0), obs=DATA)


PRECISION = 0.25 + len(DATA)  # of the exact posterior of z
POSTERIOR_MEAN = DATA.sum() / PRECISION


# ------------------------------------------------------------------- a third-party guide
def test_third_party_guide_is_fitted_by_qnvb_and_centres_opqa(load_script):
    example = load_script("examples/custom_guide.py")
    guide = example.fit(num_steps=1)
    for name, (mean, std) in example.exact_posterior().items():
        torch.testing.assert_close(guide.locs[name].detach(), mean, rtol=0, atol=1e-12)
        scale = guide.log_scales[name].detach().exp()
        torch.testing.assert_close(scale, std, rtol=1e-12, atol=0)
    result = opqa_evidence(example.model, center="guide", guide=guide)
    assert abs(result.log_evidence - example.exact_log_evidence()) < 1e-8


def test_third_party_guide_loss_equals_autonormal_at_the_same_mean_field(load_script):
    example = load_script("examples/custom_guide.py")
    guide = example.ExpScaleGuide(init_log_scale=math.log(0.3))
    loss = QuadratureELBO("gauss_hermite").loss(example.model, guide)
    start = {"w": torch.zeros(2, dtype=DTYPE), "rate": torch.tensor(1.0, dtype=DTYPE)}
    auto = AutoNormal(example.model, init_loc_fn=init_to_value(values=start), init_scale=0.3)
    reference = QuadratureELBO("gauss_hermite").loss(example.model, auto)
    assert abs(loss - reference) < 1e-12


# --------------------------------------------------------------------- published moments
def test_quadrature_elbo_publishes_the_exact_moments_and_they_match_the_gradient_identity():
    guide = AutoMeanFieldNormal(conjugate_model, init_scale=0.7)
    guide()
    loc_leaf = guide.locs.z_unconstrained
    with torch.no_grad():
        loc_leaf.fill_(0.3)
    elbo = QuadratureELBO("gauss_hermite")
    loss = elbo.differentiable_loss(conjugate_model, guide)
    loss.backward()
    moments = published_moments(loc_leaf)
    # U(z) = z^2 / 8 + sum (z - x_i)^2 / 2: E[U'] = PRECISION mu - sum x, E[U''] = PRECISION
    assert abs(moments.g.item() - (PRECISION * 0.3 - DATA.sum().item())) < 1e-12
    assert abs(moments.h.item() - PRECISION) < 1e-12
    # the gradient identity of the parameters gives the same numbers
    sigma = 0.7
    assert abs(loc_leaf.grad.item() - moments.g.item()) < 1e-12
    scale_leaf = guide.scales.z_unconstrained
    dsigma_du = torch.sigmoid(scale_leaf.detach()).item()  # softplus' derivative
    h_identity = (scale_leaf.grad.item() / dsigma_du + 1 / sigma) / sigma
    assert abs(h_identity - moments.h.item()) < 1e-12
    assert published_moments(loc_leaf) is None  # taken once


def test_published_moments_of_a_minibatch_have_the_scale_removed():
    n_units, batch = 20, 5
    data = torch.linspace(-1, 1, n_units, dtype=DTYPE)

    def model():
        g = pyro.sample("g", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))
        with pyro.plate("units", n_units, subsample_size=batch) as idx:
            z = pyro.sample("z", dist.Normal(g, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=data[idx])

    guide = AutoMeanFieldNormal(model)
    QuadratureELBO("gauss_hermite").differentiable_loss(model, guide).backward()
    moments = published_moments(guide.locs.z_unconstrained)
    # per unit: U(z) = (z - g)^2 / 2 + (z - x)^2 / (2 0.25): curvature 1 + 4, unscaled
    assert moments.g.shape == (batch,)
    torch.testing.assert_close(moments.h, torch.full((batch,), 5.0, dtype=DTYPE))
    assert moments.site.scale_factor == n_units / batch


def test_moments_of_a_changed_leaf_are_stale():
    guide = AutoMeanFieldNormal(conjugate_model)
    QuadratureELBO("gauss_hermite").differentiable_loss(conjugate_model, guide).backward()
    leaf = guide.locs.z_unconstrained
    with torch.no_grad():
        leaf.add_(1.0)
    assert published_moments(leaf) is None


# ------------------------------------------------------------------------- descriptions
def test_descriptions_of_pyros_guides_cover_the_same_latents():
    for guide in (AutoNormal(conjugate_model), AutoDiagonalNormal(conjugate_model)):
        guide()
        description = describe_guide(guide)
        assert [s.name for s in description.latent_sites] == ["z"]
        (site,) = description.sites
        assert site.family == "gaussian"
        assert {id(p) for p in site.params.values()} <= {id(p) for p in guide.parameters()}


def test_a_description_lists_its_leaves_in_layout_order_and_a_joint_gaussians():
    """`GuideDescription.leaves`, which QNVB, its guard on QNVBOptimizer and the distributed
    ELBO's parameter check read: the store's own tensors, site by site, loc before scale."""

    def model():
        pyro.sample("a", dist.Normal(torch.zeros(2, dtype=DTYPE), 1.0).to_event(1))
        pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))

    store = pyro.get_param_store()
    expected = {
        AutoMeanFieldNormal: ["locs.a", "scales.a", "locs.b", "scales.b"],
        AutoMultivariateNormal: ["loc", "scale", "scale_tril"],
    }
    for guide_class, names in expected.items():
        guide = guide_class(model)
        guide()
        leaves = describe_guide(guide).leaves()
        assert [store.param_name(t) for t in leaves] == [
            f"{guide_class.__name__}.{name}" for name in names
        ]


def test_unknown_guides_get_one_message_with_the_hook():
    with pytest.raises(TypeError, match="quadrature_description"):
        describe_guide(AutoDelta(conjugate_model))


@pytest.mark.parametrize(
    "guide_class", [AutoMeanFieldNormal, AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal]
)
def test_wrapped_guides_are_described_and_a_scale_wrapper_scales_the_entropy(guide_class):
    guide = guide_class(conjugate_model, init_scale=0.5)
    elbo = QuadratureELBO("gauss_hermite")
    plain = elbo.loss(conjugate_model, guide)
    assert elbo.loss(conjugate_model, functools.partial(guide)) == plain
    scaled = elbo.loss(conjugate_model, poutine.scale(guide, scale=2.0))
    entropy = math.log(0.5) + 0.5 * math.log(2 * math.pi * math.e)
    assert abs((scaled - plain) - (-entropy)) < 1e-12


# ------------------------------------------------------------------------------ routing
class LaplaceGuide(torch.nn.Module):
    """A hand-written Laplace guide whose parameters look like a Gaussian pair by name."""

    def forward(self):
        loc = pyro.param("my.locs.z", torch.tensor(0.0, dtype=DTYPE))
        scale = pyro.param(
            "my.scales.z", torch.tensor(0.5, dtype=DTYPE), constraint=dist.constraints.positive
        )
        pyro.sample("z", dist.Laplace(loc, scale))


def test_parameters_named_like_a_pair_are_not_paired_and_qnvb_says_it_pairs_nothing():
    qnvb = QNVB(fallback=(torch.optim.SGD, {"lr": 0.01}))
    svi = SVI(conjugate_model, LaplaceGuide(), qnvb, Trace_ELBO())
    with pytest.warns(RuntimeWarning, match="none of the 2 parameters"):
        svi.step()
    assert qnvb.get_state()["qnvb"]["pairs"] == {}
    # exactly one SGD step on each: reproduce it with plain SGD from the same seed
    moved = {name: pyro.param(name).detach().clone() for name in ("my.locs.z", "my.scales.z")}
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    SVI(conjugate_model, LaplaceGuide(), pyro.optim.SGD({"lr": 0.01}), Trace_ELBO()).step()
    for name, value in moved.items():
        assert torch.equal(pyro.param(name).detach(), value)


def scalar_description(guide, family, loc, scale, leaves, names) -> GuideDescription:
    """A guide over the one real site ``z`` of ``conjugate_model``: its scale leaf is positive
    through exp (``constraints.positive``)."""
    site = MeanFieldSite(
        name="z",
        family=family,
        loc=loc,
        scale=scale,
        params=dict(zip(("loc", "scale"), leaves)),
        param_constraints={"loc": dist.constraints.real, "scale": dist.constraints.positive},
        param_names=dict(zip(("loc", "scale"), names)),
        transform=dist.transforms.identity_transform,
        event_dim=0,
    )
    latent = [LatentSite("z", torch.Size(), 0, dist.transforms.identity_transform)]
    return GuideDescription(guide, latent, sites=[site])


class FamilyGuide(torch.nn.Module):
    """A guide that declares a family QNVB has no update for."""

    def __init__(self):
        super().__init__()
        self.loc = torch.nn.Parameter(torch.tensor(0.0, dtype=DTYPE))
        self.scale = torch.nn.Parameter(torch.tensor(0.0, dtype=DTYPE))

    def forward(self):
        pyro.module("family_guide", self)
        pyro.sample("z", dist.Normal(self.loc, self.scale.exp()))

    def quadrature_description(self, trace=None) -> GuideDescription:
        return scalar_description(
            "FamilyGuide",
            "student_t",
            self.loc,
            self.scale.exp(),
            (self.loc, self.scale),
            ("family_guide$$$loc", "family_guide$$$scale"),
        )


class StoreGuide(torch.nn.Module):
    """A described module guide holding no parameters of its own: its pyro.param sites live in
    the param store (QNVB describes it though ``parameters()`` is empty)."""

    def forward(self):
        pyro.sample("z", dist.Normal(*self._pair()))

    def _pair(self):
        loc = pyro.param("store.loc", torch.tensor(0.0, dtype=DTYPE))
        scale = pyro.param(
            "store.scale", torch.tensor(1.0, dtype=DTYPE), constraint=dist.constraints.positive
        )
        return loc, scale

    def quadrature_description(self, trace=None) -> GuideDescription:
        loc, scale = self._pair()
        leaves = (loc.unconstrained(), scale.unconstrained())
        return scalar_description("StoreGuide", "gaussian", loc, scale, leaves, ("loc", "scale"))


def test_a_module_guide_of_store_parameters_is_paired_under_trace_elbo():
    qnvb = QNVB()
    svi = SVI(conjugate_model, StoreGuide(), qnvb, Trace_ELBO())
    svi.step()
    assert set(qnvb.get_state()["qnvb"]["pairs"]) == {"loc"}
    assert qnvb.get_state()["fallback"] == {}


def test_a_family_without_an_update_goes_to_the_fallback_with_a_warning():
    qnvb = QNVB()
    svi = SVI(conjugate_model, FamilyGuide(), qnvb, Trace_ELBO())
    with pytest.warns(RuntimeWarning, match="family 'student_t'"):
        svi.step()
    assert qnvb.get_state()["qnvb"]["pairs"] == {}
    assert set(qnvb.get_state()["fallback"]) == {"family_guide$$$loc", "family_guide$$$scale"}


def test_module_local_params_are_paired_by_identity():
    # issue 10, fault 12: under module_local_params nothing has a param-store name
    with pyro.settings.context(module_local_params=True):
        guide = AutoMeanFieldNormal(conjugate_model)
        svi = SVI(conjugate_model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
        svi.step()
        loc = guide.locs.z_unconstrained.detach()
        scale = torch.nn.functional.softplus(guide.scales.z_unconstrained.detach())
    assert abs(loc.item() - POSTERIOR_MEAN.item()) < 1e-12
    assert abs(scale.item() - PRECISION**-0.5) < 1e-12


def test_qnvb_does_not_step_on_moments_its_gradients_contradict():
    # the loss leaves zero gradients on the parameters but publishes g and h: QNVB steps on the
    # gradients it was handed (g = 0, h = 1 / sigma^2: nothing moves), with a warning naming
    # the site; it used to land on the posterior of the moments (the loss/N tests of
    # test_user_fixes_s27_moments.py show that it reads the moments where they agree)
    elbo = QuadratureELBO("gauss_hermite")

    def loss_without_parameter_gradients(model, guide):
        loss = elbo.differentiable_loss(model, guide)
        loss.backward()
        for p in guide.parameters():
            p.grad = torch.zeros_like(p)
        return loss.detach()

    guide = AutoMeanFieldNormal(conjugate_model)
    with pytest.warns(RuntimeWarning, match="the gradients of site 'z' are not those of the loss"):
        SVI(conjugate_model, guide, QNVB(), loss_without_parameter_gradients).step()
    assert pyro.param("AutoMeanFieldNormal.locs.z").item() == 0.0
    assert pyro.param("AutoMeanFieldNormal.scales.z").item() == pytest.approx(0.1, rel=1e-12)


def test_moments_of_two_terms_of_one_loss_add_up():
    second = torch.tensor([0.5, 0.8, 0.6], dtype=DTYPE)  # the mean stays within lr = 1 of 0

    def model(data):
        z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 2.0))
        with pyro.plate("data", len(data)):
            pyro.sample("x", dist.Normal(z, 1.0), obs=data)

    elbo = QuadratureELBO("gauss_hermite")

    def two_terms(model, guide):
        return elbo.differentiable_loss(model, guide, DATA) + elbo.differentiable_loss(
            model, guide, second
        )

    guide = AutoMeanFieldNormal(model)
    guide(DATA)
    SVI(model, guide, QNVB(), two_terms).step()
    # U = U_1 + U_2: the prior twice, both data sets; the mean is its minimizer
    expected = (DATA.sum() + second.sum()) / (2 * 0.25 + len(DATA) + len(second))
    assert abs(pyro.param("AutoMeanFieldNormal.locs.z").item() - expected.item()) < 1e-12


def test_moments_nobody_takes_do_not_keep_the_parameters_alive():
    guide = AutoMeanFieldNormal(conjugate_model)
    svi = SVI(conjugate_model, guide, pyro.optim.Adam({"lr": 0.01}), QuadratureELBO())
    svi.step()
    leaf = weakref.ref(guide.locs.z_unconstrained)
    del svi, guide
    pyro.clear_param_store()
    gc.collect()
    assert leaf() is None


class DetachedScaleGuide(torch.nn.Module):
    """A Gaussian guide whose scale is detached in its own run: only the loc gets a gradient."""

    def __init__(self):
        super().__init__()
        self.loc = torch.nn.Parameter(torch.tensor(0.0, dtype=DTYPE))
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(0.5), dtype=DTYPE))

    def forward(self):
        pyro.module("detached", self)
        pyro.sample("z", dist.Normal(self.loc, self.log_scale.exp().detach()))

    def quadrature_description(self, trace=None) -> GuideDescription:
        return scalar_description(
            "DetachedScaleGuide",
            "gaussian",
            self.loc,
            self.log_scale.exp(),
            (self.loc, self.log_scale),
            ("detached$$$loc", "detached$$$log_scale"),
        )


def test_a_block_with_only_one_gradient_goes_to_the_fallback_with_a_warning():
    guide = DetachedScaleGuide()
    svi = SVI(conjugate_model, guide, QNVB(), Trace_ELBO())
    with pytest.warns(RuntimeWarning, match="gradient on only one of its loc and scale"):
        svi.step()
    # the fallback (Adam, lr 0.01) moved the loc by one Adam step; QNVB would have moved it far
    assert abs(abs(guide.loc.item()) - 0.01) < 1e-6


class CallableGuide:
    """A guide that is a plain callable object (no nn.Module): QNVB knows it once registered."""

    def __call__(self):
        loc = pyro.param("cg.loc", torch.tensor(0.0, dtype=DTYPE))
        scale = pyro.param(
            "cg.scale", torch.tensor(0.5, dtype=DTYPE), constraint=dist.constraints.positive
        )
        pyro.sample("z", dist.Normal(loc, scale))

    def quadrature_description(self, trace=None) -> GuideDescription:
        loc, scale = pyro.param("cg.loc"), pyro.param("cg.scale")
        leaves = (loc.unconstrained(), scale.unconstrained())
        return scalar_description(
            "CallableGuide", "gaussian", loc, scale, leaves, ("cg.loc", "cg.scale")
        )


def test_a_registered_callable_guide_is_paired_and_an_unregistered_one_is_not():
    qnvb = QNVB()
    with pytest.warns(RuntimeWarning, match="none of the 2 parameters"):
        SVI(conjugate_model, CallableGuide(), qnvb, Trace_ELBO()).step()
    assert qnvb.get_state()["qnvb"]["pairs"] == {}
    pyro.clear_param_store()
    guide = CallableGuide()
    register_guide(guide)
    qnvb = QNVB()
    SVI(conjugate_model, guide, qnvb, Trace_ELBO()).step()
    assert set(qnvb.get_state()["qnvb"]["pairs"]) == {"cg.loc"}


def test_the_guides_page_shows_what_the_example_prints(load_script, capsys):
    # docs/guides.md shows the script's output below its command; the full float reprs it once
    # showed differed in the last digits from machine to machine
    load_script("examples/custom_guide.py").main()
    printed = capsys.readouterr().out
    page = (Path(__file__).resolve().parent.parent / "docs" / "guides.md").read_text()
    shown = page.split("python examples/custom_guide.py\n```\n\n```\n", 1)[1].split("```", 1)[0]
    assert printed == shown
