"""Session 21 fixes from a trial on matrix latents and Pyro's examples."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, TraceEnum_ELBO, config_enumerate
from pyro.infer.reparam import TransformReparam
from torch.distributions.transforms import LowerCholeskyTransform

from pyro_quadvi import QNVB, opqa_evidence, to_inference_data
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO
from pyro_quadvi.infer.log_joint import latent_sites_of_model


def _centred_lkj(seen: list[torch.Size]):
    """Varying intercepts and slopes with an LKJ prior, written with `mu.unsqueeze(-2)`: batched
    over the draws, the log density of ``b`` broadcasts to ``(S, S, G)``; ``seen`` records the
    shapes of the log densities of ``b``."""

    class Recording(dist.MultivariateNormal):
        def log_prob(self, value):
            log_prob = super().log_prob(value)
            seen.append(log_prob.shape)
            return log_prob

    G = 4
    group = torch.arange(G).repeat_interleave(3)
    x = torch.linspace(-1.0, 1.0, len(group))
    y = 0.5 + 0.3 * x

    def model(group, x, y):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        tau = pyro.sample("tau", dist.HalfNormal(2.0).expand([2]).to_event(1))
        L = pyro.sample("L", dist.LKJCholesky(2, torch.tensor(2.0)))
        scale_tril = (tau.unsqueeze(-1) * L).unsqueeze(-3)
        with pyro.plate("groups", G):
            b = pyro.sample("b", Recording(mu.unsqueeze(-2), scale_tril=scale_tril))
        with pyro.plate("obs", len(y)):
            pyro.sample("y", dist.Normal(b[..., group, 0] + b[..., group, 1] * x, 1.0), obs=y)

    return model, (group, x, y)


def test_export_of_a_model_that_mis_broadcasts_never_makes_the_draws_squared():
    seen: list[torch.Size] = []
    model, args = _centred_lkj(seen)
    guide = AutoMeanFieldNormal(model)
    guide(*args)
    S = 200
    with pytest.warns(UserWarning, match="one by one|loop") as caught:
        idata = to_inference_data(model, guide, *args, num_samples=S, prior=False)
    # the warning says its shapes are the trial's, not the export's
    assert any("in a trial batched run of 2 draws" in str(w.message) for w in caught)
    assert idata.posterior.attrs["vectorized"] == 0
    assert idata.posterior["b"].shape == (1, S, 4, 2)
    # the batched trial on 2 draws made (2, 2, 4) and stopped there, never (S, S, 4)
    assert max(shape.numel() for shape in seen) == 2 * 2 * 4


def _gamma_at(loc: float, steps: int) -> str:
    """The message of an infinite log density of a ``Gamma(0.1, 1)`` latent whose guide was moved
    to ``loc`` (``exp(-1000)`` is 0 in float32: ``log Gamma(0 | 0.1, 1) = inf``) after ``steps``
    steps of the quadrature ELBO. The latent is an observation's scale: Pyro's validation, where
    on, refuses ``Normal(0, 0)`` as the model builds it, and the site is named from a run without
    it (`_name_the_invalid_site`); without validation, from the log densities."""

    def model():
        z = pyro.sample("z", dist.Gamma(0.1, 1.0))
        pyro.sample("y", dist.Normal(0.0, z), obs=torch.tensor(1.0))

    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model)
    elbo = QuadratureELBO()
    elbo.loss(model, guide)  # (does not advance the sequence)
    for _ in range(steps):
        elbo.loss_and_grads(model, guide)
    with torch.no_grad():
        guide.locs.z.fill_(loc)
    with pytest.raises(ValueError, match="site 'z' is not finite") as raised:
        elbo.loss(model, guide)
    return str(raised.value)


@pytest.mark.parametrize("validate", [True, False])
def test_an_infinite_log_density_after_steps_names_a_divergence(validate):
    """QNVB on Pyro's sparse_gamma_def diverged in 8 steps, a Gamma(0.1, ...) latent's exp
    underflowed to 0 (log density +inf), and the message said only to start the guide inside the
    support. A guide moved there by hand after 2 steps stands for that fit; the advice for a
    start is left out (with Pyro's validation, which refuses the value at the site, or without)."""
    with pyro.validation_enabled(validate):
        message = _gamma_at(-1000.0, steps=2)
    assert ("Expected parameter scale" in message) == validate  # (Pyro's refusal, appended)
    assert "moved from its start by steps of an optimizer: the fit may have diverged" in message
    assert "trust_region" in message and "a smaller lr" in message
    assert "start the guide inside it" not in message and "init_scale" not in message


@pytest.mark.parametrize("validate", [True, False])
def test_an_infinite_log_density_at_position_0_gives_both_advices(validate):
    """The same point at the ELBO's sequence position 0: the guide may be at its start, or moved
    by another ELBO, a loaded state_dict or an ELBO of another name (the second review), so
    both advices are given, the start's first."""
    with pyro.validation_enabled(validate):
        message = _gamma_at(-1000.0, steps=0)
    assert ("Expected parameter scale" in message) == validate
    assert "At the guide's start: where a latent sets the" in message
    assert "start the guide inside it" in message and "smaller init_scale" in message
    assert "After steps of an optimizer (the guide has moved): the fit may have diverged" in message
    assert "This is the guide's start" not in message


@config_enumerate
def _hmm(y):
    p = pyro.sample("p", dist.Beta(2.0, 2.0))
    locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    x = 0
    for t in pyro.markov(range(len(y))):
        transition = torch.stack([torch.stack([p, 1 - p]), torch.stack([1 - p, p])])
        x = pyro.sample(f"x_{t}", dist.Categorical(transition[x]))
        pyro.sample(f"y_{t}", dist.Normal(locs[x], 1.0), obs=y[t])


def test_the_enumeration_refusal_hides_every_enumerated_site_in_a_form_that_fits():
    """For Pyro's examples/hmm.py the refusal suggested hide=['x_0'] of 72 enumerated sites."""
    y = torch.tensor([0.0, 0.1, 3.0, 3.2, 0.2, 2.9])
    with pytest.raises(ValueError, match="marked for enumeration") as raised:
        latent_sites_of_model(_hmm, y)
    suggested = "poutine.block(model, hide_fn=lambda msg: bool(msg['infer'].get('enumerate')))"
    assert suggested in str(raised.value)
    # the suggestion, as written, fits with TraceEnum_ELBO and QNVB
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(eval(suggested, {"poutine": poutine, "model": _hmm}))
    svi = SVI(_hmm, guide, QNVB(), TraceEnum_ELBO(max_plate_nesting=0))
    losses = [svi.step(y) for _ in range(20)]
    assert all(math.isfinite(loss) for loss in losses)
    assert sorted(guide.median(y)) == ["locs", "p"]


_Y2 = torch.tensor([[0.3, -0.2], [1.1, 0.9], [-0.7, -0.4], [0.2, 0.5]])


def _wishart(y):
    P = pyro.sample("P", dist.Wishart(df=torch.tensor(4.0), covariance_matrix=torch.eye(2)))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.MultivariateNormal(torch.zeros(2), precision_matrix=P), obs=y)


def _lower_cholesky(y):
    base = dist.Normal(torch.zeros(2, 2), 1.0).to_event(2)
    L = pyro.sample("L", dist.TransformedDistribution(base, LowerCholeskyTransform()))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.MultivariateNormal(torch.zeros(2), scale_tril=L), obs=y)


def test_a_wishart_latent_is_refused_with_a_rewrite_not_a_reparameterizer_pyro_lacks():
    """The refusal sent a Wishart to "a reparameterizer of pyro.infer.reparam": Pyro has none."""
    pyro.clear_param_store()
    with pytest.raises(ValueError, match=r"latent site 'P' \(Wishart\)") as raised:
        QuadratureELBO().loss(_wishart, AutoMeanFieldNormal(_wishart), _Y2)
    message = str(raised.value)
    assert "pyro.infer.reparam has no reparameterizer for it" in message
    assert "L = scale.unsqueeze(-1) * L_corr, which is diag(scale) @ L_corr" in message
    assert "Bartlett decomposition" in message and "c_i ~ Chi2(df - i)" in message
    assert "poutine.reparam" not in message


def test_a_transformed_lower_cholesky_latent_is_sent_to_transform_reparam_which_fits():
    """The refusal names TransformReparam for a TransformedDistribution onto lower_cholesky, and
    the model wrapped as it says fits (its latent is the base's real ``L_base``)."""
    pyro.clear_param_store()
    with pytest.raises(ValueError, match=r"latent site 'L' \(TransformedDistribution\)") as raised:
        QuadratureELBO().loss(_lower_cholesky, AutoMeanFieldNormal(_lower_cholesky), _Y2)
    message = str(raised.value)
    assert "poutine.reparam(model, config={'L': TransformReparam()})" in message
    assert "latent 'L_base'" in message
    model = poutine.reparam(_lower_cholesky, config={"L": TransformReparam()})
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    losses = [svi.step(_Y2) for _ in range(20)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert [site.name for site in latent_sites_of_model(model, _Y2)] == ["L_base"]


def _lkj(y):
    d = y.shape[1]
    theta = pyro.sample("theta", dist.HalfNormal(torch.ones(d, dtype=y.dtype)).to_event(1))
    L = pyro.sample("L", dist.LKJCholesky(d, torch.ones((), dtype=y.dtype)))
    pyro.deterministic("corr", L @ L.transpose(-1, -2))
    scale_tril = theta.sqrt().unsqueeze(-1) * L
    with pyro.plate("n", len(y)):
        pyro.sample(
            "y",
            dist.MultivariateNormal(torch.zeros(d, dtype=y.dtype), scale_tril=scale_tril),
            obs=y,
        )


def test_a_cholesky_factor_exports_as_the_matrix_and_its_marginals_as_its_coordinates():
    """docs/arviz.md, "Matrix latents", and docs/evidence.md: ``L`` (3 x 3) exports with dims
    ``L_dim_0, L_dim_1``, its fixed entries constant (sd 0), ``corr`` beside it; OPQA's marginals
    of ``L`` are of its 3 unconstrained coordinates, whose tanh is ``L[1, 0]``."""
    y = torch.randn(12, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_lkj)
    guide(y)
    idata = to_inference_data(_lkj, guide, y, num_samples=50)
    L = idata.posterior["L"]
    assert L.dims == ("chain", "draw", "L_dim_0", "L_dim_1")
    assert idata.posterior["corr"].dims == ("chain", "draw", "corr_dim_0", "corr_dim_1")
    assert float(L[..., 0, 0].std()) == 0.0 and float(L[..., 0, 1].std()) == 0.0
    assert float(L[..., 1, 0].std()) > 0.01
    corr = torch.as_tensor(idata.posterior["corr"].values)
    assert torch.allclose(corr[..., 1, 0], torch.as_tensor(L[..., 1, 0].values))
    marginal = opqa_evidence(_lkj, y, num_points=3).posterior.marginals(num=5)["L"]
    assert marginal.values.shape == (5, 3) and not marginal.constrained
    z = torch.zeros(3, dtype=torch.float64)
    z[0] = 0.4
    factor = torch.distributions.biject_to(dist.constraints.corr_cholesky)(z)
    assert math.isclose(float(factor[1, 0]), math.tanh(0.4), rel_tol=1e-12)
