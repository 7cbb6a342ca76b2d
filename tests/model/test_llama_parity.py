"""cleave's CausalLM against transformers on the same random checkpoints (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from cleave.kv.metadata import AttentionMetadata
from cleave.model.fused_decode import deferred_norm_layout_applies, gemv_layout_applies
from cleave.model.llama import CausalLM, allocate_kv_cache
from cleave.model.loader import load_model
from cleave.model.tokenizer import Tokenizer

from cleave.testing.tiny_models import ARCHITECTURES

CHECKPOINT_NAMES = (*ARCHITECTURES, "llama-tied")  # written by conftest.tiny_checkpoints

BLOCK_SIZE = 16
NUM_BLOCKS = 24
# Deliberately out of order and non-contiguous, so block-table lookups are exercised.
BLOCK_TABLE = [17, 3, 22, 8, 0, 13, 5, 19]
TOLERANCE = 1e-4


def run_chunks(model: CausalLM, input_ids: torch.Tensor, chunk_lens: list[int]) -> torch.Tensor:
    """Logits [T, V] of one sequence fed as consecutive prefill chunks through a paged cache."""
    kv_cache = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE)
    logits, start = [], 0
    for chunk_len in chunk_lens:
        end = start + chunk_len
        blocks = BLOCK_TABLE[: (end + BLOCK_SIZE - 1) // BLOCK_SIZE]
        metadata = AttentionMetadata.build([chunk_len], [end], [blocks], BLOCK_SIZE)
        hidden = model(input_ids[start:end], torch.arange(start, end), kv_cache, metadata)
        logits.append(model.compute_logits(hidden))
        start = end
    return torch.cat(logits)


def greedy_generate(model: CausalLM, prompt: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> list[int]:
    """Prefill the prompt, then decode one token per step through the paged cache."""
    kv_cache = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE)
    tokens, generated = list(prompt), []
    query_len = len(prompt)
    while len(generated) < max_new_tokens:
        seq_len = len(tokens)
        blocks = BLOCK_TABLE[: (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE]
        metadata = AttentionMetadata.build([query_len], [seq_len], [blocks], BLOCK_SIZE)
        input_ids = torch.tensor(tokens[seq_len - query_len :])
        hidden = model(input_ids, torch.arange(seq_len - query_len, seq_len), kv_cache, metadata)
        next_token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        tokens.append(next_token)
        generated.append(next_token)
        query_len = 1
        if next_token in eos_ids:
            break
    return generated


def prompt_ids(vocab_size: int, length: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(1234))


@pytest.mark.parametrize("name", CHECKPOINT_NAMES)
@torch.no_grad()
def test_prefill_and_chunked_prefill_match_transformers(name, tiny_checkpoints, hf_models):
    model = load_model(tiny_checkpoints[name])
    input_ids = prompt_ids(model.config.vocab_size)
    expected = hf_models[name](input_ids[None]).logits[0].float()  # [64, V]

    one_shot = run_chunks(model, input_ids, [64])
    chunked = run_chunks(model, input_ids, [40, 24])

    assert one_shot.dtype == torch.float32 and one_shot.shape == expected.shape
    assert (one_shot - expected).abs().max().item() <= TOLERANCE
    assert (chunked - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", CHECKPOINT_NAMES)
@torch.no_grad()
def test_greedy_continuation_matches_generate(name, tiny_checkpoints, hf_models):
    path = tiny_checkpoints[name]
    model = load_model(path)
    tokenizer = Tokenizer.from_pretrained(path)
    prompt = prompt_ids(model.config.vocab_size).tolist()  # 64 tokens: 96 with the answer, 6 blocks

    ours = greedy_generate(model, prompt, 32, tokenizer.eos_token_ids)
    hf_out = hf_models[name].generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=32, do_sample=False,
    )
    assert ours == hf_out[0, len(prompt) :].tolist()


@torch.no_grad()
def test_mixed_batch_matches_separate_sequences(tiny_checkpoints):
    """A prefill chunk of one sequence and a decode token of another share one forward."""
    model = load_model(tiny_checkpoints["qwen3"])
    seq_a, seq_b = prompt_ids(model.config.vocab_size, 40), prompt_ids(model.config.vocab_size, 21) % 100
    expected_a = run_chunks(model, seq_a, [40])
    expected_b = run_chunks(model, seq_b, [21])

    kv_cache = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE)
    table_a, table_b = [4, 11, 2], [9, 20]
    # Step 1: seq_b prefills its first 20 tokens alone.
    metadata = AttentionMetadata.build([20], [20], [table_b], BLOCK_SIZE)
    model(seq_b[:20], torch.arange(20), kv_cache, metadata)
    # Step 2: seq_a's whole prompt and seq_b's 21st token in one flattened batch.
    metadata = AttentionMetadata.build([40, 1], [40, 21], [table_a, table_b], BLOCK_SIZE)
    input_ids = torch.cat([seq_a, seq_b[20:]])
    positions = torch.cat([torch.arange(40), torch.tensor([20])])
    logits = model.compute_logits(model(input_ids, positions, kv_cache, metadata))

    assert (logits[:40] - expected_a).abs().max().item() <= TOLERANCE
    assert (logits[40] - expected_b[20]).abs().max().item() <= TOLERANCE


@torch.no_grad()
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_sliding_window_matches_transformers(tiny_checkpoints, hf_models, impl):
    """Mistral with a 6-token window: a prefill chunk that starts inside the window of a cached
    prefix, then single decode steps, on the references and on the Triton kernels."""
    model = load_model(tiny_checkpoints["mistral-window"], impl=impl)
    assert model.config.sliding_window == 6
    input_ids = prompt_ids(model.config.vocab_size, 22)
    expected = hf_models["mistral-window"](input_ids[None]).logits[0].float()
    import transformers

    unwindowed = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints["mistral-window"], dtype=torch.float32, sliding_window=None
    ).eval()
    full_context = unwindowed(input_ids[None]).logits[0].float()
    assert (expected[:6] - full_context[:6]).abs().max() <= TOLERANCE
    assert (expected[6:] - full_context[6:]).abs().max() > 100 * TOLERANCE  # the window matters here
    assert (run_chunks(model, input_ids, [12, 7, 1, 1, 1]) - expected).abs().max().item() <= TOLERANCE


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_fused_decode_path_matches_transformers(tiny_checkpoints, hf_models, arch):
    """A 20-token prefill (unfused) then 1-2 token steps on the fused decode-batch kernels
    (norms inside the projections, residual adds and Qwen2's qkv bias in their epilogues), in
    the interpreter."""
    model = load_model(tiny_checkpoints[arch], impl="triton")
    assert gemv_layout_applies(model, torch.zeros(1, model.config.hidden_size))
    assert not gemv_layout_applies(model, torch.zeros(20, model.config.hidden_size))
    input_ids = prompt_ids(model.config.vocab_size, 25)
    expected = hf_models[arch](input_ids[None]).logits[0].float()
    assert (run_chunks(model, input_ids, [20, 1, 1, 1, 2]) - expected).abs().max().item() <= TOLERANCE
    # up to 64 tokens: the 20-token chunk on the split-K projections (their counters allocated per call)
    model.decode_gemv_max_tokens = 64
    assert gemv_layout_applies(model, torch.zeros(20, model.config.hidden_size))
    assert (run_chunks(model, input_ids, [20, 1, 1, 1, 2]) - expected).abs().max().item() <= TOLERANCE
    # no decode-batch projections: single-token steps take the unfused layers, whose decode
    # attention kernel rotates q/k and writes the new K/V itself
    model.decode_gemv_max_tokens = 0
    assert not gemv_layout_applies(model, torch.zeros(1, model.config.hidden_size))
    assert (run_chunks(model, input_ids, [20, 1, 1, 1, 2]) - expected).abs().max().item() <= TOLERANCE


@torch.no_grad()
@pytest.mark.parametrize(("name", "chunks"), [("llama", [20, 1, 1, 1, 2]), ("mistral-window", [12, 7, 1, 1, 1])])
def test_folded_norms_match_transformers(tiny_checkpoints, hf_models, name, chunks):
    """Norm weights folded into qkv_proj / gate_up_proj: the unfused layers (unit-weight norm
    kernels) on the references, then single-token steps on GEMMs with the norms applied by
    the decode attention and SwiGLU kernels (the interpreter)."""
    input_ids = prompt_ids(hf_models[name].config.vocab_size, sum(chunks))
    expected = hf_models[name](input_ids[None]).logits[0].float()
    folded = load_model(tiny_checkpoints[name], impl="torch").fold_norm_weights()
    assert torch.equal(folded.layers[0].input_layernorm.weight, torch.ones(folded.config.hidden_size))
    assert (run_chunks(folded, input_ids, chunks) - expected).abs().max().item() <= TOLERANCE

    model = load_model(tiny_checkpoints[name], impl="triton")
    model.decode_gemv_max_tokens = 0  # single tokens too go through the GEMM layout
    decode = AttentionMetadata.build([1], [5], [[0]], BLOCK_SIZE)
    hidden = torch.zeros(1, model.config.hidden_size)
    assert not deferred_norm_layout_applies(model, hidden, decode)  # not folded yet
    model.fold_norm_weights().fold_norm_weights()  # idempotent
    assert deferred_norm_layout_applies(model, hidden, decode)
    assert not deferred_norm_layout_applies(model, torch.zeros(2, model.config.hidden_size),
                                        AttentionMetadata.build([2], [5], [[0]], BLOCK_SIZE))
    assert (run_chunks(model, input_ids, chunks) - expected).abs().max().item() <= TOLERANCE


@torch.no_grad()
def test_triton_kernels_match_transformers(tiny_checkpoints, hf_models):
    """The same forward with every op on its Triton kernel (the interpreter on CPU)."""
    model = load_model(tiny_checkpoints["qwen3"], impl="triton")
    input_ids = prompt_ids(model.config.vocab_size, 24)
    expected = hf_models["qwen3"](input_ids[None]).logits[0].float()
    assert (run_chunks(model, input_ids, [16, 8]) - expected).abs().max().item() <= TOLERANCE
