"""Test-suite settings: one torch thread per process (the suite runs in 2 xdist workers)."""

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
