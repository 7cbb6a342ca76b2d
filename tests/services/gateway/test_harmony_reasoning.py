"""gpt-oss's harmony channels on the gateway: analysis is reasoning, final is content.

The tokenizer is the tiny checkpoint's with harmony's markers added as special tokens, as in
gpt-oss's own; its directory names `GptOssForCausalLM` and has no `cleave_config.json`, so
the gateway picks the `gpt_oss` format itself. Token ids are fed to `SampleText` one step at a
time (the decode worker's stream), so tags arrive split over tokens and steps.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from cleave.config import ModelConfig as ServedModelConfig
from cleave.engine.reasoning_tokens import ReasoningTokenCounter
from cleave.engine.request_builder import RequestBuilder
from cleave.engine.sampler import Sampler
from cleave.engine.sampling_tensors import SamplingTensors
from cleave.engine.thinking_budget import ThinkingBudget
from cleave.generation.outputs import FinishReason
from cleave.generation.reasoning import Phase
from cleave.generation.reasoning_formats import FORMATS, special_tag_tokens
from cleave.generation.sampling_params import SamplingParams
from cleave.rpc.types import ReasoningMode
from services.gateway.convert import TokenDelta
from services.gateway.model import ServedModel
from services.gateway.sample_text import SampleText

HARMONY = FORMATS["gpt_oss"]
TAG_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
OTHER_MARKERS = ("<|return|>", "<|constrain|>", "<|call|>")
THINKING = "The sky is blue because air scatters blue light."
ANSWER = " Because air scatters blue light more than red light."


@pytest.fixture(scope="module")
def harmony_dir(model_dir, tmp_path_factory):
    """The tiny checkpoint's files with harmony's special tokens, as a gpt-oss checkpoint."""
    directory = tmp_path_factory.mktemp("harmony")
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, directory / name)
    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in TAG_MARKERS + OTHER_MARKERS])
    backend.save(str(directory / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["GptOssForCausalLM"]}))
    assert not (directory / "cleave_config.json").exists()
    return directory


@pytest.fixture(scope="module")
def served(harmony_dir) -> ServedModel:
    return ServedModel(ServedModelConfig(source=str(harmony_dir), served_name="tiny-oss"))


def _ids(served: ServedModel, text: str) -> list[int]:
    return served.tokenizer.encode(text, add_special_tokens=False)


def _marker(served: ServedModel, marker: str) -> int:
    (token_id,) = _ids(served, marker)
    return token_id


def _sample_text(served: ServedModel, params: SamplingParams = SamplingParams(max_tokens=None),
                 tag_tokens: dict[int, str] | None = None) -> SampleText:
    return SampleText(0, served.tokenizer, [1], params, {_marker(served, "<|return|>")}, served.reasoning,
                      ReasoningMode.SEPARATE, tag_tokens=tag_tokens)


def _stream(text: SampleText, ids: list[int], step: int) -> tuple[str, str, FinishReason | None]:
    reasoning, content, finish = "", "", None
    for start in range(0, len(ids), step):
        out = text.push(TokenDelta(0, tuple(ids[start:start + step]), None))
        if out is not None:
            reasoning, content, finish = reasoning + out.reasoning_text, content + out.text, out.finish_reason
    return reasoning, content, finish


def _counted_by_ids(served: ServedModel, ids: list[int]) -> int:
    """The decode worker's count: by token ids, without text."""
    def is_blank(token_id: int) -> bool:
        return not served.tokenizer.decode([token_id], skip_special_tokens=True).strip()

    counter = ReasoningTokenCounter(_ids(served, HARMONY.start_tag), _ids(served, HARMONY.end_tag), is_blank=is_blank)
    for token_id in ids:
        counter.feed(token_id)
    return counter.num_reasoning_tokens


def test_the_checkpoint_selects_harmony_and_its_markers_are_special_tokens(served, harmony_dir):
    assert served.reasoning == HARMONY and served.is_reasoning_model
    tokenizer = served.tokenizer
    for marker in TAG_MARKERS + OTHER_MARKERS:
        assert len(_ids(served, marker)) == 1 and tokenizer.decode(_ids(served, marker), skip_special_tokens=True) == ""
    # every special token of the tags gets its text back, and only those
    assert special_tag_tokens(tokenizer, served.reasoning) == {_marker(served, m): m for m in TAG_MARKERS}
    off = ServedModel(ServedModelConfig(source=str(harmony_dir), reasoning_parser="none"))
    assert off.reasoning is None and special_tag_tokens(off.tokenizer, off.reasoning) == {}


@pytest.mark.parametrize("step", [1, 2, 5])
def test_analysis_streams_as_reasoning_and_final_as_content(served, step):
    answer_with_constraint = ANSWER.replace(" more", "<|constrain|> more")  # a special token outside the tags
    ids = _ids(served, HARMONY.start_tag + THINKING + HARMONY.end_tag + answer_with_constraint + "<|return|>")
    assert len(_ids(served, HARMONY.end_tag)) > 5  # the end tag spans tokens of both kinds
    text = _sample_text(served, tag_tokens=special_tag_tokens(served.tokenizer, served.reasoning))
    assert _stream(text, ids, step) == (THINKING, ANSWER, FinishReason.STOP)
    end_tag_ids = _ids(served, HARMONY.end_tag)
    end_at = next(i for i in range(len(ids)) if ids[i : i + len(end_tag_ids)] == end_tag_ids) + len(end_tag_ids)
    assert text.num_reasoning_tokens == end_at == _counted_by_ids(served, ids)
    assert text.reasoning_phase is Phase.ANSWER


@pytest.mark.parametrize("channel", ["analysis", "commentary"])
def test_a_second_thinking_message_joins_the_reasoning(served, channel):
    """A further analysis message, or a commentary preamble, before the final one: the
    reasoning goes on after a newline, without the markers between the messages."""
    more = " Red light scatters less."
    separator = f"<|end|><|start|>assistant<|channel|>{channel}<|message|>"
    ids = _ids(served, HARMONY.start_tag + THINKING + separator + more + HARMONY.end_tag + ANSWER + "<|return|>")
    text = _sample_text(served, tag_tokens=special_tag_tokens(served.tokenizer, served.reasoning))
    assert _stream(text, ids, 1) == (THINKING + "\n" + more, ANSWER, FinishReason.STOP)


def test_a_final_channel_without_analysis_is_all_content(served):
    ids = _ids(served, "<|channel|>final<|message|>" + ANSWER + "<|return|>")
    text = _sample_text(served, tag_tokens=special_tag_tokens(served.tokenizer, served.reasoning))
    assert _stream(text, ids, 1) == ("", ANSWER, FinishReason.STOP)
    assert text.num_reasoning_tokens == 0 == _counted_by_ids(served, ids)


def test_without_the_markers_text_put_back_nothing_splits(served):
    ids = _ids(served, HARMONY.start_tag + THINKING + HARMONY.end_tag + ANSWER + "<|return|>")
    reasoning, content, _ = _stream(_sample_text(served), ids, 1)
    assert reasoning == "" and content == "analysis" + THINKING + "assistantfinal" + ANSWER


def test_kept_special_tokens_are_not_put_back_twice(served):
    ids = _ids(served, HARMONY.start_tag + THINKING + HARMONY.end_tag + ANSWER + "<|return|>")
    text = _sample_text(served, SamplingParams(max_tokens=None, skip_special_tokens=False),
                        special_tag_tokens(served.tokenizer, served.reasoning))
    assert _stream(text, ids, 3) == (THINKING, ANSWER, FinishReason.STOP)


def test_a_thinking_budget_forces_the_whole_harmony_end_and_the_gateway_splits_it(served):
    """The decode worker's budget cuts the analysis after 3 tokens by forcing every token of
    `<|end|><|start|>assistant<|channel|>final<|message|>`; the gateway then reads the rest as
    the answer."""
    start_ids, end_ids = _ids(served, HARMONY.start_tag), _ids(served, HARMONY.end_tag)
    thinking_ids, answer_ids = _ids(served, THINKING), _ids(served, ANSWER)
    # the toy model never ends its analysis: it prefers thinking tokens where the tag is forced
    preferred = start_ids + thinking_ids[: 3 + len(end_ids)] + answer_ids
    budget = ThinkingBudget(end_ids, max_thinking_tokens=3, start_token_ids=start_ids, starts_in_reasoning=False)
    output = _greedy(budget, preferred, vocab_size=served.tokenizer.vocab_size)
    assert output == start_ids + thinking_ids[:3] + end_ids + answer_ids
    text = _sample_text(served, tag_tokens=special_tag_tokens(served.tokenizer, served.reasoning))
    reasoning, content, _ = _stream(text, output, 1)
    assert reasoning == served.tokenizer.decode(thinking_ids[:3]) and content == ANSWER
    assert text.num_reasoning_tokens == len(start_ids) + 3 + len(end_ids) == _counted_by_ids(served, output)


@pytest.mark.parametrize("stop", [[], ["zzz"]])  # deferred text, and text made per token for stop strings
def test_the_engine_splits_harmony_channels_too(served, stop):
    """In-process generation (`LLM.generate`, `cleave generate`) puts the skipped markers
    back for its parser as the gateway does: analysis is reasoning, final is the text."""
    builder = RequestBuilder(served.tokenizer, served.tokenizer.vocab_size, served.reasoning, frozenset(), 256, 4,
                             detokenize=True)
    (sample,) = builder.build("r", [1, 2, 3], SamplingParams(max_tokens=200, stop=stop)).samples
    output = _ids(served, HARMONY.start_tag + THINKING + HARMONY.end_tag + ANSWER)
    for token_id in output:
        assert sample.process_token(token_id) is None
    sample.flush_text()
    assert "".join(sample.reasoning_text) == THINKING and "".join(sample.text) == ANSWER
    assert sample.num_reasoning_tokens == _counted_by_ids(served, output)
    kept = builder.build("k", [1, 2, 3], SamplingParams(max_tokens=200, stop=stop, skip_special_tokens=False))
    assert kept.samples[0].tag_tokens == {}  # the detokenizer writes the markers itself


def test_min_thinking_keeps_the_analysis_open_without_a_begun_end_marker(served):
    """Harmony's end sequence opens with `<|end|>`, a special token: an engine's budget
    forbids that token (not the tag's last, `<|message|>`) until min_thinking_tokens, so the
    model cannot leave a begun end sequence in its analysis."""
    builder = RequestBuilder(served.tokenizer, served.tokenizer.vocab_size, served.reasoning, frozenset(), 256, 4,
                             detokenize=False)
    params = SamplingParams(max_tokens=32, min_thinking_tokens=4)
    (budget,) = builder.build("r", [1, 2, 3], params).samples[0].logits_processors
    start_ids, end_ids = _ids(served, HARMONY.start_tag), _ids(served, HARMONY.end_tag)
    thinking_ids = _ids(served, THINKING)
    fallback = thinking_ids[5]  # the toy model's second choice everywhere
    # it wants to end its analysis right away, and again after two more tokens
    preferred = start_ids + end_ids[:1] + thinking_ids[:2] + end_ids[:1] + end_ids + thinking_ids[:2]
    output = _greedy(budget, preferred, vocab_size=served.tokenizer.vocab_size, fallback=fallback)
    assert output == start_ids + [fallback] + thinking_ids[:2] + [fallback] + end_ids + thinking_ids[:2]
    # four thinking tokens before the third try; the end sequence's own tokens but its last count too
    assert budget.phase is Phase.ANSWER and budget.num_thinking_tokens == 4 + len(end_ids) - 1


def _greedy(budget: ThinkingBudget, preferred: list[int], vocab_size: int, fallback: int | None = None) -> list[int]:
    """Greedy decoding through the sampler where the toy model prefers `preferred[step]`,
    then `fallback`."""
    sampler, output = Sampler(), []
    for token_id in preferred:
        logits = torch.zeros(1, vocab_size)
        if fallback is not None:
            logits[0, fallback] = 0.5
        logits[0, token_id] = 1.0
        state = SamplingTensors.from_params([SamplingParams(temperature=0.0)], vocab_size=vocab_size, device="cpu",
                                            output_token_ids=[output], logits_processors=[[budget]])
        output = output + sampler.sample(logits, state).token_ids.tolist()
    return output
