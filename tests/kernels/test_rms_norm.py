"""RMSNorm and fused add+RMSNorm: Triton kernel vs torch reference."""

import pytest
import torch

from cleave.kernels import rms_norm as rms_norm_module
from cleave.kernels.rms_norm import (
    fused_add_rms_norm,
    rms_norm,
    rms_norm_reference,
)
from tests.kernels.ulp import assert_close_ulps

SHAPES = [(13, 1000), (1, 64), (5, 3, 96), (32, 128)]


def make_weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    # In bf16 the weights are signed powers of two: the weight multiply is then exact, so the
    # interpreter's truncating cast of the normed row stays a 1-ulp difference.
    if dtype == torch.float32:
        return torch.randn(hidden)
    exponent = torch.randint(-2, 3, (hidden,)).float()
    sign = torch.where(torch.rand(hidden) < 0.5, -1.0, 1.0)
    return (sign * torch.exp2(exponent)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 3
    weight = make_weight(shape[-1], dtype)
    out = rms_norm(x, weight, 1e-6, impl="triton")
    assert_close_ulps(out, rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_updates_residual_in_place(shape, dtype):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype)
    residual = torch.randn(shape, dtype=dtype)
    expected_residual = residual + x
    weight = make_weight(shape[-1], dtype)
    storage = residual.data_ptr()
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5, impl="triton")
    assert new_residual is residual and residual.data_ptr() == storage
    assert_close_ulps(residual, expected_residual)
    # normalise what the kernel stored, so a 1-ulp residual difference does not compound
    assert_close_ulps(out, rms_norm_reference(residual, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2500), (2, 96)])
def test_fused_add_rms_norm_reload_kernel(monkeypatch, shape, dtype):
    # the kernel large calls take: two passes over each row (2500 wide: two 2048-wide steps)
    monkeypatch.setattr(rms_norm_module, "RELOAD_MIN_ELEMENTS", 0)
    torch.manual_seed(3)
    x = torch.randn(shape, dtype=dtype)
    residual = torch.randn(shape, dtype=dtype)
    expected_residual = residual + x
    weight = make_weight(shape[-1], dtype)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5, impl="triton")
    assert new_residual is residual
    assert_close_ulps(residual, expected_residual)
    assert_close_ulps(out, rms_norm_reference(residual, weight, 1e-5))


def test_fp16_and_strided_rows():
    torch.manual_seed(2)
    base = torch.randn(7, 300, dtype=torch.float16)
    x = base[:, :200]  # [7, 200] rows 300 apart
    weight = torch.randn(200, dtype=torch.float16)
    out = rms_norm(x, weight, 1e-6, impl="triton")
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6), rtol=2e-3, atol=2e-3)


def test_auto_uses_reference_on_cpu():
    x = torch.randn(3, 8)
    weight = torch.randn(8)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (4096, 4096), (333, 5120), (64, 8192)])
def test_gpu_bf16(shape):
    # the second round takes the cached launch path, on fresh data
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        weight = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda")
        # arbitrary bf16 weights: a 1-ulp tie in the normed row can become 2 ulps after the multiply
        assert_close_ulps(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), ulps=2)
        expected_residual = residual + x
        out, _ = fused_add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(residual, expected_residual)
        assert_close_ulps(out, rms_norm_reference(expected_residual, weight, 1e-6), ulps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (1, 1 << 26)])
def test_gpu_bf16_reload_kernel(shape):
    # at least RELOAD_MIN_ELEMENTS: the two-pass kernel
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda")
    expected_residual = residual + x
    out, _ = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert_close_ulps(out, rms_norm_reference(expected_residual, weight, 1e-6), ulps=2)


@pytest.mark.gpu
def test_gpu_unaligned_view_after_aligned_call():
    # a view starting 2 bytes into its storage must not reuse the kernel built for aligned rows
    torch.manual_seed(0)
    base = torch.randn(64, 4097, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    for x in (base[:, :4096].contiguous(), base[:, 1:], base[:, :4096].contiguous()):
        assert_close_ulps(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), ulps=2)
