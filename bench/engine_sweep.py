"""The engine's throughput curve: output tokens/s and GPU idle against batch size, per mix.

For each prompt/output mix (`--mixes`, prompt/output tokens per request) and each batch size
B (`--batches`), B requests of random prompt ids are submitted at once, each generating
exactly its output length (ignore_eos), so the steady state runs B sequences. The model is
bench/engine.py's random Llama-3.2-1B-shaped bf16 checkpoint, and each point runs its
throughput phase (`run_requests`, `summarize`). Per point:

- `output_tokens_per_s`: output tokens over the wall time from submission to the last token
  (prefill included): what a server with B users in flight delivers.
- `step_ms`, `device_ms`, `gpu_idle_pct` (as in bench/engine.py) and `decode_tokens_per_s`
  (sequences per step over step time) of the steady state: the decode steps that ran all B
  sequences. When none did (long prompts, short outputs: the first sequences finish before
  the last prompts are prefilled), every decode-only step stands in and `steady_seqs`, the
  mean batch of the steps used, is below B.

The engine (weights, KV cache, CUDA-graph capture) is loaded once per step loop (`--modes`)
with max_num_seqs = the largest batch and max_model_len = the longest mix, and serves every
point: requests leave nothing behind but evictable prefix-cache blocks, and the graph buckets
of the largest batch contain every default batch size, so B sequences replay the graph they
would with max_num_seqs = B. A point whose KV does not fit in the cache is skipped with its
reason; a point that fails is recorded as an error and the engine is reloaded for the next.

Results: `engine-sweep-<UTC time>.json` / `.md` under `--out`, rewritten after each point so
a run cut short keeps what it measured, and `.png` at the end (bench/engine_sweep_plot.py;
it also redraws a PNG from saved JSON files).

    python bench/engine_sweep.py --out bench/results/engine                     # H200: the full sweep
    python bench/engine_sweep.py --mixes 2048/128 --out bench/results/engine    # one mix per run
    python bench/engine_sweep.py --device cpu --out /tmp/sweep    # CPU smoke: tiny model, 8/8, batches 1,2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cleave.engine.llm_engine import LLMEngine

BENCH = Path(__file__).resolve().parent

COLUMNS = ["mode", "mix", "batch", "status", "output_tokens_per_s", "seconds", "steady_seqs", "steady_steps",
           "step_ms", "device_ms", "gpu_idle_pct", "decode_tokens_per_s", "graph_pct", "preemptions", "reason"]
MODES = ("overlap", "sync")
GPU_DEFAULTS = {"mixes": "128/2048,2048/128,512/1024", "batches": "1,8,32,64,128,192,256,384,512"}
CPU_DEFAULTS = {"mixes": "8/8", "batches": "1,2"}
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class Mix:
    """Prompt and output tokens of every request of a sweep point."""

    prompt_len: int
    output_len: int

    @property
    def label(self) -> str:
        return f"{self.prompt_len}/{self.output_len}"

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def parse_mixes(text: str) -> list[Mix]:
    """"128/2048,2048/128" -> [Mix(128, 2048), Mix(2048, 128)]."""
    mixes = []
    for item in filter(None, text.split(",")):
        parts = item.split("/")
        if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
            raise ValueError(f"--mixes: {item!r} is not PROMPT/OUTPUT with two positive token counts (e.g. 512/1024)")
        mixes.append(Mix(int(parts[0]), int(parts[1])))
    if not mixes:
        raise ValueError("--mixes: give at least one PROMPT/OUTPUT mix (e.g. 512/1024)")
    return mixes


def parse_batches(text: str) -> list[int]:
    """"1,8,32" -> [1, 8, 32] (sorted, unique, each >= 1)."""
    items = list(filter(None, text.split(",")))
    if not items or not all(item.strip().isdigit() and int(item) > 0 for item in items):
        raise ValueError(f"--batches: {text!r} is not a comma-separated list of positive batch sizes")
    return sorted({int(item) for item in items})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixes", default=None, help=f"PROMPT/OUTPUT,... (default {GPU_DEFAULTS['mixes']}; "
                                                       f"CPU: {CPU_DEFAULTS['mixes']})")
    parser.add_argument("--batches", default=None, help=f"batch sizes (default {GPU_DEFAULTS['batches']}; "
                                                         f"CPU: {CPU_DEFAULTS['batches']})")
    parser.add_argument("--modes", default="overlap", help="step loops: overlap (the CUDA default), sync or both")
    parser.add_argument("--model", choices=("llama-1b", "tiny"), default=None,
                        help="llama-1b: bench/engine.py's checkpoint; tiny: cleave.testing's (default on CPU)")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="fixed KV cache size (default: from memory)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="directory for engine-sweep-<UTC time>.json / .md / .png")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    defaults = CPU_DEFAULTS if cpu else GPU_DEFAULTS
    try:
        args.mixes = parse_mixes(args.mixes or defaults["mixes"])
        args.batches = parse_batches(args.batches or defaults["batches"])
    except ValueError as error:
        parser.error(str(error))
    args.modes = [mode for mode in args.modes.split(",") if mode]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}")
    args.model = args.model or ("tiny" if cpu else "llama-1b")
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    # read by bench/engine.py's make_engine: one engine serves every mix
    args.max_model_len = max(mix.total_len for mix in args.mixes)
    return args


def ensure_bench_importable() -> None:
    """bench/ on sys.path (last, see above) for `common`, `engine` and `engine_sweep_plot`."""
    if not any(Path(entry or ".").resolve() == BENCH for entry in sys.path):
        sys.path.append(str(BENCH))


def choose_model(args: argparse.Namespace) -> None:
    """The checkpoint `write_model` writes for `args.device` (a tiny fp32 Llama on the CPU,
    the Llama-3.2-1B shape in bf16 elsewhere) and the engine's block size; on the CPU torch
    runs on one thread, as the engine's step would beside a serving process."""
    args.block_size = 16
    args.model, args.dtype = ("tiny", "float32") if args.device == "cpu" else ("llama-1b", "bfloat16")
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)


def write_model(directory: Path, args: argparse.Namespace) -> Path:
    """The sweep's checkpoint: the tiny test model, or bench/engine.py's random one."""
    if args.model == "tiny":
        from cleave.testing.tiny_models import write_tiny_checkpoint

        return write_tiny_checkpoint(directory / "tiny", "llama")
    from engine import write_checkpoint

    return write_checkpoint(directory, args.device)


class SweepEngine:
    """One step loop's engine: loaded on first use, kept across points, dropped after a failure."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, mode: str) -> None:
        self.model_dir, self.args, self.mode = model_dir, args, mode
        self.engine: LLMEngine | None = None
        self.num_loads = 0
        self.startup_s = 0.0
        self.warmup_s = 0.0

    def get(self) -> LLMEngine:
        if self.engine is None:
            from engine import make_engine

            start = time.perf_counter()
            self.engine = make_engine(self.model_dir, self.args, max(self.args.batches), self.mode,
                                      dtype=self.args.dtype, num_blocks=self.args.num_blocks)
            self.num_loads += 1
            self.startup_s = time.perf_counter() - start
            self._warm_up()
        return self.engine

    def _warm_up(self) -> None:
        """A few short requests per mix, so the first point does not pay one-off compilation."""
        from engine import run_requests

        start = time.perf_counter()
        for index, mix in enumerate(self.args.mixes):
            if kv_shortfall(self.engine, mix, 1) is None:
                warm = argparse.Namespace(prompt_len=mix.prompt_len, output_len=WARMUP_OUTPUT_LEN,
                                          temperature=self.args.temperature)
                run_requests(self.engine, 1, warm, seed=-1 - index)
        self.warmup_s = time.perf_counter() - start

    def drop(self) -> None:
        from engine import free_device_memory

        self.engine = None
        free_device_memory()


def kv_shortfall(engine: LLMEngine, mix: Mix, batch: int) -> str | None:
    """Why `batch` sequences of `mix` cannot all hold their KV at once, or None when they can."""
    if mix.total_len > engine.max_model_len:
        return f"{mix.total_len} tokens exceed the engine's max_model_len {engine.max_model_len}"
    needed = batch * engine.kv.num_blocks_for(mix.total_len)
    usable = engine.kv.num_usable_blocks
    if needed > usable:
        return f"{batch} x {mix.total_len} tokens need {needed} KV blocks; the cache has {usable}"
    return None


def point_row(mode: str, mix: Mix, batch: int) -> dict:
    """The keys that name a sweep point."""
    return {"mode": mode, "mix": mix.label, "prompt_len": mix.prompt_len, "output_len": mix.output_len,
            "batch": batch}


def run_point(engine: LLMEngine, mode: str, mix: Mix, batch: int, args: argparse.Namespace, seed: int) -> dict:
    """One sweep point on a loaded engine: B requests of `mix` at once, measured to the end."""
    from engine import decode_steps, run_requests, summarize

    row = point_row(mode, mix, batch)
    reason = kv_shortfall(engine, mix, batch)
    if reason is not None:
        return {**row, "status": "skipped", "reason": reason}
    preemptions = engine.scheduler.stats.num_preemptions
    point_args = argparse.Namespace(prompt_len=mix.prompt_len, output_len=mix.output_len,
                                    temperature=args.temperature)
    seconds, num_output, steps = run_requests(engine, batch, point_args, seed=seed)
    steady = decode_steps(steps, batch, batch) or decode_steps(steps, 1, batch)
    row.update(status="ok", output_tokens=num_output, seconds=round(seconds, 3),
               output_tokens_per_s=round(num_output / seconds, 1),
               preemptions=engine.scheduler.stats.num_preemptions - preemptions, steady_steps=len(steady))
    if steady:
        stats = summarize("sweep", mode, mix.label, steady)
        steady_seqs = sum(s.num_seqs for s in steady) / len(steady)
        row.update(
            steady_seqs=round(steady_seqs, 1), step_ms=round(stats["step_ms"], 3),
            device_ms=None if stats["device_ms"] is None else round(stats["device_ms"], 3),
            gpu_idle_pct=None if stats["gpu_idle_pct"] is None else round(stats["gpu_idle_pct"], 1),
            decode_tokens_per_s=round(steady_seqs / (stats["step_ms"] * 1e-3), 1),
            graph_pct=round(stats["graph_pct"], 1),
        )
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_bench_importable()
    from common import format_table, run_name, write_results
    from engine_sweep_plot import plot_sweep

    command_argv = sys.argv if argv is None else [str(Path(__file__)), *argv]
    name = run_name("engine-sweep")
    rows: list[dict] = []
    summary: dict = {
        "model": args.model, "dtype": args.dtype, "modes": args.modes,
        "mixes": [mix.label for mix in args.mixes], "batches": args.batches,
        "max_num_seqs": max(args.batches), "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }

    def save() -> None:
        if args.out:
            write_results(args.out, name, rows, COLUMNS, summary=summary, argv=command_argv)

    with tempfile.TemporaryDirectory(prefix="cleave-engine-sweep-") as tmp:
        start = time.perf_counter()
        model_dir = write_model(Path(tmp), args)
        summary["checkpoint_s"] = round(time.perf_counter() - start, 1)
        for mode in args.modes:
            holder = SweepEngine(model_dir, args, mode)
            seed = 0
            for mix in args.mixes:
                for batch in args.batches:
                    seed += 1
                    row = point_row(mode, mix, batch)
                    try:
                        row = run_point(holder.get(), mode, mix, batch, args, seed)
                    except Exception as error:  # one point's failure (OOM, a kernel) must not end the sweep
                        row.update(status="error", reason=f"{type(error).__name__}: {error}")
                        holder.drop()
                    rows.append(row)
                    summary.update({f"engine_loads_{mode}": holder.num_loads,
                                    f"startup_s_{mode}": round(holder.startup_s, 1),
                                    f"warmup_s_{mode}": round(holder.warmup_s, 1)})
                    if holder.engine is not None:
                        summary[f"kv_blocks_{mode}"] = holder.engine.runner.num_blocks
                    print(json.dumps(row), flush=True)
                    save()
            holder.drop()

    print(format_table(rows, COLUMNS))
    if args.out:
        png = plot_sweep(rows, Path(args.out) / f"{name}.png", title=f"{name} ({args.model}, {args.device})")
        if png is not None:
            summary["plot"] = png.name
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
