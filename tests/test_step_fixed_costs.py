"""The trimmed fixed costs of one ``SVI`` + ``QNVB`` + ``QuadratureELBO`` step (issue 11) leave
every result as it was: each fast path against the slow one it replaces, or a closed form."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributions import IidNormal
from pyro_quadvi.guides import interface
from pyro_quadvi.infer import LogJoint, latent_sites_of_model
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import qnvb as qnvb_module
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)

X = torch.linspace(-1, 1, 10, dtype=torch.float64)
Y = 0.4 - 0.7 * X + 0.2 * torch.sin(5 * X)


def _regression():
    """A model with a real vector, a real scalar and a positive latent (a log-Jacobian)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.5).to_event(1))
    b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=X.dtype), 2.0))
    s = pyro.sample("s", dist.LogNormal(torch.tensor(-1.0, dtype=X.dtype), 0.5))
    mean = b + w[..., 0] * X + w[..., 1] * X**2
    with pyro.plate("data", len(X)):
        pyro.sample("y", dist.Normal(mean, s), obs=Y)


# -- LogJoint: no log-Jacobian for identity transforms, one split of the points ---------------


@pytest.mark.parametrize("vectorize", [True, False])
def test_log_joint_and_its_gradient_equal_the_hand_written_density(vectorize):
    # log p(x, T(z)) + log|J_T(z)|: the real sites add nothing, the positive one log s = z_s
    sites = latent_sites_of_model(_regression)
    assert [site.name for site in sites] == ["w", "b", "s"]
    z = torch.tensor(
        [[0.3, -0.2, 0.1, -1.2], [-0.5, 0.8, -0.4, -0.7], [1.1, 0.0, 0.6, -1.6]],
        dtype=torch.float64,
        requires_grad=True,
    )
    value = LogJoint(_regression, sites, max_plate_nesting=1)(z, vectorize=vectorize)

    def by_hand(point):
        w, b, u = point[:2], point[2], point[3]
        s = u.exp()
        mean = b + w[0] * X + w[1] * X**2
        zero = torch.zeros((), dtype=torch.float64)  # float64 parameters, as the model's
        return (
            dist.Normal(zero, 1.5).log_prob(w).sum()
            + dist.Normal(zero, 2.0).log_prob(b)
            + dist.LogNormal(zero - 1, 0.5).log_prob(s)
            + u  # log|ds/du|
            + dist.Normal(mean, s).log_prob(Y).sum()
        )

    expected = torch.stack([by_hand(point) for point in z])
    torch.testing.assert_close(value, expected, rtol=1e-13, atol=1e-12)
    (grad,) = torch.autograd.grad(value.sum(), z)
    (want,) = torch.autograd.grad(expected.sum(), z)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


# -- the Normal priors take their numbers once (distributions.IidNormal) ----------------------


@pytest.mark.parametrize(
    "prior, loc, exact",
    [
        (priors.Normal(1.0), 0.0, True),
        (priors.Normal(0.3, loc=0.2), 0.2, False),
        (priors.LayerwiseNormal("kaiming"), 0.0, False),
    ],
)
def test_normal_priors_equal_torch_normal_with_full_parameters(prior, loc, exact):
    param = torch.zeros(5, 3)
    fn = prior("0.weight", param)
    scale = fn.scale[0, 0].item()
    reference = dist.Normal(torch.full_like(param, loc), torch.full_like(param, scale))
    assert isinstance(fn, dist.Normal) and fn.batch_shape == param.shape
    assert fn.loc.untyped_storage().nbytes() == param.element_size()  # one number, expanded
    values = torch.randn(4, 1, 5, 3, generator=torch.Generator().manual_seed(1))
    values.requires_grad_()
    got, want = fn.log_prob(values), reference.log_prob(values)
    (grad,) = torch.autograd.grad(got.sum(), values)
    (grad_want,) = torch.autograd.grad(want.sum(), values)
    if exact:  # loc 0, scale 1: the same operations up to exact ones
        assert torch.equal(got, want) and torch.equal(grad, grad_want)
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-6)
    torch.testing.assert_close(grad, grad_want, rtol=2e-7, atol=1e-7)
    expanded = fn.expand((4, 1, 5, 3))  # as a particle plate does
    assert type(expanded) is type(fn) and torch.equal(expanded.log_prob(values), got)
    with pytest.raises(ValueError, match="within the support"):
        fn.log_prob(torch.full((5, 3), math.nan))


@pytest.mark.parametrize("prior", [priors.Normal(0.7, loc=0.2), priors.LayerwiseNormal()])
def test_pyros_loc_scale_reparam_rebuilds_the_prior_of_a_bayesian_module(prior):
    # LocScaleReparam rebuilds a site's Normal as type(fn)(loc=..., scale=...): the weight is
    # then loc + scale * (its decentered draw), with the prior's own numbers
    from pyro import poutine
    from pyro.infer.reparam import LocScaleReparam

    net = nn.Linear(3, 1)
    bnn = BayesianModule(net, prior, likelihoods.Gaussian(scale=0.1))
    fn = prior("weight", net.weight)
    loc, scale = fn.loc[0, 0].item(), fn.scale[0, 0].item()
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    reparam = poutine.reparam(bnn, {"weight": LocScaleReparam(0.0)})
    trace = poutine.trace(reparam).get_trace(x, x.sum(-1, keepdim=True))
    decentered = trace.nodes["weight_decentered"]
    standard = decentered["fn"].base_dist  # the site's event dims: Independent(Normal)
    assert torch.equal(standard.loc, torch.zeros(1, 3))
    assert torch.equal(standard.scale, torch.ones(1, 3))
    torch.testing.assert_close(trace.nodes["weight"]["value"], loc + scale * decentered["value"])


def test_normal_prior_refuses_a_non_finite_loc():
    with pytest.raises(ValueError, match="finite loc and scale > 0"):
        priors.Normal(1.0, loc=math.inf)("w", torch.zeros(2))


# -- QNVB: the flat update's guard, the finish of whole blocks together, no describing --------


def test_the_flat_update_without_a_guarded_coordinate_equals_the_reference():
    # every coordinate finite: the guard's selections are skipped; values as the reference's,
    # and no result is one of the arguments (weight 1, no prior: the new last_grad is g)
    gen = torch.Generator().manual_seed(3)
    shapes = [(4, 3), (5,), (1,)]
    mus = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    sigmas = [torch.rand(s, generator=gen, dtype=torch.float64) + 0.1 for s in shapes]
    states = [init_qnvb_state(mu) for mu in mus]
    hp = QNVBHyperparameters()
    for _ in range(3):
        gs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        hs = [torch.rand(s, generator=gen, dtype=torch.float64) for s in shapes]
        fast = qnvb_update_many(mus, sigmas, gs, hs, states, hp)
        for i, result in enumerate(fast):
            want = qnvb_update(mus[i], sigmas[i], gs[i], hs[i], states[i], hp)
            assert torch.equal(result.mu, want.mu) and torch.equal(result.sigma, want.sigma)
            for got, expected in zip(result.state, want.state):
                assert torch.equal(got, expected)
            arguments = (mus[i], sigmas[i], gs[i], hs[i], *states[i])
            pointers = {t.untyped_storage().data_ptr() for t in arguments}
            for t in (result.mu, result.sigma, *result.state):
                assert t.untyped_storage().data_ptr() not in pointers
        mus = [r.mu for r in fast]
        sigmas = [r.sigma for r in fast]
        states = [r.state for r in fast]


FEATURES = torch.randn(12, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def _local_model(x, y):
    """Global weights (37 and 19 of them: longer than a vector register, so a transform's
    scalar tail matters), a scalar, and a local offset per row in a subsampled plate (a block
    updated on its minibatch's rows)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(37, dtype=x.dtype), 1.0).to_event(1))
    v = pyro.sample("v", dist.Normal(torch.zeros(19, dtype=x.dtype), 1.0).to_event(1))
    c = pyro.sample("c", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0))
    with pyro.plate("rows", 12, subsample_size=4) as idx:
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 0.5))
        lead = w.shape[:-2]  # the particle dim of a vectorized pass, else none
        projected = (w.reshape(-1, 37) @ FEATURES[idx].T).reshape((*lead, len(idx)))
        mean = projected + 0.1 * v.sum(-1) * x[idx] + c + a
        pyro.sample("y", dist.Normal(mean, 0.3), obs=y[idx])


@pytest.mark.usefixtures("fresh_param_store")
@pytest.mark.parametrize("alone", ["written", "updated"])
def test_blocks_finished_together_equal_blocks_finished_one_by_one(alone, monkeypatch):
    # a step updates the global blocks on all their entries (transformed, written and their
    # states rebound together) and the local one on its minibatch's rows (written on its own):
    # the same SVI run with every block written on its own, or updated on its own by the
    # reference update, gives the same parameters and states, bit for bit
    x = torch.linspace(-1, 1, 12, dtype=torch.float64)
    y = 1.0 - 0.5 * x + 0.1 * torch.cos(3 * x)

    def run(together: bool):
        pyro.clear_param_store()
        pyro.set_rng_seed(4)
        if not together and alone == "written":
            monkeypatch.setattr(qnvb_module.QNVB, "_whole", staticmethod(lambda item: False))
        elif not together:
            monkeypatch.setattr(qnvb_module, "_FAMILY_BATCH_UPDATES", {})
        guide = AutoMeanFieldNormal(_local_model)
        optim = QNVB()
        svi = SVI(_local_model, guide, optim, QuadratureELBO("hadamard", num_points=4))
        losses = [svi.step(x, y) for _ in range(12)]
        monkeypatch.undo()
        params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        return losses, params, optim.get_state()["qnvb"]["pairs"]

    losses_a, params_a, states_a = run(together=True)
    losses_b, params_b, states_b = run(together=False)
    assert losses_a == losses_b and len(states_a) == 4
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    for block in states_a:
        for key in states_a[block]:
            assert torch.equal(states_a[block][key], states_b[block][key]), (block, key)


def _mixed_dtype_model():
    a = pyro.sample("a", dist.Normal(torch.zeros(37), 1.0).to_event(1))  # float32
    b = pyro.sample("b", dist.Normal(torch.zeros(19, dtype=torch.float64), 1.0).to_event(1))
    x = torch.linspace(-1, 1, 16, dtype=torch.float64)
    mean = a.double().sum(-1, keepdim=True) * x + b.sum(-1, keepdim=True)
    pyro.sample("y", dist.Normal(mean, 0.5).to_event(1), obs=x.sin())


@pytest.mark.usefixtures("fresh_param_store")
def test_blocks_of_different_dtypes_are_not_updated_in_one_buffer(monkeypatch):
    # a float32 and a float64 site share family and hyperparameters; in one buffer the float32
    # scales would be transformed in float64 and differ in their last bits from the reference
    def run(together: bool):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        if not together:
            monkeypatch.setattr(qnvb_module, "_FAMILY_BATCH_UPDATES", {})
        guide = AutoMeanFieldNormal(_mixed_dtype_model)
        svi = SVI(_mixed_dtype_model, guide, QNVB(), QuadratureELBO("hadamard", num_points=4))
        losses = [svi.step() for _ in range(4)]
        monkeypatch.undo()
        return losses, {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    losses_a, params_a = run(together=True)
    losses_b, params_b = run(together=False)
    assert losses_a == losses_b
    for name in params_a:
        assert params_a[name].dtype == params_b[name].dtype
        assert torch.equal(params_a[name], params_b[name]), name


class _Counting:
    """``describe_guide`` of the guide interface (QNVB describes through it), counting its calls."""

    def __init__(self, describe):
        self.describe, self.calls = describe, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.describe(*args, **kwargs)


@pytest.mark.usefixtures("fresh_param_store")
def test_qnvb_describes_no_guide_when_published_moments_cover_its_parameters(monkeypatch):
    # with QuadratureELBO's moments for every parameter QNVB describes no live guide; a parameter
    # they do not cover (here an extra tensor handed to the optimizer) makes it describe them,
    # and the guide's parameters come out the same either way
    counter = _Counting(interface.describe_guide)
    monkeypatch.setattr(interface, "describe_guide", counter)

    def run(extra: bool):
        pyro.clear_param_store()
        pyro.set_rng_seed(2)
        counter.calls = 0
        guide = AutoMeanFieldNormal(_regression)
        stranger = torch.zeros(3, requires_grad=True)

        class WithStranger(QNVB):
            def __call__(self, params, *args, **kwargs):
                stranger.grad = torch.ones(3)
                super().__call__([*params, stranger], *args, **kwargs)

        optim = WithStranger() if extra else QNVB()
        svi = SVI(_regression, guide, optim, QuadratureELBO("hadamard", num_points=4))
        for _ in range(4):
            svi.step()
        params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        return params, counter.calls, stranger.detach().clone()

    fast, fast_calls, _ = run(extra=False)
    slow, slow_calls, moved = run(extra=True)
    assert fast_calls == 0 and slow_calls >= 4
    assert not torch.equal(moved, torch.zeros(3))  # the stranger went to the fallback (Adam)
    assert fast.keys() == slow.keys()
    for name in fast:
        assert torch.equal(fast[name], slow[name]), name


@pytest.mark.usefixtures("fresh_param_store")
def test_qnvb_describes_only_the_live_guides_holding_its_parameters(monkeypatch):
    # reading the gradients (Trace_ELBO) QNVB describes live guides to pair its parameters; a
    # guide of another model (or a stale one, whose parameters left the param store and whose
    # description then failed with a KeyError) holds none of them and is not described
    described = []

    def recording(guide, *args, **kwargs):
        described.append(guide)
        return describe(guide, *args, **kwargs)

    describe = interface.describe_guide
    monkeypatch.setattr(interface, "describe_guide", recording)
    optim = QNVB()  # from here on every describable guide that runs is live
    other = AutoMeanFieldNormal(lambda: pyro.sample("q", dist.Normal(0.0, 1.0)))
    other()
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(_regression)
    svi = SVI(_regression, guide, optim, Trace_ELBO())
    for _ in range(3):
        svi.step()
    assert len(described) == 3 and all(d is guide for d in described)


def test_not_finite_is_the_complement_of_isfinite():
    for dtype in (torch.float32, torch.float64):
        big = torch.finfo(dtype).max
        values = [0.0, -0.0, 1e-300, -big, big, math.inf, -math.inf, math.nan, 1.0]
        t = torch.tensor(values, dtype=dtype)
        assert torch.equal(qnvb_module._not_finite_mask(t), ~torch.isfinite(t))


@pytest.mark.parametrize("where", [0, 2])
def test_a_non_finite_term_is_named_and_finite_terms_that_overflow_are_refused(where):
    # the log joint checks its total once; a non-finite total names the site (a NaN datum), and
    # finite terms whose sum overflows are refused with the fix (float64), not returned as -inf
    def model(data):
        a = pyro.sample("a", dist.Normal(torch.zeros(()), 1.0))
        for i in range(3):
            pyro.sample(f"y{i}", dist.Normal(a, 1.0), obs=data[i])

    sites = latent_sites_of_model(model, torch.zeros(3))
    bad = torch.zeros(3)
    bad[where] = math.nan
    joint = LogJoint(model, sites, max_plate_nesting=0)
    with pyro.validation_enabled(False), pytest.raises(ValueError, match=f"data of 'y{where}'"):
        joint(torch.zeros(2, 1), (bad,))  # (validation would refuse the datum first)
    huge = torch.full((3,), 1.8e19)  # each log density about -1.6e38, finite; the sum is -inf
    with pytest.raises(ValueError, match=r"overflows torch.float32 at quadrature node 0.*'y0'"):
        LogJoint(model, sites, max_plate_nesting=0)(torch.zeros(2, 1), (huge,))
    # in float64 the same terms sum to a finite total: three times one of them
    joint = LogJoint(model, sites, max_plate_nesting=0)(
        torch.zeros(2, 1, dtype=torch.float64), (huge.double(),)
    )
    one = dist.Normal(0.0, 1.0).log_prob(torch.tensor(1.8e19, dtype=torch.float64))
    torch.testing.assert_close(joint, torch.full((2,), 3 * one.item(), dtype=torch.float64))


# -- QuadratureELBO: published moments as views of the node gradients' sums -------------------


@pytest.mark.usefixtures("fresh_param_store")
def test_published_moments_equal_the_guide_gradients_and_share_one_buffer():
    # dL/dloc = g and dL/dsigma = sigma h - 1 / sigma (the ELBO's module docstring): the moments
    # published at scale factor 1 are the autograd gradients, as pieces of one buffer
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    bnn = BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(scale=0.5))
    x = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = x.sum(-1)
    guide = AutoMeanFieldNormal(bnn)
    guide(x, y)
    elbo = QuadratureELBO("hadamard", num_points=4)
    loss = elbo.differentiable_loss(bnn, guide, x, y)
    description = guide.quadrature_description()
    leaves = [leaf for site in description.sites for leaf in site.params.values()]
    grads = torch.autograd.grad(loss, leaves)
    pieces = []
    for i, site in enumerate(description.sites):
        moments = qnvb_module.published_moments(site.params["loc"])
        assert moments is not None and moments.site.scale_factor == 1.0
        sigma = site.scale.detach()
        dsigma_du = torch.sigmoid(site.params["scale"].detach())  # softplus'
        torch.testing.assert_close(moments.g, grads[2 * i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            sigma * moments.h - 1 / sigma, grads[2 * i + 1] / dsigma_du, rtol=1e-10, atol=1e-10
        )
        pieces.append(moments.g)
    base = pieces[0].untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() == base for g in pieces)


def test_node_points_sum_over_the_nodes_once_for_moments_and_gradients():
    # the backward of z = loc + sigma * x makes the two sums over the K nodes that both the
    # published moments and the gradients of loc and sigma are made of: two reductions of
    # (K, D), where a hook on z and autograd's own backward made four; results bit for bit.
    # A plain Normal prior (not an IidNormal): evaluated at the nodes, as before
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()

    def prior(name, param):
        return dist.Normal(torch.zeros_like(param), 1.3)

    bnn = BayesianModule(net, prior, likelihoods.Gaussian(scale=0.5))
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = x.sum(-1)
    guide = AutoMeanFieldNormal(bnn)
    guide(x, y)
    elbo = QuadratureELBO("hadamard", num_points=4)
    for _ in range(2):  # a position of the sequence past the first
        loss = elbo.differentiable_loss(bnn, guide, x, y)
    description = guide.quadrature_description()
    leaves = [leaf for site in description.sites for leaf in site.params.values()]
    dim = description.dim
    with torch.profiler.profile(record_shapes=True) as prof:
        grads = torch.autograd.grad(loss, leaves)
    sums = [
        e for e in prof.events() if e.name == "aten::sum" and list(e.input_shapes[0]) == [4, dim]
    ]
    assert len(sums) == 2

    # the same loss with the points written out: the same gradients, bit for bit
    loc, scale = description.loc, description.scale
    nodes = elbo.rule.draw(dim, step=elbo.step(description) - 1, dtype=torch.float64)
    points = loc + scale * nodes.matrix()
    log_joint = LogJoint(bnn, description.latent_sites, max_plate_nesting=1)(points, (x, y))
    expected = -(nodes.weights @ log_joint) - description.entropy()
    assert torch.equal(loss.detach(), expected.detach())
    for got, want in zip(grads, torch.autograd.grad(expected, leaves)):
        assert torch.equal(got, want)


# -- Normal priors of Gaussian sites in closed form, under rules exact on x_j and x_j^2 -------


def _bnn_with(prior):
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    torch.nn.init.normal_(net[0].weight, generator=torch.Generator().manual_seed(3))
    return BayesianModule(net, prior, likelihoods.Gaussian(scale=0.5))


def _explicit_loss(bnn, description, rule, step, x, y, generator=None):
    """The loss of QuadratureELBO written out, every prior evaluated at the nodes."""
    nodes = rule.draw(description.dim, step=step, generator=generator, dtype=torch.float64)
    points = description.loc + description.scale * nodes.matrix()
    log_joint = LogJoint(bnn, description.latent_sites, max_plate_nesting=1)(points, (x, y))
    return -(nodes.weights @ log_joint) - description.entropy()


@pytest.mark.parametrize("rule, num_points", [("hadamard", 4), ("blocked_simplex", 3)])
@pytest.mark.parametrize(
    "prior",
    [priors.Normal(1.0), priors.Normal(0.7, loc=0.2), priors.LayerwiseNormal("kaiming")],
    ids=["N(0,1)", "N(0.2,0.7)", "kaiming"],
)
def test_closed_form_priors_equal_the_priors_at_the_nodes(rule, num_points, prior):
    # the loss, the gradients of every loc and scale and the published moments equal those of
    # the priors evaluated at the nodes (exact for these rules), to rounding; the prior's log
    # density is never evaluated at the nodes
    pyro.clear_param_store()
    bnn = _bnn_with(prior)
    x = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = x.sum(-1)
    guide = AutoMeanFieldNormal(bnn, init_scale=0.3)
    guide(x, y)
    elbo = QuadratureELBO(rule, num_points=num_points, generator=torch.Generator().manual_seed(5))
    description = guide.quadrature_description()
    leaves = [leaf for site in description.sites for leaf in site.params.values()]
    with torch.no_grad():  # move the means off the prior's centre
        for leaf in leaves[::2]:
            leaf.add_(torch.linspace(-0.5, 0.8, leaf.numel(), dtype=leaf.dtype).view(leaf.shape))

    calls = []
    original = IidNormal.log_prob
    with pytest.MonkeyPatch.context() as m:
        m.setattr(IidNormal, "log_prob", lambda self, v: calls.append(v.shape) or original(self, v))
        step = elbo.step(description)
        loss = elbo.differentiable_loss(bnn, guide, x, y)
        grads = torch.autograd.grad(loss, leaves)
    assert calls == []

    generator = torch.Generator().manual_seed(5)  # the same draw for a random rule
    expected = _explicit_loss(bnn, description, elbo.rule, step, x, y, generator)
    want = torch.autograd.grad(expected, leaves)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, rtol=1e-11, atol=1e-12)
    for i, site in enumerate(description.sites):  # g = dL/dloc; sigma h - 1/sigma = dL/dsigma
        moments = qnvb_module.published_moments(site.params["loc"])
        sigma = site.scale.detach()
        dsigma_du = torch.sigmoid(site.params["scale"].detach())
        torch.testing.assert_close(moments.g, want[2 * i], rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(
            sigma * moments.h - 1 / sigma, want[2 * i + 1] / dsigma_du, rtol=1e-10, atol=1e-10
        )


def test_random_rules_not_exact_on_quadratics_evaluate_the_priors_at_the_nodes():
    # plain Monte Carlo is not exact on x_j^2: the priors stay at the nodes, bit for bit as
    # written out (the same draws)
    pyro.clear_param_store()
    bnn = _bnn_with(priors.Normal(1.0))
    x = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = x.sum(-1)
    guide = AutoMeanFieldNormal(bnn)
    guide(x, y)
    elbo = QuadratureELBO("mc", num_points=5, generator=torch.Generator().manual_seed(7))
    assert not elbo.rule.exact_coordinate_quadratics
    description = guide.quadrature_description()
    loss = elbo.differentiable_loss(bnn, guide, x, y)
    generator = torch.Generator().manual_seed(7)
    assert torch.equal(loss, _explicit_loss(bnn, description, elbo.rule, 0, x, y, generator))


Y_OBS = torch.tensor(0.8)


@pytest.mark.parametrize("data", [False, True])
def test_closed_form_priors_reach_the_scales_when_nothing_else_depends_on_the_points(data):
    # the latent reaches nothing but its prior (no data; or data explained by a pyro.param
    # alone, so the loss has a gradient but none through the node points): the loss is the
    # closed form, and its gradients dL/dmu = (mu - m) / s^2, dL/dsigma = sigma / s^2 - 1 / sigma
    def model():
        pyro.sample("w", priors.Normal(2.0, loc=1.0)("w", torch.zeros(3)).to_event(1))
        if data:
            pyro.sample("y", dist.Normal(pyro.param("m", torch.tensor(0.3)), 1.0), obs=Y_OBS)

    pyro.clear_param_store()
    guide = AutoMeanFieldNormal(model, init_scale=0.5)
    guide()
    loss = QuadratureELBO("hadamard", num_points=4).differentiable_loss(model, guide)
    (site,) = guide.quadrature_description().sites
    mu, sigma = site.loc.detach(), site.scale.detach()
    kl = (torch.log(2.0 / sigma) + (sigma**2 + (mu - 1.0) ** 2) / 8 - 0.5).sum()
    if data:
        kl = kl - dist.Normal(0.3, 1.0).log_prob(Y_OBS)
    torch.testing.assert_close(loss.detach(), kl)
    g_loc, g_scale = torch.autograd.grad(loss, [site.params["loc"], site.params["scale"]])
    torch.testing.assert_close(g_loc, (mu - 1.0) / 4)
    dsigma_du = torch.sigmoid(site.params["scale"].detach())
    torch.testing.assert_close(g_scale / dsigma_du, sigma / 4 - 1 / sigma)
