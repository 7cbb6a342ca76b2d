"""CUDA-graph decode runner: one captured forward per batch-size bucket, replayed per step.

`capture()` runs the decode step once per bucket, largest first, into one shared graph
memory pool (smaller graphs reuse the larger ones' memory). `run()` copies a step's
inputs into the static buffers, replays the smallest bucket that holds the batch and
returns the real rows of the static output. Batches it cannot replay (a prefill chunk,
more rows than the largest bucket, a CPU device, graphs disabled or not yet captured)
run the step eagerly.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable

import torch

from cleave.graphs.buckets import batch_size_buckets, select_bucket
from cleave.graphs.buffers import StaticDecodeBuffers
from cleave.kv.metadata import AttentionMetadata

StepFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass(frozen=True)
class GraphRunnerConfig:
    """Capacities the graphs are captured for.

    Attributes:
        max_batch_size: largest bucket; bigger decode batches run eagerly.
        max_blocks_per_seq: block-table width; max model length = this * block_size.
        block_size: tokens per KV block.
        enabled: False runs every step eagerly (debugging, or when capture cannot fit).
        pdl: the input-refill kernel launches with programmatic dependent launch where the
            device has it (`cleave.kernels.pdl`).
        window_tables: batches also carry window tables (a paired cache: cleave.kv.groups).
    """

    max_batch_size: int
    max_blocks_per_seq: int
    block_size: int
    enabled: bool = True
    pdl: bool = True
    window_tables: bool = False


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed; the message says which setting to change."""


class CUDAGraphRunner:
    """Replays a captured decode step (`step_fn(input_ids, positions, metadata) -> logits`).

    `step_fn` is the model forward plus logits for a flat batch of one token per sequence;
    it must do no host syncs. The tensor `run` returns is a view of the graph's static
    output: valid until the next `run`.
    """

    def __init__(self, step_fn: StepFn, config: GraphRunnerConfig, device: torch.device | str) -> None:
        self.step_fn = step_fn
        self.config = config
        self.device = torch.device(device)
        self.buckets = batch_size_buckets(config.max_batch_size)
        self.buffers: StaticDecodeBuffers | None = None
        if self.uses_graphs:
            self.buffers = StaticDecodeBuffers(
                config.max_batch_size, config.max_blocks_per_seq, config.block_size, self.device,
                window_tables=config.window_tables,
            )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: tuple[int, int] | None = None

    @property
    def uses_graphs(self) -> bool:
        return self.config.enabled and self.device.type == "cuda"

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, in a shared pool (no-op off CUDA)."""
        if self.buffers is None or self.is_captured:
            return
        self.buffers.reset()
        torch.cuda.synchronize(self.device)
        for bucket in sorted(self.buckets, reverse=True):
            self._capture_bucket(bucket)
        upload_graphs(self._graphs.values())
        self._warm_fill()
        torch.cuda.synchronize(self.device)

    def _warm_fill(self) -> None:
        """Run the input refill once on a padding row, so its kernel compiles here and not
        in the first decode step (one variant serves every step: its counts are unspecialised
        and its tile width is the capacity's)."""
        assert self.buffers is not None
        buffers = self.buffers
        buffers.fill(buffers.input_ids[:1].clone(), buffers.positions[:1].clone(), buffers.metadata(1),
                     pdl=self.config.pdl)
        buffers.reset()

    def _capture_bucket(self, bucket: int) -> None:
        assert self.buffers is not None
        input_ids = self.buffers.input_ids[:bucket]
        positions = self.buffers.positions[:bucket]
        metadata = self.buffers.metadata(bucket)
        graph = torch.cuda.CUDAGraph()
        try:
            # Warm-up outside the graph compiles kernels and sets up library workspaces;
            # the buffers hold padding, so it writes no KV and reads none.
            self.step_fn(input_ids, positions, metadata)
            torch.cuda.synchronize(self.device)
            with graph_capture(graph, pool=self._pool):
                output = self.step_fn(input_ids, positions, metadata)
        except (RuntimeError, torch.OutOfMemoryError) as error:
            raise GraphCaptureError(
                f"capturing the decode graph for batch size {bucket} failed: {error}. "
                f"Lower max_batch_size (now {self.config.max_batch_size}) or max_blocks_per_seq "
                f"(now {self.config.max_blocks_per_seq}) to save memory, make the step free of "
                "host syncs, or set enabled=False to run decode eagerly."
            ) from error
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[bucket] = graph
        self._outputs[bucket] = output

    def bucket_for(self, batch_size: int, metadata: AttentionMetadata) -> int | None:
        """The captured bucket that will replay this batch, or None to run it eagerly."""
        if (
            not self.is_captured
            or batch_size < 1
            or not metadata.is_decode_only
            or metadata.num_seqs != batch_size
            or metadata.block_tables.shape[1] > self.config.max_blocks_per_seq
        ):
            return None
        return select_bucket(self.buckets, batch_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """One step: `input_ids`, `positions` [B] -> logits [B, V] (graph replay when possible)."""
        batch_size = input_ids.shape[0]
        bucket = self.bucket_for(batch_size, metadata)
        if bucket is None or self.buffers is None:
            return self.step_fn(input_ids, positions, metadata)
        self.buffers.fill(input_ids, positions, metadata, pdl=self.config.pdl)
        self._graphs[bucket].replay()
        return self._outputs[bucket][:batch_size]


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None) -> Iterator[None]:
    """`torch.cuda.graph` with automatic garbage collection paused while the stream captures.
    A collection inside the capture can finalize an earlier engine's CUDA graphs in this
    process (tests, benches that build engines one after another), and destroying a graph
    is not permitted while a stream captures: the capture is invalidated ("operation failed
    due to a previous error during capture"). `torch.cuda.graph` collects once on entry,
    before the capture begins."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if was_enabled:
            gc.enable()


def upload_graphs(graphs: Iterable[torch.cuda.CUDAGraph]) -> None:
    """Launch each captured graph once, at start-up. A graph's first launch also uploads its
    work to the device (unless uploaded before), so a bucket first needed late in a run
    (the last few sequences of a batch) would pay that in its step. The static buffers hold
    padding here: the replays write no KV and read none."""
    for graph in graphs:
        graph.replay()
