"""Session 18, QNVB on a model of many small sites.

The update refuses a tensor of another dtype or device than its mean, naming it (torch's type
promotion made the two implementations disagree). QNVB's bookkeeping per site was cut (one
check over all the tensors, each walk made once, whole chunks read by ``stack`` and written by
``unbind``) without changing a bit: a fit of 100 scalar sites equals the reference update site by
site, and the flat update of many small tensors equals `qnvb_update` tensor by tensor.
"""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from torch.distributions import transform_to

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides.interface import published_moments
from pyro_quadvi.optim import qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    QNVBState,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)
from pyro_quadvi.testing.compare import equal_nested

HP = QNVBHyperparameters()


def _inputs(**changed):
    mu = torch.zeros(3)
    inputs = {"mu": mu, "sigma": torch.ones(3), "g": torch.ones(3), "h": torch.ones(3)}
    inputs["state"] = init_qnvb_state(mu)
    inputs.update(changed)
    return inputs


@pytest.mark.parametrize(
    "changed, named",
    [
        ({"g": torch.tensor([1, 2, 3])}, "g"),  # the one: promoted; the many: a cast error
        ({"h": torch.tensor([1, 2, 3])}, "h"),
        ({"g": torch.tensor([True, False, True])}, "g"),
        ({"sigma": torch.ones(3, dtype=torch.float64)}, "sigma"),  # a float64 mean, or float32
        (
            {"state": init_qnvb_state(torch.zeros(3))._replace(count=torch.zeros(3).long())},
            "state.count",
        ),
    ],
    ids=["int64 g", "int64 h", "bool g", "float64 sigma", "int64 state"],
)
def test_a_tensor_of_another_dtype_than_the_mean_is_refused_by_name(changed, named):
    inputs = _inputs(**changed)
    wrong = inputs[named.split(".")[0]]
    wrong = wrong.count if named == "state.count" else wrong
    message = (
        f"qnvb_update: {named} has dtype {wrong.dtype} on cpu, mu torch.float32 on cpu: every "
        f"tensor of the update has the mean's dtype and device (it converts nothing); pass "
        f"{named}.to(mu)"
    )
    with pytest.raises(TypeError) as error:
        qnvb_update(**inputs, hp=HP)
    assert str(error.value) == message
    listed = named.replace("state.", "states[1].") if "." in named else f"{named}s[1]"
    lists = {"mus": [], "sigmas": [], "gs": [], "hs": [], "states": []}
    for key, value in _inputs().items():  # a well-formed tensor first, then the wrong one
        lists[f"{key}s"].append(value)
    for key, value in inputs.items():
        lists[f"{key}s"].append(value)
    with pytest.raises(TypeError) as error:
        qnvb_update_many(**lists, hp=HP)
    assert str(error.value).startswith(
        f"qnvb_update_many: {listed} has dtype {wrong.dtype} on cpu, mus[1] torch.float32"
    )


def test_qnvb_update_many_refuses_means_of_two_dtypes():
    mus = [torch.zeros(3), torch.zeros(2, dtype=torch.float64)]
    lists = [[torch.ones_like(m) for m in mus] for _ in range(3)]
    with pytest.raises(TypeError, match=r"mus\[1\] has dtype torch.float64 on cpu, mus\[0\]"):
        qnvb_update_many(mus, *lists, [init_qnvb_state(m) for m in mus], HP)


# -- many scalar sites: QNVB's fit is the reference update site by site, bit for bit -----------

Q, R = 0.5, 1.0


def _walk(y):
    """A local-level model: a random walk of ``len(y)`` scalar sites seen through noise."""
    x = y.new_zeros(())
    for t in pyro.markov(range(len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, Q))
        pyro.sample(f"y_{t}", dist.Normal(x, R), obs=y[t])


def _walk_data(T: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.cumsum(Q * torch.randn(T, generator=generator), 0)
    return x + R * torch.randn(T, generator=generator)


def _reference_step(elbo, guide, y, states: dict) -> float:
    """One step of the update as written for one block, `qnvb_update` site by site on the
    moments ``QuadratureELBO`` published, the scale written back through its transform's inverse
    where it changed and is finite (QNVB's rules for a block's parameters)."""
    loss = elbo.loss_and_grads(_walk, guide, y)
    store = pyro.get_param_store()
    with torch.no_grad():
        for name in store.keys():
            leaf = store._params[name]
            moments = published_moments(leaf)
            if moments is None:
                continue
            site = moments.site
            loc, scale = site.params["loc"], site.params["scale"]
            transform = transform_to(site.param_constraints["scale"])
            sigma = transform(scale.detach())
            state = states.setdefault(name, init_qnvb_state(loc.detach()))
            result = qnvb_update(loc.detach(), sigma, moments.g, moments.h, state, HP)
            new_u = transform.inv(result.sigma)
            keep = (result.sigma == sigma) | ~torch.isfinite(new_u)
            loc.data.copy_(result.mu)
            scale.data.copy_(torch.where(keep, scale.detach(), new_u))
            states[name] = result.state
    for leaf in store._params.values():
        leaf.grad = None
    return loss


def test_a_fit_of_a_hundred_scalar_sites_is_the_reference_update_bit_for_bit():
    y = _walk_data(100)
    runs = []
    for use_qnvb in (True, False):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoMeanFieldNormal(_walk)
        elbo = QuadratureELBO()
        optim = QNVB()
        svi = SVI(_walk, guide, optim, elbo)
        states: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # sigma_max in the first steps
            losses = [
                svi.step(y) if use_qnvb else _reference_step(elbo, guide, y, states)
                for _ in range(20)
            ]
        if use_qnvb:
            states = {
                name: QNVBState(**state)
                for name, state in optim.get_state()["qnvb"]["pairs"].items()
            }
        params = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
        runs.append((losses, params, states))
    (losses, params, states), (ref_losses, ref_params, ref_states) = runs
    # every block's loc and scale, and the ELBO's step count of its rotations
    assert len(params) == 201 and len(states) == 100
    assert losses == ref_losses
    assert equal_nested(params, ref_params, bits=True)
    assert equal_nested(states, ref_states, bits=True)


# -- the flat update's reads and writes of many small tensors: the reference, bit for bit -------


@pytest.mark.parametrize("shape", [(), (2,), (3,)], ids=["scalars", "pairs", "triples"])
@pytest.mark.parametrize("donate", [(), ("mu", "sigma", "state")], ids=["pure", "donated"])
def test_many_small_tensors_update_as_the_reference_bit_for_bit(shape, donate, monkeypatch):
    """Separate tensors of one shape are read by one ``stack`` and written by one ``unbind``
    where a chunk holds them whole (chunks of 64: pairs fill them whole, triples cross their
    boundaries and go piece by piece), their counts summed in one go; after the first step the
    inputs are the results (pieces of one buffer) or, donated, the same tensors again."""
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 64)
    generator = torch.Generator().manual_seed(3)
    mus = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(150)]
    sigmas = [torch.full_like(m, 0.5) for m in mus]
    states = [init_qnvb_state(m) for m in mus]
    for step in range(4):
        gs = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in mus]
        hs = [torch.rand(shape, generator=generator, dtype=torch.float64) - 0.2 for _ in mus]
        gs[7 * step + 1].fill_(math.nan)  # the guard keeps its coordinates, and counts them
        hs[5 * step + 2].fill_(math.inf)
        wanted = [qnvb_update(*args, HP) for args in zip(mus, sigmas, gs, hs, states)]
        results = qnvb_update_many(mus, sigmas, gs, hs, states, HP, donate=donate)
        for want, got in zip(wanted, results):
            assert equal_nested(tuple(want[:3]), tuple(got[:3]), bits=True)
            assert [int(c) for c in want[3:]] == [int(c) for c in got[3:]]
        assert sum(int(r.num_nonfinite) for r in results) > 0
        if donate:
            assert all(r.mu is m for r, m in zip(results, mus))
        mus = [r.mu for r in results]
        sigmas = [r.sigma for r in results]
        states = [r.state for r in results]


def test_a_donated_state_in_one_buffer_sharing_memory_with_a_gradient_is_named():
    """A field whose tensors are pieces of one buffer is tested as one span; the two tensors
    that share memory are still named."""
    mus = [torch.zeros(2) for _ in range(3)]
    buffer = torch.zeros(8 * 6)
    fields = [buffer[6 * k : 6 * k + 6].view(3, 2).unbind(0) for k in range(8)]
    states = [QNVBState(*(field[i] for field in fields)) for i in range(3)]
    gs = [torch.zeros(2), buffer[8:10], torch.zeros(2)]  # states[1].s_avg's memory
    with pytest.raises(ValueError, match=r"gs\[1\] and states\[1\].s_avg share memory"):
        qnvb_update_many(
            mus, [torch.ones(2)] * 3, gs, [torch.ones(2)] * 3, states, HP, donate=("state",)
        )
