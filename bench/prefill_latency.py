"""A lone prompt's time to its first token inside the engine, and where it goes.

The floor under a served request's time to first token at low load: one request of
`--prompt-lens` random ids at a time, in the overlapped step loop the workers run, on
bench/engine.py's random Llama-3.2-1B-shaped checkpoint (CUDA) or the tiny test model (CPU).
Per prompt length, medians over `--repeats` requests:

    first_token_ms  add_request -> the engine's first output with a token (every step() of it)
    steps           engine steps that took
    device_ms       the device's forward + sampling time of those steps (CUDA events; CUDA only)
    host_ms         first_token_ms - device_ms: what the device waited for
    floor_ms        FLOPs of the prompt / `--peak-tflops` (the linear layers at 2 x params x
                    tokens, causal attention at 2 x 2 x T^2 / 2 x Hq x D per layer)
    kernels         CUDA kernels one such request launched (torch.profiler, one extra request);
                    `--top N` also lists the N with the most device time

`--prefill-graph-max-tokens 0 1024` runs every length twice, with prompts prefilled eagerly
and replayed from the engine's prefill graphs (`EngineConfig.prefill_graph_max_tokens`).

    python bench/prefill_latency.py --out bench/results/prefill                       # H200
    python bench/prefill_latency.py --prefill-graph-max-tokens 0 1024 --out bench/results/prefill
    python bench/prefill_latency.py --device cpu --prompt-lens 16 64 --repeats 3      # CPU smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # loaded by path (tests): bench/'s helpers by their bare names
    sys.path.append(str(BENCH))

COLUMNS = ["prefill_graphs", "prompt_len", "repeats", "first_token_ms", "steps", "device_ms", "host_ms", "floor_ms", "kernels"]


def first_token(engine, prompt: list[int], request_id: str) -> tuple[float, int, float]:
    """(seconds to the first token, steps, device seconds of those steps); then the request is
    aborted, and the engine stepped until it is gone."""
    from cleave.generation.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    steps, device = 0, 0.0
    while True:
        outputs = engine.step()
        steps += 1
        device += engine.last_stats.device_s
        if any(output.outputs and output.outputs[0].token_ids for output in outputs):
            break
    seconds = time.perf_counter() - start
    engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return seconds, steps, device


def profile_kernels(engine, prompt: list[int], top: int) -> tuple[int | None, list[dict]]:
    """CUDA kernels launched while one request gets its first token, and the `top` of them
    by device time (name, launches, us); (None, []) off CUDA."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available() or engine.config.device == "cpu":
        return None, []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        first_token(engine, prompt, "profiled")
        torch.cuda.synchronize()
    launches: collections.Counter[str] = collections.Counter()
    device_us: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches[event.name] += 1
            device_us[event.name] += event.device_time
    ranked = [{"kernel": name[:80], "launches": launches[name], "us": round(us, 1)}
              for name, us in device_us.most_common(top)]
    return sum(launches.values()), ranked


def floor_ms(config, prompt_len: int, peak_tflops: float) -> float:  # type: ignore[no-untyped-def]
    """The prompt's FLOPs at the device's peak (see the module docstring)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    q_size, kv_size = config.q_size, config.kv_size
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * config.intermediate_size
    linear = 2 * per_layer * layers * prompt_len + 2 * hidden * config.vocab_size  # lm_head: last token
    attention = 2 * 2 * prompt_len * prompt_len / 2 * config.num_attention_heads * config.head_dim * layers
    return 1e3 * (linear + attention) / (peak_tflops * 1e12)


def measure(engine, prompt_len: int, args: argparse.Namespace) -> dict:
    rng = random.Random(prompt_len)
    top_id = min(128000, engine.model_config.vocab_size)

    def prompt() -> list[int]:
        return [rng.randrange(3, top_id) for _ in range(prompt_len)]  # random ids: no prefix-cache hits

    for index in range(2):  # warm-up: kernels compiled and tuned for this length
        first_token(engine, prompt(), f"warm-{prompt_len}-{index}")
    runs = [first_token(engine, prompt(), f"p{prompt_len}-{index}") for index in range(args.repeats)]
    wall = statistics.median(run[0] for run in runs)
    device = statistics.median(run[2] for run in runs)
    kernels, top_kernels = profile_kernels(engine, prompt(), args.top)
    return {
        "prompt_len": prompt_len, "repeats": args.repeats, "first_token_ms": 1e3 * wall,
        "steps": statistics.median(run[1] for run in runs),
        "device_ms": 1e3 * device if device else None, "host_ms": 1e3 * (wall - device) if device else None,
        "floor_ms": floor_ms(engine.model_config, prompt_len, args.peak_tflops),
        "kernels": kernels, "top_kernels": top_kernels,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prefill-graph-max-tokens", type=int, nargs="+", default=[0],
                        help="the engine's prefill graphs up to this many tokens (0: eager); several: one engine each")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul peak of the device")
    parser.add_argument("--top", type=int, default=0,
                        help="also list each row's N kernels with the most device time (kept under 'top_kernels')")
    parser.add_argument("--out", default=None, help="directory for prefill-latency-<UTC time>.json / .md")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.prompt_lens) < 1 or min(args.prefill_graph_max_tokens) < 0:
        parser.error("--repeats and every --prompt-lens entry must be positive, --prefill-graph-max-tokens >= 0")
    # the engine's limits (main) and the checkpoint engine_sweep.write_model writes
    args.max_model_len = max(args.prompt_lens) + 2
    args.max_num_batched_tokens = max(8192, max(args.prompt_lens))  # one step prefills the whole prompt
    args.gpu_memory_utilization = 0.5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common import format_table, run_name, write_results
    from engine import free_device_memory
    from engine_sweep import choose_model, write_model

    from cleave.engine.llm_engine import LLMEngine
    from cleave.engine.llm import build_engine_config

    choose_model(args)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cleave-prefill-latency-") as tmp:
        model_dir = write_model(Path(tmp), args)
        num_blocks = None if args.device != "cpu" else 2 * (-(-args.max_model_len // args.block_size)) + 1
        for graph_tokens in args.prefill_graph_max_tokens:
            config = build_engine_config(
                model_dir, device=args.device, dtype=args.dtype, max_num_seqs=4,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                block_size=args.block_size, num_blocks=num_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                overlap_steps=True, prefill_graph_max_tokens=graph_tokens)
            engine = LLMEngine(config, device_timing=True)
            try:
                for prompt_len in args.prompt_lens:
                    rows.append({"prefill_graphs": graph_tokens, **measure(engine, prompt_len, args)})
                    print(format_table(rows[-1:], COLUMNS), flush=True)
                    if rows[-1]["top_kernels"]:
                        print(format_table(rows[-1]["top_kernels"], ["kernel", "launches", "us"]), flush=True)
            finally:
                engine.close()
                del engine
                free_device_memory()  # the next setting's engine sizes its KV cache from what is free
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("prefill-latency"), rows, COLUMNS,
                      summary={"model": args.model, "peak_tflops": args.peak_tflops})
    return 0


if __name__ == "__main__":
    sys.exit(main())
