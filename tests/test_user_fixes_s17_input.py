"""Session 17: bad input to the package's pure functions, from the bad-input sweep of the API.

Each of these calls was accepted and gave a wrong or non-finite answer without a word (or failed
later, far from the cause): the QNVB update broadcast a ``g`` of another shape over the mean
field and ran on with a NaN, negative or infinite ``weight``; the sparse update broadcast ``g``
and ``h``; ``anneal_likelihood`` took a factor of 0, -1 or 1.5; ``theorem_inclusion`` returned
NaN or an "inclusion probability" of 17224; importance sampling returned ``(-inf, nan)``;
``gauss_hermite(max_bytes=nan)`` switched its memory guard off; ``num_bins=10**9`` hung the
calibration metrics. Each is now refused, naming the argument.
"""

from __future__ import annotations

import math
import re

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

from pyro_quadvi.evidence import importance_log_evidence, nested_sampling_log_evidence, prior_guide
from pyro_quadvi.metrics import calibration_bins, expected_calibration_error
from pyro_quadvi.nn import priors
from pyro_quadvi.optim import AnnealLikelihoodMessenger, anneal_likelihood, qnvb_functional
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)
from pyro_quadvi.optim.sparse_functional import (
    SparseQNVBHyperparameters,
    init_sparse_block,
    init_sparse_counters,
    sparse_qnvb_update,
)
from pyro_quadvi.quadrature import (
    BlockedSimplexRule,
    GaussHermiteRule,
    HadamardRule,
    MonteCarloRule,
    RASPRule,
    gauss_hermite,
    make_rule,
)
from pyro_quadvi.testing.update_cases import update_inputs

DTYPE = torch.float64
HP = QNVBHyperparameters()


def _reference(args: dict, **kwargs):
    return qnvb_update(args["mu"], args["sigma"], args["g"], args["h"], args["state"], HP, **kwargs)


def _many(args: dict, **kwargs):
    lists = [[args[k]] for k in ("mu", "sigma", "g", "h", "state")]
    return qnvb_update_many(*lists, HP, **kwargs)[0]


UPDATES = {"qnvb_update": (_reference, ""), "qnvb_update_many": (_many, "[0]")}


# ------------------------------------------------------------------------- the QNVB update


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("argument", ["sigma", "g", "h", "state.h_avg"])
@pytest.mark.parametrize("shape", [(1,), (3, 1), (0,)])
def test_an_argument_of_another_shape_than_the_mean_is_refused_not_broadcast(
    update, argument, shape
):
    # before: a g of shape (1,) moved every coordinate by its one value, a (3, 1) g grew the
    # (3,) mean field and its state to (3, 3), an empty one gave an empty result
    call, index = UPDATES[update]
    args = update_inputs()
    bad = torch.ones(shape, dtype=DTYPE)
    if argument == "state.h_avg":
        args["state"] = args["state"]._replace(h_avg=bad)
    else:
        args[argument] = bad
    plural = {"sigma": "sigmas", "g": "gs", "h": "hs", "state.h_avg": "states"}[argument]
    name = argument if not index else f"{plural}{index}" + (".h_avg" if "." in argument else "")
    mean = "mu" if not index else "mus[0]"
    message = rf"{update}: {re.escape(name)} has shape {re.escape(str(shape))}, {re.escape(mean)}"
    with pytest.raises(ValueError, match=message + r" \(3,\).*does not broadcast"):
        call(args)


@pytest.mark.parametrize("update", UPDATES)
def test_arguments_that_are_not_tensors_are_refused_by_name(update):
    call, index = UPDATES[update]
    args = update_inputs()
    args["h"] = 1.0
    name = "h" if not index else "hs[0]"
    with pytest.raises(TypeError, match=rf"{update}: {re.escape(name)} must be a tensor of"):
        call(args)
    args = update_inputs()
    args["state"] = list(args["state"])
    with pytest.raises(TypeError, match=r"must be a QNVBState \(init_qnvb_state\(mu\)"):
        call(args)
    args = update_inputs()
    fields = [args[k] if not index else [args[k]] for k in ("mu", "sigma", "g", "h", "state")]
    with pytest.raises(TypeError, match=f"{update}: hp must be a QNVBHyperparameters, got dict"):
        (qnvb_update_many if index else qnvb_update)(*fields, {"lr": 1.0})


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize(
    "argument, value, expected",
    [
        ("weight", math.nan, r"weight must be finite and > 0"),
        ("weight", math.inf, r"weight must be finite and > 0"),
        ("weight", -1.0, r"weight must be finite and > 0"),
        ("weight", 0.0, r"weight must be finite and > 0"),
        ("weight", torch.tensor(math.nan), r"weight must be finite and > 0"),
        ("prior_precision", math.nan, r"prior_precision must be finite and >= 0"),
        ("prior_precision", math.inf, r"prior_precision must be finite and >= 0"),
        ("prior_precision", -1.0, r"prior_precision must be finite and >= 0"),
    ],
)
def test_a_weight_or_prior_precision_out_of_range_is_refused(update, argument, value, expected):
    # before: NaN or infinity made every coordinate non-finite, kept unchanged without a word; a
    # negative one stepped the wrong way; weight 0 divided the held curvature by 0 (the
    # coordinates whose h was not positive were kept and counted as overflows)
    call, _ = UPDATES[update]
    with pytest.raises(ValueError, match=rf"{update}: {expected} \(.*\), got"):
        call(update_inputs(), **{argument: value})
    with pytest.raises(TypeError, match=rf"{update}: {argument} must be a real number"):
        call(update_inputs(), **{argument: True})


@pytest.mark.parametrize("update", UPDATES)
def test_valid_weights_give_the_same_bits_as_numbers_and_as_tensors(update):
    call, _ = UPDATES[update]
    as_numbers = call(update_inputs(), weight=50.0, prior_precision=2.0)
    as_tensors = call(
        update_inputs(),
        weight=torch.tensor(50.0, dtype=DTYPE),
        prior_precision=torch.tensor(2.0, dtype=DTYPE),
    )
    numbers = (as_numbers.mu, as_numbers.sigma, *as_numbers.state)
    tensors = (as_tensors.mu, as_tensors.sigma, *as_tensors.state)
    assert all(torch.equal(a, b) for a, b in zip(numbers, tensors))


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("argument", ["mu", "sigma"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_mean_or_scale_is_refused_with_its_count(update, argument, value):
    # before: the guard kept a NaN or infinite mean as it was (counted as an overflow) and
    # clamped an infinite scale to sigma_max, at every step
    call, index = UPDATES[update]
    args = update_inputs(5)
    args[argument] = args[argument].clone()
    args[argument][[1, 3]] = value
    name = (
        argument if not index else f"{argument.replace('mu', 'mus').replace('sigma', 'sigmas')}[0]"
    )
    with pytest.raises(ValueError, match=rf"{re.escape(name)} is not finite at 2 of 5 coordinates"):
        call(args)


def test_the_flat_update_refuses_a_non_finite_scale_in_a_later_chunk(monkeypatch):
    # the flat update tests the mean and scale only in a chunk whose guard acts: an infinite scale
    # in the third chunk of the second tensor is found, and counted over every tensor
    monkeypatch.setattr(qnvb_functional, "_CHUNK", 64)
    first, second = update_inputs(100), update_inputs(200)
    second["sigma"] = second["sigma"].clone()
    second["sigma"][150] = math.inf
    lists = [[first[k], second[k]] for k in ("mu", "sigma", "g", "h", "state")]
    with pytest.raises(ValueError, match=r"sigmas\[1\] is not finite at 1 of 200 coordinates"):
        qnvb_update_many(*lists, HP)


def test_in_place_the_guard_keeps_a_non_finite_mean_as_before():
    # with donate the chunks before it are written: the coordinate is kept and counted, not refused
    args = update_inputs()
    args["mu"] = args["mu"].clone()
    args["mu"][1] = math.nan
    lists = [
        [args[k].clone() if k != "state" else args[k]] for k in ("mu", "sigma", "g", "h", "state")
    ]
    result = qnvb_update_many(*lists, HP, donate=("mu",))[0]
    assert math.isnan(float(result.mu[1])) and int(result.num_overflow) == 1


def test_a_non_finite_g_still_leaves_its_coordinate_unchanged():
    # the guard's own case (a bad gradient) is not refused: the coordinate keeps its values
    for call, _ in UPDATES.values():
        args = update_inputs()
        args["g"] = args["g"].clone()
        args["g"][0] = math.nan
        result = call(args)
        assert float(result.mu[0]) == float(args["mu"][0]) and int(result.num_nonfinite) == 1


def test_the_reference_does_not_read_the_mean_back_under_vmap():
    # vmap refuses to read a value back: the refusal of a non-finite mean is left out there
    def update(mu):
        return qnvb_update(
            mu,
            torch.ones_like(mu),
            torch.ones_like(mu),
            torch.ones_like(mu),
            init_qnvb_state(mu),
            HP,
        ).mu

    mu = torch.func.vmap(update)(torch.tensor([[0.0, math.nan]], dtype=DTYPE))
    assert math.isnan(float(mu[0, 1])) and float(mu[0, 0]) == pytest.approx(-1.0)


def test_init_qnvb_state_refuses_a_mean_that_is_not_a_tensor():
    with pytest.raises(TypeError, match="init_qnvb_state: mu must be a tensor, got list"):
        init_qnvb_state([0.0, 1.0])


# ------------------------------------------------------------------------ the sparse update


@pytest.mark.parametrize("argument", ["g", "h"])
@pytest.mark.parametrize("bad", [torch.ones(1), torch.ones(3, 1), torch.ones(0)])
def test_the_sparse_update_refuses_a_g_or_h_of_another_shape(argument, bad):
    # before: g1 grew to (3, 3) by broadcasting, or a (1,) g moved every coordinate
    hp = SparseQNVBHyperparameters()
    block = init_sparse_block(torch.zeros(3), hp)
    moments = {"g": [torch.ones(3)], "h": [torch.ones(3)]}
    moments[argument] = [bad]
    with pytest.raises(
        ValueError,
        match=rf"sparse_qnvb_update: {argument}\[0\] has shape {re.escape(str(tuple(bad.shape)))}, "
        r"blocks\[0\]\.mu \(3,\)",
    ):
        sparse_qnvb_update(
            [block], init_sparse_counters(hp, 10), moments["g"], moments["h"], hp, 10
        )
    moments[argument] = [1.0]
    with pytest.raises(TypeError, match=rf"{argument}\[0\] must be a tensor of blocks\[0\]\.mu's"):
        sparse_qnvb_update(
            [block], init_sparse_counters(hp, 10), moments["g"], moments["h"], hp, 10
        )


# ----------------------------------------------------------------------------- annealing


def _model():
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.5))


@pytest.mark.parametrize("factor", [0, -1.0, math.nan, math.inf])
def test_anneal_likelihood_refuses_a_factor_that_is_not_finite_and_positive(factor):
    # before: 0 dropped the likelihood, -1 flipped the ELBO's sign, all without a word
    with pytest.raises(ValueError, match=r"anneal_likelihood: factor must be a finite factor > 0"):
        anneal_likelihood(_model, factor)


@pytest.mark.parametrize("factor", [0.0, -0.5, math.nan])
def test_a_factor_callable_going_out_of_range_is_refused_at_the_site(factor):
    values = iter([0.5, factor])
    annealed = anneal_likelihood(_model, lambda: next(values))
    poutine.trace(annealed).get_trace()  # 0.5: fine
    with pytest.raises(ValueError, match=r"factor\(\) at site 'x' must be a finite factor > 0"):
        poutine.trace(annealed).get_trace()


def test_anneal_likelihood_refuses_what_is_not_a_model_or_a_factor():
    with pytest.raises(TypeError, match="anneal_likelihood: model must be a callable"):
        anneal_likelihood(None, 0.5)
    with pytest.raises(TypeError, match=r"factor must be a real number > 0, got 'x'"):
        anneal_likelihood(_model, "x")
    with pytest.raises(TypeError, match="AnnealLikelihoodMessenger: factor must be a callable"):
        AnnealLikelihoodMessenger(0.5)


def test_valid_factors_scale_the_likelihood_as_before():
    # a factor above 1 (a "cold" posterior) is the optimizers' rule too (annealing_factor)
    for factor, scale in ((0.25, 0.25), (torch.tensor(0.25), 0.25), (lambda: 0.25, 0.25), (1, 1.0)):
        conditioned = poutine.condition(anneal_likelihood(_model, factor), {"z": torch.tensor(0.3)})
        trace = poutine.trace(conditioned)
        node = trace.get_trace().nodes["x"]
        assert float(node["scale"]) == scale
    for factor in (1.5, lambda: 1.5):
        conditioned = poutine.condition(anneal_likelihood(_model, factor), {"z": torch.tensor(0.3)})
        assert float(poutine.trace(conditioned).get_trace().nodes["x"]["scale"]) == 1.5


# ---------------------------------------------------------------------- theorem_inclusion

_THEOREM = dict(num_params=1527, hidden_layers=3, width=7, num_data=3000, num_inputs=200)


@pytest.mark.parametrize("delta", [math.nan, math.inf, -math.inf, 0.0, -1.0])
def test_theorem_inclusion_refuses_a_delta_that_is_not_finite_and_positive(delta):
    # before: NaN, or delta = -1 an "inclusion probability" of 17224
    with pytest.raises(ValueError, match=r"theorem_inclusion: delta must be finite and > 0, got"):
        priors.theorem_inclusion(**_THEOREM, delta=delta)


def test_theorem_inclusion_names_a_delta_that_is_no_number():
    # read "delta must be a real number a finite number > 0" before
    with pytest.raises(TypeError, match=r"^theorem_inclusion: delta must be a real number finite"):
        priors.theorem_inclusion(**_THEOREM, delta="0.1")


@pytest.mark.parametrize(("delta", "expected"), [(1.0, 1e-6), (2.0, 1e-10)])
def test_theorem_inclusion_takes_any_delta_above_zero(delta, expected):
    # the theorem holds "for any constant delta > 0"; delta >= 1 was refused. By hand, T = 100,
    # L = 1, N = 10, n = 100, p = 10: -log lambda = log 100 + delta (2 log 10 + log(10 * 10))
    # = (2 + 4 delta) log 10, so lambda = 10^-(2 + 4 delta)
    counts = dict(num_params=100, hidden_layers=1, width=10, num_data=100, num_inputs=10)
    assert priors.theorem_inclusion(**counts, delta=delta) == pytest.approx(expected, rel=1e-12)


def test_theorem_inclusion_refuses_a_delta_whose_lambda_underflows():
    # the paper's network: log T = 7.331, (L + 1) log N + log(sqrt(n) p) = 17.085; delta = 50 gives
    # -log lambda = 861.6, and exp(-861.6) is 0 in float64; 745 is reached at delta = 43.18
    with pytest.raises(ValueError, match=r"delta=50 gives -log lambda = 861\.6, .* delta < 43\.18"):
        priors.theorem_inclusion(**_THEOREM, delta=50)
    assert priors.theorem_inclusion(**_THEOREM, delta=43) > 0


@pytest.mark.parametrize("argument", list(_THEOREM))
@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (math.nan, TypeError)])
def test_theorem_inclusion_refuses_counts_that_are_not_positive_integers(argument, value, error):
    # before: hidden_layers 0 or -1 ran, NaN anywhere returned NaN
    with pytest.raises(error, match=rf"theorem_inclusion: {argument} must be an integer >= 1"):
        priors.theorem_inclusion(**{**_THEOREM, argument: value})


def test_theorem_inclusion_of_valid_counts_is_unchanged():
    assert priors.theorem_inclusion(**_THEOREM) == pytest.approx(1.1862e-4, rel=1e-3)


def test_a_prior_number_beyond_the_parameters_dtype_is_refused_by_name():
    # before: torch's "value cannot be converted to type float without overflow" at the first step
    param = torch.zeros(2, 3)
    for prior, setting in [
        (priors.Normal(scale=1e300), "scale=1e+300"),
        (priors.Normal(loc=-1e300), "loc=-1e+300"),
        (priors.SpikeSlab(0.5, slab_scale=1e300), "slab_scale=1e+300"),
        (priors.LayerwiseNormal(scale=1e300), "scale * std="),
    ]:
        with pytest.raises(
            ValueError,
            match=rf": {re.escape(setting)}.* for parameter 'w' is beyond"
            r" the largest torch.float32",
        ):
            prior("w", param)
        prior("w", param.double())  # finite in float64: fine


# --------------------------------------------------------------------------- evidence


def _normal_normal(x):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))
    pyro.sample("x", dist.Normal(mu, 0.1), obs=x)


@pytest.mark.parametrize(
    "num_samples, error", [(True, TypeError), (1, ValueError), (0, ValueError), (2.5, TypeError)]
)
def test_importance_sampling_needs_two_samples_or_more(num_samples, error):
    # before: True (one sample) returned a standard error of inf; 0 failed in torch.cat
    with pytest.raises(error, match="importance_log_evidence: num_samples must be an integer >= 2"):
        importance_log_evidence(
            _normal_normal,
            prior_guide(_normal_normal),
            torch.tensor(0.7, dtype=DTYPE),
            num_samples=num_samples,
        )
    with pytest.raises(
        ValueError, match="importance_log_evidence: batch_size must be an integer >= 1"
    ):
        importance_log_evidence(
            _normal_normal,
            prior_guide(_normal_normal),
            torch.tensor(0.7, dtype=DTYPE),
            batch_size=0,
        )


def test_a_non_finite_importance_estimate_is_raised_with_its_cause():
    # before: an infinite observation returned (-inf, nan) as an estimate
    pyro.set_rng_seed(0)
    with pytest.raises(
        ValueError,
        match=r"importance_log_evidence: the estimate is not finite \(log evidence -inf, standard "
        r"error nan\): of the 20 log weights .* 0 are NaN, 0 \+inf and 20 -inf",
    ):
        importance_log_evidence(
            _normal_normal,
            prior_guide(_normal_normal),
            torch.tensor(math.inf, dtype=DTYPE),
            num_samples=20,
        )


@pytest.mark.parametrize(
    "argument, value, expected",
    [
        ("ndim", 0, "ndim must be an integer >= 1"),
        ("nlive", 0, "nlive must be an integer >= 1"),
        ("seed", -1, "seed must be an integer >= 0"),
        ("dlogz", math.nan, "dlogz must be finite and >= 0"),
        ("dlogz", -1.0, "dlogz must be finite and >= 0"),
    ],
)
def test_nested_sampling_checks_its_numbers_before_dynesty(argument, value, expected):
    # before: dynesty or numpy failed ("zero-size array to reduction operation maximum"), or a
    # NaN or negative dlogz ran as if it were 0; checked even without dynesty installed
    kwargs = {"ndim": 1, argument: value}
    with pytest.raises(ValueError, match=f"nested_sampling_log_evidence: {expected}"):
        nested_sampling_log_evidence(lambda t: 0.0, lambda u: u, **kwargs)


# -------------------------------------------------------------------------- quadrature


def test_gauss_hermite_checks_max_bytes_as_the_rules_do():
    # before: max_bytes=nan compared False with every size: the memory guard was off
    for max_bytes in (math.nan, math.inf, 2.5, True):
        with pytest.raises(ValueError, match=r"max_bytes must be an integer >= 1"):
            gauss_hermite(5, max_bytes=max_bytes)
    nodes, _ = gauss_hermite(5, max_bytes=1000)
    assert nodes.shape == (5,)


@pytest.mark.parametrize(
    "rule", [GaussHermiteRule, MonteCarloRule, RASPRule, BlockedSimplexRule, HadamardRule]
)
@pytest.mark.parametrize("num_points", [None, "4", math.nan, 2.5, 4.0, True])
def test_every_rule_constructor_refuses_a_num_points_that_is_not_an_int(rule, num_points):
    # before: only make_rule checked; the classes failed later in torch ("unsupported range: 1 ->
    # nan", "full(): argument 'size' ... must be tuple of ints") or with "'<' not supported"
    with pytest.raises(ValueError, match=r"num_points must be an int, got"):
        rule(num_points)


def test_integer_num_points_of_numpy_or_torch_build_the_same_rule():
    assert make_rule("hadamard", torch.tensor(4)).num_points == 4
    nodes = []
    for num_points in (torch.tensor(3), 3):
        rule = RASPRule(num_points)
        assert type(rule.num_points) is int
        nodes.append(rule.nodes(5, generator=torch.Generator().manual_seed(0)))
    assert all(torch.equal(a, b) for a, b in zip(*nodes))


# ----------------------------------------------------------------------------- metrics

_PROBS = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.65, 0.35]], dtype=DTYPE)
_LABELS = torch.tensor([0, 0, 1])


def test_more_bins_than_cases_and_than_fifteen_are_refused():
    many = torch.full((20, 2), 0.5, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"num_bins=21 is more than the 20 cases"):
        calibration_bins(many, torch.zeros(20, dtype=torch.long), num_bins=21)
    # before: num_bins=10**9 asked for some 32 GB and timed out
    with pytest.raises(
        ValueError, match=r"num_bins=1000000000 is more than the 3 cases .* pass num_bins <= 15"
    ):
        expected_calibration_error(_PROBS, _LABELS, num_bins=10**9)
    # up to 15 for any number of cases (the default), and up to n above it
    assert calibration_bins(_PROBS, _LABELS, num_bins=15).count.sum() == 3
    assert calibration_bins(many, torch.zeros(20, dtype=torch.long), num_bins=20).count.sum() == 20


def test_a_rule_name_that_is_no_str_is_refused_by_name():
    # it gave "unhashable type: 'list'" from QNVBOptimizer(quadrature=[...]) (session 17 trial)
    from pyro_quadvi.optim import QNVBOptimizer

    with pytest.raises(TypeError, match=r"a quadrature rule's name is a str, one of \["):
        QNVBOptimizer([torch.nn.Parameter(torch.zeros(2))], quadrature=["hadamard"])
