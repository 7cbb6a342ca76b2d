"""A disaggregated stack with TLS everywhere (`cleave up --tls`): the real openai client over
HTTPS and grpcio over TLS get answers equal to the plain engine's, the KV crosses the TLS bulk
connection, the kvstore is reached over mutual TLS, and nothing without the stack's CA, or
without its certificate for the internal services, gets a connection."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys

import grpc
import httpx
import openai
import pytest

from cleave.client import GatewayClient
from cleave.cli._stack import ProcessStack, StackSpec
from cleave.engine import LLM, SamplingParams
from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, kvstore_pb2, kvstore_pb2_grpc
from cleave.rpc.client import aio_channel
from tests.e2e.conftest import NUM_KV_BLOCKS, START_HANG_S

PROMPT = "the quick brown fox jumps over the lazy dog " * 4
MAX_TOKENS = 12
WITH_IDS = gateway_pb2.StreamOptions(include_token_ids=True)


@pytest.fixture(scope="module")
def tls_stack(e2e_model, tmp_path_factory):
    spec = StackSpec(model=e2e_model, mode="disaggregated", grpc_port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS,
                     log_level="WARNING", worker_args=("--kvstore-min-prefix-tokens", "1"), tls=True)
    stack = ProcessStack(spec, tmp_path_factory.mktemp("stack-tls"))
    stack.start(timeout_s=START_HANG_S)
    yield stack
    stack.stop()
    assert [child.process.returncode for child in stack.children] == [0] * len(stack.children)


@pytest.fixture(scope="module")
def expected(e2e_model):
    reference = LLM(e2e_model, device="cpu", dtype="float32", num_blocks=NUM_KV_BLOCKS, enforce_eager=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return reference.generate([PROMPT], params)[0].outputs[0].token_ids


def child(stack: ProcessStack, name: str):
    return next(c for c in stack.children if c.name == name)


def ca_only(stack: ProcessStack) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(stack.tls.ca_file.read_bytes())


async def test_grpc_clients_get_the_engines_tokens_over_tls_and_the_kv_crosses_tls(tls_stack, expected):
    assert tls_stack.tls is not None
    async with GatewayClient(tls_stack.gateway_address, credentials=ca_only(tls_stack)) as client:
        first = await client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=WITH_IDS)
        repeat = await client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=WITH_IDS)
    assert first.samples[0].token_ids == expected == repeat.samples[0].token_ids
    # the prompt's blocks went to the kvstore, over mutual TLS, with the stack's certificate
    async with aio_channel(child(tls_stack, "kvstore").address, internal_token=tls_stack.internal_token,
                           credentials=tls_stack.channel_credentials()) as channel:
        stats = await kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest())
    assert stats.bytes_stored > 0


def test_the_openai_client_speaks_https_checked_against_the_stacks_ca(tls_stack, expected):
    context = ssl.create_default_context(cafile=str(tls_stack.tls.ca_file))
    assert tls_stack.http_url.startswith("https://")
    with httpx.Client(verify=context) as http:
        client = openai.OpenAI(base_url=tls_stack.http_url, api_key="unused", http_client=http, max_retries=0)
        completion = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                               max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == MAX_TOKENS and completion.choices[0].text
    # the system's roots do not know the stack's CA: a client that checks against them refuses the gateway
    with httpx.Client() as http:
        client = openai.OpenAI(base_url=tls_stack.http_url, api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port
        httpx.get(tls_stack.http_url.replace("https://", "http://") + "/models", timeout=10)


async def test_plain_text_and_certificate_less_clients_get_no_connection(tls_stack):
    async with GatewayClient(tls_stack.gateway_address) as client:  # plain text to the TLS gateway
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete(PROMPT, max_tokens=2, timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    decode = child(tls_stack, "decode-0").address
    # the internal token alone does not reach a worker: it asks for the stack's certificate first
    for credentials in (None, ca_only(tls_stack)):
        async with aio_channel(decode, internal_token=tls_stack.internal_token, credentials=credentials) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    async with aio_channel(decode, internal_token=tls_stack.internal_token,
                           credentials=tls_stack.channel_credentials()) as channel:
        load = (await decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=30)).load
    assert load.num_attached_gateways == 1


def test_cleave_health_checks_a_tls_worker_with_the_stacks_files(tls_stack):
    decode = child(tls_stack, "decode-0").address
    files = tls_stack.tls
    base = [sys.executable, "-m", "cleave.cli.main", "health", decode, "--timeout", "30"]
    assert subprocess.run(base, capture_output=True, check=False).returncode == 2  # plain text: unreachable
    checked = subprocess.run([*base, "--tls-ca-file", str(files.ca_file), "--tls-cert-file", str(files.cert_file),
                              "--tls-key-file", str(files.key_file)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SERVING" in checked.stdout
