"""LayerNorm and fused add+LayerNorm: Triton kernel vs torch reference."""

import pytest
import torch
import torch.nn.functional as F

from cleave.kernels.layer_norm import (
    fused_add_layer_norm,
    layer_norm,
    layer_norm_reference,
)
from tests.kernels.ulp import NEAR_ZERO, assert_close_ulps

SHAPES = [(13, 1000), (1, 64), (5, 3, 96)]


def test_reference_is_torch_layer_norm():
    x = torch.randn(4, 40)
    weight, bias = torch.randn(40), torch.randn(40)
    assert torch.equal(layer_norm_reference(x, weight, bias, 1e-5), F.layer_norm(x, (40,), weight, bias, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_reference(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 2 + 0.5
    weight = torch.randn(shape[-1], dtype=dtype)
    bias = torch.randn(shape[-1], dtype=dtype)
    out = layer_norm(x, weight, bias, 1e-5, impl="triton")
    assert_close_ulps(out, layer_norm_reference(x, weight, bias, 1e-5), atol=NEAR_ZERO)


def test_layer_norm_without_affine():
    torch.manual_seed(1)
    x = torch.randn(6, 130)
    torch.testing.assert_close(
        layer_norm(x, None, None, 1e-5, impl="triton"), F.layer_norm(x, (130,)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_fused_add_layer_norm_updates_residual_in_place(shape, dtype):
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype)
    residual = torch.randn(shape, dtype=dtype)
    expected_residual = residual + x
    weight = torch.randn(shape[-1], dtype=dtype)
    bias = torch.randn(shape[-1], dtype=dtype)
    storage = residual.data_ptr()
    out, new_residual = fused_add_layer_norm(x, residual, weight, bias, 1e-5, impl="triton")
    assert new_residual is residual and residual.data_ptr() == storage
    assert_close_ulps(residual, expected_residual, atol=NEAR_ZERO)
    # normalise what the kernel stored, so a 1-ulp residual difference does not compound
    assert_close_ulps(out, layer_norm_reference(residual, weight, bias, 1e-5), atol=NEAR_ZERO)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (4096, 4096), (333, 5120), (64, 8192)])
def test_gpu_bf16(shape):
    # the second round takes the cached launch path, on fresh data
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        weight = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda")
        bias = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda")
        assert_close_ulps(layer_norm(x, weight, bias, 1e-5), layer_norm_reference(x, weight, bias, 1e-5), atol=NEAR_ZERO)
        expected_residual = residual + x
        out, _ = fused_add_layer_norm(x, residual, weight, bias, 1e-5)
        assert torch.equal(residual, expected_residual)
        assert_close_ulps(out, layer_norm_reference(expected_residual, weight, bias, 1e-5), atol=NEAR_ZERO)
