"""Test-wide setup: Triton kernels run under the interpreter when there is no GPU, and
gRPC's asyncio runtime lives for the whole session."""

import os

import grpc
import torch

# triton.jit reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any
# cleave.kernels module is imported; CPU tests force impl="triton" to exercise the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each test runs on its own event loop, and gRPC counts its asyncio users: when the last
# server or channel of a test is collected, it tears down the process-wide poller thread and
# the next test starts a new one. That teardown, run from whichever later test happens to
# collect the garbage, can block joining the poller (grpc/grpc#22365, #40989) and races the
# next server's listener. One reference held from here keeps a single runtime for the session.
grpc.aio.init_grpc_aio()
