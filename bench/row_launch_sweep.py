"""Launch shapes of the row-wise and elementwise kernels, timed per shape.

`--op add_rms_norm` (the hottest row kernel) tries every (rows per program, num_warps) pair;
`--op silu_and_mul` (the gated-MLP activation, an elementwise op over [tokens, I] outputs)
every (column block, num_warps) pair. Each runs for the given [tokens, width] shapes beside
the launch `cleave.kernels.dispatch` picks (`row_launch`, `tile_launch`) and torch.compile
of the reference, compiled for static shapes (its best case), so the picks can be checked
on a card.

    python bench/row_launch_sweep.py --shapes 16384x4096 4096x4096 16384x8192
    python bench/row_launch_sweep.py --op silu_and_mul --shapes 4096x4096 16384x4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import copy_bandwidth_gbs, format_table, graph_call_us, run_name, write_results  # noqa: E402

from cleave.kernels.activation import _gated_act_launcher, silu_and_mul_reference  # noqa: E402
from cleave.kernels.dispatch import row_launch, tile_launch  # noqa: E402
from cleave.kernels.rms_norm import _rms_norm_launcher, fused_add_rms_norm_reference  # noqa: E402

COLUMNS = ["shape", "rows", "block", "num_warps", "picked", "us", "pct_copy"]


def sweep_silu_and_mul(shape: str, tokens: int, inter: int, args: argparse.Namespace, record) -> None:
    """SiLU-and-mul [tokens, 2I] -> [tokens, I] over column blocks x warps."""
    sets = [torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    out = torch.empty(tokens, inter, device="cuda", dtype=torch.bfloat16)
    picked = tile_launch(tokens, inter)
    moved = 3 * tokens * inter * 2  # bf16: read gate and up, write out
    compiled = torch.compile(silu_and_mul_reference, dynamic=False)
    record(moved, "compiled", "-", "-", False, graph_call_us([lambda x=x: compiled(x) for x in sets * 4]))
    for block in args.blocks:
        for warps in args.num_warps:
            if block // (warps * 32) < 1:
                continue

            def call(x, block=block, warps=warps):
                _gated_act_launcher((tokens, triton.cdiv(inter, block)), (x, out, inter, 2 * inter, inter),
                                    (False, block), warps)

            us = graph_call_us([lambda x=x: call(x) for x in sets * 4])
            record(moved, 1, block, warps, block == picked.block and warps == picked.num_warps, us)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=["add_rms_norm", "silu_and_mul"], default="add_rms_norm")
    parser.add_argument("--shapes", nargs="+", default=["16384x4096", "4096x4096"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="column blocks tried for silu_and_mul")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    results = []
    for shape in args.shapes:
        tokens, hidden = map(int, shape.split("x"))

        def record(moved: int, rows: int | str, block: int | str, warps: int | str, is_pick: bool, us: float) -> None:
            results.append({"shape": shape, "rows": rows, "block": block, "num_warps": warps,
                            "picked": "yes" if is_pick else "", "us": round(us, 2),
                            "pct_copy": round(100 * moved / (us * 1e-6) / 1e9 / copy_gbs, 1)})
            print(format_table(results[-1:], COLUMNS).splitlines()[-1], flush=True)

        if args.op == "silu_and_mul":
            sweep_silu_and_mul(shape, tokens, hidden, args, record)
            continue
        moved = 4 * tokens * hidden * 2  # bf16: read x and residual, write residual and out
        sets = [(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
                 torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
                 torch.randn(hidden, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
        out = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        picked = row_launch(tokens, hidden)
        compiled = torch.compile(fused_add_rms_norm_reference, dynamic=False)
        record(moved, "compiled", "-", "-", False,
               graph_call_us([lambda s=s: compiled(s[0], s[1], s[2], 1e-5) for s in sets * 4]))
        for rows in args.rows:
            for warps in args.num_warps:
                block = picked.block
                grid = (triton.cdiv(tokens, rows),)

                def call(s, rows=rows, warps=warps, grid=grid, block=block):
                    _rms_norm_launcher(grid, (s[0], s[1], s[2], out, tokens, hidden, hidden, hidden, hidden, 1e-5),
                                       (True, rows, block), warps)

                us = graph_call_us([lambda s=s: call(s) for s in sets * 4])
                record(moved, rows, block, warps, rows == picked.rows and warps == picked.num_warps, us)
    print(format_table(results, COLUMNS))
    if args.out:
        name = "row_launch_sweep" if args.op == "add_rms_norm" else f"launch_sweep_{args.op}"
        write_results(args.out, run_name(name), results, COLUMNS, {"copy_bandwidth_gbs": round(copy_gbs, 1)})


if __name__ == "__main__":
    main()
