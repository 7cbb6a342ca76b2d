"""Incremental detokenization: one token id in, the new text out.

Decoding token by token and concatenating is wrong twice over: a byte-level BPE token may
hold only part of a multi-byte UTF-8 character (decoded alone it is U+FFFD), and
SentencePiece-style decoders drop or add a leading space depending on what precedes a
token. So, as vLLM does, each step decodes a short window of ids twice — the already
emitted part `[prefix_offset, read_offset)` and the whole window `[prefix_offset, end)` —
and emits only the difference. Text that ends in U+FFFD is an unfinished character: it is
held back until a later token completes it (or `finish()` flushes it).

With byte-level tokenizers most tokens append the same text whatever precedes them (their
`TokenPieces` piece). When nothing is held back, such a token's text is its piece and the
window state after it is known, so `push` skips both decodes: the same text and state as
the decoding path, at a dictionary lookup per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cleave.generation.token_pieces import TokenPieces

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first output token, so the first output token sees the
# context a leading-space rule needs.
INITIAL_PREFIX_TOKENS = 5
# Held-back tokens beyond which the window is cut (each push decodes the whole window).
# Text is held back while new tokens add none (e.g. skipped special tokens) or end in an
# unfinished character, which spans at most 4 byte-level tokens; past this many, whatever
# text the window has is emitted as `finish()` would, so a run of textless or invalid-byte
# tokens costs O(1) per token instead of O(run length).
MAX_HELD_BACK_TOKENS = 16


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (`tokenizers.Tokenizer` qualifies)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, token by token.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=...)`; for transformers
            tokenizers disable `clean_up_tokenization_spaces`, which rewrites earlier text.
        prompt_token_ids: the prompt, whose tail gives the first tokens their context.
        skip_special_tokens: leave special tokens out of the text.
        pieces: `TokenPieces.for_tokenizer(tokenizer)` (shared by the tokenizer's
            detokenizers), or None to decode every token.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        pieces: TokenPieces | None = None,
    ) -> None:
        self._skip_special_tokens = skip_special_tokens
        self._token_pieces = pieces
        self._piece_table = pieces.table if pieces is not None else None
        self._decode_ids = pieces.decode if pieces is not None else tokenizer.decode
        # Only ids from `prefix_offset` on are ever decoded again, so the window keeps the
        # prompt's tail and the output ids; `_window_start` is the absolute index of its
        # first element.
        prefix_offset = max(len(prompt_token_ids) - INITIAL_PREFIX_TOKENS, 0)
        self._window: list[int] = list(prompt_token_ids[prefix_offset:])
        self._window_start = prefix_offset
        self._prefix_offset = prefix_offset
        self._read_offset = len(prompt_token_ids)
        self._num_output_tokens = 0
        self._emitted: list[str] = []
        # Text of window[:read], kept while the offsets stay (held-back pushes decode it once).
        self._prefix_text: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until completed or flushed)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def num_output_tokens(self) -> int:
        """Output tokens pushed so far."""
        return self._num_output_tokens

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while held back)."""
        window = self._window
        table = self._piece_table
        if table is not None and self._read_offset - self._window_start == len(window):
            piece = table.get(token_id)
            if piece is None:
                piece = self._token_pieces.piece(token_id)  # type: ignore[union-attr]
            if piece:
                # What the decoding path computes here: prefix text + piece, emitted whole,
                # after which `_advance` keeps just this token in the window.
                start = self._read_offset
                window.clear()
                window.append(token_id)
                self._window_start = self._prefix_offset = start
                self._read_offset = start + 1
                self._prefix_text = piece  # the new prefix is this token alone
                self._num_output_tokens += 1
                self._emitted.append(piece)
                return piece
        window.append(token_id)
        self._num_output_tokens += 1
        # The window starts at the prefix offset (`_advance` keeps it so), so only the read
        # offset needs translating.
        read = self._read_offset - self._window_start
        decode, skip = self._decode_ids, self._skip_special_tokens
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = decode(window[:read], skip)
        new_text = decode(window, skip)
        if (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)) and (
            len(window) - read <= MAX_HELD_BACK_TOKENS
        ):
            return ""
        delta = new_text[len(prefix_text) :]
        self._advance()
        if delta:
            self._emitted.append(delta)
        return delta

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Add several tokens; return their combined new text."""
        return "".join(self.push(token_id) for token_id in token_ids)

    def finish(self) -> str:
        """Flush held-back text at the end of generation (an unfinished character becomes
        U+FFFD, exactly as decoding the whole sequence would show it)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, None)
        delta = new_text[len(prefix_text) :]
        self._advance()
        if delta:
            self._emitted.append(delta)
        return delta

    def _advance(self) -> None:
        self._prefix_text = None
        self._prefix_offset = self._read_offset
        self._read_offset = self._window_start + len(self._window)
        # Drop ids that will never be decoded again.
        drop = self._prefix_offset - self._window_start
        if drop > 0:
            del self._window[:drop]
            self._window_start = self._prefix_offset

    def _decode(self, start: int, end: int | None) -> str:
        begin = start - self._window_start
        stop = None if end is None else end - self._window_start
        return self._decode_ids(self._window[begin:stop], self._skip_special_tokens)
