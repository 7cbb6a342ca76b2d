"""The internal token over real grpc.aio servers (`cleave.rpc.auth`): prefill, decode and
kvstore refuse calls without it or with another one as UNAUTHENTICATED, answer health
probes without it, and serve callers that send it."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import decode_pb2_grpc, kvstore_pb2_grpc, prefill_pb2_grpc
from cleave.proto.cleave.v1 import kvstore_pb2 as k
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc import aio_channel
from cleave.rpc.auth import INTERNAL_TOKEN_KEY
from cleave.transfer.kvstore_client import KVStoreClient
from cleave.rpc.prefill_call import prefill_response
from tests.services.kvstore.test_store import LAYOUT, chain
from tests.worker.cluster import (
    GATEWAY,
    INTERNAL_TOKEN,
    AttachReader,
    greedy,
    start_decode,
    start_kvstore,
    start_prefill,
)
from tests.worker.test_disaggregated import MAX_TOKENS, disaggregated


@pytest.fixture
async def cluster(checkpoint):
    """Decode, prefill and kvstore asking for INTERNAL_TOKEN; the prefill worker sends it to
    the kvstore and the decode worker."""
    kvstore = await start_kvstore()
    decode = await start_decode(checkpoint)
    prefill = await start_prefill(checkpoint, kvstore=kvstore.server.address)
    yield {"decode": decode, "prefill": prefill, "kvstore": kvstore}
    for running in (prefill, decode, kvstore):
        await running.close()


def _forged_calls(decode, prefill, kvstore):  # type: ignore[no-untyped-def]
    """Each call an outsider could use to read or change another request's data."""
    return {
        "Decode.Attach": lambda: _drain(decode.Attach(d.AttachRequest(gateway_id=GATEWAY))),
        "Decode.Admit": lambda: decode.Admit(d.AdmitRequest(
            request_id="forged", prompt_token_ids=[5, 6, 7], sampling=greedy(4), gateway_id=GATEWAY)),
        "Decode.Start": lambda: decode.Start(d.StartRequest(request_id="forged", gateway_id=GATEWAY,
                                                            prefill_locally=True)),
        "Decode.Handshake": lambda: decode.Handshake(d.HandshakeRequest()),
        "Prefill.Prefill": lambda: prefill_response(prefill.Prefill(p.PrefillRequest(
            request_id="forged", prompt_token_ids=[5, 6, 7], sampling=greedy(4)))),
        "KVStore.Lookup": lambda: kvstore.Lookup(k.LookupRequest(layout_id="x", block_hashes=[b"h"])),
        # no message written: the refusal comes at the headers, and a write racing it would
        # end the call as INTERNAL on the client (grpc's aio writer), not with the status
        "KVStore.Put": lambda: kvstore.Put(timeout=30),
        "KVStore.Get": lambda: _drain(kvstore.Get(k.GetRequest(layout_id="x", block_hashes=[b"h"]))),
        # which prompt blocks are stored says which prompts were seen
        "KVStore.Watch": lambda: _drain(kvstore.Watch(k.WatchRequest(layout_id="x"))),
    }


async def _drain(call) -> None:  # type: ignore[no-untyped-def]
    async for _ in call:
        pass


@pytest.mark.parametrize("token", [None, "not-the-token"], ids=["no-token", "wrong-token"])
async def test_calls_without_the_token_are_unauthenticated(cluster, token):
    channels = {name: aio_channel(running.server.address, internal_token=token) for name, running in cluster.items()}
    try:
        calls = _forged_calls(decode_pb2_grpc.DecodeStub(channels["decode"]),
                              prefill_pb2_grpc.PrefillStub(channels["prefill"]),
                              kvstore_pb2_grpc.KVStoreStub(channels["kvstore"]))
        for name, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call()
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            expected = "needs the internal token" if token is None else "the internal token in"
            assert expected in raised.value.details() and "CLEAVE_INTERNAL_TOKEN" in raised.value.details(), name
        # nothing was admitted: the decode pool is untouched
        load = (await cluster["decode"].stub.GetLoad(c.GetLoadRequest())).load
        assert (load.num_running, load.num_waiting, load.num_free_blocks) == (0, 0, load.num_total_blocks)
    finally:
        for channel in channels.values():
            await channel.close()


async def test_health_stays_open_without_the_token(cluster):
    for running in cluster.values():
        async with aio_channel(running.server.address) as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_refused_attach_leaves_the_gateways_stream_to_the_gateway(cluster):
    decode, prefill = cluster["decode"], cluster["prefill"]
    reader = AttachReader(decode.stub)  # the gateway's, with the token
    async with aio_channel(decode.server.address, internal_token="guess") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _drain(decode_pb2_grpc.DecodeStub(channel).Attach(d.AttachRequest(gateway_id=GATEWAY)))
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    try:
        # Admit, Prefill (which calls Start on the decode worker and Put on the kvstore, with
        # the token), Start: the whole disaggregated path runs with the token
        await disaggregated(decode, prefill, "r-1", list(range(5, 25)), store=True)
        await reader.wait_finished(["r-1"])
        assert len(reader.tokens("r-1")) == MAX_TOKENS
    finally:
        await reader.cancel()


async def test_kvstore_serves_a_client_that_sends_the_token():
    kvstore = await start_kvstore()  # its own store: the cluster's holds the tiny model's layout
    address = kvstore.server.address
    hashes, blocks = chain(2)
    try:
        async with KVStoreClient(address, client_id="test", internal_token=INTERNAL_TOKEN) as client:
            await client.connect(LAYOUT)
            assert (await client.put(hashes, blocks)).num_stored == 2
            assert await client.lookup(hashes) == 2
        async with KVStoreClient(address, client_id="outsider", internal_token="guess") as outsider:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await outsider.connect(LAYOUT)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await kvstore.close()


def test_the_token_travels_in_its_own_metadata_key():
    assert INTERNAL_TOKEN_KEY == "x-cleave-internal-token"
