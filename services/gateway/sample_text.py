"""Token ids -> client text for one sample: detokenize, cut at stop strings, split reasoning.

Decode workers stream token ids only (one message per engine step for all requests), so
text is made here, per sample, with the engine's own pieces in the engine's order:
`StopChecker.process` drives the `IncrementalDetokenizer` and holds back possible stop-string
prefixes, then `ReasoningParser.feed` splits thinking from the answer. The parser always runs
on reasoning models, so reasoning tokens are counted in every mode; the mode only decides
what the client sees. A request with tools has a tool-call parser too
(`cleave.generation.tool_calls`): hermes blocks are taken out of the answer text, harmony
messages to a function out of the model's text before the reasoning parser reads it; the
calls come out apart from the content (not in INLINE mode, where the text is the model's,
whole). With a byte-level (or `Fuse`) tokenizer the detokenizer takes the model's shared
`TokenPieces` (`ServedModel.token_pieces`), as the engine's do, so most tokens cost a table
lookup instead of two window decodes.
"""

from __future__ import annotations

from collections.abc import Collection

from cleave.generation.detokenizer import IncrementalDetokenizer
from cleave.generation.outputs import FinishReason
from cleave.generation.reasoning import Phase, ReasoningConfig, ReasoningParser
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.stop import StopChecker
from cleave.generation.token_pieces import TokenPieces
from cleave.generation.tool_calls import READS_MARKED_TEXT, ToolCall, ToolParse, tool_parser
from cleave.model.tokenizer import Tokenizer
from cleave.rpc.types import ReasoningMode
from services.gateway.backend import SampleOutput
from services.gateway.convert import TokenDelta


def resolve_mode(mode: ReasoningMode, reasoning: ReasoningConfig | None) -> ReasoningMode:
    """DEFAULT -> SEPARATE for reasoning models, INLINE otherwise; no tags -> INLINE."""
    if reasoning is None:
        return ReasoningMode.INLINE
    return ReasoningMode.SEPARATE if mode is ReasoningMode.DEFAULT else mode


class SampleText:
    """Text state of one sample on the gateway.

    Args:
        index: sample index.
        tokenizer / prompt_token_ids: what the detokenizer needs.
        params: the request's resolved sampling params (stop strings, special tokens).
        eos_token_ids: the model's end-of-sequence ids (their text is never shown).
        reasoning: the model's think tags, or None for a plain model.
        mode: SEPARATE, HIDDEN or INLINE (already resolved).
        include_token_ids: put token ids into every output.
        tag_tokens: `special_tag_tokens(...)` of the model (unused when the params keep
            special tokens: their text is in the detokenized text already).
        pieces: the model's `TokenPieces` (shared by all its samples), or None to decode
            every token.
        tool_format: the format to parse tool calls out of ("hermes", "harmony": a request
            with tools, `ServedModel.tool_call_format`), or None.
        parallel_tool_calls: False keeps the answer's first call only (the others are dropped).
        include_stop_str: a stop string (or stop token's text) that ends the sample stays in
            its text (vLLM's `include_stop_str_in_output`).
    """

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: Collection[int],
        reasoning: ReasoningConfig | None,
        mode: ReasoningMode,
        include_token_ids: bool = False,
        tag_tokens: dict[int, str] | None = None,
        pieces: TokenPieces | None = None,
        tool_format: str | None = None,
        parallel_tool_calls: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self.index = index
        self._tag_tokens = (tag_tokens or {}) if params.skip_special_tokens else {}
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens, pieces
        )
        self._stop = StopChecker(params, eos_token_ids, include_stop_str=include_stop_str)
        self._parser = ReasoningParser.for_config(reasoning) if reasoning is not None else None
        self._mode = mode
        self._include_token_ids = include_token_ids
        tools = tool_parser(tool_format) if tool_format is not None and mode is not ReasoningMode.INLINE else None
        marked = tool_format in READS_MARKED_TEXT
        self._marked_tools = tools if marked else None  # reads the text before the reasoning parser
        self._tools = None if marked else tools  # reads the answer after it
        self.token_ids: list[int] = []
        self.answer_parts: list[str] = []  # answer text (reasoning and tool calls removed)
        self.reasoning_parts: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self._max_tool_calls = None if parallel_tool_calls else 1
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_reasoning_tokens(self) -> int:
        return 0 if self._parser is None else self._parser.num_reasoning_tokens

    @property
    def reasoning_phase(self) -> Phase | None:
        """Where the sample is relative to its thinking block (None for a plain model)."""
        return None if self._parser is None else self._parser.phase

    @property
    def answer_text(self) -> str:
        """The answer so far (what a verifier or a vote looks at)."""
        return "".join(self.answer_parts)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning_parts)

    def push(self, delta: TokenDelta) -> SampleOutput | None:
        """Add one step's tokens; return the client-visible news (None when there is none).

        Tokens after a stop string matched here are dropped: the sample already ended.
        """
        if self.finished:
            return None
        num_calls = len(self.tool_calls)  # the calls this push completes follow them
        text: list[str] = []
        reasoning: list[str] = []
        new_ids: list[int] = []
        for token_id in delta.token_ids:
            new_ids.append(token_id)
            update = self._stop.process(token_id, self._detokenizer)
            tag = self._tag_tokens.get(token_id, "")
            self._feed(update.text + tag, text, reasoning, num_tokens=1)
            if update.finished:
                self.finish_reason = update.finish_reason
                break
        self.token_ids.extend(new_ids)
        if delta.finish_reason is not None and not self.finished:
            final = self._stop.append_text(
                "" if delta.finish_reason is FinishReason.ABORT else self._detokenizer.finish(), final=True
            )
            self._feed(final.text, text, reasoning, num_tokens=0)
            self.finish_reason = final.finish_reason or delta.finish_reason
        if self.finished and self._marked_tools is not None:
            self._feed_marked(self._marked_tools.finish(), text, reasoning)
        if self.finished and self._parser is not None:
            tail = self._parser.finish()
            self._route(tail.reasoning, tail.content, text, reasoning)
        if self.finished and self._tools is not None:
            self._add_answer(self._tools.finish(), text)
        if not (text or reasoning or new_ids or self.finished):
            return None
        return SampleOutput(
            index=self.index,
            text="".join(text),
            reasoning_text="".join(reasoning),
            token_ids=tuple(new_ids) if self._include_token_ids else (),
            finish_reason=self.finish_reason,
            logprobs=delta.logprobs[: len(new_ids)],
            tool_calls=tuple(self.tool_calls[num_calls:]),
        )

    def _feed(self, new_text: str, text: list[str], reasoning: list[str], num_tokens: int) -> None:
        if self._marked_tools is not None:
            self._feed_marked(self._marked_tools.feed(new_text), text, reasoning, num_tokens)
            return
        self._split(new_text, text, reasoning, num_tokens)

    def _feed_marked(self, parsed: ToolParse, text: list[str], reasoning: list[str], num_tokens: int = 0) -> None:
        """What the marked-text tool parser passed on goes to the reasoning parser."""
        self._add_calls(parsed.tool_calls)
        self._split(parsed.content, text, reasoning, num_tokens)

    def _add_calls(self, calls: tuple[ToolCall, ...]) -> None:
        if self._max_tool_calls is not None:
            calls = calls[: max(0, self._max_tool_calls - len(self.tool_calls))]
        self.tool_calls.extend(calls)

    def _split(self, new_text: str, text: list[str], reasoning: list[str], num_tokens: int) -> None:
        """Thinking from answer (a reasoning model), then the answer out."""
        if self._parser is None:
            self._answer(new_text, text)
            return
        if self._mode is ReasoningMode.INLINE and new_text:
            text.append(new_text)
        parsed = self._parser.feed(new_text, num_tokens=num_tokens)
        self._route(parsed.reasoning, parsed.content, text, reasoning)

    def _route(self, thought: str, content: str, text: list[str], reasoning: list[str]) -> None:
        if thought:
            self.reasoning_parts.append(thought)
        if self._mode is ReasoningMode.INLINE:  # the text went out whole already
            if content:
                self.answer_parts.append(content)
            return
        self._answer(content, text)
        if thought and self._mode is ReasoningMode.SEPARATE:
            reasoning.append(thought)

    def _answer(self, content: str, text: list[str]) -> None:
        """Answer text on its way out: through the tool-call parser when there is one."""
        if self._tools is not None:
            if content:
                self._add_answer(self._tools.feed(content), text)
        elif content:
            text.append(content)
            self.answer_parts.append(content)

    def _add_answer(self, parsed: ToolParse, text: list[str]) -> None:
        if parsed.content:
            text.append(parsed.content)
            self.answer_parts.append(parsed.content)
        self._add_calls(parsed.tool_calls)
