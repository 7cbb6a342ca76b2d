"""Per-sample text on the gateway: stop strings across steps, reasoning split, special tags."""

from __future__ import annotations

import pytest

from cleave.generation.detokenizer import REPLACEMENT_CHAR
from cleave.generation.outputs import FinishReason
from cleave.generation.reasoning import ReasoningConfig
from cleave.generation.reasoning_formats import special_tag_tokens
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.token_pieces import TokenPieces
from cleave.model.tokenizer import Tokenizer
from cleave.rpc.types import ReasoningMode
from services.gateway.convert import TokenDelta
from services.gateway.model import ServedModel
from services.gateway.sample_text import SampleText

THINK = ReasoningConfig("<think>", "</think>", starts_in_reasoning=False)
# Characters of 2, 3 and 4 UTF-8 bytes that the tiny ASCII-trained BPE splits into byte tokens.
MULTI_BYTE = "café naïve 日本語 🙂 über — ok"


def _tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def _run(text: SampleText, ids: list[int], step: int = 2, finish: FinishReason = FinishReason.LENGTH):
    outputs = []
    for start in range(0, len(ids), step):
        last = start + step >= len(ids)
        out = text.push(TokenDelta(0, tuple(ids[start:start + step]), finish if last else None))
        if out is not None:
            outputs.append(out)
    return outputs


def test_stop_string_split_across_steps_is_never_shown(model_dir):
    tokenizer = _tokenizer(model_dir)
    ids = tokenizer.encode("The sea is wide and deep and blue", add_special_tokens=False)
    text = SampleText(0, tokenizer, [1], SamplingParams(stop=["deep"]), (), None, ReasoningMode.INLINE)
    outputs = _run(text, ids, step=1)
    shown = "".join(o.text for o in outputs)
    assert shown == "The sea is wide and "
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert text.finished and text.push(TokenDelta(0, (5,))) is None


def test_reasoning_is_split_and_counted(model_dir):
    tokenizer = _tokenizer(model_dir)
    ids = tokenizer.encode("<think>two plus two</think> four", add_special_tokens=False)
    text = SampleText(0, tokenizer, [1], SamplingParams(), (), THINK, ReasoningMode.SEPARATE)
    outputs = _run(text, ids)
    assert "".join(o.reasoning_text for o in outputs) == "two plus two"
    assert "".join(o.text for o in outputs) == " four"
    end_at = ids.index(tokenizer.encode("</think>", add_special_tokens=False)[0])
    assert text.num_reasoning_tokens == end_at + 1
    assert text.answer_text == " four"


def test_special_think_tokens_still_split(model_dir):
    from cleave.engine.llm import default_model_path

    path = default_model_path()
    if path is None:
        return
    tokenizer = Tokenizer.from_pretrained(path)
    tags = special_tag_tokens(tokenizer, THINK)
    ids = tokenizer.encode("<think>12+34</think> The answer is 46.", add_special_tokens=False)
    if not tags:
        assert tokenizer.decode(ids, skip_special_tokens=True).startswith("<think>")
        return
    text = SampleText(0, tokenizer, [1], SamplingParams(), (), THINK, ReasoningMode.SEPARATE, tag_tokens=tags)
    outputs = _run(text, ids)
    assert "".join(o.reasoning_text for o in outputs) == "12+34"
    assert "".join(o.text for o in outputs) == " The answer is 46."


def test_served_model_shares_byte_level_pieces(model_dir):
    from cleave.config import ModelConfig as ServedModelConfig

    model = ServedModel(ServedModelConfig(source=str(model_dir), served_name="tiny"))
    assert isinstance(model.token_pieces, TokenPieces)


@pytest.mark.parametrize("step", [1, 3])
def test_pieces_stream_the_same_text_as_decoding_every_token(model_dir, step):
    """Multi-byte characters split over byte tokens: with the piece table the streamed
    outputs are the decoding path's, step for step, and join to the whole sequence's decode."""
    tokenizer = _tokenizer(model_dir)
    pieces = TokenPieces.for_tokenizer(tokenizer)
    assert pieces is not None
    ids = tokenizer.encode(f"The sea {MULTI_BYTE} is </s> blue {MULTI_BYTE}", add_special_tokens=False)
    assert sum(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids) >= 8  # partial byte tokens
    prompt = tokenizer.encode("Hello 日", add_special_tokens=False)  # ends inside a character
    params = SamplingParams(max_tokens=None)

    def stream(with_pieces: TokenPieces | None) -> list[tuple[str, str]]:
        text = SampleText(0, tokenizer, prompt, params, (), None, ReasoningMode.INLINE, pieces=with_pieces)
        return [(o.text, o.reasoning_text) for o in _run(text, ids, step=step)]

    fast, decoded = stream(pieces), stream(None)
    assert fast == decoded
    assert "".join(t for t, _ in fast) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(t for t, _ in fast).count(MULTI_BYTE) == 2
    assert sum(1 for piece in pieces.table.values() if piece) >= 10  # the fast path ran


def test_pieces_keep_reasoning_split_with_multi_byte_text(model_dir):
    tokenizer = _tokenizer(model_dir)
    pieces = TokenPieces.for_tokenizer(tokenizer)
    ids = tokenizer.encode(f"<think>{MULTI_BYTE}</think> {MULTI_BYTE}", add_special_tokens=False)
    text = SampleText(0, tokenizer, [1], SamplingParams(max_tokens=None), (), THINK, ReasoningMode.SEPARATE,
                      pieces=pieces)
    outputs = _run(text, ids, step=2)
    assert "".join(o.reasoning_text for o in outputs) == MULTI_BYTE
    assert "".join(o.text for o in outputs) == f" {MULTI_BYTE}"
