"""Paged decode attention alone: achieved KV bandwidth over split counts and tile settings.

For each (batch, context) of a Llama-3.2-1B-shaped layer (32 query heads, 8 KV heads,
head_dim 64; `--heads 32:4:128` is Qwen3-30B-A3B's; bf16, 16-token blocks on shuffled block
ids), times `paged_decode_attention`
inside a CUDA graph (so the number is device time, not launch overhead; with zeroed split
counters, as the decode graphs give them, so no memset is timed with it; small cases rotate
over disjoint block sets bigger than L2 together, so KV comes from HBM) with the default
split count and with the settings given on the command line, and reports microseconds and
the fraction of the HBM roofline (K and V bytes read / 4.26 TB/s).

    python bench/attention_decode.py --cases 1x1024,64x1024,32x32768 --out bench/results/decode
    python bench/attention_decode.py --heads 32:4:128 --cases 1x1024 --capacity 1025 --splits auto,8,16,64
    python bench/attention_decode.py --heads 32:4:128 --cases 1x1024 --capacity 40960 --num-warps 2 --heads-first auto,on
    python bench/attention_decode.py --cases 256x1024,32x32768 --kv-cache-dtypes auto,fp8   # an fp8 cache's reads

`--heads-first` sets the grid order (KV head fastest, or split fastest; auto: the kernel's
choice, KV head fastest from two sequences on). `--fused rotary,head-norms` times the kernel as
the decode step launches it at small batches: it also rotates the query and the new key and
writes the new key and value into the cache (`NewKV`), with Qwen3's per-head q/k norms first
(`head-norms`).

    python bench/attention_decode.py --heads 32:4:128 --cases 1x1024 --capacity 40960 \
        --fused none,head-norms --num-warps 2,4,8 --splits auto,8,16
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, graph_call_us, parse_heads, run_name, write_results  # noqa: E402

from cleave.kernels.attention_decode import (  # noqa: E402
    MAX_SPLITS,
    NUM_STAGES,
    HeadNorms,
    NewKV,
    choose_num_splits,
    decode_num_warps,
    merge_block_s,
    paged_decode_attention,
)
from cleave.kernels.kv_cache_dtype import resolve_kv_cache_dtype, to_cache_dtype  # noqa: E402
from cleave.kv.metadata import AttentionMetadata, zeroed_split_counters  # noqa: E402

COLUMNS = ["heads", "kv_dtype", "layout", "batch", "context", "fused", "num_splits", "block_n", "num_warps", "num_stages", "heads_first", "us",
           "kv_gb", "roofline_pct"]
HEADS_FIRST = {"auto": None, "on": True, "off": False}
FUSED = ("none", "rotary", "head-norms")
# Where a cache element lives, as the dims of the allocation the [2, blocks, slots, KV heads, D]
# view the kernel takes is a permutation of: "nhd" is that order itself (a block's slots hold
# every head side by side), "hnd" puts each head's slots of a block side by side, "block-hnd"
# also puts a block's K and V side by side.
LAYOUTS = {
    "nhd": ((2, "blocks", "slots", "heads", "dim"), (0, 1, 2, 3, 4)),
    "hnd": ((2, "blocks", "heads", "slots", "dim"), (0, 1, 3, 2, 4)),
    "block-hnd": (("blocks", 2, "heads", "slots", "dim"), (1, 0, 3, 2, 4)),
}
BLOCK_SIZE = 16


def parse_ints(text: str) -> list[int | None]:
    return [None if item == "auto" else int(item) for item in text.split(",")]


def parse_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """Comma-separated values, each one of `allowed` (ArgumentTypeError naming `what` else)."""
    values = text.split(",")
    unknown = [value for value in values if value not in allowed]
    if unknown:
        listing = ", ".join(allowed[:-1]) + " or " + allowed[-1]
        raise argparse.ArgumentTypeError(f"{what} are {listing}, got {', '.join(unknown)}")
    return values


def parse_orders(text: str) -> list[str]:
    """`--heads-first`: grid orders, each auto, on or off."""
    return parse_choices(text, list(HEADS_FIRST), "grid orders")


def parse_fused(text: str) -> list[str]:
    """`--fused`: kinds of launch, each none, rotary or head-norms."""
    return parse_choices(text, FUSED, "fused launches")


def parse_layouts(text: str) -> list[str]:
    """`--layouts`: cache layouts, each one of LAYOUTS."""
    return parse_choices(text, list(LAYOUTS), "cache layouts")


def cache_in_layout(layout: str, num_blocks: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A random [2, num_blocks, BLOCK_SIZE, kv_heads, head_dim] cache of `kv_dtype`, a view of an
    allocation laid out as `layout` says."""
    order, permutation = LAYOUTS[layout]
    sizes = {"blocks": num_blocks, "slots": BLOCK_SIZE, "heads": kv_heads, "dim": head_dim}
    shape = [sizes.get(dim, dim) for dim in order]
    stored = to_cache_dtype(torch.randn(*shape, dtype=torch.bfloat16, device=device), kv_dtype)
    return stored.permute(*permutation)


def new_kv_for(kind: str, metadata: AttentionMetadata, context: int, query: torch.Tensor,
               kv_heads: int, capacity: int) -> NewKV | None:
    """The `NewKV` a decode step passes for `kind`: each sequence's newest position (context - 1)
    rotated and written to its slot in `metadata`'s tables, head norms first for head-norms."""
    if kind == "none":
        return None
    batch, _, head_dim = query.shape
    device = query.device
    position = context - 1
    tables = metadata.block_tables[:, position // BLOCK_SIZE].to(torch.int64)  # [B]
    slots = tables * BLOCK_SIZE + position % BLOCK_SIZE
    angles = torch.outer(torch.arange(capacity, device=device, dtype=torch.float32),
                         10000.0 ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    head_norms = None
    if kind == "head-norms":
        weights = torch.rand(2, head_dim, device=device, dtype=query.dtype) + 0.5
        head_norms = HeadNorms(weights[0], weights[1], 1e-6)
    return NewKV(
        key=torch.randn(batch, kv_heads, head_dim, dtype=query.dtype, device=device),
        value=torch.randn(batch, kv_heads, head_dim, dtype=query.dtype, device=device),
        positions=torch.full((batch,), position, dtype=torch.int64, device=device),
        cos_sin_cache=torch.cat([angles.cos(), angles.sin()], dim=-1), slot_mapping=slots, head_norms=head_norms,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x1024,64x1024,32x32768")
    parser.add_argument("--heads", type=parse_heads, default="32:8:64", help="query heads:KV heads:head dim")
    parser.add_argument("--capacity", type=int, default=32768, help="max_seq_len the kernel is launched for")
    parser.add_argument("--splits", default="auto", help="comma-separated, 'auto' = choose_num_splits")
    parser.add_argument("--block-n", default="64")
    parser.add_argument("--num-warps", default="auto",
                        help="comma-separated; auto: the library's (decode_num_warps: by head width, query heads a KV "
                        "head and batch)")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma-separated cache element types: auto (bf16, the queries') and/or fp8 (e4m3)")
    parser.add_argument("--num-stages", default=str(NUM_STAGES),
                        help="comma-separated; default: the library's; 'auto' = triton's default")
    parser.add_argument("--heads-first", type=parse_orders, default="auto",
                        help="comma-separated grid orders: auto, on (KV head fastest), off (split fastest)")
    parser.add_argument("--fused", type=parse_fused, default="none",
                        help="comma-separated: none, rotary (the step's rotary and KV write too), head-norms (and q/k norms)")
    parser.add_argument("--layouts", type=parse_layouts, default="nhd",
                        help=f"cache layouts: {', '.join(LAYOUTS)} (comma-separated)")
    parser.add_argument("--hbm-tbs", type=float, default=4.26)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda")
    q_heads, kv_heads, head_dim = args.heads
    heads = f"{q_heads}:{kv_heads}:{head_dim}"
    rows = []
    for item, kv_setting in itertools.product(args.cases.split(","), args.kv_cache_dtypes.split(",")):
        kv_dtype = resolve_kv_cache_dtype(kv_setting, torch.bfloat16)
        batch, context = map(int, item.split("x"))
        per_seq = -(-context // BLOCK_SIZE)
        kv_gb = 2 * batch * context * kv_heads * head_dim * kv_dtype.itemsize / 1e9
        copies = max(1, min(32, int(0.25 / kv_gb)))  # >= 250 MB touched per graph replay
        num_blocks = copies * batch * per_seq + 1
        blocks = list(range(1, num_blocks))
        random.Random(batch).shuffle(blocks)
        metadatas = []
        for copy in range(copies):
            mine = blocks[copy * batch * per_seq : (copy + 1) * batch * per_seq]
            metadata = AttentionMetadata.build(
                [1] * batch, [context] * batch, [mine[i * per_seq : (i + 1) * per_seq] for i in range(batch)],
                BLOCK_SIZE, device=device, max_blocks_per_seq=-(-args.capacity // BLOCK_SIZE),
            )
            metadata.max_seq_len = args.capacity
            metadata.split_counters = zeroed_split_counters(batch, device)  # as the decode graphs give them: no memset
            metadatas.append(metadata)
        query = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=device)
        cache, cache_layout = None, None
        for layout, fused, splits, block_n, warps, stages, order in itertools.product(
            args.layouts, args.fused, parse_ints(args.splits), parse_ints(args.block_n), parse_ints(args.num_warps),
            parse_ints(args.num_stages), args.heads_first,
        ):
            if cache is None or cache_layout != layout:
                cache = None  # the last layout's cache goes before the next one is allocated
                cache = cache_in_layout(layout, num_blocks, kv_heads, head_dim, kv_dtype, device)
                cache_layout = layout
            warps = warps or decode_num_warps(head_dim, batch, q_heads // kv_heads)
            merge_chunk = merge_block_s(q_heads // kv_heads, triton.next_power_of_2(head_dim), MAX_SPLITS, warps)
            num_splits = splits or choose_num_splits(batch, kv_heads, args.capacity, block_n, merge_chunk)

            def make_call(metadata: AttentionMetadata):
                new_kv = new_kv_for(fused, metadata, context, query, kv_heads, args.capacity)
                return lambda: paged_decode_attention(
                    query, cache, metadata, head_dim**-0.5, num_splits=num_splits, block_n=block_n, num_warps=warps,
                    num_stages=stages, heads_first=HEADS_FIRST[order], new_kv=new_kv,
                )

            us = graph_call_us([make_call(m) for m in metadatas])
            rows.append({
                "heads": heads, "kv_dtype": kv_setting, "layout": layout, "batch": batch, "context": context, "fused": fused, "num_splits": num_splits,
                "block_n": block_n,
                "num_warps": warps, "num_stages": stages or "-", "heads_first": order, "us": round(us, 2), "kv_gb": round(kv_gb, 4),
                "roofline_pct": round(100 * kv_gb / (us * 1e-6) / (args.hbm_tbs * 1e3), 1),
            })
            print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("attention_decode"), rows, COLUMNS, {"capacity": args.capacity})


if __name__ == "__main__":
    main()
