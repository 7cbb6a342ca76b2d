"""Counter-based random numbers for seeded sampling.

A seeded request must sample the same tokens whatever else shares its batch and wherever
its row sits. Instead of a stateful generator per request, every random number is a pure
function of (seed, sample index, step, token id): the host mixes the first three into one
64-bit key per row (`cleave.generation.seed_keys.row_key`), and the device hashes the key with every token id in one
batched pass of int64 ops (`exponential_noise`). Integer hashing gives the same bits on any
device; only the final float log may differ by an ulp between CPU and GPU.

Multiplications keep one factor below 2**31 and the other below 2**32, so every int64
product stays below 2**63 and no step relies on signed-overflow wrapping.
"""

from __future__ import annotations

import torch

from cleave.device_copy import tensor_on

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 (see module docstring) for a 32-bit xorshift-multiply mixer.
_MUL_A = 0x21F0AAAD
_MUL_B = 0x735A2D97


def _mix32(values: torch.Tensor) -> torch.Tensor:
    # values: int64 holding uint32; returns int64 holding uint32.
    values = values ^ (values >> 16)
    values = (values * _MUL_A) & _MASK32
    values = values ^ (values >> 15)
    values = (values * _MUL_B) & _MASK32
    return values ^ (values >> 15)


def keys_to_tensor(keys: list[int], device: torch.device | str) -> torch.Tensor:
    """[S] Python 64-bit keys -> [S, 2] int64 tensor of (low, high) 32-bit words."""
    words = [(key & _MASK32, (key >> 32) & _MASK32) for key in keys]
    return tensor_on(words, torch.int64, torch.device(device)).reshape(len(keys), 2)


def uniform_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform floats in (0, 1), one per (row key, token id).

    keys: [S, 2] int64 (low, high) words from `keys_to_tensor`.
    Returns: [S, vocab_size] float32 with 23 random bits each: (k + 0.5) / 2**23 needs 24
    significant bits, exactly float32's precision, so no value rounds to 0 or 1.
    """
    token_ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)  # [V]
    low = keys[:, 0:1]  # [S, 1]
    high = keys[:, 1:2]  # [S, 1]
    hashed = _mix32(token_ids[None, :] ^ low)  # [S, V]
    hashed = _mix32((hashed + high) & _MASK32)  # [S, V]
    return ((hashed >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) samples, one per (row key, token id): [S, 2] -> [S, vocab_size] float32 > 0."""
    return -torch.log(uniform_from_keys(keys, vocab_size))
