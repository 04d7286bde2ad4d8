"""Every public name (the ``__all__`` of the package and its subpackages) has a page under
``docs/api``: its defining module, or the name itself, is the target of a ``:::`` directive.
``GuideDelta`` was public without one (session 25)."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

PACKAGES = (
    "pyro_quadvi",
    "pyro_quadvi.quadrature",
    "pyro_quadvi.guides",
    "pyro_quadvi.infer",
    "pyro_quadvi.optim",
    "pyro_quadvi.nn",
    "pyro_quadvi.nn.whvi",
    "pyro_quadvi.metrics",
    "pyro_quadvi.evidence",
    "pyro_quadvi.export",
    "pyro_quadvi.distributions",
    "pyro_quadvi.distributed",
)
API = Path(__file__).resolve().parent.parent / "docs" / "api"


def _targets() -> set[str]:
    text = "\n".join(page.read_text() for page in API.glob("*.md"))
    return set(re.findall(r"^::: *([\w.]+)", text, flags=re.MULTILINE))


def _documented_objects(targets: set[str]) -> set[int]:
    """The ids of the objects that a directive names itself (``::: pkg.module.function``)."""
    found = set()
    for target in targets:
        parent, _, name = target.rpartition(".")
        try:
            found.add(id(getattr(importlib.import_module(parent), name)))
        except (ImportError, AttributeError):
            continue
    return found


def _public():
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{package}.{name}", obj


@pytest.mark.parametrize(
    "qualified,obj", list(_public()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_public_class_and_function_has_an_api_page(qualified, obj):
    targets = _targets()
    home = obj.__module__
    assert home in targets or id(obj) in _documented_objects(targets), (
        f"{qualified} (defined in {home}) has no ::: directive in docs/api/*.md"
    )
