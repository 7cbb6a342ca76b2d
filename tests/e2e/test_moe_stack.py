"""Tiny Qwen3-MoE and gpt-oss checkpoints served by the whole stack (`cleave up`'s processes,
CPU), colocated and disaggregated: the streamed greedy tokens equal the in-process engine's,
which equal transformers'. gpt-oss's cache pairs its sliding-window and full-attention layers
(`cleave.kv.groups`), so its disaggregated stack sends both block tables' pages over TCP."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.client import GatewayClient
from cleave.client.gateway import collect
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import MOE_ARCHITECTURES, write_mxfp4_twin, write_tiny_checkpoint
from tests.e2e.conftest import NUM_KV_BLOCKS, START_HANG_S
from tests.e2e.test_stack import request

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "What is the capital of France? Paris is the capital of France.",
    "Numbers: one two three four five six seven eight nine ten",
    "Please write a short poem about the sea",
    # long enough that gpt-oss's first decode step no longer sees its first block: the
    # disaggregated stack sends none of the window pages behind it
    "Count with me slowly: one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty, and then the names of the days of the week in order",
]
MAX_TOKENS = 8  # test_stack.request's budget
NUM_PAGES = 2 * NUM_KV_BLOCKS  # a paired cache's sequence holds pages in two tables


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe_model(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(f"e2e-{request.param}") / "model", request.param, seed=3)


@pytest.fixture(params=["colocated", "disaggregated"])
def moe_stack(request, moe_model, tmp_path_factory):
    spec = StackSpec(model=moe_model, mode=request.param, grpc_port=0, http_port=0, num_kv_blocks=NUM_PAGES,
                     log_level="WARNING")
    stack = ProcessStack(spec, tmp_path_factory.mktemp(f"moe-stack-{request.param}"))
    try:
        stack.start(timeout_s=START_HANG_S)
        yield stack
    finally:
        stack.stop()
    assert [child.process.returncode for child in stack.children] == [0] * len(stack.children)


@pytest.mark.timeout(600)
async def test_moe_stack_streams_the_engines_greedy_tokens(moe_stack, moe_model):
    engine = LLM(moe_model, device="cpu", dtype="float32", num_blocks=NUM_PAGES, enforce_eager=True)
    assert engine.engine.model.config.is_moe
    expected = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    async with GatewayClient(moe_stack.gateway_address) as client:
        results = await asyncio.gather(*(collect(client.stream(request(prompt))) for prompt in PROMPTS))
    for result, engine_output in zip(results, expected):
        assert result.samples[0].token_ids == engine_output.outputs[0].token_ids
        assert result.samples[0].token_ids  # something was generated

    import transformers  # the engine's tokens are transformers' greedy continuation

    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    prompt_ids = expected[0].prompt_token_ids
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones_like(torch.tensor([prompt_ids])),
                             max_new_tokens=len(expected[0].outputs[0].token_ids), do_sample=False)
    assert hf_out[0, len(prompt_ids):].tolist() == expected[0].outputs[0].token_ids


@pytest.mark.timeout(600)
async def test_packed_mxfp4_experts_are_served_disaggregated(tmp_path_factory):
    """gpt-oss with MXFP4 experts, the workers keeping them packed (`--packed-experts`): the
    disaggregated stack streams the tokens of an in-process engine that dequantised them."""
    root = tmp_path_factory.mktemp("e2e-mxfp4")
    dense = write_tiny_checkpoint(root / "dense", "gpt-oss", seed=3)
    quantized = write_mxfp4_twin(dense, root / "model", seed=4)
    engine = LLM(quantized, device="cpu", dtype="float32", num_blocks=NUM_PAGES, enforce_eager=True)
    assert not engine.engine.model.config.packed_experts
    expected = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    spec = StackSpec(model=quantized, mode="disaggregated", grpc_port=0, http_port=0, num_kv_blocks=NUM_PAGES,
                     log_level="WARNING", worker_args=("--packed-experts",))
    stack = ProcessStack(spec, root / "stack")
    try:
        stack.start(timeout_s=START_HANG_S)
        async with GatewayClient(stack.gateway_address) as client:
            results = await asyncio.gather(*(collect(client.stream(request(prompt))) for prompt in PROMPTS))
    finally:
        stack.stop()
    assert [child.process.returncode for child in stack.children] == [0] * len(stack.children)
    for result, engine_output in zip(results, expected):
        assert result.samples[0].token_ids == engine_output.outputs[0].token_ids
