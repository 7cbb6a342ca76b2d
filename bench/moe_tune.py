"""Tune the fused MoE layer's grouped-GEMM tiles on this GPU; write the table the layer loads.

For each token count (above `moe_gemv.MAX_TOKENS`: fewer tokens run the per-entry GEMVs),
routing from random router logits, and each BLOCK_M up to twice the entries per expert: every
gate_up candidate and every down candidate (BLOCK_N, BLOCK_K, pipeline stages; warps follow
the tile) is timed alone on the same aligned entries, and checked against the built-in
launch's output. The best pair per BLOCK_M, then the BLOCK_M with the least gate_up + down
time, is the token count's launch. The table goes to `--table-dir` (default: the package's
`cleave/kernels/moe_tuned/`, where `cleave.kernels.moe_tiles` looks for it), named for the
expert shape, dtype and device; a results file compares the whole expert layer
(`fused_experts`, CUDA-graph replayed) with the built-in launch and the tuned one in the same
run, with its TFLOP/s and share of the bf16 peak on the FLOPs of the entries it computes.

    python bench/moe_tune.py                                   # Qwen3-30B-A3B experts
    python bench/moe_tune.py --model gpt-oss-20b --tokens 64,512,8192
    python bench/moe_tune.py --model gpt-oss-20b --packed-experts   # its MXFP4 experts, read packed
    python bench/moe_tune.py --dry-run                         # tiny shapes on the CPU: checks the script

Weights are random bf16 in device memory, as in `bench/moe.py` (same shapes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

if __name__ == "__main__" and "--dry-run" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, graph_call_us, machine_info, run_name, write_results  # noqa: E402
from moe import MODELS, TINY, MoEShape, Timer, packed_weight  # noqa: E402

PEAK_FLOPS = 790e12  # H200 dense bf16
COLUMNS = ["tokens", "block_m", "gate_up", "down", "default_us", "tuned_us", "speedup", "tuned_tflops", "peak_pct",
           "candidates", "rejected"]


@dataclass(frozen=True)
class Timed:
    tiles: object  # GemmTiles
    us: float


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="16,64,256,512,1024,2048,4096,8192")
    parser.add_argument("--block-m", default="16,32,64,128", help="BLOCK_M values to try (each up to 2x per-expert)")
    parser.add_argument("--block-n", default="32,64,128,256")
    parser.add_argument("--block-k", default="64,128")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--rep-ms", type=int, default=20, help="timing window per candidate")
    parser.add_argument("--packed-experts", action="store_true",
                        help="MXFP4 experts read packed (random codes and scales); a table of their own")
    parser.add_argument("--table-dir", default=None, help="where the table goes (default: the package's moe_tuned/)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, two candidates each, on the CPU")
    args = parser.parse_args(argv)
    for name in ("tokens", "block_m", "block_n", "block_k", "stages"):
        setattr(args, name, [int(value) for value in getattr(args, name).split(",") if value])
    if args.dry_run:
        args.tokens = [8]
        args.block_m, args.block_n, args.block_k, args.stages = [16, 32], [16, 32], [32 if args.packed_experts else 16], [2]
    return args


def candidate_tiles(block_m: int, gated: bool, args: argparse.Namespace) -> list:
    """Every (BLOCK_N, BLOCK_K, stages) that fits at this BLOCK_M; 8 warps for tiles of more
    than 8192 accumulators (both halves when gated), else 4."""
    from cleave.kernels.moe_tiles import GemmTiles, fits

    tiles = []
    for block_n, block_k, stages in itertools.product(args.block_n, args.block_k, args.stages):
        warps = 8 if block_m * block_n * (2 if gated else 1) > 8192 else 4
        candidate = GemmTiles(block_n, block_k, warps, stages)
        if gated and block_n > 128:  # two accumulators of 256 columns: no register room
            continue
        if fits(block_m, candidate, gated):
            tiles.append(candidate)
    return tiles


def tune_tokens(num_tokens: int, shape: MoEShape, weights: tuple, device: torch.device, dtype: torch.dtype,
                args: argparse.Namespace, timer: Timer) -> tuple[dict, object]:
    """The best launch at `num_tokens` and its row (default vs tuned whole-layer time)."""
    from cleave.kernels.fused_moe import align_block_size, fused_experts, grouped_gemm, route
    from cleave.kernels.moe_reference import SILU
    from cleave.kernels.moe_tiles import MoELaunch, default_launch

    w13, w2, router = weights  # w13 / w2 may be MXFP4Weight
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, shape.hidden, device=device, dtype=dtype, generator=generator)
    topk_weights, ids = route(hidden @ router.t(), shape.top_k, True)
    num_entries = num_tokens * shape.top_k
    per_expert = num_entries / shape.experts
    default = default_launch(num_entries, shape.experts, shape.inter, shape.hidden)
    flat_weights = topk_weights.reshape(-1).to(torch.float32)
    intermediate = torch.empty(num_entries, shape.inter, device=device, dtype=dtype)
    per_slot = torch.empty(num_entries, shape.hidden, device=device, dtype=torch.float32)

    def run_gate_up(aligned, tiles) -> torch.Tensor:
        grouped_gemm(hidden, w13, None, intermediate, aligned, tiles, shape.top_k, SILU, None)
        return intermediate

    def run_down(aligned, tiles) -> torch.Tensor:
        grouped_gemm(expected_intermediate, w2, None, per_slot, aligned, tiles, 1, None, flat_weights)
        return per_slot

    default_aligned = align_block_size(ids, shape.experts, default.block_m)
    expected_intermediate = run_gate_up(default_aligned, default.gate_up).clone()
    expected_per_slot = run_down(default_aligned, default.down).clone()
    tolerance = {"gate_up": 0.02 * float(expected_intermediate.float().abs().max()) + 1e-6,
                 "down": 0.02 * float(expected_per_slot.abs().max()) + 1e-6}
    best: MoELaunch | None = None
    best_us = float("inf")
    candidates = rejected = 0
    for block_m in args.block_m:
        if block_m > max(16, 2 * per_expert):
            continue
        aligned = align_block_size(ids, shape.experts, block_m)
        chosen = {}
        for name, run, expected in (("gate_up", run_gate_up, expected_intermediate),
                                    ("down", run_down, expected_per_slot)):
            timed = []
            for tiles in candidate_tiles(block_m, name == "gate_up", args):
                candidates += 1
                try:
                    out = run(aligned, tiles)
                    error = float((out.float() - expected.float()).abs().max())
                except Exception as failure:  # noqa: BLE001 - a tile that fails to compile or launch is skipped
                    print(f"  {num_tokens} tokens, BLOCK_M {block_m}, {name} {tiles}: {type(failure).__name__}")
                    rejected += 1
                    continue
                if error > tolerance[name]:
                    print(f"  {num_tokens} tokens, BLOCK_M {block_m}, {name} {tiles}: off by {error:.3g}")
                    rejected += 1
                    continue
                timed.append(Timed(tiles, timer.us(lambda: run(aligned, tiles))))  # noqa: B023
            if timed:
                chosen[name] = min(timed, key=lambda item: item.us)
        if len(chosen) == 2 and chosen["gate_up"].us + chosen["down"].us < best_us:
            best_us = chosen["gate_up"].us + chosen["down"].us
            best = MoELaunch(block_m, chosen["gate_up"].tiles, chosen["down"].tiles)
    if best is None:
        raise SystemExit(f"no candidate launch ran correctly at {num_tokens} tokens")

    def layer_us(launch: MoELaunch) -> float:
        def call() -> torch.Tensor:
            return fused_experts(hidden, w13, w2, topk_weights, ids, kernel="grouped", launch=launch)
        return graph_call_us([call]) if device.type == "cuda" else timer.us(call)

    default_us, tuned_us = layer_us(default), layer_us(best)
    flops = 2 * num_entries * shape.hidden * shape.inter * 3  # gate, up and down per entry
    row = {
        "tokens": num_tokens, "block_m": best.block_m, "gate_up": _tiles_text(best.gate_up),
        "down": _tiles_text(best.down), "default_us": default_us, "tuned_us": tuned_us,
        "speedup": default_us / tuned_us, "tuned_tflops": flops / tuned_us / 1e6,
        "peak_pct": 100 * flops / (tuned_us * 1e-6) / PEAK_FLOPS, "candidates": candidates, "rejected": rejected,
    }
    return row, best


def _tiles_text(tiles) -> str:  # noqa: ANN001
    return f"{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    from cleave.kernels.moe_tiles import TUNED_DIR, tuned_file_name

    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench/moe_tune.py needs a CUDA device (or --dry-run for tiny shapes on the CPU)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.dry_run else MODELS[args.model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    if args.packed_experts:
        w13, w2 = (packed_weight(shape.experts, rows, columns, device, generator)
                   for rows, columns in ((2 * shape.inter, shape.hidden), (shape.hidden, shape.inter)))
    else:
        w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device, dtype=dtype, generator=generator)
        w13 *= shape.hidden**-0.5
        w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device=device, dtype=dtype, generator=generator)
        w2 *= shape.inter**-0.5
    router = torch.randn(shape.experts, shape.hidden, device=device, dtype=dtype, generator=generator) * 0.1
    timer = Timer(device, warmup_ms=5, rep_ms=args.rep_ms)
    rows, launches = [], {}
    command = ["bench/moe_tune.py", *(argv if argv is not None else sys.argv[1:])]
    machine = machine_info()
    table_dir = Path(args.table_dir) if args.table_dir else TUNED_DIR
    table_dir.mkdir(parents=True, exist_ok=True)
    table_path = table_dir / tuned_file_name(shape.experts, shape.inter, shape.hidden, dtype, machine.device,
                                             args.packed_experts)
    name = run_name("moe-tune")
    for num_tokens in args.tokens:
        row, launch = tune_tokens(num_tokens, shape, (w13, w2, router), device, dtype, args, timer)
        rows.append(row)
        launches[str(num_tokens)] = launch.to_json()
        print(format_table([row], COLUMNS), flush=True)
        # written after every token count, so a run cut short leaves the counts it finished
        table_path.write_text(json.dumps({
            "device": machine.device, "shape": asdict(shape), "command": "python " + " ".join(command),
            "date": machine.date, "code": machine.code, "results": f"bench/results/moe/{name}.md",
            "launches": launches,
        }, indent=1) + "\n")
    print(format_table(rows, COLUMNS))
    write_results(args.out, name, rows, COLUMNS, summary={"shape": asdict(shape), "table": table_path.name},
                  argv=command)
    return rows


if __name__ == "__main__":
    main()
