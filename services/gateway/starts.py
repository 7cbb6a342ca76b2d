"""Getting a placed request running on its decode worker: the two start paths.

Disaggregated (any n: the prefill worker draws every sample's first token from one prefill,
and the decode worker's samples share the one prompt reservation):
    Decode.Admit (reserve blocks) -> pick prefill (load, prefix affinity) -> Prefill (KV goes
    straight to the reserved blocks) -> Decode.Start(first tokens).
Colocated (and every migrated restart, one per moved sample):
    Decode.Start(prefill_locally): the decode worker prefills the prompt itself.

Both return the prompt tokens a worker's prefix cache already held.
"""

from __future__ import annotations

from cleave.errors import Unavailable
from cleave.proto.cleave.v1 import decode_pb2, prefill_pb2
from cleave.rpc.convert import reasoning_to_proto, sampling_to_proto
from services.gateway.backend import GenerateSpec
from services.gateway.placement import WorkerRequest
from services.gateway.routing import PrefixAffinity, pick_prefill
from services.gateway.worker_rpc import call_worker, time_left
from services.gateway.workers import WorkerPool


async def start_disaggregated(
    pool: WorkerPool,
    affinity: PrefixAffinity,
    spec: GenerateSpec,
    prompt_ids: list[int],
    placed: WorkerRequest,
    *,
    gateway_id: str,
    store_to_kvstore: bool,
) -> int:
    """Admit on the decode worker, prefill on a prefill worker, then Start the decode."""
    sampling = sampling_to_proto(spec.sampling)
    reasoning = reasoning_to_proto(spec.reasoning)
    decode = placed.decode
    request_id = placed.worker_request_id
    prefill = pick_prefill(pool.of_role("prefill"), affinity, prompt_ids)
    if prefill is None:
        raise Unavailable("no prefill worker is in rotation; check the workers' health and retry")
    admitted = await call_worker(
        pool,
        decode.stub.Admit(
            decode_pb2.AdmitRequest(
                request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                gateway_id=gateway_id, prefill_worker_id=prefill.worker_id,
            ),
            timeout=time_left(spec.deadline),
        ),
        decode, "Admit",
    )
    prefill.in_flight_prompt_tokens += len(prompt_ids)
    try:
        result = await call_worker(
            pool,
            prefill.stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                    destination=admitted.handle, store_to_kvstore=store_to_kvstore,
                ),
                timeout=time_left(spec.deadline),
            ),
            prefill, "Prefill",
        )
    finally:
        prefill.in_flight_prompt_tokens -= len(prompt_ids)
    affinity.record(prompt_ids, prefill.address)
    await call_worker(
        pool,
        decode.stub.Start(
            decode_pb2.StartRequest(
                request_id=request_id, first_token_ids=result.first_token_ids,
                first_token_logprobs=result.first_token_logprobs, prompt_token_ids=prompt_ids,
                sampling=sampling, reasoning=reasoning, gateway_id=gateway_id,
            ),
            timeout=time_left(spec.deadline),
        ),
        decode, "Start",
    )
    return result.num_cached_tokens


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
        decode, "Start",
    )
    return started.num_cached_tokens
