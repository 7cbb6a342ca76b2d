"""Where an engine step's wall time goes when the device waits: host work, GC, the wait itself.

Runs `--batch` requests of `--prompt-len` random ids, each generating `--output-len` tokens
(ignore_eos), on bench/engine.py's random Llama-3.2-1B-shaped checkpoint (CUDA) or the tiny
test model (CPU), in the overlapped step loop with detokenization on, and reports over the
decode steps that ran the full batch:

    step_ms     mean wall time of `engine.step()` (what the sweep's `step_ms` is)
    device_ms   mean forward + sampling time on the device (CUDA events; CUDA only)
    idle_pct    1 - sum(device) / sum(step)
    wait_ms     mean time the host blocked on the previous step's sampled ids
    host_ms     step_ms - wait_ms: the serial host work per step (GC included)
    gc_ms       mean time in the garbage collector per step, and full collections seen
    *_p50       medians (the host work without GC pauses)

`--freeze both` runs each batch twice: with the garbage collector as it is, and with the
decode loop inside `frozen_heap()` (what `LLM.generate` and bench/engine.py's `run_requests`
do; the workers freeze their start-up objects for good, `cleave.worker.gc_freeze`).
`--stagger both` runs each point with every request reporting on the same step of 64 (its
text made then: one long host step in 64) and with them staggered as `LLM.generate`'s are
(each request on its own phase of the 64: `EngineConfig.stagger_reports`), one engine each.
`--profile` prints the top functions of a cProfile over the steady steps of the last run.

    python bench/engine_step_gaps.py --batch 128 256 512 --out bench/results/engine   # H200
    python bench/engine_step_gaps.py --device cpu --batch 64 --output-len 48          # CPU smoke
    python bench/engine_step_gaps.py --batch 256 --freeze on --stagger both --out bench/results/engine
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # loaded by path (tests): bench/'s helpers by their bare names
    sys.path.append(str(BENCH))

COLUMNS = ["batch", "freeze", "steps", "step_ms", "device_ms", "idle_pct", "wait_ms", "host_ms", "host_p50",
           "gc_ms", "full_gcs", "step_p50", "stagger"]


class WaitClock:
    """Wraps the runner's `collect` to time the host's block on a launched step's event."""

    def __init__(self, runner) -> None:  # type: ignore[no-untyped-def]
        self.seconds = 0.0
        collect = runner.collect

        def timed_collect(launched):  # type: ignore[no-untyped-def]
            if launched.ready is not None:
                start = time.perf_counter()
                launched.ready.synchronize()
                self.seconds += time.perf_counter() - start
            return collect(launched)

        runner.collect = timed_collect


def run_batch(
    engine, batch: int, args: argparse.Namespace, profiler: cProfile.Profile | None, frozen: bool = False
) -> dict:
    """One batch to completion; means and medians over the full-batch decode steps."""
    from engine_host import GcClock  # bench/ is on the path (main)

    from cleave.engine.frozen_heap import frozen_heap
    from cleave.generation.sampling_params import SamplingParams

    rng = random.Random(batch)
    top_id = min(128000, engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"g{batch}-{index}", [rng.randrange(3, top_id) for _ in range(args.prompt_len)], params)
    waits = WaitClock(engine.runner)
    rows = []
    with GcClock() as gc_clock, frozen_heap() if frozen else contextlib.nullcontext():
        while engine.has_unfinished():
            steady = engine.scheduler.num_running == batch and not engine.scheduler.waiting
            wait0, gc0, full0 = waits.seconds, gc_clock.seconds, gc_clock.full
            if steady and profiler is not None:
                profiler.enable()
            engine.step()
            if steady and profiler is not None:
                profiler.disable()
            stats = engine.last_stats
            if stats.num_seqs == batch and stats.num_tokens == batch:
                rows.append((stats.wall_s, stats.device_s, waits.seconds - wait0, gc_clock.seconds - gc0,
                             gc_clock.full - full0))
    del engine.runner.collect  # the instance attribute: back to the class's method
    rows = rows[min(5, len(rows) // 4) :]
    wall = [row[0] for row in rows]
    host = [row[0] - row[2] for row in rows]
    device = sum(row[1] for row in rows)
    n = len(rows)
    return {
        "batch": batch, "steps": n, "step_ms": 1e3 * sum(wall) / n,
        "device_ms": 1e3 * device / n if device else None,
        "idle_pct": 100 * (1 - device / sum(wall)) if device else None,
        "wait_ms": 1e3 * sum(row[2] for row in rows) / n, "host_ms": 1e3 * sum(host) / n,
        "host_p50": 1e3 * statistics.median(host), "gc_ms": 1e3 * sum(row[3] for row in rows) / n,
        "full_gcs": sum(row[4] for row in rows), "step_p50": 1e3 * statistics.median(wall),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--freeze", choices=("off", "on", "both"), default="both")
    parser.add_argument("--stagger", choices=("off", "on", "both"), default="on",
                        help="EngineConfig.stagger_reports (both: one engine each)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=None, help="directory for engine-step-gaps-<UTC time>.json / .md")
    args = parser.parse_args(argv)
    # read by bench/engine.py's make_engine
    args.max_model_len = args.prompt_len + args.output_len
    args.max_num_batched_tokens = 4096
    args.enforce_eager = False
    args.gpu_memory_utilization = 0.9
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common import format_table, run_name, write_results
    from engine import free_device_memory, make_engine
    from engine_sweep import choose_model, write_model

    choose_model(args)
    freezes = {"off": [False], "on": [True], "both": [False, True]}[args.freeze]
    rows: list[dict] = []
    profiler = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory(prefix="cleave-step-gaps-") as tmp:
        model_dir = write_model(Path(tmp), args)
        num_blocks = None if args.device != "cpu" else max(args.batch) * (-(-args.max_model_len // 16)) + 1
        staggers = {"off": [False], "on": [True], "both": [False, True]}[args.stagger]
        for stagger in staggers:
            engine = make_engine(model_dir, args, max(args.batch), "overlap", dtype=args.dtype, num_blocks=num_blocks,
                                 stagger_reports=stagger)
            warm = argparse.Namespace(**{**vars(args), "output_len": 4})
            run_batch(engine, 1, warm, None)
            for freeze in freezes:
                for index, batch in enumerate(args.batch):
                    last = stagger == staggers[-1] and freeze == freezes[-1] and index == len(args.batch) - 1
                    row = {**run_batch(engine, batch, args, profiler if last else None, freeze), "freeze": freeze,
                           "stagger": stagger}
                    rows.append(row)
                    print(format_table([row], COLUMNS), flush=True)
            engine.close()
            del engine
            free_device_memory()  # the next setting's engine sizes its KV cache from what is free
    print(format_table(rows, COLUMNS))
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
        print(text.getvalue())
    if args.out:
        write_results(args.out, run_name("engine-step-gaps"), rows, COLUMNS,
                      summary={"prompt_len": args.prompt_len, "output_len": args.output_len, "model": args.model})
    return 0


if __name__ == "__main__":
    sys.exit(main())
