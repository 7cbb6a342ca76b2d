"""Log lines never carry a request's body: not as an event value, not in a traceback's frame
locals, not in full inside an exception message."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from cleave.logging import MAX_TRACEBACK_LINE_CHARS, configure_logging


def _handle(body: dict) -> None:
    prompt = body["prompt"]  # a local a traceback renderer with locals would print
    raise ValueError(f"cannot tokenize {prompt}")


@pytest.mark.parametrize("as_json", [True, False])
def test_request_bodies_stay_out_of_logs(as_json: bool):
    secret = "private-" + "words " * 400 + str(40 * 1000 + 961)  # made here: not in any source line
    token_ids = [987_654_321 + index for index in range(5)]
    stream = io.StringIO()
    configure_logging("INFO", json=as_json, stream=stream)
    try:
        try:
            _handle({"prompt": secret, "token_ids": token_ids})
        except ValueError:
            structlog.get_logger("test").exception("request failed", request_id="req-5", prompt=secret,
                                                   token_ids=token_ids, messages=[{"content": secret}])
    finally:
        structlog.reset_defaults()
    output = stream.getvalue()
    assert "req-5" in output and "ValueError: cannot tokenize private-words" in output
    assert str(40 * 1000 + 961) not in output and str(token_ids[0]) not in output
    assert "<omitted: 5 items>" in output
    lines = json.loads(output)["exception"].splitlines() if as_json else output.splitlines()[1:]
    assert max(len(line) for line in lines) <= MAX_TRACEBACK_LINE_CHARS + 40
