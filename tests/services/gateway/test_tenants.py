"""A gateway with several API keys: each key is a tenant whose requests share cached prompt
prefixes only with each other, over HTTP (the openai client) and gRPC alike; a request's own
cache salt splits its tenant's cache further; outputs never change; a request's log lines name
its tenant (the key's tag, never the key), and no other request's do; a request id a client
chose is its tenant's own (another tenant's equal id neither fails nor reaches it)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
import structlog

from cleave.api_keys import ApiKeys, key_tag
from cleave.client import GatewayClient
from cleave.client.gateway import build_request, collect
from cleave.proto.cleave.v1 import gateway_pb2
from services.gateway.tenants import tenant_salt
from tests.services.gateway.stack import MODEL_NAME, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")
KEYS = ("sk-tenant-a", "sk-tenant-b")
PROMPT = "Tenants share one gateway and one prefix cache, but never each other's prompts. " * 2
IDS = gateway_pb2.StreamOptions(include_token_ids=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(model_dir):
    # a context long enough for a request that runs far longer than a test needs it to
    running = await start_stack(model_dir, "colocated", api_key=ApiKeys(KEYS), max_model_len=1024)
    yield running
    await running.close()


async def complete(stack, key: str, prompt: str, **extra):  # type: ignore[no-untyped-def]
    client = openai.AsyncOpenAI(base_url=stack.http_url, api_key=key, max_retries=0)
    async with client:
        return await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                               extra_body=extra)


async def test_over_http_a_prompt_is_cached_for_its_tenant_only(stack):
    prompt = "HTTP. " + PROMPT
    first = await complete(stack, KEYS[0], prompt)
    again = await complete(stack, KEYS[0], prompt)
    other = await complete(stack, KEYS[1], prompt)
    salted = await complete(stack, KEYS[0], prompt, cache_salt="project-x")
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, again, other, salted)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == 0, cached
    assert len({r.choices[0].text for r in (first, again, other, salted)}) == 1
    with pytest.raises(openai.AuthenticationError):
        await complete(stack, "sk-tenant-c", prompt)


async def test_over_grpc_a_prompt_is_cached_for_its_tenant_only(stack):
    async def generate(key: str) -> tuple[int, list[int]]:
        async with GatewayClient(stack.gateway_address, api_key=key) as client:
            result = await client.complete("gRPC. " + PROMPT, max_tokens=3, temperature=0.0, stream=IDS)
        return result.usage.cached_prompt_tokens, result.samples[0].token_ids

    (first, tokens), (again, _), (other, other_tokens) = [await generate(key) for key in (KEYS[1], KEYS[1], KEYS[0])]
    assert first == 0 and again > 0 and other == 0
    assert tokens == other_tokens


async def test_tenant_salts_differ_by_tenant_and_by_salt_and_stay_bounded():  # async as the module mark asks
    salts = {tenant_salt(tenant, salt) for tenant in ("t1", "t2") for salt in ("", "x", "x" * 256)}
    assert len(salts) == 6 and all(len(salt) == 64 for salt in salts)
    assert tenant_salt("t1", "x") == tenant_salt("t1", "x")


async def test_a_requests_log_lines_name_its_tenant_and_no_other_requests_do(stack, monkeypatch):
    prepare = stack.router._prepare

    def logging_prepare(spec):  # type: ignore[no-untyped-def]
        structlog.get_logger("test").info("preparing", request_id=spec.request_id)  # inside the request
        return prepare(spec)

    monkeypatch.setattr(stack.router, "_prepare", logging_prepare)
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        async with GatewayClient(stack.gateway_address, api_key=KEYS[0]) as client:
            await client.complete("logged", max_tokens=2)
            await client.list_models()  # the same connection, no tenant's work
        async with GatewayClient(stack.gateway_address, api_key=KEYS[1]) as client:
            await client.complete("logged", max_tokens=2)
        headers = {"Authorization": f"Bearer {KEYS[1]}"}
        async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=30) as http:
            body = {"model": MODEL_NAME, "prompt": "logged", "max_tokens": 2}
            assert (await http.post("/completions", json=body)).status_code == 200
            assert (await http.get("/models")).status_code == 200  # the same connection, after it
            assert (await http.post("/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"})
                    ).status_code == 200
    rpc = [(entry["rpc"], entry.get("tenant")) for entry in logs if entry["event"] == "rpc"
           and entry["rpc"].startswith("/cleave.v1.Gateway/")]
    assert rpc == [("/cleave.v1.Gateway/Generate", key_tag(KEYS[0])), ("/cleave.v1.Gateway/ListModels", None),
                   ("/cleave.v1.Gateway/Generate", key_tag(KEYS[1]))]
    prepared = [entry.get("tenant") for entry in logs if entry["event"] == "preparing"]
    assert prepared == [key_tag(KEYS[0]), key_tag(KEYS[1]), key_tag(KEYS[1]), key_tag(KEYS[0])]
    assert not any(key in repr(entry) for entry in logs for key in KEYS)  # tags only, never a key


async def test_a_request_id_is_its_tenants_own(stack):
    held = build_request("hold job-1", request_id="job-1", max_tokens=1000, ignore_eos=True)
    async with GatewayClient(stack.gateway_address, api_key=KEYS[0]) as first, \
            GatewayClient(stack.gateway_address, api_key=KEYS[1]) as second:
        call = first.stream(held)
        assert (await anext(aiter(call))).request_id == "job-1"  # running under tenant A
        # tenant B's job-1 is another request: it runs (no "already running"), and its
        # abort, from B's own connection, cannot reach A's
        other = await collect(second.stream(build_request("B's", request_id="job-1", max_tokens=2)))
        assert other.request_id == "job-1" and other.samples[0].finish_reason == "length"
        assert await second.abort("job-1") is False
        # tenant A's own second job-1 is refused while the first runs, and A's abort ends it
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(first.stream(build_request("again", request_id="job-1", max_tokens=2)))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in refused.value.details() and key_tag(KEYS[0]) not in refused.value.details()
        assert await first.abort("job-1") is True
        assert (await collect(call)).samples[0].finish_reason == "abort"
