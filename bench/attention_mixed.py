"""The attention of one mixed step alone: decodes ahead of prompt chunks, as the scheduler
orders a step that both decodes and prefills.

The engine's throughput run (256 requests of 512 prompt tokens under a 4096-token step budget)
spends its first ~33 steps this way: each step holds every request already generating (up to
~250 decodes) and fills the rest of the budget with prompts. By default (`PrefillLaunch`'s
`decode_rows`) `paged_attention` runs the leading decodes on the split-KV decode kernel and the
prompts on the prefill kernel; with `decode_rows` off the whole batch goes through the prefill
kernel, where each decode takes a BLOCK_M-row program per query head with one row in use and
walks its whole context alone.

For each `--decodes` count: that many decodes with contexts spread evenly over
[`--context` / 2, `--context`], then `--budget` minus that many prompt tokens as fresh prompts of
`--prompt-len` (the last one shorter), bf16, 16-token blocks on shuffled block ids. Each
`--attention-launches` setting (JSON `PrefillLaunch` keyword arguments; `{}` the default) is
timed inside a CUDA graph (device time per call), beside the decodes alone on the decode
kernel and the prompts alone on the prefill kernel: their sum is what splitting the batch can
reach.

    python bench/attention_mixed.py --out bench/results/prefill
    python bench/attention_mixed.py --heads 32:4:128 --decodes 64 248 \\
        --attention-launches '{"decode_rows": false}' '{}' '{"pack_gqa": true}'
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, graph_call_us, launch_label, parse_heads, run_name, write_results  # noqa: E402

COLUMNS = ["heads", "decodes", "context", "prompt_tokens", "run", "us"]
BLOCK_SIZE = 16


def mixed_lengths(decodes: int, context: int, budget: int, prompt_len: int) -> tuple[list[int], list[int]]:
    """(query lengths, context lengths) of a step: the decodes first, contexts spread evenly
    over [context / 2, context], then the rest of the budget as fresh prompts."""
    if decodes >= budget:
        raise ValueError(f"{decodes} decodes leave no prompt tokens in a budget of {budget}")
    contexts = [context // 2 + (context - context // 2) * i // max(1, decodes - 1) for i in range(decodes)]
    prompt_tokens = budget - decodes
    prompts = [prompt_len] * (prompt_tokens // prompt_len) + ([prompt_tokens % prompt_len] if prompt_tokens % prompt_len
                                                              else [])
    return [1] * decodes + prompts, contexts + prompts


def shuffled_tables(seq_lens: list[int], rng: random.Random) -> tuple[list[list[int]], int]:
    """(block tables, blocks in the cache) for sequences of `seq_lens` tokens: every sequence
    its own blocks, taken in shuffled order from 1 up (block 0 is the null block)."""
    widths = [-(-seq_len // BLOCK_SIZE) for seq_len in seq_lens]
    blocks = list(range(1, sum(widths) + 1))
    rng.shuffle(blocks)
    tables, start = [], 0
    for width in widths:
        tables.append(blocks[start:start + width])
        start += width
    return tables, len(blocks) + 1


def build_batch(query_lens: list[int], seq_lens: list[int], kv_heads: int, head_dim: int, device: torch.device,
                seed: int = 0):  # noqa: ANN201
    """(kv_cache, metadata) for the step: random bf16 KV on shuffled blocks."""
    from cleave.kv.metadata import AttentionMetadata

    tables, num_blocks = shuffled_tables(seq_lens, random.Random(seed))
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    return cache, AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, device=device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=parse_heads, default="32:8:64", help="query heads:KV heads:head dim")
    parser.add_argument("--decodes", type=int, nargs="+", default=[32, 128, 248])
    parser.add_argument("--context", type=int, default=1024, help="the longest decode's context")
    parser.add_argument("--budget", type=int, default=4096, help="tokens in the step (decodes + prompt tokens)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--attention-launches", nargs="+", default=[{"decode_rows": False}, {}], type=json.loads,
                        help="JSON PrefillLaunch keyword arguments, a row each ('{}': the default launch)")
    parser.add_argument("--out", default=None, help="directory for attention_mixed-<UTC time>.json / .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cleave.kernels.attention import paged_attention
    from cleave.kernels.attention_decode import paged_decode_attention
    from cleave.kernels.attention_prefill import PrefillLaunch, paged_prefill_attention

    device = torch.device("cuda")
    q_heads, kv_heads, head_dim = args.heads
    scale = head_dim**-0.5
    rows = []
    for decodes in args.decodes:
        query_lens, seq_lens = mixed_lengths(decodes, args.context, args.budget, args.prompt_len)
        cache, metadata = build_batch(query_lens, seq_lens, kv_heads, head_dim, device)
        query = torch.randn(sum(query_lens), q_heads, head_dim, dtype=torch.bfloat16, device=device)
        prompts_cache, prompts = build_batch(query_lens[decodes:], seq_lens[decodes:], kv_heads, head_dim, device, 1)
        base = {"heads": f"{q_heads}:{kv_heads}:{head_dim}", "decodes": decodes, "context": args.context,
                "prompt_tokens": args.budget - decodes}

        def add_row(run: str, call) -> None:  # noqa: ANN001
            rows.append({**base, "run": run, "us": round(graph_call_us([call]), 1)})
            print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)

        for launch in args.attention_launches:
            prefill = PrefillLaunch(**launch)
            add_row(f"mixed {launch_label(launch) if launch else 'default'}",
                    lambda prefill=prefill: paged_attention(query, cache, metadata, scale, prefill=prefill))
        add_row("decodes alone, decode kernel",
                lambda: paged_decode_attention(query[:decodes], cache, metadata.leading(decodes), scale))
        add_row("prompts alone, prefill kernel",
                lambda: paged_prefill_attention(query[decodes:], prompts_cache, prompts, scale))
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("attention_mixed"), rows, COLUMNS,
                      {"budget": args.budget, "prompt_len": args.prompt_len})
    return 0


if __name__ == "__main__":
    sys.exit(main())
