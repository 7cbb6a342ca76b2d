"""The gateway's request metrics around a scripted backend: each request ends in exactly one
success or failure, TTFT once, queue time at its first start, gauges back to zero."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from cleave.errors import ResourceExhausted
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.metrics import GatewayMetrics, MetricLabels
from cleave.rpc.types import ReasoningOptions, Usage
from cleave.scaling.strategies import Strategy
from services.gateway.backend import (
    GenerateChunk, GenerateSpec, Prompt, SampleOutput, Scaling, StreamShape,
)
from services.gateway.metered import MeteredBackend
from services.gateway.tenants import TenantBackend

LABELS = MetricLabels("tiny", "gw-0")


def spec(request_id: str, scaling: Scaling = Scaling()) -> GenerateSpec:
    return GenerateSpec(request_id=request_id, model="tiny", prompt=Prompt(text="hi"), sampling=SamplingParams(),
                        reasoning=ReasoningOptions(), scaling=scaling, stream=StreamShape())


class ScriptedBackend:
    """Streams `tokens` one chunk each, then a final chunk with usage; routes the request first
    (as the routing backend does) and raises `error` after the first chunk when set."""

    def __init__(self, observer: GatewayMetrics, tokens: int = 3) -> None:
        self.observer = observer
        self.tokens = tokens
        self.error: Exception | None = None
        self.gate: asyncio.Event | None = None  # when set, wait for it before the first token

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        return False

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        self.observer.routed(spec.request_id, True, "decode-0")
        if self.gate is not None:
            await self.gate.wait()
        sent = 0
        try:
            for index in range(self.tokens):
                yield GenerateChunk(samples=(SampleOutput(index=0, text=f"t{index}"),))
                sent += 1
                if self.error is not None:
                    raise self.error
            yield GenerateChunk(samples=(SampleOutput(index=0, finish_reason=FinishReason.LENGTH),),
                                usage=Usage(prompt_tokens=5, completion_tokens=self.tokens, reasoning_tokens=2))
        finally:  # as the routing backend reports every stream's end
            self.observer.ended(spec.request_id, Usage(prompt_tokens=5, completion_tokens=sent, cached_prompt_tokens=1))


def get(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {**LABELS.as_dict(), **labels}) or 0.0


@pytest.fixture
def metered():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, LABELS, max_model_len=256)
    backend = ScriptedBackend(metrics)
    return MeteredBackend(backend, metrics), backend, registry


async def test_finished_requests_count_once_with_their_tokens(metered):
    wrapped, _, registry = metered
    for index in range(4):
        chunks = [chunk async for chunk in wrapped.generate(spec(f"r{index}"))]
        assert len(chunks) == 4
    assert get(registry, "cleave:request_success_total", finished_reason="length") == 4
    assert get(registry, "cleave:time_to_first_token_seconds_count") == 4
    assert get(registry, "cleave:e2e_request_latency_seconds_count") == 4
    assert get(registry, "cleave:request_queue_time_seconds_count") == 4
    assert get(registry, "cleave:inter_token_latency_seconds_count") == 4 * 2  # 3 token chunks: 2 gaps each
    assert get(registry, "cleave:time_per_output_token_seconds_count") == 4
    assert get(registry, "cleave:request_generation_tokens_sum") == 12
    assert get(registry, "cleave:request_prompt_tokens_sum") == 20
    assert get(registry, "cleave:reasoning_tokens_total") == 8
    assert get(registry, "cleave:routing_decisions_total", prefill="remote", decode_worker="decode-0") == 4
    assert get(registry, "cleave:request_failure_total", code="RESOURCE_EXHAUSTED") == 0


async def test_each_tenants_finished_requests_and_tokens_are_counted_under_its_tag():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, LABELS, max_model_len=256, tenants=True)
    backend = ScriptedBackend(metrics)
    wrapped = MeteredBackend(backend, metrics)
    for request_id, tenant in [("a1", "tag-a"), ("a2", "tag-a"), ("b1", "tag-b")]:
        _ = [chunk async for chunk in TenantBackend(wrapped, tenant).generate(spec(request_id))]
    _ = [chunk async for chunk in wrapped.generate(spec("one-key"))]  # no tenant: not counted per tenant
    backend.error = ResourceExhausted("full")
    with pytest.raises(ResourceExhausted):
        _ = [chunk async for chunk in TenantBackend(wrapped, "tag-b").generate(spec("b-failed"))]
    assert get(registry, "cleave:tenant_requests_total", tenant="tag-a") == 2
    assert get(registry, "cleave:tenant_requests_total", tenant="tag-b") == 1  # finished ones
    assert get(registry, "cleave:tenant_tokens_total", tenant="tag-a", kind="prompt") == 10
    assert get(registry, "cleave:tenant_tokens_total", tenant="tag-a", kind="generation") == 6
    # b's failed request counts the prompt and the one token it had streamed
    assert get(registry, "cleave:tenant_tokens_total", tenant="tag-b", kind="prompt") == 10
    assert get(registry, "cleave:tenant_tokens_total", tenant="tag-b", kind="cached_prompt") == 1
    assert get(registry, "cleave:tenant_tokens_total", tenant="tag-b", kind="generation") == 3 + 1
    assert get(registry, "cleave:tenant_tokens_total", tenant="", kind="prompt") == 0
    assert get(registry, "cleave:request_success_total", finished_reason="length") == 4


async def test_a_tenant_that_leaves_mid_stream_is_counted_for_what_it_got():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, LABELS, max_model_len=256, tenants=True)
    backend = ScriptedBackend(metrics, tokens=8)
    stream = TenantBackend(MeteredBackend(backend, metrics), "tag-a").generate(spec("a1"))
    for _ in range(3):
        await anext(stream)
    await stream.aclose()  # the client went away after three tokens
    assert get(registry, "cleave:request_failure_total", code="CANCELLED") == 1
    assert get(registry, "cleave:tenant_requests_total", tenant="tag-a") == 0
    assert get(registry, "cleave:tenant_tokens_total", tenant="tag-a", kind="prompt") == 5
    assert get(registry, "cleave:tenant_tokens_total", tenant="tag-a", kind="generation") == 2  # the third was not yet counted as sent
    assert metrics._ended == {}  # nothing kept once the request left


async def test_without_tenant_metrics_no_tenant_series_is_served(metered):
    wrapped, _, registry = metered
    _ = [chunk async for chunk in TenantBackend(wrapped, "tag-a").generate(spec("a1"))]
    assert get(registry, "cleave:request_success_total", finished_reason="length") == 1
    assert not [metric for metric in registry.collect() if metric.name.startswith("cleave:tenant_")]


async def test_a_failed_request_counts_its_code_and_not_a_success(metered):
    wrapped, backend, registry = metered
    backend.error = ResourceExhausted("full")
    with pytest.raises(ResourceExhausted):
        async for _ in wrapped.generate(spec("r")):
            pass
    assert get(registry, "cleave:request_failure_total", code="RESOURCE_EXHAUSTED") == 1
    assert get(registry, "cleave:request_success_total", finished_reason="length") == 0
    assert get(registry, "cleave:num_requests_running") == get(registry, "cleave:num_requests_waiting") == 0


async def test_gauges_follow_requests_and_a_client_that_leaves_is_cancelled(metered):
    wrapped, backend, registry = metered
    backend.gate = asyncio.Event()
    stream = wrapped.generate(spec("r", Scaling(Strategy.MAJORITY_VOTE, num_samples=3)))
    first = asyncio.ensure_future(anext(stream))
    for _ in range(100):
        if get(registry, "cleave:num_requests_waiting") == 1:
            break
        await asyncio.sleep(0.01)
    assert (get(registry, "cleave:num_requests_waiting"), get(registry, "cleave:num_requests_running")) == (1, 0)
    backend.gate.set()
    await first
    assert (get(registry, "cleave:num_requests_waiting"), get(registry, "cleave:num_requests_running")) == (0, 1)
    await stream.aclose()  # the client went away
    assert (get(registry, "cleave:num_requests_waiting"), get(registry, "cleave:num_requests_running")) == (0, 0)
    assert get(registry, "cleave:request_failure_total", code="CANCELLED") == 1
    assert get(registry, "cleave:test_time_scaling_samples_total", strategy="majority_vote") == 3


def test_each_decode_workers_requests_are_read_at_scrape_time():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, LABELS, max_model_len=256)
    loads = {"decode-0": 2}
    metrics.track_decode_workers(lambda: loads.items())
    assert get(registry, "cleave:num_decode_worker_requests", decode_worker="decode-0") == 2
    loads.update({"decode-0": 0, "decode-1": 3})  # a worker that joined later is reported too
    assert get(registry, "cleave:num_decode_worker_requests", decode_worker="decode-0") == 0
    assert get(registry, "cleave:num_decode_worker_requests", decode_worker="decode-1") == 3
