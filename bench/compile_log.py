"""Every Triton JIT compile a benchmark pays while it runs: which kernel, when, how long.

A Triton kernel is compiled once per specialisation: its constexprs, and for each integer
argument not marked `do_not_specialize` whether it is 1 and whether it divides by 16. A
count that changes step to step (sequences, tokens, rows) can so meet a new variant in the
middle of a run, and its step pays the compile (or a disk-cache load) on the host. This
listens to triton's JIT hooks (`triton.knobs.runtime.jit_cache_hook` before a compile,
`jit_post_compile_hook` after; an in-memory cache hit calls neither) and tags each compile
with the caller's current `label` (e.g. the engine step's index).

    with CompileLog() as log:
        for step in range(n):
            log.label = step
            engine.step()
    log.events  # [CompileEvent(label, kernel, seconds), ...]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompileEvent:
    label: Any  # the caller's label when the compile began
    kernel: str  # the kernel's qualified name
    seconds: float  # host time from the cache miss to the compiled kernel (compile or disk load)
    signature: str  # the arguments it specialised on: 16-byte divisible ones, those equal to 1, constexprs


class CompileLog:
    """Collects `CompileEvent`s while entered; a triton without the knobs hooks logs nothing
    (`supported` says which)."""

    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self.label: Any = None
        self._started: list[tuple[Any, float]] = []
        self._runtime: Any = None
        self._saved: tuple[Any, Any] = (None, None)

    @property
    def supported(self) -> bool:
        return self._runtime is not None

    def __enter__(self) -> "CompileLog":
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self._runtime = runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._saved
            self._runtime = None

    def _before(self, **kwargs: Any) -> bool:
        self._started.append((self.label, time.perf_counter()))
        return False  # a true value would tell triton to skip the compile

    def _after(self, **kwargs: Any) -> None:
        if not self._started:
            return
        label, started = self._started.pop()
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(fn)
        self.events.append(CompileEvent(label, name, time.perf_counter() - started, _specialisation(fn, kwargs)))

    def summary(self) -> dict:
        """Count and total seconds, and the events as [label, kernel, ms, signature] rows."""
        return {
            "compiles": len(self.events),
            "compile_s": round(sum(event.seconds for event in self.events), 3),
            "events": [[event.label, event.kernel, round(event.seconds * 1e3, 1), event.signature]
                       for event in self.events],
        }


def _specialisation(fn: Any, kwargs: dict) -> str:
    """The compile's specialisation in words: which arguments it took as divisible by 16
    (`/16`) and which as constants (`=value`), by name where the kernel says its names."""
    compile_info = kwargs.get("compile") or {}
    jit = getattr(fn, "jit_function", None)
    names = list(getattr(jit, "arg_names", None) or [])

    def name_of(index: Any) -> str:
        position = index[0] if isinstance(index, tuple) and index else index
        return names[position] if isinstance(position, int) and position < len(names) else str(index)

    parts = []
    configs = compile_info.get("configs") or [{}]
    attrs = configs[0] if isinstance(configs[0], dict) else {}
    divisible = sorted(name_of(index) for index, values in attrs.items() if "tt.divisibility" in str(values))
    if divisible:
        parts.append("/16: " + ",".join(divisible))
    constants = compile_info.get("constants") or {}
    if isinstance(constants, dict):
        parts.append("const: " + ",".join(f"{name_of(index)}={value}" for index, value in constants.items()))
    signature = compile_info.get("signature") or {}
    if isinstance(signature, dict):  # the pointers' element types: two compiles may differ only there
        pointers = [f"{name}={kind}" for name, kind in signature.items() if str(kind).startswith("*")]
        if pointers:
            parts.append("types: " + ",".join(pointers))
    return "; ".join(parts)[:1600]
