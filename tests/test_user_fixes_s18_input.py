"""Session 18: bad input that the session-17 sweep found accepted and failing later, unclearly,
or refused at the call with a message that named neither the argument nor what it takes.

``SparseQNVB*(tau_max=1e300)`` overflowed in the first step's zero logits ("Numerical result out
of range"); ``SparseQNVB(num_cases=1e300)`` ran without a trust region and
``SparseQNVB(prior_precision=1e300)`` only warned of non-finite terms. Each is now refused
naming the argument and the range it takes.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

from pyro_quadvi import AutoSpikeSlab, QuadratureELBO, SparseQNVB
from pyro_quadvi.distributions import SpikeSlab
from pyro_quadvi.evidence import (
    importance_log_evidence,
    nested_sampling_log_evidence,
    opqa_evidence,
    prior_guide,
)
from pyro_quadvi.export import to_inference_data
from pyro_quadvi.infer.log_joint import LogJoint, latent_sites_of_model, model_max_plate_nesting
from pyro_quadvi.metrics import gaussian_nll, reliability_diagram
from pyro_quadvi.nn import priors
from pyro_quadvi.optim import SparseQNVBOptimizer, anneal_likelihood, geometric_annealing
from pyro_quadvi.optim.sparse_functional import SparseQNVBHyperparameters
from pyro_quadvi.quadrature import (
    gauss_hermite,
    hadamard_signs,
    make_rule,
    orthonormal_hermite,
    quadratic_exactness,
)
from pyro_quadvi.store import (
    detached_parameters,
    follow_store,
    set_weights_only_state,
    weights_only_state,
)

# ---------------------------------------------------------------- sparse QNVB: widths and ranges


@pytest.mark.parametrize("name", ["tau_max", "late_tau_max"])
@pytest.mark.parametrize("value", [1e300, 1e-160])
def test_sparse_hyperparameters_refuse_a_width_whose_square_overflows(name, value):
    bounds = r"\[7\.46e-155, 1\.34e\+154\]"
    with pytest.raises(ValueError, match=rf"^{name}=1e[+-]\d+ is outside {bounds}"):
        SparseQNVBHyperparameters(**{name: value})
    with pytest.raises(ValueError, match=rf"^{name}=1e[+-]\d+ is outside"):
        SparseQNVB(num_epochs=3, steps_per_epoch=2, **{name: value})


def test_sparse_optimizer_refuses_a_width_beyond_float32_at_its_parameters():
    net = torch.nn.Linear(3, 1)
    with pytest.raises(
        ValueError,
        match=r"^SparseQNVBOptimizer: tau_max=1e\+20 is outside "
        r"\[5\.42e-20, 1\.84e\+19\].* finite in torch\.float32.*float64 parameters",
    ):
        SparseQNVBOptimizer(net.parameters(), num_cases=16, steps_per_epoch=2, tau_max=1e20)
    # the same width is within float64's range
    SparseQNVBOptimizer(net.double().parameters(), num_cases=16, steps_per_epoch=2, tau_max=1e20)


def _spike_slab_model(x, y):
    w = pyro.sample("w", SpikeSlab(0.3, 2.0).expand([3]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal((x * w).sum(-1), 0.5), obs=y)


@pytest.mark.parametrize(
    "setting, name",
    [
        ({"num_cases": 1e300}, r"num_cases / steps_per_epoch=5e\+299"),
        ({"prior_precision": 1e300}, r"prior_precision / steps_per_epoch=5e\+299"),
        ({"tau_max": 1e20}, r"tau_max=1e\+20 is outside"),
    ],
)
def test_sparse_qnvb_refuses_settings_beyond_the_sites_dtype(fresh_param_store, setting, name):
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    y = x.sum(-1)
    guide = AutoSpikeSlab(_spike_slab_model, init_scale=1e-5**0.5, init_inclusion=1 - 1e-9)
    optim = SparseQNVB(num_epochs=3, steps_per_epoch=2, **setting)
    svi = SVI(_spike_slab_model, guide, optim, QuadratureELBO(rule="hadamard", num_points=4))
    with pytest.raises(ValueError, match=rf"^SparseQNVB: {name}.*torch\.float32"):
        svi.step(x, y)
    assert optim.counters.step == 0 and not optim.blocks  # nothing was updated


# ---------------------------------------------------------------- priors: types at the call


@pytest.mark.parametrize("bad", [None, "bad", [1.0], {}, torch.ones(2), True])
@pytest.mark.parametrize(
    "make, name",
    [
        (lambda v: priors.Normal(scale=v), "priors.Normal: scale"),
        (lambda v: priors.Normal(loc=v), "priors.Normal: loc"),
        (lambda v: priors.LayerwiseNormal(scale=v), "priors.LayerwiseNormal: scale"),
        (lambda v: priors.SpikeSlab(inclusion=v), "priors.SpikeSlab: inclusion"),
        (lambda v: priors.SpikeSlab(0.5, slab_scale=v), "priors.SpikeSlab: slab_scale"),
    ],
)
def test_priors_refuse_a_setting_that_is_no_real_number_by_name(make, name, bad):
    # before: "'>' not supported between instances of 'NoneType' and 'int'", "float() argument
    # must be a string or a real number", "Boolean value of Tensor ... is ambiguous"
    with pytest.raises(TypeError, match=rf"^{name} must be a real number"):
        make(bad)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: priors.Normal(scale=math.inf), r"priors.Normal needs .* got scale=inf, loc=0"),
        (lambda: priors.Normal(loc=math.nan), r"priors.Normal needs .* got scale=1.0, loc=nan"),
        (lambda: priors.Normal(loc=-math.inf), r"priors.Normal needs a finite loc and scale > 0"),
        (lambda: priors.LayerwiseNormal(scale=math.inf), r"LayerwiseNormal: scale must be finite"),
    ],
)
def test_priors_refuse_an_infinite_setting_at_the_call(make, message):
    # before: accepted, and "a Normal prior needs a finite loc and scale > 0" at the first step
    with pytest.raises(ValueError, match=message):
        make()


def test_priors_keep_one_element_tensors_and_their_values():
    prior = priors.Normal(scale=torch.tensor(2.0), loc=torch.tensor(0.5, requires_grad=True))
    assert (prior.scale, prior.loc) == (2.0, 0.5)
    assert priors.SpikeSlab(torch.tensor(0.25)).inclusion == 0.25


@pytest.mark.parametrize(
    "shape, error",
    [
        (None, TypeError),
        (3, TypeError),
        ("bad", TypeError),
        ((4.0, 3), TypeError),
        ((True, 3), TypeError),
        # a sequence of ints of the wrong shape stays a ValueError, as torch's own was
        ([1], ValueError),
        ((3,), ValueError),
        ((4, -1), ValueError),
    ],
)
def test_fan_in_and_fan_out_refuses_what_is_no_weight_shape(shape, error):
    with pytest.raises(error, match=r"^fan_in_and_fan_out: shape must be a weight's shape"):
        priors.fan_in_and_fan_out(shape)
    assert priors.fan_in_and_fan_out([4, 3]) == (3, 4)


# ---------------------------------------------------------------- the log joint's arguments


def _plated_model(data):
    z = pyro.sample("z", dist.Normal(torch.zeros(2), 2.0).to_event(1))
    with pyro.plate("data", len(data)):
        pyro.sample("x", dist.Normal(z[..., 0] + 0.5 * z[..., 1], 1.0), obs=data)


DATA = torch.linspace(-1.0, 1.0, 8)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(sites=None), r"sites must be an iterable of LatentSite.*got None \(NoneType\)$"),
        (dict(sites="bad"), r"sites must be an iterable of LatentSite.*got 'bad' \(str\)$"),
        (dict(sites=[1]), r"sites must be an iterable of LatentSite.*got 1 \(int\) in it$"),
        (dict(closed_form=[1]), r"closed_form must be a mapping .*got \[1\] \(list\)$"),
        (dict(closed_form="bad"), r"closed_form must be a mapping .*got 'bad' \(str\)$"),
        (dict(expected_log_priors=None), r"expected_log_priors must be a collection of site"),
        (dict(expected_log_priors="w"), r"expected_log_priors must be a collection of site"),
        (dict(expected_log_priors=[1]), r"expected_log_priors must be a collection of site"),
    ],
)
def test_log_joint_refuses_arguments_of_another_type_by_name(arguments, message):
    # before: "'NoneType' object is not iterable", "'int' object has no attribute 'numel'",
    # "dictionary update sequence element #0 has length 1; 2 is required"
    sites = latent_sites_of_model(_plated_model, DATA)
    with pytest.raises(TypeError, match=rf"^LogJoint: {message}"):
        LogJoint(_plated_model, **{"sites": sites, **arguments})


def test_log_joint_takes_its_sites_from_any_iterable():
    # before (session 18's check): a generator was refused as "not a sequence of LatentSite"
    sites = latent_sites_of_model(_plated_model, DATA)
    z = torch.tensor([[0.5, -1.0], [0.0, 2.0]])
    expected = LogJoint(_plated_model, sites)(z, (DATA,))
    from_generator = LogJoint(_plated_model, (site for site in sites))
    assert from_generator.dim == 2
    assert torch.equal(from_generator(z, (DATA,)), expected)


@pytest.mark.parametrize("z", [None, "bad", 1.0, [[0.0, 0.0]], torch.tensor(0.0)])
def test_log_joint_refuses_points_that_are_no_tensor_by_name(z):
    joint = LogJoint(_plated_model, latent_sites_of_model(_plated_model, DATA))
    with pytest.raises(TypeError, match=r"^LogJoint: z must be a tensor of points \(K, 2\)"):
        joint(z, (DATA,))


@pytest.mark.parametrize("model", [None, 1, "bad"])
def test_latent_sites_of_model_refuses_a_model_that_is_not_callable(model):
    # before: Pyro's "1 is not callable, did you mean to pass it as a keyword arg?", and for
    # None (its first argument taken as the model) "tensor([...]) is not callable"
    with pytest.raises(TypeError, match=r"^latent_sites_of_model: model must be a callable"):
        latent_sites_of_model(model, DATA)


@pytest.mark.parametrize("trace", [None, 1, "bad", [1]])
def test_model_max_plate_nesting_refuses_what_is_no_trace(trace):
    with pytest.raises(TypeError, match=r"^model_max_plate_nesting: trace must be a pyro"):
        model_max_plate_nesting(trace)


def test_log_joint_names_a_given_max_plate_nesting_below_the_models_plates():
    # before: torch's "Value is not broadcastable with batch_shape+event_shape: torch.Size([8])
    # vs torch.Size([8, 3])" from the vectorized pass, the argument unnamed
    sites = latent_sites_of_model(_plated_model, DATA)
    joint = LogJoint(_plated_model, sites, max_plate_nesting=0)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"^max_plate_nesting=0, but the model nests its plates 1"):
        joint(torch.zeros(3, 2), (DATA,))
    assert torch.equal(torch.get_rng_state(), state)  # the looped run drew from a fork
    found = LogJoint(_plated_model, sites)(torch.zeros(3, 2), (DATA,))
    assert torch.equal(
        LogJoint(_plated_model, sites, max_plate_nesting=1)(torch.zeros(3, 2), (DATA,)), found
    )


# ---------------------------------------------------------------- evidence: callables and counts


IID_DATA = torch.tensor([0.3, -0.2, 0.5])


def _iid_model(x=IID_DATA):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("d", len(x)):
        pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


@pytest.mark.parametrize("bad", [None, 1, "bad"])
def test_evidence_estimators_refuse_what_is_not_callable_by_name(bad):
    # before: "'NoneType' object is not callable", Pyro's "1 is not callable, did you mean to
    # pass it as a keyword arg?", Messenger.__call__() missing 1 required positional argument
    guide = prior_guide(_iid_model)
    with pytest.raises(TypeError, match=r"^prior_guide: model must be a callable Pyro model"):
        prior_guide(bad)
    with pytest.raises(TypeError, match=r"^importance_log_evidence: model must be a callable"):
        importance_log_evidence(bad, guide, num_samples=10)
    with pytest.raises(TypeError, match=r"^importance_log_evidence: guide must be a callable"):
        importance_log_evidence(_iid_model, bad, num_samples=10)
    with pytest.raises(TypeError, match=r"^nested_sampling_log_evidence: log_likelihood must be"):
        nested_sampling_log_evidence(bad, lambda u: u, 1)
    with pytest.raises(TypeError, match=r"^nested_sampling_log_evidence: prior_transform must"):
        nested_sampling_log_evidence(lambda t: 0.0, bad, 1)
    if bad is not None:  # (None: no guide, the default)
        with pytest.raises(TypeError, match=r"^opqa_evidence: guide must be a fitted guide"):
            opqa_evidence(_iid_model, num_points=4, guide=bad, center="guide")


def test_opqa_marginals_refuse_a_count_that_is_no_integer_by_name():
    posterior = opqa_evidence(_iid_model, num_points=4).posterior
    for bad in (None, "bad", [1], {}):
        # before: "'<' not supported between instances of 'NoneType' and 'int'"
        with pytest.raises(TypeError, match=r"^OPQAPosterior.marginals: num must be an integer"):
            posterior.marginals(bad)
    with pytest.raises(ValueError, match=r"^OPQAPosterior.marginals: num must be an integer >= 2"):
        posterior.marginals(1)
    assert posterior.marginals(5)["mu"].density.shape == (5,)


# ---------------------------------------------------------------- quadrature: the pure functions


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: gauss_hermite(3, dtype=1), r"^gauss_hermite: dtype must be a floating"),
        (lambda: gauss_hermite(3, dtype="bad"), r"^gauss_hermite: dtype must be a floating"),
        (lambda: orthonormal_hermite(None, 2), r"^orthonormal_hermite: x must be a tensor"),
        (lambda: orthonormal_hermite([0.0], 2), r"^orthonormal_hermite: x must be a tensor"),
        (lambda: orthonormal_hermite(torch.zeros(2), None), r"degree must be >= 0 \(an integer\)"),
        (lambda: orthonormal_hermite(torch.zeros(2), 2.5), r"degree must be >= 0 \(an integer\)"),
        (lambda: hadamard_signs(None, 3), r"^hadamard_signs: index must be an integer tensor"),
        (lambda: hadamard_signs(torch.zeros(3), 3), r"^hadamard_signs: index must be an integer"),
        (lambda: hadamard_signs(torch.arange(3), 2.5), r"^hadamard_signs: iterate must be an int"),
        (lambda: hadamard_signs(torch.arange(3), None), r"^hadamard_signs: iterate must be an int"),
        (lambda: hadamard_signs(torch.arange(3), 3, dtype=1), r"^hadamard_signs: dtype must be"),
    ],
)
def test_quadrature_functions_refuse_arguments_of_another_type_by_name(call, message):
    # before: "Cannot access accelerator device when none is available" (dtype=1 taken for a
    # device), "unsupported operand type(s) for &", "ones_like(): argument 'input' must be
    # Tensor", "'<' not supported between instances of 'NoneType' and 'int'"
    with pytest.raises(ValueError, match=message):
        call()


def test_quadrature_functions_still_take_what_they_took():
    assert gauss_hermite(3, dtype=None)[0].dtype == torch.float64
    assert orthonormal_hermite(torch.zeros(2), torch.tensor(3)).shape == (2, 4)
    signs = hadamard_signs(torch.arange(4), torch.tensor(3), dtype=torch.float64)
    assert signs.tolist() == [1.0, -1.0, -1.0, 1.0]


@pytest.mark.parametrize("device", [1, "bad", [1]])
def test_a_rules_draw_refuses_what_is_no_device_by_name(device):
    # before: torch's "Expected one of cpu, cuda, ..." or "Cannot access accelerator device when
    # none is available", the argument unnamed (a CUDA index on a machine with CUDA is a device)
    if device == 1 and torch.cuda.device_count() > 1:
        pytest.skip("cuda:1 is a device here")
    for rule in (make_rule("rasp_simplex", 3), make_rule("gauss_hermite", 3)):
        with pytest.raises(ValueError, match=rf"^{rule.name}: device must be a torch.device"):
            rule.nodes(2, device=device)


_X = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
_W = torch.full((4,), 0.25, dtype=torch.float64)


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(X=None), TypeError, r"X must be a \(K, d\) tensor, got None"),
        (dict(X=_X.tolist()), TypeError, r"X must be a \(K, d\) tensor, got \[\["),
        (dict(w=None), TypeError, r"w must be a \(K,\) tensor, got None"),
        (dict(w=_W.unsqueeze(-1)), TypeError, r"w must be a \(K,\) tensor, got shape \(4, 1\)"),
        (dict(w=_W[:1]), ValueError, r"w must hold one weight per node of X, 4, got 1"),
        (dict(atol="bad"), TypeError, r"atol must be None or a number >= 0, got 'bad'"),
        (dict(atol=torch.ones(2)), TypeError, r"atol must be None or a number >= 0"),
        (dict(atol=math.nan), ValueError, r"atol must be finite and >= 0, got nan"),
        (dict(atol=-1.0), ValueError, r"atol must be finite and >= 0, got -1.0"),
    ],
)
def test_quadratic_exactness_refuses_arguments_by_name(arguments, error, message):
    # before: "'NoneType' object has no attribute 'dtype'", "mat1 and mat2 shapes cannot be
    # multiplied (3x1 and 3x2)", "full_like(): argument 'fill_value' must be Number", and a NaN
    # or negative atol changed the counts silently
    with pytest.raises(error, match=rf"^quadratic_exactness: {message}"):
        quadratic_exactness(**{"X": _X, "w": _W, **arguments})
    exact = quadratic_exactness(_X, _W, atol=torch.tensor(1e-9, requires_grad=True))
    assert exact.total == exact.num_basis == 6


@pytest.mark.parametrize("atol", [0, torch.tensor(0), torch.tensor(0, dtype=torch.int32)])
def test_quadratic_exactness_takes_an_integer_tensor_atol_as_it_takes_an_int(atol):
    # before: torch.tensor(0) was refused ("atol must be None or a number >= 0") while 0 passed
    assert quadratic_exactness(_X, _W, atol=atol) == quadratic_exactness(_X, _W, atol=0.0)


def test_quadratic_exactness_refuses_a_bool_atol():
    for atol in (True, torch.tensor(True)):
        with pytest.raises(TypeError, match=r"^quadratic_exactness: atol must be None or a num"):
            quadratic_exactness(_X, _W, atol=atol)


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize("scale", [None, "bad", {}])
def test_gaussian_nll_refuses_a_scale_that_is_no_number_by_name(scale):
    # before: torch's "must be real number, not NoneType" or "new(): invalid data type 'str'"
    mean = torch.zeros(4, 1)
    with pytest.raises(TypeError, match=r"^scale must be a number > 0 or a floating tensor"):
        gaussian_nll(mean, scale, mean)
    assert gaussian_nll(mean, [1.0], mean).item() == pytest.approx(0.5 * math.log(2 * math.pi))


@pytest.mark.parametrize("ax", [1, "bad", [1]])
def test_reliability_diagram_refuses_what_is_no_axes_by_name(ax):
    pytest.importorskip("matplotlib")
    # before: "'int' object has no attribute 'bar'", after the bins were computed
    probs = torch.tensor([[0.8, 0.2], [0.3, 0.7]])
    with pytest.raises(TypeError, match=r"^reliability_diagram: ax must be a matplotlib Axes"):
        reliability_diagram(probs, torch.tensor([0, 1]), num_bins=2, ax=ax)


# ---------------------------------------------------------------- the ArviZ export's labels


@pytest.mark.parametrize(
    "labels, message",
    [
        (dict(coords=1), r"coords must be a mapping dim -> coordinate values.*got 1 \(int\)$"),
        (dict(coords=["data"]), r"coords must be a mapping dim -> coordinate values"),
        (dict(dims=1), r"dims must be a mapping variable -> a sequence of dim names"),
        (dict(dims="bad"), r"dims must be a mapping variable -> a sequence of dim names"),
        (dict(dims={"z": "feature"}), r"dims must be a mapping variable -> a sequence of dim"),
        (dict(dims={"z": [1]}), r"dims must be a mapping variable -> a sequence of dim names"),
    ],
)
def test_to_inference_data_refuses_labels_of_another_type_before_drawing(labels, message):
    # before, after the draws: "'int' object is not iterable", "dictionary update sequence
    # element #0 has length 1; 2 is required"
    pytest.importorskip("arviz")

    def guide(data):
        raise AssertionError("nothing is drawn")

    with pytest.raises(TypeError, match=rf"^to_inference_data: {message}"):
        to_inference_data(_plated_model, guide, DATA, **labels)


# ---------------------------------------------------------------- annealing


@pytest.mark.parametrize("initial", [None, "bad", [0.1], {}, torch.tensor([0.1, 0.1])])
def test_geometric_annealing_refuses_an_initial_that_is_no_number_by_name(initial):
    # before: "'<' not supported between instances of 'int' and 'NoneType'", "Boolean value of
    # Tensor with more than one value is ambiguous"
    with pytest.raises(TypeError, match=r"^geometric_annealing: initial must be a real number"):
        geometric_annealing(initial, 10)
    assert repr(geometric_annealing(torch.tensor(0.5), 10)) == "geometric_annealing(0.5, 10)"


def test_anneal_likelihood_names_a_factor_beyond_the_sites_dtype():
    # before: accepted, and the ELBO blamed the model's support for the infinite log density
    annealed = anneal_likelihood(_plated_model, 1e300)
    with pytest.raises(
        ValueError,
        match=r"^anneal_likelihood at site 'x': factor=1e\+300 is beyond the range of "
        r"torch.float32 \(largest 3.4e\+38\)",
    ):
        poutine.trace(annealed).get_trace(DATA)
    trace = poutine.trace(anneal_likelihood(_plated_model, 1e300)).get_trace(DATA.double())
    assert trace.nodes["x"]["scale"] == 1e300  # within float64's range


def _poisson_counts(counts, rate_dtype=torch.float32):
    rate = pyro.sample("rate", dist.LogNormal(torch.tensor(0.0, dtype=rate_dtype), 1.0))
    with pyro.plate("data", len(counts)):
        pyro.sample("counts", dist.Poisson(rate), obs=counts)


def test_anneal_likelihood_reads_the_dtype_of_the_log_density_not_of_integer_counts():
    # before: int64 counts were skipped (no floating dtype), and the ELBO said "check the
    # model's support" of the infinite log density; the rate's float32 is the log density's
    counts = torch.tensor([1, 2, 3])
    with pytest.raises(
        ValueError, match=r"^anneal_likelihood at site 'counts': factor=1e\+300 .* torch.float32"
    ):
        poutine.trace(anneal_likelihood(_poisson_counts, 1e300)).get_trace(counts)
    # a float64 rate gives a float64 log density, where 1e300 is a number
    trace = poutine.trace(anneal_likelihood(_poisson_counts, 1e300)).get_trace(
        counts, torch.float64
    )
    trace.compute_log_prob()
    assert trace.nodes["counts"]["scale"] == 1e300
    assert trace.nodes["counts"]["log_prob"].dtype == torch.float64


# ---------------------------------------------------------------- store: tensors bounds, sound


@pytest.mark.parametrize("module", [None, 1, "bad", [1], lambda: None])
def test_detached_parameters_takes_any_object_as_follow_param_store_does(module):
    # before: "cannot create weak reference to 'NoneType' object"
    assert detached_parameters(module) == []


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(fullname=["a"]), r"fullname must be the parameter's name in the param store"),
        (dict(param=None), r"param must be the module's parameter \(a tensor\), got None"),
        (dict(param="bad"), r"param must be the module's parameter \(a tensor\), got 'bad'"),
        (dict(installed=None), r"installed must be the caller's record, a dict"),
    ],
)
def test_follow_store_refuses_arguments_of_another_type_by_name(
    fresh_param_store, arguments, message
):
    # before: "unhashable type: 'list'", "'NoneType' object has no attribute 'shape'"
    param = torch.nn.Parameter(torch.zeros(3))
    pyro.param("a", param)
    with pytest.raises(TypeError, match=rf"^follow_store: {message}"):
        follow_store(**{"fullname": "a", "param": param, "installed": {}, **arguments})


def _bounded_model(data):
    prior = dist.Normal(torch.zeros(1, dtype=torch.float64), 1.0).to_event(1)
    loc = pyro.sample("loc", prior)
    with pyro.plate("data", len(data)):
        pyro.sample("x", dist.Normal(loc, 1.0), obs=data.double())


def _bounded_guide(data, dtype=torch.float32):
    """A guide whose float64 scale lives in an interval of tensor bounds in ``dtype``."""
    lower, upper = torch.tensor([[0.25], [4.0]], dtype=dtype)
    one = torch.ones(1, dtype=torch.float64)
    scale = pyro.param("scale", one, constraint=constraints.interval(lower, upper))
    loc = pyro.param("guide_loc", 0 * one)
    pyro.sample("loc", dist.Normal(loc, scale).to_event(1))


def _steps(guide, n):
    svi = SVI(_bounded_model, guide, pyro.optim.SGD({"lr": 0.01}), Trace_ELBO())
    return [svi.step(DATA) for _ in range(n)]


def test_a_constraint_of_tensor_bounds_resumes_bit_for_bit(tmp_path, fresh_param_store):
    # the guide set up again holds the same bounds in float64 (as after a checkpoint loaded
    # onto another device, whose repr names it): the same support, another repr
    # ("tensor([0.2500], dtype=torch.float64)"), and it was refused
    pyro.set_rng_seed(0)
    _steps(_bounded_guide, 3)
    torch.save(weights_only_state(), tmp_path / "state.pt")
    lost = _steps(_bounded_guide, 3)
    pyro.clear_param_store()

    def again(data):
        _bounded_guide(data, dtype=torch.float64)

    again(DATA)  # set up
    set_weights_only_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert _steps(again, 3) == lost


@pytest.mark.parametrize("where", ["a bound's fifth decimal", "the elided middle"])
def test_another_constraint_of_tensor_bounds_is_refused_naming_the_parameter(
    fresh_param_store, where
):
    # before: accepted, its repr the same: a bound shows 4 decimals, a long one only its ends
    bounds = torch.tensor([0.25, 4.0]).repeat(2000, 1).T.clone()
    pyro.param("w", torch.ones(2000), constraint=constraints.interval(*bounds))
    saved = weights_only_state()
    pyro.clear_param_store()
    other = bounds.clone()
    if where == "the elided middle":
        other[0, 1000] = 0.5
    else:
        other[0] = 0.25001
    before = pyro.param("w", torch.ones(2000), constraint=constraints.interval(*other)).detach()
    with pytest.raises(ValueError) as error:
        set_weights_only_state(saved)
    message = str(error.value)
    assert message.startswith("the checkpoint's parameter 'w' was saved under the constraint ")
    assert "(the same repr: they differ in a bound's digits or elided entries)" in message
    assert len(message) < 1000  # the bounds' reprs are cut
    assert torch.equal(pyro.param("w"), before)  # nothing restored
