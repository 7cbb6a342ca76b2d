"""Decode attention launch settings measured inside the graph-replayed decode step.

`bench/attention_decode.py` times the kernel alone; here every setting is captured into its
own `CUDAGraphRunner` of the Llama-3.2-1B-shaped model (the attention call in the model is
bound to the setting while its graphs are captured) and the whole step is timed back to back,
settings in turns, so the kernel is measured beside the projections it overlaps with.

    python bench/attention_in_step.py --cases 64x1024,32x32768 \
        --settings '{}' '{"num_stages": 2}' '{"block_n": 32}' --out bench/results/decode/ab
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

from common import format_table, write_results
from decode import Case, build_model, decode_batch, kv_bytes_per_token, llama_3_2_1b_config, pipelined_ms, weight_bytes_read

import cleave.model.llama as llama
from cleave.graphs.runner import CUDAGraphRunner, GraphRunnerConfig
from cleave.kernels.attention_decode import paged_decode_attention
from cleave.model.llama import allocate_kv_cache

COLUMNS = ["case", "setting", "median_us", "roofline_pct", "rounds_us"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="64x1024,32x32768", help="comma-separated BATCHxCONTEXT")
    parser.add_argument("--settings", nargs="+", default=["{}", '{"num_stages": 2}'],
                        help="JSON keyword arguments of paged_decode_attention, one per setting")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hbm-tbs", type=float, default=4.26)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda")
    config = llama_3_2_1b_config()
    model = build_model(config, device)
    weights = weight_bytes_read(model)
    cases = [Case(*map(int, text.split("x"))) for text in args.cases.split(",")]
    settings = [json.loads(text) for text in args.settings]
    num_blocks = max(case.kv_blocks(args.block_size) for case in cases) + 1
    kv_cache = allocate_kv_cache(config, num_blocks, args.block_size, device=device)
    kv_cache.normal_(0.0, 1.0)

    def step(input_ids, positions, metadata):
        return model.compute_logits(model(input_ids, positions, kv_cache, metadata))

    rows = []
    with torch.inference_mode():
        for case in cases:
            batch = decode_batch(case, args.block_size, num_blocks, device, seed=case.batch + case.context)
            gb_read = (weights + case.batch * case.context * kv_bytes_per_token(config)) / 1e9
            runners = []
            for setting in settings:
                llama.paged_decode_attention = functools.partial(paged_decode_attention, **setting)
                runner = CUDAGraphRunner(
                    step, GraphRunnerConfig(case.batch, -(-args.max_model_len // args.block_size), args.block_size), device
                )
                runner.capture()
                runners.append(runner)
            llama.paged_decode_attention = paged_decode_attention
            iters = 20 if case.context > 4096 else 50
            times: list[list[float]] = [[] for _ in settings]
            for _ in range(args.rounds):
                for index, runner in enumerate(runners):
                    ms, _ = pipelined_ms(lambda: runner.run(*batch), warmup=2, iters=iters, trials=3)
                    times[index].append(ms * 1e3)
            for setting, samples in zip(settings, times):
                median = statistics.median(samples)
                rows.append({
                    "case": f"{case.batch}x{case.context}", "setting": json.dumps(setting),
                    "median_us": round(median, 1),
                    "roofline_pct": round(100 * gb_read / (median * 1e-6) / (args.hbm_tbs * 1e3), 1),
                    "rounds_us": " ".join(f"{t:.1f}" for t in samples),
                })
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
            del runners
            torch.cuda.empty_cache()

    print(format_table(rows, COLUMNS))
    if args.out:
        summary = {"model": "Llama-3.2-1B shape, random bf16 weights", "max_model_len": args.max_model_len}
        json_path, md_path = write_results(args.out, "attention_in_step", rows, COLUMNS, summary)
        print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
