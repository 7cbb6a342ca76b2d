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

import torch

from common import format_table, run_name, write_results
from decode import Case, decode_batch
from decode_attention_binding import decode_attention_bound, require_calls
from step_turns import build_step_bench, summary_row, time_in_turns


COLUMNS = ["case", "setting", "median_us", "min_us", "max_us", "roofline_pct", "rounds_us"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="64x1024,32x32768", help="comma-separated BATCHxCONTEXT")
    parser.add_argument("--settings", nargs="+", default=["{}", '{"num_stages": 3}'],
                        help="JSON keyword arguments of paged_decode_attention, one per setting")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hbm-tbs", type=float, default=4.26)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = [Case(*map(int, text.split("x"))) for text in args.cases.split(",")]
    settings = [json.loads(text) for text in args.settings]
    bench = build_step_bench(cases, args.block_size, args.max_model_len)

    rows = []
    with torch.inference_mode():
        for case in cases:
            batch = decode_batch(case, args.block_size, bench.num_blocks, torch.device("cuda"),
                                 seed=case.batch + case.context)
            runners = []
            for setting in settings:
                # the model's decode attention calls are bound to the setting while it is captured
                with decode_attention_bound(setting) as bound_calls:
                    runners.append(bench.runner(bench.step, case.batch))
                require_calls(bound_calls, setting)
            calls = [functools.partial(lambda runner: runner.run(*batch), runner) for runner in runners]
            times = time_in_turns(calls, args.rounds, iters=20 if case.context > 4096 else 50, trials=3)
            for setting, samples in zip(settings, times):
                rows.append({"case": f"{case.batch}x{case.context}", "setting": json.dumps(setting),
                             **summary_row(samples, bench.gb_read(case), args.hbm_tbs)})
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
            del runners
            torch.cuda.empty_cache()

    print(format_table(rows, COLUMNS))
    if args.out:
        summary = {"model": "Llama-3.2-1B shape, random bf16 weights", "max_model_len": args.max_model_len}
        json_path, md_path = write_results(args.out, run_name("attention_in_step"), rows, COLUMNS, summary)
        print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
