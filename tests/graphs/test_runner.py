"""CUDA-graph runner: eager fallbacks on CPU; on the GPU, replay equals eager for every bucket."""

from __future__ import annotations

import random

import pytest
import torch

from cleave.graphs.runner import CUDAGraphRunner, GraphRunnerConfig
from cleave.kv.metadata import AttentionMetadata
from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM, allocate_kv_cache

BLOCK_SIZE = 16


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )


class RecordingStep:
    """A step function that records its calls and returns distinguishable logits."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, AttentionMetadata]] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        self.calls.append((input_ids, metadata))
        return (input_ids + positions).float()[:, None]  # [B, 1]


def random_decode_batch(
    batch_size: int, max_seq_len: int, num_blocks: int, rng: random.Random, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Mixed-length decode batch on distinct, shuffled blocks (block 0 never used)."""
    free_blocks = list(range(1, num_blocks))
    rng.shuffle(free_blocks)
    seq_lens = [rng.randint(1, max_seq_len) for _ in range(batch_size)]
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // BLOCK_SIZE)
        tables.append([free_blocks.pop() for _ in range(count)])
    metadata = AttentionMetadata.build([1] * batch_size, seq_lens, tables, BLOCK_SIZE, device=device)
    input_ids = torch.tensor([rng.randrange(512) for _ in range(batch_size)], device=device)
    positions = torch.tensor([seq_len - 1 for seq_len in seq_lens], device=device)
    return input_ids, positions, metadata


def test_cpu_runner_runs_eagerly_with_the_callers_tensors():
    step = RecordingStep()
    runner = CUDAGraphRunner(step, GraphRunnerConfig(max_batch_size=8, max_blocks_per_seq=4, block_size=4), "cpu")
    runner.capture()
    input_ids, positions, metadata = random_decode_batch(3, 16, 20, random.Random(0), "cpu")

    logits = runner.run(input_ids, positions, metadata)

    assert not runner.uses_graphs and not runner.is_captured
    assert len(step.calls) == 1 and step.calls[0][0] is input_ids and step.calls[0][1] is metadata
    assert logits[:, 0].tolist() == (input_ids + positions).float().tolist()


def test_disabled_runner_never_captures():
    runner = CUDAGraphRunner(
        RecordingStep(), GraphRunnerConfig(max_batch_size=8, max_blocks_per_seq=4, block_size=4, enabled=False), "cuda"
    )
    assert not runner.uses_graphs
    runner.capture()
    assert not runner.is_captured


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("decode_gemv_max_tokens", "fold_norms"),
    [
        (16, False),
        (64, False),  # buckets 24 and 32 on the split-K kernel
        (16, True),  # buckets 24 and 32 on GEMMs with the norms applied in attention and SwiGLU
    ],
)
def test_gpu_replay_matches_eager_for_every_bucket(decode_gemv_max_tokens, fold_norms):
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = tiny_config()
    model = CausalLM(config).to(device).eval()
    model.decode_gemv_max_tokens = decode_gemv_max_tokens
    if fold_norms:
        with torch.no_grad():
            for layer in model.layers:  # norm weights that matter, then folded into the projections
                layer.input_layernorm.weight.normal_(1.0, 0.2)
                layer.post_attention_layernorm.weight.normal_(1.0, 0.2)
        model.fold_norm_weights()
    num_blocks, max_blocks_per_seq = 4096, 64
    kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, device=device)
    kv_cache.normal_()
    kv_cache[:, :, 0].zero_()  # the null block

    def step(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, kv_cache, metadata))

    runner = CUDAGraphRunner(step, GraphRunnerConfig(32, max_blocks_per_seq, BLOCK_SIZE), device)
    with torch.inference_mode():
        runner.capture()
        assert runner.is_captured and runner.buckets == [1, 2, 4, 8, 16, 24, 32]
        rng = random.Random(0)
        lower_bounds = [0] + runner.buckets[:-1]
        # One batch inside every bucket, then smaller ones: stale rows must be reset to padding.
        batch_sizes = [rng.randint(low + 1, high) for low, high in zip(lower_bounds, runner.buckets)] + [1, 20]
        for batch_size in batch_sizes:
            batch = random_decode_batch(batch_size, max_blocks_per_seq * BLOCK_SIZE, num_blocks, rng, device)
            original = kv_cache.clone()

            graph_logits = runner.run(*batch).clone()
            graph_cache = kv_cache.clone()
            kv_cache.copy_(original)
            eager_logits = step(*batch)
            eager_cache = kv_cache.clone()

            assert runner.bucket_for(batch_size, batch[2]) is not None
            assert graph_logits.shape == (batch_size, config.vocab_size)
            assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))
            torch.testing.assert_close(graph_logits, eager_logits, atol=1e-4, rtol=1e-4)
            # Padding rows wrote nothing: the graph changed only the real tokens' slots.
            written = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool, device=device)
            written[batch[2].slot_mapping] = True
            flat = (num_blocks * BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
            graph_flat = graph_cache.view(config.num_hidden_layers, 2, *flat)
            original_flat = original.view(config.num_hidden_layers, 2, *flat)
            assert torch.equal(graph_flat[:, :, ~written], original_flat[:, :, ~written])
            torch.testing.assert_close(graph_cache, eager_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_batches_beyond_the_largest_bucket_and_prefills_run_eagerly():
    device = torch.device("cuda")
    calls = RecordingStep()
    runner = CUDAGraphRunner(calls, GraphRunnerConfig(4, 8, BLOCK_SIZE), device)
    runner.capture()
    captured_calls = len(calls.calls)
    large = random_decode_batch(5, 64, 64, random.Random(1), device)
    assert runner.bucket_for(5, large[2]) is None
    runner.run(*large)
    prefill = AttentionMetadata.build([3], [3], [[1]], BLOCK_SIZE, device=device)
    assert runner.bucket_for(3, prefill) is None
    runner.run(torch.ones(3, dtype=torch.int64, device=device), torch.arange(3, device=device), prefill)
    assert len(calls.calls) == captured_calls + 2
    assert calls.calls[-1][1] is prefill
