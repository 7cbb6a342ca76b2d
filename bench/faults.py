"""Fault tolerance of the stack as processes, measured at full scale on CPU (or one GPU).

The stack runs as `cleave up --prefill 2 --decode 2` runs it: a `ProcessStack` (kvstore, two
prefill workers, two decode workers, gateway; disaggregated, the shipped model) with its
`Supervisor` polled on a thread, so a dead child comes back on its address. Two prefill
workers, because a draining prefill worker refuses the prompts that had not reached it and
the gateway retries them on another; with only one, disaggregated mode has none left
(`services/gateway/readiness.py`) and those requests fail UNAVAILABLE. Five parts, in order,
on one stack:

1. kill: `num_requests` greedy requests from `num_clients` clients, once undisturbed (the
   reference) and once with decode-0 SIGKILLed `kill_fraction` of the undisturbed wall time
   into the run: completed / failed / token-identical, requests the gateway migrated (its
   "request migrated" log lines), and whether decode-0 came back and took traffic again.
2. drain: per service, SIGTERM while `num_drain` requests stream: admitted-and-lost
   (failed or not token-identical to an undisturbed pass), exit code, drain time (signal to
   exit); the supervisor then restarts it and the next service is tried.
3. hang: per worker (prefill-0, decode-0), SIGSTOP while `num_drain` requests stream (hung,
   its connections still open), SIGCONT once they all ended: completed / token-identical
   to an undisturbed pass, the pass's wall time against the undisturbed one (the stall), and
   whether the worker serves again.
4. mixed: `num_mixed` requests that finish, are cancelled at a random point, or run into
   their deadline; afterwards every worker's KV pool must be full again (GetLoad
   num_free_blocks == num_total_blocks). Transfer failures are not injected: a process stack
   has no fault hook for its bulk connections (tests/services/gateway/test_no_leaks.py tears
   them in process), and cutting a loopback TCP connection from outside needs privileges.
5. oversized: an HTTP body of `body_bytes` (declared Content-Length, and chunked without
   one), streamed from a generator, and a gRPC message of `grpc_bytes`: time to refusal,
   growth of the gateway's resident memory, and the inter-token gap p99 of 4 streams during
   the attacks against 4 streams alone.

    python bench/faults.py            # full: 800 / 8 clients, 1,000 mixed, 1 GB, 200 MB
    python bench/faults.py --quick    # 80 requests, 100 mixed, 64 MB bodies and message

`--device cuda` puts the four workers on one GPU (KV over CUDA IPC). `--tls` runs the same
stack as `cleave up --tls` does (mutual TLS between the services, TLS
bulk KV, HTTPS and TLS on the gateway), every client checking the stack's CA, the attacks
included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import random
import signal
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from cleave.cli._stack import Child, ProcessStack, StackSpec
from cleave.cli._supervisor import SupervisedStack
from cleave.client import GatewayClient, wait_until_serving
from cleave.client.gateway import collect
from cleave.config import SHIPPED_MODEL_DIR
from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, prefill_pb2_grpc
from cleave.rpc import aio_channel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import nearest_rank, run_name, write_results  # noqa: E402

IDS = gateway_pb2.StreamOptions(include_token_ids=True)
DRAINED = ("decode-0", "prefill-0", "kvstore", "gateway")
HUNG = ("prefill-0", "decode-0")
HANG_MAX_S = 120.0  # a guard: the requests of a hang part end long before (the worker is lost in seconds)
MIXED_KINDS = ("finish", "cancel_early", "cancel_streaming", "timeout")
MIXED_CONCURRENCY = 12
CHUNK_BYTES = 1 << 20
NUM_WINDOWS = 3  # quiet / attacked stream windows, in turns
COLUMNS = ("part", "figure", "value", "target", "met")


@dataclass(frozen=True)
class Settings:
    """Sizes of one run."""

    num_requests: int = 800
    num_clients: int = 8
    max_tokens: int = 16
    kill_fraction: float = 0.3  # of the undisturbed pass's wall time
    num_drain: int = 8
    drain_max_tokens: int = 32
    num_mixed: int = 1000
    body_bytes: int = 1 << 30
    grpc_bytes: int = 200 << 20
    stream_max_tokens: int = 200  # the 4 streams whose inter-token gaps part 4 measures


QUICK = Settings(num_requests=80, max_tokens=8, num_drain=6, drain_max_tokens=16, num_mixed=100,
                 body_bytes=64 << 20, grpc_bytes=64 << 20, stream_max_tokens=120)


class FaultStack(SupervisedStack):
    """The supervised stack, plus what the figures read from the gateway's log and the
    clients it takes (over TLS with a TLS stack)."""

    def migrations(self) -> int:
        """Requests the gateway moved to another decode worker (its log spans restarts)."""
        return self.child("gateway").log_path.read_text(errors="replace").count("request migrated")

    def client(self) -> GatewayClient:
        """A client of the gateway's gRPC API."""
        return GatewayClient(self.stack.gateway_address, credentials=self.stack.channel_credentials())

    @property
    def ca_file(self) -> str | None:
        """The stack's CA (None without TLS), for a client in another process."""
        return None if self.stack.tls is None else str(self.stack.tls.ca_file)


# ---- requests ---------------------------------------------------------------------------------


async def greedy(client: GatewayClient, prompt: str, max_tokens: int, on_token=None) -> list[int]:  # type: ignore[no-untyped-def]
    """One greedy request's token ids (raises the gRPC error of a failed one)."""

    async def watched():  # type: ignore[no-untyped-def]
        async for response in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                              stream=IDS):
            if on_token is not None and any(sample.token_ids for sample in response.samples):
                on_token()
            yield response

    (sample,) = (await collect(watched())).samples
    return list(sample.token_ids)


async def run_clients(supervised: FaultStack, batches: list[list[str]], max_tokens: int,
                      on_done=None) -> list[list[list[int] | str]]:  # type: ignore[no-untyped-def]
    """Each batch from its own client, one request after another: tokens, or the error."""

    async def one_client(batch: list[str]) -> list[list[int] | str]:
        results: list[list[int] | str] = []
        async with supervised.client() as client:
            for prompt in batch:
                try:
                    results.append(await greedy(client, prompt, max_tokens))
                except grpc.aio.AioRpcError as error:
                    results.append(f"{error.code().name}: {error.details()}")
                if on_done is not None:
                    on_done()
        return results

    return list(await asyncio.gather(*(one_client(batch) for batch in batches)))


async def worker_load(supervised: FaultStack, worker: Child) -> common_pb2.WorkerLoad:
    stub_type = decode_pb2_grpc.DecodeStub if worker.name.startswith("decode") else prefill_pb2_grpc.PrefillStub
    stack = supervised.stack
    async with aio_channel(worker.address, internal_token=stack.internal_token,
                           credentials=stack.channel_credentials()) as channel:
        return (await stub_type(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)).load


# ---- 1. SIGKILL of a decode worker ------------------------------------------------------------


async def kill_decode(supervised: FaultStack, settings: Settings) -> dict:
    per_client = settings.num_requests // settings.num_clients
    batches = [[f"fault {client} {index}: tell me about the fox" for index in range(per_client)]
               for client in range(settings.num_clients)]
    start = time.monotonic()
    reference = await run_clients(supervised, batches, settings.max_tokens)
    undisturbed_s = time.monotonic() - start
    victim = supervised.child("decode-0")
    migrated_before = supervised.migrations()
    kill_after_s = settings.kill_fraction * undisturbed_s
    killed_at: list[float] = []
    done = 0

    def count() -> None:
        nonlocal done
        done += 1

    async def kill_later() -> None:
        await asyncio.sleep(kill_after_s)
        victim.process.kill()
        killed_at.append(time.monotonic())

    start = time.monotonic()
    killer = asyncio.ensure_future(kill_later())
    disturbed = await run_clients(supervised, batches, settings.max_tokens, on_done=count)
    disturbed_s = time.monotonic() - start
    await killer
    restarted = await asyncio.to_thread(supervised.wait_restarted, victim)
    back_s = time.monotonic() - killed_at[0] if restarted is not None else None
    took_traffic = restarted is not None and await takes_traffic(supervised, restarted, settings.max_tokens)
    pairs = [(want, got) for want_batch, got_batch in zip(reference, disturbed) for want, got in zip(want_batch, got_batch)]
    errors = [got for _, got in pairs if isinstance(got, str)]
    return {
        "requests": len(pairs),
        "reference_failed": sum(isinstance(want, str) for want, _ in pairs),
        "completed": len(pairs) - len(errors),
        "failed": len(errors),
        "identical": sum(not isinstance(want, str) and want == got for want, got in pairs),
        "migrated": supervised.migrations() - migrated_before,
        "killed_after_s": round(killed_at[0] - start, 2),
        "exit": victim.process.returncode,
        "came_back": restarted is not None,
        "back_after_s": None if back_s is None else round(back_s, 2),
        "took_traffic": took_traffic,
        "undisturbed_s": round(undisturbed_s, 1),
        "disturbed_s": round(disturbed_s, 1),
        "errors": sorted(set(errors))[:5],
    }


async def takes_traffic(supervised: FaultStack, worker: Child, max_tokens: int, timeout_s: float = 60.0) -> bool:
    """Whether bursts through the gateway reach `worker` (its token rate shows the work)."""
    deadline = time.monotonic() + timeout_s
    async with supervised.client() as client:
        while time.monotonic() < deadline:
            burst = [f"after {time.monotonic()} {index}" for index in range(8)]
            await asyncio.gather(*(greedy(client, prompt, max_tokens) for prompt in burst))
            if (await worker_load(supervised, worker)).tokens_per_second > 0:
                return True
    return False


# ---- 2. SIGTERM drain per service -------------------------------------------------------------


async def drain(supervised: FaultStack, name: str, settings: Settings) -> dict:
    prompts = [f"drain {name} {index}: the quick brown fox jumps over the lazy dog" for index in range(settings.num_drain)]
    (reference,) = await run_clients(supervised, [prompts], settings.drain_max_tokens)
    victim = supervised.child(name)
    migrated_before = supervised.migrations()
    streaming: set[int] = set()
    finished: set[int] = set()
    ready = asyncio.Event()

    def saw_token(index: int) -> None:
        streaming.add(index)
        # a prefill worker holds a request only until its first token: signal it then, while
        # the others are still prefilling or queued for it; the rest once all stream
        if name.startswith("prefill") or len(streaming) == len(prompts):
            ready.set()

    async def one(client: GatewayClient, index: int) -> list[int] | str:
        try:
            return await greedy(client, prompts[index], settings.drain_max_tokens, lambda: saw_token(index))
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"
        finally:
            finished.add(index)

    async with supervised.client() as client:
        tasks = [asyncio.ensure_future(one(client, index)) for index in range(len(prompts))]
        await asyncio.wait_for(ready.wait(), 120)
        in_flight = len(prompts) - len(finished)
        signalled = time.monotonic()
        victim.process.send_signal(signal.SIGTERM)
        exit_code = await asyncio.to_thread(victim.process.wait, 120)
        drain_s = time.monotonic() - signalled
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
    lost = sum(isinstance(got, str) or got != want for want, got in zip(reference, results))
    restarted = await asyncio.to_thread(supervised.wait_restarted, victim)
    await wait_until_serving(supervised.stack.gateway_address, credentials=supervised.stack.channel_credentials())
    return {
        "service": name,
        "in_flight": in_flight,
        "admitted_lost": lost,
        "exit": exit_code,
        "drain_s": round(drain_s, 2),
        "migrated": supervised.migrations() - migrated_before,
        "restarted": restarted is not None,
        "errors": sorted({got for got in results if isinstance(got, str)})[:3],
    }


# ---- 3. SIGSTOP of a worker ------------------------------------------------------------------


async def hang(supervised: FaultStack, name: str, settings: Settings) -> dict:
    prompts = [f"hang {name} {index}: the quick brown fox jumps over the lazy dog" for index in range(settings.num_drain)]
    start = time.monotonic()
    (reference,) = await run_clients(supervised, [prompts], settings.drain_max_tokens)
    undisturbed_s = time.monotonic() - start
    victim = supervised.child(name)
    migrated_before = supervised.migrations()
    streaming = asyncio.Event()

    async def one(client: GatewayClient, prompt: str) -> list[int] | str:
        try:
            return await greedy(client, prompt, settings.drain_max_tokens, streaming.set)
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"

    async with supervised.client() as client:
        start = time.monotonic()
        tasks = [asyncio.ensure_future(one(client, prompt)) for prompt in prompts]
        await asyncio.wait_for(streaming.wait(), 120)
        victim.process.send_signal(signal.SIGSTOP)
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), HANG_MAX_S)
        finally:
            victim.process.send_signal(signal.SIGCONT)
        hung_s = time.monotonic() - start
    serving_again = await asyncio.to_thread(_serving_within, supervised, victim, 60.0)
    return {
        "service": name,
        "requests": len(prompts),
        "completed": sum(not isinstance(got, str) for got in results),
        "identical": sum(got == want for want, got in zip(reference, results)),
        "migrated": supervised.migrations() - migrated_before,
        "undisturbed_s": round(undisturbed_s, 2),
        "hung_s": round(hung_s, 2),
        "serving_again": serving_again,
        "errors": sorted({got for got in results if isinstance(got, str)})[:3],
    }


def _serving_within(supervised: FaultStack, worker: Child, timeout_s: float) -> bool:
    """Whether the (continued) worker answers SERVING within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if supervised.stack.is_serving(worker):
            return True
        time.sleep(0.05)
    return False


# ---- 4. mixed endings, KV pools back to full --------------------------------------------------


async def mixed_request(client: GatewayClient, index: int, kind: str, rng: random.Random,
                        prompt: str | None = None) -> str:
    """Run one request the way `kind` says (on `prompt`, or on one of its own); returns how it ended."""
    max_tokens = rng.randint(2, 24)
    timeout = rng.uniform(0.01, 0.3) if kind == "timeout" else 120.0
    text = prompt if prompt is not None else f"mixed {index}: " + "word " * rng.randint(1, 40)
    call = client.generate(text, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=IDS,
                           timeout=timeout)
    try:
        if kind == "cancel_early":
            await asyncio.sleep(rng.uniform(0.0, 0.05))  # in tokenize, admission, prefill, transfer or start
            call.cancel()
            await collect(call)
            return "finished"  # it beat the cancel
        if kind == "cancel_streaming":
            cancel_after = rng.randint(1, max_tokens)
            seen = 0
            async for response in call:
                seen += sum(len(sample.token_ids) for sample in response.samples)
                if seen >= cancel_after:
                    call.cancel()
            return "finished"
        (sample,) = (await collect(call)).samples
        return "finished" if len(sample.token_ids) == max_tokens else "short"
    except asyncio.CancelledError:
        return "cancelled"
    except grpc.aio.AioRpcError as error:
        if error.code() is grpc.StatusCode.CANCELLED:
            return "cancelled"
        if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED and kind == "timeout":
            return "timed out"
        return f"error {error.code().name}"


async def settled_loads(supervised: FaultStack, timeout_s: float = 30.0) -> dict[str, common_pb2.WorkerLoad]:
    """Every worker's load once its KV pool is full again and nothing runs or waits there, or
    as it stands after `timeout_s` (what is still held then is leaked)."""
    workers = [child for child in supervised.stack.children if child.name.startswith(("decode", "prefill"))]
    deadline = time.monotonic() + timeout_s
    while True:  # handlers of clients that gave up end a moment after them
        loads = {worker.name: await worker_load(supervised, worker) for worker in workers}
        idle = all(load.num_free_blocks == load.num_total_blocks and load.num_running == load.num_waiting == 0
                   for load in loads.values())
        if idle or time.monotonic() > deadline:
            return loads
        await asyncio.sleep(0.1)


async def mixed(supervised: FaultStack, settings: Settings, seed: int = 11) -> dict:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(MIXED_CONCURRENCY)
    outcomes: dict[str, int] = {}

    async def bounded(client: GatewayClient, index: int) -> None:
        async with limit:
            outcome = await mixed_request(client, index, rng.choice(MIXED_KINDS), rng)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    start = time.monotonic()
    async with supervised.client() as client:
        await asyncio.gather(*(bounded(client, index) for index in range(settings.num_mixed)))
    run_s = time.monotonic() - start
    loads = await settled_loads(supervised)
    return {
        "requests": settings.num_mixed,
        "outcomes": dict(sorted(outcomes.items())),
        "run_s": round(run_s, 1),
        "blocks_leaked": sum(load.num_total_blocks - load.num_free_blocks for load in loads.values()),
        "pools": {name: f"{load.num_free_blocks}/{load.num_total_blocks}" for name, load in loads.items()},
        "still_running": sum(load.num_running + load.num_waiting for load in loads.values()),
        "transfer_failures": "not injected (no fault hook on a process stack)",
    }


# ---- 5. oversized input ---------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssPeak:
    """The highest resident memory of a process, sampled every few milliseconds on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline = rss_bytes(pid)
        self.peak = self.baseline
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(0.005):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        """Growth over the baseline in bytes."""
        self._stopping.set()
        self._thread.join()
        return self.peak - self.baseline


async def http_body_attack(host: str, port: int, num_bytes: int, declared: bool, ca_file: str | None) -> dict:
    """POST a `num_bytes` body from a generator of 1 MiB chunks until the gateway answers
    (over TLS, checked against `ca_file`, when given)."""
    context = None if ca_file is None else ssl.create_default_context(cafile=ca_file)
    reader, writer = await asyncio.open_connection(host, port, ssl=context)
    framing = f"Content-Length: {num_bytes}" if declared else "Transfer-Encoding: chunked"
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    answered_at: list[float] = []
    start = time.monotonic()
    writer.write(head.encode())
    status = asyncio.ensure_future(reader.readline())
    status.add_done_callback(lambda _: answered_at.append(time.monotonic()))

    def body():  # type: ignore[no-untyped-def]
        chunk = b"x" * CHUNK_BYTES
        yield b'{"prompt": "' + chunk[12:]
        for _ in range(num_bytes // CHUNK_BYTES - 1):
            yield chunk

    sent = 0
    try:
        for chunk in body():
            if status.done():
                break
            writer.write(chunk if declared else f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
            sent += len(chunk)
    except (ConnectionError, OSError):
        pass  # the gateway closed the connection: its answer, if any, is in `status`
    try:
        line = await asyncio.wait_for(status, 30)
    except (ConnectionError, OSError):
        line = b""
    writer.close()
    return {"status": line.decode(errors="replace").strip() or "closed",
            "refused_s": round((answered_at[0] if answered_at else time.monotonic()) - start, 3),
            "sent_mb": round(sent / 2**20, 1)}


async def grpc_message_attack(address: str, num_bytes: int, ca_file: str | None) -> dict:
    """Send one Generate request of `num_bytes`, serialized before the clock starts (over
    TLS, checked against `ca_file`, when given)."""
    payload = gateway_pb2.GenerateRequest(text="x" * num_bytes).SerializeToString()
    method = f"/{gateway_pb2.DESCRIPTOR.services_by_name['Gateway'].full_name}/Generate"
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    if ca_file is None:
        channel = grpc.aio.insecure_channel(address, options=options)
    else:
        channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(Path(ca_file).read_bytes()), options)
    async with channel:
        generate = channel.unary_stream(method, request_serializer=None,
                                        response_deserializer=gateway_pb2.GenerateResponse.FromString)
        start = time.monotonic()
        try:
            async for _ in generate(payload, timeout=60):
                pass
            code = "OK"
        except grpc.aio.AioRpcError as error:
            code = error.code().name
        return {"status": code, "refused_s": round(time.monotonic() - start, 3), "sent_mb": round(len(payload) / 2**20, 1)}


def attack_round(host: str, http_port: int, grpc_address: str, body_bytes: int, grpc_bytes: int,
                 ca_file: str | None) -> dict[str, dict]:
    """The three attacks once, one after another. Runs in a process of its own: building and
    sending the payloads there never stalls the event loop that times the streams."""

    async def in_turn() -> dict[str, dict]:
        return {
            "http_content_length": await http_body_attack(host, http_port, body_bytes, True, ca_file),
            "http_chunked": await http_body_attack(host, http_port, body_bytes, False, ca_file),
            "grpc_message": await grpc_message_attack(grpc_address, grpc_bytes, ca_file),
        }

    return asyncio.run(in_turn())


async def stream_gaps_ms(supervised: FaultStack, max_tokens: int, num_streams: int = 4) -> list[float]:
    """Gaps between token-carrying messages of `num_streams` concurrent streams, as their
    client sees them (a message may carry several tokens when the client reads late)."""

    async def one(client: GatewayClient, index: int) -> list[float]:
        gaps, last = [], None
        async for response in client.generate(f"stream {index}: once upon a time", max_tokens=max_tokens,
                                              temperature=0.0, ignore_eos=True, stream=IDS):
            if any(sample.token_ids for sample in response.samples):
                now = time.monotonic()
                if last is not None:
                    gaps.append((now - last) * 1e3)
                last = now
        return gaps

    async with supervised.client() as client:
        return [gap for gaps in await asyncio.gather(*(one(client, index) for index in range(num_streams)))
                for gap in gaps]


async def oversized(supervised: FaultStack, settings: Settings) -> dict:
    stack = supervised.stack
    address, http_port = stack.gateway_address, stack.http_port
    assert http_port is not None
    loop = asyncio.get_running_loop()
    attacks: dict[str, list[dict]] = {"http_content_length": [], "http_chunked": [], "grpc_message": []}
    quiet: list[list[float]] = []
    attacked: list[list[float]] = []
    growth = 0
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as attacker:
        await loop.run_in_executor(attacker, time.monotonic)  # started and imported before any clock runs
        for _ in range(NUM_WINDOWS):  # quiet and attacked windows in turns: the spread of each is the noise
            quiet.append(await stream_gaps_ms(supervised, settings.stream_max_tokens))
            peak = RssPeak(supervised.child("gateway").process.pid)
            streams = asyncio.ensure_future(stream_gaps_ms(supervised, settings.stream_max_tokens))
            while not streams.done():  # attack for as long as the streams run
                round_ = await loop.run_in_executor(attacker, attack_round, stack.spec.host, http_port, address,
                                                    settings.body_bytes, settings.grpc_bytes, supervised.ca_file)
                for kind, result in round_.items():
                    attacks[kind].append(result)
            attacked.append(await streams)
            growth = max(growth, peak.stop())
    return {
        "body_mb": settings.body_bytes >> 20,
        "grpc_mb": settings.grpc_bytes >> 20,
        "attacks": {name: {"rounds": len(runs), "statuses": sorted({run["status"] for run in runs}),
                           "max_refused_s": max(run["refused_s"] for run in runs),
                           "max_sent_mb": max(run["sent_mb"] for run in runs)} for name, runs in attacks.items()},
        "max_refused_s": max(run["refused_s"] for runs in attacks.values() for run in runs),
        "rss_growth_mb": round(growth / 2**20, 1),
        "itl_p50_quiet_ms": nearest_rank([gap for gaps in quiet for gap in gaps], 0.5),
        "itl_p50_attacked_ms": nearest_rank([gap for gaps in attacked for gap in gaps], 0.5),
        "itl_p99_quiet_ms": nearest_rank([gap for gaps in quiet for gap in gaps], 0.99),
        "itl_p99_attacked_ms": nearest_rank([gap for gaps in attacked for gap in gaps], 0.99),
        "itl_p99_quiet_windows_ms": [nearest_rank(gaps, 0.99) for gaps in quiet],
        "itl_p99_attacked_windows_ms": [nearest_rank(gaps, 0.99) for gaps in attacked],
    }


# ---- the run --------------------------------------------------------------------------------------


def figures(kill: dict | None, drains: list[dict], mix: dict | None, attack: dict | None,
            hangs: Sequence[dict] = ()) -> list[dict]:
    """One row per reported figure, with its target and whether it was met."""
    rows = []

    def row(part: str, figure: str, value: object, target: str, met: bool | None) -> None:
        rows.append({"part": part, "figure": figure, "value": value, "target": target,
                     "met": "-" if met is None else ("yes" if met else "NO")})

    if kill is not None:
        total = kill["requests"]
        enough = total - total // 800  # the target: at most one in 800 lost or different
        row("kill", "completed", f"{kill['completed']}/{total}", f">= {enough}", kill["completed"] >= enough)
        row("kill", "token-identical", f"{kill['identical']}/{total}", f">= {enough}", kill["identical"] >= enough)
        row("kill", "failed", kill["failed"], "-", None)
        row("kill", "migrated requests", kill["migrated"], "> 0", kill["migrated"] > 0)
        row("kill", "decode-0 back (s after kill)", kill["back_after_s"], "comes back", kill["came_back"])
        row("kill", "decode-0 took traffic again", kill["took_traffic"], "yes", kill["took_traffic"])
    for drained in drains:
        part = f"drain {drained['service']}"
        row(part, "in flight at SIGTERM", drained["in_flight"], "> 0", drained["in_flight"] > 0)
        row(part, "admitted and lost", drained["admitted_lost"], "0", drained["admitted_lost"] == 0)
        row(part, "exit code", drained["exit"], "0", drained["exit"] == 0)
        row(part, "drain time (s)", drained["drain_s"], "-", None)
    for hung in hangs:
        part = f"hang {hung['service']}"
        total = hung["requests"]
        row(part, "completed", f"{hung['completed']}/{total}", f"{total}", hung["completed"] == total)
        row(part, "token-identical", f"{hung['identical']}/{total}", f"{total}", hung["identical"] == total)
        row(part, "pass (s), undisturbed -> hung", f"{hung['undisturbed_s']} -> {hung['hung_s']}", "-", None)
        row(part, "serving again after SIGCONT", hung["serving_again"], "yes", hung["serving_again"])
    if mix is not None:
        outcomes = " ".join(f"{name}={count}" for name, count in mix["outcomes"].items())
        clean = not any(name.startswith(("error", "short")) for name in mix["outcomes"])
        row("mixed", "outcomes", outcomes, "no errors", clean)
        row("mixed", "KV blocks leaked", mix["blocks_leaked"], "0", mix["blocks_leaked"] == 0)
    if attack is not None:
        for kind, runs in attack["attacks"].items():
            size = attack["grpc_mb"] if kind.startswith("grpc") else attack["body_mb"]
            row("oversized", f"{kind} {size} MB: refused in (s)", runs["max_refused_s"], "< 1", runs["max_refused_s"] < 1)
            row("oversized", f"{kind}: answer", " / ".join(runs["statuses"]), "413 / RESOURCE_EXHAUSTED",
                all("413" in status or status == "RESOURCE_EXHAUSTED" for status in runs["statuses"]))
        row("oversized", "gateway RSS growth (MB)", attack["rss_growth_mb"], "< 100", attack["rss_growth_mb"] < 100)
        row("oversized", "4 streams' gap p50 quiet -> attacked (ms)",
            f"{attack['itl_p50_quiet_ms']} -> {attack['itl_p50_attacked_ms']}", "-", None)
        quiet, attacked = attack["itl_p99_quiet_windows_ms"], attack["itl_p99_attacked_windows_ms"]
        row("oversized", "4 streams' gap p99 quiet -> attacked (ms)",
            f"{attack['itl_p99_quiet_ms']} -> {attack['itl_p99_attacked_ms']}", "within noise", None)
        row("oversized", "gap p99 per window, quiet | attacked (ms)",
            f"{' '.join(map(str, quiet))} | {' '.join(map(str, attacked))}",
            "attacked <= worst quiet", max(attacked) <= max(quiet))
    return rows


def start_stack(model: Path, workdir: Path, tls: bool = False, device: str = "cpu") -> FaultStack:
    spec = StackSpec(model=model, mode="disaggregated", num_prefill=2, num_decode=2, grpc_port=0, http_port=0,
                     log_level="WARNING", metrics=False, tls=tls, device=device)
    stack = ProcessStack(spec, workdir)
    stack.start(timeout_s=600)
    return FaultStack(stack)


async def run(supervised: FaultStack, settings: Settings, parts: tuple[str, ...], save) -> dict:  # type: ignore[no-untyped-def]
    """Run the asked parts in order; `save(results)` after each keeps partial results."""
    results: dict = {"kill": None, "drain": [], "hang": [], "mixed": None, "oversized": None}
    if "kill" in parts:
        results["kill"] = await kill_decode(supervised, settings)
        save(results)
    if "drain" in parts:
        for name in DRAINED:
            results["drain"].append(await drain(supervised, name, settings))
            save(results)
    if "hang" in parts:
        for name in HUNG:
            results["hang"].append(await hang(supervised, name, settings))
            save(results)
    if "mixed" in parts:
        results["mixed"] = await mixed(supervised, settings)
        save(results)
    if "oversized" in parts:
        results["oversized"] = await oversized(supervised, settings)
        save(results)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="80 requests, 100 mixed, 64 MB bodies")
    parser.add_argument("--parts", default="kill,drain,hang,mixed,oversized", help="comma-separated, run in this order")
    parser.add_argument("--model", type=Path, default=SHIPPED_MODEL_DIR)
    parser.add_argument("--tls", action="store_true", help="a TLS stack (cleave up --tls), every client over TLS")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the workers run (cuda: all four on one GPU, KV over CUDA IPC)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "faults")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="the stack's directory, its services' logs kept there (default: a temporary one)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    parts = tuple(part for part in args.parts.split(",") if part)
    unknown = set(parts) - {"kill", "drain", "hang", "mixed", "oversized"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}")
    name = run_name("faults" + ("-quick" if args.quick else "") + ("-tls" if args.tls else "")
                    + ("-cuda" if args.device == "cuda" else ""))

    def save(results: dict) -> None:
        rows = figures(results["kill"], results["drain"], results["mixed"], results["oversized"], results["hang"])
        stack = (f"disaggregated, 2 prefill + 2 decode, {'one GPU' if args.device == 'cuda' else 'CPU'}, supervised"
                 + (", TLS everywhere" if args.tls else ""))
        summary = {"settings": asdict(settings), "stack": stack,
                   **{key: value for key, value in results.items() if value}}
        write_results(args.out, name, rows, COLUMNS, summary=summary,
                      argv=[sys.argv[0], *(sys.argv[1:] if argv is None else argv)])

    with contextlib.ExitStack() as scope:
        workdir = args.workdir or Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="cleave-faults-")))
        workdir.mkdir(parents=True, exist_ok=True)
        supervised = start_stack(args.model, workdir, tls=args.tls, device=args.device)
        try:
            results = asyncio.run(run(supervised, settings, parts, save))
        finally:
            supervised.close()
    results["files"] = [str(args.out / f"{name}.json"), str(args.out / f"{name}.md")]
    results["rows"] = figures(results["kill"], results["drain"], results["mixed"], results["oversized"], results["hang"])
    for row in results["rows"]:
        print(f"{row['part']:>18}  {row['figure']:<32} {row['value']!s:<28} target {row['target']:<12} {row['met']}")
    return results


if __name__ == "__main__":
    main()
