"""Comparing a kernel's output with its torch reference in units in the last place."""

from __future__ import annotations

import torch

# Absolute floor for outputs near zero (LayerNorm, activations, rotary), where cancellation
# makes a last-bit difference many ulps wide.
NEAR_ZERO = 1e-5


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1, atol: float = 0.0) -> None:
    """Each bf16 element within `ulps` units in the last place, or within `atol` of the
    reference (a floor for values near zero, where cancellation spreads ulps); fp32 is held
    to a tight relative bound instead."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    far = ((ordered(actual) - ordered(expected)).abs() > ulps) & ((actual.float() - expected.float()).abs() > atol)
    assert not far.any(), f"{int(far.sum())} elements off, e.g. {actual[far][:4]} vs {expected[far][:4]}"
