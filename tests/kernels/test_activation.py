"""SiLU-and-mul, GeLU(tanh)-and-mul and GeLU+bias: Triton kernel vs torch reference.

The kernels compute in fp32 and round once, so in 16-bit dtypes they are compared with the
reference evaluated in fp32 and rounded once.
"""

import pytest
import torch

from cleave.kernels.activation import (
    gelu_bias,
    gelu_bias_reference,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from cleave.kernels.row_norm import DeferredRMSNorm
from tests.kernels.ulp import NEAR_ZERO, assert_close_ulps

SHAPES = [(13, 1000), (1, 64), (2, 3, 96)]
GATED = [(silu_and_mul, silu_and_mul_reference), (gelu_tanh_and_mul, gelu_tanh_and_mul_reference)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op,reference", GATED)
def test_gated_matches_reference(op, reference, shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape[:-1] + (2 * shape[-1],), dtype=dtype) * 3
    out = op(x, impl="triton")
    assert out.shape == shape and out.dtype == dtype
    assert_close_ulps(out, reference(x.float()).to(dtype), atol=NEAR_ZERO)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_bias_matches_reference(shape, dtype):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype) * 3
    bias = torch.randn(shape[-1], dtype=dtype)
    out = gelu_bias(x, bias, impl="triton")
    assert_close_ulps(out, gelu_bias_reference(x.float(), bias.float()).to(dtype), atol=NEAR_ZERO)


def test_gated_reads_strided_rows_in_fp16():
    torch.manual_seed(2)
    x = torch.randn(5, 300, dtype=torch.float16)[:, :200]  # [5, 2*100], rows 300 apart
    torch.testing.assert_close(
        silu_and_mul(x, impl="triton"), silu_and_mul_reference(x.float()).half(), rtol=1e-3, atol=1e-3
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op,reference", GATED)
def test_gated_applies_a_deferred_norm_of_the_residual_rows(op, reference, dtype):
    # a 2100-wide residual: the inverse RMS is read in 1024-column steps, the last one masked
    torch.manual_seed(4)
    x = torch.randn(3, 2 * 96, dtype=dtype) * 3
    residual = torch.randn(3, 2100, dtype=dtype) * torch.tensor([[0.5], [4.0], [30.0]]).to(dtype)
    row_norm = DeferredRMSNorm(residual, 1e-6)
    out = op(x, impl="triton", row_norm=row_norm)
    expected = reference(x, row_norm)
    assert expected.dtype == dtype
    assert_close_ulps(out, expected, atol=NEAR_ZERO)
    # the norm matters: each row is scaled by about 1 / its residual's scale before the activation
    assert not torch.allclose(out.float(), reference(x).float(), atol=1e-2)
    with pytest.raises(ValueError, match="row_norm.source has 2 rows"):
        op(x, impl="triton", row_norm=DeferredRMSNorm(residual[:2], 1e-6))
    with pytest.raises(ValueError, match="DeferredRMSNorm.source"):
        DeferredRMSNorm(residual.t(), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 14336), (4096, 4096), (333, 11008)])
def test_gpu_bf16(shape):
    # the second round takes the cached launch path, on fresh data
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(shape[0], 2 * shape[1], dtype=torch.bfloat16, device="cuda") * 3
        for op, reference in GATED:
            assert_close_ulps(op(x), reference(x.float()).bfloat16(), atol=NEAR_ZERO)
        row_norm = DeferredRMSNorm(torch.randn(shape[0], 2048, dtype=torch.bfloat16, device="cuda"), 1e-5)
        for op, reference in GATED:
            assert_close_ulps(op(x, row_norm=row_norm), reference(x, row_norm), atol=NEAR_ZERO)
        y = x[:, : shape[1]].contiguous()
        bias = torch.randn(shape[1], dtype=torch.bfloat16, device="cuda")
        assert_close_ulps(gelu_bias(y, bias), gelu_bias_reference(y.float(), bias.float()).bfloat16(), atol=NEAR_ZERO)


def test_many_wide_rows_take_the_wide_launch_and_mask_the_ragged_block():
    # >= 1024 rows of > 4096 outputs: 4096-column blocks, the second one mostly masked
    from cleave.kernels.dispatch import tile_launch

    launch = tile_launch(1024, 4100)
    assert (launch.block, launch.num_warps, launch.grid) == (4096, 16, (1024, 2))
    torch.manual_seed(3)
    x = torch.randn(1024, 2 * 4100) * 3
    assert_close_ulps(silu_and_mul(x, impl="triton"), silu_and_mul_reference(x), atol=NEAR_ZERO)
