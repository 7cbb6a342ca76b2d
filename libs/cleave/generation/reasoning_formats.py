"""Which thinking tags a served model uses: named formats, and picking one for a checkpoint.

A checkpoint from the Hub ships no `cleave_config.json`, so its tags are recognised from what
it does ship, as vLLM's `--reasoning-parser` names them:

- `qwen3`: `<think>` ... `</think>`, opened by the model (Qwen3, Qwen3-MoE).
- `deepseek_r1`: the same tags, but the chat template's generation prompt already opened the
  block (DeepSeek-R1 and its Qwen2 / Llama distills; Qwen3 thinking-only checkpoints).
- `gpt_oss`: OpenAI's harmony format. The generation prompt ends with `<|start|>assistant`;
  the model writes `<|channel|>analysis<|message|>` thinking `<|end|>`, then
  `<|start|>assistant<|channel|>final<|message|>` answer, ended by `<|return|>` (an eos
  token). A model that skips the analysis channel opens its answer with
  `<|channel|>final<|message|>` (answer tags). Further analysis messages, and commentary
  ones without a recipient (preambles), before the final one join the reasoning, a newline
  apart (reasoning separators); tool calls (commentary to a function) are taken out before
  this parser reads the text (`cleave.generation.tool_calls`). The harmony markers are special tokens, which
  detokenizing skips: the gateway puts their text back for the parser.

`select_reasoning_config` resolves `--reasoning-parser` (`REASONING_PARSERS`): a named format
or `none` wins over everything; `auto` takes the `reasoning` section of `cleave_config.json`
when there is one, and otherwise recognises the checkpoint (`_recognise`). The gateway and
the workers call it with the same flag on the same directory, so the text split and the
token-id counting and budgets agree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import jinja2

from cleave.generation.reasoning import ReasoningConfig, read_reasoning_config

if TYPE_CHECKING:
    from cleave.model.tokenizer import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_COMMENTARY = "<|channel|>commentary<|message|>"
HARMONY_ASSISTANT = "<|start|>assistant"
HARMONY_END = "<|end|>"

FORMATS: Mapping[str, ReasoningConfig] = MappingProxyType({
    "qwen3": ReasoningConfig(THINK_START, THINK_END, starts_in_reasoning=False),
    "deepseek_r1": ReasoningConfig(THINK_START, THINK_END, starts_in_reasoning=True),
    "gpt_oss": ReasoningConfig(
        start_tag=HARMONY_ANALYSIS,
        end_tag=HARMONY_END + HARMONY_ASSISTANT + HARMONY_FINAL,
        answer_tags=(HARMONY_FINAL, HARMONY_ASSISTANT + HARMONY_FINAL),
        # a further analysis message, or a commentary one without a recipient (a preamble)
        reasoning_separators=(HARMONY_END + HARMONY_ASSISTANT + HARMONY_ANALYSIS,
                              HARMONY_END + HARMONY_ASSISTANT + HARMONY_COMMENTARY),
    ),
})
AUTO, NONE = "auto", "none"
REASONING_PARSERS: tuple[str, ...] = (AUTO, NONE, *FORMATS)

_GPT_OSS_ARCHITECTURES = frozenset({"GptOssForCausalLM"})
_QWEN3_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})


def check_reasoning_parser(name: str) -> str:
    """`name` if it is one of `REASONING_PARSERS`; ValueError naming the choices otherwise."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return name


def select_reasoning_config(model_dir: str | Path, tokenizer: Tokenizer, parser: str = AUTO) -> ReasoningConfig | None:
    """The thinking tags of the checkpoint in `model_dir` (None: not a reasoning model).

    Args:
        model_dir: the checkpoint directory (config.json, optional cleave_config.json).
        tokenizer: its tokenizer (vocabulary and chat template are looked at).
        parser: `--reasoning-parser`: auto, none or a name of `FORMATS`.
    """
    check_reasoning_parser(parser)
    if parser != AUTO:
        return FORMATS.get(parser)  # None for none
    explicit = read_reasoning_config(model_dir)
    if explicit is not None:
        return explicit
    return FORMATS.get(_recognise(model_dir, tokenizer))


def special_tag_tokens(tokenizer: Tokenizer, reasoning: ReasoningConfig | None) -> dict[int, str]:
    """The special tokens inside the reasoning tags, by id, with their text.

    Detokenizing with skip_special_tokens drops special tokens, so the text of those that
    make up a tag (`<think>` as one token, or harmony's `<|channel|>`, `<|message|>`,
    `<|end|>`, `<|start|>`) is put back for the reasoning parser; every other special token
    (eos, `<|return|>`, ...) stays skipped.
    """
    if reasoning is None:
        return {}
    tags: dict[int, str] = {}
    for tag in reasoning.tags:
        for token_id in tokenizer.encode(tag, add_special_tokens=False):
            if token_id not in tags and tokenizer.is_special(token_id):
                tags[token_id] = tokenizer.decode([token_id])
    return tags


def _recognise(model_dir: str | Path, tokenizer: Tokenizer) -> str:
    """The named format a checkpoint without a `reasoning` section uses, or `none`."""
    architecture = _architecture(Path(model_dir))
    if architecture in _GPT_OSS_ARCHITECTURES:
        return "gpt_oss"
    if _generation_prompt_opens_thinking(tokenizer):
        return "deepseek_r1"
    has_think_tokens = all(tokenizer.token_to_id(tag) is not None for tag in (THINK_START, THINK_END))
    if architecture in _QWEN3_ARCHITECTURES and has_think_tokens:
        return "qwen3"
    return NONE


def _architecture(model_dir: Path) -> str:
    """The first of config.json's `architectures` ("" when it names none)."""
    file = model_dir / "config.json"
    raw = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    architectures = raw.get("architectures") or [""]
    return str(architectures[0])


def _generation_prompt_opens_thinking(tokenizer: Tokenizer) -> bool:
    """Whether the chat template ends its generation prompt with `<think>` (DeepSeek-R1)."""
    if tokenizer.chat_template is None:
        return False
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1 = ?"}], add_generation_prompt=True)
    except (jinja2.TemplateError, TypeError, ValueError):
        return False  # a template that cannot render one user turn opens nothing we can see
    return prompt.rstrip().endswith(THINK_START)
