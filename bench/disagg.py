"""Disaggregated vs colocated serving under long-prompt interference, through the gateway.

Each mode starts the whole stack as processes (`cleave up`'s ProcessStack): disaggregated is
1 prefill + 1 decode worker sharing the device (on one GPU the KV moves by CUDA IPC, which
the workers negotiate on their first transfer), colocated is 1 decode worker that prefills
itself. The workload goes through the gateway's gRPC Generate stream:
  - `--num-users` streaming users, each sending requests one after another for
    `--duration-s` seconds (or `--requests-per-user` requests when the duration is 0;
    `--prompt-len` random token ids, `--output-len` greedy tokens, ignore_eos), their first
    requests spread over `--ramp-s` seconds;
  - meanwhile a `--long-prompt-len` prompt arrives `--long-first-s` seconds after the start
    and then every `--long-interval-s` seconds while the users run, so the default run sees
    several of them.
Reported per mode, for the users' requests: time to first token (p50/p90), time per output
token after the first (per request, p50/p90), the p99 gap between streamed tokens, and
output tokens/s of everything served. Every mode is warmed up first (graphs, kernels, the
transport handshake).

    python bench/disagg.py --out bench/results/disagg             # GPU, Llama-3.2-1B-shaped bf16
    python bench/disagg.py --device cpu --num-users 4 --prompt-len 32 --output-len 16 \\
        --duration-s 3 --long-interval-s 1 --out /tmp/disagg   # CPU smoke, shipped reasoner
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

COLUMNS = ["mode", "transport", "kvstore_puts", "requests", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms",
           "itl_p99_ms", "long_prompts", "long_ttft_p50_ms", "output_tok_s", "wall_s"]
FIRST_TOKEN_ID = 3  # ids below are pad/bos/eos in the shipped tokenizers


@dataclass
class Timing:
    """One streamed request as the client saw it (monotonic seconds)."""

    kind: str  # "user" or "long"
    sent: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds per token between responses

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.num_tokens < 2:
            return None
        return (self.last - self.first) / (self.num_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


REASONING_MODES = {"inline": 3, "separate": 1, "hidden": 2}  # cleave.v1.ReasoningMode values


async def stream_one(stub, kind: str, prompt: list[int], max_tokens: int, args: argparse.Namespace) -> Timing:
    """Send one Generate request and time its token stream."""
    from cleave.proto.cleave.v1 import common_pb2 as c
    from cleave.proto.cleave.v1 import gateway_pb2 as g

    request = g.GenerateRequest(
        token_ids=g.TokenIds(ids=prompt),
        sampling=c.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        reasoning=c.ReasoningOptions(mode=REASONING_MODES[args.reasoning_mode]),
        stream=g.StreamOptions(include_token_ids=True),
    )
    timing = Timing(kind, time.monotonic())
    async for response in stub.Generate(request, timeout=args.timeout_s):
        now = time.monotonic()
        count = sum(len(sample.token_ids) for sample in response.samples)
        if not count:
            continue
        if timing.first is None:
            timing.first = now
        else:
            timing.gaps.extend([(now - timing.last) / count] * count)
        timing.last = now
        timing.num_tokens += count
    return timing


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)]


async def run_workload(address: str, args: argparse.Namespace, vocab: int) -> tuple[list[Timing], float]:
    """The users and the long prompts; returns every request's timing and the wall time."""
    from cleave.proto.cleave.v1 import gateway_pb2_grpc
    from cleave.rpc import aio_channel

    rng = random.Random(args.seed)
    channel = aio_channel(address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    timings: list[Timing] = []

    started = time.monotonic()

    def more_requests(num_sent: int) -> bool:
        if args.duration_s > 0:
            return time.monotonic() - started < args.duration_s
        return num_sent < args.requests_per_user

    async def user(index: int) -> None:
        await asyncio.sleep(args.ramp_s * index / max(args.num_users, 1))
        num_sent = 0
        while more_requests(num_sent):
            prompt = random_prompt(rng, args.prompt_len, vocab)
            timings.append(await stream_one(stub, "user", prompt, args.output_len, args))
            num_sent += 1

    async def long_prompts(stop: asyncio.Event) -> list[Timing]:
        pending = []
        delay = args.long_first_s
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                prompt = random_prompt(rng, args.long_prompt_len, vocab)
                pending.append(asyncio.ensure_future(
                    stream_one(stub, "long", prompt, args.long_output_len, args)))
                delay = args.long_interval_s
        return list(await asyncio.gather(*pending))

    stop = asyncio.Event()
    longs = asyncio.ensure_future(long_prompts(stop)) if args.long_interval_s > 0 else None
    try:
        await asyncio.gather(*(user(i) for i in range(args.num_users)))
        stop.set()
        if longs is not None:
            timings.extend(await longs)
    finally:
        stop.set()
        await channel.close()
    return timings, time.monotonic() - started


async def warm_up(address: str, args: argparse.Namespace, vocab: int) -> None:
    """A few requests one at a time: kernels, graphs and the prefill/decode handshake."""
    from cleave.proto.cleave.v1 import gateway_pb2_grpc
    from cleave.rpc import aio_channel

    rng = random.Random(args.seed + 1)
    async with aio_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for length in (args.prompt_len, args.prompt_len, args.long_prompt_len):
            await stream_one(stub, "warmup", random_prompt(rng, length, vocab), 4, args)
        await asyncio.gather(*(stream_one(stub, "warmup", random_prompt(rng, args.prompt_len, vocab), 4, args)
                               for _ in range(min(args.num_users, 8))))


async def negotiated_transport(decode_address: str, prefill_worker_id: str) -> str:
    """The transport the decode worker's Admit hands out for this prefill worker now."""
    from cleave.proto.cleave.v1 import common_pb2 as c
    from cleave.proto.cleave.v1 import decode_pb2 as d
    from cleave.proto.cleave.v1 import decode_pb2_grpc
    from cleave.rpc import aio_channel

    async with aio_channel(decode_address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        admitted = await stub.Admit(d.AdmitRequest(
            request_id="bench-transport-probe", prompt_token_ids=[FIRST_TOKEN_ID] * 4,
            sampling=c.SamplingParams(max_tokens=1), gateway_id="bench-probe", prefill_worker_id=prefill_worker_id))
        await stub.Abort(c.AbortRequest(request_id="bench-transport-probe"))
    return c.TransportKind.Name(admitted.handle.transport).removeprefix("TRANSPORT_KIND_").lower()


def summarize(mode: str, transport: str, timings: list[Timing], wall_s: float) -> dict:
    users = [t for t in timings if t.kind == "user"]
    longs = [t for t in timings if t.kind == "long"]
    ms = 1e3
    ttfts = [t.ttft * ms for t in users]
    tpots = [t.tpot * ms for t in users if t.tpot is not None]
    gaps = [gap * ms for t in users for gap in t.gaps]
    return {
        "mode": mode, "transport": transport, "requests": len(users),
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
        "tpot_p50_ms": percentile(tpots, 50), "tpot_p90_ms": percentile(tpots, 90),
        "itl_p99_ms": percentile(gaps, 99), "long_prompts": len(longs),
        "long_ttft_p50_ms": percentile([t.ttft * ms for t in longs], 50),
        "output_tok_s": sum(t.num_tokens for t in timings) / wall_s, "wall_s": wall_s,
        "user_tokens_per_request": sum(t.num_tokens for t in users) / max(len(users), 1),
    }


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, workdir: Path, vocab: int) -> dict:
    from cleave.cli._stack import ProcessStack, StackSpec

    worker_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-context-length", str(args.max_context_length)]
    if args.enforce_eager and args.device != "cpu":
        worker_args.append("--enforce-eager")
    spec = StackSpec(model=model_dir, mode=mode, grpc_port=0, http_port=None, device=args.device,
                     num_kv_blocks=args.num_kv_blocks, log_level="WARNING", worker_args=tuple(worker_args),
                     store_to_kvstore=args.store_to_kvstore)
    stack = ProcessStack(spec, workdir / mode)
    stack.start(timeout_s=args.start_timeout_s)
    try:
        asyncio.run(warm_up(stack.gateway_address, args, vocab))
        transport = "local"
        if mode == "disaggregated":
            decode = next(child for child in stack.children if child.name == "decode-0")
            transport = asyncio.run(negotiated_transport(decode.address, "prefill-0"))
        timings, wall_s = asyncio.run(run_workload(stack.gateway_address, args, vocab))
    finally:
        stack.stop()
    return {**summarize(mode, transport, timings, wall_s), "kvstore_puts": args.store_to_kvstore}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: Llama-3.2-1B-shaped random bf16 on cuda, the shipped reasoner on cpu)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--modes", default="disaggregated,colocated")
    parser.add_argument("--num-users", type=int, default=50)
    parser.add_argument("--duration-s", type=float, default=12.0,
                        help="users send requests until this long after the start (0: --requests-per-user each)")
    parser.add_argument("--requests-per-user", type=int, default=1, help="with --duration-s 0")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--ramp-s", type=float, default=2.0, help="users' first requests spread over this long")
    parser.add_argument("--long-prompt-len", type=int, default=None,
                        help="default: 8192 (on cpu 256, within the shipped reasoner's context)")
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--long-first-s", type=float, default=0.5, help="when the first long prompt arrives")
    parser.add_argument("--long-interval-s", type=float, default=3.0, help="then one every this long (0: none at all)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-context-length", type=int, default=None,
                        help="default: the longest prompt plus its output, rounded up to 256")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="per worker (default: every user's request plus 4 long prompts, with room to spare)")
    parser.add_argument("--block-size", type=int, default=16, help="only used to size the default KV cache")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--reasoning-mode", choices=sorted(REASONING_MODES), default="inline",
                        help="how the gateway returns thinking text (inline: streamed as it comes)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per request")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-store-to-kvstore", dest="store_to_kvstore", action="store_false",
                        help="prefill workers keep no prompt blocks in the kvstore (A/B of the background puts)")
    parser.add_argument("--out", default=None, help="directory for disagg.json / disagg.md")
    args = parser.parse_args(argv)
    if args.long_prompt_len is None:
        args.long_prompt_len = 256 if args.device == "cpu" else 8192
    longest = max(args.prompt_len + args.output_len, args.long_prompt_len + args.long_output_len)
    if args.max_context_length is None:
        args.max_context_length = -(-longest // 256) * 256
    if args.num_kv_blocks is None:
        per_user = -(-(args.prompt_len + args.output_len) // args.block_size)
        per_long = -(-(args.long_prompt_len + args.long_output_len) // args.block_size)
        args.num_kv_blocks = int(1.25 * (args.num_users * per_user + 4 * per_long)) + 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common import format_table, write_results

    from cleave.config import SHIPPED_MODEL_DIR

    with tempfile.TemporaryDirectory(prefix="cleave-disagg-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model
        if model_dir is None and args.device == "cpu":
            model_dir = SHIPPED_MODEL_DIR
        elif model_dir is None:
            from engine import write_checkpoint

            model_dir = write_checkpoint(workdir / "model", args.device)
        vocab = min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 512)
        rows = []
        for mode in args.modes.split(","):
            rows.append(run_mode(mode, model_dir, args, workdir, vocab))
            print(format_table(rows[-1:], COLUMNS), flush=True)
    summary = {key: getattr(args, key) for key in (
        "num_users", "duration_s", "requests_per_user", "prompt_len", "output_len", "long_prompt_len", "long_output_len",
        "long_first_s", "long_interval_s", "max_num_batched_tokens", "num_kv_blocks", "reasoning_mode")}
    summary["model"] = str(args.model or ("shipped reasoner" if args.device == "cpu" else "Llama-3.2-1B-shaped bf16"))
    print(format_table(rows, COLUMNS))
    if args.out:
        for path in write_results(args.out, "disagg", rows, COLUMNS, summary):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
