"""API-surface fixes of an audit: Markdown docstrings, type hints on public methods, and the
clear refusals of Pyro-convention arguments that mean something else here (or nothing)."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import numpy as np
import pytest

import pyro_quadvi

PACKAGE = pathlib.Path(pyro_quadvi.__file__).parent
SPHINX_ROLE = re.compile(r":(class|func|meth|attr|mod|data|exc|obj):`")


def _docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


def test_docstrings_have_no_sphinx_roles_or_rest_literal_blocks():
    """mkdocstrings renders Markdown: a role shows as ':class:`x`', a '::' as two colons."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, doc in _docstrings(ast.parse(path.read_text())):
            roles = len(SPHINX_ROLE.findall(doc))
            literal = sum(1 for text in doc.splitlines() if text.rstrip().endswith("::"))
            if roles or literal:
                found.append((path.relative_to(PACKAGE).as_posix(), line, roles, literal))
    assert found == []


def test_quadrature_rule_table_is_a_markdown_table():
    import pyro_quadvi.quadrature as quadrature

    rows = [line for line in quadrature.__doc__.splitlines() if line.startswith("|")]
    names = [row.split("|")[1].strip().strip("`") for row in rows[2:]]
    assert names == list(quadrature.RULES)
    assert set(rows[1]) == {"|", "-"}


def test_add_param_group_docstring_lists_the_group_keys():
    from pyro_quadvi.optim import QNVBOptimizer
    from pyro_quadvi.optim.torch_qnvb import _GROUP_KEYS

    doc = QNVBOptimizer.add_param_group.__doc__
    assert "_GROUP_KEYS" not in doc
    assert [key for key in _GROUP_KEYS if f"``{key}``" not in doc] == []


def test_public_methods_carry_return_types():
    from pyro_quadvi import AutoMeanFieldNormal, QuadratureELBO
    from pyro_quadvi.distributed import (
        DistributedQuadratureELBO,
        all_reduce_mean_,
        all_reduce_sum_,
    )
    from pyro_quadvi.infer import GumbelSpikeSlabELBO
    from pyro_quadvi.nn import BayesianModule

    returns = {
        BayesianModule.train: "BayesianModule",
        BayesianModule.prior_of: "Distribution",
        BayesianModule.predict: "Prediction",
        QuadratureELBO.differentiable_loss: "torch.Tensor",
        GumbelSpikeSlabELBO.differentiable_loss: "torch.Tensor",
        DistributedQuadratureELBO.differentiable_loss: "torch.Tensor",
        all_reduce_mean_: "None",
        all_reduce_sum_: "None",
    }
    assert {f.__qualname__: inspect.signature(f).return_annotation for f in returns} == {
        f.__qualname__: r for f, r in returns.items()
    }
    quantiles = inspect.signature(AutoMeanFieldNormal.quantiles).parameters["quantiles"]
    assert quantiles.annotation == "Sequence[float] | torch.Tensor"


def test_overrides_copy_their_base_signatures():
    from pyro_quadvi.nn import likelihoods
    from pyro_quadvi.quadrature import (
        BlockedSimplexRule,
        GaussHermiteRule,
        HadamardRule,
        MonteCarloRule,
        QuadratureRule,
        RASPRule,
    )

    base = inspect.signature(QuadratureRule.draw)
    rules = [RASPRule, BlockedSimplexRule, HadamardRule, GaussHermiteRule, MonteCarloRule]
    assert [r.__name__ for r in rules if inspect.signature(r.draw) != base] == []
    differing = []
    for cls in (likelihoods.Gaussian, likelihoods.Categorical, likelihoods.Bernoulli):
        for name, method in vars(cls).items():
            if inspect.isfunction(method) and not name.startswith("__"):
                if inspect.signature(method) != inspect.signature(
                    getattr(likelihoods.Likelihood, name)
                ):
                    differing.append(f"{cls.__name__}.{name}")
    assert differing == []


# -- Pyro-convention arguments that mean something else here: refused, naming the way ----------


def test_qnvb_refuses_clip_args_and_the_fallback_clips_as_it_says():
    import pyro
    import pyro.distributions as dist
    import torch
    from pyro.infer import SVI
    from pyro.optim import PyroOptim

    from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO

    with pytest.raises(TypeError, match="QNVB takes no clip_args") as refused:
        QNVB(clip_args={"clip_norm": 1.0})
    # no clipping asked for: what QNVB does anyway
    assert repr(QNVB(clip_args=None)) == repr(QNVB(clip_args={})) == "QNVB()"
    assert "trust_region" in str(refused.value)
    assert "fallback=pyro.optim.ClippedAdam(" in str(refused.value)

    # the way the message names: the fallback's parameter ``b`` (a gradient of about -1e6)
    # moves by the clipped value, lr * 0.01, in one SGD step
    def model():
        b = pyro.param("b", torch.tensor(0.0))
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(z + b, 0.01), obs=torch.tensor(100.0))

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    fallback = PyroOptim(torch.optim.SGD, {"lr": 1.0}, {"clip_value": 0.01})
    svi = SVI(model, AutoMeanFieldNormal(model), QNVB(fallback=fallback), QuadratureELBO())
    svi.step()
    assert pyro.param("b").item() == pytest.approx(0.01, rel=1e-6)
    pyro.clear_param_store()


@pytest.mark.parametrize("value", [True, False])
def test_elbos_refuse_vectorize_particles_naming_vectorize(value):
    from pyro_quadvi import QuadratureELBO
    from pyro_quadvi.infer import GumbelSpikeSlabELBO

    for make in (QuadratureELBO, GumbelSpikeSlabELBO):
        with pytest.raises(
            TypeError, match="takes no vectorize_particles: its switch is vectorize"
        ):
            make(vectorize_particles=True)
        # Pyro's default, as a port of Trace_ELBO(vectorize_particles=False) passes it: nothing
        assert make(vectorize_particles=False).vectorize is None
    from pyro_quadvi.distributed import DistributedQuadratureELBO

    with pytest.raises(TypeError, match="takes no vectorize_particles: its switch is vectorize"):
        DistributedQuadratureELBO(vectorize_particles=True)
    assert DistributedQuadratureELBO(vectorize_particles=False).vectorize is None
    # the one switch keeps its meaning: no alias was added
    assert QuadratureELBO(vectorize=value).vectorize is value
    assert GumbelSpikeSlabELBO(num_particles=4, vectorize=value).vectorize is value


def test_qnvb_optimizer_refuses_num_points_naming_num_eval():
    import torch

    from pyro_quadvi.optim import QNVBOptimizer

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match=r"num_eval") as refused:
        QNVBOptimizer(params, num_points=5)
    assert "quadrature='rasp_simplex', num_eval=5" in str(refused.value)
    assert QNVBOptimizer(params, quadrature="rasp_cross", num_eval=4).rule.num_points == 4


def test_sparse_qnvb_refuses_a_dict_of_optim_args():
    from pyro_quadvi import SparseQNVB

    with pytest.raises(TypeError, match="keyword arguments") as refused:
        SparseQNVB({"lr": 0.1})
    assert "SparseQNVB(steps_per_epoch=len(loader)" in str(refused.value)
    with pytest.raises(TypeError, match=r"num_epochs must be an integer >= 3, got 10\.0"):
        SparseQNVB(10.0, 5)
    # the positional order is a contract: num_epochs, steps_per_epoch, target_sparsity
    optimizer = SparseQNVB(4, 5, 0.9)
    hp = optimizer.sparse_hyperparameters
    assert (hp.num_epochs, optimizer.steps_per_epoch, hp.target_sparsity) == (4, 5, 0.9)


def test_qnvb_repr_shows_the_settings_that_differ_from_the_defaults():
    import pyro.optim
    import torch

    from pyro_quadvi import QNVB, SparseQNVB
    from pyro_quadvi.optim import geometric_annealing

    assert repr(QNVB()) == "QNVB()"
    assert repr(QNVB(lr=1.0, fallback=(torch.optim.Adam, {"lr": 1e-2}))) == "QNVB()"
    assert repr(QNVB({"lr": 0.5}, trust_region=0.3)) == "QNVB(lr=0.5, trust_region=0.3)"
    # under a schedule recent_fraction's default is 0.1: 1.0 differs from it
    annealed = QNVB(annealing=geometric_annealing(0.01, 100), recent_fraction=1.0)
    assert repr(annealed) == "QNVB(recent_fraction=1.0, annealing=geometric_annealing(0.01, 100))"
    clipped = QNVB(fallback=pyro.optim.PyroOptim(torch.optim.SGD, {"lr": 0.1}, {"clip_norm": 1.0}))
    assert repr(clipped) == "QNVB(fallback=PyroOptim(SGD, {'lr': 0.1}, {'clip_norm': 1.0}))"
    assert repr(QNVB(fallback=pyro.optim.ClippedAdam({"lr": 1e-3}))) == (
        "QNVB(fallback=(ClippedAdam, {'lr': 0.001}))"
    )
    assert repr(SparseQNVB(steps_per_epoch=5)) == "SparseQNVB(steps_per_epoch=5)"
    sparse = SparseQNVB(4, 5, max_lr=0.2, num_cases=100)
    assert repr(sparse) == "SparseQNVB(num_epochs=4, steps_per_epoch=5, max_lr=0.2, num_cases=100)"
    assert repr(SparseQNVB(np.int64(4), 5)) == "SparseQNVB(num_epochs=4, steps_per_epoch=5)"


def test_testing_exports_agree_with_its_problems_module():
    import pyro_quadvi.testing as testing
    from pyro_quadvi.testing import problems

    assert sorted(testing.__all__) == sorted(problems.__all__)
    assert [name for name in problems.__all__ if not hasattr(problems, name)] == []


def test_api_pages_show_public_names_and_the_datasets_module():
    yaml = pytest.importorskip("yaml")
    config, api = PACKAGE.parent / "mkdocs.yml", PACKAGE.parent / "docs" / "api" / "nn.md"
    if not (config.exists() and api.exists()):
        pytest.skip("the docs are not shipped with this install")
    handlers = yaml.safe_load(config.read_text())["plugins"][1]["mkdocstrings"]["handlers"]
    # "public": a module's __all__ where it has one (helpers outside it are not rendered)
    assert handlers["python"]["options"]["filters"] == "public"
    assert "::: pyro_quadvi.testing.datasets" in api.read_text().splitlines()
