"""Concurrent prefills share engine steps and their transfers overlap: N prompts that arrive
together cost one engine step on the prefill worker, not N; no KV send waits for another's,
nor for a round trip to the engine's step thread. Checked by counting engine steps, engine
calls and concurrent sends, not by wall-clock."""

from __future__ import annotations

import asyncio
import threading

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.prefill_call import prefill_response
from tests.worker.cluster import (
    ENGINE_ARGS, GATEWAY, AttachReader, greedy, start_decode, wait_pool_full,
)

NUM_PROMPTS = 6
PROMPTS = [list(range(20 + 3 * i, 37 + 3 * i)) for i in range(NUM_PROMPTS)]  # 17 tokens each


class StepCounter:
    """Counts the prefill engine's steps (wraps `LLMEngine.step` on the instance)."""

    def __init__(self, engine) -> None:
        self.num_steps = 0
        self._step = engine.step
        engine.step = self

    def __call__(self):
        self.num_steps += 1
        return self._step()


class CallCounter:
    """Counts round trips to the prefill engine's step thread (wraps `AsyncEngine.call`)."""

    def __init__(self, async_engine) -> None:
        self.num_calls = 0
        self._call = async_engine.call
        async_engine.call = self

    def __call__(self, fn):
        self.num_calls += 1
        return self._call(fn)


class SendTracker:
    """Counts the prefill backend's KV sends in flight at once (wraps `_send`), and the
    engine round trips made before each send started."""

    def __init__(self, backend, calls: CallCounter) -> None:
        self.in_flight = self.most_in_flight = 0
        self.calls_before_send: list[int] = []
        self._calls = calls
        self._send = backend._send
        backend._send = self

    async def __call__(self, handle, table, *stream):
        self.calls_before_send.append(self._calls.num_calls)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._send(handle, table, *stream)
        finally:
            self.in_flight -= 1


async def test_concurrent_prefills_run_in_one_step_and_send_together(prefill, checkpoint):
    llm = LLM(checkpoint, **ENGINE_ARGS)
    expected = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0))]
    decode = await start_decode(checkpoint)
    reader = AttachReader(decode.stub)
    try:
        backend = prefill.backend
        steps, calls = StepCounter(backend.engine), CallCounter(backend.async_engine)
        sends = SendTracker(backend, calls)
        ids = [f"b{i}" for i in range(NUM_PROMPTS)]
        handles = [(await decode.stub.Admit(d.AdmitRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=greedy(3), gateway_id=GATEWAY,
            prefill_worker_id="prefill-0"))).handle for rid, prompt in zip(ids, PROMPTS)]
        # Hold the engine thread between steps until every prompt is queued, so the test
        # does not depend on how fast the RPCs arrive.
        gate, held = threading.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def hold(engine) -> None:
            loop.call_soon_threadsafe(held.set)
            gate.wait(10)

        holding = asyncio.ensure_future(backend.async_engine.call(hold))
        await held.wait()
        calls.num_calls = 0
        calls = [asyncio.ensure_future(prefill_response(prefill.stub.Prefill(p.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=greedy(3), destination=handle))))
            for rid, prompt, handle in zip(ids, PROMPTS, handles)]
        while (await prefill.stub.GetLoad(c.GetLoadRequest())).load.num_running < NUM_PROMPTS:
            await asyncio.sleep(0.01)  # each Prefill queued its prompt before counting as running
        gate.set()
        await holding
        results = await asyncio.gather(*calls)
        assert steps.num_steps == 1, "the prompts were prefilled in separate engine steps"
        assert sends.most_in_flight >= 2, "the KV sends ran one after another"
        # The block tables are kept by the step itself: no send waits for another engine step.
        assert sends.calls_before_send == [0] * NUM_PROMPTS
        assert all(result.transfer.num_blocks == 5 for result in results)
        for rid, prompt, result in zip(ids, PROMPTS, results):
            await decode.stub.Start(d.StartRequest(
                request_id=rid, first_token_ids=result.first_token_ids, prompt_token_ids=prompt, gateway_id=GATEWAY))
        await reader.wait_finished(ids)
        assert [reader.tokens(rid) for rid in ids] == expected
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
    finally:
        await reader.cancel()
        await decode.close()
