"""``AutoMeanFieldNormal`` as a part of Pyro's ``AutoGuideList`` on a subsampled plate: the list
makes the plates of its parts, so the plate's subsample site is in the list's trace, not in the
part's own; the part raised ``KeyError`` with the plate's name on its first run, under every
ELBO. It now reads the indices from the list's plate."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList

from pyro_quadvi import QNVB, AutoMeanFieldNormal

N = 8
Y = torch.arange(N, dtype=torch.float64)


def model(y, idx):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 10.0))
    with pyro.plate("N", N, subsample=idx):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        pyro.sample("obs", dist.Normal(theta, 1.0), obs=y[idx])


def plates(y, idx):
    return pyro.plate("N", N, subsample=idx)


def test_a_list_part_records_the_lists_minibatch_and_qnvb_moves_only_those_rows(
    fresh_param_store,
):
    pyro.set_rng_seed(0)
    guide = AutoGuideList(model, create_plates=plates)
    part = AutoMeanFieldNormal(poutine.block(model, expose=["mu", "theta"]))
    guide.append(part)
    svi = SVI(model, guide, QNVB(), Trace_ELBO())
    guide(Y, torch.tensor([0, 1]))  # the parameters exist before the first step
    store = pyro.get_param_store()
    for step in range(8):
        idx = torch.tensor([(2 * step) % N, (2 * step + 1) % N])
        before = {name: store[name].detach().clone() for name in store.keys()}
        svi.step(Y, idx)
        factor, rows, mask = part._last_run["theta"]
        assert factor == N / 2 and torch.equal(rows[-1], idx) and mask is None
        for name in ("AutoGuideList.0.locs.theta", "AutoGuideList.0.scales.theta"):
            moved = (store[name].detach() != before[name]).nonzero().flatten()
            assert set(moved.tolist()) <= set(idx.tolist()), (step, name, moved)
    # every row was in some minibatch and has moved from its start
    assert (store["AutoGuideList.0.locs.theta"].detach() != 0).all()
