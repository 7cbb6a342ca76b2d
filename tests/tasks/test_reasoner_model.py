"""The shipped reasoning model loads with transformers, chats, thinks and mostly adds correctly."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import cleave
from cleave.tasks import arithmetic

MODEL_DIR = Path(cleave.__file__).parent / "assets" / "reasoner"
# Greedy gets 16 of these 20 right (torch 2.13 CPU, fp32); the floor leaves room for numerics.
GREEDY_FLOOR = 14
NUM_PROBLEMS = 20


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def test_directory_is_small_and_declares_its_reasoning_tags():
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size < 8 * 2**20
    cleave_config = json.loads((MODEL_DIR / "cleave_config.json").read_text())
    assert cleave_config["reasoning"] == {"start_tag": "<think>", "end_tag": "</think>", "starts_in_reasoning": False,
                                          "answer_prefix": " The answer is"}
    generation_config = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == AutoTokenizer.from_pretrained(MODEL_DIR).convert_tokens_to_ids("</s>")


def test_tokenizer_round_trips_and_has_the_special_tokens(tokenizer):
    text = "<s><|user|>What is 4821 + 970?</s><|assistant|>" + arithmetic.format_solution(
        arithmetic.Problem(4821, 970, "What is 4821 + 970?", "5791")
    ) + "</s>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    for token in ("<s>", "</s>", "<pad>", "<think>", "</think>", "<|user|>", "<|assistant|>"):
        assert tokenizer.convert_ids_to_tokens(tokenizer.convert_tokens_to_ids(token)) == token
    assert tokenizer.convert_ids_to_tokens(tokenizer("12+3", add_special_tokens=False)["input_ids"]) == ["1", "2", "+", "3"]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")


def test_chat_template_renders_user_turns_and_generation_prompt(tokenizer):
    messages = [
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "</think> The answer is 42."},
        {"role": "user", "content": "What is 1 + 2?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<s><|user|>What is 12 + 30?</s><|assistant|></think> The answer is 42.</s>"
        "<|user|>What is 1 + 2?</s><|assistant|>"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<s><|user|>What is 12 + 30?</s>"


def greedy_completions(model, tokenizer, problems):
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": arithmetic.format_prompt(p)}], add_generation_prompt=True, tokenize=False
        )
        for p in problems
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=160, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new_tokens = output[:, batch["input_ids"].shape[1] :]
    return [tokenizer.decode(row, skip_special_tokens=False).split("</s>")[0] for row in new_tokens], output


def test_greedy_generation_thinks_then_answers_correctly(model, tokenizer):
    problems = arithmetic.heldout_problems(NUM_PROBLEMS, seed=0)
    completions, output = greedy_completions(model, tokenizer, problems)
    # Every row stopped at </s>, well before the token limit.
    assert all((row == tokenizer.eos_token_id).any() for row in output)
    assert arithmetic.is_well_formed(completions[0])
    assert completions[0].startswith("<think>\n9460+__71 0+1+0=01 ____1\n")
    assert sum(arithmetic.is_well_formed(c) for c in completions) >= NUM_PROBLEMS - 1
    assert sum(arithmetic.extract_answer(c) is not None for c in completions) >= NUM_PROBLEMS - 1
    correct = sum(arithmetic.is_correct(c, p.answer) for c, p in zip(completions, problems))
    assert correct >= GREEDY_FLOOR
