"""Layer streaming on the GPU (in one process: the in-memory transport with its copy on a side
stream after each layer's event, as CUDA IPC copies on the transfer stream): the blocks land
byte-identical to a send after the step, and the first layer's copy is issued while the
last layer's forward has not finished. CUDA IPC between two worker processes, with
`layer_streaming="auto"`, runs in tests/worker/test_handshake_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from cleave.engine.llm import build_engine_config
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint
from cleave.transfer.block_copy import copy_blocks
from cleave.transfer.memory import MemoryEndpoint, MemoryTransferClient
from services.prefill.backend import PrefillSpec
from services.prefill.engine_backend import EnginePrefillBackend

pytestmark = pytest.mark.gpu

NUM_LAYERS, PROMPT_TOKENS, BLOCK_SIZE = 8, 4096, 16


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    # wide enough that a 4k-token forward takes a few ms per layer on any GPU
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("stream-gpu") / "llama", "llama", seed=2, num_hidden_layers=NUM_LAYERS,
        hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=8192)


async def gpu_prefill(checkpoint, mode: str, prompt: list[int]):
    config = build_engine_config(checkpoint, device="cuda", dtype="float32", block_size=BLOCK_SIZE, num_blocks=600,
                                 max_model_len=PROMPT_TOKENS + 64, max_num_batched_tokens=PROMPT_TOKENS + 64)
    backend = EnginePrefillBackend(config, worker_id="p", model_id="tiny", layer_streaming=mode)
    await backend.start()
    events: list[torch.cuda.Event] = []  # each reported layer's event, in order
    first_copy: dict[str, object] = {}
    try:
        streams = backend.layer_streams
        if streams is not None:

            def recording_watch(output):  # type: ignore[no-untyped-def]
                progress = streams.watch(output)
                if progress is not None:
                    listener = progress._listener
                    progress._listener = lambda layer, ready: (events.append(ready), listener(layer, ready))
                return progress

            backend.engine.watch_layers = recording_watch
        endpoint = MemoryEndpoint(torch.zeros_like(backend.engine.kv_cache))
        await endpoint.start()
        side = torch.cuda.Stream()

        def side_copy(src, dst, src_index, dst_index, layers):  # type: ignore[no-untyped-def]
            if "last_layer_done" not in first_copy:
                first_copy["layers"] = layers
                first_copy["last_layer_done"] = len(events) == NUM_LAYERS and events[-1].query()
            current = torch.cuda.current_stream()
            side.wait_stream(current)  # after the layer's event (the sender ordered it there)
            with torch.cuda.stream(side):
                copy_blocks(src, dst, src_index, dst_index, layers)
            current.wait_stream(side)

        backend.transfers = MemoryTransferClient(endpoint, copy=side_copy)
        num_blocks = backend.engine.handoff.num_blocks_for(len(prompt))
        dst_ids = random.Random(3).sample(range(1, 600), num_blocks)
        pending = endpoint.expect("t", dst_ids, timeout_s=60)
        spec = PrefillSpec("r", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=1), pending.handle)
        result = await backend.prefill(spec)
        await pending.wait()
        torch.cuda.synchronize()
        claimed = streams.num_claimed if streams is not None else 0
        return endpoint.kv_cache[:, :, dst_ids].cpu(), result, claimed, events, first_copy
    finally:
        await backend.shutdown()


async def test_layer_streaming_on_cuda_lands_the_same_bytes_and_overlaps_the_forward(wide_checkpoint):
    prompt = [random.Random(i).randrange(5, 400) for i in range(PROMPT_TOKENS)]
    streamed, result, claimed, events, first_copy = await gpu_prefill(wide_checkpoint, "on", prompt)
    after, after_result, after_claimed, _, _ = await gpu_prefill(wide_checkpoint, "off", prompt)
    assert (claimed, after_claimed) == (1, 0)
    assert len(events) == NUM_LAYERS and all(isinstance(event, torch.cuda.Event) for event in events)
    assert first_copy["layers"].start == 0
    assert first_copy["last_layer_done"] is False  # issued while the last layer still ran (or was not queued)
    assert torch.count_nonzero(streamed) > 0
    assert torch.equal(streamed.view(torch.uint8), after.view(torch.uint8))
    assert result.first_token_ids == after_result.first_token_ids
