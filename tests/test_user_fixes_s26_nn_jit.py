"""User trial t20 (session 26): a BayesianModule whose net hides its weights from
functional_call, Pyro's Jit ELBOs, TorchScript nets, and the message on a float32 x beside a
float64 net."""

import warnings

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI, JitTrace_ELBO, JitTraceMeanField_ELBO
from torch import nn

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import module_loss


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=g, dtype=dtype)
    y = x @ torch.tensor([[1.0], [-1.0], [0.5]], dtype=dtype) + 0.5 * torch.randn(
        40, 1, generator=g, dtype=dtype
    )
    return x, y


def _bnn(net):
    return BayesianModule(net, priors.Normal(1.0), likelihoods.Gaussian(40, scale=0.5))


class _Captured(nn.Module):
    """Runs its layer on a dict of the layer's parameters made in __init__."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.p = dict(inner.named_parameters())

    def forward(self, x):
        return torch.func.functional_call(self.inner, self.p, (x,))


class _Detached(nn.Module):
    """Runs its layer on detached copies of the layer's parameters."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        weights = {k: v.detach() for k, v in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, weights, (x,))


class _TwoHeads(nn.Module):
    """A head ``b`` that the forward never uses."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 1)
        self.b = nn.Linear(3, 1)

    def forward(self, x):
        return self.a(x)


@pytest.mark.parametrize("wrapper", [_Captured, _Detached])
def test_a_net_that_reads_its_weights_from_elsewhere_is_refused(wrapper):
    # it fitted the prior (loss 250.49 / 477.18 against the exact mean field's 32.61, every
    # guide scale at 1.000), without a word
    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = _bnn(wrapper(nn.Linear(3, 1)))
    x, y = _data()
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO(rule="gauss_hermite"))
    with pytest.raises(ValueError) as error:
        svi.step(x, y)
    message = str(error.value)
    assert message.startswith(
        f"BayesianModule: the outputs of the network {wrapper.__name__} do not depend on its "
        "parameters ['inner.weight', 'inner.bias'], the weights each pass samples and swaps "
        "into the net with torch.func.functional_call"
    )
    assert "captured in __init__" in message and "dict made in forward, not detached" in message
    # caught, the refusal stays: the next step fitted the prior (loss 403.9, the guide moved)
    before = {k: v.detach().clone() for k, v in guide.named_parameters()}
    with pytest.raises(ValueError, match="do not depend on its parameters"):
        svi.step(x, y)
    for name, value in guide.named_parameters():
        assert torch.equal(value, before[name]), name
    with torch.no_grad(), pytest.raises(ValueError, match="do not depend on its parameters"):
        _bnn(wrapper(nn.Linear(3, 1)))(x, y)  # the model alone, under no_grad: checked too


def test_a_head_the_forward_never_uses_is_named_in_one_warning():
    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = _bnn(_TwoHeads())
    x, y = _data()
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    svi = SVI(bnn, guide, QNVB(), QuadratureELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            svi.step(x, y)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1  # checked once per module, not at every step
    assert messages[0].startswith(
        "BayesianModule: the outputs of the network _TwoHeads on this batch do not depend on "
        "its latent parameters ['b.weight', 'b.bias']: their posterior is their prior"
    )
    assert "requires_grad_(False)" in messages[0]


@pytest.mark.parametrize("elbo", [JitTrace_ELBO, JitTraceMeanField_ELBO])
def test_pyros_jit_elbos_are_refused_by_name(elbo):
    # torch's bare "Cannot insert a Tensor that requires grad as a constant"; torch refuses
    # functional_call while tracing, so these ELBOs cannot run the net
    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = _bnn(nn.Linear(3, 1))
    x, y = _data()
    guide = AutoMeanFieldNormal(bnn, init_loc_fn=bnn.init_to_net())
    svi = SVI(bnn, guide, pyro.optim.Adam({"lr": 0.01}), elbo())
    with pytest.raises(NotImplementedError) as error:
        svi.step(x, y)
    message = str(error.value)
    assert message.startswith("BayesianModule cannot run under torch.jit.trace, which Pyro's")
    assert "JitTraceMeanField_ELBO" in message
    assert "Use the ELBO without Jit (Trace_ELBO, TraceMeanField_ELBO) or QuadratureELBO" in message
    loc = guide.median(x, y)["weight"]
    assert torch.equal(loc, bnn.net.weight.detach())  # no step taken


@pytest.mark.parametrize("jit", ["script", "trace"])
def test_a_torchscript_net_is_refused_where_it_is_given(jit):
    net = nn.Linear(3, 1)
    x, _ = _data()
    scripted = torch.jit.script(net) if jit == "script" else torch.jit.trace(net, x)
    kind = "RecursiveScriptModule" if jit == "script" else "TopLevelTracedModule"
    with pytest.raises(TypeError) as error:
        _bnn(scripted)
    assert str(error.value).startswith(
        f"BayesianModule: the network is a TorchScript module ({kind}, from torch.jit.script "
        "or torch.jit.trace)"
    )
    assert str(error.value).endswith("Pass the eager net (the module you scripted or traced)")
    with pytest.raises(TypeError) as error:
        module_loss(scripted, F.mse_loss)
    assert str(error.value).startswith(f"module_loss: the network is a TorchScript module ({kind}")
    assert "or keep the scripted net and use the closure form, step(closure)" in str(error.value)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float64])
def test_the_dtype_message_puts_numpys_float64_on_the_tensor_that_is_float64(x_dtype):
    # a float32 x on a float64 net was told "the net's parameters are torch.float64 (NumPy's
    # float64, say)"
    pyro.clear_param_store()
    torch.manual_seed(0)
    net_dtype = torch.float64 if x_dtype == torch.float32 else torch.float32
    bnn = _bnn(nn.Linear(3, 1).to(net_dtype))
    x, y = _data(x_dtype)
    guide = AutoMeanFieldNormal(bnn)
    with pytest.raises(ValueError) as error:
        SVI(bnn, guide, QNVB(), QuadratureELBO()).step(x, y.to(net_dtype))
    numpy = " (NumPy's float64, say)" if x_dtype == torch.float64 else ""
    assert str(error.value).startswith(
        f"x is {x_dtype}{numpy} but the net's parameters are {net_dtype}, and the net failed"
    )
