"""Benchmark cleave's fused Triton ops against torch eager and torch.compile of the reference.

For each op, hidden size and token count (bf16) it reports device microseconds per call
(CUDA-graph replay over rotating input sets, so large shapes stream from HBM), the effective
bandwidth (bytes an ideal kernel must read + write, over time), that bandwidth as a percent of
a measured device copy, and for small token counts the host wall-clock microseconds per call.
Each implementation is measured `--rounds` times, the implementations taking turns in a
rotated order, and the median is reported, so drift of the machine during a run does not
decide a comparison.

    python bench/fused_kernels.py --out bench/results/kernels
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbs, format_table, graph_call_us, host_call_us, run_name, write_results  # noqa: E402

from cleave.kernels.activation import (  # noqa: E402
    gelu_bias,
    gelu_bias_reference,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from cleave.kernels.layer_norm import (  # noqa: E402
    fused_add_layer_norm,
    fused_add_layer_norm_reference,
    layer_norm,
    layer_norm_reference,
)
from cleave.kernels.rms_norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from cleave.kernels.rotary import apply_rotary, apply_rotary_reference  # noqa: E402

HIDDEN_SIZES = (1024, 2048, 4096, 8192)
TOKEN_COUNTS = (1, 16, 64, 256, 1024, 4096, 16384)
SMALL_TOKENS = 64  # host per-call time is measured up to this many tokens
HEAD_DIM = 128
MAX_POSITION = 32768
BF16 = 2  # bytes


@dataclass(frozen=True)
class OpSpec:
    """One op: its inputs for (tokens, hidden), its Triton and reference callables, its bytes."""

    name: str
    make_inputs: Callable[[int, int], tuple]
    triton: Callable
    reference: Callable
    bytes_moved: Callable[[int, int], int]


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")


def _rotary_heads(hidden: int) -> tuple[int, int]:
    num_q_heads = hidden // HEAD_DIM
    return num_q_heads, max(1, num_q_heads // 4)


def _rotary_inputs(tokens: int, hidden: int) -> tuple:
    num_q, num_kv = _rotary_heads(hidden)
    qkv = _randn(tokens, (num_q + 2 * num_kv) * HEAD_DIM)  # fused projection output
    query = qkv[:, : num_q * HEAD_DIM].view(tokens, num_q, HEAD_DIM)
    key = qkv[:, num_q * HEAD_DIM : (num_q + num_kv) * HEAD_DIM].view(tokens, num_kv, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda")
    angles = torch.rand(MAX_POSITION, HEAD_DIM // 2, device="cuda") * 6.2832
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [P, D]: a true rotation
    return query, key, positions, cache, True


def _rotary_bytes(tokens: int, hidden: int) -> int:
    num_q, num_kv = _rotary_heads(hidden)
    return tokens * (2 * (num_q + num_kv) * HEAD_DIM * BF16 + HEAD_DIM * 4 + 8)


OPS = (
    OpSpec(
        "rms_norm",
        lambda t, h: (_randn(t, h), _randn(h), 1e-6),
        lambda *a: rms_norm(*a, impl="triton"),
        rms_norm_reference,
        lambda t, h: (2 * t * h + h) * BF16,
    ),
    OpSpec(
        "add_rms_norm",
        lambda t, h: (_randn(t, h), _randn(t, h), _randn(h), 1e-6),
        lambda *a: fused_add_rms_norm(*a, impl="triton"),
        fused_add_rms_norm_reference,
        lambda t, h: (4 * t * h + h) * BF16,
    ),
    OpSpec(
        "layer_norm",
        lambda t, h: (_randn(t, h), _randn(h), _randn(h), 1e-5),
        lambda *a: layer_norm(*a, impl="triton"),
        layer_norm_reference,
        lambda t, h: (2 * t * h + 2 * h) * BF16,
    ),
    OpSpec(
        "add_layer_norm",
        lambda t, h: (_randn(t, h), _randn(t, h), _randn(h), _randn(h), 1e-5),
        lambda *a: fused_add_layer_norm(*a, impl="triton"),
        fused_add_layer_norm_reference,
        lambda t, h: (4 * t * h + 2 * h) * BF16,
    ),
    OpSpec(
        "silu_and_mul",
        lambda t, h: (_randn(t, 2 * h),),
        lambda *a: silu_and_mul(*a, impl="triton"),
        silu_and_mul_reference,
        lambda t, h: 3 * t * h * BF16,
    ),
    OpSpec(
        "gelu_tanh_and_mul",
        lambda t, h: (_randn(t, 2 * h),),
        lambda *a: gelu_tanh_and_mul(*a, impl="triton"),
        gelu_tanh_and_mul_reference,
        lambda t, h: 3 * t * h * BF16,
    ),
    OpSpec(
        "gelu_bias",
        lambda t, h: (_randn(t, h), _randn(h)),
        lambda *a: gelu_bias(*a, impl="triton"),
        gelu_bias_reference,
        lambda t, h: (2 * t * h + h) * BF16,
    ),
    OpSpec(
        "rotary",
        _rotary_inputs,
        lambda *a: apply_rotary(*a, impl="triton"),
        apply_rotary_reference,
        _rotary_bytes,
    ),
)
IMPLS = ("triton", "eager", "compiled")
COLUMNS = (
    "op", "hidden", "tokens", "triton_us", "eager_us", "compiled_us", "triton_gbs", "triton_pct_copy",
    "compiled_pct_copy", "triton_call_us", "eager_call_us", "compiled_call_us",
)


def _input_sets(spec: OpSpec, tokens: int, hidden: int, l2_bytes: int) -> tuple[list[tuple], int]:
    """Enough input sets to cycle past L2, and how many calls one graph replay makes."""
    set_bytes = spec.bytes_moved(tokens, hidden)
    num_sets = max(1, min(16, math.ceil(3 * l2_bytes / set_bytes)))
    calls = max(num_sets, min(256, math.ceil((512 << 20) / set_bytes)))
    calls = math.ceil(calls / num_sets) * num_sets
    return [spec.make_inputs(tokens, hidden) for _ in range(num_sets)], calls


def _measure(fn: Callable, sets: list[tuple], calls: int, tokens: int, rep_ms: int) -> tuple[float, float | None]:
    device_us = graph_call_us([lambda i=i: fn(*sets[i % len(sets)]) for i in range(calls)], rep_ms=rep_ms)
    host_us = host_call_us(lambda: fn(*sets[0])) if tokens <= SMALL_TOKENS else None
    return device_us, host_us


def run(args: argparse.Namespace) -> tuple[list[dict], float]:
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    specs = [spec for spec in OPS if spec.name in args.ops]
    rows = []
    for hidden in args.hidden:
        # compiled references for static shapes (their best case): one compilation per shape
        torch._dynamo.reset()
        compiled = {spec.name: torch.compile(spec.reference, dynamic=False) for spec in specs}
        for spec in specs:
            for tokens in args.tokens:
                row: dict = {"op": spec.name, "hidden": hidden, "tokens": tokens}
                sets, calls = _input_sets(spec, tokens, hidden, l2_bytes)
                impls = {"triton": spec.triton, "eager": spec.reference, "compiled": compiled[spec.name]}
                samples: dict[str, list[float]] = {impl: [] for impl in args.impls}
                host: dict[str, list[float]] = {impl: [] for impl in args.impls}
                failed: set[str] = set()
                for round_index in range(args.rounds):
                    # the implementations take turns, in a rotated order each round, so clock
                    # and thermal drift during the run (and the host's noise, for the per-call
                    # times) do not favour one of them
                    shift = round_index % len(args.impls)
                    for impl in args.impls[shift:] + args.impls[:shift]:
                        if impl in failed:
                            continue
                        try:
                            device_us, host_us = _measure(impls[impl], sets, calls, tokens, args.rep_ms)
                        except Exception:  # one failing variant must not lose the rest of the run
                            traceback.print_exc()
                            failed.add(impl)
                            continue
                        samples[impl].append(device_us)
                        if host_us is not None:
                            host[impl].append(host_us)
                for impl in args.impls:
                    if not samples[impl]:
                        continue
                    device_us = statistics.median(samples[impl])
                    host_us = statistics.median(host[impl]) if host[impl] else None
                    gbs = spec.bytes_moved(tokens, hidden) / (device_us * 1e-6) / 1e9
                    row[f"{impl}_us"] = device_us
                    row[f"{impl}_gbs"] = gbs
                    row[f"{impl}_pct_copy"] = 100 * gbs / copy_gbs
                    row[f"{impl}_call_us"] = host_us
                rows.append(row)
                print(format_table([row], COLUMNS).splitlines()[-1], flush=True)
                del sets
        torch.cuda.empty_cache()
    return rows, copy_gbs


def check_targets(rows: list[dict]) -> list[str]:
    """The targets this benchmark exists for, as PASS/FAIL lines."""
    lines = []
    for row in rows:
        if row["op"] in ("add_rms_norm", "silu_and_mul") and row["tokens"] >= 4096 and row["hidden"] == 4096:
            pct, ours, comp = row.get("triton_pct_copy"), row.get("triton_us"), row.get("compiled_us")
            ok = pct is not None and pct >= 85 and (comp is None or ours <= comp)
            lines.append(f"{'PASS' if ok else 'FAIL'} {row['op']} T={row['tokens']} H=4096: {pct:.1f}% of copy, "
                         f"{ours:.1f} us vs compiled {comp if comp is None else round(comp, 1)} us")
        if row.get("triton_call_us") is not None:
            ours = row["triton_call_us"]
            others = [row.get("eager_call_us"), row.get("compiled_call_us")]
            ok = all(other is None or ours < other for other in others)
            if not ok:
                lines.append(f"FAIL per-call {row['op']} H={row['hidden']} T={row['tokens']}: {ours:.1f} us vs "
                             f"eager {others[0]} / compiled {others[1]}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN_SIZES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_COUNTS))
    parser.add_argument("--ops", nargs="+", default=[spec.name for spec in OPS], choices=[s.name for s in OPS])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per measurement")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measurements per implementation, taken in turns; the median is reported")
    parser.add_argument("--out", type=Path, default=None, help="directory for NAME-<UTC time>.json / .md")
    parser.add_argument("--name", default="kernels", help="result file stem under --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/fused_kernels.py needs a CUDA device")
    rows, copy_gbs = run(args)
    print(format_table(rows, COLUMNS))
    checks = check_targets(rows)
    print("\n".join(checks))
    if args.out is not None:
        summary = {"copy_bandwidth_gbs": round(copy_gbs, 1), "checks": checks}
        for path in write_results(args.out, run_name(args.name), rows, COLUMNS, summary):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
