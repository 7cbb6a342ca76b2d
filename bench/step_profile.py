"""Where one call's device time goes: its matrix products by shape, and its kernels by name.

`gemm_rows(step, peak_tflops)` profiles `step` with shapes recorded and groups its
`aten::mm` / `aten::addmm` calls by (M, K, N): calls per step, device microseconds, TFLOP/s
and the share of `peak_tflops` each shape reaches. A prefill's GEMMs are most of its FLOPs,
so this table says which shapes (and so which cuBLAS tile choices) hold it below peak.
`kernel_rows(step)` is bench/decode_profile.py's per-kernel table (launches, device time,
time on the critical path, gaps as `(idle)`) for one call: what the rest of the time is
(attention, norms, rotary, KV writes, launch gaps).

Both profile `calls` calls after one call the profiler records and discards
(`profiled_calls`): its first profiled launches carry the profiler's own start-up on the
host, which showed as a millisecond-long gap early in every prefill profile.

On a CPU (tests) the products' times are host times: there is no device to read.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

GEMM_COLUMNS = ["shape", "calls", "us", "tflops", "pct_of_peak", "pct_of_gemm_time"]
KERNEL_COLUMNS = ["kernel", "launches", "us", "critical_us", "pct_of_call"]

# op name -> (index of the [M, K] input, index of the [K, N] input) in its recorded shapes
GEMM_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2)}


def profiled_calls(step: Callable[[], object], calls: int, activities: list, record_shapes: bool = False):
    """A finished `torch.profiler.profile` of `calls` calls of `step`, run after one
    unprofiled call and one profiled call whose events are dropped (the schedule's warm-up:
    the profiler's start-up lands there, not in the calls it reports)."""
    from torch.profiler import profile, schedule

    on_device = torch.cuda.is_available()
    step()
    if on_device:
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=record_shapes,
                 schedule=schedule(wait=0, warmup=1, active=calls, repeat=1)) as prof:
        for index in range(1 + calls):
            step()
            if on_device and index in (0, calls):
                # the warm-up call's kernels end before the reported calls start (else the ones
                # still queued land in their counts), and every kernel before the trace closes
                torch.cuda.synchronize()
            prof.step()
    return prof


def gemm_rows(step: Callable[[], object], peak_tflops: float, calls: int = 2) -> list[dict[str, object]]:
    """`step`'s matrix products grouped by M x K x N, slowest total first (per call of `step`)."""
    from torch.profiler import ProfilerActivity

    on_device = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    prof = profiled_calls(step, calls, activities, record_shapes=True)
    count: collections.Counter[tuple[int, int, int]] = collections.Counter()
    time_us: collections.Counter[tuple[int, int, int]] = collections.Counter()
    for event in prof.events():
        operands = GEMM_OPERANDS.get(event.name)
        if operands is None or event.device_type != torch.autograd.DeviceType.CPU:
            continue
        shapes = event.input_shapes
        if len(shapes) <= max(operands) or len(shapes[operands[0]]) != 2 or len(shapes[operands[1]]) != 2:
            continue
        (m, k), (_, n) = shapes[operands[0]], shapes[operands[1]]
        count[m, k, n] += 1
        time_us[m, k, n] += event.device_time_total if on_device else event.cpu_time_total
    total_us = sum(time_us.values()) or 1.0
    rows = []
    for (m, k, n), us in sorted(time_us.items(), key=lambda item: -item[1]):
        tflops = 2.0 * m * k * n * count[m, k, n] / (us * 1e-6) / 1e12 if us else 0.0
        rows.append({
            "shape": f"{m}x{k}x{n}",
            "calls": round(count[m, k, n] / calls, 1),
            "us": round(us / calls, 1),
            "tflops": round(tflops, 1),
            "pct_of_peak": round(100 * tflops / peak_tflops, 1),
            "pct_of_gemm_time": round(100 * us / total_us, 1),
        })
    return rows


def kernel_rows(step: Callable[[], object], call_us: float, top: int = 24, calls: int = 2) -> list[dict[str, object]]:
    """`step`'s device kernels (CUDA only), those extending the call most first, with their share
    of `call_us` (the call's measured time)."""
    from decode_profile import kernel_table

    table, _ = kernel_table(step, calls)
    ranked = sorted(table.items(), key=lambda item: -item[1][2])[:top]
    return [
        {
            "kernel": name,
            "launches": round(launches, 1),
            "us": round(us, 1),
            "critical_us": round(critical_us, 1),
            "pct_of_call": round(100 * us / call_us, 1) if call_us else 0.0,
        }
        for name, (launches, us, critical_us) in ranked
    ]
