"""Long thinking generations: one 16k-token generation and a batch of 32, on one GPU.

A Llama-3.2-1B-shaped random bf16 checkpoint (the same one `bench/engine.py` writes) decodes
`--output-len` tokens per request (ignore_eos, as a model thinking for that long would) through
the full engine: paged KV cache, CUDA-graph decode, on-device sampling, detokenization. For each
batch size it reports output tokens/s, and, as the KV cache grows, the decode forward's time and
its fraction of the HBM roofline: (weight bytes + KV bytes read) / forward time / `--hbm-tbs`.

    python bench/long_thinking.py --out bench/results/long_thinking
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

COLUMNS = ["batch", "context", "steps", "forward_ms", "step_ms", "gb_read", "roofline_pct"]


def kv_bytes_per_token(config) -> int:
    # K and V, every layer, bf16
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_batch(engine, batch: int, args: argparse.Namespace, on_progress=None) -> tuple[dict, list[dict]]:
    """Decode `batch` requests to the end; `on_progress(summary, rows)` runs every 2048 steps."""
    from cleave.generation.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.8, ignore_eos=True)
    for index in range(batch):
        prompt = [(7 * index + 13 * t) % 400 + 3 for t in range(args.prompt_len)]
        engine.add_request(f"think-{batch}-{index}", prompt, params)
    steps: list[tuple[int, float, float]] = []  # (context, forward_s, total_s) of decode steps
    num_output = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        num_output += sum(len(s.token_ids) for o in outputs for s in o.outputs)
        stats = engine.last_stats
        if stats.num_tokens == stats.num_seqs == batch:
            context = args.prompt_len + len(steps) + 1
            steps.append((context, stats.forward_s, stats.total_s))
            if on_progress is not None and len(steps) % 2048 == 0:
                on_progress(*_report(engine, batch, args, steps, num_output, time.perf_counter() - start))
    return _report(engine, batch, args, steps, num_output, time.perf_counter() - start)


def _report(engine, batch: int, args: argparse.Namespace, steps: list, num_output: int, seconds: float):
    model = engine.runner.model
    weights = weight_bytes(model)
    per_token = kv_bytes_per_token(model.config)
    rows = []
    edges = [args.prompt_len] + [c for c in (1024, 2048, 4096, 8192, 12288, 16384, 32768) if c > args.prompt_len]
    for lo, hi in zip(edges, edges[1:]):
        window = [s for s in steps if lo < s[0] <= hi]
        if not window:
            continue
        forward_s = statistics.median(s[1] for s in window)
        context = statistics.median(s[0] for s in window)
        read = weights + batch * context * per_token
        rows.append({
            "batch": batch, "context": int(context), "steps": len(window),
            "forward_ms": forward_s * 1e3, "step_ms": statistics.median(s[2] for s in window) * 1e3,
            "gb_read": read / 1e9, "roofline_pct": 100.0 * read / forward_s / (args.hbm_tbs * 1e12),
        })
    summary = {"batch": batch, "output_len": args.output_len, "decode_steps": len(steps),
               "seconds": round(seconds, 2), "output_tokens_per_s": round(num_output / seconds, 1)}
    return summary, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16384)
    parser.add_argument("--hbm-tbs", type=float, default=4.26)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="directory for long_thinking-<UTC time>.json / .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from common import format_table, run_name, write_results
    from engine import free_device_memory, make_engine, write_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    engine_args = argparse.Namespace(
        device=args.device, max_num_batched_tokens=8192, max_model_len=args.prompt_len + args.output_len,
        block_size=16, enforce_eager=False, gpu_memory_utilization=0.9,
    )
    name = run_name("long_thinking")  # one file for the run, rewritten as batches finish
    rows, summary = [], {"prompt_len": args.prompt_len, "output_len": args.output_len, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp), args.device)
        for batch in batches:
            engine = make_engine(model_dir, engine_args, max(batch, 1), "overlap", sync_timing=True)

            def save(run_summary: dict, batch_rows: list[dict], done: int = len(rows)) -> None:
                # partial results survive a later timeout: rewrite this batch's rows in place
                del rows[done:]
                rows.extend(batch_rows)
                summary["runs"][done_runs:] = [run_summary]
                print(json.dumps(run_summary), flush=True)
                if args.out:
                    write_results(args.out, name, rows, COLUMNS, summary=summary)

            done_runs = len(summary["runs"])
            save(*run_batch(engine, batch, args, on_progress=save))
            print(format_table(rows, COLUMNS), flush=True)
            del engine
            free_device_memory()
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
