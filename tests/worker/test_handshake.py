"""The prefill side of the transport handshake: what two endpoints negotiate, one Handshake
per pair, NCCL peers registered, failures left on TCP and retried later."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cleave.errors import Unavailable
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.rpc.convert import kv_layout_to_proto, transport_from_proto, transport_to_proto
from cleave.rpc.types import KVLayout, TransferHandle, TransportKind
from cleave.transfer import EndpointInfo, KVTransferClient, choose_transport, peer_endpoint
from cleave.worker import TransportNegotiator

ALL = frozenset(TransportKind)
LAYOUT = KVLayout(model_id="m", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
GPU_A = EndpointInfo(host="node-1", device_kind="cuda", device_index=0, gpu_uuid="GPU-a", transports=ALL)
GPU_B = EndpointInfo(host="node-1", device_kind="cuda", device_index=1, gpu_uuid="GPU-b", transports=ALL)
GPU_A_NO_NCCL = EndpointInfo(host="node-1", device_kind="cuda", device_index=0, gpu_uuid="GPU-a",
                             transports=frozenset({TransportKind.TCP, TransportKind.CUDA_IPC}))
CPU = EndpointInfo(host="node-1", device_kind="cpu")


class FakeDecodeWorkers:
    """Decode workers' Handshake as the decode backend answers it, from fake endpoints."""

    def __init__(self, endpoints: dict[str, EndpointInfo], layout: KVLayout = LAYOUT) -> None:
        self.endpoints = endpoints
        self.layout = layout
        self.requests: list[tuple[str, d.HandshakeRequest]] = []
        self.fail_next = 0

    async def __call__(self, address: str, request: d.HandshakeRequest) -> d.HandshakeResponse:
        self.requests.append((address, request))
        await asyncio.sleep(0.01)  # concurrent first transfers overlap the call
        if self.fail_next:
            self.fail_next -= 1
            raise Unavailable(f"decode worker at {address} is not reachable")
        local = self.endpoints[address]
        offered = [transport_from_proto(kind, "t") for kind in request.supported_transports]
        transport = choose_transport(peer_endpoint(request.host, request.gpu_uuids, offered, local), local)
        return d.HandshakeResponse(transport=transport_to_proto(transport), rank=1, world_size=2,
                                   tcp_address=f"bulk-of-{address}", layout=kv_layout_to_proto(self.layout),
                                   worker_id=f"id-of-{address}")


class FakeRendezvous:
    """Rank 0 of an NCCL pair without NCCL: hands out ids, 'connects' to a marker object."""

    def __init__(self) -> None:
        self.ids: list[bytes] = []
        self.connected: list[bytes] = []

    def unique_id(self) -> bytes:
        self.ids.append(bytes([len(self.ids)]) * 128)
        return self.ids[-1]

    async def connect(self, unique_id: bytes):
        self.connected.append(unique_id)
        return FakeCommunicator(unique_id)


class FakeCommunicator:
    def __init__(self, unique_id: bytes) -> None:
        self.unique_id = unique_id
        self.closed = False

    def close(self) -> None:
        self.closed = True


def handle(address: str, transport: TransportKind = TransportKind.TCP) -> TransferHandle:
    return TransferHandle(transport=transport, address=f"bulk-of-{address}", transfer_id="t", block_ids=(1,),
                          worker_id=f"id-of-{address}", control_address=address)


def negotiator(endpoint: EndpointInfo, call, rendezvous: FakeRendezvous | None = None, **kwargs) -> TransportNegotiator:
    if rendezvous is None and TransportKind.NCCL in endpoint.transports:
        rendezvous = FakeRendezvous()
    return TransportNegotiator("prefill-7", endpoint, LAYOUT, KVTransferClient(), nccl=rendezvous, call=call, **kwargs)


@pytest.mark.parametrize(("prefill", "decode", "expected"), [
    (GPU_A, GPU_A, TransportKind.CUDA_IPC),  # one GPU: IPC, never NCCL
    (GPU_A, GPU_B, TransportKind.NCCL),
    (GPU_A_NO_NCCL, GPU_B, TransportKind.TCP),
    (GPU_A, EndpointInfo(host="node-2", device_kind="cuda", gpu_uuid="GPU-a", transports=ALL), TransportKind.NCCL),
    (CPU, GPU_A, TransportKind.TCP),
    (GPU_A, CPU, TransportKind.TCP),
    (CPU, CPU, TransportKind.TCP),
])
async def test_negotiated_transport(prefill, decode, expected):
    workers = FakeDecodeWorkers({"decode:1": decode})
    links = negotiator(prefill, workers)
    link = await links.prepare(handle("decode:1"))
    assert (link.transport, link.worker_id, link.bulk_address) == (expected, "id-of-decode:1", "bulk-of-decode:1")
    [(address, request)] = workers.requests
    assert address == "decode:1" and request.peer_id == "prefill-7" and request.host == "node-1"
    assert list(request.gpu_uuids) == ([prefill.gpu_uuid] if prefill.has_gpu else [])
    proposed = [transport_from_proto(kind, "t") for kind in request.supported_transports]
    assert proposed == [k for k in (TransportKind.CUDA_IPC, TransportKind.NCCL, TransportKind.TCP)
                        if k in prefill.transports]
    assert len(request.nccl_unique_id) == (128 if TransportKind.NCCL in prefill.transports else 0)
    assert request.layout == kv_layout_to_proto(LAYOUT)


async def test_one_handshake_per_pair_shared_by_concurrent_transfers():
    workers = FakeDecodeWorkers({"decode:1": GPU_A, "decode:2": GPU_A})
    links = negotiator(GPU_A, workers)
    first = await asyncio.gather(*(links.prepare(handle("decode:1", TransportKind.TCP)) for _ in range(5)))
    later = [await links.prepare(handle("decode:1", TransportKind.CUDA_IPC)) for _ in range(3)]
    assert {link.transport for link in first + later} == {TransportKind.CUDA_IPC}
    assert len(workers.requests) == links.num_handshakes == 1
    await links.prepare(handle("decode:2"))
    assert [address for address, _ in workers.requests] == ["decode:1", "decode:2"]
    assert links.link(handle("decode:2")).transport is TransportKind.CUDA_IPC
    assert links.link(handle("decode:3")) is None


async def test_nccl_link_registers_rank0_communicator_under_the_bulk_address():
    workers, rendezvous = FakeDecodeWorkers({"decode:1": GPU_B}), FakeRendezvous()
    links = negotiator(GPU_A, workers, rendezvous)
    await asyncio.gather(links.prepare(handle("decode:1")), links.prepare(handle("decode:1")))
    [(_, request)] = workers.requests
    assert rendezvous.connected == rendezvous.ids == [request.nccl_unique_id]
    communicator = links.transfers.nccl_peer("bulk-of-decode:1")
    assert communicator.unique_id == request.nccl_unique_id
    await links.close()
    assert communicator.closed


async def test_no_control_address_means_no_handshake():
    workers = FakeDecodeWorkers({})
    links = negotiator(GPU_A, workers)
    bare = TransferHandle(transport=TransportKind.TCP, address="bulk:1", transfer_id="t", block_ids=(1,))
    assert await links.prepare(bare) is None and workers.requests == []


async def test_failed_handshake_stays_on_handles_and_retries_after_a_while():
    workers = FakeDecodeWorkers({"decode:1": GPU_A})
    workers.fail_next = 1
    links = negotiator(GPU_A, workers, retry_after_s=3600.0)
    assert await links.prepare(handle("decode:1")) is None
    assert await links.prepare(handle("decode:1")) is None  # not yet: no second call
    assert len(workers.requests) == 1
    links.retry_after_s = 0.0
    link = await links.prepare(handle("decode:1"))
    assert link.transport is TransportKind.CUDA_IPC and len(workers.requests) == 2


@pytest.mark.parametrize("answer", ["other_layout", "not_offered", "grpc_error"])
async def test_refused_answers_leave_the_pair_on_tcp(answer):
    workers = FakeDecodeWorkers({"decode:1": GPU_B}, layout=KVLayout(**{**LAYOUT.__dict__, "head_dim": 16}))

    async def not_offered(address, request):
        return d.HandshakeResponse(transport=c.TRANSPORT_KIND_NCCL, tcp_address="bulk", worker_id="x")

    async def grpc_error(address, request):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "Handshake is not wired")

    if answer == "other_layout":
        links = negotiator(GPU_A, workers)
    else:
        links = negotiator(GPU_A_NO_NCCL, not_offered if answer == "not_offered" else grpc_error)
    assert await links.prepare(handle("decode:1")) is None
    assert links.link(handle("decode:1")) is None
