"""Prefill graph runner: token buckets, the static buffers' padding, which steps it takes;
on the GPU, a replay equals the eager forward for a prompt in every bucket (hidden states
and KV cache), with and without a cached prefix."""

from __future__ import annotations

import random

import pytest
import torch

from cleave.graphs.prefill import PrefillGraphConfig, PrefillGraphRunner, StaticPrefillBuffers, prefill_token_buckets
from cleave.kv.metadata import PAD_SLOT_ID, AttentionMetadata
from cleave.model.llama import CausalLM, allocate_kv_cache
from tests.graphs.test_runner import BLOCK_SIZE, tiny_config


def test_steps_it_cannot_pad_run_eagerly(tmp_path):
    config = PrefillGraphConfig(max_tokens=48, max_blocks_per_seq=8, block_size=16)
    runner = PrefillGraphRunner(lambda ids, positions, metadata: ids, config, "cpu")

    def bucket(query_lens: list[int], seq_lens: list[int], width: int = 4):  # type: ignore[no-untyped-def]
        metadata = AttentionMetadata.build(query_lens, seq_lens, [list(range(1, width + 1))] * len(seq_lens), 16,
                                           max_blocks_per_seq=width)
        return runner.bucket_for(torch.zeros(sum(query_lens), dtype=torch.long), metadata)

    assert bucket([20], [20]) == 32 and bucket([48], [60]) == 48 and bucket([2], [40]) == 32
    assert bucket([49], [49]) is None  # more new tokens than the largest bucket
    assert bucket([10, 10], [10, 10]) is None  # two sequences
    assert bucket([1], [30]) is None  # a decode step (the decode graphs' business)
    assert bucket([20], [20], width=9) is None  # a table wider than the graphs were captured for


def test_buffers_return_rows_and_columns_a_shorter_prompt_leaves_to_padding():
    buffers = StaticPrefillBuffers(PrefillGraphConfig(max_tokens=8, max_blocks_per_seq=4, block_size=4), "cpu")
    long = AttentionMetadata.build([6], [6], [[3, 4]], 4)
    buffers.fill(torch.arange(1, 7), torch.arange(6), long)
    short = AttentionMetadata.build([2], [2], [[5]], 4)
    buffers.fill(torch.tensor([7, 8]), torch.tensor([0, 1]), short)
    assert buffers.input_ids.tolist() == [7, 8, 0, 0, 0, 0, 0, 0]
    assert buffers.positions.tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    assert buffers.slot_mapping.tolist() == [20, 21] + [PAD_SLOT_ID] * 6
    assert buffers.block_tables.tolist() == [[5, 0, 0, 0]]
    assert buffers.query_start_loc.tolist() == [0, 2] and buffers.seq_lens.tolist() == [2]
    metadata = buffers.metadata(4)
    assert metadata.max_query_len == 4 and metadata.max_seq_len == 16 and metadata.slot_mapping.shape == (4,)


def test_token_buckets_grow_by_half_and_end_at_the_limit():
    assert prefill_token_buckets(1024) == [32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert prefill_token_buckets(100) == [32, 48, 64, 96, 100]
    assert prefill_token_buckets(32) == [32] and prefill_token_buckets(10) == [10]
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_token_buckets(0)


@pytest.mark.gpu
def test_gpu_replay_matches_eager_in_every_bucket():
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = tiny_config()
    model = CausalLM(config).to(device).eval()
    num_blocks, max_blocks_per_seq = 1024, 64
    kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, device=device)
    kv_cache.normal_()
    kv_cache[:, :, 0].zero_()  # the null block

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, positions, kv_cache, metadata)

    runner = PrefillGraphRunner(forward, PrefillGraphConfig(256, max_blocks_per_seq, BLOCK_SIZE), device)
    rng = random.Random(0)
    with torch.inference_mode():
        runner.capture()
        assert runner.is_captured and runner.buckets == [32, 48, 64, 96, 128, 192, 256]
        lower_bounds = [1] + runner.buckets[:-1]
        # one prompt inside every bucket, then a short one after the longest (stale rows go back to
        # padding); every other one after a cached prefix of whole blocks
        lengths = [rng.randint(low + 1, high) for low, high in zip(lower_bounds, runner.buckets)] + [256, 3]
        for index, num_new in enumerate(lengths):
            context = 16 * rng.randint(1, 8) if index % 2 else 0
            seq_len = context + num_new
            blocks = rng.sample(range(1, num_blocks), -(-seq_len // BLOCK_SIZE))
            metadata = AttentionMetadata.build([num_new], [seq_len], [blocks], BLOCK_SIZE, device=device)
            input_ids = torch.randint(0, config.vocab_size, (num_new,), device=device)
            positions = torch.arange(context, seq_len, device=device)
            bucket = runner.bucket_for(input_ids, metadata)
            assert bucket is not None and bucket >= num_new
            original = kv_cache.clone()
            graph_hidden = runner.run(input_ids, positions, metadata, bucket).clone()
            graph_cache = kv_cache.clone()
            kv_cache.copy_(original)
            eager_hidden = forward(input_ids, positions, metadata)
            assert graph_hidden.shape == eager_hidden.shape == (num_new, config.hidden_size)
            torch.testing.assert_close(graph_hidden, eager_hidden, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(graph_cache, kv_cache, atol=1e-3, rtol=1e-3)
            # padding wrote nothing: the graph changed only the prompt's new slots
            written = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool, device=device)
            written[metadata.slot_mapping] = True
            flat = (config.num_hidden_layers, 2, num_blocks * BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
            assert torch.equal(graph_cache.view(flat)[:, :, ~written], original.view(flat)[:, :, ~written])


def test_buffers_take_a_paired_caches_window_table():
    config = PrefillGraphConfig(max_tokens=8, max_blocks_per_seq=4, block_size=4, window_tables=True)
    buffers = StaticPrefillBuffers(config, "cpu")
    metadata = AttentionMetadata.build([6], [6], [[3, 5]], 4, window_tables=[[7, 2]])
    buffers.fill(torch.arange(6), torch.arange(6), metadata)
    view = buffers.metadata(8)
    assert view.window.block_tables.tolist() == [[7, 2, 0, 0]]
    assert view.window.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, -1, -1]
    assert view.block_tables.tolist() == [[3, 5, 0, 0]]
    buffers.fill(torch.arange(2), torch.arange(2), AttentionMetadata.build([2], [2], [[4]], 4, window_tables=[[6]]))
    window_slots, window_tables = buffers.window
    assert window_slots.tolist() == [24, 25] + [-1] * 6
    assert window_tables.tolist() == [[6, 0, 0, 0]]
