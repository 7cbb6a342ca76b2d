"""CUDA-graph decode runner: buckets and padding, static buffers, capture and replay."""

from cleave.graphs.buckets import batch_size_buckets, select_bucket
from cleave.graphs.buffers import StaticDecodeBuffers
from cleave.graphs.runner import CUDAGraphRunner, GraphCaptureError, GraphRunnerConfig, StepFn

__all__ = [
    "CUDAGraphRunner",
    "GraphCaptureError",
    "GraphRunnerConfig",
    "StaticDecodeBuffers",
    "StepFn",
    "batch_size_buckets",
    "select_bucket",
]
