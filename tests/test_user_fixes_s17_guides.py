"""Guides the session 17 trial found wanting: a guide's site hidden by ``poutine.block``, Pyro's
``AutoNormalMessenger`` (now read), and the refusals of the guides that are not read."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO
from pyro_quadvi.distributions import SpikeSlab

pytestmark = pytest.mark.usefixtures("float64_store")


Y = torch.tensor(2.0, dtype=torch.float64)


def ab_model():
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(a, 1.0))
    pyro.sample("y", dist.Normal(b, 1.0), obs=Y)


def spike_model():
    a = pyro.sample("a", SpikeSlab(torch.tensor(0.5, dtype=torch.float64)))
    pyro.sample("y", dist.Normal(a, 1.0), obs=Y)


def _fit(model, guide, steps: int = 3) -> None:
    svi = SVI(model, guide, QNVB(), QuadratureELBO("gauss_hermite"))
    for _ in range(steps):
        svi.step()


# ------------------------------------------------------------------ a site hidden from the guide
@pytest.mark.parametrize("guide_class", [AutoMeanFieldNormal, AutoNormal, AutoDiagonalNormal])
def test_a_model_site_hidden_from_the_guide_is_refused_not_fitted(guide_class):
    # before: QuadratureELBO read 'a' from the guide itself and fitted it to its posterior
    # (0.667, 0.707), as if nothing were hidden; Trace_ELBO draws it from the prior instead
    guide = guide_class(ab_model)
    with pytest.raises(ValueError) as error:
        _fit(ab_model, poutine.block(guide, hide=["a"]))
    message = str(error.value)
    assert message.startswith(
        "the trace of the guide's run lacks 'a': a poutine.block around the guide hid it."
    )
    assert "it would fit 'a' all the same" in message
    assert "pyro.condition(model, data={...}), and build the guide from that model" in message
    way_out = "build the guide on poutine.block(model, hide=['a']) (or use an AutoGuideList)"
    assert way_out in message


@pytest.mark.parametrize(
    "guide_class, model, draw, sites",
    [
        (AutoMeanFieldNormal, ab_model, "a_unconstrained", "'a'"),
        (AutoNormal, ab_model, "a_unconstrained", "'a'"),
        (AutoSpikeSlab, spike_model, "a_unconstrained", "'a'"),
        (AutoDiagonalNormal, ab_model, "_AutoDiagonalNormal_latent", "'a', 'b'"),
    ],
)
def test_a_hidden_draw_of_the_guide_is_named_not_a_key_error(guide_class, model, draw, sites):
    # before: a bare KeyError with the draw's name
    guide = guide_class(model)
    with pytest.raises(ValueError) as error:
        _fit(model, poutine.block(guide, hide=[draw]))
    message = str(error.value)
    assert message.startswith(
        f"the trace of the guide's run lacks {draw!r} (its draw of {sites}): a poutine.block "
        "around the guide hid it."
    )
    assert f"poutine.block(model, hide=[{sites}])" in message


def test_the_way_out_a_guide_of_the_conditioned_model_fits_the_rest_exactly():
    # the message's first way out: b | y, a = 1 is N(1.5, 1/2), which Gauss-Hermite and QNVB
    # reach in a step (a Gaussian model: the fixed point is exact)
    conditioned = pyro.condition(ab_model, data={"a": torch.tensor(1.0, dtype=torch.float64)})
    guide = AutoMeanFieldNormal(conditioned)
    _fit(conditioned, guide)
    assert guide.locs.b.item() == pytest.approx(1.5, abs=1e-12)
    assert guide.scales.b.item() == pytest.approx(0.5**0.5, abs=1e-12)
