"""Paged prefill attention alone: achieved TFLOP/s over tile, warp and pipeline settings.

For each prompt length of a Llama-3.2-1B-shaped layer (32 query heads, 8 KV heads, head_dim
64; `--heads 32:4:128` for Qwen3-30B-A3B's), one sequence without a cached prefix, bf16,
16-token blocks on shuffled block ids, times `paged_prefill_attention` inside a CUDA graph
(device time) for every combination of `--block-m`, `--block-n`, `--num-warps` and
`--num-stages` and of the kernel's launch options (`--pack-gqa`, `--heavy-first`,
`--causal-split`: see `cleave.kernels.attention_prefill`), and reports microseconds, TFLOP/s
(causal: 2 x 2 x T^2 / 2 x Hq x D) and the share of `--peak-tflops`. The first combination of
the defaults is what the engine runs for that head size (`prefill_launch_for`). Each prompt length also gets a row for torch's
`scaled_dot_product_attention` on contiguous [1, Hq, T, D] tensors with the KV heads repeated
(transformers' sdpa path: the baseline a user would otherwise run), and one for each other
`--sdpa` variant: an SDPA backend (`auto`: torch's choice, `flash`, `cudnn`, `efficient`),
with `+gqa` for the KV heads left unrepeated under SDPA's `enable_gqa` (what
`PrefillLaunch.dense_backend` / `dense_gqa` would run). One layer's share of an 8192-token
prefill: multiply by the layer count (16 for the 1B).

    python bench/attention_prefill.py --tokens 2048 8192 --out bench/results/prefill
    python bench/attention_prefill.py --tokens 8192 --block-m 64 128 --block-n 32 64 --num-warps 4 8 --num-stages 2 3 4
    python bench/attention_prefill.py --tokens 8192 --block-m 64 128 --num-warps 4 8 --pack-gqa off on \
        --heavy-first off on --causal-split off on
    python bench/attention_prefill.py --tokens 8192 --sdpa auto cudnn flash auto+gqa cudnn+gqa
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, graph_call_us, parse_heads, run_name, write_results  # noqa: E402

from cleave.kernels.attention_prefill import prefill_launch_for  # noqa: E402

COLUMNS = ["heads", "tokens", "kernel", "block_m", "block_n", "num_warps", "num_stages", "pack_gqa", "heavy_first",
           "causal_split", "us", "tflops", "peak_pct"]
BLOCK_SIZE = 16
SWITCHES = {"off": False, "on": True}


def causal_flops(tokens: int, q_heads: int, head_dim: int) -> float:
    """QK^T and PV over the lower triangle of one sequence's prompt."""
    return 2 * 2 * tokens * tokens / 2 * q_heads * head_dim


def sdpa_call(query: torch.Tensor, kv_heads: int, variant: str = "auto"):  # noqa: ANN201
    """torch's causal SDPA on [1, Hq, T, D] query, key and value (KV heads repeated, as
    transformers' sdpa attention runs a GQA model, unless `variant` ends in "+gqa"), on the
    backend `variant` names (`attention_fresh.SDPA_BACKENDS`, or "auto"); key and value are random."""
    from cleave.kernels.attention_fresh import SDPA_BACKENDS
    from torch.nn.attention import sdpa_kernel

    backend, _, gqa = variant.partition("+")
    tokens, q_heads, head_dim = query.shape
    q = query.transpose(0, 1).unsqueeze(0).contiguous()
    kv = torch.randn(2, 1, kv_heads, tokens, head_dim, dtype=query.dtype, device=query.device)
    k, v = (t.repeat_interleave(1 if gqa else q_heads // kv_heads, dim=1).contiguous() for t in kv)

    def call() -> torch.Tensor:
        with contextlib.nullcontext() if backend == "auto" else sdpa_kernel(SDPA_BACKENDS[backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=bool(gqa))

    return call


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--heads", type=parse_heads, default="32:8:64", help="query heads:KV heads:head dim")
    # left out: what the engine runs for --heads' head size (`prefill_launch_for`)
    parser.add_argument("--block-m", type=int, nargs="+")
    parser.add_argument("--block-n", type=int, nargs="+")
    parser.add_argument("--num-warps", type=int, nargs="+")
    parser.add_argument("--num-stages", type=int, nargs="+", help="0: triton's default")
    for option in ("--pack-gqa", "--heavy-first", "--causal-split"):
        parser.add_argument(option, nargs="+", choices=sorted(SWITCHES))
    parser.add_argument("--sdpa", nargs="+", default=["auto"],
                        help="torch SDPA rows: auto, flash, cudnn, efficient, each with +gqa for unrepeated KV heads")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul peak of the device")
    parser.add_argument("--out", default=None, help="directory for attention_prefill-<UTC time>.json / .md")
    args = parser.parse_args(argv)
    engine = prefill_launch_for(args.heads[2])
    for name in ("block_m", "block_n", "num_warps"):
        if getattr(args, name) is None:
            setattr(args, name, [getattr(engine, name)])
    args.num_stages = args.num_stages or [engine.num_stages or 0]
    for name in ("pack_gqa", "heavy_first", "causal_split"):
        if getattr(args, name) is None:
            setattr(args, name, ["on" if getattr(engine, name) else "off"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cleave.kernels.attention_prefill import paged_prefill_attention
    from cleave.kv.metadata import AttentionMetadata

    device = torch.device("cuda")
    q_heads, kv_heads, head_dim = args.heads
    heads = f"{q_heads}:{kv_heads}:{head_dim}"
    rows = []
    for tokens in args.tokens:
        num_blocks = -(-tokens // BLOCK_SIZE)
        blocks = list(range(1, num_blocks + 1))
        random.Random(tokens).shuffle(blocks)
        cache = torch.randn(2, num_blocks + 1, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
        query = torch.randn(tokens, q_heads, head_dim, dtype=torch.bfloat16, device=device)
        metadata = AttentionMetadata.build([tokens], [tokens], [blocks], BLOCK_SIZE, device=device)
        flops = causal_flops(tokens, q_heads, head_dim)

        def add_row(us: float | str, **setting) -> None:
            row = {"heads": heads, "tokens": tokens, **setting, "us": us}
            if isinstance(us, float):
                tflops = flops / (us * 1e-6) / 1e12
                row.update(us=round(us, 1), tflops=round(tflops, 1), peak_pct=round(100 * tflops / args.peak_tflops, 1))
            rows.append(row)
            print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)

        for block_m, block_n, warps, stages, pack, heavy, split in itertools.product(
            args.block_m, args.block_n, args.num_warps, args.num_stages, args.pack_gqa, args.heavy_first,
            args.causal_split,
        ):
            setting = {"kernel": "cleave", "block_m": block_m, "block_n": block_n, "num_warps": warps,
                       "num_stages": stages or "-", "pack_gqa": pack, "heavy_first": heavy, "causal_split": split}

            def call() -> torch.Tensor:
                return paged_prefill_attention(
                    query, cache, metadata, head_dim**-0.5, block_m=block_m, block_n=block_n, num_warps=warps,
                    num_stages=stages or None, pack_gqa=SWITCHES[pack], heavy_first=SWITCHES[heavy],
                    causal_split=SWITCHES[split],
                )

            try:
                us = graph_call_us([call])
            except Exception as error:  # noqa: BLE001 - a setting that does not compile is a row
                add_row(type(error).__name__, **setting)
                continue
            add_row(us, **setting)
        for variant in args.sdpa:
            kernel = "torch sdpa" if variant == "auto" else f"torch sdpa {variant}"
            try:
                add_row(graph_call_us([sdpa_call(query, kv_heads, variant)]), kernel=kernel)
            except Exception as error:  # noqa: BLE001 - a backend the device lacks is a row
                add_row(type(error).__name__, kernel=kernel)
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("attention_prefill"), rows, COLUMNS, {"peak_tflops": args.peak_tflops})
    return 0


if __name__ == "__main__":
    sys.exit(main())
