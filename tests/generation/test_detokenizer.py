"""IncrementalDetokenizer against full decode, on tokenizers built here from small corpora:
a GPT-2-style byte-level BPE and a Llama-style SentencePiece BPE with byte fallback."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cleave.config import SHIPPED_MODEL_DIR
from cleave.generation.detokenizer import IncrementalDetokenizer
from cleave.generation.token_pieces import TokenPieces
from cleave.model.tokenizer import Tokenizer as CleaveTokenizer
from tests.generation.byte_level import byte_level_bpe

CORPUS = [
    "Hello world, this is a small corpus for a tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "数学很有趣。我们来思考这个问题：二加二等于四。",
    "日本語のテキストも少し入れておきます。",
    "Emoji time 🎉🎉 🚀 👩‍💻 ❤️ and accents: café, naïve, Zürich.",
    "<think>Let me reason step by step.</think> The answer is 42.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>"]
TEXTS = [
    "世界 🎉 fox",
    " 数学很有趣！👩‍💻 café",
    "\n\n二加二等于四。 Done 🚀🦀",
    "The answer is: 🤔🤯 (a, b) = 中文",
]


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return byte_level_bpe(CORPUS * 10, 700, SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def llama_like() -> Tokenizer:
    """Metaspace BPE on ASCII text; every other character falls back to <0xXX> byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS[:2] * 10, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


def _stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(token_id) for token_id in output_ids]
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return deltas


def _expected(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def _pieces_against_decoding(tokenizer, pieces, prompt_ids, output_ids, skip_special_tokens) -> tuple[str, int]:
    """`output_ids` streamed on the pieces path and on the decoding path side by side, the same
    delta asserted at every token and the same finish: the text, and how many tokens took the
    pieces path."""
    decoding = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    fast = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, pieces)
    num_fast = 0
    for token_id in output_ids:
        num_fast += fast._read_offset == fast._window_start + len(fast._window) and bool(pieces.piece(token_id))
        assert fast.push(token_id) == decoding.push(token_id)
    assert fast.finish() == decoding.finish()
    assert fast.text == decoding.text
    return fast.text, num_fast


@pytest.mark.parametrize("tokenizer_name", ["byte_level", "llama_like"])
@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_without_replacement_chars(request, tokenizer_name, text):
    tokenizer = request.getfixturevalue(tokenizer_name)
    prompt_ids = tokenizer.encode("Hello world, think:").ids
    output_ids = tokenizer.encode(text).ids
    split = [tokenizer.decode([t]) for t in output_ids]
    assert any("\ufffd" in piece for piece in split), "fixture must split a character"
    deltas = _stream(tokenizer, prompt_ids, output_ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == _expected(tokenizer, prompt_ids, output_ids)
    assert "".join(deltas).strip() == text.strip()


def test_split_character_is_held_back_until_complete(llama_like):
    ids = llama_like.encode("中").ids  # three <0xXX> byte tokens (after a leading ▁)
    byte_ids = [i for i in ids if llama_like.id_to_token(i).startswith("<0x")]
    assert len(byte_ids) == 3
    detok = IncrementalDetokenizer(llama_like, llama_like.encode("Hello").ids)
    assert [detok.push(t) for t in byte_ids] == ["", "", "中"]


def test_leading_space_of_first_output_token_is_kept(llama_like):
    prompt_ids = llama_like.encode("Hello").ids
    words = sorted(t for t in llama_like.get_vocab() if t.startswith("▁") and t[1:].isalpha())
    output_ids = [llama_like.token_to_id(words[0]), llama_like.token_to_id(words[1])]
    alone = llama_like.decode(output_ids)
    assert alone == words[0][1:] + " " + words[1][1:]  # decoded alone, the first space is stripped
    deltas = _stream(llama_like, prompt_ids, output_ids)
    assert deltas[0] == " " + words[0][1:]
    assert "".join(deltas) == " " + alone


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_byte_level_streams_match_full_decode(byte_level, skip_special_tokens):
    rng = random.Random(0)
    vocab_size = byte_level.get_vocab_size()
    for _ in range(15):
        prompt_ids = byte_level.encode(rng.choice(CORPUS)).ids
        output_ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 120))]
        expected = _expected(byte_level, prompt_ids, output_ids, skip_special_tokens)
        detok = IncrementalDetokenizer(byte_level, prompt_ids, skip_special_tokens)
        for token_id in output_ids:
            detok.push(token_id)
            assert expected.startswith(detok.text)  # never emits text it must take back
        detok.finish()
        assert detok.text == expected


def test_random_sentencepiece_streams_match_full_decode(llama_like):
    rng = random.Random(1)
    pieces = [i for i in range(llama_like.get_vocab_size()) if not llama_like.id_to_token(i).startswith("<")]
    for _ in range(15):
        prompt_ids = llama_like.encode(rng.choice(CORPUS[:2])).ids
        output_ids = [rng.choice(pieces) for _ in range(rng.randrange(1, 80))]
        deltas = _stream(llama_like, prompt_ids, output_ids)
        assert "".join(deltas) == _expected(llama_like, prompt_ids, output_ids)


def test_empty_prompt_and_unfinished_character_flush(byte_level):
    ids = byte_level.encode("🦀").ids
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(byte_level, [])
    assert detok.push_many(ids[:-1]) == ""
    assert detok.finish() == byte_level.decode(ids[:-1])
    assert detok.text.endswith("\ufffd") and detok.num_output_tokens == len(ids) - 1


def test_textless_tokens_keep_the_window_bounded(byte_level):
    special = byte_level.token_to_id("<|endoftext|>")
    prompt_ids = byte_level.encode("Hello world").ids
    output_ids = [special] * 200 + byte_level.encode(" fox jumps").ids
    detok = IncrementalDetokenizer(byte_level, prompt_ids, skip_special_tokens=True)
    pieces, widest = [], 0
    for token_id in output_ids:
        pieces.append(detok.push(token_id))
        widest = max(widest, len(detok._window))
    pieces.append(detok.finish())
    assert "".join(pieces) == " fox jumps"
    assert widest <= 2 * 16 + 2


# ---- TokenPieces: the decode-free path for byte-level and Fuse tokenizers -------------------


def test_token_pieces_only_for_byte_level_decoders_without_clean_up(byte_level, llama_like):
    assert TokenPieces.for_tokenizer(byte_level) is not None
    assert TokenPieces.for_tokenizer(CleaveTokenizer(byte_level, {})) is not None
    assert TokenPieces.for_tokenizer(llama_like) is None  # leading-space rules: context matters
    assert TokenPieces.for_tokenizer(CleaveTokenizer(byte_level, {}, clean_up_tokenization_spaces=True)) is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_fuse_decoders_pieces_stream_as_decoding_does(skip_special_tokens):
    """The built-in reasoner's character vocabulary (a `Fuse` decoder) gets pieces, and random
    ids (its added tokens among them) stream the same deltas and text on the pieces path as on
    the decoding one, and as the tokenizers library decodes the whole."""
    shipped = CleaveTokenizer.from_pretrained(SHIPPED_MODEL_DIR)
    pieces = TokenPieces.for_tokenizer(shipped)
    assert pieces is not None
    rng = random.Random(3)
    vocab_size = shipped.vocab_size
    num_fast = 0
    for _ in range(10):
        prompt_ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))]
        output_ids = [rng.randrange(vocab_size) for _ in range(80)]
        text, fast = _pieces_against_decoding(shipped, pieces, prompt_ids, output_ids, skip_special_tokens)
        assert text == _expected(shipped.backend, prompt_ids, output_ids, skip_special_tokens)
        num_fast += fast
    assert num_fast > 500  # most tokens took the pieces path


def test_token_pieces_exclude_added_and_partial_character_tokens(byte_level):
    pieces = TokenPieces.for_tokenizer(byte_level)
    assert pieces.piece(byte_level.token_to_id("<|endoftext|>")) == ""
    fox = byte_level.encode(" fox").ids
    assert len(fox) == 1 and pieces.piece(fox[0]) == " fox"
    crab = byte_level.encode("🦀").ids  # four bytes, no merge: each token is part of a character
    assert len(crab) >= 2 and all(pieces.piece(token_id) == "" for token_id in crab)
    assert pieces.table[fox[0]] == " fox"  # looked up once, then kept


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_pieces_path_matches_the_decoding_path(byte_level, skip_special_tokens):
    """Same deltas, text and finish as decoding every window, on random ids: specials,
    partial characters, held-back runs and plain pieces interleaved."""
    rng = random.Random(2)
    pieces = TokenPieces.for_tokenizer(byte_level)
    vocab_size = byte_level.get_vocab_size()
    plain = [i for i in range(vocab_size) if pieces.piece(i)]
    num_fast = 0
    for _ in range(20):
        prompt_ids = byte_level.encode(rng.choice(CORPUS)).ids
        output_ids = [rng.choice(plain) if rng.random() < 0.6 else rng.randrange(vocab_size) for _ in range(150)]
        text, fast = _pieces_against_decoding(byte_level, pieces, prompt_ids, output_ids, skip_special_tokens)
        assert text == _expected(byte_level, prompt_ids, output_ids, skip_special_tokens)
        num_fast += fast
    assert num_fast > 1000  # the pieces path ran (most tokens), not only the decoding one


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_partial_characters_between_pieces_compose_without_decoding(byte_level, skip_special_tokens):
    """Tokens that are part of a character, each between pieces (or after one more piece),
    take the composed path: the same deltas as decoding every window, and no window decoded
    once each token's own text is known."""
    rng = random.Random(3)
    pieces = TokenPieces.for_tokenizer(byte_level)
    vocab_size = byte_level.get_vocab_size()
    added = set(byte_level.get_added_tokens_decoder())
    plain = [i for i in range(vocab_size) if pieces.piece(i)]
    partial = [i for i in range(vocab_size) if not pieces.piece(i) and i not in added]
    assert partial and all("\ufffd" in byte_level.decode([i]) for i in partial)
    for token_id in partial:
        pieces.alone(token_id)  # each token's own text, looked up once and kept
    decode = pieces.decode
    window_decodes: list[list[int]] = []
    pieces.decode = lambda ids, skip: window_decodes.append(ids) or decode(ids, skip)  # type: ignore[method-assign]
    for _ in range(20):
        prompt_ids = byte_level.encode(rng.choice(CORPUS)).ids
        output_ids = [rng.choice(plain)]
        for _ in range(60):
            output_ids += [rng.choice(partial)] + [rng.choice(plain) for _ in range(rng.randint(1, 2))]
        decoding = IncrementalDetokenizer(byte_level, prompt_ids, skip_special_tokens)
        fast = IncrementalDetokenizer(byte_level, prompt_ids, skip_special_tokens, pieces)
        assert [fast.push(t) for t in output_ids] == [decoding.push(t) for t in output_ids]
        assert fast.finish() == decoding.finish()
        assert fast.text == decoding.text == _expected(byte_level, prompt_ids, output_ids, skip_special_tokens)
    # only `finish` decodes (one window and its prefix per stream)
    assert len(window_decodes) <= 2 * 20


def _state(detok: IncrementalDetokenizer) -> tuple:
    return (list(detok._window), detok._window_start, detok._prefix_offset, detok._read_offset,
            detok._num_output_tokens, detok._prefix_text, detok._window_text, detok._prefix_ends_in_piece)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_push_many_in_runs_matches_pushing_one_at_a_time(byte_level, llama_like, skip_special_tokens):
    """Random chunks of random ids (pieces, specials, partial characters): push_many gives
    the text of the chunk's pushes, leaves the same state behind, and the streams end alike."""
    rng = random.Random(4)
    for tokenizer in (byte_level, llama_like):
        pieces = TokenPieces.for_tokenizer(tokenizer)
        vocab_size = tokenizer.get_vocab_size()
        plain = [i for i in range(vocab_size) if pieces is not None and pieces.piece(i)] or list(range(vocab_size))
        for _ in range(12):
            prompt_ids = tokenizer.encode(rng.choice(CORPUS)).ids
            output_ids = [rng.choice(plain) if rng.random() < 0.7 else rng.randrange(vocab_size) for _ in range(120)]
            one = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, pieces)
            many = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, pieces)
            start = 0
            while start < len(output_ids):
                chunk = output_ids[start : start + rng.randint(1, 20)]
                assert many.push_many(chunk) == "".join(one.push(token_id) for token_id in chunk)
                assert _state(many) == _state(one)
                start += len(chunk)
            assert many.finish() == one.finish() and many.text == one.text
