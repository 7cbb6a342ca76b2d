"""`torch.compile` path: the same model with Inductor fusing the torch reference ops.

This is the baseline the hand-written Triton kernels are measured against: norms, rotary and
activations are forced to their torch references (impl="torch") and the compiler decides the
fusions. KV write + paged attention run outside the compiled graphs, on the Triton kernels
by default (attention_impl="auto"), so a comparison isolates the fused pointwise ops; pass
attention_impl="torch" for an all-reference model.
"""

from __future__ import annotations

import torch

from cleave.kernels.dispatch import Impl
from cleave.model.llama import CausalLM


def compile_model(
    model: CausalLM,
    *,
    attention_impl: Impl = "auto",
    mode: str | None = None,
    dynamic: bool | None = None,
) -> CausalLM:
    """Switch `model` to the torch reference ops and compile its forward in place; returns it.

    `mode` and `dynamic` are passed to `torch.compile` (e.g. mode="max-autotune-no-cudagraphs").
    The first call of each new shape pays the compile time.
    """
    model.set_impl("torch", attention_impl=attention_impl)
    model.forward = torch.compile(model.forward, mode=mode, dynamic=dynamic)  # type: ignore[method-assign]
    return model
