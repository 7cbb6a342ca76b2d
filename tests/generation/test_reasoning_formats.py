"""Picking a checkpoint's thinking tags: cleave_config.json, the checkpoint's own signs, the flag."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from cleave.generation.reasoning import ReasoningConfig, ReasoningParser
from cleave.generation.reasoning_formats import FORMATS, REASONING_PARSERS, select_reasoning_config
from cleave.model.tokenizer import Tokenizer

QWEN3 = ReasoningConfig("<think>", "</think>", starts_in_reasoning=False)
DEEPSEEK_R1 = ReasoningConfig("<think>", "</think>", starts_in_reasoning=True)
HARMONY_END = "<|end|><|start|>assistant<|channel|>final<|message|>"
# DeepSeek-R1-Distill's template shape: the generation prompt opens the thinking block.
R1_TEMPLATE = (
    "{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Qwen3's shape: `<think>` appears in the generation prompt only when thinking is switched off,
# and then closed again.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
FAILING_TEMPLATE = "{{ raise_exception('only system and user roles') }}"
CUSTOM = {"start_tag": "<reason>", "end_tag": "</reason>", "starts_in_reasoning": True, "answer_prefix": " A:"}


def tokenizer(think_tokens: bool = True, template: str | None = PLAIN_TEMPLATE) -> Tokenizer:
    """A word-level tokenizer, with `<think>` and `</think>` tokens or without."""
    backend = BackendTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if think_tokens:
        backend.add_tokens(["<think>", "</think>"])
    return Tokenizer(backend, {}, chat_template=template)


def checkpoint(directory: Path, architecture: str | None, cleave_config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture]} if architecture else {"model_type": "llama"}
    (directory / "config.json").write_text(json.dumps(config))
    if cleave_config is not None:
        (directory / "cleave_config.json").write_text(json.dumps(cleave_config))
    return directory


@pytest.mark.parametrize(
    ("architecture", "think_tokens", "template", "expected"),
    [
        ("GptOssForCausalLM", False, None, FORMATS["gpt_oss"]),
        ("Qwen3ForCausalLM", True, QWEN3_TEMPLATE, QWEN3),
        ("Qwen3MoeForCausalLM", True, QWEN3_TEMPLATE, QWEN3),
        ("Qwen3ForCausalLM", False, QWEN3_TEMPLATE, None),  # no think tokens: not a thinking Qwen3
        ("Qwen2ForCausalLM", True, R1_TEMPLATE, DEEPSEEK_R1),  # DeepSeek-R1-Distill-Qwen
        ("LlamaForCausalLM", True, R1_TEMPLATE, DEEPSEEK_R1),  # DeepSeek-R1-Distill-Llama
        ("Qwen3ForCausalLM", True, R1_TEMPLATE, DEEPSEEK_R1),  # a thinking-only Qwen3 opens it in the prompt
        ("Qwen2ForCausalLM", True, PLAIN_TEMPLATE, None),
        ("LlamaForCausalLM", True, None, None),
        ("LlamaForCausalLM", True, FAILING_TEMPLATE, None),
        ("MistralForCausalLM", False, PLAIN_TEMPLATE, None),
        (None, True, PLAIN_TEMPLATE, None),  # config.json names no architecture
    ],
)
def test_recognised_from_the_checkpoint(tmp_path, architecture, think_tokens, template, expected):
    directory = checkpoint(tmp_path / "model", architecture)
    assert select_reasoning_config(directory, tokenizer(think_tokens, template)) == expected


def test_gpt_oss_format_is_harmony():
    harmony = FORMATS["gpt_oss"]
    assert (harmony.start_tag, harmony.end_tag, harmony.starts_in_reasoning) == (
        "<|channel|>analysis<|message|>", HARMONY_END, False)
    assert "<|channel|>final<|message|>" in harmony.answer_tags


def test_cleave_config_wins_over_the_architecture(tmp_path):
    directory = checkpoint(tmp_path / "model", "GptOssForCausalLM", {"reasoning": CUSTOM})
    assert select_reasoning_config(directory, tokenizer()) == ReasoningConfig(
        "<reason>", "</reason>", starts_in_reasoning=True, answer_prefix=" A:")


def test_cleave_config_without_a_reasoning_section_falls_back_to_the_checkpoint(tmp_path):
    directory = checkpoint(tmp_path / "model", "Qwen3ForCausalLM", {"kernels": {}})
    assert select_reasoning_config(directory, tokenizer()) == QWEN3


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "gpt_oss"])
def test_a_named_parser_overrides_cleave_config_and_the_architecture(tmp_path, name):
    directory = checkpoint(tmp_path / "model", "MistralForCausalLM", {"reasoning": CUSTOM})
    assert select_reasoning_config(directory, tokenizer(False), name) == FORMATS[name]


def test_none_turns_reasoning_off_even_with_cleave_config(tmp_path):
    directory = checkpoint(tmp_path / "model", "GptOssForCausalLM", {"reasoning": CUSTOM})
    assert select_reasoning_config(directory, tokenizer(), "none") is None


def test_an_unknown_parser_is_refused_naming_the_choices(tmp_path):
    directory = checkpoint(tmp_path / "model", "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="'qwen'.*auto, none, qwen3, deepseek_r1, gpt_oss"):
        select_reasoning_config(directory, tokenizer(), "qwen")
    assert REASONING_PARSERS == ("auto", "none", "qwen3", "deepseek_r1", "gpt_oss")


def test_answer_tags_are_read_from_cleave_config(tmp_path):
    directory = checkpoint(tmp_path / "model", None, {"reasoning": {**CUSTOM, "answer_tags": ["<final>"]}})
    assert select_reasoning_config(directory, tokenizer()).answer_tags == ("<final>",)
    checkpoint(directory, None, {"reasoning": {**CUSTOM, "answer_tags": "<final>"}})
    with pytest.raises(ValueError, match="answer_tags must be a list"):
        select_reasoning_config(directory, tokenizer())


def test_reasoning_separators_are_read_from_cleave_config(tmp_path):
    directory = checkpoint(tmp_path / "model", None, {"reasoning": {**CUSTOM, "reasoning_separators": ["<next>"]}})
    config = select_reasoning_config(directory, tokenizer())
    assert config.reasoning_separators == ("<next>",) and "<next>" in config.tags
    checkpoint(directory, None, {"reasoning": {**CUSTOM, "reasoning_separators": [""]}})
    with pytest.raises(ValueError, match="reasoning_separators must be a list of non-empty strings"):
        select_reasoning_config(directory, tokenizer())


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer.",
         "Think.", "Answer."),
        ("<|channel|>final<|message|>Answer at once.", "", "Answer at once."),
        ("<|start|>assistant<|channel|>final<|message|>Answer.", "", "Answer."),
        ("<|channel|>analysis<|message|>Cut short <|end|><|start|>assist", "Cut short <|end|><|start|>assist", ""),
        ("<|channel|>commentary<|message|>x", "", "<|channel|>commentary<|message|>x"),
        # a commentary message (a preamble; no tools API) after the analysis joins the thinking,
        # as does a second analysis message: the messages a newline apart, no markers
        ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>commentary<|message|>P.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Answer.",
         "A.\nP.", "Answer."),
        ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>"
         "<|start|>assistant<|channel|>analysis<|message|>C.<|end|><|start|>assistant<|channel|>final<|message|>X",
         "A.\nB.\nC.", "X"),
        # a separator's text after the answer opened is answer text
        ("<|channel|>final<|message|>X<|end|><|start|>assistant<|channel|>analysis<|message|>",
         "", "X<|end|><|start|>assistant<|channel|>analysis<|message|>"),
        ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analy", "A.<|end|><|start|>assistant<|channel|>analy", ""),
        ("Plain text <|channel|>final<|message|>", "", "Plain text <|channel|>final<|message|>"),
    ],
)
def test_harmony_text_splits_the_same_in_every_chunking(text, reasoning, content):
    """The gpt_oss tags share their first marker with the answer tags: every cut of the text
    (one character at a time included) gives the same split as the whole text at once."""
    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        parser = ReasoningParser.for_config(FORMATS["gpt_oss"])
        deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
        assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == (reasoning, content)
