"""Triton embedding lookup against F.embedding."""

import pytest
import torch
import torch.nn.functional as F

from cleave.kernels.embedding import embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_the_reference_and_strided_ids(dtype):
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(50, 24, generator=generator).to(dtype)
    ids = torch.tensor([[3, 0], [49, 0], [3, 0], [17, 0]])[:, 0]  # strided, with a repeat

    out = embedding(ids, table, impl="triton")

    assert torch.equal(out, F.embedding(ids, table))


def test_rows_wider_than_one_block_and_ids_outside_the_table_give_zeros(monkeypatch):
    monkeypatch.setattr("cleave.kernels.embedding.MAX_BLOCK", 16)
    table = torch.randn(10, 40)
    ids = torch.tensor([9, -1, 10, 2], dtype=torch.int32)

    out = embedding(ids, table, impl="triton")

    assert torch.equal(out[0], table[9]) and torch.equal(out[3], table[2])
    assert torch.count_nonzero(out[1:3]) == 0


def test_torch_path_and_empty_batch():
    table = torch.randn(10, 8)
    ids = torch.tensor([1, 4])
    assert torch.equal(embedding(ids, table, impl="torch"), table[ids])
    assert embedding(ids[:0], table, impl="triton").shape == (0, 8)


@pytest.mark.gpu
def test_gpu_llama_vocab():
    table = torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 128256, (64,), device="cuda")
    assert torch.equal(embedding(ids, table), F.embedding(ids, table))
