"""API-surface fixes of an audit: Markdown docstrings, type hints on public methods, and the
clear refusals of Pyro-convention arguments that mean something else here (or nothing)."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

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
