"""Engine spans: a request submitted inside a traced request gets engine.queue_wait and
engine.prefill_forward in its trace; an untraced one gets nothing and is never watched."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.step_trace import TraceOrigin
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.tracing.helpers import by_name, memory_tracing, traced_caller

PROMPT = "Please write a short poem about the sea, and another one about the mountains."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("trace-tiny") / "qwen2", "qwen2", seed=3)


def make_engine(path: Path) -> AsyncEngine:
    # 8 tokens per step: the prompt takes several chunked-prefill steps
    config = EngineConfig(
        model=str(path), dtype="float32", device="cpu",
        scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=8, max_num_seqs=4),
        cache=CacheConfig(block_size=8),
    )
    return AsyncEngine(LLMEngine(config))


async def test_a_traced_request_gets_its_queue_wait_and_prefill_spans(checkpoint):
    tracing, spans = memory_tracing("cleave-prefill")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    async with make_engine(checkpoint) as engine:
        with traced_caller(tracing, "cleave.v1.Prefill/Prefill") as request_span:
            outputs = [output async for output in engine.submit("r1", PROMPT, params)]
        assert engine.step_trace.watched == {}  # forgotten once reported
    assert outputs[-1].finished
    finished = spans.get_finished_spans()
    queue_wait, prefill = by_name(finished, "engine.queue_wait"), by_name(finished, "engine.prefill_forward")
    for engine_span in (queue_wait, prefill):
        assert engine_span.parent.span_id == request_span.get_span_context().span_id
        assert engine_span.attributes["request_id"] == "r1"
    assert queue_wait.start_time <= queue_wait.end_time == prefill.start_time < prefill.end_time
    assert prefill.attributes["prompt_tokens"] > 8  # more than one step's budget
    request = by_name(finished, "cleave.v1.Prefill/Prefill")
    assert request.start_time <= queue_wait.start_time and prefill.end_time <= request.end_time


async def test_untraced_requests_record_nothing(checkpoint):
    assert TraceOrigin.capture() is None
    async with make_engine(checkpoint) as engine:
        outputs = []
        async for output in engine.submit("r2", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)):
            assert engine.step_trace.watched == {}  # never watched, even while it runs
            outputs.append(output)
    assert outputs[-1].finished and len(outputs) > 1
