"""KVStore Put benchmark: what a prompt's 16 MiB put costs the store, and what it does to a
Lookup issued meanwhile.

Layout: Llama-3.2-1B-shaped KV (16 layers, 8 KV heads, head_dim 64, bf16, 16-token blocks:
32 KiB per token, one block 512 KiB), `--tokens` per put (512: 32 blocks, 16 MiB). The store
(`BlockStore` behind the real servicer and `serve()`, on an ephemeral port) runs in a child
process of this script, so its CPU time (all its threads, gRPC's included) is the store's
alone; the client is the real `KVStoreClient` in this process.
Each put stores new blocks (fresh chained hashes). Rows:
  - put:             puts back to back; wall ms per put (client encode + stream + store),
                     server CPU ms per put (user + system, the mean:
                     os.times ticks are 10 ms), CPU ms of the store's event-loop thread
                     (time.thread_time, median), MB/s (payload MB / wall s);
  - lookup/idle:     Lookup latency with nothing else in flight;
  - lookup/during:   Lookups issued one after another while a put is in flight (latency of each).
`--grpc-floor` swaps the store's Put for one that only counts the messages gRPC delivered: what
receiving 16 MiB costs before the store does anything (lookups then miss).
`--profile` runs cProfile on the store's event-loop thread over the put phase and writes the
top functions to `<out>/<name>_profile.txt` (and no other results: profiling inflates them).

    python bench/kvstore_put.py --puts 30 --out bench/results/kvstore --name after
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import format_table, run_name, write_results

from cleave.kv.prefix_hash import block_hashes
from cleave.proto.cleave.v1 import kvstore_pb2
from cleave.rpc import serve
from cleave.rpc.types import KVLayout
from cleave.transfer.kvstore_client import KVStoreClient
from services.kvstore.__main__ import registration
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.store import BlockStore, StoreConfig

LAYOUT = KVLayout(model_id="llama-3.2-1b-shape", dtype="bfloat16", block_size=16, num_layers=16,
                  num_kv_heads=8, head_dim=64)
BLOCK_BYTES = 16 * 2 * 16 * 8 * 64 * 2  # [L, 2, BS, Hkv, D] bf16 = 512 KiB
COLUMNS = ["row", "n", "mb", "wall_ms_p50", "wall_ms_max", "server_cpu_ms", "server_user_ms", "server_sys_ms",
           "loop_cpu_ms", "mb_per_s"]


# -- the store (child process) ---------------------------------------------------------------

class ReceiveOnlyServicer(KVStoreServicer):
    """A store whose Put receives blocks and keeps nothing (the gRPC floor)."""

    async def Put(self, request_iterator, context):  # type: ignore[no-untyped-def]
        num_messages = 0
        async for _ in request_iterator:
            num_messages += 1
        return kvstore_pb2.PutResponse(num_stored=num_messages)


async def store_main(args: argparse.Namespace) -> None:
    """Serve a BlockStore (its disk tier in a temporary directory)."""
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as scratch:
        await serve_store(args, Path(scratch) if args.disk_mib else None)


async def serve_store(args: argparse.Namespace, disk: Path | None) -> None:
    """Answer `cpu`, `profile on|off`, `quit` lines on stdin."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # logs go to stderr: stdout carries only the replies
    backend = BlockStore(StoreConfig(ram_bytes=args.ram_mib << 20, disk_path=disk, disk_bytes=args.disk_mib << 20))
    await backend.start()
    servicer = (ReceiveOnlyServicer if args.grpc_floor else KVStoreServicer)(backend)
    server = await serve([registration(servicer)], "127.0.0.1:0", handle_signals=False)
    await server.set_ready()
    profile = cProfile.Profile()
    print(f"PORT {server.port}", file=replies)
    while True:
        command = (await asyncio.to_thread(sys.stdin.readline)).strip()
        if command == "cpu":
            times = os.times()  # every thread of the process, gRPC's included
            # thread_time: this coroutine runs on the event loop's thread
            print(f"CPU {times.user} {times.system} {time.thread_time()}", file=replies)
        elif command == "profile on":
            profile.enable()  # the event loop's thread: this coroutine runs on it
            print("OK", file=replies)
        elif command == "profile off":
            profile.disable()
            text = io.StringIO()
            for key in ("tottime", "cumulative"):
                pstats.Stats(profile, stream=text).sort_stats(key).print_stats(30)
            Path(args.profile_file).write_text(text.getvalue())
            print("OK", file=replies)
        else:
            break
    await server.drain(0)
    await backend.shutdown()


class StoreProcess:
    """The store in a child process, driven over its stdin/stdout."""

    def __init__(self, args: argparse.Namespace, profile_file: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--store", "--ram-mib", str(args.ram_mib), "--disk-mib", str(args.disk_mib),
             "--profile-file", str(profile_file), *(["--grpc-floor"] if args.grpc_floor else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self._answer("PORT"))

    def _answer(self, prefix: str) -> str:
        line = self.process.stdout.readline().strip()
        if not line.startswith(prefix):
            raise RuntimeError(f"store process answered {line!r}, expected {prefix}")
        return line[len(prefix):].strip()

    def ask(self, command: str, prefix: str = "OK") -> str:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._answer(prefix)

    def cpu_s(self) -> tuple[float, float, float]:
        """The store's CPU seconds so far: user and system (all threads), event-loop thread."""
        user, system, loop = self.ask("cpu", "CPU").split()
        return float(user), float(system), float(loop)

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait(timeout=30)


# -- the client (this process) ---------------------------------------------------------------

def prompt_hashes(index: int, num_blocks: int) -> list[bytes]:
    tokens = range(index * 1_000_000, index * 1_000_000 + num_blocks * LAYOUT.block_size)
    return block_hashes(list(tokens), LAYOUT.block_size, b"bench")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(args: argparse.Namespace, store: StoreProcess) -> tuple[list[dict], dict]:
    num_blocks = args.tokens // LAYOUT.block_size
    mb = num_blocks * BLOCK_BYTES / 1e6
    # [n, L, 2, BS, Hkv, D] bf16
    blocks = torch.randn(num_blocks, 16, 2, 16, 8, 64).to(torch.bfloat16)
    client = KVStoreClient(f"127.0.0.1:{store.port}", client_id="bench")
    await client.connect(LAYOUT)
    probe = prompt_hashes(0, num_blocks)
    await client.put(probe, blocks)
    for index in range(1, 1 + args.warmup):
        await client.put(prompt_hashes(index, num_blocks), blocks)
        await client.lookup(probe)
    next_prompt = 1 + args.warmup

    if args.profile:
        store.ask("profile on")
    walls, users, systems, loops = [], [], [], []
    for _ in range(args.puts):
        hashes = prompt_hashes(next_prompt, num_blocks)
        next_prompt += 1
        cpu_before = store.cpu_s()
        start = time.perf_counter()
        result = await client.put(hashes, blocks)
        walls.append((time.perf_counter() - start) * 1e3)
        cpu_after = store.cpu_s()
        users.append((cpu_after[0] - cpu_before[0]) * 1e3)
        systems.append((cpu_after[1] - cpu_before[1]) * 1e3)
        loops.append((cpu_after[2] - cpu_before[2]) * 1e3)
        assert result.num_stored == num_blocks, result
        assert await client.lookup(probe) == (0 if args.grpc_floor else num_blocks)  # keeps the probe most recent
    if args.profile:
        store.ask("profile off")

    idle = []
    for _ in range(args.lookups):
        start = time.perf_counter()
        assert await client.lookup(probe) == (0 if args.grpc_floor else num_blocks)
        idle.append((time.perf_counter() - start) * 1e3)

    during = []
    for _ in range(args.puts):
        hashes = prompt_hashes(next_prompt, num_blocks)
        next_prompt += 1
        put = asyncio.ensure_future(client.put(hashes, blocks))
        await asyncio.sleep(0)  # the put's stream is open
        while not put.done():
            start = time.perf_counter()
            await client.lookup(probe)
            during.append((time.perf_counter() - start) * 1e3)
        await put
    await client.close()

    rows = [
        {"row": "put", "n": len(walls), "mb": mb, "wall_ms_p50": statistics.median(walls), "wall_ms_max": max(walls),
         "server_cpu_ms": statistics.mean(users) + statistics.mean(systems),
         "server_user_ms": statistics.mean(users), "server_sys_ms": statistics.mean(systems),
         "loop_cpu_ms": statistics.median(loops), "mb_per_s": mb / (statistics.median(walls) / 1e3)},
        {"row": "lookup/idle", "n": len(idle), "wall_ms_p50": statistics.median(idle), "wall_ms_max": max(idle)},
        {"row": "lookup/during put", "n": len(during), "wall_ms_p50": statistics.median(during),
         "wall_ms_max": max(during)},
    ]
    summary = {
        **({"note": args.note} if args.note else {}),
        "cpu": f"{cpu_model()} x {os.cpu_count()} cores (shared)",
        "layout": f"{LAYOUT.num_layers} layers, {LAYOUT.num_kv_heads} KV heads, head_dim {LAYOUT.head_dim}, "
                  f"{LAYOUT.dtype}, {LAYOUT.block_size}-token blocks ({BLOCK_BYTES // 1024} KiB each)",
        "per put": f"{args.tokens} tokens = {num_blocks} blocks = {mb:.1f} MB",
        "store": "Put receives only (--grpc-floor)" if args.grpc_floor else
                 f"RAM {args.ram_mib} MiB" + (f", disk {args.disk_mib} MiB" if args.disk_mib else ", no disk tier"),
        "lookup_during_put_p99_ms": round(percentile(during, 0.99), 2),
    }
    return rows, summary


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per put (16 per block)")
    parser.add_argument("--puts", type=int, default=20, help="timed puts (and as many with lookups in flight)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=50, help="idle lookups timed")
    parser.add_argument("--ram-mib", type=int, default=8192, help="the store's RAM tier")
    parser.add_argument("--disk-mib", type=int, default=0, help="disk tier in a temporary directory (0: none)")
    parser.add_argument("--grpc-floor", action="store_true", help="Put only receives (keeps nothing)")
    parser.add_argument("--profile", action="store_true", help="cProfile the store's event loop over the puts")
    parser.add_argument("--note", default="", help="recorded with the results (which code ran)")
    parser.add_argument("--out", default="bench/results/kvstore")
    parser.add_argument("--name", default="kvstore_put")
    parser.add_argument("--store", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-file", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.store:
        asyncio.run(store_main(args))
        return
    name = run_name(args.name)
    profile_file = Path(args.out) / f"{name}_profile.txt"
    profile_file.parent.mkdir(parents=True, exist_ok=True)
    store = StoreProcess(args, profile_file)
    try:
        rows, summary = asyncio.run(run(args, store))
    finally:
        store.close()
    if not args.profile:
        profile_file.unlink(missing_ok=True)
    print(format_table(rows, COLUMNS))
    for key, value in summary.items():
        print(f"{key}: {value}")
    if args.profile:  # profiled times are inflated: only the profile is kept
        print(f"profile: {profile_file}")
    else:
        write_results(args.out, name, rows, COLUMNS, summary)


if __name__ == "__main__":
    main()
