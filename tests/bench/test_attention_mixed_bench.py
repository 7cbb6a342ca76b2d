"""bench/attention_mixed.py: the mixed step it times is laid out as the scheduler lays one out
(timing needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("attention_mixed")


def test_decodes_lead_and_prompts_fill_the_rest_of_the_budget(bench):
    query_lens, seq_lens = bench.mixed_lengths(5, 1024, 1200, 512)
    assert query_lens == [1] * 5 + [512, 512, 171]
    assert seq_lens == [512, 640, 768, 896, 1024, 512, 512, 171]
    assert sum(query_lens) == 1200
    with pytest.raises(ValueError, match="no prompt tokens"):
        bench.mixed_lengths(64, 1024, 64, 512)


def test_the_batch_attends_as_the_reference_with_its_decodes_on_the_decode_kernel(bench):
    from cleave.kernels.attention import paged_attention, paged_attention_reference
    from cleave.kernels.attention_prefill import PrefillLaunch

    query_lens, seq_lens = bench.mixed_lengths(3, 40, 40, 20)
    cache, metadata = bench.build_batch(query_lens, seq_lens, 2, 16, torch.device("cpu"))
    cache = cache.float()
    assert metadata.num_decode_seqs == 3
    query = torch.randn(sum(query_lens), 4, 16)
    out = paged_attention(query, cache, metadata, 0.25, impl="triton",
                          prefill=PrefillLaunch(block_m=16, block_n=16, decode_rows=True))
    torch.testing.assert_close(out, paged_attention_reference(query, cache, metadata, 0.25), atol=2e-5, rtol=1e-5)
