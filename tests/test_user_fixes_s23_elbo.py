"""Session 23: what a guide run on other data, a guide built without the observations and a
``torch.func`` transform met in `QuadratureELBO`.

- A guide fitted on data of one width and stepped on data of another gave torch's bare size
  error after a false vectorization warning, or, where the old shape broadcasts (a guide of
  width 1, an elementwise model of width 4), a silent wrong fit: one weight for every column,
  its prior counted once per column. Now refused by site, with both shapes.
- A guide built with ``y=None`` samples ``y``; under ``gauss_hermite`` the rule's node count
  (3 points in 51 dims) was refused first, not the cause.
- ``torch.func.grad`` over ``functional_call`` of the local-mode loss raised torch's bare
  ``setup_context`` message.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO


def _regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("rows", x.shape[0]):
        pyro.sample("y", dist.Normal((x * w).sum(-1), 1.0), obs=y)


def _data(rows, width, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator)
    return x, x.sum(-1)


@pytest.mark.parametrize("vectorize", [True, False, None])
def test_a_guide_fitted_on_one_width_is_refused_on_another(vectorize):
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_regression)
    svi = SVI(_regression, guide, QNVB(), QuadratureELBO(vectorize=vectorize))
    svi.step(*_data(20, 3, 0))
    wider = _data(20, 4, 1)
    words = r"latent site 'w': the guide gives it shape \(3,\), .* has shape \(4,\).*new guide"
    with pytest.raises(ValueError, match=words):
        svi.step(*wider)
    with pytest.raises(ValueError, match=words):
        svi.evaluate_loss(*wider)


def test_a_guide_of_width_one_no_longer_fits_every_column_with_one_weight():
    # (x * w).sum(-1) broadcasts a w of shape (1,) over 4 columns: the fit ran, its median
    # one number for the four weights 1, -1, 2, 0.5
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_regression)
    svi = SVI(_regression, guide, QNVB(), QuadratureELBO())
    svi.step(*_data(20, 1, 0))
    with pytest.raises(ValueError, match=r"shape \(1,\), .* has shape \(4,\)"):
        svi.step(*_data(50, 4, 1))


def test_a_site_in_a_plate_broadcast_by_it_is_no_mismatch():
    # the model's Normal(0, 1) has shape (); the plate broadcasts it to the guide's (5,):
    # the fit's means are the closed form's, y / 2 for a unit prior and a unit noise
    y = torch.tensor([0.6, -1.2, 2.4, 0.0, 1.8])

    def local(y):
        with pyro.plate("groups", 5):
            theta = pyro.sample("theta", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(theta, 1.0), obs=y)

    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(local)
    svi = SVI(local, guide, QNVB(), QuadratureELBO())
    for _ in range(30):
        svi.step(y)
    assert torch.allclose(guide.median()["theta"], y / 2, atol=1e-4)


def test_a_guide_built_without_the_observations_is_named_before_the_rules_node_count():
    pyro.clear_param_store()
    x, y = _data(50, 1, 0)
    guide = AutoMeanFieldNormal(_regression)
    guide(x)  # y=None: the guide samples the 50 y's as latents
    svi = SVI(_regression, guide, QNVB(), QuadratureELBO(rule="gauss_hermite"))
    with pytest.raises(ValueError, match="the guide samples 'y', which the model observes") as e:
        svi.step(x, y)
    assert "3^51" in str(e.value.__cause__)  # the rule's refusal, kept as the cause


def test_torch_func_grad_over_the_local_mode_loss_is_refused_by_name():
    pyro.clear_param_store()
    x, y = _data(20, 2, 0)
    guide = AutoMeanFieldNormal(_regression)
    loss_fn = QuadratureELBO()(_regression, guide)
    loss_fn(x, y)
    params = dict(loss_fn.named_parameters())

    def loss(p):
        return torch.func.functional_call(loss_fn, p, (x, y))

    with pytest.raises(RuntimeError, match=r"torch.func transform.*torch.autograd.grad"):
        torch.func.grad(loss)(params)
    # the way the message gives: the gradient of the loss, as svi.step takes it
    value = loss_fn(x, y)
    grads = torch.autograd.grad(value, list(params.values()))
    assert all(bool(torch.isfinite(g).all()) and bool(g.ne(0).any()) for g in grads)
