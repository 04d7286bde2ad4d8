"""A hand-written guide's description is checked against itself and against its run (t25).

The fixture: a correlated 2-d Bayesian regression (noise 0.5) and a LogNormal rate, described by
a mean-field guide of softplus scales; the exact ELBO at any guide is closed-form (`elbo_closed`).
"""

import copy
import gc
import math
import pickle
import types
import weakref

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer import SVI
from pyro.nn import PyroModule
from torch import nn
from torch.distributions import biject_to

from pyro_quadvi.guides import (
    AutoMeanFieldNormal,
    GuideDescription,
    MeanFieldSite,
    describe_guide,
    interface,
)
from pyro_quadvi.infer import LatentSite, QuadratureELBO

D = torch.float64
X = torch.tensor([[1.0, 0.5], [0.3, 1.0], [1.0, -0.7], [0.2, 1.0], [0.8, 0.9]], dtype=D)
Y = torch.tensor([0.9, -0.4, 1.3, 0.2, 0.5], dtype=D)
R = torch.tensor([1.5, 0.7, 2.2], dtype=D)
S = 0.5
SUPPORT = {"w": constraints.real_vector, "rate": constraints.positive}
SHAPE = {"w": (2,), "rate": ()}


@pytest.fixture(autouse=True)
def fresh_store():
    pyro.clear_param_store()  # each Guide's PyroModule parameters are named alike


def model():
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", len(Y)):
        pyro.sample("y", dist.Normal((X * w).sum(-1), S), obs=Y)
    rate = pyro.sample("rate", dist.LogNormal(torch.tensor(0.0, dtype=D), 1.0))
    with pyro.plate("rates", len(R)):
        pyro.sample("r", dist.LogNormal(rate.log(), 1.0), obs=R)


def elbo_closed(mw, sw, mu, su) -> float:
    """The exact ELBO of the mean field N(mw, sw^2) x LogNormal(mu, su^2)."""
    vw = sw**2
    ll = (
        -len(Y) / 2 * math.log(2 * math.pi * S**2)
        - ((Y - X @ mw) ** 2).sum() / (2 * S**2)
        - ((X**2).sum(0) * vw).sum() / (2 * S**2)
    )
    pw = -math.log(2 * math.pi) - 0.5 * ((mw**2).sum() + vw.sum())
    hw = (0.5 * torch.log(2 * math.pi * math.e * vw)).sum()
    lr = R.log()
    llr = (-0.5 * math.log(2 * math.pi) - 0.5 * ((lr - mu) ** 2 + su**2) - lr).sum()
    pu = -0.5 * math.log(2 * math.pi) - 0.5 * (mu**2 + su**2)
    hu = 0.5 * torch.log(2 * math.pi * math.e * su**2)
    return float(ll + pw + hw + llr + pu + hu)


def unchanged(description):
    pass


class Guide(PyroModule):
    """Softplus scales; ``edit(description)`` spoils the description, ``offset`` the run."""

    def __init__(self, edit=unchanged, offset=0.0, rate_map=None):
        super().__init__()
        self.mu_w = nn.Parameter(torch.tensor([0.3, -0.2], dtype=D))
        self.raw_w = nn.Parameter(torch.full((2,), -1.0, dtype=D))
        self.mu_r = nn.Parameter(torch.tensor(0.1, dtype=D))
        self.raw_r = nn.Parameter(torch.tensor(-1.0, dtype=D))
        self.edit, self.offset = edit, offset
        self.rate_map = rate_map or biject_to(SUPPORT["rate"])

    def forward(self):
        sp = torch.nn.functional.softplus
        pyro.sample("w", dist.Normal(self.mu_w + self.offset, sp(self.raw_w)).to_event(1))
        normal = dist.Normal(self.mu_r, sp(self.raw_r))
        pyro.sample("rate", dist.TransformedDistribution(normal, [self.rate_map]))

    def quadrature_description(self, trace=None):
        sites, latent = [], []
        for name, loc, raw in [("w", self.mu_w, self.raw_w), ("rate", self.mu_r, self.raw_r)]:
            to = biject_to(SUPPORT[name])
            sites.append(
                MeanFieldSite(
                    name=name,
                    family="gaussian",
                    loc=loc,
                    scale=torch.nn.functional.softplus(raw),
                    params={"loc": loc, "scale": raw},
                    param_constraints={
                        "loc": constraints.real,
                        "scale": constraints.softplus_positive,
                    },
                    param_names={"loc": f"mine.{name}.m", "scale": f"mine.{name}.s"},
                    transform=to,
                    event_dim=len(SHAPE[name]),
                    constraint=SUPPORT[name],
                )
            )
            latent.append(LatentSite(name, torch.Size(SHAPE[name]), len(SHAPE[name]), to))
        description = GuideDescription("Guide", latent, sites=sites)
        self.edit(description)
        return description


def loss(guide) -> float:
    return QuadratureELBO("gauss_hermite").loss(model, guide)


def exact_elbo(guide) -> float:
    """The closed-form ELBO of a guide with ``mu_w, raw_w, mu_r, raw_r`` (softplus scales)."""
    sp = torch.nn.functional.softplus
    with torch.no_grad():
        return elbo_closed(guide.mu_w, sp(guide.raw_w), guide.mu_r, sp(guide.raw_r))


def test_a_consistent_description_gives_the_exact_elbo():
    guide = Guide()
    assert -loss(guide) == pytest.approx(exact_elbo(guide), abs=1e-10)


def logvar_scale(d):  # scale = exp(raw / 2) declared under constraints.positive (t25 b.py)
    for site in d.sites:
        site.scale = (0.5 * site.params["scale"]).exp()


def roles_swapped(d):  # the loc leaf under "scale" (t25 g.py)
    s = d.sites[0]
    s.params = {"loc": s.params["scale"], "scale": s.params["loc"]}


@pytest.mark.parametrize(
    ("edit", "role"), [(logvar_scale, "scale"), (roles_swapped, "loc")], ids=["logvar", "swapped"]
)
def test_declared_values_follow_from_the_declared_parameters(edit, role):
    with pytest.raises(
        ValueError, match=rf"Guide, site 'w': its {role} is not what params\['{role}'\]"
    ):
        loss(Guide(edit))


def test_a_stale_description_is_refused():
    guide = Guide()
    cached = guide.quadrature_description()
    guide.quadrature_description = lambda trace=None: cached
    with torch.no_grad():
        guide.raw_r.add_(0.5)
    with pytest.raises(ValueError, match=r"site 'rate': its scale .*\(not a cached one\)"):
        loss(guide)


def test_sites_out_of_layout_order_are_refused():
    # before: -loss -15.0546 where the exact ELBO is -12.0434 (t25 h.py)
    with pytest.raises(ValueError, match=r"lists site 'w' after 'rate'.*\['w', 'rate'\]"):
        loss(Guide(lambda d: d.sites.reverse()))


def test_a_block_of_another_size_than_its_site_is_refused():
    with pytest.raises(ValueError, match=r"site 'w' has 2 coordinates .* its latent site has 3"):
        GuideDescription(
            "Guide",
            [LatentSite("w", torch.Size([3]), 1, biject_to(constraints.real_vector))],
            sites=[Guide().quadrature_description().sites[0]],
        )


def test_an_undeclared_offset_in_the_run_is_refused():
    # before: the ELBO at mu (-12.0434), not the guide's (-12.3494), and the offset never moved
    with pytest.raises(ValueError, match=r"run samples 'w' .* not from the declared Normal"):
        loss(Guide(offset=0.5))


def test_a_run_through_another_map_than_the_declared_transform_is_refused():
    # declared exp (biject_to(positive)), sampled through softplus: the draws' mean was off
    softplus = dist.transforms.SoftplusTransform()
    with pytest.raises(ValueError, match=r"run samples 'rate' .* pushed through transform"):
        loss(Guide(rate_map=softplus))


def test_a_transform_off_the_support_is_refused():
    def identity(d):
        d.sites[1].transform = biject_to(constraints.real)

    with pytest.raises(ValueError, match=r"site 'rate': its transform .* support GreaterThan"):
        loss(Guide(identity))


def test_hints_not_a_mapping_name_the_site():
    def five(d):
        d.sites[0].hints = 5

    with pytest.raises(TypeError, match=r"site 'w': hints=5 is not a mapping"):
        loss(Guide(five))
    site = Guide().quadrature_description().sites[0]
    with pytest.raises(TypeError, match=r"site 'w': hints=5 is not a mapping"):
        MeanFieldSite(**{**vars(site), "hints": 5})


def test_unknown_hints_blame_the_guide():
    def unknown(d):
        d.sites[0].hints = {"no_such_setting": 1.0}

    with pytest.raises(
        TypeError, match=r"description of Guide, site 'w' declares .*'no_such_setting'"
    ):
        describe_guide(Guide(unknown))


class DeltaAtTheSites(Guide):
    """Draws each model site as a Delta (AutoNormal's way): no density at the site to check."""

    def forward(self):
        sp = torch.nn.functional.softplus
        w = pyro.sample("w_unconstrained", dist.Normal(self.mu_w, sp(self.raw_w)).to_event(1))
        pyro.sample("w", dist.Delta(w, event_dim=1))
        u = pyro.sample("rate_unconstrained", dist.Normal(self.mu_r, sp(self.raw_r)))
        pyro.sample("rate", dist.Delta(u.exp()))


def test_a_delta_at_the_site_is_read_as_declared():
    guide = DeltaAtTheSites()
    assert -loss(guide) == pytest.approx(exact_elbo(guide), abs=1e-10)


@pytest.fixture
def checked_in_full(monkeypatch):
    """The blocks the full check has read so far (it asks `_maps_onto` once a block)."""
    blocks = []
    maps_onto = interface._maps_onto

    def spy(site):
        blocks.append(site.name)
        return maps_onto(site)

    monkeypatch.setattr(interface, "_maps_onto", spy)
    return blocks


def svi_of(guide):
    return SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), QuadratureELBO("gauss_hermite"))


def test_a_description_stale_from_step_3_is_refused_between_full_checks(checked_in_full):
    guide = Guide()
    described, kept = guide.quadrature_description, []

    def kept_from_step_2(trace=None):  # caches softplus(raw) of step 2
        if len(kept) < 2:
            kept.append(described(trace))
        return kept[-1]

    guide.quadrature_description = kept_from_step_2
    svi = svi_of(guide)
    svi.step()
    svi.step()
    assert checked_in_full == ["w", "rate"]  # step 1's read only
    with pytest.raises(ValueError, match=r"Guide, site 'w': its scale .*\(not a cached one\)"):
        svi.step()
    assert checked_in_full == ["w", "rate"]


def test_another_transform_after_step_1_is_checked_in_full(checked_in_full):
    guide = Guide()
    svi = svi_of(guide)
    svi.step()
    svi.step()
    assert checked_in_full == ["w", "rate"]
    # declared, not run through: only the full check's densities see it
    softplus = dist.transforms.SoftplusTransform()
    guide.edit = lambda d: setattr(d.sites[1], "transform", softplus)
    with pytest.raises(ValueError, match=r"run samples 'rate' .* pushed through transform"):
        svi.step()
    guide.rate_map = softplus  # run through it too: checked in full once more, then sampled
    svi.step()
    svi.step()
    assert checked_in_full == ["w", "rate"] * 3


def test_a_copy_or_a_pickle_of_a_guide_is_checked_in_full_at_its_first_read(checked_in_full):
    guide = Guide()
    loss(guide)
    loss(guide)
    assert checked_in_full == ["w", "rate"]
    loss(copy.deepcopy(guide))
    loss(pickle.loads(pickle.dumps(guide)))
    assert checked_in_full == ["w", "rate"] * 3
    alive = weakref.ref(guide)
    del guide
    gc.collect()
    assert alive() is None


def test_a_stale_block_of_a_subsampled_plate_is_refused_at_the_run_s_rows():
    data = torch.linspace(-1.0, 2.0, 40)

    def local_model():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 40, subsample_size=8) as rows:
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=data[rows])

    guide = AutoMeanFieldNormal(local_model)
    svi = SVI(local_model, guide, pyro.optim.Adam({"lr": 0.05}), QuadratureELBO("gauss_hermite"))
    owner = types.SimpleNamespace()  # reads of a hand-written guide, in full at the first
    for _ in range(3):  # later reads, at other rows, agree
        svi.step()
        trace = interface.trace_for_description(guide)
        description = describe_guide(guide, trace)
        interface.check_declaration(description, trace, owner=owner)
    z = description.sites[1]
    with torch.no_grad():  # the run's rows of z's scale move, its description is kept
        z.params["scale"][z.rows[-1]] += 0.3
    with pytest.raises(ValueError, match=r"site 'z': its scale .*\(not a cached one\)"):
        interface.check_declaration(description, trace, owner=owner)
