"""Session 27, the lead: items left by session 26, each against an exact reference."""

from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_quadvi import opqa_evidence
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO
from pyro_quadvi.optim import QNVB


def _moving_support():
    lo = pyro.sample("lo", dist.Normal(0.0, 1.0))
    x = pyro.sample("x", dist.Uniform(lo, lo + 1.0))
    pyro.sample("y", dist.Normal(x, 0.5), obs=torch.tensor(2.0))


def test_a_support_that_depends_on_a_latent_is_named_with_its_fix():
    """`Uniform(lo, lo + 1)`: the guide maps ``x`` onto the interval of the set-up run, (0, 1)
    at ``lo``'s initial 0, and on the tensor grid of 10 Gauss-Hermite points (unit-scale nodes
    t, guide scale 0.1) the pairs with sigmoid(0.1 t_j) outside [0.1 t_i, 1 + 0.1 t_i] lie outside
    the model's support; Pyro's validation error names only the values."""
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_moving_support)
    guide()
    t, _ = np.polynomial.hermite_e.hermegauss(10)
    lo = 0.1 * t[:, None]
    x = 1.0 / (1.0 + np.exp(-0.1 * t[None, :]))
    outside = int(((x < lo) | (x > lo + 1.0)).sum())
    assert outside > 0
    with pytest.raises(ValueError, match=rf"site 'x': {outside} of the guide's values") as info:
        QuadratureELBO(rule="gauss_hermite", num_points=10).loss(_moving_support, guide)
    assert "depends on another latent" in str(info.value)
    assert "pyro.sample('u', dist.Uniform(0.0, 1.0))" in str(info.value)


def _uniform_site():
    u = pyro.sample("u", dist.Uniform(torch.tensor(2.0, dtype=torch.float64), 5.0))
    pyro.sample("y", dist.Normal(u, 1.0), obs=torch.tensor(3.0, dtype=torch.float64))


def _half_cauchy_scale():
    s = pyro.sample("s", dist.HalfCauchy(torch.tensor(1.0, dtype=torch.float64)))
    with pyro.plate("d", 4):
        y = torch.tensor([0.5, -1.2, 2.0, 0.3], dtype=torch.float64)
        pyro.sample("y", dist.Normal(0.0, s), obs=y)


@pytest.mark.parametrize(
    "model, site, rule, scale",
    [
        (_uniform_site, "u", "blocked_simplex", 1.1277),  # the mean field's 1.3115: 14% narrow
        (_uniform_site, "u", "gauss_hermite", 1.3072),
        (_half_cauchy_scale, "s", "blocked_simplex", 0.3744),  # the mean field's 0.3273: 14% wide
        (_half_cauchy_scale, "s", "gauss_hermite", 0.3272),
    ],
)
def test_the_default_rules_scale_on_a_lone_skewed_site(model, site, rule, scale):
    """docs/quadrature.md ("Wide sites far from quadratic"): a lone site of sd near one in the
    unconstrained space is fitted 14% off its mean-field scale by the default rule, and to 0.3% by
    10 Gauss-Hermite points (the mean-field optima 1.3115 and 0.3273 from a 60-point rule
    minimized by Nelder-Mead)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    options = {"num_points": 10} if rule == "gauss_hermite" else {}
    svi = pyro.infer.SVI(model, guide, QNVB(), QuadratureELBO(rule=rule, **options))
    for _ in range(300):
        svi.step()
    fitted = pyro.param(f"AutoMeanFieldNormal.scales.{site}").item()
    assert fitted == pytest.approx(scale, abs=2e-4)


def _conjugate_sites():
    y = torch.tensor([0.4, -1.1, 0.7], dtype=torch.float64)
    for i in range(3):
        z = pyro.sample(f"z_{i}", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        pyro.sample(f"y_{i}", dist.Normal(z, 1.0), obs=y[i])


def test_the_laplace_centre_takes_the_row_by_row_hessian_where_torch_cannot_batch_it(monkeypatch):
    """`_hessian_factor` takes the Hessian in one batched backward; where torch refuses to batch
    a model's backward it takes it a row a pass, and the log evidence is the same: here exact,
    sum_i log N(y_i; 0, 2)."""
    exact = float(dist.Normal(0.0, 2.0**0.5).log_prob(torch.tensor([0.4, -1.1, 0.7])).sum())
    hessian = torch.autograd.functional.hessian
    calls = []

    def refusing(function, inputs, **kwargs):
        calls.append(kwargs.get("vectorize", False))
        if kwargs.get("vectorize"):
            raise RuntimeError("vmap: no batching rule for this backward")
        return hessian(function, inputs, **kwargs)

    monkeypatch.setattr(torch.autograd.functional, "hessian", refusing)
    found = opqa_evidence(_conjugate_sites, num_points=1, center="laplace").log_evidence
    assert float(found) == pytest.approx(exact, abs=1e-6)
    assert calls[:2] == [True, False]


_NAMES = ["w9", "w8", "w7", "w6", "w5", "w4", "w3", "w2", "w1", "w0"]  # built in reverse order


def _many_sites():
    for name in _NAMES:  # unobserved, sd 100: every one pinned at sigma_max = 0.5
        pyro.sample(name, dist.Normal(0.0, 100.0))
    offsets = sum(pyro.param(f"c{i}", torch.tensor(0.01 * i)) for i in (3, 2, 1, 0))
    pyro.sample("y", dist.Normal(offsets, 1.0), obs=torch.tensor(0.5))


def test_qnvb_keeps_its_blocks_by_name_whatever_order_svi_hands_them():
    """SVI hands QNVB a set of parameters, in the order of their tensors' addresses: QNVB sorts
    its blocks by their loc's name, so `get_state`'s keys and the warnings' first site are the
    same in every run (they followed the addresses)."""
    pyro.clear_param_store()
    junk = [torch.empty(int(n)) for n in torch.randint(1, 10_000, (50,))]  # shift addresses
    guide = AutoMeanFieldNormal(_many_sites)
    optim = QNVB(sigma_max=0.5)
    svi = pyro.infer.SVI(_many_sites, guide, optim, QuadratureELBO())
    with pytest.warns(RuntimeWarning, match=r"at 10 coordinates \(first: site 'w0'\)"):
        for _ in range(3):
            svi.step()
    del junk
    state = optim.get_state()
    locs = [f"AutoMeanFieldNormal.locs.{name}" for name in sorted(_NAMES)]
    assert list(state["qnvb"]["pairs"]) == locs
    assert list(state["qnvb"]["settings"]) == locs
    assert list(state["fallback"]) == ["c0", "c1", "c2", "c3"]
