"""LayerProgress through the engine (CPU): each layer is reported once, in order, right after
its forward wrote its KV and before the next layer's; nothing is hooked when unused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.engine.layer_progress import LayerProgress
from cleave.engine.llm import build_engine_config
from cleave.engine.llm_engine import LLMEngine
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint

NUM_LAYERS = 3
PROMPT = [(11 * i) % 300 + 5 for i in range(23)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("layers") / "llama", "llama", seed=5,
                                 num_hidden_layers=NUM_LAYERS)


def make_engine(checkpoint: Path, **overrides) -> LLMEngine:
    args = dict(device="cpu", dtype="float32", block_size=4, num_blocks=40, max_model_len=128)
    return LLMEngine(build_engine_config(checkpoint, **{**args, **overrides}))


def run_prefill(engine: LLMEngine, request_id: str = "r") -> list[int]:
    engine.add_request(request_id, PROMPT, SamplingParams(temperature=0.0, max_tokens=1), prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    return engine.handoff.export(request_id)


def test_each_layer_is_reported_once_in_order_after_its_kv_and_before_the_next(checkpoint):
    engine = make_engine(checkpoint)
    cache = engine.kv_cache  # [L, 2, NB, BS, Hkv, D], zeroed
    reports: list[tuple[int, object, bool, bool]] = []
    plans = []

    def listener(layer: int, ready) -> None:
        table = plans[-1].scheduled[0].block_table
        written = bool(cache[layer][:, table].abs().sum() > 0)
        next_written = layer + 1 < NUM_LAYERS and bool(cache[layer + 1][:, table].abs().sum() > 0)
        reports.append((layer, ready, written, next_written))

    def watch(output):
        plans.append(output)
        return LayerProgress(NUM_LAYERS, cache.device, listener)

    engine.watch_layers = watch
    run_prefill(engine)
    assert len(plans) == 1  # one step ran the whole prompt
    assert [layer for layer, *_ in reports] == list(range(NUM_LAYERS))
    assert all(ready is None for _, ready, _, _ in reports)  # CPU: the layer is done
    assert all(written for _, _, written, _ in reports)
    assert not any(next_written for *_, next_written in reports)
    assert all(not layer._forward_hooks for layer in engine.model.layers)  # removed after the step


def test_watched_and_unwatched_prefills_write_the_same_kv(checkpoint):
    plain, watched = make_engine(checkpoint), make_engine(checkpoint)
    seen: list[int] = []
    watched.watch_layers = lambda output: LayerProgress(NUM_LAYERS, torch.device("cpu"), lambda i, _: seen.append(i))
    plain_table, watched_table = run_prefill(plain), run_prefill(watched)
    assert seen == list(range(NUM_LAYERS))
    assert torch.equal(plain.kv_cache[:, :, plain_table], watched.kv_cache[:, :, watched_table])


def test_chunked_prompt_reports_every_chunk_step(checkpoint):
    engine = make_engine(checkpoint, max_num_batched_tokens=8, enable_chunked_prefill=True)
    steps: list[list[int]] = []

    def watch(output):
        layers: list[int] = []
        steps.append(layers)
        return LayerProgress(NUM_LAYERS, torch.device("cpu"), lambda i, _: layers.append(i))

    engine.watch_layers = watch
    run_prefill(engine)
    assert len(steps) == 3  # 23 tokens in chunks of 8
    assert steps == [list(range(NUM_LAYERS))] * 3


def test_finish_reports_the_layers_the_forward_did_not():
    reports: list[tuple[int, object]] = []
    progress = LayerProgress(4, torch.device("cpu"), lambda i, ready: reports.append((i, ready)))
    progress.on_layer_done(0)
    progress.finish()
    progress.finish()  # idempotent
    assert reports == [(0, None), (1, None), (2, None), (3, None)]
    assert progress.is_complete


def test_a_layer_out_of_order_is_refused():
    progress = LayerProgress(3, torch.device("cpu"), lambda i, ready: None)
    progress.on_layer_done(0)
    with pytest.raises(RuntimeError, match="in order"):
        progress.on_layer_done(2)
