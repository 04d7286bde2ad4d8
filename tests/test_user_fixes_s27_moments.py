"""Session 27, trial t30: QNVB checks the moments ``QuadratureELBO`` published against the
gradients it is handed. A loss ``c`` times one ``QuadratureELBO``'s has its moments divided by
``c``; a loss with other terms, or moments of another backward pass, is read from its gradients.
Each against the closed-form mean field of a 3-d linear-Gaussian model."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_quadvi.optim.qnvb as qnvb_module
from pyro_quadvi.guides import AutoMeanFieldNormal
from pyro_quadvi.infer import QuadratureELBO
from pyro_quadvi.optim import QNVB

D, N = 3, 20
LOC, SCALE = "AutoMeanFieldNormal.locs.z", "AutoMeanFieldNormal.scales.z"


def _data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    return x, y + torch.randn(rows, generator=g, dtype=torch.float64)


X, Y = _data(N, 0)
X2, Y2 = _data(30, 1)


def _model(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """``z ~ N(0, I)``, ``y ~ N(x z, 1)``; ``rows``: a minibatch of a plate of ``N`` rows."""
    z = pyro.sample("z", dist.Normal(torch.zeros(D, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("n", x.shape[0], subsample=rows) as i:
        pyro.sample("y", dist.Normal((x[i] * z).sum(-1), 1.0), obs=y[i])


def _exact(*parts: tuple[torch.Tensor, torch.Tensor], penalty: float = 0.0):
    """The optimum of the sum of the ELBOs of ``parts`` (each with its prior and entropy), plus
    ``penalty * |loc|^2``: means and standard deviations."""
    precision = sum(x.T @ x + torch.eye(D, dtype=torch.float64) for x, _ in parts)
    mu = torch.linalg.solve(precision + 2 * penalty * torch.eye(D), sum(x.T @ y for x, y in parts))
    return mu, (len(parts) / torch.diag(precision)).sqrt()


def _fit(loss, steps: int, backward_twice: bool = False, validation=None):
    """``steps`` QNVB steps on ``loss(guide)``, the gradients cleared (``None``) after each, and
    ``validation(guide)``'s backward (its gradients cleared too) before each; the guide's means
    and standard deviations."""
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_model)
    guide(X, Y)
    params = [pyro.param(LOC).unconstrained(), pyro.param(SCALE).unconstrained()]
    optim = QNVB()
    for _ in range(steps):
        if validation is not None:
            validation(guide).backward()
            for p in params:
                p.grad = None
        value = loss(guide)
        if backward_twice:
            value.backward(retain_graph=True)
        value.backward()
        optim(params)
        for p in params:
            p.grad = None
    return pyro.param(LOC).detach(), pyro.param(SCALE).detach()


def _assert_at(fit, exact, tol: float) -> None:
    (mu, sd), (mu_exact, sd_exact) = fit, exact
    assert ((mu - mu_exact) / sd_exact).abs().max().item() < tol
    assert (sd / sd_exact - 1).abs().max().item() < tol


ELBO = QuadratureELBO("gauss_hermite")


def _gh(guide, x=X, y=Y, rows=None):
    return ELBO.differentiable_loss(_model, guide, x, y, rows)


@pytest.mark.parametrize("factor", [1.0 / N, 2.0])
def test_a_loss_scaled_by_a_constant_reaches_the_same_optimum(float64_store, factor):
    # trial t30 item 1: SVI(loss=differentiable_loss / N) had sd ratio sqrt(N) = 4.4721 (2 *
    # loss: 0.7071); the moments carry the factor, the gradients of the scale tell it
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_model)
    svi = SVI(_model, guide, QNVB(), lambda m, g, *a: factor * ELBO.differentiable_loss(m, g, *a))
    for _ in range(30):
        svi.step(X, Y)
    _assert_at((pyro.param(LOC).detach(), pyro.param(SCALE).detach()), _exact((X, Y)), 1e-10)


def test_two_backward_passes_and_two_accumulated_minibatches_reach_the_optimum(float64_store):
    # item 2: loss.backward() twice (retain_graph) had sd ratio 0.7071, and so had two
    # minibatches accumulated without dividing by 2 (here the two halves: twice the whole ELBO)
    _assert_at(_fit(_gh, 30, backward_twice=True), _exact((X, Y)), 1e-10)
    halves = torch.arange(N).reshape(2, N // 2)
    both = _fit(lambda g: _gh(g, rows=halves[0]) + _gh(g, rows=halves[1]), 30)
    _assert_at(both, _exact((X, Y)), 1e-10)


def test_two_quadrature_elbo_terms_on_one_guide_reach_their_sum_s_optimum(float64_store):
    # item 3 (multi-task): the optimum has sd^2 = 2 / (h1 + h2); QNVB gave 1 / (h1 + h2)
    fit = _fit(lambda g: _gh(g) + _gh(g, X2, Y2), 30)
    _assert_at(fit, _exact((X, Y), (X2, Y2)), 1e-10)


def test_a_penalty_on_the_guide_s_locs_is_not_ignored(float64_store):
    # item 4b: with + 5 |loc|^2 QNVB sat at the unpenalised optimum (to 1e-15); the gradients
    # hold the penalty, so QNVB reads the site from them, with a warning naming it
    def penalised(guide):
        return _gh(guide) + 5 * (pyro.param(LOC) ** 2).sum()

    with pytest.warns(RuntimeWarning, match="the gradients of site 'z' are not those of the loss"):
        fit = _fit(penalised, 80)
    _assert_at(fit, _exact((X, Y), penalty=5.0), 1e-8)


def test_a_trace_elbo_term_beside_a_quadrature_elbo_term_is_not_ignored(float64_store):
    # item 4a: GH(X, Y) + Trace_ELBO(X2, Y2): QNVB sat at the GH term's optimum alone; averaged
    # (the entropy counted once, as the gradient read assumes) QNVB reaches the sum's optimum
    pyro.set_rng_seed(0)
    trace = Trace_ELBO(num_particles=16, vectorize_particles=True)

    def mean(guide):
        return (_gh(guide) + trace.differentiable_loss(_model, guide, X2, Y2)) / 2

    with pytest.warns(RuntimeWarning, match="the gradients of site 'z' are not those of the loss"):
        fit = _fit(mean, 60)
    _assert_at(fit, _exact((X, Y), (X2, Y2)), 0.1)
    mu_alone, sd_alone = _exact((X, Y))
    assert ((fit[0] - mu_alone) / sd_alone).abs().max().item() > 1.0


def test_moments_of_a_validation_backward_are_not_stepped_on(float64_store):
    # item 5: a validation loss's backward, its gradients cleared (p.grad = None), then the
    # training loss's: QNVB summed both sets of moments (mu 0.98 sd off)
    with pytest.warns(RuntimeWarning, match="the moments are another backward pass's"):
        fit = _fit(_gh, 30, validation=lambda g: _gh(g, X2, Y2))
    _assert_at(fit, _exact((X, Y)), 1e-10)


def test_moments_whose_loc_has_no_gradient_are_dropped(float64_store):
    # item 5: moments outliving the gradients they came with (all cleared): QNVB stepped on them
    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(_model)
    guide(X, Y)
    params = [pyro.param(LOC).unconstrained(), pyro.param(SCALE).unconstrained()]
    before = [p.detach().clone() for p in params]
    _gh(guide).backward()
    for p in params:
        p.grad = None
    QNVB()(params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_quadrature_elbo_s_moments_are_stepped_on_as_published(monkeypatch, dtype):
    # the plain step keeps the published tensors themselves (no division by a c of 1 up to
    # rounding), at every step of a fit, in float32 as in float64
    taken = []

    def record(leaf):
        moments = published(leaf)
        taken.append(moments)
        return moments

    published = qnvb_module.published_moments
    monkeypatch.setattr(qnvb_module, "published_moments", record)
    pyro.clear_param_store()
    x, y = X.to(dtype) * 3, Y.to(dtype) * 3

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(D, dtype=dtype), 1.0).to_event(1))
        with pyro.plate("n", N):
            pyro.sample("y", dist.Normal((x * z).sum(-1), 0.5), obs=y)

    optim = QNVB()
    svi = SVI(model, AutoMeanFieldNormal(model), optim, ELBO)
    stepped = []
    find_blocks = optim.find_blocks
    monkeypatch.setattr(
        optim, "find_blocks", lambda *a: stepped.append(find_blocks(*a)) or stepped[-1]
    )
    for _ in range(30):
        svi.step()
    assert len(stepped) == 30
    for (blocks, _), moments in zip(stepped, [m for m in taken if m is not None]):
        assert blocks[0].moments is moments


@pytest.mark.parametrize(
    "fallback, words",
    [
        (
            pyro.optim.Adam,
            "got pyro.optim.Adam (pyro.optim.Adam uncalled: call it with its "
            "arguments, fallback=pyro.optim.Adam({'lr': 0.01}))",
        ),
        (
            torch.optim.SGD,
            "got torch.optim.SGD (a class alone: pair it with its arguments, "
            "fallback=(torch.optim.SGD, {'lr': 0.01}))",
        ),
    ],
)
def test_an_uncalled_fallback_is_named_with_the_call_it_needs(fallback, words):
    # item 9: QNVB(fallback=pyro.optim.Adam) said "got <function <lambda>.<locals>.<lambda> ...>"
    with pytest.raises(ValueError) as error:
        QNVB(fallback=fallback)
    assert str(error.value).endswith(words)


def test_the_sampled_check_still_catches_a_scaled_loss_and_a_penalty_on_a_large_block(
    float64_store,
):
    # session 27, f29: the check compares at most CHECKED_COORDINATES coordinates of a block
    # (here every 3rd of 200); a loss 2 * GH has its moments halved, a penalty on the whole
    # site's locs sends the site to its gradients, with the warning naming it
    d = 200
    assert d > qnvb_module.CHECKED_COORDINATES
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, d, generator=g, dtype=torch.float64)
    y = x @ torch.randn(d, generator=g, dtype=torch.float64)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("n", N):
            pyro.sample("y", dist.Normal((x * w).sum(-1), 1.0), obs=y)

    def blocks(loss):
        pyro.clear_param_store()
        guide = AutoMeanFieldNormal(model)
        guide()
        params = [
            pyro.param(f"AutoMeanFieldNormal.{k}.w").unconstrained() for k in ("locs", "scales")
        ]
        with torch.no_grad():  # locs away from 0, where the penalty's gradient is 0
            params[0].copy_(torch.linspace(-1.0, 1.0, d))
        # a new ELBO each time, at the start of its rule's sequence, from one seed
        # (Gauss-Hermite's 3^200 nodes would be too many)
        pyro.set_rng_seed(0)
        loss(guide, QuadratureELBO()).backward()
        found, _ = QNVB().find_blocks(params)
        return [b.moments for b in found]

    (plain,) = blocks(lambda guide, elbo: elbo.differentiable_loss(model, guide))
    (halved,) = blocks(lambda guide, elbo: 2 * elbo.differentiable_loss(model, guide))
    assert torch.allclose(halved.g, plain.g, rtol=1e-12, atol=0)  # published 2 g, divided by 2
    assert torch.allclose(halved.h, plain.h, rtol=1e-12, atol=0)
    assert not torch.equal(halved.h, 2 * plain.h)

    def penalised(guide, elbo):
        return (
            elbo.differentiable_loss(model, guide)
            + 5 * (pyro.param(LOC.replace("z", "w")) ** 2).sum()
        )

    with pytest.warns(RuntimeWarning, match="the gradients of site 'w' are not those of the loss"):
        (moments,) = blocks(penalised)
    assert moments is None  # read from the gradients
