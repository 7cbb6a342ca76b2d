"""The benchmark's HTTP client against a scripted OpenAI server: timings, token counts,
failures, and the endpoint check's one-line errors."""

from __future__ import annotations

import socket

import pytest

from cleave.benchmark.client import EndpointError, EndpointSpec, OpenAIClient, check_endpoint
from cleave.benchmark.load import LoadSpec, run_load
from cleave.benchmark.workload import BenchRequest
from cleave.cli.tls_certs import write_certificates

REQUEST = BenchRequest(prompt="hello there", prompt_len=None, output_len=5)


async def send(base_url: str, request: BenchRequest = REQUEST, **spec_kwargs):
    async with OpenAIClient(EndpointSpec(base_url=base_url, **spec_kwargs)) as client:
        return await client.send(request)


async def test_completion_with_usage(fake_server):
    fake, url = await fake_server(step_s=0.01)
    record = await send(url, model="fake-model")
    assert record.success and record.error is None
    assert record.usage_reported and record.output_tokens == 5
    assert record.prompt_len == 7  # from usage
    assert record.finish_reason == "length"
    assert len(record.itl_s) == 4  # one gap per token chunk after the first
    assert 0 < record.ttft_s <= record.e2e_s
    assert record.e2e_s >= record.ttft_s + sum(record.itl_s) - 1e-9
    body = fake.bodies[0]
    assert body["max_tokens"] == 5 and body["min_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == "hello there" and body["model"] == "fake-model"


async def test_without_usage_tokens_are_counted_by_chunks(fake_server):
    _, url = await fake_server(behaviour="no_usage")
    record = await send(url, BenchRequest("p", prompt_len=3, output_len=6))
    assert record.success and not record.usage_reported
    assert record.output_tokens == 6
    assert record.prompt_len == 3  # the benchmark's own count stays


async def test_chat_counts_answer_and_reasoning_deltas(fake_server):
    fake, url = await fake_server(behaviour="no_usage")
    record = await send(url, endpoint="/v1/chat/completions", ignore_eos=False)
    assert record.success and record.output_tokens == 5
    body = fake.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["max_completion_tokens"] == 5 and "ignore_eos" not in body and "min_tokens" not in body


async def test_error_event_mid_stream_fails_the_request(fake_server):
    _, url = await fake_server(behaviour="error_mid_stream")
    record = await send(url)
    assert not record.success
    assert record.error_reason == "stream error" and record.error == "the worker went away"


async def test_bearer_key_is_sent(fake_server):
    _, url = await fake_server(behaviour="needs_key")
    assert (await send(url, api_key="secret")).success
    refused = await send(url, api_key="wrong")
    assert (refused.success, refused.status, refused.error_reason) == (False, 401, "HTTP 401")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("case, spec_kwargs, expected", [
    ("needs_key", {}, r"HTTP 401 \(no API key was sent\): pass the server's key with --api-key"),
    ("needs_key", {"api_key": "wrong"}, r"HTTP 401 .*the --api-key given was refused"),
    ("ok", {"endpoint": "/v1/complete"}, r"/v1/complete answered HTTP 404 .*check --base-url and --endpoint"),
    ("html", {}, r"did not answer like an OpenAI-compatible server: answered text/html.*<html>welcome"),
])
async def test_bad_endpoints_are_one_line_errors(fake_server, case, spec_kwargs, expected):
    _, url = await fake_server(behaviour=case)
    async with OpenAIClient(EndpointSpec(base_url=url, **spec_kwargs)) as client:
        with pytest.raises(EndpointError, match=expected) as caught:
            await check_endpoint(client, REQUEST)
    assert "\n" not in str(caught.value)


async def test_unreachable_server_is_one_line_error():
    url = f"http://127.0.0.1:{closed_port()}"
    async with OpenAIClient(EndpointSpec(base_url=url)) as client:
        with pytest.raises(EndpointError, match=r"cannot reach .*is the server running"):
            await client.served_models()
        with pytest.raises(EndpointError, match=r"cannot reach .*is the server running"):
            await check_endpoint(client, REQUEST)


async def test_a_server_refusing_ignore_eos_gets_max_tokens_only(fake_server):
    fake, url = await fake_server(behaviour="strict")
    async with OpenAIClient(EndpointSpec(base_url=url)) as client:
        check = await check_endpoint(client, REQUEST)
        assert check.spec.ignore_eos is False and client.spec is check.spec
        assert "ignore_eos" in check.note and check.requests_sent == 2
        assert (await client.send(REQUEST)).success
    assert "ignore_eos" in fake.bodies[0] and "ignore_eos" not in fake.bodies[-1]


async def test_served_models_lists_ids(fake_server):
    _, url = await fake_server()
    async with OpenAIClient(EndpointSpec(base_url=url)) as client:
        assert await client.served_models() == [("fake-model", None)]


@pytest.mark.parametrize("cap", [1, 3])
async def test_concurrency_cap_holds(fake_server, cap):
    fake, url = await fake_server(step_s=0.005)
    requests = [REQUEST] * 8
    async with OpenAIClient(EndpointSpec(base_url=url), max_connections=cap) as client:
        result = await run_load(client, requests, LoadSpec([0.0] * 8, max_concurrency=cap))
    assert [r.index for r in result.records] == list(range(8))
    assert all(r.success for r in result.records)
    assert fake.max_in_flight == cap


async def test_arrival_offsets_are_kept(fake_server):
    _, url = await fake_server()
    offsets = [0.0, 0.05, 0.15]
    async with OpenAIClient(EndpointSpec(base_url=url)) as client:
        result = await run_load(client, [REQUEST] * 3, LoadSpec(offsets))
    sent = [r.sent_s for r in result.records]
    assert all(actual >= planned for actual, planned in zip(sent, offsets))
    assert sent[2] - sent[0] >= 0.15 - 1e-3


async def test_an_https_server_is_checked_against_the_given_ca(fake_server, tmp_path):
    tls = write_certificates(tmp_path / "tls")
    _, url = await fake_server(ssl_context=tls.server_context(mutual=False))
    assert url.startswith("https://")
    record = await send(url, ca_file=str(tls.ca_file))
    assert record.success and record.output_tokens == 5
    refused = await send(url)  # the system's roots do not know the stack's CA
    assert not refused.success and "certificate" in refused.error.lower()
