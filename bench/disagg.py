"""Disaggregated vs colocated vs conditional serving under long-prompt interference, through the gateway.

Each mode starts the whole stack as processes (`cleave up`'s ProcessStack): disaggregated is
1 prefill + 1 decode worker sharing the device (on one GPU the KV moves by CUDA IPC, which
the workers negotiate on their first transfer; the two run under an MPS daemon unless
`--mps off`, one daemon for the whole run that every stack wanting it adopts, the `mps` column
says whether they did), colocated is 1 decode worker that prefills
itself, conditional starts what disaggregated starts and lets the gateway choose per request.
The load (bench/serve_load.py) comes from `--client-procs` client processes, so that the
client is not what limits the stream (how the HTTP stream's tokens are counted: bench/serve_clients.py):
  - `--num-users` streaming users, each sending requests one after another for
    `--duration-s` seconds (or `--requests-per-user` requests when the duration is 0), their
    first requests spread over `--ramp-s` seconds. Over gRPC (`--api grpc`) a request is
    `--prompt-len` random token ids; over the OpenAI API (`--api http`) a streamed chat
    completion of random words, as many as make about `--prompt-len` tokens with the served
    tokenizer and its chat template (or `--prompt-words` words when given), so that the two
    APIs carry prompts of the same length in tokens. Either way `--output-len` greedy tokens,
    ignore_eos. Lengths are N or LOW-HIGH (drawn uniformly per request);
  - meanwhile a `--long-prompt-len` prompt arrives `--long-first-s` seconds after the start
    and then every `--long-interval-s` seconds (the mean of exponential gaps with
    `--long-arrival poisson`) while the users run.
Reported per mode, for the users' requests: time to first token (p50/p90), time per output
token after the first (per request, p50/p90), the p99 gap between streamed tokens; output
tokens/s of everything served; and over all requests (users' and long ones) the SLO
goodput: requests/s that finished with TTFT <= `--slo-ttft-ms` and TPOT <= `--slo-tpot-ms`,
and their share (`slo_pct`). Beside them, the CPU cores each part of the run used meanwhile
(`cpu_gateway`, `cpu_decode`, `cpu_prefill`, `cpu_kvstore`: the stack's processes and their
ranks; `cpu_clients`: the load's own processes) and the host's `host_cpus`: when they add
up to the host, the latencies are the host's as much as the stack's. And what the workers'
engines did meanwhile, from their /metrics (`decode_step_ms`, `decode_steps_s`,
`decode_busy_pct`, `decode_tokens`, and the same for prefill: bench/engine_meter.py): a TPOT
far above `decode_step_ms` is time between the decode engine's steps. Every mode is warmed up
first (graphs, kernels, the transport handshake). All modes of a run go into one
`disagg-<UTC time>.json/.md` under `--out`.

Presets (explicit flags still win):
  --preset http64   64 users over HTTP, chats of 256-512 tokens (200-400 words of English text
                    with a subword tokenizer), 128 output tokens, no long prompts
  --preset mixed    48 users of 256-1024-token prompts and 128-256 output tokens, plus
                    8k-32k-token prompts arriving as a Poisson process (one per 2 s), for 60 s

    python bench/disagg.py --out bench/results/disagg             # GPU, Llama-3.2-1B-shaped bf16
    python bench/disagg.py --preset mixed --modes disaggregated,colocated,conditional --out bench/results/disagg
    python bench/disagg.py --preset mixed --modes disaggregated,conditional \
        --conditional-policy 1024:0,256:2048 --out bench/results/disagg   # conditional's thresholds, in one run
    python bench/disagg.py --num-users 1 --modes colocated,disaggregated --long-interval-s 0 --rounds 3 \
        --out bench/results/disagg   # one user, the modes alternating: rows of each round compare
    python bench/disagg.py --modes disaggregated,colocated --worker-variant= \\
        --worker-variant='--stream-interval 2' --out bench/results/disagg   # worker flags compared in one run
    python bench/disagg.py --device cpu --num-users 4 --prompt-len 32 --output-len 16 --duration-s 3 \\
        --long-interval-s 1 --client-procs 2 --out /tmp/disagg   # CPU smoke, shipped reasoner
    python bench/disagg.py --device cpu --api http --num-users 4 --output-len 16 --duration-s 3 --client-procs 2
    python bench/disagg.py --device cpu --num-users 4 --prompt-len 64 --output-len 64 --duration-s 10 \
        --long-interval-s 0 --client-procs 1 --modes disaggregated --tls off,on --api grpc,http --rounds 2 \
        --out bench/results/disagg   # what TLS costs the served path, in one run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_use import CpuMeter, role_of  # noqa: E402 - bench/ is on the path now
from cleave.cli._arg_types import positive_int  # noqa: E402
from engine_meter import EngineMeter  # noqa: E402
from serve_clients import REASONING_MODES  # noqa: E402
from serve_load import (  # noqa: E402
    FIRST_TOKEN_ID, Slo, Workload, max_chat_tokens, run_load, summarize, warm_up, words_for_tokens,
)

if TYPE_CHECKING:
    import grpc

    from cleave.cli._stack import StackSpec

COLUMNS = ["mode", "round", "gateways", "api", "transport", "tls", "mps", "prefill_sm_pct", "metrics", "switch_ms", "policy", "prefill_variant", "worker_variant", "kvstore_puts", "requests", "errors", "ttft_p50_ms", "ttft_p90_ms",
           "tpot_p50_ms", "tpot_p90_ms", "itl_p99_ms", "long_prompts", "long_ttft_p50_ms", "output_tok_s",
           "goodput_rps", "slo_pct", "wall_s", "cpu_gateway", "cpu_decode", "cpu_prefill", "cpu_clients", "host_cpus",
           "decode_step_ms", "decode_busy_pct", "decode_tokens", "prefill_step_ms", "prefill_busy_pct", "prefill_tokens"]
MODES = ("disaggregated", "colocated", "conditional")
PRESETS = {
    "http64": dict(api="http", num_users=64, prompt_len=(256, 512), output_len=(128, 128), long_interval_s=0.0),
    "mixed": dict(num_users=48, prompt_len=(256, 1024), output_len=(128, 256), long_prompt_len=(8192, 32768),
                  long_interval_s=2.0, long_arrival="poisson", duration_s=60.0),
}


async def negotiated_transport(decode_address: str, prefill_worker_id: str, internal_token: str | None,
                               credentials: grpc.ChannelCredentials | None = None) -> str:
    """The transport the decode worker's Admit hands out for this prefill worker now (the
    stack's internal token authenticates the probe; `credentials`: a TLS stack's)."""
    from cleave.proto.cleave.v1 import common_pb2 as c
    from cleave.proto.cleave.v1 import decode_pb2 as d
    from cleave.proto.cleave.v1 import decode_pb2_grpc
    from cleave.rpc import aio_channel

    async with aio_channel(decode_address, internal_token=internal_token, credentials=credentials) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        admitted = await stub.Admit(d.AdmitRequest(
            request_id="bench-transport-probe", prompt_token_ids=[FIRST_TOKEN_ID] * 4,
            sampling=c.SamplingParams(max_tokens=1), gateway_id="bench-probe", prefill_worker_id=prefill_worker_id))
        await stub.Abort(c.AbortRequest(request_id="bench-transport-probe"))
    return c.TransportKind.Name(admitted.handle.transport).removeprefix("TRANSPORT_KIND_").lower()


@dataclass(frozen=True)
class Variant:
    """One row's stack: the mode and the settings the run compares."""

    mode: str
    num_gateways: int
    puts: bool
    api: str
    mps: str
    sm_percent: int
    metrics: bool
    switch_ms: float | None  # every service's --gil-switch-interval-ms; None: Python's 5 ms
    policy: "ConditionalPolicy | None" = None  # conditional mode's thresholds; None: the gateway's defaults
    prefill_variant: str = ""  # extra prefill-worker flags of this row (--prefill-variant)
    worker_variant: str = ""  # extra flags of every worker of this row (--worker-variant)
    tls: bool = False  # TLS between the services and to the gateway (cleave up --tls)


@dataclass(frozen=True)
class ConditionalPolicy:
    """Conditional mode's thresholds (gateway --local-prefill-max-tokens,
    --remote-prefill-idle-tokens, --local-prefill-max-running and
    --remote-prefill-busy-max-queue-tokens), written LOCAL:IDLE[:RUNNING[:BUSY_QUEUE]] (one
    left out: the gateway's default)."""

    local_max_tokens: int
    idle_tokens: int
    max_running: int | None = None
    busy_max_queue_tokens: int | None = None

    @staticmethod
    def parse(text: str) -> "ConditionalPolicy":
        parts = text.split(":")
        try:
            if not 1 <= len(parts) <= 4:
                raise ValueError(text)
            local, idle, running, queue = (int(part) if part else None for part in parts + [""] * (4 - len(parts)))
            if local is None:
                raise ValueError(text)
            return ConditionalPolicy(local, idle or 0, running, queue)
        except ValueError:
            raise argparse.ArgumentTypeError("a conditional policy is LOCAL:IDLE[:RUNNING[:BUSY_QUEUE]] "
                                             f"(token and request counts), not {text!r}")

    def gateway_args(self) -> tuple[str, ...]:
        optional = (("--local-prefill-max-running", self.max_running),
                    ("--remote-prefill-busy-max-queue-tokens", self.busy_max_queue_tokens))
        return ("--local-prefill-max-tokens", str(self.local_max_tokens),
                "--remote-prefill-idle-tokens", str(self.idle_tokens),
                *(item for flag, value in optional if value is not None for item in (flag, str(value))))

    def __str__(self) -> str:
        values = [self.local_max_tokens, self.idle_tokens, self.max_running, self.busy_max_queue_tokens]
        while values[-1] is None:
            values.pop()
        return ":".join("" if value is None else str(value) for value in values)


def stack_spec(variant: Variant, model_dir: Path, args: argparse.Namespace, workdir: Path) -> tuple[StackSpec, str]:
    """The stack of one row (the run's flags with the variant's settings), and its name."""
    from cleave.cli._stack import StackSpec

    worker_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-context-length", str(args.max_context_length)]
    if args.enforce_eager and args.device != "cpu":
        worker_args.append("--enforce-eager")
    service_args = [] if variant.switch_ms is None else ["--gil-switch-interval-ms", f"{variant.switch_ms:g}"]
    name = (f"{variant.mode}-{variant.num_gateways}-{variant.puts}-{variant.api}-{variant.mps}-{variant.sm_percent}-"
            f"{variant.metrics}-{variant.switch_ms}-{variant.policy}-{variant.tls}-")
    name += "".join(c if c.isalnum() else "_" for c in variant.prefill_variant + "-" + variant.worker_variant)
    return StackSpec(model=model_dir, mode=variant.mode, grpc_port=0, http_port=0 if variant.api == "http" else None,
                     device=args.device, num_kv_blocks=args.num_kv_blocks, log_level="WARNING",
                     worker_args=tuple(worker_args + service_args) + tuple(shlex.split(variant.worker_variant)),
                     prefill_args=tuple(args.prefill_arg) + tuple(shlex.split(variant.prefill_variant)),
                     gateway_args=tuple(args.gateway_arg) + tuple(service_args)
                     + (variant.policy.gateway_args() if variant.policy is not None else ()),
                     num_gateways=variant.num_gateways, store_to_kvstore=variant.puts, mps=variant.mps,
                     prefill_sm_percent=variant.sm_percent if variant.sm_percent < 100 else None,
                     metrics=variant.metrics, trace_dir=workdir / name / "traces" if args.trace else None,
                     tls=variant.tls), name


def run_mode(variant: Variant, model_dir: Path, args: argparse.Namespace, workdir: Path, vocab: int) -> dict:
    """Start the variant's stack, warm it up, run the load on it, stop it: its row."""
    from cleave.cli._stack import ProcessStack

    args = argparse.Namespace(**{**vars(args), "api": variant.api})
    spec, name = stack_spec(variant, model_dir, args, workdir)
    stack = ProcessStack(spec, workdir / name)
    stack.start(timeout_s=args.start_timeout_s)
    under_mps = stack.mps is not None
    try:
        load = workload(args, stack.gateway_address, stack.http_url, vocab,
                        None if stack.tls is None else str(stack.tls.ca_file))
        asyncio.run(warm_up(load, min(args.num_users, 8)))
        transport = "local"
        if any(child.name == "prefill-0" for child in stack.children):
            decode = next(child for child in stack.children if child.name == "decode-0")
            transport = asyncio.run(negotiated_transport(decode.address, "prefill-0", stack.internal_token,
                                                         stack.channel_credentials()))
        roles: dict[str, list[int]] = {}
        for child in stack.children:
            roles.setdefault(role_of(child.name), []).append(child.process.pid)
        meter = CpuMeter(roles)
        metrics = stack.metrics_addresses()
        engines = EngineMeter({role: [address for name, address in metrics.items() if role_of(name) == role]
                               for role in ("decode", "prefill")})
        run = run_load(load, args.client_procs)
        cores = meter.cores(run.wall_s)
        steps = engines.columns(run.wall_s)
    finally:
        stack.stop()
    row = {"mode": variant.mode, "gateways": variant.num_gateways, "api": variant.api, "transport": transport,
           "mps": under_mps,
           "prefill_sm_pct": variant.sm_percent if under_mps and variant.mode != "colocated" else 100,
           "metrics": variant.metrics,
           "tls": variant.tls,
           "switch_ms": variant.switch_ms if variant.switch_ms is not None else 5.0,
           "policy": str(variant.policy) if variant.policy is not None else "-",
           "prefill_variant": variant.prefill_variant or "-",
           "worker_variant": variant.worker_variant or "-",
           "kvstore_puts": variant.puts,
           "client_procs": args.client_procs, **summarize(run.timings, run.wall_s, Slo(args.slo_ttft_ms, args.slo_tpot_ms)),
           # CPU cores each part used over the run; on a host short of cores, latency is not the stack's alone
           **{f"cpu_{role}": used for role, used in sorted(cores.items())},
           "cpu_clients": round(run.client_cpu_s / max(run.wall_s, 1e-9), 2), "host_cpus": os.cpu_count(),
           **steps}  # what the engines did meanwhile (bench/engine_meter.py)
    if row["errors"]:
        print(f"{variant.mode}: {row['errors']} requests failed, the first with: {row['first_error']}", file=sys.stderr)
    if spec.trace_dir is not None:  # the services flushed their spans as they stopped
        from hops import format_hop_table, hop_table

        row["hops"] = hop_table(spec.trace_dir)
        print(format_hop_table(row["hops"]), flush=True)
    return row


def workload(args: argparse.Namespace, grpc_address: str, http_url: str | None, vocab: int,
             tls_ca_file: str | None = None) -> Workload:
    """The load of a run: the flags, the stack's addresses and CA, and the ids prompts are drawn from."""
    given = {"grpc_address": grpc_address, "http_url": http_url, "vocab": vocab, "tls_ca_file": tls_ca_file}
    return Workload(**given, **{f.name: getattr(args, f.name) for f in fields(Workload) if f.name not in given})


def mps_list(text: str) -> list[str]:
    """auto, on, off, or a comma-separated list of them."""
    settings = text.split(",")
    if any(setting not in ("auto", "on", "off") for setting in settings):
        raise argparse.ArgumentTypeError(f"expected auto, on, off or a list of them, got {text!r}")
    return settings


def api_list(text: str) -> str:
    """grpc, http, or both comma-separated."""
    if not text or any(api not in ("grpc", "http") for api in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: want grpc, http or grpc,http")
    return text


def length_range(text: str) -> tuple[int, int]:
    """N or LOW-HIGH -> (low, high)."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or LOW-HIGH with 1 <= LOW <= HIGH")
    return bounds


def size_cache(args: argparse.Namespace, user_prompt_tokens: int) -> None:
    """Default --max-context-length (the longest request fits) and --num-kv-blocks (per worker:
    every user's request plus 4 long prompts, with room to spare)."""
    user = user_prompt_tokens + args.output_len[1]
    long = args.long_prompt_len[1] + args.long_output_len if args.long_interval_s > 0 else 0
    if args.max_context_length is None:
        args.max_context_length = -(-max(user, long) // 256) * 256
    if args.num_kv_blocks is None:
        per_user, per_long = (-(-tokens // args.block_size) for tokens in (user, long))
        args.num_kv_blocks = int(1.25 * (args.num_users * per_user + 4 * per_long)) + 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: Llama-3.2-1B-shaped random bf16 on cuda, the shipped reasoner on cpu)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="http64 or mixed: a workload's defaults (see above); other flags override them")
    parser.add_argument("--modes", default="disaggregated,colocated", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--api", type=api_list, default="grpc",
                        help="users stream over the gateway's gRPC Generate (grpc) or its OpenAI chat completions "
                        "(http); grpc,http runs each mode both ways")
    parser.add_argument("--client-procs", type=int, default=None,
                        help="client processes the users are split across (default: min(8, cores/2) on cuda, 1 on cpu)")
    parser.add_argument("--num-users", type=int, default=50)
    parser.add_argument("--duration-s", type=float, default=12.0,
                        help="users send requests until this long after the start (0: --requests-per-user each)")
    parser.add_argument("--requests-per-user", type=int, default=1, help="with --duration-s 0")
    parser.add_argument("--prompt-len", type=length_range, default="512",
                        help="prompt tokens, N or LOW-HIGH (over HTTP: chats of about this many tokens)")
    parser.add_argument("--prompt-words", type=length_range, default=None,
                        help="words of text, N or LOW-HIGH (--api http; default: about --prompt-len tokens, "
                        "on cpu 16-32 words)")
    parser.add_argument("--output-len", type=length_range, default="256", help="N or LOW-HIGH")
    parser.add_argument("--ramp-s", type=float, default=2.0, help="users' first requests spread over this long")
    parser.add_argument("--long-prompt-len", type=length_range, default=None,
                        help="token ids, N or LOW-HIGH (default: 8192; on cpu 256, within the shipped reasoner)")
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--long-first-s", type=float, default=0.5, help="when the first long prompt arrives")
    parser.add_argument("--long-interval-s", type=float, default=3.0, help="then one every this long (0: none at all)")
    parser.add_argument("--long-arrival", choices=("periodic", "poisson"), default="periodic",
                        help="poisson: exponential gaps with --long-interval-s as their mean")
    parser.add_argument("--slo-ttft-ms", type=float, default=250.0, help="goodput counts requests within this TTFT...")
    parser.add_argument("--slo-tpot-ms", type=float, default=10.0, help="...and this time per output token")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-context-length", type=int, default=None,
                        help="default: the longest prompt plus its output, rounded up to 256")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="per worker (default: every user's request plus 4 long prompts, with room to spare)")
    parser.add_argument("--block-size", type=int, default=16, help="only used to size the default KV cache")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--gateways", type=lambda text: [int(n) for n in text.split(",")], default=[1],
                        help="gateway processes sharing one port; a comma-separated list runs each mode with each")
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="extra gateway flag, repeatable (e.g. --gateway-arg=--local-prefill-max-tokens=2048)")
    parser.add_argument("--prefill-arg", action="append", default=[],
                        help="extra prefill-worker flag, repeatable, after the shared worker flags (e.g. "
                        "--prefill-arg=--max-num-batched-tokens=8192)")
    parser.add_argument("--reasoning-mode", choices=sorted(REASONING_MODES), default="inline",
                        help="how the gateway returns thinking text (inline: streamed as it comes)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per request")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="run the whole list of modes and variants this many times, one after the other "
                        "(A B A B ...), each row naming its round: comparisons that a drifting machine would "
                        "blur (one user's TTFT) can then be made round by round")
    parser.add_argument("--kvstore-puts", type=lambda text: [{"on": True, "off": False}[v] for v in text.split(",")],
                        default=[True], help="on, off or on,off: prefill workers put prompt blocks in the kvstore "
                        "(a list runs each mode both ways)")
    parser.add_argument("--mps", type=mps_list, default=["auto"],
                        help="auto, on, off or a list (off,on runs each mode both ways): GPU workers sharing the "
                        "device run under the stack's MPS daemon (cleave up --mps; colocated has one worker, so "
                        "auto leaves it without)")
    parser.add_argument("--prefill-sm-percent", type=lambda text: [int(v) for v in text.split(",")], default=[100],
                        help="under MPS, the percent of SMs prefill workers may occupy (100: all); a list runs "
                        "each mode with each (cleave up --prefill-sm-percent)")
    parser.add_argument("--metrics", type=lambda text: [{"on": True, "off": False}[v] for v in text.split(",")],
                        default=[True], help="on, off or on,off: every process serves Prometheus metrics "
                        "(cleave up --metrics; a list runs each mode both ways, for the cost of the metrics)")
    parser.add_argument("--tls", type=lambda text: [{"on": True, "off": False}[v] for v in text.split(",")],
                        default=[False], help="off, on or off,on: TLS between the services and to the gateway "
                        "(cleave up --tls; a list runs each mode both ways, for the cost of TLS)")
    parser.add_argument("--gil-switch-interval-ms", type=lambda text: [float(v) for v in text.split(",")],
                        default=[None], help="every service's --gil-switch-interval-ms (default: Python's 5 ms); "
                        "a list runs each mode with each")
    parser.add_argument("--conditional-policy", type=lambda text: [ConditionalPolicy.parse(v) for v in text.split(",")],
                        default=[None], help="conditional mode's thresholds as LOCAL:IDLE[:RUNNING[:BUSY_QUEUE]] (gateway "
                        "--local-prefill-max-tokens, --remote-prefill-idle-tokens, --local-prefill-max-running and "
                        "--remote-prefill-busy-max-queue-tokens); a list runs conditional once with each "
                        "(e.g. 1024:0,256:2048,1024:0:64:4096)")
    parser.add_argument("--prefill-variant", action="append", default=None,
                        help="extra prefill-worker flags for one set of rows, repeatable: the modes with a "
                        "prefill worker run once per variant (e.g. --prefill-variant= "
                        "--prefill-variant='--layer-streaming off'); default: one run with none")
    parser.add_argument("--worker-variant", action="append", default=None,
                        help="extra flags of every worker (prefill and decode) for one set of rows, repeatable: "
                        "every mode runs once per variant (e.g. --worker-variant= --worker-variant='--stream-interval 2')")
    parser.add_argument("--out", default=None, help="directory for disagg-<UTC time>.json / .md (never overwritten)")
    parser.add_argument("--trace", action="store_true",
                        help="trace every request; print each mode's per-hop latencies (bench/hops.py), kept under 'hops'")
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    cpu = args.device == "cpu"
    if args.long_prompt_len is None:
        args.long_prompt_len = (256, 256) if cpu else (8192, 8192)
    if args.prompt_words is None and cpu:
        args.prompt_words = (16, 32)
    if args.client_procs is None:
        args.client_procs = 1 if cpu else max(1, min(8, (os.cpu_count() or 2) // 2))
    return args


def write_model(directory: Path, device: str) -> Path:
    """engine.write_checkpoint: bench/engine.py's random Llama-3.2-1B-shaped checkpoint."""
    from engine import write_checkpoint

    return write_checkpoint(directory, device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common import format_table

    from cleave.config import SHIPPED_MODEL_DIR

    with tempfile.TemporaryDirectory(prefix="cleave-disagg-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model
        if model_dir is None and args.device == "cpu":
            model_dir = SHIPPED_MODEL_DIR
        elif model_dir is None:
            model_dir = write_model(workdir / "model", args.device)
        vocab = min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 512)
        apis = args.api.split(",")
        if args.prompt_words is None:  # chats as long in tokens as the gRPC prompts
            args.prompt_words = words_for_tokens(model_dir, args.prompt_len)
        size_cache(args, max(max_chat_tokens(model_dir, args.prompt_words[1]) if "http" in apis else 0,
                             args.prompt_len[1] if "grpc" in apis else 0))
        summary = {key: getattr(args, key) for key in (
            "rounds", "preset", "api", "client_procs", "num_users", "duration_s", "requests_per_user", "prompt_len",
            "prompt_words", "output_len", "long_prompt_len", "long_output_len", "long_first_s", "long_interval_s",
            "long_arrival", "slo_ttft_ms", "slo_tpot_ms", "max_num_batched_tokens", "max_context_length",
            "num_kv_blocks", "reasoning_mode", "gateways", "gateway_arg", "prefill_arg")}
        default_model = "shipped reasoner" if args.device == "cpu" else "Llama-3.2-1B-shaped bf16"
        summary["model"] = str(args.model or default_model)
        name = "disagg-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        with run_mps_daemon(workdir, args) as mps_env:
            rows = run_variants(args, model_dir, workdir, vocab, mps_env, name, summary)
    print(format_table(rows, COLUMNS))
    return 0


@contextlib.contextmanager
def run_mps_daemon(workdir: Path, args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """One MPS daemon for the whole run, when any mode may want one (its environment, or {}).

    On the H200 host (driver 580) a daemon started after another one quit in the same process
    tree is refused (`-d` exits 1, even seconds later), so each stack adopting the run's
    daemon is what lets `--mps on,off` compare within one run."""
    from cleave.cli._mps import PIPE_ENV, MpsDaemon, wants_mps

    if not any(wants_mps(setting, args.device, 2) for setting in args.mps):
        yield {}
        return
    daemon = MpsDaemon.start(workdir / "mps", {key: value for key, value in os.environ.items() if key != PIPE_ENV})
    try:
        yield dict(daemon.env)
    finally:
        daemon.stop()


@contextlib.contextmanager
def mps_for(variant: "Variant", args: argparse.Namespace, mps_env: dict[str, str]) -> Iterator[None]:
    """The process environment a variant's stack sees: the run's daemon when the variant
    wants MPS (its stack adopts it), none otherwise."""
    from cleave.cli._mps import LOG_ENV, PIPE_ENV, wants_mps

    saved = {key: os.environ.get(key) for key in (PIPE_ENV, LOG_ENV)}
    wanted = wants_mps(variant.mps, args.device, 1 if variant.mode == "colocated" else 2)
    try:
        for key in saved:
            os.environ.pop(key, None)
        if wanted:
            os.environ.update(mps_env)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_variants(args: argparse.Namespace, model_dir: Path, workdir: Path, vocab: int, mps_env: dict[str, str],
                 name: str, summary: dict) -> list[dict]:
    """Every variant of the run, one stack each; results written after each one."""
    from common import format_table, write_results

    rows: list[dict] = []
    written: tuple[Path, ...] = ()
    for round_index, values in itertools.product(range(1, args.rounds + 1), itertools.product(
            args.modes.split(","), args.gateways, args.kvstore_puts, args.api.split(","), args.mps, args.prefill_sm_percent,
            args.metrics, args.gil_switch_interval_ms, args.conditional_policy, args.prefill_variant or [""],
            args.worker_variant or [""], args.tls)):
        variant = Variant(*values)
        if variant.mode == "colocated" and variant.prefill_variant != (args.prefill_variant or [""])[0]:
            continue  # no prefill worker
        if variant.mode != "conditional" and variant.policy != args.conditional_policy[0]:
            continue  # the policy only changes conditional mode
        if variant.mode != "conditional":
            variant = replace(variant, policy=None)
        if variant.mode == "colocated" and (variant.mps, variant.sm_percent) != (
                args.mps[0], args.prefill_sm_percent[0]):
            continue  # one worker: no MPS to share and no prefill worker to cap
        with mps_for(variant, args, mps_env):
            rows.append({"round": round_index, **run_mode(variant, model_dir, args, workdir, vocab)})
        print(format_table(rows[-1:], COLUMNS), flush=True)
        if args.out:  # after every mode, so a failure later keeps the modes that ran
            written = write_results(args.out, name, rows, COLUMNS, summary)
    for path in written:
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
