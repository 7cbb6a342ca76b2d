"""cleave's Tokenizer against transformers' AutoTokenizer on the tiny checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from cleave.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world! Why is the sky blue?",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "<think>reasoning here</think>The answer is 42.",
    "<s>special</s> tokens <|user|> inline <|assistant|>",
    "unicode: café, naïve, 東京, emoji 🙂",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "How many legs does a spider have?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers_pair(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


def test_encode_matches(tokenizers_pair):
    ours, hf = tokenizers_pair
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text
    assert ours.encode("Hello")[0] == ours.bos_token_id == hf.bos_token_id


def test_decode_and_tokens_match(tokenizers_pair):
    ours, hf = tokenizers_pair
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    think = ours.encode("<think>x</think>", add_special_tokens=False)
    assert ours.decode(think, skip_special_tokens=True) == "<think>x</think>"


def test_chat_template_matches(tokenizers_pair):
    ours, hf = tokenizers_pair
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    rendered = ours.apply_chat_template(CONVERSATIONS[0])
    assert rendered == "<s><|user|>\nWhat is the capital of France?</s>\n<|assistant|>\n"


def test_vocab_and_eos_ids(tokenizers_pair, tiny_checkpoints):
    ours, hf = tokenizers_pair
    assert ours.vocab_size == len(hf) == 512
    generation = json.loads((tiny_checkpoints["llama"] / "generation_config.json").read_text())
    assert ours.eos_token_ids == frozenset(generation["eos_token_id"]) == {hf.eos_token_id, ours.token_to_id("<|user|>")}


def test_special_tokens_come_from_the_post_processor(tmp_path, tiny_checkpoints):
    path = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "no-post-processor")
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(spec))
    ours, hf = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    ids = ours.encode("Hello world", add_special_tokens=True)
    assert ids == hf("Hello world")["input_ids"] == ours.encode("Hello world", add_special_tokens=False)


def test_missing_tokenizer_and_template(tmp_path, tokenizers_pair):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    without_template = Tokenizer(tokenizers_pair[0].backend, {"eos_token": "</s>"})
    assert without_template.eos_token_ids == {without_template.token_to_id("</s>")}
    with pytest.raises(ValueError, match="no chat_template"):
        without_template.apply_chat_template(CONVERSATIONS[0])
