"""`TokenPieces`: the text of tokens that append the same text whatever precedes them.

A byte-level BPE decoder (GPT-2, Llama 3, Qwen) turns ids into text by concatenating each
token's bytes and decoding the whole as UTF-8, invalid bytes replaced by U+FFFD. When a
token's bytes are valid UTF-8 on their own, that decoding splits at the token:

    decode(ids + [token]) == decode(ids) + decode([token])      for every `ids`

(a valid sequence starts with a lead byte, so it never completes a character the bytes
before it left open, and those bytes decode to the same U+FFFD with or without it). Such a
token's text is its *piece*; the incremental detokenizer emits it without decoding the
window again. Tokens outside the rule get no piece: added tokens (special or not: the
tokenizer decodes them apart from the bytes around them), tokens whose bytes are an
unfinished or invalid character (their text shows U+FFFD), and tokens without text.

A `Fuse` decoder (the tokens' strings joined as they are: a character-level vocabulary such
as the built-in reasoner's) splits at every token by construction, so the same rule holds.
Other decoders (SentencePiece's leading-space rules, WordPiece's "##" merges) make a
token's text depend on its neighbours; `TokenPieces.for_tokenizer` returns None for them.

`TokenPieces.decode` is the backend tokenizer's own `decode` (the same text as the wrapper's
without its clean-up, which pieces require off), for the ids the detokenizer still decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from cleave.generation.detokenizer import REPLACEMENT_CHAR

# decoders whose text splits at a token that is valid text alone (the module docstring)
_SPLITTING_DECODERS = (decoders.ByteLevel, decoders.Fuse)


class TokenPieces:
    """Pieces of one tokenizer's tokens, looked up once per token id and kept.

    Args:
        decode: `decode(ids, skip_special_tokens)` of a tokenizer with a byte-level or `Fuse` decoder
            and no clean-up (see the module docstring; `for_tokenizer` checks).
        added_token_ids: ids of the tokenizer's added tokens (never given a piece).

    `piece(token_id)` is the token's text, or "" when the token has no piece;
    `alone(token_id)` its text decoded on its own, or None for an added token. The tables
    grow to at most the vocabulary size.
    """

    def __init__(self, decode: Callable[[list[int], bool], str], added_token_ids: frozenset[int]) -> None:
        self.decode = decode
        self._added_token_ids = added_token_ids
        self.table: dict[int, str] = {}  # token id -> piece ("" for none); read by the detokenizer
        self._alone: dict[int, str | None] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TokenPieces | None:
        """Pieces for a `cleave.model.tokenizer.Tokenizer` or a `tokenizers.Tokenizer` with
        a byte-level or `Fuse` decoder and no text clean-up; None for any other tokenizer."""
        backend = getattr(tokenizer, "backend", tokenizer)
        if not isinstance(backend, BackendTokenizer) or not isinstance(backend.decoder, _SPLITTING_DECODERS):
            return None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None  # a text rewrite across token boundaries
        return cls(backend.decode, frozenset(backend.get_added_tokens_decoder()))

    def piece(self, token_id: int) -> str:
        """The token's text when it appends the same text after any ids, else ""."""
        piece = self.table.get(token_id)
        if piece is None:
            piece = self.table[token_id] = self._lookup(token_id)
        return piece

    def alone(self, token_id: int) -> str | None:
        """`decode([token_id])` for a token that is not an added token (None for one).

        After ids whose bytes end in a whole character, such a token adds exactly this text
        (U+FFFD for a partial character), whatever came before.
        """
        try:
            return self._alone[token_id]
        except KeyError:
            text = None if token_id in self._added_token_ids or token_id < 0 else self.decode([token_id], False)
            self._alone[token_id] = text
            return text

    def _lookup(self, token_id: int) -> str:
        if token_id in self._added_token_ids or token_id < 0:
            return ""
        text = self.decode([token_id], False)
        return "" if REPLACEMENT_CHAR in text else text
