"""Session 16: the peak memory of a ``QuadratureELBO`` + ``QNVB`` step on a large plain latent
vector, without changing any result.

A trial found a step on ``D = 10^7`` latents under a plain ``dist.Normal`` prior holding about 30
times the vector's bytes. With the default rule (K = 3 nodes) the step held, in units of ``4 D``
bytes: the nodes ``x`` and the points ``z`` (K each), torch's ``Normal.log_prob`` at all K nodes
(``z - m`` kept for the backward, and up to three more tensors of K x D at once, with as many in
its backward), copies of the flat loc and scale, a copy of the points' gradient in the split's
backward, and three temporaries of ``D`` in the publication of ``h``: 22.1 (``expand``: 21.1;
Pyro's ``AutoDiagonalNormal``: 23.1; the package's ``IidNormal`` integrated in closed form:
18.25, at the nodes under ``AutoDiagonalNormal``: 22). Now the prior's log density is evaluated a
node at a time with torch's own operations (``infer/normal_density.py``), one site's flat
parameters are views, and the node sums and moments are made in place: at most ``3 K + 4.5``
(``x``, ``z``, one output or gradient of all nodes, and a few vectors of ``D``), every value,
gradient and published moment the same bits as before.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributions import IidNormal
from pyro_quadvi.guides.interface import published_moments
from pyro_quadvi.infer import normal_density, quadrature_elbo
from pyro_quadvi.testing.compare import equal_nested
from pyro_quadvi.testing.memory import cpu_peak_bytes

OBSERVED = torch.linspace(-1.0, 1.0, 5)


def vector_model(prior: str, dim: int, dtype: torch.dtype = torch.float32):
    """``w ~ prior`` over ``dim`` coordinates, five observations of ``w[:5]``."""

    def model():
        if prior == "plain":
            fn = dist.Normal(torch.zeros(dim, dtype=dtype), 1.0).to_event(1)
        elif prior == "expand":
            fn = dist.Normal(torch.tensor(0.0, dtype=dtype), 1.0).expand([dim]).to_event(1)
        else:
            fn = IidNormal.of(0.0, 1.0, torch.zeros(dim, dtype=dtype)).to_event(1)
        w = pyro.sample("w", fn)
        pyro.sample("y", dist.Normal(w[..., :5], 1.0).to_event(1), obs=OBSERVED.to(dtype))

    return model


# -- the peak of a step --------------------------------------------------------------------


@pytest.mark.parametrize(
    "prior, guide_class",
    [
        ("plain", AutoMeanFieldNormal),  # 22.13 before
        ("expand", AutoMeanFieldNormal),  # 21.13
        ("iid", AutoMeanFieldNormal),  # 18.25 (the prior in closed form)
        ("plain", AutoDiagonalNormal),  # 23.13
        ("iid", AutoDiagonalNormal),  # 22.00 (the prior at the nodes)
    ],
)
def test_a_step_on_a_large_latent_vector_holds_at_most_3k_plus_4_5_vectors(prior, guide_class):
    dim = 200_000
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = vector_model(prior, dim)
    guide = guide_class(model)
    elbo = QuadratureELBO()
    svi = SVI(model, guide, QNVB(), elbo)
    svi.step()  # the first step checks the vectorized pass; the optimizer makes its state
    svi.step()
    peak = cpu_peak_bytes(svi.step) / (4 * dim)
    assert peak <= 3 * 3 + 4.5, peak


# -- the same bits -------------------------------------------------------------------------


def plate_model():
    """A Normal prior with tensor parameters under a plate, observed in it (so that the nodes
    run in one pass: read outside the plate, ``u`` would not broadcast over them)."""
    with pyro.plate("p", 300):
        u = pyro.sample("u", dist.Normal(torch.linspace(-1, 1, 300), torch.linspace(0.5, 2, 300)))
        pyro.sample("y", dist.Normal(u, 1.0), obs=torch.linspace(0, 1, 300))


def several_sites_model():
    """Normal priors with tensor and number parameters, a positive site and a closed-form
    ``IidNormal`` (loc 0.2); ``v`` is read in three places."""
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    scale = torch.linspace(0.5, 2, 300)
    u = pyro.sample("u", dist.Normal(torch.linspace(-1, 1, 300), scale).to_event(1))
    v = pyro.sample("v", dist.Normal(torch.zeros(400), 2.0).to_event(1))
    w = pyro.sample("w", IidNormal.of(0.2, 1.3, torch.zeros(200)).to_event(1))
    mean = u[..., :5] + v[..., :5] * v[..., 5:10] + v[..., -5:] + w[..., :5] ** 2
    pyro.sample("y", dist.Normal(mean, s.unsqueeze(-1)).to_event(1), obs=OBSERVED)


CASES = {
    "plain": (vector_model("plain", 500), AutoMeanFieldNormal),
    "plain float64": (vector_model("plain", 500, torch.float64), AutoMeanFieldNormal),
    "expand, diagonal": (vector_model("expand", 500), AutoDiagonalNormal),
    "iid at the nodes": (vector_model("iid", 500), AutoDiagonalNormal),
    "plate": (plate_model, AutoNormal),
    "several sites": (several_sites_model, AutoMeanFieldNormal),
}


def _fit(model, guide_class, rule: str) -> list:
    """Two ``loss_and_grads`` (losses, gradients, published moments) and three QNVB steps
    (losses, parameters)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = guide_class(model)
    guide()
    elbo = QuadratureELBO(rule, generator=torch.Generator().manual_seed(1))
    params = {name: value.unconstrained() for name, value in pyro.get_param_store().items()}
    out = []
    for _ in range(2):
        loss = elbo.loss_and_grads(model, guide)
        moments = {}
        for name, param in params.items():
            published = published_moments(param)
            if published is not None:
                moments[name] = (published.g.clone(), published.h.clone())
        out.append((loss, {name: p.grad.clone() for name, p in params.items()}, moments))
        for param in params.values():
            param.grad = None
    svi = SVI(model, guide, QNVB(), elbo)
    out.append([svi.step() for _ in range(3)])
    out.append({name: p.detach().clone() for name, p in params.items()})
    return out


@pytest.mark.filterwarnings("error::UserWarning")  # a fallback to the loop would hide the pass
@pytest.mark.parametrize("rule", ["blocked_simplex", "mc"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_prior_node_by_node_gives_torchs_loss_gradients_moments_and_steps_bit_for_bit(
    case, rule, monkeypatch
):
    model, guide_class = CASES[case]
    monkeypatch.setattr(normal_density, "SLICE_ELEMENTS", 64)  # several slices of each site
    calls = []
    made = normal_density.NodeByNodeNormal.of.__func__

    def counted(cls, fn, value):
        lean = made(cls, fn, value)
        calls.append(lean is not None)
        return lean

    monkeypatch.setattr(normal_density.NodeByNodeNormal, "of", classmethod(counted))
    node_by_node = _fit(model, guide_class, rule)
    assert any(calls)  # the path under test ran
    monkeypatch.setattr(normal_density.NodeByNodeNormal, "of", classmethod(lambda *_: None))
    torchs = _fit(model, guide_class, rule)
    assert equal_nested(node_by_node, torchs, bits=True)


def test_the_node_sums_with_closed_form_priors_are_the_old_sums_bit_for_bit():
    # before: clones of g_all and gx_all, and factor * (loc - m), factor * scale added to slices
    generator = torch.Generator().manual_seed(3)
    g_all, gx_all, loc = (torch.randn(50, generator=generator) for _ in range(3))
    scale = torch.rand(50, generator=generator) + 0.1
    closed = quadrature_elbo._ClosedPriors(description=None)
    closed.pieces = [(5, 20, 0.3, 1.7, 2.0), (20, 31, 0.0, 0.6, 1.0), (40, 45, -1.0, 2.0, 0.5)]
    closed.total_weight = torch.tensor(0.9)
    old_g, old_gx = g_all.clone(), gx_all.clone()
    for start, stop, m, s, c in closed.pieces:
        factor = closed.total_weight * (c / (s * s))
        centred = loc[start:stop] - m if m != 0 else loc[start:stop]
        old_g[start:stop].add_(factor * centred)
        old_gx[start:stop].add_(factor * scale[start:stop])
    kept = (g_all.clone(), gx_all.clone())
    g_pub, gx_pub = closed.with_priors(g_all, gx_all, loc, scale)
    assert equal_nested((g_pub, gx_pub), (old_g, old_gx), bits=True)
    assert equal_nested((g_all, gx_all), kept, bits=True)  # the gradients it returns: untouched


class _Site:
    """What `_publish` reads of a Gaussian site of six coordinates."""

    family, shape, scale_factor = "gaussian", torch.Size([6]), 1.0

    def __init__(self):
        self.loc = torch.zeros(6)
        self.params = {"loc": self.loc}


class _Description:
    def __init__(self):
        self.sites = [_Site()]


@pytest.mark.parametrize("spare", [False, True])
def test_h_is_gx_over_sigma_and_zero_where_sigma_is_not_positive_as_before(spare, monkeypatch):
    scale = torch.tensor([0.5, 0.0, 2.0, float("nan"), 1e-30, 3.0])
    gx_all = torch.tensor([1.0, 2.0, -3.0, 4.0, 5.0, float("nan")])
    g_all = torch.arange(6.0)
    before = torch.where(scale > 0, gx_all / scale, torch.zeros_like(scale))
    published = []
    monkeypatch.setattr(quadrature_elbo, "publish_moments", published.append)
    given = gx_all.clone()
    quadrature_elbo._publish(_Description(), g_all, given, scale, None, spare)
    assert equal_nested(published[0].h, before, bits=True)
    assert equal_nested(published[0].g, g_all, bits=True)
    assert spare or equal_nested(given, gx_all, bits=True)  # not spare: left as it was


def test_a_non_finite_prior_at_a_node_is_named_as_before():
    dim = 100_000
    pyro.clear_param_store()
    model = vector_model("plain", dim)
    guide = AutoMeanFieldNormal(model)
    guide()
    with torch.no_grad():
        guide.locs.w[70_000] = 3e38
        guide.scales.w.fill_(1e38)
    with pytest.raises(ValueError, match=r"log density of site 'w' is not finite \(-inf\) at qu"):
        QuadratureELBO().loss_and_grads(model, guide)
