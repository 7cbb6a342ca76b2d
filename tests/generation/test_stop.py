"""StopChecker: stop strings across tokens, hold-back while streaming, token stops."""

from __future__ import annotations

import random

import pytest

from cleave.generation.detokenizer import IncrementalDetokenizer
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.stop import StopChecker


class PieceTokenizer:
    """Token i decodes to PIECES[i]; tokens listed in `special` vanish when skipped."""

    def __init__(self, pieces: list[str], special: set[int] = frozenset()) -> None:
        self.pieces = pieces
        self.special = special

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))


def _feed(checker: StopChecker, chunks: list[str]):
    deltas = []
    for chunk in chunks:
        update = checker.append_text(chunk)
        deltas.append(update.text)
        if update.finished:
            return deltas, update
    return deltas, None


def test_stop_string_spanning_tokens_is_cut_and_never_streamed():
    checker = StopChecker(SamplingParams(stop=["o wo"]))
    deltas, update = _feed(checker, ["Hel", "lo ", "wor", "ld", "!"])
    assert deltas == ["Hel", "l", ""]  # "o " held back, then the match ends the sample
    assert update.finish_reason is FinishReason.STOP and update.stop_reason == "o wo"
    assert checker.text == "Hell"


def test_held_back_prefix_is_released_when_it_does_not_complete():
    checker = StopChecker(SamplingParams(stop=["abc"]))
    deltas, update = _feed(checker, ["xa", "b", "d", "ab"])
    assert update is None
    assert deltas == ["x", "", "abd", ""]
    assert checker.held_back == "ab"
    final = checker.append_text("", final=True)
    assert final.text == "ab" and checker.text == "xabdab"


def test_earliest_occurrence_wins_among_stop_strings():
    checker = StopChecker(SamplingParams(stop=["world", "lo w", "he"]))
    _, update = _feed(checker, ["xhello world"])
    assert update.text == "x" and update.stop_reason == "he"
    checker = StopChecker(SamplingParams(stop=["world", "lo w"]))
    _, update = _feed(checker, ["hel", "lo world"])
    assert checker.text == "hel" and update.stop_reason == "lo w"


def test_random_streams_match_reference_truncation():
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        hits = [(text.find(s), s) for s in stops if s in text]
        expected = text[: min(hits)[0]] if hits else text
        checker = StopChecker(SamplingParams(stop=stops))
        seen = ""
        for chunk in chunks:
            update = checker.append_text(chunk)
            seen += update.text
            assert expected.startswith(seen)
            if update.finished:
                break
            # Held back text is exactly what may still begin a stop string.
            assert not any(s in seen + checker.held_back for s in stops)
            assert all(not (seen + checker.held_back).endswith(s[:k]) for s in stops
                       for k in range(len(checker.held_back) + 1, len(s)))
        else:
            seen += checker.append_text("", final=True).text
        assert seen == expected == checker.text


def test_held_back_text_is_the_longest_stop_prefix_for_long_and_periodic_stops():
    """The held-back tail against the plain definition (the longest proper prefix of a stop
    string that the text ends with), on stop strings longer than the searched tail and
    periodic ones, where a prefix occurs in many places: the text mostly follows a stop
    string, so long tails are held back, then strays."""
    rng = random.Random(1)
    longest_held = 0
    for _ in range(1500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 60))) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:
            stops.append("ab" * rng.randint(10, 30) + "c")
        checker = StopChecker(SamplingParams(stop=stops))
        for _ in range(rng.randint(1, 30)):
            follow = rng.choice(stops)
            held = len(checker.held_back)
            new = follow[held:held + rng.randint(1, 6)] if follow.startswith(checker.held_back) else ""
            if not new or rng.random() < 0.15:
                new = "".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
            buffer = checker.held_back + new
            if checker.append_text(new).finished:
                break
            expected = max((k for s in stops for k in range(len(s)) if buffer.endswith(s[:k])), default=0)
            assert len(checker.held_back) == expected and buffer.endswith(checker.held_back), (stops, buffer)
            longest_held = max(longest_held, expected)
    assert longest_held > 40  # tails longer than the searched one were held back


def test_held_back_prefix_found_behind_a_later_occurrence_of_the_text_tail():
    tail = "abcdefghijklmnop"  # as long as the tail searched for at once
    stop = "z" + tail + "q" + tail + "!"  # the tail ends two prefixes; the text ends with the shorter
    checker = StopChecker(SamplingParams(stop=[stop]))
    assert checker.append_text("q" * 20 + "z" + tail).text == "q" * 20
    assert checker.held_back == "z" + tail
    assert checker.append_text("q" + tail).text == "" and checker.held_back == "z" + tail + "q" + tail
    update = checker.append_text("!")
    assert update.finished and update.stop_reason == stop and checker.text == "q" * 20
    checker = StopChecker(SamplingParams(stop=[tail + "x!"]))  # a prefix exactly as long as the tail
    assert checker.append_text("w" + tail).text == "w" and checker.held_back == tail


def test_eos_stop_token_and_ignore_eos():
    eos = 9
    checker = StopChecker(SamplingParams(stop_token_ids=[7]), eos_token_ids=[eos])
    assert checker.check_token(1) is None
    stop = checker.check_token(eos)
    assert stop.finish_reason is FinishReason.STOP and stop.stop_reason is None
    assert not stop.include_token_text
    stop = checker.check_token(7)
    assert stop.finish_reason is FinishReason.STOP and stop.stop_reason == 7
    ignoring = StopChecker(SamplingParams(ignore_eos=True, max_tokens=None), eos_token_ids=[eos])
    assert ignoring.check_token(eos) is None


def test_process_through_detokenizer_length_flushes_held_back_text():
    tokenizer = PieceTokenizer(["x", "a", "b", "c", "<eos>"], special={4})
    params = SamplingParams(stop=["abc"], max_tokens=3)
    checker = StopChecker(params, eos_token_ids=[4])
    detok = IncrementalDetokenizer(tokenizer, [0])
    updates = [checker.process(t, detok) for t in [0, 1, 2]]
    assert [u.text for u in updates] == ["x", "", "ab"]
    assert updates[-1].finish_reason is FinishReason.LENGTH and checker.text == "xab"


def test_process_stop_string_and_eos():
    tokenizer = PieceTokenizer(["x", "a", "b", "c", "<eos>"], special={4})
    checker = StopChecker(SamplingParams(stop=["bc"], max_tokens=None), eos_token_ids=[4])
    detok = IncrementalDetokenizer(tokenizer, [])
    updates = [checker.process(t, detok) for t in [0, 1, 2, 3]]
    assert [u.text for u in updates] == ["x", "a", "", ""]
    assert updates[-1].stop_reason == "bc" and checker.text == "xa"

    checker = StopChecker(SamplingParams(stop=["ab"], max_tokens=None), eos_token_ids=[4])
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    updates = [checker.process(t, detok) for t in [0, 1, 4]]
    # eos text is not output; the held-back "a" is released.
    assert [u.text for u in updates] == ["x", "", "a"]
    assert updates[-1].finish_reason is FinishReason.STOP and updates[-1].stop_reason is None


def test_include_stop_str_keeps_the_stop_string_and_the_stop_tokens_text():
    tokenizer = PieceTokenizer(["x", "a", "bcd", "!", "<eos>"], special={4})
    checker = StopChecker(SamplingParams(stop=["bc"], max_tokens=None), include_stop_str=True)
    detok = IncrementalDetokenizer(tokenizer, [])
    updates = [checker.process(t, detok) for t in [0, 1, 2, 3]]
    assert [u.text for u in updates] == ["x", "a", "bc", ""]  # cut after the stop string, as vLLM does
    assert updates[2].stop_reason == "bc" and checker.text == "xabc"
    # a stop token id's text stays too, and eos text where special tokens are kept
    for token_ids, skip_special, expected in (([0, 1, 3], True, "xa!"), ([0, 1, 4], True, "xa"),
                                              ([0, 1, 4], False, "xa<eos>")):
        checker = StopChecker(SamplingParams(stop_token_ids=[3], max_tokens=None), eos_token_ids=[4],
                              include_stop_str=True)
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special)
        updates = [checker.process(t, detok) for t in token_ids]
        assert updates[-1].finish_reason is FinishReason.STOP and checker.text == expected


@pytest.mark.parametrize("final", [False, True])
def test_nothing_after_finish(final):
    checker = StopChecker(SamplingParams(stop=["z"]))
    checker.append_text("az") if not final else checker.append_text("a", final=True)
    assert checker.append_text("more").text == ""


def test_min_tokens_lets_no_stop_string_or_stop_id_end_a_short_sample():
    from cleave.generation.sampling_params import SamplingParams
    from cleave.generation.stop import StopChecker

    checker = StopChecker(SamplingParams(stop=["ab"], stop_token_ids=[9], min_tokens=3), eos_token_ids=(0,))
    assert checker.check_token(9) is None  # token 1 of at least 3: not a stop
    assert checker.append_text("ab").text == "ab"  # nor a stop string, nothing held back
    assert checker.check_token(1) is None
    assert checker.append_text("a").text == "a"
    assert checker.check_token(1) is None  # token 3: the minimum is met, stop strings count again
    update = checker.append_text("b ab")
    assert (update.text, update.finish_reason, update.stop_reason) == ("b ", FinishReason.STOP, "ab")
    late = StopChecker(SamplingParams(stop_token_ids=[9], min_tokens=1))
    assert late.check_token(4) is None and late.check_token(9).finish_reason is FinishReason.STOP
