"""Host-side (CPU) cost of one engine decode step, measured on CPU with a tiny model.

Runs the real `LLMEngine` (scheduler, input batching, sampler, detokenizer, stop checks,
output building) with a tiny random Llama checkpoint on CPU. The tiny forward is cheap, so
the host phases dominate and can be timed: `--batch` requests of `--prompt-len` random text
ids each generate exactly `--output-len` tokens (ignore_eos); only decode steps that run
the full batch are kept. Each phase is reported in ms per decode step:

    schedule     Scheduler.schedule()
    prepare      block copies + InputBatch (host arrays -> tensors)
    forward      the tiny model's forward (device work on a GPU; excluded from host)
    detokenize   the previous step's deferred text (overlaps the forward on a GPU)
    sampling_prep SamplingTensors (host part of sampling)
    sample       sampling itself (device work on a GPU; excluded from host)
    postprocess  scheduler.resolve, stop checks, output objects (overlapped steps: the
                 previous step's tokens, with their text)
    host         schedule + prepare + detokenize + sampling_prep + postprocess

`--mode sync` is the plain loop, `--mode overlap` the overlapped steps a CUDA engine runs
(on CPU nothing overlaps, so this is their host cost), `both` (default) one row each.

`--forward random` replaces the model's forward by random logits (normal, one row per
sampling entry): on a GPU host the forward runs on the device, so the host phases run
back to back without a CPU forward in between evicting their data from the caches.

Phases are medians over steps. By default the engine's clock is this thread's CPU time
(`--clock cpu`: torch runs single-threaded here), so other processes on a shared machine
do not inflate the numbers; `--clock wall` keeps the engine's perf_counter.

Medians leave out the garbage collector's pauses; `host_mean` (the mean of each step's host
phases) and `gc` (mean milliseconds per step in collections, `full_gcs` the full ones seen)
keep them; `host_max` is the longest step's host work (with a stream interval, the reporting
step's: the one a GPU waits on, unless `--stagger on` spreads the reports over the steps).
`--gc frozen` runs the decode loop with every object alive before it frozen
(`gc.collect(); gc.freeze()`), as the workers do once started and `LLM.generate` does for
its loop; `--gc both` runs each point both ways.

    python bench/engine_host.py                          # batch 64 and 256
    python bench/engine_host.py --batch 64 --profile     # cProfile of the decode loop
    python bench/engine_host.py --mode overlap           # only the overlapped steps
    python bench/engine_host.py --batch 256 --gc both    # with and without a frozen heap
    python bench/engine_host.py --batch 256 --prompt-len 512 --output-len 160 --mode overlap --forward random \
        --gc frozen --stream-interval 1 64 --repeats 3   # every step's outputs vs LLM.generate's
    python bench/engine_host.py --batch 48 --prompt-len 512 --temperature 0 --no-detokenize --mode overlap \
        --forward random --gc frozen --profile           # a decode worker's engine under the serving bench
    python bench/engine_host.py --batch 64 256 --prompt-len 512 --output-len 400 --no-detokenize --mode overlap \
        --forward random --gc frozen --churn both        # a stable batch vs one whose requests end and arrive
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import json
import os
import pstats
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # loaded by path (tests): bench/'s helpers by their bare names
    sys.path.append(str(BENCH))

PHASES = ("schedule", "prepare", "forward", "detokenize", "sampling_prep", "sample", "postprocess")
HOST_PHASES = ("schedule", "prepare", "detokenize", "sampling_prep", "postprocess")
TEXT_IDS = (8, 500)  # plain BPE tokens of the tiny tokenizer (specials and think tags excluded)
CHURN_ROUNDS = 4  # with --churn: requests in all, in batches' worth


def phase_ms(stats) -> dict[str, float]:
    """One StepStats split into disjoint phases, in milliseconds."""
    return {
        "schedule": stats.schedule_s * 1e3,
        "prepare": stats.prepare_s * 1e3,
        "forward": (stats.forward_s - stats.overlap_s) * 1e3,
        "detokenize": stats.overlap_s * 1e3,
        "sampling_prep": stats.sampling_prep_s * 1e3,
        "sample": (stats.sample_s - stats.sampling_prep_s) * 1e3,
        "postprocess": stats.postprocess_s * 1e3,
    }


def make_engine(model_dir: Path, batch: int, args: argparse.Namespace, overlap: bool, stream_interval: int = 1,
                stagger: bool = False):
    from cleave.engine.llm import build_engine_config
    from cleave.engine.llm_engine import LLMEngine

    max_model_len = args.prompt_len + args.output_len + 1
    blocks_per_seq = -(-max_model_len // args.block_size)
    config = build_engine_config(
        model_dir, device="cpu", dtype="float32", max_num_seqs=batch,
        max_num_batched_tokens=args.max_num_batched_tokens or max(batch * args.prompt_len, 2048),
        max_model_len=max_model_len,
        block_size=args.block_size, num_blocks=batch * blocks_per_seq + 1, seed=0, overlap_steps=overlap,
        # --no-detokenize: token ids out, as a decode worker's engine (the gateway makes the text)
        detokenize=args.detokenize, stream_interval=stream_interval, stagger_reports=stagger,
    )
    return LLMEngine(config)


class GcClock:
    """Time in the garbage collector (the engine's clock) and full collections, via gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def replace_forward_with_random_logits(engine) -> None:  # type: ignore[no-untyped-def]
    """The runner's forward returns standard-normal logits [R, V] (R: rows that sample)."""
    import torch

    vocab_size = engine.runner.vocab_size
    generator = torch.Generator().manual_seed(0)

    def forward(batch, layer_progress=None, prompt_rows=()):  # type: ignore[no-untyped-def]
        rows = batch.num_entries if batch.logits_indices is None else batch.logits_indices.numel()
        return torch.randn(rows, vocab_size, generator=generator), False, []

    engine.runner._forward = forward


def run_batch(
    model_dir: Path,
    batch: int,
    args: argparse.Namespace,
    profiler: cProfile.Profile | None,
    overlap: bool,
    frozen: bool = False,
    stream_interval: int = 1,
    stagger: bool = False,
    churn: bool = False,
) -> dict:
    """Decode `batch` requests to completion; median phase ms over full-batch decode steps.
    `churn`: requests arrive as a decode worker's do (prompt KV handed over, no prefill step)
    and end at random lengths, each replaced at once, CHURN_ROUNDS x `batch` in all."""
    import torch

    from cleave.generation.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = make_engine(model_dir, batch, args, overlap, stream_interval, stagger)
    if args.forward == "random":
        replace_forward_with_random_logits(engine)
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    num_admitted = expected_output = 0

    def admit() -> None:
        nonlocal num_admitted, expected_output
        request_id, prompt = f"r{num_admitted}", [rng.randrange(*TEXT_IDS) for _ in range(args.prompt_len)]
        num_admitted += 1
        if not churn:
            engine.add_request(request_id, prompt, params)
            expected_output += args.output_len
            return
        length = rng.randrange(max(2, args.output_len // 4), args.output_len + 1)
        engine.handoff.reserve(request_id, len(prompt))
        engine.handoff.receive(request_id, prompt, [rng.randrange(*TEXT_IDS)],
                               SamplingParams(max_tokens=length, temperature=args.temperature, ignore_eos=True))
        expected_output += length  # the hand-off's first token is reported with the rest

    for _ in range(batch):
        admit()
    full = batch - batch // 8 if churn else batch  # a churned batch counts once nearly full
    rows, num_output = [], 0
    if frozen:
        gc.collect()
        gc.freeze()
    gc_clock = GcClock()
    gc.callbacks.append(gc_clock)
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            profiling = profiler is not None and engine.scheduler.num_running == batch and not engine.scheduler.waiting
            if profiling:
                profiler.enable()
            gc_before, full_before = gc_clock.seconds, gc_clock.full
            outputs = engine.step()
            if profiling:
                profiler.disable()
            num_output += sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
            stats = engine.last_stats
            if churn:
                while num_admitted < CHURN_ROUNDS * batch and \
                        engine.scheduler.num_running + engine.scheduler.num_waiting < batch:
                    admit()
            if stats.num_seqs >= full and stats.num_tokens == stats.num_seqs:
                row = phase_ms(stats)
                row["gc"], row["full_gcs"] = (gc_clock.seconds - gc_before) * 1e3, gc_clock.full - full_before
                rows.append(row)
    finally:
        gc.callbacks.remove(gc_clock)
        if frozen:
            gc.unfreeze()
    seconds = time.perf_counter() - start
    if num_output != expected_output:
        raise RuntimeError(f"expected {expected_output} output tokens, got {num_output}")
    # Drop the first steps (allocator and cache warm-up).
    rows = rows[min(5, len(rows) // 4) :]
    if not rows:
        raise RuntimeError("no full-batch decode steps; raise --output-len")
    result = {"mode": "overlap" if overlap else "sync", "gc": "frozen" if frozen else "normal", "batch": batch,
              "stream_interval": stream_interval, "stagger": stagger, "churn": churn, "steps": len(rows)}
    for phase in PHASES:
        result[phase] = statistics.median(row[phase] for row in rows)
    result["host"] = sum(result[phase] for phase in HOST_PHASES)
    result["host_mean"] = statistics.fmean(sum(row[phase] for phase in HOST_PHASES) for row in rows)
    result["host_max"] = max(sum(row[phase] for phase in HOST_PHASES) for row in rows)
    result["gc_ms"] = statistics.fmean(row["gc"] for row in rows)
    result["full_gcs"] = sum(row["full_gcs"] for row in rows)
    result["step"] = sum(result[phase] for phase in PHASES)
    result["host_us_per_seq"] = 1e3 * result["host"] / batch
    result["tokens_per_s"] = num_output / seconds
    return result


def format_rows(results: list[dict]) -> str:
    columns = ["mode", "gc", "batch", "stream_interval", "stagger", "churn", "steps", *PHASES, "host", "step",
               "host_us_per_seq", "host_mean", "host_max", "gc_ms", "full_gcs"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in results:
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: every prompt in one step (sequences then cross KV blocks together); "
                             "smaller admits them over several steps, as a server fills up")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[1],
                        help="steps between reports of a running request (EngineConfig.stream_interval); "
                        "several: a row each (LLM.generate's engine runs at 64)")
    parser.add_argument("--stagger", choices=("off", "on", "both"), default="off",
                        help="EngineConfig.stagger_reports: each request reports on its own phase of the interval")
    parser.add_argument("--churn", choices=("off", "on", "both"), default="off",
                        help="requests handed over with their prompt's KV (a decode worker's), ending at random "
                        "lengths in [output-len / 4, output-len] and replaced at once, so the batch's membership "
                        "changes most steps")
    parser.add_argument("--detokenize", default=True, action=argparse.BooleanOptionalAction,
                        help="make text per token (--no-detokenize: token ids only, as a decode worker's engine)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per batch size; the fastest is kept")
    parser.add_argument("--mode", choices=("sync", "overlap", "both"), default="both", help="engine step loop")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="time phases by thread CPU or wall time")
    parser.add_argument("--forward", choices=("model", "random"), default="model",
                        help="the tiny model's forward, or random logits (the host phases alone, caches warm)")
    parser.add_argument("--gc", choices=("normal", "frozen", "both"), default="normal",
                        help="decode with the objects alive before the loop frozen, or not, or both")
    parser.add_argument("--profile", action="store_true", help="cProfile full-batch steps; print the top functions")
    parser.add_argument("--json", default=None, help="rows to STEM-<UTC time>.json beside this path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cleave.testing.tiny_models import write_tiny_checkpoint

    if args.clock == "cpu":
        # The engine times its phases with time.perf_counter; read this thread's CPU clock instead.
        time.perf_counter = time.thread_time
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", "llama", max_position_embeddings=4096)
        modes = {"sync": (False,), "overlap": (True,), "both": (False, True)}[args.mode]
        freezes = {"normal": (False,), "frozen": (True,), "both": (False, True)}[args.gc]
        for batch in args.batch:
            for overlap in modes:
                staggers = {"off": (False,), "on": (True,), "both": (False, True)}[args.stagger]
                churns = {"off": (False,), "on": (True,), "both": (False, True)}[args.churn]
                for frozen, interval, stagger, churn in itertools.product(freezes, args.stream_interval, staggers,
                                                                          churns):
                    profiler = cProfile.Profile() if args.profile else None
                    runs = [run_batch(model_dir, batch, args, profiler, overlap, frozen, interval, stagger, churn)
                            for _ in range(args.repeats)]
                    results.append(min(runs, key=lambda row: row["host"]))
                    if profiler is not None:
                        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    print(format_rows(results))
    if args.json:
        from common import machine_info, run_path

        out = run_path(args.json)
        out.write_text(json.dumps(results, indent=1))
        machine = machine_info()
        header = [f"# {out.stem}", "", f"- command: `{shlex.join(['python', *sys.argv])}`",
                  f"- code: {machine.code}", f"- host: {machine.host}, {os.cpu_count()} cores, no GPU use "
                  f"(phases timed by the thread's {'CPU' if args.clock == 'cpu' else 'wall'} clock)",
                  f"- date: {machine.date}", ""]
        out.with_suffix(".md").write_text("\n".join(header) + format_rows(results) + "\n")
        print(f"wrote {out} and {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
