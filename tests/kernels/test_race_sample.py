"""The one-pass race kernel against the torch exponential race over the same noise keys.

The reference is the sampler's torch path written out: softmax(l / T), Exp(1) noise hashed
from each row's key (`cleave.engine.counter_rng.exponential_noise`), argmax(p / q); greedy
rows take argmax(l). CPU runs use the Triton interpreter, so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

from cleave.engine.counter_rng import exponential_noise, keys_to_tensor
from cleave.kernels.race_sample import BLOCK_V, choose_race_splits, race_sample


def reference_race(logits, temperatures, is_greedy, keys):  # noqa: ANN001, ANN201
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    noise = exponential_noise(keys, logits.shape[1]).clamp_min(1e-20)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, logits.float().argmax(dim=-1), sampled)


def batch(num_rows: int, vocab_size: int, seed: int = 0, dtype=torch.float32):  # noqa: ANN001, ANN201
    generator = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(num_rows, vocab_size, generator=generator)).to(dtype)
    temperatures = torch.linspace(0.3, 1.7, num_rows)
    is_greedy = torch.zeros(num_rows, dtype=torch.bool)
    keys = keys_to_tensor([int(k) for k in torch.randint(0, 2**62, (num_rows,), generator=generator)], "cpu")
    return logits, temperatures, is_greedy, keys


@pytest.mark.parametrize(("num_rows", "vocab_size", "num_splits"), [
    (3, 5000, None),  # three chunks' worth of blocks, the last one short
    (2, BLOCK_V, 1),  # one program a row, writing its token itself
    (1, 3 * BLOCK_V + 17, 4),  # a chunk past the vocabulary: it holds no token
])
def test_race_matches_the_torch_race_over_the_same_keys(num_rows, vocab_size, num_splits):
    logits, temperatures, is_greedy, keys = batch(num_rows, vocab_size)
    is_greedy[0] = num_rows > 1  # a greedy row among sampled ones
    counters = torch.zeros(8, dtype=torch.int32)

    tokens = race_sample(logits, temperatures, is_greedy, keys, counters, num_splits=num_splits)

    assert torch.equal(tokens, reference_race(logits, temperatures, is_greedy, keys))
    assert not counters.any()  # left zeroed for the next launch


@pytest.mark.parametrize("num_splits", [1, 2])
def test_ties_take_the_lowest_index_and_masked_tokens_never_win(num_splits):
    """Greedy rows over tied maxima in different blocks (of one chunk, or of two) take the
    first (as torch.argmax); a sampled row whose every token but one is -inf (a grammar's
    mask) takes that one."""
    vocab_size = 2 * BLOCK_V
    logits = torch.full((3, vocab_size), -float("inf"))
    logits[0, [5, BLOCK_V + 3]] = 2.0
    logits[1, [BLOCK_V + 9, BLOCK_V + 1]] = 1.0
    logits[2, 4000] = -50.0
    temperatures = torch.ones(3)
    is_greedy = torch.tensor([True, True, False])
    keys = keys_to_tensor([11, 12, 13], "cpu")

    tokens = race_sample(logits, temperatures, is_greedy, keys, num_splits=num_splits)

    assert tokens.tolist() == [5, BLOCK_V + 1, 4000]


def test_bf16_logits_race_as_their_fp32_values():
    logits, temperatures, is_greedy, keys = batch(2, 3000, seed=3, dtype=torch.bfloat16)
    tokens = race_sample(logits, temperatures, is_greedy, keys, num_splits=2)
    assert torch.equal(tokens, reference_race(logits.float(), temperatures, is_greedy, keys))


def test_split_count_fills_the_gpu_for_few_rows_and_stays_within_the_vocabulary():
    assert choose_race_splits(1, 128256) == 64
    assert choose_race_splits(256, 128256) == 2
    assert choose_race_splits(512, 128256) == 1
    assert choose_race_splits(1, 3000) == 2  # two blocks of the vocabulary


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 64, 256])
def test_gpu_race_matches_the_torch_race(num_rows):
    """Llama-3's vocabulary on the device: bf16 logits, seeded keys."""
    logits, temperatures, is_greedy, keys = batch(num_rows, 128256, seed=num_rows, dtype=torch.bfloat16)
    device = torch.device("cuda")
    logits, temperatures, is_greedy, keys = (t.to(device) for t in (logits, temperatures, is_greedy, keys))
    tokens = race_sample(logits, temperatures, is_greedy, keys)
    expected = reference_race(logits, temperatures, is_greedy, keys)
    # The device's log may differ from torch's by an ulp: a near tie may go the other way.
    assert (tokens == expected).float().mean().item() >= 0.99
