"""The gateway's CPU per streamed token, with no engine behind it.

The real gateway process (`python -m services.gateway --mode colocated`, the shipped model's
tokenizer and chat template, as `cleave up` serves it) streams from one fake decode worker
(bench/fake_decode.py, a process of its own): every `--step-ms` a step with one token per
live sample, ordinary text tokens of the model's tokenizer, sent as the real worker sends
them (one `StepOutput` a step on the gateway's Attach stream). The gateway detokenizes,
demultiplexes and streams as it would behind an engine, while nothing on the host computes a
model. `--users` streaming users (bench/serve_load.py, split over `--client-procs`
processes) send requests of `--output-len` tokens one after another for `--duration-s`
seconds, over the gateway's gRPC Generate stream (token-id prompts of `--prompt-len`) or its
OpenAI API (chats of about as many tokens); `--api grpc,http` runs both, each on a fresh
gateway and worker. Every start-up wait is an event: the worker's `listening` and `attached`
lines, the gateway's health stream turning SERVING.

Reported per API (one row): delivered output tokens/s; the CPU cores the gateway and the fake
worker used (bench/cpu_use.py, from /proc) and the clients (their own process time); the
gateway's CPU microseconds per delivered token; TTFT and TPOT p50 as the clients saw them;
requests finished and failed; tokens per stream message (the stream merges a lagging
sample's tokens). The /proc window opens after a short warm-up and before the client
processes start, so it also holds their start-up, while the gateway idles (0.005 cores on the
2-core dev machine); cores are CPU seconds per second of the load itself. A host with fewer
cores than the gateway, the worker and the clients want together (the 2-core dev machine)
caps tokens/s; microseconds per token is the figure that carries over to another host.

`--profile PATH` runs the gateway under cProfile (it drains and exits on SIGTERM, and cProfile
writes the profile as it exits) into PATH-<api>.prof; the result's .md lists the top 25
functions by tottime and by cumulative time. The profile covers the process's whole life
(start-up imports too); cProfile sees Python frames of the event loop's thread only: grpc's
Cython layer counts as the `Context.run` that calls it, its C-core threads and the
tokenizer's thread pool not at all. A profiled run's CPU numbers include the profiler's cost.

    python bench/gateway_load.py --users 64 --output-len 256 --step-ms 10 --duration-s 20 --api grpc,http
    python bench/gateway_load.py --users 64 --output-len 256 --step-ms 10 --duration-s 20 --api grpc,http \\
        --profile /tmp/gateway.prof
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import pstats
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Light imports only up here: the client processes (spawned) import this module again.
from cpu_use import CpuMeter  # noqa: E402
from serve_clients import REASONING_MODES  # noqa: E402
from serve_load import Slo, Workload, max_chat_tokens, run_load, summarize, warm_up, words_for_tokens  # noqa: E402

BENCH = Path(__file__).resolve().parent
COLUMNS = ["api", "users", "output_len", "step_ms", "client_procs", "profiled", "requests", "errors", "tokens",
           "wall_s", "output_tok_s", "cpu_gateway", "gateway_us_per_token", "cpu_fake_decode", "cpu_clients",
           "ttft_p50_ms", "tpot_p50_ms", "tokens_per_event", "host_cpus"]
GATEWAY_ID = "gateway-0"  # the gateway's default --gateway-id, which its Attach stream names
PROFILE_TOP = 25
WARM_UP_TOKENS = 8
NO_SLO = Slo(ttft_ms=float("inf"), tpot_ms=float("inf"))  # summarize's goodput is not reported here


@dataclass
class Child:
    """A process this bench started, in a session of its own (a kill of its group reaches
    everything it started), and its log."""

    name: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, num_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""

    def check_running(self) -> None:
        """RuntimeError with the log's tail when the process has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.process.returncode}; its log "
                               f"({self.log_path}) ends with:\n{self.log_tail()}")

    def stop(self, graceful: bool, timeout_s: float) -> None:
        """SIGTERM and wait up to `timeout_s` when `graceful`; otherwise, or past that, SIGKILL
        the process group."""
        if self.process.poll() is None and graceful:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def spawn(name: str, command: Sequence[str], workdir: Path, events: bool = False) -> Child:
    """Start `command` in a new session, its stderr (and stdout, unless `events` keeps that
    for `ChildEvents`) into `workdir/<name>.log`."""
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(command), stdout=subprocess.PIPE if events else log, stderr=log,
                                   start_new_session=True)
    return Child(name, process, log_path)


class ChildEvents:
    """The lines a child prints on stdout (`word rest`), read on a thread of their own, so
    waiting for one returns as it is printed."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name=f"{child.name}-events", daemon=True).start()

    def _read(self) -> None:
        for line in self.child.process.stdout:  # type: ignore[union-attr]
            self._lines.put(line.decode(errors="replace").strip())

    def wait_for(self, word: str, timeout_s: float, watched: Sequence[Child]) -> str:
        """The rest of the next line starting with `word`; RuntimeError when one of `watched`
        exits first, TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=1.0)  # the event, or a look at the processes each second
            except queue.Empty:
                for child in watched:
                    child.check_running()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no '{word}' from {self.child.name} in {timeout_s:g} s; see "
                                       f"{', '.join(str(child.log_path) for child in watched)}") from None
                continue
            head, _, rest = line.partition(" ")
            if head == word:
                return rest


def wait_serving(address: str, gateway: Child, timeout_s: float) -> None:
    """Return once the gateway's health (a `Watch` stream: each change as it happens) says
    SERVING: its worker is in rotation, its token stream open, its HTTP API listening."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                          timeout=timeout_s)
        try:
            for reply in watch:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    watch.cancel()
                    return
        except grpc.RpcError as error:
            gateway.check_running()
            raise RuntimeError(f"the gateway at {address} did not report SERVING: {error.code().name}; see "
                               f"{gateway.log_path}") from None
    raise RuntimeError(f"the gateway's health stream ended before SERVING; see {gateway.log_path}")


def read_port(path: Path, owner: Child) -> int:
    text = path.read_text().strip() if path.is_file() else ""
    if not text:
        owner.check_running()
        raise RuntimeError(f"{owner.name} serves but wrote no port to {path}")
    return int(text)


def gateway_command(args: argparse.Namespace, decode_address: str, workdir: Path,
                    profile_path: Path | None) -> list[str]:
    """The gateway as `cleave up` starts it (colocated, one decode worker), on ephemeral
    ports reported in port files; under cProfile with `profile_path`."""
    python = [sys.executable] + (["-m", "cProfile", "-o", str(profile_path)] if profile_path is not None else [])
    return [*python, "-m", "services.gateway", "--mode", "colocated", "--decode", decode_address,
            "--model", str(args.model), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--port-file", str(workdir / "gateway.port"), "--http-port-file", str(workdir / "gateway.http.port"),
            "--parent-pid", str(os.getpid()), "--log-level", "INFO", "--no-log-json", "--grace-seconds", "5",
            *args.gateway_arg]


def workload(api: str, args: argparse.Namespace, grpc_address: str, http_url: str, vocab: int) -> Workload:
    """The users' requests: one length of prompt and of answer, no long prompts."""
    return Workload(
        api=api, grpc_address=grpc_address, http_url=http_url, num_users=args.users, duration_s=args.duration_s,
        requests_per_user=1, ramp_s=args.ramp_s, prompt_len=(args.prompt_len, args.prompt_len),
        prompt_words=args.prompt_words, output_len=(args.output_len, args.output_len), long_prompt_len=(1, 1),
        long_output_len=1, long_first_s=0.0, long_interval_s=0.0, long_arrival="periodic",
        reasoning_mode=args.reasoning_mode, timeout_s=args.timeout_s, seed=args.seed, vocab=vocab)


def profile_tables(path: Path, limit: int = PROFILE_TOP) -> dict[str, str]:
    """pstats' top `limit` functions of a profile by tottime and by cumulative time."""
    tables = {}
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(str(path), stream=text).strip_dirs().sort_stats(order).print_stats(limit)
        tables[order] = text.getvalue().strip()
    return tables


def run_api(api: str, args: argparse.Namespace, workdir: Path, vocab: int,
            profile_path: Path | None) -> tuple[dict, dict[str, str] | None]:
    """Start the fake worker and the gateway, warm up, run the load, stop both: the API's
    row (and its profile's tables)."""
    workdir.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    finished = False
    try:
        fake = spawn("fake-decode", [sys.executable, str(BENCH / "fake_decode.py"), "--model", str(args.model),
                                     "--step-ms", str(args.step_ms), "--seed", str(args.seed),
                                     "--parent-pid", str(os.getpid())], workdir, events=True)
        children.append(fake)
        events = ChildEvents(fake)
        fake_port = events.wait_for("listening", args.start_timeout_s, [fake])
        gateway = spawn("gateway", gateway_command(args, f"127.0.0.1:{fake_port}", workdir, profile_path), workdir)
        children.append(gateway)
        # the gateway writes its port file before it starts its backend, which attaches
        events.wait_for("attached", args.start_timeout_s, [fake, gateway])
        grpc_address = f"127.0.0.1:{read_port(workdir / 'gateway.port', gateway)}"
        wait_serving(grpc_address, gateway, args.start_timeout_s)
        http_url = f"http://127.0.0.1:{read_port(workdir / 'gateway.http.port', gateway)}/v1"
        load = workload(api, args, grpc_address, http_url, vocab)
        asyncio.run(warm_up(replace(load, output_len=(WARM_UP_TOKENS, WARM_UP_TOKENS)), min(args.users, 8)))
        meter = CpuMeter({"gateway": [gateway.process.pid], "fake_decode": [fake.process.pid]})
        run = run_load(load, args.client_procs)
        cpu_s = meter.seconds()
        for child in children:
            child.check_running()
        finished = True
    finally:
        for child in reversed(children):  # the gateway first: its token stream ends cleanly
            child.stop(graceful=finished, timeout_s=args.stop_timeout_s)
    if profile_path is not None and gateway.process.returncode != 0:
        raise RuntimeError(f"the profiled gateway exited with code {gateway.process.returncode} (no profile); "
                           f"its log ends with:\n{gateway.log_tail()}")
    return row(api, args, run.timings, run.wall_s, run.client_cpu_s, cpu_s, profile_path is not None), (
        profile_tables(profile_path) if profile_path is not None else None)


def row(api: str, args: argparse.Namespace, timings: list, wall_s: float, client_cpu_s: float,
        cpu_s: dict[str, float], profiled: bool) -> dict:
    summary = summarize(timings, wall_s, NO_SLO)
    tokens = sum(timing.num_tokens for timing in timings)
    return {
        "api": api, "users": args.users, "output_len": args.output_len, "step_ms": args.step_ms,
        "client_procs": args.client_procs, "profiled": profiled,
        "requests": sum(timing.error is None for timing in timings), "errors": summary["errors"],
        "tokens": tokens, "wall_s": round(wall_s, 2), "output_tok_s": round(tokens / wall_s, 1),
        "cpu_gateway": round(cpu_s["gateway"] / wall_s, 2),
        "gateway_cpu_s": cpu_s["gateway"],
        "gateway_us_per_token": round(cpu_s["gateway"] * 1e6 / tokens, 1) if tokens else None,
        "cpu_fake_decode": round(cpu_s["fake_decode"] / wall_s, 2),
        "cpu_clients": round(client_cpu_s / wall_s, 2),
        "ttft_p50_ms": summary["ttft_p50_ms"], "tpot_p50_ms": summary["tpot_p50_ms"],
        "ttft_p90_ms": summary["ttft_p90_ms"], "tpot_p90_ms": summary["tpot_p90_ms"],
        "tokens_per_event": round(summary["tokens_per_event"], 2), "host_cpus": os.cpu_count(),
        "first_error": summary["first_error"],
    }


def save(out: Path, name: str, rows: list[dict], summary: dict, profiles: dict[str, dict[str, str]],
         argv: Sequence[str]) -> tuple[Path, Path]:
    """The rows as JSON and markdown (`common.write_results`), each profile's tables appended
    to the markdown."""
    from common import write_results  # imports torch: kept out of the client processes

    paths = write_results(out, name, rows, COLUMNS, summary=summary, argv=argv,
                          details={"profiles": profiles} if profiles else None)
    with paths[1].open("a") as markdown:
        for api, tables in profiles.items():
            for order, text in tables.items():
                markdown.write(f"\n## Gateway profile, {api}: top {PROFILE_TOP} by {order}\n\n```text\n{text}\n```\n")
    return paths


def api_list(text: str) -> list[str]:
    apis = text.split(",")
    if not text or any(api not in ("grpc", "http") for api in apis):
        raise argparse.ArgumentTypeError(f"{text!r}: want grpc, http or grpc,http")
    return apis


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from cleave.config import SHIPPED_MODEL_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=64, help="streaming users, each sending one request at a time")
    parser.add_argument("--output-len", type=int, default=256, help="tokens a request (ignore_eos)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the fake worker's milliseconds a step")
    parser.add_argument("--duration-s", type=float, default=20.0, help="users send requests until this long after "
                        "the start (each finishes the one it has running)")
    parser.add_argument("--api", type=api_list, default=["grpc", "http"], help="grpc, http or grpc,http")
    parser.add_argument("--client-procs", type=int, default=2, help="processes the users are split across")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="prompt tokens (gRPC: token ids; HTTP: a chat of about this many tokens)")
    parser.add_argument("--ramp-s", type=float, default=1.0, help="users' first requests spread over this long")
    parser.add_argument("--reasoning-mode", choices=sorted(REASONING_MODES), default="inline")
    parser.add_argument("--model", type=Path, default=SHIPPED_MODEL_DIR,
                        help="checkpoint directory the gateway serves (default: the shipped reasoner, as `cleave up`)")
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="extra gateway flag, repeatable (e.g. --gateway-arg=--gil-switch-interval-ms=1)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="run the gateway under cProfile into PATH-<api>.prof; top functions in the .md")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument("--start-timeout-s", type=float, default=300.0,
                        help="a guard against a hang: each start-up event comes within this")
    parser.add_argument("--stop-timeout-s", type=float, default=60.0,
                        help="a process's time to drain and exit (a profiled gateway writes its profile then)")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "gateway")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the processes' logs here (default: a "
                        "temporary directory)")
    args = parser.parse_args(argv)
    if min(args.users, args.output_len, args.client_procs, args.prompt_len) < 1 or args.step_ms <= 0:
        parser.error("--users, --output-len, --client-procs and --prompt-len must be at least 1, --step-ms positive")
    from cleave.model.text_config import TextConfig

    config = TextConfig.from_pretrained(args.model)
    args.vocab, max_model_len = config.vocab_size, config.max_position_embeddings
    args.prompt_words = words_for_tokens(args.model, (args.prompt_len, args.prompt_len))
    longest_prompt = max(args.prompt_len, max_chat_tokens(args.model, args.prompt_words[1]))
    if longest_prompt + args.output_len > max_model_len:
        parser.error(f"a prompt of up to {longest_prompt} tokens and {args.output_len} output tokens do not fit "
                     f"the model's {max_model_len} positions; lower --output-len or --prompt-len")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    from common import format_table, run_name

    args = parse_args(argv)
    name = run_name("gateway-load-profiled" if args.profile else "gateway-load")
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    summary = {
        "model": str(args.model), "mode": "colocated, one fake decode worker (bench/fake_decode.py)",
        "users": args.users, "output_len": args.output_len, "step_ms": args.step_ms, "duration_s": args.duration_s,
        "prompt_len": args.prompt_len, "prompt_words": args.prompt_words, "ramp_s": args.ramp_s,
        "reasoning_mode": args.reasoning_mode, "client_procs": args.client_procs,
        "offered_tok_s": round(args.users * 1000 / args.step_ms, 1),  # every user with a request live
        "gateway_args": args.gateway_arg, "profile": str(args.profile) if args.profile else None,
    }
    rows: list[dict] = []
    profiles: dict[str, dict[str, str]] = {}
    with contextlib.ExitStack() as scope:
        workdir = args.workdir or Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="cleave-gateway-load-")))
        for api in args.api:
            profile_path = None
            if args.profile is not None:
                profile_path = args.profile.with_name(f"{args.profile.stem}-{api}{args.profile.suffix or '.prof'}")
                profile_path.parent.mkdir(parents=True, exist_ok=True)
            result, tables = run_api(api, args, workdir / api, args.vocab, profile_path)
            rows.append(result)
            if tables is not None:
                profiles[api] = tables
            print(format_table(rows[-1:], COLUMNS), flush=True)
            if result["errors"]:
                print(f"{api}: {result['errors']} requests failed, the first with: {result['first_error']}",
                      file=sys.stderr)
            paths = save(args.out, name, rows, summary, profiles, command)  # after each API: a failure keeps the rows
    print(format_table(rows, COLUMNS))
    for api, tables in profiles.items():
        print(f"\ngateway profile, {api}:\n{tables['tottime']}\n\n{tables['cumulative']}")
    for path in paths:
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
