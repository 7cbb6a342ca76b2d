"""Getting a placed request running on its decode worker: the two start paths.

Disaggregated (any n: the prefill worker draws every sample's first token from one prefill,
and the decode worker's samples share the one prompt reservation): one call,
    Prefill(decode = the placed worker) on a prefill worker picked by load and prefix
    affinity. The prefill worker admits the request on the decode worker while the prompt
    runs, ships its KV there and starts the decode. Its stream's first message carries the
    first tokens as soon as they are sampled, before the KV is sent; they go to the client at
    once (`deliver_first_tokens`), ahead of anything the decode worker's stream brings for
    the request. The rest of the stream (the KV delivered, the decode started) is read in
    the background (`follow_handoff`): should it fail, the decode never started and the
    request moves like one whose decode worker was lost (a `WorkerLost` in its queue),
    resuming from the prompt and the tokens already streamed.
Colocated (and every migrated restart, one per moved sample):
    Decode.Start(prefill_locally): the decode worker prefills the prompt itself.

Both return the prompt tokens a worker's prefix cache already held. A Prefill that fails on
the prefill worker itself (not on the decode worker behind it) before its first tokens, or
whose prefill worker the pool declares lost while it waits, raises `PrefillFailed`, naming
that worker, so the caller can retry elsewhere (`RoutingBackend._start`); one whose decode
worker fails it or is declared lost raises Unavailable with field "decode", and the caller
moves the request to another decode worker (`RoutingBackend._start_anywhere`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from cleave.errors import CleaveError, Unavailable
from cleave.proto.cleave.v1 import decode_pb2, prefill_pb2
from cleave.rpc.convert import reasoning_to_proto, sampling_to_proto
from services.gateway.attach import WorkerLost
from services.gateway.backend import GenerateSpec
from services.gateway.delta_queue import DeltaQueue
from services.gateway.placement import WorkerRequest
from services.gateway.routing import PrefixAffinity, pick_prefill
from services.gateway.worker_rpc import call_worker, time_left
from services.gateway.workers import WorkerHandle, WorkerPool


class PrefillFailed(Unavailable):
    """The prefill worker failed the call (it died, stopped or refused while draining); the
    decode worker behind it was not the problem.

    Attributes:
        worker: the prefill worker that failed.
    """

    def __init__(self, message: str, worker: WorkerHandle) -> None:
        super().__init__(message)
        self.worker = worker


async def start_disaggregated(
    pool: WorkerPool,
    affinity: PrefixAffinity,
    spec: GenerateSpec,
    prompt_ids: list[int],
    placed: WorkerRequest,
    queue: DeltaQueue,
    *,
    gateway_id: str,
    store_to_kvstore: bool,
    hashes: Sequence[bytes],
    avoid: Sequence[WorkerHandle] = (),
) -> int:
    """Prefill on a prefill worker (not one of `avoid`) that admits, fills and starts the
    placed decode worker; returns once the first tokens are in the request's queue (first),
    with the rest of the handoff followed by `placed.handoff` (`hashes`: the prompt's
    `affinity.hashes`)."""
    decode = placed.decode
    request_id = placed.worker_request_id
    prefill = pick_prefill([w for w in pool.of_role("prefill") if w not in avoid], affinity, prompt_ids, hashes)
    if prefill is None:
        raise Unavailable("no prefill worker is in rotation; check the workers' health and retry")
    request = prefill_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(spec.sampling),
        store_to_kvstore=store_to_kvstore,
        decode=prefill_pb2.DecodeTarget(
            address=decode.address, gateway_id=gateway_id, reasoning=reasoning_to_proto(spec.reasoning)),
    )
    call = prefill.stub.Prefill(request, timeout=time_left(spec.deadline))
    prefill.in_flight_prompt_tokens += len(prompt_ids)
    try:
        first = await call_worker(pool, call.read(), prefill, "Prefill", deadline=spec.deadline, behind=decode)
        if first is grpc.aio.EOF:
            raise Unavailable(f"Prefill on prefill worker {prefill.address} ended without first tokens")
    except BaseException as error:
        call.cancel()  # the worker aborts the request and releases its reservation
        if isinstance(error, Unavailable) and error.field != "decode":
            raise PrefillFailed(error.message, prefill) from None
        raise
    finally:
        prefill.in_flight_prompt_tokens -= len(prompt_ids)
    affinity.record(prompt_ids, prefill.address, hashes)
    deliver_first_tokens(queue, request_id, first)
    handoff = asyncio.ensure_future(follow_handoff(pool, call, prefill, decode, queue, request_id,
                                                   deadline=spec.deadline))
    # however the handoff ends, its call ends with it (a no-op once the stream ended), also
    # when it was cancelled before its first step and never ran: that call, unread, would
    # stay open for the gateway's lifetime
    handoff.add_done_callback(lambda _: call.cancel())
    placed.handoff = handoff
    return first.num_cached_tokens


async def follow_handoff(
    pool: WorkerPool, call: grpc.aio.UnaryStreamCall, prefill: WorkerHandle, decode: WorkerHandle,
    queue: DeltaQueue, worker_request_id: str, *, deadline: float | None,
) -> bool:
    """Read a Prefill stream past its first tokens; True once the KV was delivered and the
    decode started. A failure there means the decode never started: the request's queue
    gets a `WorkerLost` (False), and its samples move on, resumed from what the client
    already has. However it ends (cancelled too: the request ended or moved), the call is
    cancelled as its task ends (`start_disaggregated`): the prefill worker aborts the request
    and the decode worker's reservation; when its worker was lost, the worker aborts it if it
    wakes."""
    try:
        while await call_worker(pool, call.read(), prefill, "Prefill", deadline=deadline,
                                behind=decode) is not grpc.aio.EOF:
            pass  # the transfer's statistics
    except CleaveError as error:
        queue.put_nowait(WorkerLost(f"the KV handoff from prefill worker {prefill.address} failed after the "
                                    f"first tokens ({error.message})", worker_request_id))
        return False
    return True


def deliver_first_tokens(queue: DeltaQueue, worker_request_id: str, result: prefill_pb2.PrefillResponse) -> None:
    """Put each sample's first token (a RequestDelta, as the decode stream's) at the head of
    the request's queue: the decode worker's stream may already have brought the tokens
    after it. Nothing consumes the queue until the start returns, and no await separates
    the drain from the refill."""
    waiting = []
    while not queue.empty():
        waiting.append(queue.get_nowait())
    logprobs = list(result.first_token_logprobs)
    for index, token in enumerate(result.first_token_ids):
        delta = decode_pb2.RequestDelta(request_id=worker_request_id, sample_index=index, token_ids=[token])
        if len(logprobs) == len(result.first_token_ids):
            delta.logprobs.append(logprobs[index])
        if index == 0:  # the prompt's scores travel once, with the first sample's first token
            delta.prompt_logprobs.extend(result.prompt_logprobs)
        queue.put_nowait(delta)
    for item in waiting:
        queue.put_nowait(item)


async def start_colocated(
    pool: WorkerPool, spec: GenerateSpec, prompt_ids: list[int], placed: WorkerRequest, *, gateway_id: str
) -> int:
    """Start(prefill_locally): the decode worker prefills the prompt itself."""
    decode = placed.decode
    started = await call_worker(
        pool,
        decode.stub.Start(
            decode_pb2.StartRequest(
                request_id=placed.worker_request_id, prefill_locally=True, prompt_token_ids=prompt_ids,
                sampling=sampling_to_proto(spec.sampling), reasoning=reasoning_to_proto(spec.reasoning),
                gateway_id=gateway_id,
            ),
            timeout=time_left(spec.deadline),
        ),
        decode, "Start", deadline=spec.deadline,
    )
    return started.num_cached_tokens
