"""Streaming clients of the gateway for the serving benchmarks, and what they measure.

`GrpcClient` streams Generate requests (token-id prompts), `HttpClient` the OpenAI API's
streamed chat completions (text prompts) and completions (token-id prompts). Each request
becomes one `Timing` in the calling process's monotonic clock.

Token counts: gRPC responses carry the token ids (`include_token_ids`), so every message's
count is exact. The HTTP stream's deltas carry only text; the gateway writes one SSE event
per batch of new tokens of a sample (even when they made no visible text) and, asked for
`stream_options.include_usage`, a last event with the exact completion token count. A
request's tokens are that count; its gaps are one per event, each divided by the request's
mean tokens per event after the first (at 1.0 every token came as its own event and the
gaps are exact). Logprobs would give exact counts per event, but they change what the
workers compute, so the clients do not ask for them.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

REASONING_MODES = {"inline": 3, "separate": 1, "hidden": 2}  # cleave.v1.ReasoningMode values


@dataclass
class Timing:
    """One streamed request as its client process saw it (that process's monotonic seconds)."""

    kind: str  # "user", "long" or "warmup"
    sent: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    num_events: int = 0  # stream messages that carried tokens
    prompt_tokens: int | None = None  # as the gateway counted them (after the chat template)
    gaps: list[float] = field(default_factory=list)  # seconds per token between messages
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.num_tokens < 2:
            return None
        return (self.last - self.first) / (self.num_tokens - 1)

    def record(self, now: float, count: int) -> None:
        """A message with `count` new tokens arrived at `now`."""
        if self.first is None:
            self.first = now
        else:
            self.gaps.extend([(now - self.last) / count] * count)
        self.last = now
        self.num_tokens += count
        self.num_events += 1

    def recount(self, num_tokens: int) -> None:
        """The server's token count replaces one token per event; the gaps shrink to match."""
        if self.num_events > 1 and num_tokens > self.num_events:
            tokens_per_event = (num_tokens - 1) / (self.num_events - 1)
            self.gaps = [gap / tokens_per_event for gap in self.gaps]
        self.num_tokens = num_tokens


class GrpcClient:
    """Generate streams over `num_channels` channels, each with its own connection.

    Args:
        address: the gateway's gRPC host:port.
        reasoning_mode: a key of REASONING_MODES.
        timeout_s: per request.
        num_channels: requests pick one by index.
    """

    def __init__(self, address: str, reasoning_mode: str, timeout_s: float, num_channels: int = 1,
                 ca_file: str | None = None) -> None:
        import grpc

        from cleave.proto.cleave.v1 import gateway_pb2_grpc
        from cleave.rpc.client import channel_options

        # a local subchannel pool: channels with equal options would otherwise share one connection
        options = channel_options() + [("grpc.use_local_subchannel_pool", 1)]
        if ca_file is None:
            self.channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(max(num_channels, 1))]
        else:  # TLS, the gateway checked against the stack's CA
            credentials = grpc.ssl_channel_credentials(Path(ca_file).read_bytes())
            self.channels = [grpc.aio.secure_channel(address, credentials, options=options)
                             for _ in range(max(num_channels, 1))]
        self.stubs = [gateway_pb2_grpc.GatewayStub(channel) for channel in self.channels]
        self.reasoning_mode = REASONING_MODES[reasoning_mode]
        self.timeout_s = timeout_s

    async def connect(self) -> None:
        await asyncio.gather(*(channel.channel_ready() for channel in self.channels))

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))

    async def tokens(self, kind: str, prompt: list[int], max_tokens: int, channel: int = 0) -> Timing:
        """Stream the answer to a token-id prompt (greedy, ignore_eos)."""
        from cleave.proto.cleave.v1 import common_pb2 as c
        from cleave.proto.cleave.v1 import gateway_pb2 as g

        request = g.GenerateRequest(
            token_ids=g.TokenIds(ids=prompt),
            sampling=c.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            reasoning=c.ReasoningOptions(mode=self.reasoning_mode),
            stream=g.StreamOptions(include_token_ids=True),
        )
        timing = Timing(kind, time.monotonic())
        async for response in self.stubs[channel % len(self.stubs)].Generate(request, timeout=self.timeout_s):
            now = time.monotonic()
            count = sum(len(sample.token_ids) for sample in response.samples)
            if count:
                timing.record(now, count)
            if response.HasField("usage"):
                timing.prompt_tokens = response.usage.prompt_tokens
        return timing


class HttpClient:
    """Streamed requests to the OpenAI API over one aiohttp session.

    Args:
        url: the API's base, http://host:port/v1.
        reasoning_mode: inline, separate or hidden (the API's `reasoning_mode`).
        timeout_s: per request.
    """

    def __init__(self, url: str, reasoning_mode: str, timeout_s: float, ca_file: str | None = None) -> None:
        import aiohttp

        # https: the gateway checked against the stack's CA
        tls = True if ca_file is None else ssl.create_default_context(cafile=ca_file)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=tls), timeout=aiohttp.ClientTimeout(total=timeout_s))
        self.url = url
        self.reasoning_mode = reasoning_mode

    async def connect(self) -> None:
        async with self.session.get(self.url.removesuffix("/v1") + "/health") as response:
            response.raise_for_status()

    async def close(self) -> None:
        await self.session.close()

    async def chat(self, kind: str, text: str, max_tokens: int, channel: int = 0) -> Timing:
        """Stream a chat completion of one user message (greedy, ignore_eos)."""
        return await self._stream(kind, "/chat/completions", {"messages": [{"role": "user", "content": text}]},
                                  max_tokens)

    async def tokens(self, kind: str, prompt: list[int], max_tokens: int, channel: int = 0) -> Timing:
        """Stream a completion of a token-id prompt (greedy, ignore_eos)."""
        return await self._stream(kind, "/completions", {"prompt": prompt}, max_tokens)

    async def _stream(self, kind: str, path: str, body: dict, max_tokens: int) -> Timing:
        body = {**body, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "reasoning_mode": self.reasoning_mode}
        timing = Timing(kind, time.monotonic())
        async with self.session.post(self.url + path, json=body) as response:
            if response.status != 200:
                timing.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return timing
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.monotonic()
                payload = line[len(b"data: "):].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    timing.error = str(event["error"].get("message"))
                elif event.get("choices"):
                    timing.record(now, 1)
                elif event.get("usage"):
                    timing.recount(event["usage"]["completion_tokens"])
                    timing.prompt_tokens = event["usage"]["prompt_tokens"]
        return timing
