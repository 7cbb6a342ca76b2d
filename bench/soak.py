"""A leak hunt on a long run: does any service's resident memory grow round after round?

The stack is bench/faults.py's (`start_stack`: kvstore, two prefill workers, two decode
workers, gateway; disaggregated, CPU, the shipped model, supervised). It serves `rounds`
rounds of `requests` requests each, `concurrency` at a time, each of a kind drawn by a seeded
RNG from two families:

- gRPC (`GatewayClient`, as faults.mixed_request): finish, cancel early (in tokenize,
  admission, prefill, transfer or start), cancel while streaming, run into the deadline;
- HTTP through the real `openai` client (`AsyncOpenAI` on the stack's HTTP port): a chat
  stream, completions of n = 2..3 samples (streamed or not), chat with logprobs and
  top_logprobs, completions with a stop string, chat under a `guided_regex` (extra_body),
  and a chat stream the client closes midway (the gateway sees the disconnect).

Prompts come from a pool of `prompts` texts reused every round, so that what the services
cache by prompt fills during the warm-up: the gateway's tokenizer keeps up to 10,000 encoded
texts (the shipped model's tokenizer has no pre-tokenizer, so each whole prompt under 256
characters is one cache entry, about 3.7 KB), and its prefill affinity up to 100,000 block
hashes. With `--prompts 0` every prompt is new and both grow steadily until full (about 5 MB
of the gateway's per 1000 requests): bounded, not a leak, but indistinguishable from one
within a few thousand requests.

After each round, once every worker's KV pool is full again and nothing runs there (GetLoad,
polled with a deadline: faults.settled_loads), it records each service process's resident
memory (VmRSS) and the KV blocks still held (leaked). Round 1 is the warm-up (allocators,
caches, compiled grammars); the leak figure is each service's growth per 1000 requests from
round 2 to the last round. A Python process grows for a while from fragmentation and then
levels off; a leak keeps growing at the same pace round after round (the `delta_mb` column).
Every ending that is not the kind's own (an error, fewer samples or tokens than asked, an
answer outside its regex or logprobs of the wrong width) counts as unexpected.

    python bench/soak.py                                  # 8 rounds x 400 requests, 12 at a time
    python bench/soak.py --rounds 3 --requests 50 --out /tmp/soak   # a quick look
    python bench/soak.py --kinds stop,guided_regex        # only these endings, to narrow a leak down
    python bench/soak.py --prompts 0                      # every prompt new: caches keyed by prompt fill
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

from cleave.client import GatewayClient
from cleave.config import SHIPPED_MODEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_name, write_results  # noqa: E402
from faults import MIXED_KINDS, FaultStack, mixed_request, rss_bytes, settled_loads, start_stack  # noqa: E402

HTTP_KINDS = ("chat_stream", "completions_n", "logprobs", "stop", "guided_regex", "stream_closed")
KINDS = MIXED_KINDS + HTTP_KINDS
SERVICES = ("gateway", "prefill-0", "prefill-1", "decode-0", "decode-1", "kvstore")
THINK = {"max_thinking_tokens": 2}  # the random model would think to the token limit; answers start after
REGEX = r"[a-z]{1,6}( [a-z]{1,6}){0,3}"
STOPS = (".", "..", "...", "e")  # the shipped model writes mostly dots
SETTLE_S = 60.0  # a guard: handlers of abandoned requests end well within it
COLUMNS = ("round", "service", "requests", "rss_mb", "delta_mb", "blocks_held", "pid")
UNEXPECTED = ("error", "short", "wrong")  # outcomes no kind asks for


@dataclass(frozen=True)
class Settings:
    """Sizes of one run."""

    rounds: int = 8
    requests: int = 400  # a round
    concurrency: int = 12
    seed: int = 7
    kinds: tuple[str, ...] = KINDS  # a subset narrows a leak down to the endings that cause it
    prompts: int = 64  # distinct prompts, reused round after round; 0: every prompt new


# ---- HTTP requests -----------------------------------------------------------------------------


def prompt_text(number: int, num_prompts: int, rng: random.Random) -> str:
    """Request `number`'s prompt: one of `num_prompts` (each the same on every use), or a new
    one with `num_prompts` 0."""
    if num_prompts == 0:
        return f"soak {number}: " + "word " * rng.randint(1, 40)
    index = number % num_prompts
    return f"soak {index}: " + "word " * (1 + index * 7 % 40)


async def http_request(client: openai.AsyncOpenAI, model: str, prompt: str, kind: str, rng: random.Random) -> str:
    """Run one OpenAI-API request for `model` on `prompt` the way `kind` says; returns how it ended."""
    max_tokens = rng.randint(2, 24)
    messages = [{"role": "user", "content": prompt}]
    try:
        if kind == "chat_stream":
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=rng.choice((0.0, 1.0)),
                stream=True, stream_options={"include_usage": True}, extra_body=THINK)
            async with stream:
                finishes = [choice.finish_reason async for chunk in stream for choice in chunk.choices
                            if choice.finish_reason]
            return "finished" if finishes else "short"
        if kind == "completions_n":
            num_samples = rng.randint(2, 3)
            request = dict(model=model, prompt=prompt, max_tokens=max_tokens, n=num_samples,
                           temperature=1.0, seed=rng.randrange(1 << 30))
            if rng.random() < 0.5:
                stream = await client.completions.create(**request, stream=True)
                async with stream:
                    finished = {choice.index async for chunk in stream for choice in chunk.choices
                                if choice.finish_reason}
            else:
                finished = {choice.index for choice in (await client.completions.create(**request)).choices}
            return "finished" if finished == set(range(num_samples)) else "short"
        if kind == "logprobs":
            top = rng.randint(1, 5)
            response = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=1.0, logprobs=True,
                top_logprobs=top, extra_body=THINK)
            entries = response.choices[0].logprobs.content or []
            return "finished" if all(len(entry.top_logprobs) == top for entry in entries) else "wrong"
        if kind == "stop":
            response = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=1.0, stop=[rng.choice(STOPS)],
                                                       seed=rng.randrange(1 << 30))
            return "stopped" if response.choices[0].finish_reason == "stop" else "finished"
        if kind == "guided_regex":
            response = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=40, temperature=1.0, seed=rng.randrange(1 << 30),
                extra_body={**THINK, "guided_regex": REGEX})
            choice = response.choices[0]
            matched = choice.finish_reason == "length" or re.fullmatch(REGEX, choice.message.content or "")
            return "finished" if matched else "wrong"
        if kind == "stream_closed":
            close_after = rng.randint(1, 3)  # chunks: a chunk may carry several tokens
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
                extra_body={**THINK, "ignore_eos": True})
            seen = 0
            async with stream:  # leaving it closes the connection: the gateway sees a disconnect
                async for _ in stream:
                    seen += 1
                    if seen >= close_after:
                        return "closed"
            return "finished"  # it ended first
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    except openai.APIStatusError as error:
        return f"error {error.status_code}"
    except openai.APIConnectionError as error:
        return f"error {type(error).__name__}"


# ---- the run -------------------------------------------------------------------------------------


async def one_round(supervised: FaultStack, settings: Settings, round_index: int) -> Counter:
    """`settings.requests` requests of kinds drawn from the round's seed: how each kind ended."""
    rng = random.Random(settings.seed * 1000 + round_index)
    plan = [(rng.choice(settings.kinds), rng.randrange(1 << 32)) for _ in range(settings.requests)]
    limit = asyncio.Semaphore(settings.concurrency)
    outcomes: Counter = Counter()
    stack = supervised.stack

    async def bounded(grpc_client: GatewayClient, http_client: openai.AsyncOpenAI, model: str, index: int) -> None:
        kind, seed = plan[index]
        rng = random.Random(seed)
        number = round_index * settings.requests + index
        prompt = prompt_text(number, settings.prompts, rng)
        async with limit:
            if kind in MIXED_KINDS:
                outcome = await mixed_request(grpc_client, number, kind, rng, prompt)
            else:
                outcome = await http_request(http_client, model, prompt, kind, rng)
        outcomes[f"{kind} {outcome}"] += 1

    async with (supervised.client() as grpc_client,
                openai.AsyncOpenAI(base_url=stack.http_url, api_key="soak", max_retries=0,
                                   timeout=120) as http_client):
        (served,) = (await http_client.models.list()).data
        await asyncio.gather(*(bounded(grpc_client, http_client, served.id, index)
                               for index in range(settings.requests)))
    return outcomes


def growth_per_1000(rows: list[dict], service: str, requests_a_round: int) -> float | None:
    """MB per 1000 requests between round 2 and the last round (None with fewer than 3 rounds)."""
    series = [row["rss_mb"] for row in rows if row["service"] == service]
    if len(series) < 3:
        return None
    return round((series[-1] - series[1]) / ((len(series) - 2) * requests_a_round / 1000), 2)


def summarize(settings: Settings, rows: list[dict], outcomes: Counter, rounds: list[dict],
              supervised: FaultStack) -> dict:
    """The run's figures: growth per service, blocks leaked, how the requests ended."""
    return {
        "settings": asdict(settings),
        "stack": "disaggregated, 2 prefill + 2 decode, CPU, supervised (bench/faults.py: start_stack)",
        "growth_mb_per_1000_requests": {service: growth_per_1000(rows, service, settings.requests)
                                        for service in SERVICES},
        "rss_mb": {service: [row["rss_mb"] for row in rows if row["service"] == service] for service in SERVICES},
        "blocks_leaked": rounds[-1]["blocks_leaked"] if rounds else None,
        "blocks_leaked_any_round": max((entry["blocks_leaked"] for entry in rounds), default=None),
        "still_running": rounds[-1]["still_running"] if rounds else None,
        "outcomes": dict(sorted(outcomes.items())),
        "unexpected": sum(count for name, count in outcomes.items() if name.split(" ")[1] in UNEXPECTED),
        "round_s": [entry["run_s"] for entry in rounds],
        "restarts": supervised.lines,  # what the supervisor said: nothing, in a run where no service died
    }


async def soak(supervised: FaultStack, settings: Settings,
               save) -> tuple[list[dict], Counter, list[dict]]:  # type: ignore[no-untyped-def]
    """All rounds; `save(rows, outcomes, rounds)` after each keeps partial results."""
    rows: list[dict] = []
    outcomes: Counter = Counter()
    rounds: list[dict] = []
    previous: dict[str, float] = {}
    for round_index in range(settings.rounds):
        start = time.monotonic()
        round_outcomes = await one_round(supervised, settings, round_index)
        run_s = time.monotonic() - start
        loads = await settled_loads(supervised, SETTLE_S)
        settle_s = time.monotonic() - start - run_s
        outcomes += round_outcomes
        for service in SERVICES:
            child = supervised.child(service)
            rss_mb = round(rss_bytes(child.process.pid) / 2**20, 1)
            load = loads.get(service)
            rows.append({"round": round_index + 1, "service": service,
                         "requests": (round_index + 1) * settings.requests, "rss_mb": rss_mb,
                         "delta_mb": round(rss_mb - previous[service], 1) if service in previous else "-",
                         "blocks_held": "-" if load is None else load.num_total_blocks - load.num_free_blocks,
                         "pid": child.process.pid})
            previous[service] = rss_mb
        rounds.append({"round": round_index + 1, "run_s": round(run_s, 1), "settle_s": round(settle_s, 2),
                       "blocks_leaked": sum(load.num_total_blocks - load.num_free_blocks for load in loads.values()),
                       "still_running": sum(load.num_running + load.num_waiting for load in loads.values()),
                       "outcomes": dict(sorted(round_outcomes.items()))})  # the JSON's details
        save(rows, outcomes, rounds)
        print(f"round {round_index + 1}/{settings.rounds}: {run_s:.1f} s, "
              + " ".join(f"{row['service']}={row['rss_mb']}" for row in rows[-len(SERVICES):])
              + f" MB, blocks leaked {rounds[-1]['blocks_leaked']}", flush=True)
    return rows, outcomes, rounds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Settings()
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="round 1 is the warm-up")
    parser.add_argument("--requests", type=int, default=defaults.requests, help="requests a round")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated request kinds to draw from")
    parser.add_argument("--prompts", type=int, default=defaults.prompts,
                        help="distinct prompts, reused every round (0: every prompt new, and the caches keyed "
                             "by prompt grow until full)")
    parser.add_argument("--model", type=Path, default=SHIPPED_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "soak")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="the stack's directory, its services' logs kept there (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1 or args.prompts < 0:
        parser.error("--rounds, --requests and --concurrency must be at least 1, --prompts at least 0")
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    settings = Settings(rounds=args.rounds, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                        kinds=kinds, prompts=args.prompts)
    name = run_name("soak")
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]

    with contextlib.ExitStack() as scope:
        workdir = args.workdir or Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="cleave-soak-")))
        workdir.mkdir(parents=True, exist_ok=True)
        supervised = start_stack(args.model, workdir)

        def save(rows: list[dict], outcomes: Counter, rounds: list[dict]) -> None:
            write_results(args.out, name, rows, COLUMNS, argv=command, details={"rounds": rounds},
                          summary=summarize(settings, rows, outcomes, rounds, supervised))

        try:
            rows, outcomes, rounds = asyncio.run(soak(supervised, settings, save))
            summary = summarize(settings, rows, outcomes, rounds, supervised)
        finally:
            supervised.close()
    for service, growth in summary["growth_mb_per_1000_requests"].items():
        print(f"{service:>10}: {growth} MB / 1000 requests (round 2 -> {settings.rounds})")
    print(f"blocks leaked {summary['blocks_leaked']}, unexpected endings {summary['unexpected']}")
    return {**summary, "rounds": rounds, "rows": rows,
            "files": [str(args.out / f"{name}.json"), str(args.out / f"{name}.md")]}


if __name__ == "__main__":
    main()
