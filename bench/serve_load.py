"""Load generator for the serving benchmarks: streaming users through the gateway, over its
gRPC Generate stream or its OpenAI HTTP API (bench/serve_clients.py), split across client
processes.

One Python process reads only ~7k gRPC messages/s per core, less than the stack streams, so
the users run in `num_procs` spawned processes, each with its own event loop and its own
connections (one gRPC channel per `USERS_PER_CHANNEL` users, or one aiohttp session), all
released together by a barrier. Each process times its requests with its own monotonic clock
(TTFT, TPOT and gaps are durations inside one process) and hands its `Timing`s back as plain
dicts. The parent sends the long prompts and measures the run's wall time (for tokens/s and
goodput) on its own clock, from the barrier until the last process reported and the last
long prompt finished.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import random
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hops import percentile
from serve_clients import GrpcClient, HttpClient, Timing

FIRST_TOKEN_ID = 3  # ids below are pad/bos/eos in the shipped tokenizers
USERS_PER_CHANNEL = 8
READY_TIMEOUT_S = 300.0  # client processes import, connect and meet at the barrier within this
WORDS = (
    "the quick brown fox jumps over lazy dog serving system turns prompts into tokens runs model "
    "streams answer back user prefill reads whole prompt once limited arithmetic decode produces "
    "one token time memory bandwidth keeping two apart lets each run best speed key value cache "
    "holds what attention needs earlier blocks sixteen positions shared reused without copying "
    "thinks before answers reasoning markers final long take thousands grow scheduler decide "
    "requests step sea wide deep blue sings storms calm capital france paris spider eight legs"
).split()


@dataclass(frozen=True)
class Workload:
    """What the users and the long prompts send; plain data, it crosses to client processes.

    Ranges are inclusive (low, high), drawn uniformly per request.
    """

    api: str  # "grpc" or "http"
    grpc_address: str
    http_url: str | None  # http://host:port/v1
    num_users: int
    duration_s: float  # users send until this long after the start (0: requests_per_user each)
    requests_per_user: int
    ramp_s: float  # users' first requests spread over this long
    prompt_len: tuple[int, int]  # token ids: gRPC users
    prompt_words: tuple[int, int]  # words of text: HTTP users (chat completions)
    output_len: tuple[int, int]
    long_prompt_len: tuple[int, int]  # token ids, over either API
    long_output_len: int
    long_first_s: float
    long_interval_s: float  # mean time between long prompts (0: none)
    long_arrival: str  # "periodic" or "poisson"
    reasoning_mode: str
    timeout_s: float  # per request
    seed: int
    vocab: int  # prompt ids are drawn from [FIRST_TOKEN_ID, vocab)
    tls_ca_file: str | None = None  # a TLS stack's CA, which clients check the gateway against


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)]


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def send(client: GrpcClient | HttpClient, workload: Workload, kind: str, rng: random.Random,
               channel: int = 0) -> Timing:
    """One request of `kind`; a failure becomes the Timing's error instead of ending the run."""
    sent = time.monotonic()
    try:
        if kind == "long":
            prompt = random_prompt(rng, rng.randint(*workload.long_prompt_len), workload.vocab)
            return await client.tokens(kind, prompt, workload.long_output_len, channel)
        max_tokens = rng.randint(*workload.output_len)
        if isinstance(client, HttpClient):
            return await client.chat(kind, random_text(rng, rng.randint(*workload.prompt_words)), max_tokens, channel)
        prompt = random_prompt(rng, rng.randint(*workload.prompt_len), workload.vocab)
        return await client.tokens(kind, prompt, max_tokens, channel)
    except Exception as error:  # noqa: BLE001 - counted and reported with the results
        details = getattr(error, "details", None)
        message = f"{error.code().name}: {details()}" if callable(details) else f"{type(error).__name__}: {error}"
        await asyncio.sleep(0.1)  # a dead stack fails every request; don't spin on it
        return Timing(kind, sent, error=message)


def make_client(workload: Workload, num_channels: int = 1) -> GrpcClient | HttpClient:
    if workload.api == "http":
        assert workload.http_url, "the stack has no HTTP API (StackSpec.http_port=None)"
        return HttpClient(workload.http_url, workload.reasoning_mode, workload.timeout_s, workload.tls_ca_file)
    return GrpcClient(workload.grpc_address, workload.reasoning_mode, workload.timeout_s, num_channels,
                      workload.tls_ca_file)


async def warm_up(workload: Workload, num_parallel: int) -> None:
    """A few requests one at a time, then some at once: kernels, graphs, the transport handshake."""
    client = make_client(workload)
    rng = random.Random(workload.seed - 1)
    try:
        await client.connect()
        for kind in ("warmup", "warmup", "long") if workload.long_interval_s > 0 else ("warmup", "warmup"):
            timing = await send(client, workload, kind, rng)
            if timing.error:
                raise RuntimeError(f"the warm-up request failed: {timing.error}")
        await asyncio.gather(*(send(client, workload, "warmup", rng) for _ in range(num_parallel)))
    finally:
        await client.close()


def _user_rng(workload: Workload, user: int) -> random.Random:
    return random.Random(workload.seed * 1_000_003 + user)  # the same prompts however users are split


async def _users(workload: Workload, proc_index: int, num_procs: int, barrier: Any) -> tuple[list[Timing], float]:
    """This process's users' timings, and the CPU seconds it spent from the start on."""
    users = list(range(proc_index, workload.num_users, num_procs))
    client = make_client(workload, -(-len(users) // USERS_PER_CHANNEL))
    timings: list[Timing] = []
    try:
        await client.connect()
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, READY_TIMEOUT_S)
        started, cpu_started = time.monotonic(), time.process_time()

        async def user(position: int, index: int) -> None:
            rng = _user_rng(workload, index)
            await asyncio.sleep(workload.ramp_s * index / max(workload.num_users, 1))
            num_sent = 0
            while (time.monotonic() - started < workload.duration_s if workload.duration_s > 0
                   else num_sent < workload.requests_per_user):
                timings.append(await send(client, workload, "user", rng, position // USERS_PER_CHANNEL))
                num_sent += 1

        await asyncio.gather(*(user(position, index) for position, index in enumerate(users)))
    finally:
        await client.close()
    return timings, time.process_time() - cpu_started


def client_process(workload: Workload, proc_index: int, num_procs: int, barrier: Any, results: Any) -> None:
    """Entry point of one client process: its share of the users, timings (and its CPU
    seconds) onto `results`."""
    try:
        timings, cpu_s = asyncio.run(_users(workload, proc_index, num_procs, barrier))
        results.put((proc_index, [asdict(timing) for timing in timings], None, cpu_s))
    except BaseException:  # noqa: BLE001 - the parent raises it
        barrier.abort()
        results.put((proc_index, [], traceback.format_exc(), 0.0))


async def _long_prompts(workload: Workload, client: GrpcClient | HttpClient, stop: asyncio.Event) -> list[Timing]:
    rng = random.Random(workload.seed + 7)
    pending = []
    delay = workload.long_first_s
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            pending.append(asyncio.ensure_future(send(client, workload, "long", rng)))
            interval = workload.long_interval_s
            delay = rng.expovariate(1 / interval) if workload.long_arrival == "poisson" else interval
    return list(await asyncio.gather(*pending))


def _next_result(results: Any, processes: list, reported: set[int]) -> tuple[int, list[dict], str | None, float]:
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(processes) if i not in reported and p.exitcode not in (None, 0)]
            if dead:
                exitcode = processes[dead[0]].exitcode
                raise RuntimeError(f"client process {dead[0]} died with exit code {exitcode}") from None


async def _drive(workload: Workload, processes: list, barrier: Any, results: Any) -> LoadRun:
    loop = asyncio.get_running_loop()
    client = make_client(workload)
    try:
        await client.connect()
        await loop.run_in_executor(None, barrier.wait, READY_TIMEOUT_S)
        started, cpu_started = time.monotonic(), time.process_time()
        clients_cpu_s = 0.0
        stop = asyncio.Event()
        longs = asyncio.ensure_future(_long_prompts(workload, client, stop) if workload.long_interval_s > 0
                                      else asyncio.sleep(0, []))
        timings: list[Timing] = []
        reported: set[int] = set()
        try:
            while len(reported) < len(processes):
                index, rows, error, cpu_s = await loop.run_in_executor(None, _next_result, results, processes, reported)
                if error is not None:
                    raise RuntimeError(f"client process {index} failed:\n{error}")
                reported.add(index)
                timings.extend(Timing(**row) for row in rows)
                clients_cpu_s += cpu_s
        except BaseException:
            longs.cancel()
            raise
        stop.set()
        timings.extend(await longs)
        return LoadRun(timings, time.monotonic() - started, clients_cpu_s + time.process_time() - cpu_started)
    finally:
        await client.close()


@dataclass(frozen=True)
class LoadRun:
    """What a load run measured: every request's timing, the run's wall time (parent clock)
    and the CPU seconds the load's own processes spent meanwhile (clients and this one)."""

    timings: list[Timing]
    wall_s: float
    client_cpu_s: float


def run_load(workload: Workload, num_procs: int) -> LoadRun:
    """Run the users in `num_procs` spawned processes and the long prompts from this one."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_procs + 1)
    results = context.Queue()
    processes = [context.Process(target=client_process, args=(workload, index, num_procs, barrier, results),
                                 name=f"bench-client-{index}", daemon=True) for index in range(num_procs)]
    for process in processes:
        process.start()
    try:
        return asyncio.run(_drive(workload, processes, barrier, results))
    except threading.BrokenBarrierError:
        try:
            index, _, error, _ = results.get(timeout=10)
        except queue.Empty:
            raise RuntimeError("the client processes did not all start in time") from None
        raise RuntimeError(f"client process {index} failed before the start:\n{error}") from None
    finally:
        barrier.abort()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when it finished without error, its first token came within
    `ttft_ms` and its later tokens averaged at most `tpot_ms` (one-token answers: TTFT only)."""

    ttft_ms: float
    tpot_ms: float

    def met(self, timing: Timing) -> bool:
        if timing.error is not None or timing.ttft is None or timing.ttft * 1e3 > self.ttft_ms:
            return False
        return timing.tpot is None or timing.tpot * 1e3 <= self.tpot_ms


def summarize(timings: list[Timing], wall_s: float, slo: Slo) -> dict:
    """The users' latencies, the long prompts' TTFT, throughput and SLO goodput of a run."""
    ms = 1e3
    done = [t for t in timings if t.error is None and t.first is not None]
    users = [t for t in done if t.kind == "user"]
    longs = [t for t in done if t.kind == "long"]
    num_users = sum(t.kind == "user" for t in timings)
    num_longs = sum(t.kind == "long" for t in timings)
    num_met = {kind: sum(slo.met(t) for t in timings if t.kind == kind) for kind in ("user", "long")}
    errors = [t.error for t in timings if t.error is not None]
    prompt_tokens = [t.prompt_tokens for t in users if t.prompt_tokens is not None]
    return {
        "requests": num_users, "errors": len(errors), "first_error": errors[0] if errors else None,
        "ttft_p50_ms": percentile([t.ttft * ms for t in users], 50),
        "ttft_p90_ms": percentile([t.ttft * ms for t in users], 90),
        "tpot_p50_ms": percentile([t.tpot * ms for t in users if t.tpot is not None], 50),
        "tpot_p90_ms": percentile([t.tpot * ms for t in users if t.tpot is not None], 90),
        "itl_p99_ms": percentile([gap * ms for t in users for gap in t.gaps], 99),
        "long_prompts": num_longs, "long_ttft_p50_ms": percentile([t.ttft * ms for t in longs], 50),
        "output_tok_s": sum(t.num_tokens for t in timings) / wall_s, "wall_s": wall_s,
        "goodput_rps": sum(num_met.values()) / wall_s,
        "slo_pct": 100 * sum(num_met.values()) / max(len(timings), 1),
        "user_slo_pct": 100 * num_met["user"] / max(num_users, 1),
        "long_slo_pct": 100 * num_met["long"] / num_longs if num_longs else None,
        "user_tokens_per_request": sum(t.num_tokens for t in users) / max(len(users), 1),
        "tokens_per_event": sum(t.num_tokens for t in done) / max(sum(t.num_events for t in done), 1),
        "user_prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
    }


def max_chat_tokens(model_dir: Path, num_words: int) -> int:
    """An upper bound on the prompt tokens of a chat of `num_words` words (chat template included)."""
    from cleave.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    widest = max(WORDS, key=lambda word: len(tokenizer.encode(" " + word, add_special_tokens=False)))
    text = tokenizer.apply_chat_template([{"role": "user", "content": " ".join([widest] * num_words)}])
    return len(tokenizer.encode(text, add_special_tokens=False)) + 8


def words_for_tokens(model_dir: Path, num_tokens: tuple[int, int]) -> tuple[int, int]:
    """Word counts of chats about `num_tokens` tokens long (LOW, HIGH), chat template included,
    with the model's tokenizer: its mean tokens per word of WORDS (a word and its space)."""
    from cleave.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    per_word = sum(len(tokenizer.encode(" " + word, add_special_tokens=False)) for word in WORDS) / len(WORDS)
    empty = tokenizer.apply_chat_template([{"role": "user", "content": ""}])
    overhead = len(tokenizer.encode(empty, add_special_tokens=False))
    low, high = (max(1, round((tokens - overhead) / per_word)) for tokens in num_tokens)
    return low, high
