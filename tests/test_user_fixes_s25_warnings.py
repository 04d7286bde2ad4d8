"""Session 25: the optimizers' and the export's warnings point at the user's line.

They used fixed ``stacklevel`` counts: the Pyro ``QNVB``'s count warnings pointed inside Pyro's
``svi.py`` (at 3) or inside ``qnvb.py`` (at 2), and a count through a context manager's
``__enter__`` depended on ``contextlib``'s frames. ``user_stacklevel`` walks to the first frame
outside the package, Pyro, torch and ``contextlib``.
"""

import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.optim import SparseQNVBOptimizer


def _model(y):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 1e-6))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_qnvb_count_warning_under_svi_points_at_the_step():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = torch.randn(10, dtype=torch.float64)
    svi = SVI(_model, AutoMeanFieldNormal(_model), QNVB(), QuadratureELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):
            svi.step(y)  # the line the warning should name
    pinned = [w for w in caught if "sigma pinned at sigma_min" in str(w.message)]
    assert len(pinned) == 1
    assert pinned[0].filename == __file__
    assert (
        pinned[0].lineno
        == test_qnvb_count_warning_under_svi_points_at_the_step.__code__.co_firstlineno + 8
    )


def test_sampled_params_warning_through_the_context_manager_points_at_the_with():
    net = torch.nn.Linear(2, 1)
    opt = SparseQNVBOptimizer(net.parameters(), num_cases=10, steps_per_epoch=2, num_epochs=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.sampled_params():
            pass
    unfinished = [w for w in caught if "the sieve has not finished" in str(w.message)]
    assert len(unfinished) == 1
    assert unfinished[0].filename == __file__
