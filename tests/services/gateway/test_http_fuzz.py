"""The HTTP API against its OpenAPI schema (`services/gateway/openapi.yaml`), fuzzed by
schemathesis on a live colocated stack: inputs that fit the schema and inputs that break
it (wrong types, out-of-range numbers, missing fields) must never answer 5xx, every answer
must be documented (status, content type, body shape), and the stack must still serve a
normal request afterwards.

Generation is derandomized with a fixed example budget per operation, so a run is
repeatable and bounded; expensive-but-valid values (many samples, long outputs) are capped
before sending, since they cost CPU time and test nothing about validation.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import services.gateway
from services.gateway.http_api import OpenAIApi
from tests.services.gateway.stack import MODEL_NAME
from tests.services.gateway.threaded_stack import threaded_stack

SCHEMA_PATH = Path(services.gateway.__file__).parent / "openapi.yaml"
EXAMPLES_PER_OPERATION = 50  # per generation mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_FUZZ_TOKENS = 4
MAX_FUZZ_SAMPLES = 2
UINT32_MAX = 2**32 - 1
REQUEST_TIMEOUT_S = 20.0


def load_schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def served_by(schema: dict[str, Any], stack) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The schema narrowed to what this stack serves (its model id, its vocabulary), so
    that positive cases mostly reach generation instead of a 404 or a vocabulary 400."""
    schema = copy.deepcopy(schema)
    components = schema["components"]["schemas"]
    components["SamplingFields"]["properties"]["model"] = {"type": "string", "enum": [MODEL_NAME]}
    components["TokenIds"]["items"]["maximum"] = stack.router.model.vocab_size - 1
    bias = components["SamplingFields"]["properties"]["logit_bias"]  # keys: token ids of the vocabulary
    value = bias.pop("additionalProperties")
    bias.update(properties={str(token_id): value for token_id in (0, 7, 42)}, additionalProperties=False)
    # regexes, choices and grammars drawn at random are mostly not ones (a 400 each); the
    # structured-output tests send real ones, and response_format stays in
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        del components["SamplingFields"]["properties"][name]
    if stack.router.model.tool_call_format is None:  # its chat template describes no tools: they are a 400
        chat = components["ChatCompletionRequest"]["allOf"][1]["properties"]
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            del chat[name]
    detokenize = _body_schema(schema, "/detokenize")
    detokenize["properties"]["tokens"]["items"] = {"$ref": "#/components/schemas/TokenIds/items"}
    for body in (detokenize, *_body_schema(schema, "/tokenize")["oneOf"]):
        body["properties"]["model"] = {"type": "string", "enum": [MODEL_NAME]}
    return schema


@pytest.fixture(scope="module")
def live(model_dir):
    """A colocated stack on the tiny reasoning checkpoint, served from its own thread."""
    with threaded_stack(model_dir, "colocated") as stack:
        yield stack


def _body_schema(schema: dict[str, Any], path: str) -> dict[str, Any]:
    return schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def root_url(stack) -> str:  # type: ignore[no-untyped-def]
    return stack.http_url.removesuffix("/v1")


def _cheap(body: Any) -> None:
    """Cap sample counts and output lengths that are valid but slow (in place)."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_FUZZ_TOKENS < value <= UINT32_MAX:
            body[name] = MAX_FUZZ_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    min_tokens = body.get("min_tokens")
    if (isinstance(min_tokens, int) and isinstance(limit, int) and not isinstance(min_tokens, bool)
            and limit < min_tokens <= UINT32_MAX):
        body["min_tokens"] = limit
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and MAX_FUZZ_SAMPLES < n <= 1024:
        body["n"] = MAX_FUZZ_SAMPLES
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_FUZZ_SAMPLES and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:MAX_FUZZ_SAMPLES]


def fuzz_operation(operation, mode: schemathesis.GenerationMode, base_url: str,  # type: ignore[no-untyped-def]
                   statuses: set[tuple[str, int]]) -> list[str]:
    """Send EXAMPLES_PER_OPERATION generated cases; the failed checks, one line each (and
    each (operation, status) answered into `statuses`)."""
    failures: list[str] = []

    @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:  # type: ignore[no-untyped-def]
        if case.headers:  # framing headers are aiohttp's parser's (a plain-text 400 before any route runs)
            case.headers = {name: value for name, value in case.headers.items()
                            if name.lower() not in ("content-length", "transfer-encoding")}
        if isinstance(case.body, dict) and case.operation.path.startswith("/v1/"):
            body = copy.deepcopy(case.body)
            _cheap(body)
            case.body = body
        try:
            response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
            statuses.add((operation.label, response.status_code))
            case.validate_response(response, checks=CHECKS)
        except (Exception, BaseExceptionGroup) as error:  # collect every failure, then report them together
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            failures.append(f"{operation.label} [{mode.value}] {first_line}: {case.as_curl_command()}")

    run()
    return failures


def test_the_schema_is_valid_openapi_and_lists_every_route():
    schema = load_schema()
    validate(schema)
    api_routes = {
        (route.method, route.resource.canonical.replace("{model_id:.+}", "{model_id}"))
        for route in OpenAIApi(None, [], str, served_model=object()).app().router.routes()  # type: ignore[arg-type]
        if route.method != "HEAD"
    }
    documented = {(method.upper(), path) for path, item in schema["paths"].items() for method in item}
    assert documented == api_routes


def test_no_generated_request_gets_a_server_error_or_an_undocumented_answer(live):
    schema = served_by(load_schema(), live)
    loaded = schemathesis.openapi.from_dict(schema)
    base_url = root_url(live)
    failures: list[str] = []
    statuses: set[tuple[str, int]] = set()
    for result in loaded.get_all_operations():
        operation = result.ok()
        definition = schema["paths"][operation.path][operation.method.lower()]
        negatable = "parameters" in definition or "requestBody" in definition  # else nothing to break
        modes = [schemathesis.GenerationMode.POSITIVE] + [schemathesis.GenerationMode.NEGATIVE] * negatable
        for mode in modes:
            failures += fuzz_operation(operation, mode, base_url, statuses)
    assert not failures, f"{len(failures)} failed checks:\n" + "\n".join(failures)
    # the cases reach both sides of validation
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"):
        assert {(route, 200), (route, 400)} <= statuses, sorted(statuses)

    # the stack still serves
    ready = httpx.get(f"{base_url}/ready", timeout=10)
    assert ready.status_code == 200, ready.text
    answer = httpx.post(f"{base_url}/v1/completions", timeout=30,
                        json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1


# JSON values at the edges of what parsers and protobuf fields take (json.dumps writes NaN and
# Infinity as the bare words Python's json module parses back)
AWKWARD = [None, True, -1, 2**63, 2**64, -(10**30), 1e308, float("nan"), float("-inf"), "", "\ud800", [], [None],
           {"": None}]
BASES = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}


def body_fields(schema: dict[str, Any], path: str) -> list[str]:
    """Every request field the schema documents for a generation route."""
    components = schema["components"]["schemas"]
    own = components["CompletionRequest" if path == "/v1/completions" else "ChatCompletionRequest"]["allOf"][1]
    return sorted({*components["SamplingFields"]["properties"], *own["properties"]})


@pytest.mark.parametrize("path", sorted(BASES))
def test_awkward_values_in_every_documented_field_get_no_server_error(live, path):
    failures = []
    with httpx.Client(base_url=root_url(live), timeout=REQUEST_TIMEOUT_S) as client:
        for field in body_fields(load_schema(), path):
            for value in AWKWARD:
                body = {**BASES[path], field: value}
                if field in ("max_tokens", "max_completion_tokens", "n") and value == -1:
                    continue
                response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
                if response.status_code >= 500 or not 200 <= response.status_code < 300 and "error" not in response.json():
                    failures.append(f"{field}={value!r}: {response.status_code} {response.text[:200]}")
    assert not failures, "\n".join(failures)


# Values nested about as deep as the body parser takes (deeper is a 400 naming `body`): no
# field takes one, and no field's check may walk one by recursion into a server error.
DEEP = ["[" * 800 + "]" * 800, '{"a":' * 800 + "1" + "}" * 800]


@pytest.mark.parametrize("path", sorted(BASES))
def test_deeply_nested_values_in_every_documented_field_get_no_server_error(live, path):
    refused = []
    bodies = {field: json.dumps(BASES[path])[:-1] + f", {json.dumps(field)}: {{}}}}"
              for field in body_fields(load_schema(), path)}
    if path == "/v1/chat/completions":
        bodies["messages[0].content"] = '{"max_tokens": 2, "messages": [{"role": "user", "content": {}}]}'
    with httpx.Client(base_url=root_url(live), timeout=REQUEST_TIMEOUT_S) as client:
        for field, template in bodies.items():
            for deep in DEEP:
                response = client.post(path, content=template.replace("{}", deep, 1) if field != "messages[0].content"
                                       else template.replace('"content": {}', f'"content": {deep}'),
                                       headers={"Content-Type": "application/json"})
                param = response.json()["error"]["param"] if response.status_code == 400 else ""
                if not (param == field or param.startswith((f"{field}.", f"{field}["))):
                    refused.append(f"{field}: {response.status_code} {response.text[:200]}")
    assert not refused, "\n".join(refused)

