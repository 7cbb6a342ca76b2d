"""`SSEParser` gives the same events however the byte stream is cut."""

from __future__ import annotations

import json

import pytest

from cleave.benchmark.sse import SSEParser

EVENTS = [
    {"choices": [{"index": 0, "text": "héllo ✓"}]},
    {"choices": [{"index": 0, "text": " 世界", "finish_reason": "length"}]},
    {"choices": [], "usage": {"completion_tokens": 2}},
]
STREAM = (
    ": a comment line servers send to keep the connection alive\n\n"
    + "".join(f"data: {json.dumps(event, ensure_ascii=False)}\r\n\r\n" for event in EVENTS)
    + "event: ignored\ndata:line one\ndata: line two\n\n"
    + "data: [DONE]\n\n"
).encode()
EXPECTED = [json.dumps(event, ensure_ascii=False) for event in EVENTS] + ["line one\nline two", "[DONE]"]


def parse(pieces: list[bytes]) -> list[str]:
    parser = SSEParser()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.close()


def test_whole_stream():
    assert parse([STREAM]) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_split_in_two_anywhere(cut):
    # includes cuts inside multi-byte characters and between \r and \n
    assert parse([STREAM[:cut], STREAM[cut:]]) == EXPECTED


def test_one_byte_at_a_time():
    assert parse([STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_events_complete_only_at_their_blank_line():
    parser = SSEParser()
    assert parser.feed(b'data: {"a": 1}\n') == []
    assert parser.feed(b"\n") == ['{"a": 1}']


def test_close_hands_out_an_unterminated_last_event():
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == ["[DONE]"]
