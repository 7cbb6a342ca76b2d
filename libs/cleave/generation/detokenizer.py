"""Incremental detokenization: one token id in, the new text out.

Decoding token by token and concatenating is wrong twice over: a byte-level BPE token may
hold only part of a multi-byte UTF-8 character (decoded alone it is U+FFFD), and
SentencePiece-style decoders drop or add a leading space depending on what precedes a
token. So, as vLLM does, each step decodes a short window of ids twice — the already
emitted part `[prefix_offset, read_offset)` and the whole window `[prefix_offset, end)` —
and emits only the difference. Text that ends in U+FFFD is an unfinished character: it is
held back until a later token completes it (or `finish()` flushes it).

With byte-level (and `Fuse`) tokenizers most tokens append the same text whatever precedes them (their
`TokenPieces` piece). When nothing is held back, such a token's text is its piece and the
window state after it is known, so `push` skips both decodes: the same text and state as
the decoding path, at a dictionary lookup per token.

Held-back text is composed the same way while it can be: the window's text once known
(decoded, or composed) plus a piece is the text with that piece appended, and after a
prefix that ends in a piece (a whole character) the first held token adds its own text
(`TokenPieces.alone`). So a token that is part of a character, between pieces, costs no
decode; in a run of such tokens each one after the first decodes the window, and the
pieces after the run do not.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        # Text of the whole window when known without decoding it again, else None.
        self._window_text: str | None = None
        # Whether window[:read] ends in a piece: its bytes end in a whole character, so the
        # window's text is the prefix's text plus the held tokens' own text.
        self._prefix_ends_in_piece = False

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
                self._prefix_text = self._window_text = piece  # the new prefix is this token alone
                self._prefix_ends_in_piece = True
                self._num_output_tokens += 1
                self._emitted.append(piece)
                return piece
        window.append(token_id)
        self._num_output_tokens += 1
        # The window starts at the prefix offset (`_advance` keeps it so), so only the read
        # offset needs translating.
        read = self._read_offset - self._window_start
        new_text = self._composed_text(token_id, len(window) - read)
        prefix_text = self._prefix_text
        if new_text is None or prefix_text is None:
            decode, skip = self._decode_ids, self._skip_special_tokens
            if prefix_text is None:
                prefix_text = self._prefix_text = decode(window[:read], skip)
            if new_text is None:
                new_text = decode(window, skip)
        if (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)) and (
            len(window) - read <= MAX_HELD_BACK_TOKENS
        ):
            self._window_text = new_text
            return ""
        delta = new_text[len(prefix_text) :]
        split_cleanly = self._prefix_ends_in_piece
        self._advance()
        if split_cleanly:
            # The held tokens are the prefix (and the window) now; after a prefix that ends
            # in a whole character their text is exactly the delta.
            self._prefix_text = self._window_text = delta
            self._prefix_ends_in_piece = bool(table is not None and table.get(token_id))
        if delta:
            self._emitted.append(delta)
        return delta

    def _composed_text(self, token_id: int, num_held: int) -> str | None:
        """The window's text with `token_id` appended (the last of `num_held` held-back
        tokens) when it composes without decoding (see the module docstring), else None."""
        pieces = self._token_pieces
        if pieces is None:
            return None
        piece = pieces.piece(token_id)
        window_text = self._window_text
        if piece and window_text is not None:
            return window_text + piece  # a piece appends its text after any ids
        if num_held == 1 and self._prefix_ends_in_piece:
            alone = pieces.alone(token_id)  # after a whole character, a token adds its own text
            if alone is not None:
                return self._prefix_text + alone  # type: ignore[operator]  # set with the flag
        return None

    def push_many(self, token_ids: Sequence[int]) -> str:
        """Add several tokens; return their combined new text: `push` over each, with the
        same text and state, but a run of piece tokens taken at once (its state after it is
        that of its last token alone, see `push`)."""
        table = self._piece_table
        if table is None:
            return "".join([self.push(token_id) for token_id in token_ids])
        pieces = self._token_pieces
        parts: list[str] = []
        index, count = 0, len(token_ids)
        while index < count:
            if self._read_offset - self._window_start == len(self._window):  # nothing held back
                run: list[str] = []
                end = index
                while end < count:
                    token_id = token_ids[end]
                    piece = table.get(token_id)
                    if piece is None:
                        piece = pieces.piece(token_id)  # type: ignore[union-attr]
                    if not piece:
                        break
                    run.append(piece)
                    end += 1
                if run:
                    last = self._read_offset + len(run) - 1  # the run's last token, absolute
                    window = self._window
                    window.clear()
                    window.append(token_ids[end - 1])
                    self._window_start = self._prefix_offset = last
                    self._read_offset = last + 1
                    self._prefix_text = self._window_text = run[-1]
                    self._prefix_ends_in_piece = True
                    self._num_output_tokens += len(run)
                    text = "".join(run)
                    self._emitted.append(text)
                    parts.append(text)
                    index = end
                    continue
            parts.append(self.push(token_ids[index]))
            index += 1
        return "".join(parts)

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
        self._prefix_text = self._window_text = None
        self._prefix_ends_in_piece = False
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
