"""Test-suite settings: one torch thread per process (the suite runs in 2 xdist workers)."""

import importlib.util
from pathlib import Path

import pyro
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def fresh_param_store():
    """An empty param store and ``pyro.set_rng_seed(0)`` before the test; emptied after it."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


@pytest.fixture(scope="session")
def load_script():
    """A function loading a script of the repository (``"tutorials/x.py"``) as a module."""

    def load(relative: str):
        path = Path(__file__).resolve().parent.parent / relative
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def run_quick(tmp_path):
    """A function running a tutorial module's ``main`` in ``--quick`` mode; returns its result and
    the figure's path. ``main`` runs single-threaded: the thread count is restored after it."""

    def run(tutorial, figure: str):
        out = tmp_path / figure
        threads = torch.get_num_threads()
        try:
            result = tutorial.main(["--quick", "--out", str(out)])
        finally:
            torch.set_num_threads(threads)
        return result, out

    return run
