"""Session 21 (h1): QNVB on narrow floats, settings beyond the dtype's range, nodes the dtype
rounds back to the mean, and a start held by one overflowing step."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import init_to_value

from pyro_quadvi import QNVB, AutoMeanFieldNormal, AutoSpikeSlab, QuadratureELBO, SparseQNVB
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.optim.qnvb import held_site
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)


def _normal_mean(y: torch.Tensor, noise: float):
    def model():
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=y.dtype), 1e4))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu, noise), obs=y)

    return model


def _fit(model, steps: int, guide_kw: dict | None = None, **settings):
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model, **(guide_kw or {}))
    svi = SVI(model, guide, QNVB(**settings), QuadratureELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step()
    return guide, [str(w.message) for w in caught]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qnvb_refuses_a_guide_in_half_precision_naming_the_site(dtype):
    # under Pyro's ELBO: QuadratureELBO refuses such a guide before QNVB sees it (s27)
    y = torch.tensor([0.5, 1.0, 1.5], dtype=dtype)
    model = _normal_mean(y, 1.0)
    pyro.clear_param_store()
    svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), Trace_ELBO())
    with pytest.raises(TypeError, match=rf"QNVB: site 'mu' is {dtype}; .*torch.autocast"):
        svi.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_qnvb_refuses_a_spike_slab_guide_in_half_precision(dtype):
    # it ran silently: a bfloat16 fit put a slab mean at 37.75 where float32 gives 1.49
    def model():
        w = pyro.sample("w", SpikeSlab(torch.tensor(0.1, dtype=dtype), 2.0).expand([3]).to_event(1))
        pyro.sample("y", dist.Normal(w.sum(), 0.5), obs=torch.tensor(1.0, dtype=dtype))

    pyro.clear_param_store()
    guide = AutoSpikeSlab(model)
    svi = SVI(model, guide, SparseQNVB(num_epochs=3, steps_per_epoch=5), QuadratureELBO())
    with pytest.raises(TypeError, match=rf"SparseQNVB: site 'w' is {dtype}; .*torch.autocast"):
        svi.step()
    assert guide.locs.w.float().abs().max().item() < 3.0  # nothing was updated


def test_qnvb_refuses_a_sigma_max_beyond_float32():
    y = torch.tensor([0.5, 1.0, 1.5])
    with pytest.raises(ValueError, match=r"QNVB \(site 'mu'\): sigma_max=1e\+40 is beyond"):
        _fit(_normal_mean(y, 1.0), 1, sigma_max=1e40)


def test_nodes_that_round_to_the_mean_are_counted_in_both_updates():
    mu = torch.tensor([1000.0, 1000.0, 0.5])
    # float32's spacing at 1000 (in [2^9, 2^10)) is 2^9 * 1.19e-7 = 6.1e-5: 1e-6 is below it
    # (and its step's 1e-5 too), 1e-3 above; at 0.5 it is 6e-8, below 1e-7
    sigma = torch.tensor([1e-6, 1e-3, 1e-7])
    g, h = torch.ones(3), torch.ones(3)
    hp = QNVBHyperparameters()
    assert int(qnvb_update(mu, sigma, g, h, init_qnvb_state(mu), hp).num_unresolved) == 1
    (many,) = qnvb_update_many([mu], [sigma], [g], [h], [init_qnvb_state(mu)], hp)
    assert int(many.num_unresolved) == 1
    wide = qnvb_update(
        mu.double(), sigma.double(), g.double(), h.double(), init_qnvb_state(mu.double()), hp
    )
    assert int(wide.num_unresolved) == 0  # float64 resolves 1e-6 at 1000


def test_a_sigma_the_step_widens_past_the_spacing_is_not_counted_in_either_update():
    # rule 12 counts a coordinate whose sigma stays below the spacing at the mean after the
    # step: 1e-7 at a mean of 5 (spacing 4.8e-7) with a curvature asking for sigma 1 is widened
    # to 1e-6 (the rate limit) at once
    mu, sigma = torch.tensor([5.0, 1000.0]), torch.tensor([1e-7, 1e-7])
    g, h = torch.zeros(2), torch.ones(2)
    hp = QNVBHyperparameters()
    state = init_qnvb_state(mu)
    assert qnvb_update(mu, sigma, g, h, state, hp).sigma.tolist() == pytest.approx([1e-6] * 2)
    assert int(qnvb_update(mu, sigma, g, h, state, hp).num_unresolved) == 1  # 1e-6 < 6.1e-5
    (many,) = qnvb_update_many([mu], [sigma], [g], [h], [state], hp)
    assert int(many.num_unresolved) == 1


def test_a_tiny_init_scale_that_the_fit_widens_gives_no_resolution_warning():
    # init_scale=1e-7 at w = 5 (float32 spacing 6e-7 there): warned at step 1, then the fit
    # converged exactly, its sigma 5e4 times the spacing
    torch.manual_seed(0)
    x = torch.randn(100)
    y = 2 * x + 0.5 * torch.randn(100)

    def model():
        w = pyro.sample("w", dist.Normal(0.0, 10.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(w * x, 0.5), obs=y)

    start = {"init_scale": 1e-7, "init_loc_fn": init_to_value(values={"w": torch.tensor(5.0)})}
    guide, messages = _fit(model, 100, start)
    assert not [m for m in messages if "round back" in m]
    assert guide.locs.w.item() == pytest.approx(1.9433, abs=1e-3)
    assert guide.scales.w.item() == pytest.approx(0.0488, abs=1e-3)


def test_qnvb_warns_once_of_a_site_whose_nodes_round_to_its_mean():
    torch.manual_seed(0)
    y = 1000 + 1e-5 * torch.randn(100)  # posterior sd 1e-6 at a mean of 1000: float32 cannot
    start = {"init_loc_fn": init_to_value(values={"mu": torch.tensor(1000.0)})}
    guide, messages = _fit(_normal_mean(y, 1e-5), 30, start)
    unresolved = [m for m in messages if "round back" in m]
    assert len(unresolved) == 1
    assert "site 'mu'" in unresolved[0] and "torch.float32" in unresolved[0]
    assert "use float64" in unresolved[0]
    assert guide.scales.mu.item() > 2e-6  # what the warning is about: sigma too wide
    start = {"init_loc_fn": init_to_value(values={"mu": torch.tensor(1000.0).double()})}
    guide, messages = _fit(_normal_mean(y.double(), 1e-5), 30, start)
    assert not [m for m in messages if "round back" in m]
    assert guide.scales.mu.item() == pytest.approx(1e-6, rel=0.01)


def _poisson(x, y):
    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Poisson((w * x).exp()), obs=y)

    return model


def test_a_start_held_by_one_overflowing_step_is_named_not_blamed_on_sigma_min():
    torch.manual_seed(0)
    x = torch.rand(200, dtype=torch.float64) * 1000.0  # the first nodes' loss is 3.6e43
    y = torch.poisson((0.002 * x).exp())
    _, messages = _fit(_poisson(x, y), 12)
    held = [m for m in messages if "held nearly still by one past step" in m]
    assert len(held) == 1 and "site 'w'" in held[0]
    # the hold by the arithmetic of the averages, 2 ln(ratio) / -ln(betas[1]) (ratio 1.1e56)
    assert "a factor of 1.2e+112 in g^2, about 260,000 steps at betas[1]=0.999" in held[0]
    assert "For an overflowing start, start with a smaller init_scale" in held[0]
    assert "betas=(0, 0.5), about 370 steps" in held[0]
    assert not [m for m in messages if "sigma pinned at sigma_min" in m]
    # the advice works: started with nodes that do not overflow, the mean is not held
    guide, messages = _fit(_poisson(x, y), 12, {"init_scale": 1e-4})
    assert not [m for m in messages if "held nearly still" in m]
    assert guide.locs.w.item() == pytest.approx(0.002, abs=1e-4)


def test_a_fit_converging_normally_is_not_called_held():
    torch.manual_seed(0)
    y = 3.0 + torch.randn(50, dtype=torch.float64)
    guide, messages = _fit(_normal_mean(y, 1.0), 100)
    assert not [m for m in messages if "held nearly still" in m]
    assert abs(guide.locs.mu.item() - y.mean().item()) < 1e-3


def test_a_site_is_held_only_where_at_least_half_of_its_coordinates_are():
    # coordinate 0: one step holds the curvature average (h2_avg = n h_avg^2) and the gradient
    # is 1e5 below the past ones' root mean square; the others move as usual
    def state(held: int, size: int = 100) -> dict:
        h_avg = torch.ones(size)
        h2_avg = torch.ones(size)
        h2_avg[:held] = 10.0
        grad = torch.ones(size)
        grad[:held] = 1e-5
        return {
            "curvature_count": torch.full((size,), 10.0),
            "h_avg": h_avg,
            "h2_avg": h2_avg,
            "last_grad": grad,
            "s_avg": torch.ones(size),
        }

    assert held_site(state(1)) is None  # one weight of a hundred (the tutorial's false warning)
    assert held_site(state(49)) is None
    held = held_site(state(50))
    assert held is not None and int(held.sum()) == 50


def test_the_held_advice_of_faster_forgetting_releases_the_mean_when_it_says():
    # betas=(0, 0.5): the warning says about 370 steps; the loss leaves its held value at 369
    torch.manual_seed(0)
    x = torch.rand(200, dtype=torch.float64) * 1000.0
    y = torch.poisson((0.002 * x).exp())
    model = _poisson(x, y)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(betas=(0.0, 0.5)), QuadratureELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = [svi.step() for _ in range(400)]
    released = next(step for step, loss in enumerate(losses, 1) if loss < 1000.0)
    assert 340 <= released <= 400
    assert guide.locs.w.item() == pytest.approx(0.002, abs=1e-4)


def test_a_site_pinned_at_sigma_min_beside_a_held_one_keeps_its_warning():
    # the held site's warning replaces the sigma_min warning only where every pinned site is held
    torch.manual_seed(0)
    x = torch.rand(200, dtype=torch.float64) * 1000.0
    y = torch.poisson((0.002 * x).exp())
    z = 3.0 + 1e-9 * torch.randn(100, dtype=torch.float64)  # posterior sd 1e-9 < sigma_min

    def model():
        _poisson(x, y)()
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=z.dtype), 10.0))
        with pyro.plate("rows", len(z)):
            pyro.sample("z", dist.Normal(mu, 1e-8), obs=z)

    _, messages = _fit(model, 12)
    assert len([m for m in messages if "site 'w': its mean is held" in m]) == 1
    pinned = [m for m in messages if "sigma pinned at sigma_min" in m]
    assert len(pinned) == 1 and "at 2 coordinates" in pinned[0]
