"""`cleave up`: run the whole stack (kvstore, prefill, decode, gateway) as local processes.

Prints the gateway's gRPC and HTTP addresses once everything is healthy and runs until
Ctrl-C / SIGTERM / SIGHUP (its terminal closed), then stops every process. A child that dies
meanwhile is restarted on its address with backoff (`_supervisor`); the children die with
`cleave up` however it ends (`_ownership`), and a closed stdout (`cleave up | tee log` after
Ctrl-C) never keeps it from stopping them. `--demo` sends one arithmetic question through
the gRPC gateway, prints the streamed reasoning and the answer, and stops the stack.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.cli._arg_types import positive_int
from cleave.cli._memory_split import DEFAULT_GPU_MEMORY_UTILIZATION, MemorySplit
from cleave.config import gateway_api_keys
from cleave.engine.config import KV_CACHE_DTYPES
from cleave.generation.reasoning_formats import REASONING_PARSERS

if TYPE_CHECKING:
    import grpc

    from cleave.cli._stack import StackSpec

DEMO_MAX_TOKENS = 256
# `--gateways auto` on a GPU: a gateway process for every CORES_PER_GATEWAY host cores, at most MAX_AUTO_GATEWAYS
CORES_PER_GATEWAY = 4
MAX_AUTO_GATEWAYS = 4


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _take_stop_signals() -> dict[int, object]:
    """Stop on Ctrl-C, SIGTERM and SIGHUP, however they were set when this process started
    (a shell runs `cleave up &` with SIGINT ignored, and the ignoring is inherited), and
    return the handlers they had."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return {signum: signal.signal(signum, _raise_interrupt) for signum in STOP_SIGNALS}


def _say(text: str, file=None) -> None:  # type: ignore[no-untyped-def]
    """Print one line; a closed pipe (the reader of `cleave up | tee` is gone) silences the
    rest of the output instead of raising out of the shutdown."""
    out = file if file is not None else sys.stdout
    try:
        print(text, file=out, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
        _silence(out)


def _silence(out) -> None:  # type: ignore[no-untyped-def]
    """Point a broken stream's descriptor at /dev/null, so the interpreter's last flush
    does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


async def demo(address: str, out=sys.stdout, api_key: str | None = None,  # type: ignore[no-untyped-def]
               credentials: grpc.ChannelCredentials | None = None) -> str:
    """Ask one held-out arithmetic question; stream reasoning and answer to `out`. Returns
    the answer text. `api_key`: the gateway's, when it asks for one; `credentials`: TLS."""
    from cleave.client import GatewayClient
    from cleave.tasks.arithmetic import format_prompt, heldout_problems

    problem = heldout_problems(1, seed=int(time.time()) % 1000)[0]
    print(f"\n> {format_prompt(problem)}", file=out)
    answer: list[str] = []
    section = ""
    async with GatewayClient(address, api_key=api_key, credentials=credentials) as client:
        async for response in client.generate(format_prompt(problem), max_tokens=DEMO_MAX_TOKENS, temperature=0.0):
            for sample in response.samples:
                for name, text in (("reasoning", sample.reasoning_text), ("answer", sample.text)):
                    if not text:
                        continue
                    if section != name:
                        section = name
                        print(f"\n[{name}]", file=out)
                    print(text, end="", file=out, flush=True)
                    if name == "answer":
                        answer.append(text)
            if response.HasField("usage"):
                usage = response.usage
                print(f"\n\n({usage.completion_tokens} tokens, {usage.reasoning_tokens} of them reasoning; "
                      f"expected answer {problem.answer})", file=out)
    return "".join(answer)


def gateway_count(text: str) -> int | str:
    """`--gateways`: "auto" or a count of at least 1."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be auto or a positive integer, got {text!r}") from None


def resolve_gateways(gateways: int | str, device: str) -> int:
    """The gateway processes to start: a count as given; "auto" is 1 on the CPU (where the
    workers need the cores more) and, on a GPU, one per `CORES_PER_GATEWAY` host cores up to
    `MAX_AUTO_GATEWAYS` (one Python gateway streams less than one GPU decodes; the served
    stack's benches ran 4, bench/results/disagg/)."""
    if gateways != "auto":
        return int(gateways)
    if not device.startswith("cuda"):
        return 1
    return max(1, min(MAX_AUTO_GATEWAYS, (os.cpu_count() or 1) // CORES_PER_GATEWAY))


def stack_spec(args: argparse.Namespace, model: Path, default_name: str) -> "StackSpec":
    """The stack `cleave up`'s flags describe (`model`: the resolved checkpoint directory)."""
    from cleave.cli._device import resolve_device
    from cleave.cli._stack import StackSpec

    # the thinking tags: every service reads them from the model unless told (gateway and workers alike)
    model_args = ("--reasoning-parser", args.reasoning_parser) if args.reasoning_parser != "auto" else ()
    worker_args = model_args
    if args.stream_interval is not None:
        worker_args += ("--stream-interval", str(args.stream_interval))
    if args.packed_experts:
        worker_args += ("--packed-experts",)
    if args.kv_cache_dtype != "auto":  # every worker alike: a hand-off needs equal KV dtypes
        worker_args += ("--kv-cache-dtype", args.kv_cache_dtype)
    device = resolve_device(args.device)
    return StackSpec(
        model=model, mode=args.mode, num_prefill=args.prefill, num_decode=args.decode,
        num_gateways=resolve_gateways(args.gateways, device),
        grpc_port=args.grpc_port, http_port=None if args.http_port < 0 else args.http_port,
        device=device, num_kv_blocks=args.num_kv_blocks, served_model_name=args.served_model_name or default_name,
        host=args.host, store_to_kvstore=args.store_to_kvstore,
        trace_dir=Path(args.trace_dir) if args.trace_dir else None,
        gpu_memory_utilization=args.gpu_memory_utilization, gpu_memory_split=args.gpu_memory_split,
        metrics=args.metrics, mps=args.mps, prefill_gpus=args.prefill_gpus, decode_gpus=args.decode_gpus,
        decode_tensor_parallel_size=args.tensor_parallel_size, worker_args=worker_args, gateway_args=model_args,
        tls=args.tls,
    )


def run(args: argparse.Namespace) -> int:
    from cleave.cli._device import DeviceUnavailable, check_device, resolve_device
    from cleave.cli._model import ModelNotFound, model_dir, served_name
    from cleave.cli._stack import ProcessStack
    from cleave.cli._supervisor import RestartPolicy, Supervisor

    args.device = resolve_device(args.device)
    if (args.prefill_gpus or args.decode_gpus) and not args.device.startswith("cuda"):
        print(f"--prefill-gpus / --decode-gpus place workers on CUDA devices; pass --device cuda, not {args.device}",
              file=sys.stderr)
        return 2
    if args.tensor_parallel_size < 1 or (
            args.tensor_parallel_size > 1 and args.mode not in ("colocated", "disaggregated")):
        print(f"error: --tensor-parallel-size {args.tensor_parallel_size}: must be >= 1, and above 1 only with "
              "--mode colocated or --mode disaggregated (conditional mode is not tested with tensor-parallel "
              "decode workers yet)", file=sys.stderr)
        return 2
    try:
        model = model_dir(args.model)
        check_device(args.device)  # here, not as a worker's log tail once it has started
        for index in sorted(set(args.prefill_gpus) | set(args.decode_gpus)):
            check_device(f"cuda:{index}")
    except (ModelNotFound, DeviceUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    spec = stack_spec(args, model, served_name(args.model, model))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cleave-up-"))
    stack = ProcessStack(spec, workdir)
    previous = _take_stop_signals()
    started = time.monotonic()
    try:
        _say(f"starting cleave ({spec.mode}, model {model.name}, device {spec.device}); logs in {workdir}")
        shares = stack.memory_shares()
        if shares:
            listed = ", ".join(f"{name} {share:g}" for name, share in shares.items())
            _say(f"  GPU memory shares: {listed}")
        stack.start(timeout_s=args.timeout)
        _say(f"cleave is up in {time.monotonic() - started:.1f} s")
        _say(f"  gRPC gateway: {stack.gateway_address}")
        if stack.http_url:
            _say(f"  OpenAI HTTP:  {stack.http_url}")
        if stack.tls is not None:
            _say(f"  TLS CA:       {stack.tls.ca_file} (clients check the gateway against it)")
        for name, address in stack.metrics_addresses().items():
            _say(f"  metrics:      {name} http://{address}/metrics")
        if spec.metrics:
            _say(f"  Prometheus targets: {stack.prometheus_targets_file}")
        if args.demo:
            # the gateway inherited CLEAVE_API_KEY and CLEAVE_API_KEY_FILE: the demo sends its first key
            keys = gateway_api_keys(os.environ)
            asyncio.run(demo(stack.gateway_address, api_key=keys.keys[0] if keys is not None else None,
                             credentials=stack.channel_credentials()))
            return 0
        _say("press Ctrl-C to stop")
        supervisor = Supervisor(stack, RestartPolicy(max_fast_crashes=args.max_fast_crashes),
                                say=lambda line: _say(line, sys.stderr))
        while True:
            time.sleep(0.5)
            supervisor.poll()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as error:  # GaveUp and PortInUse among them
        _say(f"error: {error}", sys.stderr)
        return 2 if not stack.children else 1
    finally:
        try:
            _say("stopping cleave")
        finally:
            stack.stop()
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        indexes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CUDA device indexes like 0 or 1,2, got {text!r}") from None
    if any(index < 0 for index in indexes):
        raise argparse.ArgumentTypeError(f"device indexes must be >= 0, got {text!r}")
    return indexes


def _utilization(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _memory_split(text: str) -> MemorySplit:
    try:
        return MemorySplit.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="run kvstore, prefill, decode and gateway locally",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory or Hugging Face Hub id ORG/NAME[@REVISION] "
                        "(default: the shipped reasoner)")
    parser.add_argument("--mode", choices=("disaggregated", "colocated", "conditional"), default="disaggregated",
                        help="separate prefill and decode workers, or decode workers that prefill too")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated; default 1)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    parser.add_argument("--gateways", type=gateway_count, default="auto", metavar="auto|N",
                        help="gateway processes sharing the gRPC and HTTP ports (default auto: 1 on the CPU; on "
                             f"a GPU one per {CORES_PER_GATEWAY} host cores, at most {MAX_AUTO_GATEWAYS}, as the "
                             "served-stack benches ran; a Python gateway streams ~10k tokens/s, so add one per "
                             "~8k tokens/s served)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port (0: any free port)")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="OpenAI-compatible HTTP port (0: any free port, -1: no HTTP)")
    parser.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    parser.add_argument("--device", default="auto",
                        help="torch device of the workers: cpu, cuda, or auto (default: cuda where torch sees a CUDA "
                             "device, else cpu)")
    parser.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks per worker (0: automatic)")
    parser.add_argument("--gpu-memory-utilization", type=_utilization, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help="share of each GPU the workers on it use together (default 0.9)")
    parser.add_argument("--gpu-memory-split", type=_memory_split, default=MemorySplit(), metavar="PREFILL:DECODE",
                        help="how workers sharing a GPU divide that share, by role weight (default 1:2: "
                             "1 prefill + 1 decode get 0.3 and 0.6; 1:1 splits equally)")
    parser.add_argument("--prefill-gpus", type=_gpu_list, default=(), metavar="I,J,...",
                        help="CUDA device indexes the prefill workers run on, round-robin (default: all on --device)")
    parser.add_argument("--decode-gpus", type=_gpu_list, default=(), metavar="I,J,...",
                        help="CUDA device indexes the decode workers run on, round-robin (default: all on --device)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks each decode worker splits the model over, one process each (--mode colocated or "
                             "disaggregated; prefill workers keep one rank; on CUDA a worker on cuda:K uses "
                             "cuda:K..K+N-1; default 1)")
    parser.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                        help="run GPU workers that share a device under an NVIDIA MPS daemon of the stack's, so "
                             "their kernels run side by side instead of in time slices (auto: when two or more "
                             "workers share the device and nvidia-cuda-mps-control is on PATH)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                        help="thinking tags of the model, for every service (default auto: the checkpoint's "
                        "cleave_config.json, else recognised from its tokenizer)")
    parser.add_argument("--stream-interval", type=positive_int, default=None, metavar="N",
                        help="steps between a decode worker's reports of a running request's tokens (default 2: "
                        "tokens in pairs, half the host work per token; 1 sends each token alone)")
    parser.add_argument("--packed-experts", action="store_true",
                        help="workers keep a checkpoint's MXFP4 experts (gpt-oss) packed in memory, read by the "
                             "expert kernels: a quarter of bf16's bytes (default: dequantised at load)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="every worker's KV cache element type: auto (the model's dtype) or fp8 (float8 e4m3, "
                             "scale 1.0, clamped to +-448: half the bytes, twice the tokens; greedy outputs may "
                             "differ from the model dtype's)")
    parser.add_argument("--served-model-name", default="",
                        help="model id clients use (default: the Hub id without its revision, or the model directory's name)")
    parser.add_argument("--store-to-kvstore", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill workers put new prompt blocks into the kvstore (default on; off for an A/B)")
    parser.add_argument("--workdir", default=None, help="port files and logs (default: a temporary directory)")
    parser.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                        help="each process serves Prometheus metrics on a free port of its own, listed in "
                             "<workdir>/prometheus-targets.json (default on)")
    parser.add_argument("--trace-dir", default=None,
                        help="each service writes its trace spans to <dir>/<name>.jsonl (read them with bench/hops.py)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each service has to become healthy")
    parser.add_argument("--max-fast-crashes", type=int, default=5,
                        help="give up (and stop the stack) after a service crashed this many times in a row, "
                             "each soon after its start (default 5); dead services are restarted until then")
    parser.add_argument("--tls", action="store_true",
                        help="TLS between every service and on the gateway's gRPC and HTTPS APIs, with a CA and "
                             "certificate made for this stack under <workdir>/tls (`cleave tls-certs`; clients "
                             "check the gateway against its ca.pem)")
    parser.add_argument("--demo", action="store_true", help="send one arithmetic question, print, and stop")
    parser.set_defaults(handler=run)
