"""Decode-batch projections: the weight-streaming Triton GEMV vs cuBLAS (F.linear).

For the Llama-3.2-1B projections (qkv, o, gate_up with fused SwiGLU, down, lm_head) at
1-16 rows, times each implementation inside CUDA graphs over enough weight copies that
every call streams its weight from HBM, over a sweep of tile settings, and reports
microseconds and the fraction of the roofline (weight bytes / 4.26 TB/s).

    python bench/small_linear.py --rows 1 8 --out bench/results/kernels
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, graph_call_us, run_name, write_results  # noqa: E402

from cleave.kernels.activation import silu_and_mul  # noqa: E402
from cleave.kernels.small_linear import small_linear  # noqa: E402

COLUMNS = ["shape", "rows", "impl", "block_n", "block_k", "num_warps", "num_stages", "us", "roofline_pct"]
SHAPES = {"qkv": (3072, 2048, False), "o": (2048, 2048, False), "gate_up": (16384, 2048, True),
          "down": (2048, 8192, False), "lm_head": (128256, 2048, False)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--block-k", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4])
    parser.add_argument("--num-stages", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--hbm-tbs", type=float, default=4.26)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    rows_out = []
    for name in args.shapes:
        num_out, num_in, gated = SHAPES[name]
        weight_bytes = num_out * num_in * 2
        copies = max(1, min(32, (512 << 20) // weight_bytes))
        weights = [torch.randn(num_out, num_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(rows, num_in, device="cuda", dtype=torch.bfloat16)

            def record(impl: str, us: float, **settings) -> None:
                rows_out.append({"shape": name, "rows": rows, "impl": impl, **settings, "us": round(us, 2),
                                 "roofline_pct": round(100 * weight_bytes / (us * 1e-6) / (args.hbm_tbs * 1e12), 1)})
                print(format_table(rows_out[-1:], COLUMNS).splitlines()[-1], flush=True)

            if gated:
                record("cublas+silu_and_mul", graph_call_us([lambda w=w: silu_and_mul(F.linear(x, w)) for w in weights]))
            else:
                record("cublas", graph_call_us([lambda w=w: F.linear(x, w) for w in weights]))
            for block_n, block_k, warps, stages in itertools.product(
                args.block_n, args.block_k, args.num_warps, args.num_stages
            ):
                settings = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
                try:
                    us = graph_call_us([lambda w=w: small_linear(x, w, gated=gated, **settings) for w in weights])
                except Exception as error:  # noqa: BLE001 - an infeasible tile (shared memory) is skipped
                    print(f"skip {name} {settings}: {type(error).__name__}", flush=True)
                    continue
                record("triton", us, **settings)
        del weights
    print(format_table(rows_out, COLUMNS))
    if args.out:
        write_results(args.out, run_name("small_linear"), rows_out, COLUMNS)


if __name__ == "__main__":
    main()
