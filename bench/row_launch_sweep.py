"""Launch shapes of the row-wise norm kernels: rows per program x warps, timed per shape.

Times fused add+RMSNorm (the hottest row kernel) with every (rows, num_warps) pair for the
given [tokens, hidden] shapes, beside `row_launch`'s own pick and torch.compile of the
reference, so the pick in `cleave.kernels.dispatch.row_launch` can be checked on a card.

    python bench/row_launch_sweep.py --shapes 16384x4096 4096x4096 16384x8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import copy_bandwidth_gbs, format_table, graph_call_us, write_results  # noqa: E402

from cleave.kernels.dispatch import row_launch  # noqa: E402
from cleave.kernels.rms_norm import _rms_norm_launcher, fused_add_rms_norm_reference  # noqa: E402

COLUMNS = ["shape", "rows", "num_warps", "picked", "us", "pct_copy"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["16384x4096", "4096x4096"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    results = []
    for shape in args.shapes:
        tokens, hidden = map(int, shape.split("x"))
        moved = 4 * tokens * hidden * 2  # bf16: read x and residual, write residual and out
        sets = [(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
                 torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
                 torch.randn(hidden, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
        out = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        picked = row_launch(tokens, hidden)

        def record(rows: int | str, warps: int | str, us: float) -> None:
            is_pick = rows == picked.rows and warps == picked.num_warps
            results.append({"shape": shape, "rows": rows, "num_warps": warps, "picked": "yes" if is_pick else "",
                            "us": round(us, 2), "pct_copy": round(100 * moved / (us * 1e-6) / 1e9 / copy_gbs, 1)})
            print(format_table(results[-1:], COLUMNS).splitlines()[-1], flush=True)

        compiled = torch.compile(fused_add_rms_norm_reference)
        record("compiled", "-", graph_call_us([lambda s=s: compiled(s[0], s[1], s[2], 1e-5) for s in sets * 4]))
        for rows in args.rows:
            for warps in args.num_warps:
                block = picked.block
                grid = (triton.cdiv(tokens, rows),)

                def call(s, rows=rows, warps=warps, grid=grid, block=block):
                    _rms_norm_launcher(grid, (s[0], s[1], s[2], out, tokens, hidden, hidden, hidden, hidden, 1e-5),
                                       (True, rows, block), warps)

                record(rows, warps, graph_call_us([lambda s=s: call(s) for s in sets * 4]))
    print(format_table(results, COLUMNS))
    if args.out:
        write_results(args.out, "row_launch_sweep", results, COLUMNS, {"copy_bandwidth_gbs": round(copy_gbs, 1)})


if __name__ == "__main__":
    main()
