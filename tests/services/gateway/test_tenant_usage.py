"""A tenant's tokens are counted however its request ends: through the real routing backend and
workers (both modes), a stream its client leaves after a few tokens adds the prompt and the
tokens generated until then to the tenant's counters, as a finished one adds all of its."""

from __future__ import annotations

import contextlib

import pytest
from prometheus_client import CollectorRegistry

from cleave.generation.sampling_params import SamplingParams
from cleave.metrics import GatewayMetrics, MetricLabels
from cleave.rpc.types import ReasoningOptions
from services.gateway.backend import GenerateSpec, Prompt, Scaling, StreamShape
from services.gateway.metered import MeteredBackend
from services.gateway.tenants import TenantBackend

LABELS = MetricLabels("tiny", "gw-test")
PROMPT = list(range(3, 23))  # 20 tokens


def tokens(registry: CollectorRegistry, tenant: str, kind: str) -> float:
    labels = {**LABELS.as_dict(), "tenant": tenant, "kind": kind}
    return registry.get_sample_value("cleave:tenant_tokens_total", labels) or 0.0


def spec(request_id: str, max_tokens: int) -> GenerateSpec:
    return GenerateSpec(request_id=request_id, model="tiny", prompt=Prompt(token_ids=tuple(PROMPT)),
                        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        reasoning=ReasoningOptions(), scaling=Scaling(), stream=StreamShape(include_token_ids=True))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stream_left_mid_way_counts_the_prompt_and_the_tokens_it_got(stack, monkeypatch):
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, LABELS, max_model_len=256, tenants=True)
    monkeypatch.setattr(stack.router, "observer", metrics)
    backend = TenantBackend(MeteredBackend(stack.router, metrics), "tag-a")
    got = 0
    async with contextlib.aclosing(backend.generate(spec("left", 200))) as stream:
        async for chunk in stream:
            got += sum(len(sample.token_ids) for sample in chunk.samples)
            if got >= 3:
                break  # the client leaves; aclosing ends the request
    assert registry.get_sample_value("cleave:request_failure_total", {**LABELS.as_dict(), "code": "CANCELLED"}) == 1
    assert tokens(registry, "tag-a", "prompt") > len(PROMPT) - 1  # the prompt as templated, at least its tokens
    assert got <= tokens(registry, "tag-a", "generation") < 200  # what was streamed, maybe a step more
    before = tokens(registry, "tag-a", "generation")
    _ = [chunk async for chunk in backend.generate(spec("finished", 4))]
    assert tokens(registry, "tag-a", "generation") == before + 4
    assert metrics._ended == {}
