"""`reasoning_effort` (OpenAI's chat parameter; gpt-oss's harmony system message reads it):
validated by the HTTP and gRPC front doors and handed to the chat template."""

from __future__ import annotations

import json
import shutil

import pytest

from cleave.config import ModelConfig as ServedModelConfig
from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc import convert
from cleave.rpc.types import ReasoningOptions
from services.gateway.backend import Prompt
from services.gateway.model import ServedModel
from services.gateway.openai_request import generate_spec

# A template that shows what the gateway passed it (the tiny checkpoint's own ignores both)
TEMPLATE = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% if enable_thinking is defined %}Thinking: {{ enable_thinking }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory) -> ServedModel:
    directory = tmp_path_factory.mktemp("effort")
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(model_dir / name, directory / name)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": TEMPLATE}))
    return ServedModel(ServedModelConfig(source=str(directory)))


def _rendered(served: ServedModel, reasoning: ReasoningOptions | None) -> str:
    return served.tokenizer.decode(served.encode(Prompt(text="Why is the sky blue?"), reasoning))


def test_the_template_gets_the_effort_and_thinking_switch_only_when_set(served):
    assert _rendered(served, None).startswith("user: Why is the sky blue?")
    assert _rendered(served, ReasoningOptions()).startswith("user:")
    assert _rendered(served, ReasoningOptions(reasoning_effort="high")).startswith("Reasoning: high\nuser:")
    both = _rendered(served, ReasoningOptions(enable_thinking=False, reasoning_effort="low"))
    assert both.startswith("Reasoning: low\nThinking: False\nuser:")


@pytest.mark.parametrize("chat", [True, False])
def test_the_http_body_field_is_validated(chat):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    spec, _ = generate_spec({**prompt, "reasoning_effort": "medium"}, "r", "tiny", chat)
    assert spec.reasoning.reasoning_effort == "medium"
    assert generate_spec(prompt, "r", "tiny", chat)[0].reasoning.reasoning_effort is None
    for bad in ("extreme", 3, ""):
        with pytest.raises(InvalidArgument, match="must be one of low, medium, high") as raised:
            generate_spec({**prompt, "reasoning_effort": bad}, "r", "tiny", chat)
        assert raised.value.field == "reasoning_effort"


def test_the_grpc_field_round_trips_and_is_validated():
    options = ReasoningOptions(reasoning_effort="low", enable_thinking=True)
    assert convert.reasoning_from_proto(convert.reasoning_to_proto(options)) == options
    assert convert.reasoning_from_proto(common_pb2.ReasoningOptions()).reasoning_effort is None
    with pytest.raises(InvalidArgument, match="must be one of low, medium, high, got 'max'") as raised:
        convert.reasoning_from_proto(common_pb2.ReasoningOptions(reasoning_effort="max"))
    assert raised.value.field == "reasoning.reasoning_effort"


def test_chat_template_kwargs_pass_only_what_the_gateway_honours():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    spec, _ = generate_spec({**body, "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": False}},
                            "r", "tiny", True)
    assert (spec.reasoning.reasoning_effort, spec.reasoning.enable_thinking) == ("high", False)
    # the top-level field wins over the template variable
    spec, _ = generate_spec({**body, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                            "r", "tiny", True)
    assert spec.reasoning.reasoning_effort == "low"
    for kwargs, field in (({"reasoning_effort": "max"}, "chat_template_kwargs.reasoning_effort"),
                          ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking"),
                          ({"thinking_budget": 5}, "chat_template_kwargs.thinking_budget")):
        with pytest.raises(InvalidArgument) as raised:
            generate_spec({**body, "chat_template_kwargs": kwargs}, "r", "tiny", True)
        assert raised.value.field == field
