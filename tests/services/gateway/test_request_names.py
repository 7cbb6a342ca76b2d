"""One list of chat roles and one model lookup serve both the gRPC and the HTTP API."""

from __future__ import annotations

import pytest

from cleave.config import ModelConfig
from cleave.errors import InvalidArgument, NotFound
from cleave.proto.cleave.v1 import gateway_pb2 as g
from services.gateway.openai_request import chat_prompt
from services.gateway.request_names import chat_role, resolve_model
from services.gateway.servicer import prompt_from_proto

MODELS = (ModelConfig(source="org/a", served_name="a"), ModelConfig(source="org/b", served_name="b"))


def test_developer_is_system_on_both_apis():
    grpc_prompt = prompt_from_proto(g.GenerateRequest(chat=g.ChatMessages(messages=[g.ChatMessage(role="developer", content="x")])))
    http_prompt = chat_prompt({"messages": [{"role": "developer", "content": "x"}]})
    assert grpc_prompt.chat[0].role == http_prompt.chat[0].role == "system"


@pytest.mark.parametrize("role", ["", "robot", None, 3])
def test_unknown_role_names_the_field(role):
    with pytest.raises(InvalidArgument) as raised:
        chat_role(role, "messages[2].role")
    assert raised.value.field == "messages[2].role"
    assert "developer" in str(raised.value)


def test_resolve_model():
    assert resolve_model(MODELS, "") == resolve_model(MODELS, None) == "a"
    assert resolve_model(MODELS, "b") == "b"
    with pytest.raises(NotFound, match="'c' is not served here; served: a, b"):
        resolve_model(MODELS, "c")
    with pytest.raises(InvalidArgument, match="must be a model id string, got int"):
        resolve_model(MODELS, 7)
