"""AsyncEngine: concurrent streams reassemble to the offline result; cancelling frees KV."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.errors import InvalidArgument, Unavailable
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint

PROMPTS = ["Hello world", "What is the capital of France?", "Please write a short poem about the sea.", "1 2 3"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("async-tiny") / "qwen2", "qwen2", seed=3)


def make_engine(path: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(path), dtype="float32", device="cpu",
        scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=64), cache=CacheConfig(block_size=8),
    )
    return LLMEngine(config)


def offline(path: Path, params: list[SamplingParams]) -> dict[str, OutputAccumulator]:
    engine = make_engine(path)
    results: dict[str, OutputAccumulator] = {}
    for index, (prompt, sampling) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{index}", prompt, sampling)
        results[f"r{index}"] = OutputAccumulator(f"r{index}")
    while engine.has_unfinished():
        for output in engine.step():
            results[output.request_id].add(output)
    return results


async def test_concurrent_streams_match_offline(checkpoint):
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True, n=3),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.8, seed=11, ignore_eos=True),
    ]
    expected = offline(checkpoint, params)

    async def consume(engine: AsyncEngine, index: int) -> tuple[OutputAccumulator, int]:
        accumulator, num_deltas = OutputAccumulator(f"r{index}"), 0
        await asyncio.sleep(0.01 * index)  # arrive at different steps
        async for output in engine.submit(f"r{index}", PROMPTS[index], params[index]):
            assert output.delta
            accumulator.add(output)
            num_deltas += 1
        return accumulator, num_deltas

    async with AsyncEngine(make_engine(checkpoint)) as engine:
        results = await asyncio.gather(*(consume(engine, i) for i in range(len(PROMPTS))))
        assert await engine.call(lambda e: e.kv.num_free_blocks == e.kv.num_usable_blocks)

    for index, (accumulator, num_deltas) in enumerate(results):
        got, want = accumulator.result(), expected[f"r{index}"].result()
        assert got.finished and num_deltas > 1
        assert [(s.token_ids, s.text, s.finish_reason) for s in got.outputs] == [
            (s.token_ids, s.text, s.finish_reason) for s in want.outputs
        ]
        assert all(s.finish_reason is FinishReason.LENGTH for s in got.outputs)


async def test_cancelling_a_stream_aborts_and_frees_blocks(checkpoint):
    async with AsyncEngine(make_engine(checkpoint)) as engine:
        seen = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.submit("long", PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True)):
                seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), timeout=30)
        assert await engine.call(lambda e: e.num_requests) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the abort is applied between steps
            if await engine.call(lambda e: e.num_requests == 0 and e.kv.num_free_blocks == e.kv.num_usable_blocks):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the cancelled request still holds KV blocks")


async def test_bad_request_and_duplicate_id_raise(checkpoint):
    async with AsyncEngine(make_engine(checkpoint)) as engine:
        with pytest.raises(InvalidArgument) as error:
            async for _ in engine.submit("bad", "hi", SamplingParams(top_p=0.0)):
                pass
        assert error.value.field == "top_p"
        first = engine.submit("dup", "hi", SamplingParams(max_tokens=50, ignore_eos=True))
        await first.__anext__()
        with pytest.raises(InvalidArgument) as error:
            async for _ in engine.submit("dup", "hi", SamplingParams(max_tokens=2)):
                pass
        assert error.value.field == "request_id"
        await first.aclose()


async def test_a_failing_step_fails_the_streams_and_is_reported(checkpoint):
    reported = threading.Event()
    errors: list[BaseException] = []

    def on_failure(error: BaseException) -> None:
        errors.append(error)
        reported.set()

    engine = make_engine(checkpoint)
    async_engine = AsyncEngine(engine, on_failure=on_failure)

    def broken_step():  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    engine.step = broken_step  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match="device lost"):
        async for _ in async_engine.submit("r", [1, 2, 3], SamplingParams(max_tokens=2)):
            pass
    assert await asyncio.to_thread(reported.wait, 10)
    assert [str(error) for error in errors] == ["device lost"] and not async_engine.is_running
    with pytest.raises(Unavailable):
        await async_engine.call(lambda e: None)


async def test_a_grammar_compiles_off_the_event_loop(checkpoint, monkeypatch):
    """A structured output's grammar is compiled on a worker thread: the loop runs (here: sets
    the event the compile waits for) while it compiles, and the request then streams as usual."""
    from cleave.engine.grammar import GrammarCompiler
    from cleave.generation.structured_output import StructuredKind, StructuredOutput

    loop_ran = threading.Event()
    compiled_on: list[threading.Thread] = []
    compile = GrammarCompiler.compile

    def slow_compile(self, spec, field="structured_output"):
        compiled_on.append(threading.current_thread())
        assert loop_ran.wait(timeout=30), "the event loop did not run while the grammar compiled"
        return compile(self, spec, field)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    engine = AsyncEngine(make_engine(checkpoint))
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0,
                                structured_output=StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no")))

        async def answer() -> str:
            accumulator = OutputAccumulator("g")
            async for output in engine.submit("g", PROMPTS[0], params):
                accumulator.add(output)
            return accumulator.result().outputs[0].text

        task = asyncio.create_task(answer())
        await asyncio.sleep(0)  # the submit starts, and hands the compile to a thread
        loop_ran.set()
        assert await task in ("yes", "no")
        assert compiled_on and compiled_on[0].name.startswith("cleave-grammar")
    finally:
        await engine.shutdown()
