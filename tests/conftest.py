"""Test-suite settings: one torch thread per process (the suite runs in 2 xdist workers)."""

import importlib.util
import tempfile
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


@pytest.fixture
def float64_store():
    """float64 as torch's default dtype and an empty param store for the test; the dtype restored
    and the store emptied after it."""
    pyro.clear_param_store()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
    pyro.clear_param_store()


@pytest.fixture(scope="session")
def spawn_ranks():
    """``pyro_quadvi.testing.ranks.run_ranks``, a test failure (not an error) where the ranks do
    not all finish in time: a rank left waiting is the bug the distributed tests look for."""
    from pyro_quadvi.testing.ranks import RanksFailed, run_ranks

    def spawn(scenarios, outdir: Path, **kwargs) -> list:
        try:
            return run_ranks(scenarios, outdir, **kwargs)
        except RanksFailed as error:
            pytest.fail(f"a rank was left waiting: {error}")

    return spawn


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
def run_quick(tmp_path, monkeypatch):
    """A function running a tutorial module's ``main(["--quick", *extra])`` without ``--out``;
    returns its result and the figure's path.

    It runs in an empty working directory with a ``docs/img`` folder, and with the temporary
    directory (``tempfile.gettempdir()``) inside ``tmp_path``: a quick run must leave ``docs/img``
    untouched and write ``figure`` (the name the tutorial gives it) to the temporary directory.
    ``main`` runs single-threaded: the thread count is restored after it."""

    def run(tutorial, figure: str, *extra: str):
        work, temp = tmp_path / "work", tmp_path / "temp"
        (work / "docs" / "img").mkdir(parents=True)
        temp.mkdir()
        monkeypatch.chdir(work)
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        threads = torch.get_num_threads()
        try:
            result = tutorial.main(["--quick", *extra])
        finally:
            torch.set_num_threads(threads)
        assert list((work / "docs" / "img").iterdir()) == []
        return result, temp / figure

    return run
