"""User trial t25 (session 26), hand-written guides: a declared scale that is not positive is
named with its site (item 5); a declared parameter that is a tensor computed from a leaf is warned
of as such (item 8)."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, QuadratureELBO
from pyro_quadvi.guides import GuideDescription, MeanFieldSite
from pyro_quadvi.infer import LatentSite

DTYPE = torch.float64
DATA = torch.tensor([0.9, 0.1, 1.4, 0.6], dtype=DTYPE)


@pytest.fixture(autouse=True)
def _clear_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def model():
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=DTYPE), 1.0).to_event(1))
    with pyro.plate("data", len(DATA)):
        pyro.sample("x", dist.Normal(w.sum(-1), 1.0), obs=DATA)


class HandGuide(torch.nn.Module):
    """A guide over ``w`` whose description's scale is ``scale_of(raw)`` under the declared
    ``scale_constraint`` and whose declared ``loc`` parameter is ``loc_of(loc)``. It draws ``w``
    as ``AutoNormal`` does, a ``Delta`` at the value the ELBO puts there (here its loc), so that
    a declared scale that is not positive reaches the loss (a Normal refuses one when drawing)."""

    def __init__(
        self,
        raw,
        scale_of=torch.nn.functional.softplus,
        loc_of=lambda loc: loc,
        scale_constraint=dist.constraints.softplus_positive,
    ):
        super().__init__()
        self.loc = torch.nn.Parameter(torch.tensor([0.3, -0.2], dtype=DTYPE))
        self.raw = torch.nn.Parameter(torch.tensor(raw, dtype=DTYPE))
        self.scale_of, self.loc_of = scale_of, loc_of
        self.scale_constraint = scale_constraint

    def forward(self):
        pyro.module("hand", self)
        pyro.sample("w", dist.Delta(self.loc, event_dim=1))

    def quadrature_description(self, trace=None) -> GuideDescription:
        identity = dist.transforms.identity_transform
        site = MeanFieldSite(
            name="w",
            family="gaussian",
            loc=self.loc,
            scale=self.scale_of(self.raw),
            params={"loc": self.loc_of(self.loc), "scale": self.raw},
            param_constraints={
                "loc": dist.constraints.real,
                "scale": self.scale_constraint,
            },
            param_names={"loc": "hand$$$loc", "scale": "hand$$$raw"},
            transform=identity,
            event_dim=1,
        )
        latent = [LatentSite("w", torch.Size([2]), 1, identity)]
        return GuideDescription("HandGuide", latent, sites=[site])


def _unmapped(raw) -> HandGuide:
    """A raw scale parameter under no map, declared so (``constraints.real``): consistent with
    itself, so the declaration's own checks pass and the scale reaches the loss."""
    return HandGuide(raw, scale_of=lambda r: r, scale_constraint=dist.constraints.real)


def test_a_negative_declared_scale_is_named_with_its_site_and_the_fix():
    guide = _unmapped([-0.5, -1.0])
    with pytest.raises(ValueError) as raised:
        QuadratureELBO("gauss_hermite").differentiable_loss(model, guide)
    message = str(raised.value)
    assert "at site 'w' a scale of -1 (2 of 2 entries" in message
    assert "Declare it positive, e.g. softplus(raw) or raw.exp()" in message
    assert "collapsed" not in message


def test_a_raw_scale_under_no_map_names_the_negative_entry():
    guide = _unmapped([0.5, -1.0])
    with pytest.raises(ValueError, match=r"site 'w' a scale of -1 \(1 of 2 entries"):
        QuadratureELBO("gauss_hermite").differentiable_loss(model, guide)


def test_a_zero_scale_is_named_as_a_collapse():
    guide = _unmapped([0.5, 0.0])
    with pytest.raises(ValueError, match=r"site 'w' a scale of 0 .* collapsed to zero"):
        QuadratureELBO("gauss_hermite").differentiable_loss(model, guide)


@pytest.mark.parametrize("role", ["loc", "scale"])
def test_a_computed_declared_parameter_is_warned_of_as_not_a_leaf(role):
    if role == "loc":
        guide = HandGuide([0.5, 0.5], loc_of=lambda loc: loc * 1.0)
    else:
        guide = HandGuide([0.5, 0.5])
        described = guide.quadrature_description

        def computed_raw(trace=None):
            description = described(trace)
            description.sites[0].params["scale"] = guide.raw * 1.0
            return description

        guide.quadrature_description = computed_raw
    qnvb = QNVB()
    svi = SVI(model, guide, qnvb, QuadratureELBO("gauss_hermite"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi.step()
    messages = [str(w.message) for w in caught]
    assert any(
        f"site 'w' declares under params ['{role}'] a tensor computed from a parameter" in m
        and "must be the leaf tensor the optimizer receives" in m
        for m in messages
    ), messages
    assert not any("describe a guide of your own" in m for m in messages)
    assert not any("frozen or detached" in m for m in messages)
    assert qnvb.get_state()["qnvb"]["pairs"] == {}
