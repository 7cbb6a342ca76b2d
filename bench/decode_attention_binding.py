"""Binding the model's decode attention calls to launch settings, for benchmarks that time
`paged_decode_attention` settings inside a whole decode step (`bench/attention_in_step.py`,
`bench/moe.py --decode-attention`).

The model reaches the kernel through three modules: `cleave.kernels.attention` (the GEMV
layout's single-token steps of models without q/k norms), `cleave.kernels.rotary_attention`
(layers that attend through `Attention.attend`, Qwen3's among them) and
`cleave.model.fused_decode` (the deferred-norm layout). All three are bound, and the calls
are counted, so a setting that no call took fails the run instead of timing the default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def decode_attention_bound(setting: dict[str, Any]) -> Iterator[list[int]]:
    """Inside, every decode attention call of the model runs with `setting`'s keyword
    arguments of `paged_decode_attention` (over the caller's); yields a list holding the
    number of bound calls, which `require_calls` checks."""
    from cleave.kernels import attention, attention_decode, rotary_attention
    from cleave.model import fused_decode

    original = attention_decode.paged_decode_attention
    calls = [0]

    def bound(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **{**kwargs, **setting})

    modules = (attention, rotary_attention, fused_decode)
    saved = [module.paged_decode_attention for module in modules]
    for module in modules:
        module.paged_decode_attention = bound
    try:
        yield calls
    finally:
        for module, function in zip(modules, saved):
            module.paged_decode_attention = function


def require_calls(calls: list[int], setting: dict[str, Any]) -> None:
    """Raise when no decode attention call took `setting` (the step never reached the kernel)."""
    if not calls[0]:
        raise RuntimeError(f"no decode attention call took the setting {setting}: the step reaches the kernel "
                           "through a module bench/decode_attention_binding.py does not bind")
