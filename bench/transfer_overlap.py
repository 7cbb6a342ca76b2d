"""Prefill-to-KV-landed time: the prompt's KV sent after the forward vs layer by layer during it.

One engine (a Llama-3.2-1B-shaped random bf16 checkpoint, `--shape 1b`; or the tiny test
model, `--shape tiny`) prefills one prompt per iteration as a prefill-only request, in one
chunk (`max_num_batched_tokens` >= the prompt), and its KV is copied into a second cache
on the same device with `copy_blocks` on a copy stream: the kernel and stream the CUDA IPC
sender uses to write a decode worker's mapped cache. Modes, alternated per iteration:

  - after:  engine.step() returns (first token on the host), then one copy of every layer,
            ready="complete" (the prefill worker's send-after-step path);
  - layers: the prefill worker's layer streaming (`services.prefill.layer_stream`): the step
            thread records an event per layer and posts it to the event loop, which issues
            that layer's copy on the copy stream after it, while the next layers compute.

Per row: `step_ms` from submit to the step's return (forward + first token), `landed_ms`
from submit until the copy stream finished every layer, and `exposed_ms` = landed - step:
what the transfer adds to time to first KV landed at the decode worker. Not measured here:
the control frame and the receiver's acknowledgement (one each per transfer, or per merged
run of layers; see bench/transfer.py cuda_ipc/e2e) and a second process's mapped cache.

    python bench/transfer_overlap.py --tokens 8192 32768 --out bench/results/transfer_overlap
    python bench/transfer_overlap.py --device cpu --shape tiny --tokens 64 --iters 1   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cleave.transfer.streams import Ready, order_after

BENCH = Path(__file__).resolve().parent

COLUMNS = ["mode", "tokens", "iters", "step_ms", "landed_ms", "exposed_ms", "kv_mb"]
MODES = ("after", "layers")


class CopySender:
    """The part of a CUDA IPC sender that moves bytes, into a cache of this process: each
    run of layers is one `copy_blocks` on the copy stream after `ready`; `finish` waits for
    the copy stream off the event loop."""

    def __init__(self, dst: torch.Tensor, dst_ids: list[int], copy_stream: torch.cuda.Stream | None) -> None:
        self.dst = dst
        self.dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
        self.copy_stream = copy_stream
        self.num_runs = 0

    async def send_layers(self, layers: range, cache: torch.Tensor, block_ids: list[int], ready: Ready = "complete") -> None:
        from cleave.transfer.block_copy import copy_blocks

        self.num_runs += 1
        if self.copy_stream is None:
            copy_blocks(cache, self.dst, torch.tensor(block_ids), self.dst_index, layers)
            return
        order_after(self.copy_stream, ready, cache.device)
        with torch.cuda.stream(self.copy_stream):  # the index too: nothing on the compute stream
            src_index = torch.tensor(block_ids, dtype=torch.int64).pin_memory().to(cache.device, non_blocking=True)
            copy_blocks(cache, self.dst, src_index, self.dst_index, layers)

    async def finish(self) -> int:
        if self.copy_stream is not None:
            done = torch.cuda.Event()
            done.record(self.copy_stream)
            await asyncio.to_thread(done.synchronize)
        return self.num_runs

    async def close(self) -> None:
        await self.finish()


def model_dir(shape: str, directory: Path, device: str) -> Path:
    from cleave.testing.tiny_models import write_tiny_checkpoint

    if shape == "tiny":
        return write_tiny_checkpoint(directory / "tiny", "llama", max_position_embeddings=65536)
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    from engine import write_checkpoint  # bench/engine.py: random Llama-3.2-1B-shaped bf16 weights

    return write_checkpoint(directory, device)


def run_steps(engine) -> None:  # type: ignore[no-untyped-def]
    while engine.has_unfinished():
        engine.step()


async def prefill_once(engine, streams, mode: str, prompt: list[int], dst: torch.Tensor, request_id: str,
                       copy_stream: torch.cuda.Stream | None) -> dict:  # type: ignore[no-untyped-def]
    from cleave.generation.sampling_params import SamplingParams
    from services.prefill.layer_stream import LayerStream

    cache = engine.kv_cache
    num_blocks = engine.handoff.num_blocks_for(len(prompt))
    sender = CopySender(dst, list(range(num_blocks)), copy_stream)
    if cache.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    stream = None
    if mode == "layers":
        stream = LayerStream(sender, cache)  # type: ignore[arg-type]
        streams.offer(request_id, stream)
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1), prefill_only=True)
    await asyncio.to_thread(run_steps, engine)  # the step thread; the loop stays free for the layers
    stepped = time.perf_counter()
    table = engine.handoff.export(request_id)
    if stream is None:
        await sender.send_layers(range(cache.shape[0]), cache, table, ready="complete")
        runs = await sender.finish()
    else:
        taken = streams.take(request_id)
        assert taken is stream and stream.is_claimed and stream.block_ids == table, "the step did not claim the stream"
        runs = await stream.result()
    landed = time.perf_counter()
    engine.handoff.release_export(request_id)
    return {"step_ms": (stepped - start) * 1e3, "landed_ms": (landed - start) * 1e3,
            "exposed_ms": (landed - stepped) * 1e3, "runs": runs}


async def run(args: argparse.Namespace, directory: Path) -> list[dict]:
    from cleave.engine.llm import build_engine_config
    from cleave.engine.llm_engine import LLMEngine
    from services.prefill.layer_stream import LayerStreams

    longest = max(args.tokens)
    config = build_engine_config(
        model_dir(args.shape, directory, args.device), device=args.device, dtype=args.dtype,
        block_size=args.block_size, max_model_len=longest + args.block_size,
        max_num_batched_tokens=longest + args.block_size, enable_prefix_caching=False, enforce_eager=True,
        num_blocks=args.num_blocks)
    engine = LLMEngine(config)
    cache = engine.kv_cache  # [L, 2, NB, BS, Hkv, D]
    streams = LayerStreams(asyncio.get_running_loop(), cache.shape[0], cache.device)
    engine.watch_layers = streams.watch
    copy_stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
    rows = []
    for tokens in args.tokens:
        num_blocks = engine.handoff.num_blocks_for(tokens)
        dst = torch.zeros((cache.shape[0], 2, num_blocks, *cache.shape[3:]), dtype=cache.dtype, device=cache.device)
        kv_mb = dst.numel() * dst.element_size() / 2**20
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        rng = random.Random(args.seed)
        for iteration in range(args.warmup + args.iters):
            for mode in MODES:  # alternated, so drift (clocks, other tenants) hits both alike
                prompt = [rng.randrange(5, 500) for _ in range(tokens)]  # new tokens: no cache hits
                result = await prefill_once(engine, streams, mode, prompt, dst, f"{mode}-{tokens}-{iteration}",
                                            copy_stream)
                if iteration >= args.warmup:
                    results[mode].append(result)
        for mode in MODES:
            timed = results[mode]
            row = {"mode": mode, "tokens": tokens, "iters": len(timed), "kv_mb": kv_mb}
            for key in ("step_ms", "landed_ms", "exposed_ms"):
                row[key] = statistics.median(result[key] for result in timed)
            rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="prompt lengths")
    parser.add_argument("--shape", choices=("1b", "tiny"), default="1b", help="random weights of this shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", help="auto: the checkpoint's on CUDA, float32 on CPU")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: what memory allows)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for transfer_overlap.{json,md}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        rows = asyncio.run(run(args, Path(directory)))
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    from common import format_table, run_name, write_results

    print(format_table(rows, COLUMNS))
    if args.out is not None:
        write_results(args.out, run_name("transfer_overlap"), rows, COLUMNS, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
