"""StopChecker at its boundaries: the token that meets min_tokens, the token that meets
max_tokens, and the detokenizer's held-back bytes when eos or length ends the sample."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from cleave.generation.detokenizer import IncrementalDetokenizer
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.stop import StopChecker, StopUpdate
from tests.generation.byte_level import byte_level_bpe
from tests.generation.test_stop import PieceTokenizer

EOS = 9
END_OF_TEXT = "<|endoftext|>"
CRAB = "🦀"  # four UTF-8 bytes, one token each under a byte-level BPE that never merged them


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """A GPT-2-style byte-level BPE trained on ASCII only, so a 4-byte character is 4 tokens."""
    return byte_level_bpe(["plain ascii text"] * 10, 300, [END_OF_TEXT])


def _process(checker: StopChecker, detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[StopUpdate]:
    """`process` each token the way the engine does, up to the update that ends the sample."""
    updates = []
    for token_id in token_ids:
        updates.append(checker.process(token_id, detokenizer))
        if updates[-1].finished:
            break
    return updates


# ---- min_tokens: a stop id ends the sample only once min_tokens tokens came before it --------


def test_eos_as_the_min_tokens_th_token_does_not_end_the_sample():
    checker = StopChecker(SamplingParams(min_tokens=2, max_tokens=None), eos_token_ids=[EOS])
    assert checker.check_token(1) is None
    assert checker.check_token(EOS) is None  # token 2 of at least 2: generation goes on


def test_eos_right_after_min_tokens_tokens_is_a_stop():
    checker = StopChecker(SamplingParams(min_tokens=2, max_tokens=None), eos_token_ids=[EOS])
    assert checker.check_token(1) is None
    assert checker.check_token(2) is None
    stop = checker.check_token(EOS)
    assert stop is not None
    assert (stop.finish_reason, stop.stop_reason, stop.include_token_text) == (FinishReason.STOP, None, False)


def test_a_stop_token_id_as_the_min_tokens_th_token_does_not_end_the_sample():
    checker = StopChecker(SamplingParams(stop_token_ids=[7], min_tokens=2, max_tokens=None))
    assert checker.check_token(1) is None
    assert checker.check_token(7) is None
    assert checker.check_token(7).stop_reason == 7  # token 3: past the minimum


# ---- the detokenizer's held-back bytes are flushed when the sample ends -----------------------


def test_an_unfinished_character_is_flushed_when_max_tokens_ends_the_sample(byte_level):
    crab_ids = byte_level.encode(CRAB).ids
    assert len(crab_ids) == 4
    checker = StopChecker(SamplingParams(max_tokens=1))
    detokenizer = IncrementalDetokenizer(byte_level, [])
    (update,) = _process(checker, detokenizer, crab_ids)
    # The first byte alone is held back by `push`; the end of the sample flushes it as U+FFFD.
    assert update.text == byte_level.decode(crab_ids[:1]) == "\ufffd"
    assert (update.finish_reason, update.stop_reason) == (FinishReason.LENGTH, None)
    assert checker.text == detokenizer.text == "\ufffd"


def test_an_unfinished_character_is_flushed_when_eos_ends_the_sample(byte_level):
    crab_ids = byte_level.encode(CRAB).ids
    eos = byte_level.token_to_id(END_OF_TEXT)
    prompt_ids = byte_level.encode("plain text ").ids
    checker = StopChecker(SamplingParams(max_tokens=None), eos_token_ids=[eos])
    detokenizer = IncrementalDetokenizer(byte_level, prompt_ids)
    updates = _process(checker, detokenizer, byte_level.encode("ascii").ids + crab_ids[:2] + [eos])
    held = byte_level.decode(crab_ids[:2])
    assert held.endswith("\ufffd")
    assert [update.text for update in updates[-3:]] == ["", "", held]  # two bytes held, then flushed
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == (FinishReason.STOP, None)
    assert checker.text == "ascii" + held


# ---- a stop string completed by the last token max_tokens allows is a stop, not length --------


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop_not_length():
    tokenizer = PieceTokenizer(["x", "a", "b", "c"])
    checker = StopChecker(SamplingParams(stop=["ab"], max_tokens=3))
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    updates = _process(checker, detokenizer, [0, 1, 2])
    assert [update.text for update in updates] == ["x", "", ""]  # "a" held back, then cut
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == (FinishReason.STOP, "ab")
    assert checker.text == "x"


# ---- a final text before min_tokens still ends the sample -------------------------------------


def test_text_after_a_final_append_before_min_tokens_is_not_emitted():
    checker = StopChecker(SamplingParams(stop=["b"], min_tokens=3))
    assert checker.check_token(1) is None
    final = checker.append_text("ab", final=True)  # too short for stop strings: all of it is output
    assert (final.text, final.finish_reason) == ("ab", None)
    later = checker.append_text("more")
    assert (later.text, later.finish_reason) == ("", None)
    assert checker.text == "ab"


def test_a_context_window_shorter_than_min_tokens_ends_the_sample_by_length():
    tokenizer = PieceTokenizer(["x", "y"])
    checker = StopChecker(SamplingParams(min_tokens=3, max_tokens=None), max_new_tokens=1)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    update = checker.process(0, detokenizer)
    assert (update.text, update.finish_reason) == ("x", FinishReason.LENGTH)
    assert checker.process(1, detokenizer).text == ""  # the sample is over: nothing more is output
    assert checker.text == "x"
