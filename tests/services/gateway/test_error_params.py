"""Errors name each field as the client sent it on its route, including errors raised after
the body was parsed, under the names of the gRPC request (`chat.messages`, `text`), of the
engine's checks (`max_tokens`) or of the chat body a Responses request runs as (`messages[0]`).

Nothing here reaches a worker: each input is refused while the gateway checks it.
"""

from __future__ import annotations

import json

import pytest

from cleave.errors import InvalidArgument
from services.gateway.openai_request import http_error
from services.gateway.responses_api import param_names
from tests.services.gateway.test_fuzz_regressions import CHAT, COMPLETIONS, USER, gateway  # noqa: F401  (a fixture)

RESPONSES = "/v1/responses"
TOO_LONG = "a" * 100_000  # over the prompt bytes a 256-token context can hold
OVER_CONTEXT = 100_000  # tokens

FOUND = [
    (RESPONSES, {"input": "\ud800"}, "input"),
    (RESPONSES, {"input": [{"role": "user", "content": "\ud800"}]}, "input[0].content"),
    (RESPONSES, {"instructions": "\ud800", "input": "x"}, "instructions"),
    (RESPONSES, {"input": TOO_LONG}, "input"),
    (RESPONSES, {"input": [{"role": "user", "content": TOO_LONG}]}, "input"),
    (RESPONSES, {"input": "x", "max_output_tokens": OVER_CONTEXT}, "max_output_tokens"),
    (CHAT, {"messages": [USER], "max_completion_tokens": OVER_CONTEXT}, "max_completion_tokens"),
    (CHAT, {"messages": [USER], "max_tokens": OVER_CONTEXT}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
    (COMPLETIONS, {"prompt": TOO_LONG}, "prompt"),
    ("/tokenize", {"prompt": TOO_LONG}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), FOUND, ids=[str(i) for i in range(len(FOUND))])
async def test_an_error_names_the_field_the_client_sent(gateway, path, body, param):  # noqa: F811
    client, _ = gateway
    response = await client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    assert "max_tokens" not in error["message"].removeprefix(f"{param}: "), error  # not the engine's name either


def test_a_path_under_a_renamed_field_is_named_by_that_field():
    # the chat body a Responses request runs as numbers its messages after the instructions,
    # and merges consecutive function_call items: its positions are not the input's
    names = param_names({"instructions": "Be brief.", "input": [{"role": "user", "content": "x"}]})
    error = http_error(InvalidArgument("is wrong", field="messages[1].content"), names)
    assert error.body["error"]["param"] == "input"
    error = http_error(InvalidArgument("is wrong", field="input[0].content"), names)  # the body's own name
    assert error.body["error"]["param"] == "input[0].content"
