"""`GatewayClient`: Generate (streamed or collected), Abort, ListModels and readiness."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import aio_channel

_SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


@dataclass
class SampleResult:
    """One sample, collected from a stream."""

    index: int
    text: str = ""
    reasoning_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    answer: str | None = None
    reward: float | None = None
    advantage: float | None = None


@dataclass
class Completion:
    """A whole Generate call, collected."""

    request_id: str
    samples: list[SampleResult]
    usage: common_pb2.Usage
    selected_index: int | None = None
    votes: list[gateway_pb2.AnswerVotes] = field(default_factory=list)


def build_request(
    prompt: str | Sequence[int] | Sequence[dict[str, str]],
    *,
    raw: bool = False,
    reasoning: common_pb2.ReasoningOptions | None = None,
    scaling: gateway_pb2.TestTimeScaling | None = None,
    stream: gateway_pb2.StreamOptions | None = None,
    request_id: str = "",
    model: str = "",
    truncate_prompt_tokens: int | None = None,
    **sampling: Any,
) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest from a text, token-id or chat prompt and SamplingParams fields
    (`truncate_prompt_tokens`: run the prompt's last k tokens; None: all)."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields: {', '.join(sorted(unknown))}")
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, model=model, raw_prompt=raw, sampling=common_pb2.SamplingParams(**sampling),
        truncate_prompt_tokens=truncate_prompt_tokens,
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.chat.messages.extend(gateway_pb2.ChatMessage(**message) for message in prompt)  # type: ignore[arg-type]
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    if reasoning is not None:
        request.reasoning.CopyFrom(reasoning)
    if scaling is not None:
        request.scaling.CopyFrom(scaling)
    if stream is not None:
        request.stream.CopyFrom(stream)
    return request


class GatewayClient:
    """An asyncio client of one gateway (host:port); `api_key`: the gateway's --api-key,
    sent as `authorization: Bearer <key>` on every call (None: the gateway asks for none);
    `credentials`: TLS for a gateway that serves it, e.g.
    `grpc.ssl_channel_credentials(Path("ca.pem").read_bytes())` (None: plain text)."""

    def __init__(self, address: str, api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self.channel = aio_channel(address, api_key=api_key, credentials=credentials)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the gateway reports SERVING (raises TimeoutError)."""
        health = health_pb2_grpc.HealthStub(self.channel)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                response = await health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"the gateway at {self.address} did not become ready in {timeout_s:g} s")
            await asyncio.sleep(0.2)

    def stream(
        self, request: gateway_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The raw response stream of a GenerateRequest (a grpc.aio call: `.cancel()` aborts)."""
        return self.stub.Generate(request, timeout=timeout)

    def generate(self, prompt: Any, timeout: float | None = None, **kwargs: Any) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream a generation; kwargs as `build_request`."""
        return self.stream(build_request(prompt, **kwargs), timeout=timeout)

    async def complete(self, prompt: Any, timeout: float | None = None, **kwargs: Any) -> Completion:
        """Run a generation to the end and collect every sample."""
        return await collect(self.generate(prompt, timeout=timeout, **kwargs))

    async def abort(self, request_id: str) -> bool:
        response = await self.stub.Abort(common_pb2.AbortRequest(request_id=request_id))
        return response.found

    async def list_models(self) -> list[gateway_pb2.ModelInfo]:
        return list((await self.stub.ListModels(gateway_pb2.ListModelsRequest())).models)


async def collect(responses: AsyncIterator[gateway_pb2.GenerateResponse]) -> Completion:
    """Fold a Generate stream into a Completion."""
    samples: dict[int, SampleResult] = {}
    texts: dict[int, tuple[list[str], list[str]]] = {}  # each sample's text and reasoning, joined at the end
    completion = Completion(request_id="", samples=[], usage=common_pb2.Usage())
    async for response in responses:
        completion.request_id = response.request_id
        for delta in response.samples:
            sample = samples.setdefault(delta.index, SampleResult(delta.index))
            text, reasoning = texts.setdefault(delta.index, ([], []))
            text.append(delta.text)
            reasoning.append(delta.reasoning_text)
            sample.token_ids.extend(delta.token_ids)
            if delta.finish_reason:
                sample.finish_reason = common_pb2.FinishReason.Name(delta.finish_reason).removeprefix("FINISH_REASON_").lower()
            for name in ("answer", "reward", "advantage"):
                if delta.HasField(name):
                    setattr(sample, name, getattr(delta, name))
        if response.HasField("usage"):
            completion.usage = response.usage
        if response.HasField("selected_index"):
            completion.selected_index = response.selected_index
        if response.votes.answers:
            completion.votes = list(response.votes.answers)
    for index, (text, reasoning) in texts.items():
        samples[index].text, samples[index].reasoning_text = "".join(text), "".join(reasoning)
    completion.samples = [samples[i] for i in sorted(samples)]
    return completion


async def wait_until_serving(address: str, timeout_s: float = 120.0, api_key: str | None = None,
                             credentials: grpc.ChannelCredentials | None = None) -> None:
    """Return once a one-token request through the gateway at `address` succeeds (after a
    restart, say; `credentials` for a TLS gateway); past `timeout_s` (a guard against a
    hang) the last failure is raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with GatewayClient(address, api_key=api_key, credentials=credentials) as client:
                await client.complete("ping", max_tokens=1, timeout=10)
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
