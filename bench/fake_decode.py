"""A decode worker without an engine, so that a bench measures the gateway alone
(bench/gateway_load.py).

It serves `cleave.v1.Decode` on a real grpc.aio server (`cleave.rpc.serve`: health SERVING as
soon as it listens, as a worker whose model loaded) and behaves as the real worker
(services/decode) wherever the gateway depends on it:

- `Start(prefill_locally)` (colocated mode; anything else is FAILED_PRECONDITION) queues the
  request; the next step carries each sample's first token (the engine prefills, then
  samples), every step after one more, and the delta of a sample's `max_tokens`-th token
  carries FINISH_REASON_LENGTH.
- A step every `step_s` seconds (no catching up when the loop falls behind: a slow step)
  while any sample is live. Its deltas go into the outbox of the request's gateway; that
  gateway's `Attach` stream takes everything queued since its last message as ONE
  `StepOutput` (a stream that lags gets several steps in one message, as
  services/decode/gateway_streams.py does), with the worker's load at most once a second.
  Deltas of a gateway not attached yet wait for it; a second Attach of one gateway id ends
  the first; a gateway whose stream ends loses its requests (nobody would read them).
- `Abort` ends the request, or one sample, with FINISH_REASON_ABORT on the next step.
- `GetLoad`: live samples as running, none waiting, a KV pool of `num_total_blocks` with the
  live requests' blocks taken, the token rate, the attached gateways.

Token ids are drawn from the tokenizer's ordinary text tokens (`ordinary_token_ids`: not
special, not end-of-sequence, holding no reasoning tag), so the gateway's detokenizer, stop
checker and reasoning parser do the work real text makes, and every sample runs to its
`max_tokens` as answer text.

    python bench/fake_decode.py --model DIR --step-ms 10 [--parent-pid PID]

prints its events on stdout, one a line, for the parent to wait on: `listening PORT` once
it serves, `attached GATEWAY_ID` as a gateway's Attach stream opens.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cleave.config import SHIPPED_MODEL_DIR, RpcConfig
from cleave.errors import FailedPrecondition, InvalidArgument
from cleave.generation.reasoning_formats import select_reasoning_config
from cleave.logging import configure_logging
from cleave.model.text_config import TextConfig
from cleave.model.tokenizer import Tokenizer
from cleave.parent_death import follow_parent
from cleave.proto.cleave.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from cleave.rpc import ServiceRegistration, serve

LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
BLOCK_SIZE = 16  # for the load report's free blocks only
LOAD_INTERVAL_S = 1.0  # a StepOutput carries the load at most this often (the real worker's default)
RATE_WINDOW_S = 5.0
TOKEN_CYCLE = 4099  # a prime: samples start at random offsets into one shuffled cycle of ids


def ordinary_token_ids(model_dir: Path) -> list[int]:
    """The ids of the tokenizer's plain text pieces: decoding to text (no partial UTF-8), not
    special, not end-of-sequence, holding no thinking tag of the model."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    reasoning = select_reasoning_config(model_dir, tokenizer)
    tags = reasoning.tags if reasoning is not None else ()
    ordinary = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if (not text or "\ufffd" in text or token_id in tokenizer.eos_token_ids or tokenizer.is_special(token_id)
                or any(tag and tag in text for tag in tags)):
            continue
        ordinary.append(token_id)
    if not ordinary:
        raise SystemExit(f"the tokenizer of {model_dir} has no plain text token to stream")
    return ordinary


@dataclass
class _Request:
    """A started request: its gateway, its samples' progress and the blocks it holds."""

    gateway_id: str
    max_tokens: int
    num_blocks: int
    offsets: list[int]  # each sample's start in the token cycle
    num_tokens: list[int]
    finished: list[bool]
    aborted: set[int] = field(default_factory=set)

    @property
    def num_live(self) -> int:
        return self.finished.count(False)


class _Outbox:
    """One gateway's deltas not yet sent, and which Attach call reads them."""

    def __init__(self) -> None:
        self.deltas: list[tuple[str, int, tuple[int, ...], int]] = []  # request id, sample, tokens, finish
        self.step = 0
        self.ready = asyncio.Event()
        self.owner: object | None = None


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """The Decode service over a timer instead of an engine (see the module docstring).

    Args:
        token_ids: the ids samples stream (`ordinary_token_ids`).
        step_s: seconds between steps.
        max_model_len: a request without max_tokens fills the context up to this.
        on_attach: called with a gateway id as its Attach stream opens.
        seed: of the token cycle and the samples' offsets.
    """

    def __init__(self, token_ids: Sequence[int], step_s: float, max_model_len: int,
                 on_attach: Callable[[str], None] = lambda gateway_id: None, seed: int = 0,
                 worker_id: str = "fake-decode-0", num_total_blocks: int = 1 << 20,
                 max_num_running: int = 4096) -> None:
        self._rng = random.Random(seed)
        self._cycle = [self._rng.choice(token_ids) for _ in range(TOKEN_CYCLE)]
        self.step_s = step_s
        self.max_model_len = max_model_len
        self.worker_id = worker_id
        self.num_total_blocks = num_total_blocks
        self.max_num_running = max_num_running
        self._on_attach = on_attach
        self._requests: dict[str, _Request] = {}
        self._outboxes: dict[str, _Outbox] = {}
        self._work = asyncio.Event()  # set while a sample is live
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self.step = 0

    # ---- the steps ------------------------------------------------------------------------

    async def run_steps(self) -> None:
        """The engine's loop: a step every `step_s` while a sample is live."""
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            if not self._requests:
                self._work.clear()
                await self._work.wait()
                next_step = loop.time()  # the first step (prefill and first token) one step from now
            next_step += self.step_s
            delay = next_step - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                next_step = loop.time()  # behind: this step was slow, the next one is not early
            self._step()

    def _step(self) -> None:
        self.step += 1
        by_gateway: dict[str, list[tuple[str, int, tuple[int, ...], int]]] = {}
        num_tokens = 0
        for request_id, request in list(self._requests.items()):
            deltas = by_gateway.setdefault(request.gateway_id, [])
            for index, finished in enumerate(request.finished):
                if finished:
                    continue
                if index in request.aborted:
                    request.finished[index] = True
                    deltas.append((request_id, index, (), ABORT))
                    continue
                position = request.offsets[index] + request.num_tokens[index]
                request.num_tokens[index] += 1
                num_tokens += 1
                done = request.num_tokens[index] >= request.max_tokens
                request.finished[index] = done
                deltas.append((request_id, index, (self._cycle[position % TOKEN_CYCLE],), LENGTH if done else 0))
            if not request.num_live:
                del self._requests[request_id]
        self._count(num_tokens)
        for gateway_id, deltas in by_gateway.items():
            self._publish(gateway_id, deltas)

    def _publish(self, gateway_id: str, deltas: list) -> None:
        outbox = self._outboxes.setdefault(gateway_id, _Outbox())
        outbox.deltas.extend(deltas)
        outbox.step = self.step
        outbox.ready.set()

    def _count(self, num_tokens: int) -> None:
        now = time.monotonic()
        self._rate.append((now, num_tokens))
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()

    def load(self) -> common_pb2.WorkerLoad:
        """The worker's load now, as the real one reports it."""
        used = sum(request.num_blocks for request in self._requests.values())
        span = max(time.monotonic() - self._rate[0][0], 1.0) if self._rate else 1.0
        return common_pb2.WorkerLoad(
            worker_id=self.worker_id,
            num_running=sum(request.num_live for request in self._requests.values()),
            num_waiting=0,
            num_free_blocks=max(self.num_total_blocks - used, 0),
            num_total_blocks=self.num_total_blocks,
            max_num_running=self.max_num_running,
            tokens_per_second=sum(count for _, count in self._rate) / span,
            num_attached_gateways=sum(outbox.owner is not None for outbox in self._outboxes.values()),
        )

    # ---- the service ----------------------------------------------------------------------

    async def Start(self, request: decode_pb2.StartRequest,
                    context: grpc.aio.ServicerContext) -> decode_pb2.StartResponse:
        if not request.prefill_locally:
            raise FailedPrecondition("the fake decode worker only prefills locally: run the gateway with "
                                     "--mode colocated")
        if not request.request_id or not request.gateway_id or not request.prompt_token_ids:
            raise InvalidArgument("request_id, gateway_id and prompt_token_ids must be set with prefill_locally")
        if request.request_id in self._requests:
            raise InvalidArgument("a request of this id is running here; use a unique id", field="request_id")
        num_prompt = len(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens or max(self.max_model_len - num_prompt, 1)
        num_samples = request.sampling.n or 1
        self._requests[request.request_id] = _Request(
            gateway_id=request.gateway_id, max_tokens=max_tokens,
            num_blocks=num_samples * math.ceil((num_prompt + max_tokens) / BLOCK_SIZE),
            offsets=[self._rng.randrange(TOKEN_CYCLE) for _ in range(num_samples)],
            num_tokens=[0] * num_samples, finished=[False] * num_samples)
        self._work.set()
        return decode_pb2.StartResponse(num_cached_tokens=0)

    async def Attach(self, request: decode_pb2.AttachRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.StepOutput]:
        gateway_id = request.gateway_id
        if not gateway_id:
            raise InvalidArgument("must be set", field="gateway_id")
        outbox = self._outboxes.setdefault(gateway_id, _Outbox())
        token = object()
        outbox.owner = token
        outbox.ready.set()  # wakes a previous reader, which sees it was replaced
        self._on_attach(gateway_id)
        last_load = 0.0
        try:
            while True:
                await outbox.ready.wait()
                if outbox.owner is not token:
                    return
                outbox.ready.clear()
                if not outbox.deltas:
                    continue
                deltas, outbox.deltas = outbox.deltas, []
                message = decode_pb2.StepOutput(step=outbox.step)
                add = message.deltas.add
                for request_id, sample_index, token_ids, finish in deltas:
                    entry = add(request_id=request_id, sample_index=sample_index, token_ids=token_ids)
                    if finish:
                        entry.finish_reason = finish
                now = time.monotonic()
                if now - last_load >= LOAD_INTERVAL_S:
                    message.load.CopyFrom(self.load())
                    last_load = now
                yield message
        finally:
            if outbox.owner is token:  # not replaced: the gateway is gone, and so are its requests
                outbox.owner = None
                outbox.deltas.clear()
                for request_id in [rid for rid, held in self._requests.items() if held.gateway_id == gateway_id]:
                    del self._requests[request_id]

    async def Abort(self, request: common_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        held = self._requests.get(request.request_id)
        if held is None:
            return common_pb2.AbortResponse(found=False)
        if request.HasField("sample_index"):
            index = request.sample_index
            if not 0 <= index < len(held.finished) or held.finished[index]:
                return common_pb2.AbortResponse(found=False)
            held.aborted.add(index)
        else:
            held.aborted.update(range(len(held.finished)))
        return common_pb2.AbortResponse(found=True)  # its ABORT comes with the next step

    async def GetLoad(self, request: common_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.GetLoadResponse:
        return common_pb2.GetLoadResponse(load=self.load())


def event(line: str) -> None:
    """One event for the parent (`gateway_load.ChildEvents`)."""
    print(line, flush=True)


async def serve_fake(model_dir: Path, step_s: float, listen: str, seed: int) -> None:
    """Serve until SIGTERM/SIGINT (`cleave.rpc.serve` drains on either)."""
    max_model_len = TextConfig.from_pretrained(model_dir).max_position_embeddings
    worker = FakeDecode(ordinary_token_ids(model_dir), step_s, max_model_len,
                        on_attach=lambda gateway_id: event(f"attached {gateway_id}"), seed=seed)
    name = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
    server = await serve([ServiceRegistration(name, worker, decode_pb2_grpc.add_DecodeServicer_to_server)], listen,
                         RpcConfig(grace_seconds=1.0))
    steps = asyncio.create_task(worker.run_steps(), name="fake-decode-steps")
    await server.set_ready()
    event(f"listening {server.port}")
    try:
        await server.wait()
    finally:
        steps.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SHIPPED_MODEL_DIR, help="the tokenizer's checkpoint directory")
    parser.add_argument("--step-ms", type=float, default=10.0, help="milliseconds between steps")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=None, help="receive SIGTERM when this process dies")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.step_ms <= 0:
        parser.error("--step-ms must be positive")
    follow_parent(args.parent_pid)
    configure_logging(args.log_level, json=False)  # to stderr: stdout carries the events
    asyncio.run(serve_fake(args.model, args.step_ms / 1000, args.listen, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
