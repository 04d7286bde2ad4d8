"""The fast Walsh-Hadamard transform against the explicit Hadamard matrix."""

from __future__ import annotations

import math

import pytest
import scipy.linalg
import torch
from torch.func import grad, jvp, vmap

from pyro_quadvi.linalg import fwht
from pyro_quadvi.quadrature import hadamard_signs

F64 = torch.float64


def explicit(size: int, dtype=F64) -> torch.Tensor:
    return torch.from_numpy(scipy.linalg.hadamard(size)).to(dtype)


@pytest.mark.parametrize("bits", range(13))
def test_equals_the_explicit_matrix(bits):
    size = 1 << bits
    generator = torch.Generator().manual_seed(bits)
    for shape in [(size,), (3, size), (2, 1, size)] if bits < 11 else [(2, size)]:
        # integer entries: every partial sum is exact in float64, so the two agree bit for bit
        x = torch.randint(-50, 50, shape, generator=generator).to(F64)
        assert torch.equal(fwht(x), x @ explicit(size))
        y = torch.randn(shape, generator=generator, dtype=F64)
        torch.testing.assert_close(fwht(y), y @ explicit(size), rtol=0, atol=1e-12 * size)
        torch.testing.assert_close(
            fwht(y, normalized=True), y @ explicit(size) / math.sqrt(size), rtol=0, atol=1e-12
        )


def test_sign_helper_is_the_same_matrix():
    index = torch.arange(64, dtype=torch.int32)
    signs = hadamard_signs(index.unsqueeze(0), index.unsqueeze(1), dtype=F64)
    assert torch.equal(signs, explicit(64))
    assert torch.equal(fwht(torch.eye(64, dtype=F64)), signs)


def test_orthonormal_transform_is_its_own_inverse_and_keeps_norms():
    x = torch.randn(5, 1024, dtype=F64, generator=torch.Generator().manual_seed(1))
    y = fwht(x, normalized=True)
    torch.testing.assert_close(fwht(y, normalized=True), x, rtol=0, atol=1e-13)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-14, atol=0)


def test_float32_keeps_its_dtype_and_matches_float64():
    x = torch.randn(4, 4096, dtype=F64, generator=torch.Generator().manual_seed(2))
    y32 = fwht(x.float(), normalized=True)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), fwht(x, normalized=True), rtol=0, atol=1e-5)


@pytest.mark.parametrize("normalized", [False, True])
def test_gradcheck_float64(normalized):
    x = torch.randn(3, 64, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: fwht(t, normalized), (x,))
    assert torch.autograd.gradgradcheck(lambda t: fwht(t, normalized), (x,))


def test_backward_is_the_transform_of_the_gradient():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, dtype=F64, generator=generator, requires_grad=True)
    w = torch.randn(2, 256, dtype=F64, generator=generator)
    (fwht(x) * w).sum().backward()
    torch.testing.assert_close(x.grad, w @ explicit(256), rtol=0, atol=1e-11)


def test_vmap_grad_and_forward_mode():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 32, dtype=F64, generator=generator)
    assert torch.equal(vmap(fwht)(x), fwht(x))
    assert torch.equal(vmap(vmap(lambda t: fwht(t, True)))(x), fwht(x, True))
    # d/dx sum(fwht(x)^2) = 2 H H x = 2 D x
    gradient = vmap(grad(lambda t: fwht(t).square().sum()))(x)
    torch.testing.assert_close(gradient, 2 * 32 * x, rtol=1e-14, atol=1e-12)
    tangent = torch.randn(6, 3, 32, dtype=F64, generator=generator)
    _, out = jvp(fwht, (x,), (tangent,))
    torch.testing.assert_close(out, tangent @ explicit(32), rtol=0, atol=1e-12)


@pytest.mark.parametrize("normalized", [False, True])
def test_a_last_dim_of_one_gives_a_new_tensor(normalized):
    # H = [1]: the values are the input's, in a tensor of their own (it was the input itself, so
    # an in-place change of the output changed the input)
    x = torch.ones(3, 1, dtype=F64)
    y = fwht(x, normalized=normalized)
    y.mul_(5.0)
    assert x.tolist() == [[1.0], [1.0], [1.0]] and y.tolist() == [[5.0], [5.0], [5.0]]


def test_empty_batch():
    assert fwht(torch.zeros(0, 8)).shape == (0, 8)


def test_bad_input():
    with pytest.raises(ValueError, match=r"power of two.*pad it with zeros to 16"):
        fwht(torch.zeros(3, 12))
    with pytest.raises(TypeError, match="floating dtype"):
        fwht(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least one dim"):
        fwht(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        fwht([1.0, 2.0])
