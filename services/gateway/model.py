"""The served model as the gateway sees it: tokenizer, chat template, context, think tags.

The gateway never loads weights. It reads the checkpoint directory's tokenizer files,
`config.json` (context length, vocabulary), `generation_config.json` (sampling defaults)
and `cleave_config.json` (reasoning tags; without them the tags are recognised from the
checkpoint, or named by `--reasoning-parser`), and turns a `Prompt` into token ids.

Before tokenizing, a prompt's text is measured in UTF-8 bytes: no token covers more bytes
than the vocabulary's longest, so text over `max_model_len` times that many bytes cannot fit
the context whatever it tokenizes to, and is refused without running the tokenizer (a chat's
content before its template runs, and all the template rendered, tools included, after).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from cleave.config import ModelConfig as ServedModelConfig
from cleave.errors import InvalidArgument
from cleave.generation.reasoning import ReasoningConfig
from cleave.generation.reasoning_formats import select_reasoning_config
from cleave.generation.token_pieces import TokenPieces
from cleave.generation.tool_calls import tool_call_format
from cleave.model.source import resolve_model_dir
from cleave.model.text_config import TextConfig
from cleave.model.tokenizer import Tokenizer
from cleave.rpc.types import ReasoningOptions
from services.gateway.backend import ChatMessage, Prompt


@dataclass(frozen=True)
class SamplingDefaults:
    """Model defaults for unset sampling fields (`generation_config.json`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def _read_defaults(path: Path) -> SamplingDefaults:
    file = path / "generation_config.json"
    raw: dict[str, Any] = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    return SamplingDefaults(
        temperature=float(raw.get("temperature", 1.0)) if raw.get("do_sample", True) else 0.0,
        top_p=float(raw.get("top_p", 1.0)),
        top_k=int(raw.get("top_k", 0) or 0),
    )


class ServedModel:
    """Tokenization and limits of one served model.

    Args:
        config: the model section of the gateway's configuration; `source` is a checkpoint
            directory or a Hub id (`cleave.model.source`).
        max_prompt_bytes: prompt text over this many UTF-8 bytes is refused before
            tokenizing; 0: `max_model_len` times the longest token's bytes.
    """

    def __init__(self, config: ServedModelConfig, max_prompt_bytes: int = 0) -> None:
        path = resolve_model_dir(config.source)  # ModelNotFound: one line naming --model
        self.config = config
        self.path = path
        self.tokenizer = Tokenizer.from_pretrained(path)
        # One piece table for every sample's detokenizer (None: neither a byte-level nor a `Fuse` decoder).
        self.token_pieces: TokenPieces | None = TokenPieces.for_tokenizer(self.tokenizer)
        model_config = TextConfig.from_pretrained(path)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = config.max_context_length or model_config.max_position_embeddings
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(model_config.eos_token_ids)
        self.reasoning: ReasoningConfig | None = select_reasoning_config(
            path, self.tokenizer, config.effective_reasoning_parser
        )
        self.defaults = _read_defaults(path)
        # how its answers hold tool calls, as its chat template asks for them (None: no tools)
        self.tool_call_format = tool_call_format(self.tokenizer.chat_template)
        self.max_prompt_bytes = max_prompt_bytes or self.max_model_len * _longest_token_bytes(self.tokenizer)

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def is_reasoning_model(self) -> bool:
        return self.reasoning is not None

    def check_prompt_size(self, prompt: Prompt) -> int:
        """The prompt's size in bytes (text: UTF-8; token ids: 4 each), without tokenizing.

        Raises InvalidArgument naming `text` or `chat.messages` when the text is over
        `max_prompt_bytes`: more than the context could hold.
        """
        if prompt.token_ids is not None:
            return 4 * len(prompt.token_ids)
        if prompt.text is not None:
            field, num_bytes = "text", _utf8_len(prompt.text)
        else:
            # content alone: templates may drop earlier turns' reasoning, never their content
            field, num_bytes = "chat.messages", sum(_utf8_len(m.content) for m in prompt.chat or ())
        if num_bytes > self.max_prompt_bytes:
            raise InvalidArgument(
                f"is {num_bytes} bytes of text, more than this model's context of {self.max_model_len} tokens "
                f"can hold (at most {self.max_prompt_bytes} bytes); shorten the prompt",
                field=field,
            )
        return num_bytes

    def renders_short(self, prompt: Prompt, max_bytes: int) -> bool:
        """Whether what the chat template may render from `prompt` holds at most `max_bytes`
        bytes (token ids: 4 each): every string of every turn, of its earlier tool calls and
        of the tools, which `check_prompt_size` leaves out (a template may drop them) and which
        may be megabytes. Counting stops past `max_bytes`, so millions of parts cost no more
        than a few."""
        if prompt.token_ids is not None:
            return 4 * len(prompt.token_ids) <= max_bytes
        turns = [(m.role, m.content, m.reasoning_content, m.name, m.tool_calls, m.tool_call_id)
                 for m in prompt.chat or ()]
        pending: list[Any] = [prompt.text or "", prompt.tools, turns]
        total = 0
        while pending and total <= max_bytes:
            part = pending.pop()
            if isinstance(part, str):
                total += _utf8_len(part)
            elif isinstance(part, dict):
                pending.extend(part.keys())
                pending.extend(part.values())
            elif isinstance(part, (list, tuple)):
                pending.extend(part)
            else:  # a number, bool or null in a schema or in arguments
                total += 1
        return total <= max_bytes

    def encode(self, prompt: Prompt, reasoning: ReasoningOptions | None = None) -> list[int]:
        """Token ids of a prompt; text and chat go through the chat template unless raw, with
        the template variables `reasoning` sets (`enable_thinking`, `reasoning_effort`).

        Raises InvalidArgument for token ids outside the vocabulary and for prompts the
        template renders to nothing.
        """
        if prompt.token_ids is not None:
            bad = next((t for t in prompt.token_ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(
                    f"token id {bad} is outside this model's vocabulary [0, {self.vocab_size})",
                    field="token_ids.ids",
                )
            return list(prompt.token_ids)
        if prompt.text is not None and (prompt.raw or self.tokenizer.chat_template is None):
            return self.tokenizer.encode_without_gil(prompt.text)
        if prompt.tools and self.tool_call_format is None:
            raise InvalidArgument("this model's chat template does not ask for tool calls in a format the gateway "
                                  "parses (hermes <tool_call> blocks, harmony messages to=functions.NAME); describe "
                                  "the tools in the messages", field="tools")
        if prompt.text is not None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt.text}]
        else:
            messages = [_template_message(m) for m in prompt.chat or ()]
        kwargs = reasoning.template_kwargs() if reasoning is not None else {}
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tools=list(prompt.tools) or None, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as error:  # the template refused what it was given
            raise InvalidArgument(f"the model's chat template cannot render this conversation: {error}",
                                  field="input") from None
        num_bytes = _utf8_len(text)
        if num_bytes > self.max_prompt_bytes:  # tools and earlier calls may render to megabytes: tokenizing took seconds
            raise InvalidArgument(
                f"renders to {num_bytes} bytes of text (tools and earlier tool calls included), more than this "
                f"model's context of {self.max_model_len} tokens can hold (at most {self.max_prompt_bytes} bytes); "
                "shorten the conversation or the tools", field="input")
        token_ids = self.tokenizer.encode_without_gil(text, add_special_tokens=False)
        if not token_ids:
            raise InvalidArgument("renders to an empty prompt", field="input")
        return token_ids


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A chat turn as chat templates read it (fields a turn lacks are left out or None)."""
    turn: dict[str, Any] = {
        "role": message.role,
        "content": message.content,
        "reasoning_content": message.reasoning_content or None,
        "name": message.name or None,
    }
    if message.tool_calls:
        turn["tool_calls"] = [dict(call) for call in message.tool_calls]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _utf8_len(text: str) -> int:
    # gRPC strings are valid UTF-8 and HTTP text was checked; surrogatepass only keeps a
    # measurement from raising
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes of any token's string in the vocabulary (added tokens included).

    Byte-level vocabularies spell each byte as one character of up to 2 bytes, so this may
    overstate a token's text by up to 2x: the bound stays safe (it never refuses a prompt
    that fits), only looser.
    """
    vocabulary = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8", "surrogatepass")) for token in vocabulary), default=1) or 1
