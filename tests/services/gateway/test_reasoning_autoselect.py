"""A Hub-style Qwen3 checkpoint (no `cleave_config.json`) served through the OpenAI API: the
gateway and the workers recognise its `<think>` tags themselves.

A random tiny model would not write the tags, so this one is wired by hand into a bigram
machine: attention and MLP outputs are zero, so the last hidden state is the current token's
embedding, and `lm_head` maps each token of one chosen sequence to the next (orthonormal
embeddings, so nothing else scores). Greedy decoding then writes
`<think>` THINKING `</think>` ANSWER `</s>` after the chat prompt: the split can only come out
right if both sides picked the `qwen3` tags.
"""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file

from cleave.config import ModelConfig as ServedModelConfig
from cleave.generation.reasoning_formats import FORMATS
from cleave.model.tokenizer import Tokenizer
from cleave.testing.tiny_models import write_tiny_checkpoint
from services.gateway.model import ServedModel
from tests.services.gateway.stack import MODEL_NAME, start_stack

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
THINKING = "air scatters blue light"
ANSWER = " Paris is the capital of France"


def wire_bigram_chain(model_dir, chain: list[int]) -> None:
    """Make greedy decoding follow `chain`: after token chain[i] comes chain[i + 1]."""
    assert len(set(chain)) == len(chain), f"a bigram machine needs distinct tokens: {chain}"
    weights = load_file(model_dir / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    basis, _ = torch.linalg.qr(torch.randn(hidden, len(chain), generator=torch.Generator().manual_seed(0)))
    lm_head = torch.zeros_like(weights["lm_head.weight"])
    for index, (token, following) in enumerate(zip(chain, chain[1:])):
        weights["model.embed_tokens.weight"][token] = basis[:, index]
        lm_head[following] = 10.0 * basis[:, index]
    weights["lm_head.weight"] = lm_head
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-hub") / "model", "qwen3",
                                      tie_word_embeddings=False)
    assert not (directory / "cleave_config.json").exists()
    tokenizer = Tokenizer.from_pretrained(directory)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    output = tokenizer.encode(f"<think>{THINKING}</think>{ANSWER}", add_special_tokens=False)
    wire_bigram_chain(directory, [prompt[-1], *output, tokenizer.eos_token_id])
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3_stack(qwen3_dir):
    running = await start_stack(qwen3_dir, "disaggregated")
    yield running
    await running.close()


def client(stack) -> openai.AsyncOpenAI:
    return stack.openai()  # closed with the stack


def test_the_gateway_recognises_qwen3_unless_told_otherwise(qwen3_dir):
    assert ServedModel(ServedModelConfig(source=str(qwen3_dir))).reasoning == FORMATS["qwen3"]
    assert ServedModel(ServedModelConfig(source=str(qwen3_dir), reasoning_parser="none")).reasoning is None
    named = ServedModel(ServedModelConfig(source=str(qwen3_dir), reasoning_parser="deepseek_r1"))
    assert named.reasoning == FORMATS["deepseek_r1"]


@in_module_loop
async def test_chat_splits_reasoning_content_from_content(qwen3_stack):
    response = await client(qwen3_stack).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0.0,
    )
    choice = response.choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (THINKING, ANSWER)
    assert choice.finish_reason == "stop"
    num_thinking = len(Tokenizer.from_pretrained(qwen3_stack.decode[0].engine_config.model).encode(
        THINKING, add_special_tokens=False))
    # the decode worker counts by token ids: both tags and everything between them
    assert response.usage.completion_tokens_details.reasoning_tokens == num_thinking + 2


@in_module_loop
async def test_streamed_deltas_put_thinking_before_the_answer(qwen3_stack):
    stream = await client(qwen3_stack).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0.0, stream=True,
    )
    parts = []
    async for chunk in stream:
        for choice in chunk.choices:
            if getattr(choice.delta, "reasoning_content", None):
                parts.append(("reasoning", choice.delta.reasoning_content))
            if choice.delta.content:
                parts.append(("content", choice.delta.content))
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # no reasoning after the answer
    assert "".join(t for k, t in parts if k == "reasoning") == THINKING
    assert "".join(t for k, t in parts if k == "content") == ANSWER


@in_module_loop
async def test_a_thinking_budget_on_the_worker_closes_the_recognised_block(qwen3_stack):
    """The decode worker forces `</think>` after two thinking tokens (it picked the same tags)
    and the bigram model answers from there."""
    response = await client(qwen3_stack).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0.0, extra_body={"max_thinking_tokens": 2},
    )
    message = response.choices[0].message
    tokenizer = Tokenizer.from_pretrained(qwen3_stack.decode[0].engine_config.model)
    assert message.reasoning_content == tokenizer.decode(tokenizer.encode(THINKING, add_special_tokens=False)[:2])
    assert message.content == ANSWER
    assert response.usage.completion_tokens_details.reasoning_tokens == 2 + 2
