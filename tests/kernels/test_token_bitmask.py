"""Triton token bitmask (grammar-constrained decoding) against the torch reference and a
bit-by-bit oracle in Python ints."""

import pytest
import torch

from cleave.kernels.token_bitmask import (
    allowed_ids_to_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    bitmask_words,
)


def _random_bitmask(rows: int, words: int, generator: torch.Generator) -> torch.Tensor:
    # every int32 value, so about half the words have bit 31 (the sign bit) set
    return torch.randint(-(2**31), 2**31, (rows, words), generator=generator, dtype=torch.int64).to(torch.int32)


def _oracle(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    # token v of logits row rows[r] allowed iff (bitmask[r, v >> 5] >> (v & 31)) & 1, in Python ints
    out = logits.clone()
    for mask_row, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if not (int(bitmask[mask_row, token >> 5]) >> (token & 31)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab_size", [37, 100])
def test_random_bitmasks_match_the_reference_and_the_bits(dtype, vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(3, vocab_size, generator=generator).to(dtype)
    bitmask = _random_bitmask(3, bitmask_words(vocab_size), generator)
    assert (bitmask < 0).any()
    original = logits.clone()

    out = apply_token_bitmask(logits, bitmask, impl="triton")

    assert out.dtype == dtype and out.shape == logits.shape
    assert torch.equal(out, apply_token_bitmask_reference(logits, bitmask))
    assert torch.equal(out, _oracle(logits, bitmask, [0, 1, 2]))
    assert torch.isneginf(out).any() and torch.isfinite(out).any()
    assert torch.equal(logits, original)  # not modified


@pytest.mark.parametrize("rows_dtype", [torch.int64, torch.int32])
def test_rows_subset_masks_only_the_listed_rows(rows_dtype):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 70, generator=generator)
    bitmask = _random_bitmask(2, bitmask_words(70), generator)
    rows = torch.tensor([3, 1], dtype=rows_dtype)
    original = logits.clone()

    out = apply_token_bitmask(logits, bitmask, rows, impl="triton")

    assert torch.equal(out, apply_token_bitmask_reference(logits, bitmask, rows))
    assert torch.equal(out, _oracle(logits, bitmask, [3, 1]))
    assert torch.equal(out[0], original[0]) and torch.equal(out[2], original[2])  # untouched
    assert torch.equal(logits, original)
    assert out.data_ptr() != logits.data_ptr()


def test_all_zero_and_all_one_rows_strided_logits_and_extra_words():
    generator = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 50, generator=generator)
    logits = wide[:, :45]  # row stride 50
    words = bitmask_words(45) + 2  # more words than the vocabulary needs: their bits are ignored
    bitmask = _random_bitmask(3, words, generator)
    bitmask[0] = 0
    bitmask[1] = -1
    original = wide.clone()

    out = apply_token_bitmask(logits, bitmask, impl="triton")

    assert out.shape == (3, 45)
    assert torch.isneginf(out[0]).all()
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out, apply_token_bitmask_reference(logits, bitmask))
    assert torch.equal(wide, original)


def test_vocabulary_over_several_blocks(monkeypatch):
    monkeypatch.setattr("cleave.kernels.token_bitmask.MAX_BLOCK_V", 64)
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 200, generator=generator, dtype=torch.bfloat16)
    bitmask = _random_bitmask(1, bitmask_words(200), generator)
    rows = torch.tensor([1])

    out = apply_token_bitmask(logits, bitmask, rows, impl="triton")

    assert torch.equal(out, _oracle(logits, bitmask, [1]))


def test_bitmask_from_ids_sets_the_expected_words_and_round_trips():
    vocab_size = 70
    ids = [[31], [0, 1, 63, 64, 69], list(range(32)), [], [5, 5, 33]]

    bitmask = allowed_ids_to_bitmask(ids, vocab_size)

    assert bitmask.dtype == torch.int32 and bitmask.shape == (5, 3) and bitmask.device.type == "cpu"
    assert bitmask[0].tolist() == [-(2**31), 0, 0]  # bit 31 alone: the int32 sign bit
    assert bitmask[1].tolist() == [0b11, -(2**31), 0b100001]
    assert bitmask[2].tolist() == [-1, 0, 0]
    assert bitmask[4].tolist() == [1 << 5, 1 << 1, 0]
    for impl in ("torch", "triton"):
        out = apply_token_bitmask(torch.zeros(5, vocab_size), bitmask, impl=impl)
        assert [torch.isfinite(row).nonzero().flatten().tolist() for row in out] == [sorted(set(row)) for row in ids]
    with pytest.raises(ValueError):
        allowed_ids_to_bitmask([[70]], vocab_size)


def test_torch_path_empty_bitmask_and_bad_shapes():
    logits = torch.randn(2, 40)
    bitmask = allowed_ids_to_bitmask([[0, 39], [7]], 40)
    # "auto" runs the reference on CPU tensors
    assert torch.equal(apply_token_bitmask(logits, bitmask), apply_token_bitmask_reference(logits, bitmask))
    empty = apply_token_bitmask(logits, bitmask[:0], torch.zeros(0, dtype=torch.int64), impl="triton")
    assert torch.equal(empty, logits) and empty.data_ptr() != logits.data_ptr()
    with pytest.raises(ValueError, match="words"):
        apply_token_bitmask(logits, bitmask[:, :1], impl="triton")  # 40 tokens need 2 words
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, bitmask.to(torch.int64), impl="triton")
    with pytest.raises(ValueError, match="one row per logits row"):
        apply_token_bitmask(logits, bitmask[:1], impl="triton")
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(logits, bitmask, torch.tensor([0]), impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen_vocab_matches_the_reference(dtype):
    vocab_size = 151936
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, vocab_size, device="cuda", generator=generator).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (64, bitmask_words(vocab_size)), device="cuda", generator=generator,
                            dtype=torch.int64).to(torch.int32)
    original = logits.clone()
    rows = torch.randperm(64, device="cuda", generator=generator)[:24]

    assert torch.equal(apply_token_bitmask(logits, bitmask), apply_token_bitmask_reference(logits, bitmask))
    assert torch.equal(apply_token_bitmask(logits, bitmask[:24], rows),
                       apply_token_bitmask_reference(logits, bitmask[:24], rows))
    assert torch.equal(logits, original)
