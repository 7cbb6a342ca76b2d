"""MXFP4 (OCP microscaling FP4) dequantisation, as gpt-oss stores its expert weights.

A checkpoint tensor X is stored as two: `X_blocks` [..., G, 16] uint8 holds 32 FP4 (E2M1)
values per block, two per byte, the element at even index in the low nibble; `X_scales`
[..., G] uint8 holds each block's shared E8M0 scale, 2^(s - 127). The dequantised tensor is
[..., G * 32]: value = fp4(nibble) * 2^(s - 127). E2M1 nibbles: bit 3 is the sign, bits 0-2
index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

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
