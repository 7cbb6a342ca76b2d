"""Fused add+RMSNorm at large shapes: the library's one-pass kernel (row held in registers)
vs its two-pass kernel (row reloaded from L2) over step widths and warps, vs torch.compile.

The sweep behind `cleave.kernels.rms_norm.RELOAD_MIN_ELEMENTS`, `RELOAD_BLOCK` and
`RELOAD_WARPS`. Both kernels are launched directly with each setting; a two-pass step as
wide as the row is the structure Inductor picks for 16384 x 4096 (one reduction step loaded
with evict_last, then loaded again with evict_first to normalise). Device microseconds per
call under CUDA-graph replay (bench/common.graph_call_us); the compiled reference is timed
before and after the sweep.

    python bench/add_rms_norm_passes.py --out bench/results/kernels
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, graph_call_us, run_name, write_results  # noqa: E402

from cleave.kernels.rms_norm import (  # noqa: E402
    _add_rms_norm_reload_kernel,
    _rms_norm_kernel,
    fused_add_rms_norm_reference,
)

SHAPES = ((16384, 4096), (4096, 4096), (16384, 2048), (4096, 8192), (16384, 8192))
COLUMNS = ("tokens", "hidden", "variant", "block", "num_warps", "us")


def one_pass(x, res, w, out, num_warps: int):
    tokens, hidden = x.shape
    return lambda: _rms_norm_kernel[(tokens,)](
        x, res, w, out, tokens, hidden, hidden, hidden, hidden, 1e-6,
        HAS_RESIDUAL=True, ROWS=1, BLOCK_H=triton.next_power_of_2(hidden), PDL=False, num_warps=num_warps,
    )


def two_pass(x, res, w, out, block: int, num_warps: int):
    tokens, hidden = x.shape
    return lambda: _add_rms_norm_reload_kernel[(tokens,)](
        x, res, w, out, hidden, hidden, hidden, 1e-6, HIDDEN=hidden, BLOCK=block, num_warps=num_warps,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rep-ms", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows: list[dict] = []

    def record(tokens: int, hidden: int, variant: str, us: float, block: int | None = None,
               num_warps: int | None = None) -> None:
        rows.append({"tokens": tokens, "hidden": hidden, "variant": variant, "block": block, "num_warps": num_warps,
                     "us": round(us, 2)})
        print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)

    for tokens, hidden in SHAPES:
        x, res, out = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        calls = 8 if tokens * hidden >= 1 << 26 else 32
        torch._dynamo.reset()
        compiled = torch.compile(fused_add_rms_norm_reference)
        record(tokens, hidden, "compiled", graph_call_us([lambda: compiled(x, res, w, 1e-6)] * calls, rep_ms=args.rep_ms))
        for num_warps in (4, 8, 16):
            us = graph_call_us([one_pass(x, res, w, out, num_warps)] * calls, rep_ms=args.rep_ms)
            record(tokens, hidden, "one_pass", us, triton.next_power_of_2(hidden), num_warps)
        for block in (1024, 2048, 4096):
            if block > hidden:
                continue
            for num_warps in (8, 16):
                us = graph_call_us([two_pass(x, res, w, out, block, num_warps)] * calls, rep_ms=args.rep_ms)
                record(tokens, hidden, "two_pass", us, block, num_warps)
        record(tokens, hidden, "compiled_again",
               graph_call_us([lambda: compiled(x, res, w, 1e-6)] * calls, rep_ms=args.rep_ms))
        del x, res, out

    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("add_rms_norm_passes"), rows, COLUMNS)


if __name__ == "__main__":
    main()
