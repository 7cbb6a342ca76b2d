"""Mixture-of-experts models served by the engine: LLM greedy generation of tiny Qwen3-MoE and
gpt-oss checkpoints against transformers' generate, batched with chunked prefill."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import MOE_ARCHITECTURES, write_mxfp4_twin, write_tiny_checkpoint
from tests.engine.hf_reference import hf_greedy_continuations

NUM_PROMPTS = 4
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-moe")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=40 + i) for i, arch in enumerate(MOE_ARCHITECTURES)}


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(5, 60))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def hf_greedy(moe_checkpoints: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per architecture: the prompts and transformers' greedy continuations (eos disabled)."""
    return {arch: hf_greedy_continuations(path, _prompts, MAX_TOKENS) for arch, path in moe_checkpoints.items()}


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert all(result.finished for result in results)
    return [result.outputs[0].token_ids for result in results]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_llm_greedy_matches_transformers(arch, moe_checkpoints, hf_greedy):
    """Four prompts at once, prefilled in 48-token chunks beside other sequences' decode steps."""
    prompts, expected = hf_greedy[arch]
    llm = LLM(moe_checkpoints[arch], device="cpu", dtype="float32", max_model_len=256,
              max_num_batched_tokens=48, block_size=16)
    assert llm.engine.model.config.is_moe
    assert _generate(llm, prompts, MAX_TOKENS) == expected
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_engine_decode_steps_on_the_triton_kernels(arch, moe_checkpoints, hf_greedy):
    """Two sequences decoded together on the fused MoE and decode attention kernels (the
    interpreter), a few steps each."""
    prompts, expected = hf_greedy[arch]
    llm = LLM(moe_checkpoints[arch], device="cpu", dtype="float32", max_model_len=256, block_size=16)
    llm.engine.model.set_impl("triton")
    assert _generate(llm, prompts[:2], 4) == [tokens[:4] for tokens in expected[:2]]


def test_packed_mxfp4_experts_generate_what_the_dequantised_ones_do(tmp_path_factory):
    """gpt-oss with MXFP4 experts, kept packed (`packed_experts`) or dequantised at load: the
    same greedy tokens, on the torch path (which dequantises per call) and on the kernels
    (the interpreter: grouped GEMMs for the prompts, per-entry GEMVs for the decode steps)."""
    root = tmp_path_factory.mktemp("engine-mxfp4")
    dense = write_tiny_checkpoint(root / "dense", "gpt-oss", seed=44)
    quantized = write_mxfp4_twin(dense, root / "quantized", seed=45)
    options = dict(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=48, block_size=16)
    dense_llm, packed_llm = LLM(dense, **options), LLM(quantized, packed_experts=True, **options)
    assert packed_llm.engine.model.config.packed_experts and not dense_llm.engine.model.config.packed_experts
    prompts = _prompts(dense_llm.engine.model.config.vocab_size)
    assert _generate(packed_llm, prompts, 16) == _generate(dense_llm, prompts, 16)
    for llm in (dense_llm, packed_llm):
        llm.engine.model.set_impl("triton")
    assert _generate(packed_llm, prompts[:2], 4) == _generate(dense_llm, prompts[:2], 4)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_llm_greedy_matches_transformers_on_cuda(arch, eager, moe_checkpoints, hf_greedy):
    """The same on the GPU: decode steps replay CUDA graphs holding the fused MoE kernels,
    or run them eagerly (which of the two a failure follows says where to look)."""
    prompts, expected = hf_greedy[arch]
    # a cache of its own size: tests in one process would each claim 90% of the device
    llm = LLM(moe_checkpoints[arch], device="cuda", dtype="float32", max_model_len=256,
              max_num_batched_tokens=48, block_size=16, num_blocks=128, enforce_eager=eager)
    assert (llm.engine.runner.graph_runner is None) is eager
    assert _generate(llm, prompts, MAX_TOKENS) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("setting", ["route_in_gemv", "route_in_router"])
def test_routing_settings_on_cuda_match_transformers(arch, setting, moe_checkpoints, hf_greedy):
    """`SparseMoeBlock.route_in_gemv` (the first expert GEMV routes each token itself) and
    `route_in_router` (the router GEMV's last program routes) on the GPU, in eager decode steps
    (the engine captures its graphs at start, before the blocks are switched;
    tests/kernels/test_moe_router.py replays the router from a graph). One prompt at a time,
    so the decode steps are single-token, as `route_in_router` needs."""
    from cleave.model.moe import SparseMoeBlock

    prompts, expected = hf_greedy[arch]
    llm = LLM(moe_checkpoints[arch], device="cuda", dtype="float32", max_model_len=256,
              max_num_batched_tokens=48, block_size=16, num_blocks=128, enforce_eager=True)
    blocks = [module for module in llm.engine.model.modules() if isinstance(module, SparseMoeBlock)]
    for block in blocks:
        setattr(block, setting, True)
    assert blocks and [_generate(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts] == expected


@pytest.mark.gpu
def test_packed_mxfp4_experts_on_cuda_generate_what_the_dequantised_ones_do(tmp_path_factory):
    """The same on the GPU, in bf16, decode steps replayed from CUDA graphs."""
    root = tmp_path_factory.mktemp("engine-mxfp4-cuda")
    dense = write_tiny_checkpoint(root / "dense", "gpt-oss", seed=44)
    quantized = write_mxfp4_twin(dense, root / "quantized", seed=45)
    options = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_batched_tokens=48, block_size=16,
                   num_blocks=128)
    dense_llm = LLM(dense, **options)
    prompts = _prompts(dense_llm.engine.model.config.vocab_size)
    expected = _generate(dense_llm, prompts, MAX_TOKENS)
    del dense_llm
    packed_llm = LLM(quantized, packed_experts=True, **options)
    assert packed_llm.engine.runner.graph_runner is not None
    produced = _generate(packed_llm, prompts, MAX_TOKENS)
    # bf16: the packed kernels sum each 32-value scale group first; a near-tie may flip late
    assert [tokens[:8] for tokens in produced] == [tokens[:8] for tokens in expected]
