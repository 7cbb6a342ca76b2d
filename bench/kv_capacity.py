"""How many long reasoning sequences a KV budget holds at once, paired cache vs one slot per layer.

A model whose sliding-window layers pair with its full-attention layers (gpt-oss:
`cleave.kv.groups`) keeps the sliding layers' KV in window tables that give pages back behind
the window. This drives the engine's own `Scheduler` and `KVCacheManager` (no model: the
pages a sequence holds depend only on its length and the scheduler's rules) through one
sequence of `--prompt-len` + `--output-len` tokens, prefilled in `--chunk`-token steps, and
records the most pages it held at once; a budget of `--kv-gib` then holds
budget // (page bytes * peak pages) such sequences side by side. `handoff_mib` is what a
disaggregated hand-off of the prompt moves (a paired cache skips the window pages behind the
window). Exact counts, no timing: runs anywhere.

    python bench/kv_capacity.py --model gpt-oss-20b --kv-gib 64 --prompt-len 1024 --output-len 32768
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, run_name, write_results  # noqa: E402

COLUMNS = ["layout", "slots", "page_kib", "pages", "peak_pages", "peak_gib", "sequences", "tokens_held", "handoff_mib"]
GIB = 1 << 30


@dataclass(frozen=True)
class Params:
    """What the scheduler reads of a sequence's sampling parameters."""

    max_tokens: int


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-oss-20b", help="a shape of bench/moe.py's MODELS")
    parser.add_argument("--kv-gib", type=float, default=64.0, help="device memory given to the KV cache")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step (max_num_batched_tokens)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default=None, help="directory for kv-capacity-<UTC time>.json / .md")
    args = parser.parse_args(argv)
    if min(args.kv_gib, args.prompt_len, args.output_len, args.chunk, args.block_size) <= 0:
        parser.error("--kv-gib, --prompt-len, --output-len, --chunk and --block-size must be positive")
    return args


def peak_pages(groups, args: argparse.Namespace) -> tuple[int, int]:  # noqa: ANN001
    """The most pages one sequence holds over its life under the scheduler's rules, and the
    pages a hand-off of its prompt sends."""
    from cleave.engine.config import SchedulerConfig
    from cleave.engine.scheduler import Scheduler
    from cleave.engine.sequence import Sequence
    from cleave.kv.manager import KVCacheManager

    total = args.prompt_len + args.output_len
    num_pages = 2 * -(-total // args.block_size) + 2
    kv = KVCacheManager(num_pages, args.block_size, enable_prefix_caching=False,
                        sliding_window=groups.sliding_window, window_group=groups.is_paired)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=args.chunk, max_num_seqs=1, max_model_len=total), kv)
    scheduler.add(Sequence("r", [1] * args.prompt_len, sampling_params=Params(args.output_len)))

    def length_checker(seq, token):  # noqa: ANN001, ANN202
        return None

    peak = 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
        scheduler.advance(output)
        scheduler.resolve(output, [2] * len(output.sampled_seqs), length_checker)
    return peak, kv.num_blocks_for(args.prompt_len) - kv.num_unseen_pages(args.prompt_len)


def main(argv: Seq[str] | None = None) -> int:
    args = parse_args(argv)
    from moe import MODELS, decode_model_config

    from cleave.kv.groups import kv_groups

    config = decode_model_config(MODELS[args.model], args.prompt_len + args.output_len)
    budget = int(args.kv_gib * GIB)
    rows = []
    for layout, paired in (("slot per layer", False), ("paired", True)):
        groups = kv_groups(config, pair_window_layers=paired)
        page_bytes = groups.num_slots * 2 * args.block_size * config.num_key_value_heads * config.head_dim * 2  # bf16
        peak, handoff_pages = peak_pages(groups, args)
        sequences = budget // page_bytes // peak
        rows.append({
            "layout": layout, "slots": groups.num_slots, "page_kib": page_bytes / 1024, "pages": budget // page_bytes,
            "peak_pages": peak, "peak_gib": peak * page_bytes / GIB, "sequences": sequences,
            "tokens_held": sequences * (args.prompt_len + args.output_len),
            "handoff_mib": handoff_pages * page_bytes / (1 << 20),
        })
    print(format_table(rows, COLUMNS))
    if args.out:
        json_path, _ = write_results(args.out, run_name("kv-capacity"), rows, COLUMNS, summary=vars(args))
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
