"""KV transfer benchmark: a prompt's KV of a Llama-3.2-1B-shaped model between two caches.

KV: 16 layers, 8 KV heads, head_dim 64, bf16, 16-token blocks (32 KiB per token), for 1k- and
32k-token prompts, on shuffled (non-contiguous) block ids. Rows:
  - local/torch:  `dst[:, :, d] = src[:, :, s]` in one process (gather + scatter; event-timed);
  - local/fused:  `copy_blocks` (one read, one write per byte) in one process (device time,
                  calls replayed back to back in a CUDA graph, as for cuda_ipc/copy);
  - cuda_ipc/copy: `copy_blocks` into a cache another process exported (device time only);
  - cuda_ipc/e2e: `KVSender.send_all` + verdict (one copy launch, one control frame, one
    acknowledgement), wall clock from `open` to the receiver's confirmation;
  - cuda_ipc/streamed: a prefill forward emulated on a producer stream (`--layer-compute-ms`
    of device time per layer); each layer is handed to `send_layer` with the producer's event
    as it is enqueued, so copies and frames overlap the remaining layers. `ms` is the whole
    transfer, `exposed_ms` the part after the last layer exists (its event completed and it
    was handed over) until the receiver has everything: what a prefill adds to time to first
    token;
  - tcp/e2e:      the same as e2e over loopback TCP (CUDA -> pinned host -> socket -> host -> CUDA).
GB/s is bytes moved (KV bytes of the prompt) / ms (for streamed: / exposed_ms); the target
for cuda_ipc is >= 1000.

    python bench/transfer.py --tokens 1024 32768 --skip-tcp --out bench/results/transfer
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import subprocess
import sys
import time

import torch

from common import event_times_ms, format_table, graph_call_us, run_name, write_results

from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.convert import transfer_handle_from_proto, transfer_handle_to_proto
from cleave.rpc.types import TransportKind
from cleave.transfer import KVReceiver, KVTransferClient, copy_blocks

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 64, 16, torch.bfloat16
COLUMNS = ["transport", "mode", "tokens", "blocks", "mb", "ms", "exposed_ms", "gb_per_s", "frames"]


def kv_cache(num_blocks: int, device: str) -> torch.Tensor:
    """[L, 2, NB, BS, Hkv, D] bf16"""
    return torch.randn(LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device).to(DTYPE)


def shuffled_ids(num_blocks: int, pool: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(pool, generator=generator)[:num_blocks].tolist()


def device_ms(fn, calls: int = 8) -> float:
    """Device milliseconds per call of fn(), `calls` calls back to back in one CUDA graph (so
    a 1k-token copy's ~20 us is not hidden behind its launch's host time)."""
    return graph_call_us([fn] * calls, rep_ms=20) / 1e3


def event_ms(fn, reps: int = 20) -> float:
    """Median device time of fn() in ms (CUDA events around each call; includes launch gaps)."""
    return statistics.median(event_times_ms(fn, warmup=1, iters=reps))


def row(transport: str, mode: str, tokens: int, blocks: int, ms: float, exposed_ms: float | None = None,
        frames: int | None = None) -> dict:
    num_bytes = blocks * LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    effective_ms = ms if exposed_ms is None else exposed_ms
    return {"transport": transport, "mode": mode, "tokens": tokens, "blocks": blocks,
            "mb": num_bytes / 1e6, "ms": ms, "exposed_ms": exposed_ms,
            "gb_per_s": num_bytes / (effective_ms * 1e-3) / 1e9, "frames": frames}


def sleep_cycles_per_ms() -> float:
    """`torch.cuda._sleep` cycles per ms of device time (measured once)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


async def streamed_transfer(client: KVTransferClient, handle, src: torch.Tensor, src_ids: list[int],
                            layer_cycles: int) -> tuple[float, float, int]:
    """One transfer handed over layer by layer as an emulated forward produces the layers;
    returns (total ms, exposed ms, frames)."""
    producer = torch.cuda.Stream()
    torch.cuda.synchronize()
    start = time.perf_counter()
    sender = await client.open(handle)
    events = []
    for layer in range(LAYERS):
        with torch.cuda.stream(producer):
            torch.cuda._sleep(layer_cycles)  # the layer's forward
            event = torch.cuda.Event()
            event.record(producer)
        events.append(event)
        if layer < LAYERS - 1:
            await sender.send_layer(layer, src, src_ids, ready=event)
    await asyncio.to_thread(events[-1].synchronize)  # the last layer exists
    handed = time.perf_counter()
    await sender.send_layer(LAYERS - 1, src, src_ids, ready=events[-1])
    await sender.finish(timeout_s=600)
    done = time.perf_counter()
    return (done - start) * 1e3, (done - handed) * 1e3, sender.num_frames


def print_profile(profile: cProfile.Profile, title: str, file=sys.stdout) -> None:
    """The 25 functions with the most own time, then the 25 with the most cumulative time."""
    print(f"== profile: {title}", file=file)
    for key in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=file).sort_stats(key).print_stats(25)


async def receiver_main(args: argparse.Namespace) -> None:
    """Child process: export a cache, print handles for `--reps` transfers, serve them."""
    profile = cProfile.Profile() if args.profile else None
    cache = torch.zeros(LAYERS, 2, args.pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    receiver = KVReceiver(cache)
    await receiver.start()
    dst_ids = shuffled_ids(args.blocks, args.pool, seed=2)
    pendings = [receiver.expect(f"t{i}", dst_ids, timeout_s=600, transport=TransportKind(args.transport))
                for i in range(args.reps)]
    for pending in pendings:
        print("HANDLE", transfer_handle_to_proto(pending.handle).SerializeToString().hex(), flush=True)
    if profile is not None:
        profile.enable()
    for pending in pendings:
        await pending.wait()
    if profile is not None:
        profile.disable()
        print_profile(profile, f"receiver, {args.blocks} blocks", file=sys.stderr)
    print("DONE", flush=True)
    sys.stdin.readline()  # keep the exported cache alive until the parent has measured
    await receiver.close()


async def remote_rows(transport: str, tokens: int, pool: int, reps: int, layer_compute_ms: float,
                      profile: bool = False) -> list[dict]:
    blocks = tokens // BLOCK_SIZE
    streamed = transport == "cuda_ipc"
    num_transfers = reps * (2 if streamed else 1)
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "receiver", "--transport", transport, "--blocks", str(blocks),
         "--pool", str(pool), "--reps", str(num_transfers), *(["--profile"] if profile else [])],
        stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    client = KVTransferClient()
    rows = []
    try:
        handles = []
        for _ in range(num_transfers):
            kind, data = child.stdout.readline().split()
            assert kind == "HANDLE"
            handles.append(transfer_handle_from_proto(common_pb2.TransferHandle.FromString(bytes.fromhex(data))))
        src = kv_cache(pool, "cuda")
        src_ids = shuffled_ids(blocks, pool, seed=1)
        times, frames = [], 0
        profiler = cProfile.Profile() if profile else None
        for index, handle in enumerate(handles[:reps]):
            torch.cuda.synchronize()
            if profiler is not None and index == 1:  # past the first transfer's one-off mapping
                profiler.enable()
            start = time.perf_counter()
            sender = await client.open(handle)
            await sender.send_all(src, src_ids, timeout_s=600)
            times.append((time.perf_counter() - start) * 1e3)
            frames = sender.num_frames
        if profiler is not None:
            profiler.disable()
            print_profile(profiler, f"sender e2e, {transport}, {blocks} blocks, {reps - 1} transfers")
        rows.append(row(transport, "e2e", tokens, blocks, statistics.median(times[1:] or times),
                        frames=frames if streamed else LAYERS))
        if streamed:
            cycles = int(layer_compute_ms * sleep_cycles_per_ms())
            results = [await streamed_transfer(client, handle, src, src_ids, cycles) for handle in handles[reps:]]
            kept = results[1:] or results
            rows.append(row(transport, "streamed", tokens, blocks, statistics.median(r[0] for r in kept),
                            exposed_ms=statistics.median(r[1] for r in kept), frames=kept[-1][2]))
        if transport == "cuda_ipc":
            dst = client.ipc_caches.open(handles[0].cuda_ipc_handle)
            src_index = torch.tensor(src_ids, device="cuda")
            dst_index = torch.tensor(shuffled_ids(blocks, pool, seed=2), device="cuda")
            rows.append(row(transport, "copy", tokens, blocks, device_ms(lambda: copy_blocks(src, dst, src_index, dst_index))))
        assert child.stdout.readline().strip() == "DONE"
    finally:
        await client.close()
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)
    return rows


def local_rows(tokens: int, pool: int) -> list[dict]:
    blocks = tokens // BLOCK_SIZE
    src, dst = kv_cache(pool, "cuda"), kv_cache(pool, "cuda")
    src_ids = torch.tensor(shuffled_ids(blocks, pool, seed=1), device="cuda")
    dst_ids = torch.tensor(shuffled_ids(blocks, pool, seed=2), device="cuda")

    def torch_copy() -> None:
        dst[:, :, dst_ids] = src[:, :, src_ids]

    return [row("local", "torch", tokens, blocks, event_ms(torch_copy)),
            row("local", "fused", tokens, blocks, device_ms(lambda: copy_blocks(src, dst, src_ids, dst_ids)))]


async def main(args: argparse.Namespace) -> None:
    rows = []
    for tokens in args.tokens:
        pool = tokens // BLOCK_SIZE + 64
        rows += local_rows(tokens, pool)
        rows += await remote_rows("cuda_ipc", tokens, pool, args.reps, args.layer_compute_ms, args.profile)
        if not args.skip_tcp:
            rows += await remote_rows("tcp", tokens, pool, min(args.reps, 3), args.layer_compute_ms)
        print(format_table(rows, COLUMNS), flush=True)
    if args.out:
        def ipc(mode: str) -> float | None:
            rates = [r["gb_per_s"] for r in rows if r["transport"] == "cuda_ipc" and r["mode"] == mode]
            return min(rates) if rates else None

        write_results(args.out, run_name("transfer"), rows, COLUMNS, summary={
            "target_cuda_ipc_gb_per_s": 1000, "min_cuda_ipc_copy_gb_per_s": ipc("copy"),
            "min_cuda_ipc_e2e_gb_per_s": ipc("e2e"), "min_cuda_ipc_streamed_exposed_gb_per_s": ipc("streamed"),
            "layer_compute_ms": args.layer_compute_ms})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 32768], help="prompt lengths")
    parser.add_argument("--reps", type=int, default=5, help="end-to-end transfers per point")
    parser.add_argument("--skip-tcp", action="store_true", help="leave out the loopback TCP rows")
    parser.add_argument("--layer-compute-ms", type=float, default=3.0,
                        help="device time per layer of the emulated forward in the streamed rows "
                             "(an 8k-token prefill of the 1B shape is ~3 ms per layer on an H200)")
    parser.add_argument("--out", default=None, help="directory for transfer-<UTC time>.json / .md")
    parser.add_argument("--profile", action="store_true",
                        help="print cProfile tables of the cuda_ipc end-to-end sender and of the receiver")
    parser.add_argument("--role", choices=["driver", "receiver"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="cuda_ipc", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pool", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.role == "receiver":
        asyncio.run(receiver_main(arguments))
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/transfer.py needs a CUDA device (see --help)")
        asyncio.run(main(arguments))
