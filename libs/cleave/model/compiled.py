"""`torch.compile` path: the same model with Inductor fusing the torch reference ops.

This is the baseline the hand-written Triton kernels are measured against: every op is
forced to its torch reference (impl="torch") and the compiler decides the fusions. Paged
attention stays an eager op between the compiled regions, since its reference reads the
batch layout on the host.
"""

from __future__ import annotations

import torch

from cleave.model.llama import CausalLM


def compile_model(model: CausalLM, *, mode: str | None = None, dynamic: bool | None = None) -> CausalLM:
    """Switch `model` to the torch reference ops and compile its forward in place; returns it.

    `mode` and `dynamic` are passed to `torch.compile` (e.g. mode="max-autotune-no-cudagraphs").
    The first call of each new shape pays the compile time.
    """
    model.set_impl("torch")
    model.forward = torch.compile(model.forward, mode=mode, dynamic=dynamic)  # type: ignore[method-assign]
    return model
