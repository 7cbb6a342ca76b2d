"""MXFP4 (OCP microscaling FP4), as gpt-oss stores its expert weights: dequantisation, and
the weights kept packed for the expert kernels.

A checkpoint tensor X is stored as two: `X_blocks` [..., G, 16] uint8 holds 32 FP4 (E2M1)
values per block, two per byte, the element at even index in the low nibble; `X_scales`
[..., G] uint8 holds each block's shared E8M0 scale, 2^(s - 127). The dequantised tensor is
[..., G * 32]: value = fp4(nibble) * 2^(s - 127). E2M1 nibbles: bit 3 is the sign, bits 0-2
index 0, 0.5, 1, 1.5, 2, 3, 4, 6.

`MXFP4Weight` keeps an expert stack [E, N, K] packed (4.25 bits a value against bf16's 16);
the expert kernels (`cleave.kernels.moe_gemv`, `cleave.kernels.fused_moe`) read its bytes
and decode them in registers (`decode_e2m1`, `e8m0_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
VALUES_PER_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., G, 16] uint8
    scales: torch.Tensor,  # [..., G] uint8
    dtype: torch.dtype = torch.bfloat16,
    rows_per_chunk: int = 1 << 20,
) -> torch.Tensor:  # [..., G * 32]
    """Dequantise MXFP4 blocks in `dtype`, a bounded number of blocks at a time (the fp32
    scratch of a 128-expert layer would otherwise be several GiB)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != VALUES_PER_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            f"expected blocks [..., G, {VALUES_PER_BLOCK // 2}] and scales [..., G]"
        )
    if (scales == E8M0_NAN).any():
        raise ValueError("MXFP4 scales hold the E8M0 NaN encoding (255)")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    flat_blocks = blocks.reshape(-1, VALUES_PER_BLOCK // 2)  # [N, 16]
    flat_scales = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS  # [N, 1]
    out = torch.empty(flat_blocks.shape[0], VALUES_PER_BLOCK, dtype=dtype, device=blocks.device)
    for start in range(0, flat_blocks.shape[0], rows_per_chunk):
        chunk = flat_blocks[start : start + rows_per_chunk]
        values = torch.empty(chunk.shape[0], VALUES_PER_BLOCK, dtype=torch.float32, device=blocks.device)
        values[:, 0::2] = lut[(chunk & 0x0F).long()]
        values[:, 1::2] = lut[(chunk >> 4).long()]
        # exact: a power of two times a 3-bit-mantissa value
        out[start : start + rows_per_chunk] = torch.ldexp(values, flat_scales[start : start + rows_per_chunk]).to(dtype)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * VALUES_PER_BLOCK)


@dataclass(frozen=True)
class MXFP4Weight:
    """An [E, N, K] expert weight in MXFP4: `blocks` [E, N, K // 2] uint8 (the checkpoint's
    [E, N, K // 32, 16] blocks, flattened per row) and `scales` [E, N, K // 32] uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise ValueError(f"MXFP4 blocks and scales must be uint8, got {self.blocks.dtype} and {self.scales.dtype}")
        if self.blocks.dim() != 3 or self.scales.shape != (*self.blocks.shape[:2], self.blocks.shape[2] // 16) \
                or self.blocks.shape[2] % 16:
            raise ValueError(f"MXFP4 blocks {tuple(self.blocks.shape)} and scales {tuple(self.scales.shape)} do not "
                             "match: expected blocks [E, N, K // 2] and scales [E, N, K // 32]")
        if self.blocks.stride(-1) != 1 or self.scales.stride(-1) != 1:
            raise ValueError("MXFP4 blocks and scales must be contiguous in their last dimension")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dequantised weight's shape [E, N, K]."""
        experts, rows, packed = self.blocks.shape
        return experts, rows, 2 * packed

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [E, N, K]
        experts, rows, groups = self.scales.shape
        return dequantize_mxfp4(self.blocks.reshape(experts, rows, groups, VALUES_PER_BLOCK // 2), self.scales, dtype)


def dense_weight(weight: torch.Tensor | MXFP4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a tensor of `dtype` (MXFP4 dequantised), for the torch reference paths."""
    return weight.dequantize(dtype) if isinstance(weight, MXFP4Weight) else weight


def weight_launch_args(weight: torch.Tensor | MXFP4Weight) -> tuple:
    """(weights, scales, stride_we, stride_wn, stride_se, stride_sn) of an expert kernel's
    launch: the packed blocks and scales of an MXFP4 weight, or the tensor itself (passed
    again, unused, as the scales)."""
    if isinstance(weight, MXFP4Weight):
        blocks, scales = weight.blocks, weight.scales
        return blocks, scales, blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1)
    return weight, weight, weight.stride(0), weight.stride(1), 0, 0


@triton.jit
def decode_e2m1(codes):
    """fp32 values of E2M1 codes (int32, 0..15): sign, two exponent bits (bias 1), one
    mantissa bit; exponent 0 holds 0 and 0.5."""
    magnitude = codes & 7
    exponent = magnitude >> 1
    normal = (((exponent + 126) << 23) | ((magnitude & 1) << 22)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, tl.where(magnitude == 1, 0.5, 0.0), normal)
    return tl.where((codes & 8) != 0, -value, value)


@triton.jit
def e8m0_scale(codes):
    """fp32 2^(code - 127) of E8M0 scale codes (int32, 0..254)."""
    return tl.where(codes == 0, 5.877471754111438e-39, (codes << 23).to(tl.float32, bitcast=True))
