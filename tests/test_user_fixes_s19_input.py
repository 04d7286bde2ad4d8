"""Session 19: input that a user passes by hand and that failed deep inside torch.

``LogJoint(model, sites)(z)`` with one point ``z`` of shape ``(dim,)`` ended in torch's
IndexError ("invalid index of a 0-dim tensor"): it is now evaluated as ``z[None]`` and returned
without the points' axis; points of more than 2 dims, or none, are refused naming ``z``.

The priors of `pyro_quadvi.nn` take an integer tensor (``scale=torch.tensor(2)``) as the number it
holds, in the parameter's dtype, as they take a float. So does ``IidNormal(loc, scale)`` built by
hand, whose integer ``loc=torch.tensor(0)`` stayed an integer tensor: its draws failed with
torch's NotImplementedError ("normal_kernel_cpu not implemented for 'Long'") and a float
``scale=1.5`` beside it was cast to 1, a wrong log density without an error.
"""

from __future__ import annotations

import functools

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.distributions import IidNormal
from pyro_quadvi.infer.log_joint import LogJoint, latent_sites_of_model
from pyro_quadvi.nn import priors

F64 = torch.float64


@pytest.fixture(autouse=True)
def clean_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


# ---------------------------------------------------------------- LogJoint: one point (dim,)


def regression_data():
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(12, 2, generator=generator, dtype=F64)
    y = X @ torch.tensor([1.0, -0.5], dtype=F64) + 0.3 * torch.randn(12, generator=generator)
    return X, y.to(F64)


def regression(X, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal((X * w).sum(-1), s), obs=y)


def regression_log_joint(point, X, y) -> torch.Tensor:
    """The log joint and log-Jacobian of `regression` at one unconstrained point, by hand."""
    w, log_s = point[:2], point[2]
    s = log_s.exp()
    prior = dist.Normal(0.0, 1.0).log_prob(w).sum() + dist.LogNormal(0.0, 1.0).log_prob(s)
    return prior + log_s + dist.Normal(X @ w, s).log_prob(y).sum()


@pytest.mark.parametrize("vectorize", [True, False])
def test_log_joint_takes_one_point_without_the_points_axis(vectorize):
    X, y = regression_data()
    sites = latent_sites_of_model(regression, X, y)
    point = torch.tensor([0.4, -0.3, 0.2], dtype=F64, requires_grad=True)

    value = LogJoint(regression, sites)(point, (X, y), vectorize=vectorize)
    batched = LogJoint(regression, sites)(point[None], (X, y), vectorize=vectorize)

    assert value.shape == ()
    assert torch.equal(value, batched[0])
    assert value.item() == pytest.approx(regression_log_joint(point, X, y).item(), rel=1e-12)
    (grad,) = torch.autograd.grad(value, point)
    (expected,) = torch.autograd.grad(regression_log_joint(point, X, y), point)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("vectorize", [True, False])
def test_log_joint_by_site_of_one_point_gives_a_0d_term_per_site(vectorize):
    X, y = regression_data()
    sites = latent_sites_of_model(regression, X, y)
    point = torch.tensor([0.4, -0.3, 0.2], dtype=F64)

    terms = LogJoint(regression, sites)(point, (X, y), vectorize=vectorize, by_site=True)
    batched = LogJoint(regression, sites)(point[None], (X, y), vectorize=vectorize, by_site=True)

    assert list(terms) == ["w", "s", "y"]
    for name, term in terms.items():
        assert term.shape == ()
        assert torch.equal(term, batched[name][0])
    expected = dist.Normal(X @ point[:2], point[2].exp()).log_prob(y).sum()
    assert terms["y"].item() == pytest.approx(expected.item(), rel=1e-12)


def test_log_joint_one_point_of_the_wrong_width_names_its_own_shape():
    X, y = regression_data()
    log_joint = LogJoint(regression, latent_sites_of_model(regression, X, y))
    with pytest.raises(ValueError, match=r"3 unconstrained coordinates \(w, s\), got shape \(4,\)"):
        log_joint(torch.zeros(4, dtype=F64), (X, y))


def test_log_joint_one_point_where_the_density_is_not_finite_is_named_as_the_point():
    def model():
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.factor("wall", torch.where(x > 1, -torch.inf, 0.0))

    log_joint = LogJoint(model, latent_sites_of_model(model))
    assert log_joint(torch.tensor([0.5])).item() == pytest.approx(-0.125 - 0.9189385, rel=1e-6)
    with pytest.raises(ValueError, match=r"site 'wall' .* at the point unconstrained z = \[2.0\]"):
        log_joint(torch.tensor([2.0]))


def test_check_plate_nesting_takes_one_point():
    X, y = regression_data()
    sites = latent_sites_of_model(regression, X, y)
    point = torch.tensor([0.4, -0.3, 0.2], dtype=F64)
    LogJoint(regression, sites, max_plate_nesting=1).check_plate_nesting(point, (X, y))
    with pytest.raises(ValueError, match=r"max_plate_nesting=0, but the model nests its plates 1"):
        LogJoint(regression, sites, max_plate_nesting=0).check_plate_nesting(point, (X, y))


@pytest.mark.parametrize(
    "shape, fix",
    [
        ((2, 2, 3), r"got shape \(2, 2, 3\): lay the points along one axis, z.reshape\(-1, 3\)"),
        ((0, 3), r"got shape \(0, 3\): no point to evaluate"),
    ],
)
@pytest.mark.parametrize("max_plate_nesting", [None, 1])
def test_log_joint_refuses_points_of_more_dims_or_none(shape, fix, max_plate_nesting):
    X, y = regression_data()
    sites = latent_sites_of_model(regression, X, y)
    log_joint = LogJoint(regression, sites, max_plate_nesting=max_plate_nesting)
    expected = r"LogJoint: z must be points \(K, 3\) or one point \(3,\), " + fix
    with pytest.raises(ValueError, match=expected):
        log_joint(torch.zeros(shape, dtype=F64), (X, y))


# ---------------------------------------------------------------- priors: integer tensors


@pytest.mark.parametrize(
    "make",
    [
        lambda number: priors.Normal(scale=number(2), loc=number(-1)),
        lambda number: priors.LayerwiseNormal("kaiming", scale=number(3)),
        lambda number: priors.SpikeSlab(inclusion=0.25, slab_scale=number(2)),
    ],
    ids=["Normal", "LayerwiseNormal", "SpikeSlab"],
)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_prior_of_integer_tensors_equals_the_float_one_to_the_bit(make, dtype):
    weight = torch.randn(3, 4, dtype=dtype, generator=torch.Generator().manual_seed(1))
    of_ints = make(lambda n: torch.tensor(n))("0.weight", weight)
    of_floats = make(float)("0.weight", weight)
    log_prob = of_ints.log_prob(weight)
    assert log_prob.dtype == dtype
    assert torch.equal(log_prob, of_floats.log_prob(weight))
    torch.manual_seed(0)
    draw = of_ints.sample()
    torch.manual_seed(0)
    assert draw.dtype == dtype and torch.equal(draw, of_floats.sample())


@pytest.mark.parametrize(
    "loc, scale, dtype",
    [
        (torch.tensor(0), 1.5, torch.get_default_dtype()),
        (torch.tensor([0, 1]), torch.tensor(2, dtype=torch.int32), torch.get_default_dtype()),
        (torch.tensor(1), torch.tensor(2.0, dtype=F64), F64),
        (torch.tensor(1.0, dtype=F64), torch.tensor(3), F64),
    ],
)
def test_iid_normal_takes_integer_tensors_in_the_other_arguments_float_dtype(loc, scale, dtype):
    prior = IidNormal(loc, scale)
    assert prior.loc.dtype == prior.scale.dtype == dtype
    expected = dist.Normal(torch.as_tensor(loc, dtype=dtype), torch.as_tensor(scale, dtype=dtype))
    value = torch.tensor(0.3, dtype=dtype)
    assert torch.equal(prior.log_prob(value), expected.log_prob(value))
    torch.manual_seed(0)
    draw = prior.sample()
    torch.manual_seed(0)
    assert torch.equal(draw, expected.sample())


def test_a_model_with_an_integer_loc_fits_as_the_float_one_to_the_bit():
    y = torch.tensor([0.5, 1.5, 1.0])

    def model(loc):
        w = pyro.sample("w", IidNormal(loc, torch.tensor(2)))
        with pyro.plate("data", 3):
            pyro.sample("y", dist.Normal(w, 1.0), obs=y)

    losses = []
    for loc in (torch.tensor(1), 1.0):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoMeanFieldNormal(model)
        losses.append(QuadratureELBO().loss(model, guide, loc))
    assert losses[0] == losses[1]


# ---------------------------------------------------------------- the rows check at scale
ROWS, BATCH = 1000, 5
SPARSE = torch.zeros(ROWS, dtype=F64)
SPARSE[ROWS - 1] = 1.0  # a 0/1 outcome with one 1: zero at the rows that the check compares


def sparse_rows_model(idx, seen: list[int], follow: bool = True):
    """``z_i ~ N(0, 10^2)``, ``y_i ~ N(z_i, 1)`` on `SPARSE`, read by the plate's rows
    (``follow``) or by the model's ``idx``; ``seen`` gets the number of rows of each run."""
    with pyro.plate("rows", ROWS, subsample=idx) as ind:
        seen.append(len(ind))
        z = pyro.sample("z", dist.Normal(0.0, 10.0))
        pyro.sample("y", dist.Normal(z, 1.0), obs=SPARSE[ind] if follow else SPARSE[idx])


def test_the_rows_check_runs_the_model_at_the_compared_rows_not_at_all_rows(float64_store):
    """The data are zero at the guide's rows, the model's and the shifted ones, so the check
    runs the model once more to tell data that follow the rows from data kept at ``idx``: that
    run took all 1000 rows (at 10^6 rows of a small MLP per row, 2.9 s and 380 MB more at set-up
    for its two runs: docs/benchmarks.md, "The rows check at scale"), and now takes both sets of
    rows at once."""
    seen: list[int] = []
    model = functools.partial(sparse_rows_model, seen=seen)
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    svi.step(torch.arange(BATCH))
    assert BATCH < max(seen) <= 2 * BATCH
    assert guide.locs.z.shape == (ROWS,)


def test_a_model_reading_its_own_rows_is_refused_where_the_data_are_zero_there(float64_store):
    model = functools.partial(sparse_rows_model, seen=[], follow=False)
    pyro.set_rng_seed(0)
    svi = SVI(model, AutoMeanFieldNormal(model), QNVB(), QuadratureELBO())
    with pytest.raises(ValueError, match="its observed sites 'y' keep the same data with the gu"):
        svi.step(torch.arange(BATCH))


@pytest.mark.parametrize("follow", [True, False])
def test_the_guide_taking_the_models_rows_in_another_order(float64_store, follow):
    """``create_plates`` gives the guide's plate the model's rows reversed: the check's last run
    takes those rows and one more, so that data kept at ``idx`` (``len(idx)`` entries, as many
    as the rows without the one more) show as such where the data are zero at every row
    compared; data read by the plate's rows are accepted and fitted (``y_i 100/101 = 0``)."""
    seen: list[int] = []
    model = functools.partial(sparse_rows_model, seen=seen, follow=follow)
    idx = torch.tensor([7, 3, 998, 5, 0])

    def plates(idx):
        return pyro.plate("rows", ROWS, subsample=idx.flip(0))

    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model, create_plates=plates)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    if not follow:
        with pytest.raises(ValueError, match="its observed sites 'y' keep the same data"):
            svi.step(idx)
        return
    for _ in range(3):
        svi.step(idx)
    assert max(seen) == BATCH + 1
    torch.testing.assert_close(guide.locs.z.detach()[idx], SPARSE[idx], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "loc, scale, name, shown",
    [
        (torch.tensor(True), 1.0, "loc", "a bool tensor (tensor(True))"),
        (0.0, torch.tensor([True, False]), "scale", "a bool tensor (tensor([ True, False]))"),
        (0.0, True, "scale", "a bool value (True)"),
    ],
)
def test_iid_normal_refuses_a_bool_loc_or_scale(loc, scale, name, shown):
    """``IidNormal(loc=torch.tensor(True), ...)`` was silently a loc of 1.0."""
    with pytest.raises(TypeError) as raised:
        IidNormal(loc, scale)
    assert str(raised.value) == (
        f"IidNormal: {name} must be a real number or a floating or integer tensor, got {shown}, "
        "which would be taken as 1.0 or 0.0: pass the number itself"
    )


# ------------------------------------------- the rows check where the model's rows are all rows
FULL = 50
X_FULL = torch.linspace(0.1, 5.0, FULL, dtype=F64)
Y_FULL = torch.zeros(FULL, dtype=F64)


def all_rows_model(idx, follow: bool):
    """``z_i ~ N(0, 10^2)``, ``y_i ~ N(x_i z_i, 1)`` with ``y = 0``, the data read by the plate's
    rows (``follow``) or kept at the model's ``idx``."""
    with pyro.plate("rows", FULL, subsample=idx) as ind:
        rows = ind if follow else idx
        z = pyro.sample("z", dist.Normal(0.0, 10.0))
        pyro.sample("y", dist.Normal(X_FULL[rows] * z, 1.0), obs=Y_FULL[rows])


@pytest.mark.parametrize("follow", [True, False])
def test_the_rows_check_where_the_models_rows_are_a_permutation_of_all_rows(float64_store, follow):
    """``idx`` a permutation of all 50 rows, ``y`` all zero: the check's last run took all 50
    rows, where data kept at ``idx`` have as many entries as data that follow the rows, and it
    accepted the model reading ``x[idx]``, whose fit paired each row's latent with another row's
    ``x`` (its sds up to 12.5 times off). That run now takes 49 of the rows: data kept at ``idx``
    are refused, data read by the plate's rows accepted and fitted (sd ``(0.01 + x_i^2)^-1/2``)."""
    model = functools.partial(all_rows_model, follow=follow)
    idx = torch.randperm(FULL, generator=torch.Generator().manual_seed(0))
    pyro.set_rng_seed(0)
    guide = AutoMeanFieldNormal(model)
    svi = SVI(model, guide, QNVB(), QuadratureELBO())
    if not follow:
        with pytest.raises(ValueError, match="its observed sites 'y' keep the same data"):
            svi.step(idx)
        return
    for _ in range(20):
        svi.step(idx)
    exact = (0.01 + X_FULL**2) ** -0.5
    torch.testing.assert_close(guide.scales.z.detach(), exact, rtol=1e-12, atol=0)
