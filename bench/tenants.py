"""One tenant's flood against another tenant's requests, through a gateway with two API keys,
without and with `--max-requests-per-key` and `--max-samples-per-key`, and with B's requests at
other priorities.

The stack runs as `cleave up` runs it (colocated by default, the shipped model, the CPU unless
`--device`), its gateway taking two keys from a key file. Tenant A keeps `--flood` streams
open (greedy requests of `--flood-tokens` tokens each and `--flood-samples` samples (n), a new
one as each ends; one the gateway refuses is sent again after the Retry-After it came with, as
a well-behaved client does); tenant B sends `--calm-requests` requests of `--calm-tokens`
tokens one after another once the flood streams, at each priority of `--calm-priorities` (A's
are 0; a non-zero one runs the gateway with `--scheduling-policy priority`). Per request cap
(`--caps`), samples cap (`--samples-caps`; 0: none, each) and priority: B's time to first
token and request time (p50, p90), A's finished and refused requests and its generated tokens
(all samples') per second. `--max-num-seqs` bounds each worker's running sequences (a request
of n samples takes n seats, all at once), so that a flood larger than it waits (priorities
order only what waits). A request of more samples than a samples cap, or than a worker's
seats, could never run (INVALID_ARGUMENT): such a configuration is refused before any stack
starts.

    python bench/tenants.py                      # caps 0 and 4, 32 flood streams
    python bench/tenants.py --caps 0,2,8 --flood 64
    python bench/tenants.py --caps 0 --calm-priorities 0,-1 --max-num-seqs 8
    python bench/tenants.py --caps 0 --samples-caps 0,8 --flood 4 --flood-samples 8 --flood-tokens 128 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.client import GatewayClient
from cleave.config import SHIPPED_MODEL_DIR, WorkerConfig
from cleave.proto.cleave.v1 import gateway_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, nearest_rank, run_name, write_results  # noqa: E402

KEYS = ("sk-flood", "sk-calm")
IDS = gateway_pb2.StreamOptions(include_token_ids=True)
COLUMNS = ("cap", "samples_cap", "calm_priority",
           "calm_ttft_p50_ms", "calm_ttft_p90_ms", "calm_e2e_p50_ms", "calm_e2e_p90_ms", "calm_failed",
           "flood_finished", "flood_refused", "flood_tok_per_s")


@dataclass
class Flood:
    """What tenant A's streams did."""

    finished: int = 0
    refused: int = 0
    tokens: int = 0
    streaming: asyncio.Event = field(default_factory=asyncio.Event)


def retry_after_s(error: grpc.aio.AioRpcError) -> float:
    metadata = dict(error.trailing_metadata() or ())
    return int(metadata.get("retry-after-ms", "1000")) / 1000


async def flood_stream(client: GatewayClient, index: int, tokens: int, samples: int, flood: Flood,
                       stop: asyncio.Event) -> None:
    """One of tenant A's streams: a request of `samples` samples after another until `stop`."""
    many = {"n": samples} if samples > 1 else {}  # one sample: n unset, the request of the default flood
    turn = 0
    while not stop.is_set():
        turn += 1
        try:
            async for response in client.generate(f"flood {index}.{turn}: tell me a long story", max_tokens=tokens,
                                                  temperature=0.0, ignore_eos=True, stream=IDS, **many):
                got = sum(len(sample.token_ids) for sample in response.samples)
                flood.tokens += got
                if got:
                    flood.streaming.set()
            flood.finished += 1
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            flood.refused += 1
            await asyncio.sleep(retry_after_s(error))  # the client honours the gateway's Retry-After


async def calm_requests(client: GatewayClient, count: int, tokens: int,
                        priority: int) -> tuple[list[float], list[float], int]:
    """Tenant B's requests, one after another: (TTFT ms, request ms, failures)."""
    ttfts, totals, failed = [], [], 0
    for index in range(count):
        start = time.perf_counter()
        first = None
        try:
            async for response in client.generate(f"calm {index}: what is 17 + 25?", max_tokens=tokens,
                                                  temperature=0.0, ignore_eos=True, stream=IDS, priority=priority):
                if first is None and any(sample.token_ids for sample in response.samples):
                    first = time.perf_counter()
        except grpc.aio.AioRpcError:
            failed += 1
            continue
        end = time.perf_counter()
        ttfts.append(((first or end) - start) * 1e3)
        totals.append((end - start) * 1e3)
    return ttfts, totals, failed


async def load(address: str, args: argparse.Namespace, priority: int) -> dict:
    flood, stop = Flood(), asyncio.Event()
    async with GatewayClient(address, api_key=KEYS[0]) as flooder, GatewayClient(address, api_key=KEYS[1]) as calm:
        streams = [asyncio.ensure_future(flood_stream(flooder, index, args.flood_tokens, args.flood_samples,
                                                      flood, stop))
                   for index in range(args.flood)]
        try:
            await asyncio.wait_for(flood.streaming.wait(), args.start_timeout_s)
            tokens_before, start = flood.tokens, time.perf_counter()
            ttfts, totals, failed = await calm_requests(calm, args.calm_requests, args.calm_tokens, priority)
            wall_s = time.perf_counter() - start
            flood_tokens = flood.tokens - tokens_before
        finally:
            stop.set()
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    return {
        "calm_ttft_p50_ms": nearest_rank(ttfts, 0.5, 1), "calm_ttft_p90_ms": nearest_rank(ttfts, 0.9, 1),
        "calm_e2e_p50_ms": nearest_rank(totals, 0.5, 1), "calm_e2e_p90_ms": nearest_rank(totals, 0.9, 1),
        "calm_failed": failed, "flood_finished": flood.finished, "flood_refused": flood.refused,
        "flood_tok_per_s": round(flood_tokens / wall_s, 1), "calm_ttfts_ms": [round(t, 1) for t in ttfts],
    }


def run_cap(cap: int, samples_cap: int, priority: int, args: argparse.Namespace, workdir: Path) -> dict:
    key_file = workdir / "api-keys"
    key_file.write_text("\n".join(KEYS) + "\n")
    policy = ("--scheduling-policy", "priority") if priority else ()
    seats = ("--max-num-seqs", str(args.max_num_seqs)) if args.max_num_seqs else ()
    spec = StackSpec(model=args.model, mode=args.mode, grpc_port=0, http_port=None, device=args.device,
                     log_level="WARNING", metrics=False, worker_args=seats,
                     gateway_args=("--api-key-file", str(key_file), "--max-requests-per-key", str(cap),
                                   "--max-samples-per-key", str(samples_cap), *policy))
    stack = ProcessStack(spec, workdir / f"cap-{cap}-samples-{samples_cap}-priority-{priority}")
    stack.start(timeout_s=args.start_timeout_s)
    try:
        row = {"cap": cap, "samples_cap": samples_cap, "calm_priority": priority,
               **asyncio.run(load(stack.gateway_address, args, priority))}
    finally:
        stack.stop()
    print(format_table([row], COLUMNS), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="0,4", help="--max-requests-per-key values, comma-separated (0: none)")
    parser.add_argument("--flood", type=int, default=32, help="tenant A's streams open at once")
    parser.add_argument("--flood-tokens", type=int, default=64, help="tokens of each of A's requests")
    parser.add_argument("--flood-samples", type=int, default=1, help="samples (n) of each of A's requests")
    parser.add_argument("--samples-caps", default="0", help="--max-samples-per-key values, comma-separated, "
                        "each run with each of --caps (0: none)")
    parser.add_argument("--calm-requests", type=int, default=20, help="tenant B's requests, one after another")
    parser.add_argument("--calm-tokens", type=int, default=8, help="tokens of each of B's requests")
    parser.add_argument("--calm-priorities", default="0", help="priorities of B's requests, comma-separated, "
                        "one run each (lower first; A's are 0)")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="each worker's running requests at most "
                        "(0: the workers' default)")
    parser.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated", "conditional"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", type=Path, default=SHIPPED_MODEL_DIR)
    parser.add_argument("--start-timeout-s", type=float, default=600.0, help="a guard against a hang, not a wait")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "tenants")
    args = parser.parse_args(argv)
    caps = [int(cap) for cap in args.caps.split(",") if cap]
    priorities = [int(priority) for priority in args.calm_priorities.split(",") if priority]
    samples_caps = [int(cap) for cap in args.samples_caps.split(",") if cap]
    if (any(cap < 0 for cap in caps + samples_caps) or args.flood < 1 or args.calm_requests < 1
            or args.flood_samples < 1 or args.max_num_seqs < 0):
        parser.error("caps and --max-num-seqs must be >= 0, --flood, --flood-samples and --calm-requests >= 1")
    too_small = [cap for cap in samples_caps if 0 < cap < args.flood_samples]
    if too_small:
        parser.error(f"--samples-caps {','.join(map(str, too_small))} is less than --flood-samples "
                     f"{args.flood_samples}: the gateway refuses a request of more samples than the cap "
                     "(INVALID_ARGUMENT), so tenant A could send nothing; give caps of at least "
                     f"{args.flood_samples}, or fewer samples")
    seats = args.max_num_seqs or WorkerConfig.max_num_seqs
    if args.flood_samples > seats:
        parser.error(f"--flood-samples {args.flood_samples} is more than a worker's {seats} seats "
                     "(--max-num-seqs): the engine refuses a request of more samples than it can run at once "
                     "(INVALID_ARGUMENT); give at most that many samples, or more seats")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cleave-tenants-") as workdir:
        for cap in caps:
            for samples_cap in samples_caps:
                for priority in priorities:
                    rows.append(run_cap(cap, samples_cap, priority, args, Path(workdir)))
    print(format_table(rows, COLUMNS))
    summary = {"stack": f"{args.mode}, {args.device}, {args.model.name}, two API keys",
               "flood": f"{args.flood} streams of {args.flood_tokens} tokens"
                        + (f", {args.flood_samples} samples a request" if args.flood_samples > 1 else "")
                        + " (tenant A)",
               "calm": f"{args.calm_requests} requests of {args.calm_tokens} tokens one after another (tenant B)",
               "max_num_seqs": args.max_num_seqs or "the workers' default"}
    write_results(args.out, run_name("tenants"), rows, COLUMNS, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
