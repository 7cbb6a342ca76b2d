"""Host time of a graph-replayed decode step: the runner's input copies vs the graph launch.

Builds the Llama-3.2-1B-shaped model of `bench/decode.py` with a batch-1 graph, then times
on the host: `CUDAGraphRunner.run` back to back (device-bound, so this is host time per
call), `StaticDecodeBuffers.fill` alone, and `CUDAGraph.replay` and `fill` each on an idle
device. A synchronised step pays this host time before the device starts.

    python bench/graph_runner_host.py --out bench/results/decode
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, run_name, write_results  # noqa: E402
from decode import Case, build_model, decode_batch, llama_3_2_1b_config  # noqa: E402

from cleave.graphs.runner import CUDAGraphRunner, GraphRunnerConfig  # noqa: E402
from cleave.model.llama import allocate_kv_cache  # noqa: E402

COLUMNS = ["what", "host_us"]


def back_to_back_us(fn, calls: int = 200, trials: int = 5) -> float:
    """Median over trials of host microseconds per call of `calls` unsynchronised calls."""
    per_call = []
    for _ in range(trials):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - began) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def idle_device_us(fn, calls: int = 30) -> float:
    """Median host microseconds of one call made on an idle device."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda")
    config = llama_3_2_1b_config()
    model = build_model(config, device)
    case = Case(1, args.context)
    num_blocks = case.kv_blocks(16) + 1
    kv_cache = allocate_kv_cache(config, num_blocks, 16, device=device)

    def step(input_ids, positions, metadata):
        return model.compute_logits(model(input_ids, positions, kv_cache, metadata))

    runner = CUDAGraphRunner(
        step, GraphRunnerConfig(max_batch_size=1, max_blocks_per_seq=-(-args.max_model_len // 16), block_size=16), device
    )
    with torch.inference_mode():
        runner.capture()
        batch = decode_batch(case, 16, num_blocks, device, seed=1)
        for _ in range(20):
            runner.run(*batch)
        graph = runner._graphs[runner.bucket_for(1, batch[2])]
        rows = [
            {"what": "runner.run, back to back", "host_us": round(back_to_back_us(lambda: runner.run(*batch), 50), 1)},
            {"what": "buffers.fill, back to back", "host_us": round(back_to_back_us(lambda: runner.buffers.fill(*batch)), 1)},
            {"what": "graph.replay, idle device", "host_us": round(idle_device_us(graph.replay), 1)},
            {"what": "buffers.fill, idle device", "host_us": round(idle_device_us(lambda: runner.buffers.fill(*batch)), 1)},
        ]
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("graph_runner_host"), rows, COLUMNS, {"batch": 1, "context": args.context})


if __name__ == "__main__":
    main()
