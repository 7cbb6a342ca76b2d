"""`Tokenizer`: an HF fast tokenizer (tokenizer.json) with its special tokens and chat template.

Reads what transformers reads — `tokenizer.json`, `tokenizer_config.json`, an optional
`chat_template.jinja`, and the eos ids of `config.json` / `generation_config.json` — without
importing transformers. Chat templates render in the same sandboxed jinja2 environment
transformers uses (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `tojson`,
`strftime_now`), with the special tokens as template variables. Special tokens are added
by tokenizer.json's post-processor alone (transformers 5 ignores `add_bos_token` for
tokenizer.json-backed tokenizers as well).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Older spellings of a message's reasoning, copied to `reasoning_content` (and `thinking`) as transformers does.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_chat_template(template: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which chat templates do not want
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or serialised AddedToken dicts
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


class Tokenizer:
    """Text <-> token ids, special tokens, eos ids and chat-template rendering for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._compiled_template = _compile_chat_template(chat_template) if chat_template else None
        eos_ids = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load from a checkpoint directory holding tokenizer.json (+ tokenizer_config.json)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        special = {key: _token_content(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None}

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: use "default"
            chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")

        extra_eos = _as_id_list(_read_json(path / "config.json").get("eos_token_id"))
        extra_eos += _as_id_list(_read_json(path / "generation_config.json").get("eos_token_id"))
        return cls(
            backend,
            {k: v for k, v in special.items() if v is not None},
            chat_template=chat_template,
            extra_eos_token_ids=tuple(extra_eos),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # -- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (HF's `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        token = self.special_tokens.get("bos_token")
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        token = self.special_tokens.get("eos_token")
        return None if token is None else self.backend.token_to_id(token)

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_without_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` through the batch API, which releases the GIL while the Rust tokenizer runs
        (`encode` holds it): a long text tokenized in a worker thread leaves the event loop's
        thread running."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        # transformers skips this clean-up for BPE models because it corrupts their output
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                                  (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def is_special(self, token_id: int) -> bool:
        """Whether a token is special: it has text, which skip_special_tokens drops."""
        return self.decode([token_id], skip_special_tokens=True) == "" and self.decode([token_id]) != ""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    # -- chat -------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text (tokenize it with add_special_tokens=False)."""
        if self._compiled_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        chat = []
        for message in messages:
            message = {key: value for key, value in message.items() if value is not None}
            reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        variables = {**self.special_tokens, **template_kwargs}
        return self._compiled_template.render(
            messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )

