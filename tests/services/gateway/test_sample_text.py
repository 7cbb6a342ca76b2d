"""Per-sample text on the gateway: stop strings across steps, reasoning split, special tags."""

from __future__ import annotations

from cleave.engine.outputs import FinishReason
from cleave.engine.request import ReasoningConfig
from cleave.engine.sampling_params import SamplingParams
from cleave.model.tokenizer import Tokenizer
from cleave.rpc.types import ReasoningMode
from services.gateway.convert import TokenDelta
from services.gateway.sample_text import SampleText, special_tag_tokens

THINK = ReasoningConfig("<think>", "</think>", starts_in_reasoning=False)


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
