"""NCCL transport on one rank: a communicator that sends to itself, grouped as NCCL needs.

CPU: argument checks, a clear error where libnccl cannot load, and the whole NCCL sender /
receiver path (headers on a real socket, `ncclSend` -> `ncclRecv`, scatter) over a fake
libnccl that copies CPU tensors and, like NCCL, refuses a send to oneself outside a group.
GPU (`-m gpu`): the same path on the real libnccl, rank 0 to itself, every byte checked.
"""

from __future__ import annotations

import contextlib
import ctypes
import pytest
import torch

from cleave.errors import FailedPrecondition, InvalidArgument, Unavailable
from cleave.rpc.types import TransportKind
from cleave.transfer import KVReceiver, KVTransferClient
from cleave.transfer.nccl import NcclCommunicator, NcclKVSender, NcclLibrary

L, NB, BS, H, D = 3, 16, 4, 2, 8
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def nccl_loadable() -> bool:
    try:
        NcclLibrary()
    except Unavailable:
        return False
    return True


class FakeNccl:
    """libnccl's point-to-point calls on CPU tensors: operations queue inside a group and
    run at its end; a send to oneself outside a group fails (NCCL would hang there)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._depth = 0
        self._sends: list[torch.Tensor] = []
        self._recvs: list[torch.Tensor] = []

    def send(self, tensor: torch.Tensor, peer: int, comm, stream: int) -> None:
        self.calls.append(("send", peer, tensor.nbytes))
        if self._depth == 0:
            raise AssertionError("a send to oneself outside a group: NCCL would wait forever")
        self._sends.append(tensor)

    def recv(self, tensor: torch.Tensor, peer: int, comm, stream: int) -> None:
        self.calls.append(("recv", peer, tensor.nbytes))
        if self._depth == 0:
            raise AssertionError("a receive from oneself outside a group: NCCL would wait forever")
        self._recvs.append(tensor)

    def group_start(self) -> None:
        self.calls.append(("group_start",))
        self._depth += 1

    def group_end(self) -> None:
        self.calls.append(("group_end",))
        self._depth -= 1
        if self._depth == 0:
            assert len(self._sends) == len(self._recvs), "unmatched self send/receive in a group"
            for sent, received in zip(self._sends, self._recvs):
                received.view(-1).view(torch.uint8).copy_(sent.reshape(-1).view(torch.uint8))
            self._sends.clear()
            self._recvs.clear()

    @contextlib.contextmanager
    def group(self):
        self.group_start()
        try:
            yield
        finally:
            self.group_end()

    def destroy(self, comm) -> None:
        self.calls.append(("destroy",))


class FakeStream:
    """Stands in for the communicator's CUDA stream on CPU (with `torch.cuda.stream` made a
    no-op where CUDA exists, see `no_cuda_streams`)."""

    cuda_stream = 0


def fake_communicator(library: FakeNccl, rank: int = 0, world_size: int = 1) -> NcclCommunicator:
    """A communicator over the fake library (one rank: loopback), on CPU."""
    return NcclCommunicator(library, ctypes.c_void_p(1), rank=rank, world_size=world_size,
                            device=torch.device("cpu"), unique_id=bytes(128), stream=FakeStream())


def source_cache(device: str, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NB, BS, H, D, generator=generator).to(torch.bfloat16).to(device)


def assert_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
    """Every byte of every reserved block equals its source block; other blocks stay zero."""
    dst, src = dst.cpu(), src.cpu()
    for dst_id, src_id in zip(dst_ids, src_ids):
        assert torch.equal(dst[:, :, dst_id].view(torch.uint8), src[:, :, src_id].view(torch.uint8)), (dst_id, src_id)
    others = [block for block in range(dst.shape[2]) if block not in dst_ids]
    assert torch.count_nonzero(dst[:, :, others]) == 0


# -- CPU: arguments and loading ----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(rank=0, world_size=3, device="cuda:0"), InvalidArgument, "2 ranks .* or 1 .*not 3"),
    (dict(rank=1, world_size=1, device="cuda:0"), InvalidArgument, r"rank 1 outside \[0, 1\)"),
    (dict(rank=-1, world_size=2, device="cuda:0"), InvalidArgument, "rank -1 outside"),
    (dict(rank=0, world_size=1, device="cpu"), FailedPrecondition, "NCCL needs a CUDA device, not cpu"),
])
async def test_create_checks_its_arguments_before_loading_nccl(kwargs, error, message):
    with pytest.raises(error, match=message):
        await NcclCommunicator.create(bytes(128), **kwargs)


async def test_create_checks_the_unique_id_length():
    with pytest.raises(InvalidArgument, match="128 bytes, got 5"):
        await NcclCommunicator.create(b"short", rank=0, world_size=1, device="cuda:0")


@pytest.mark.skipif(nccl_loadable(), reason="libnccl loads here (CUDA torch)")
async def test_loopback_without_libnccl_is_unavailable_and_says_what_to_install():
    with pytest.raises(Unavailable, match="cannot load libnccl .*install torch with CUDA or nvidia-nccl"):
        await NcclCommunicator.loopback("cuda:0")


def test_peer_is_the_other_rank_or_itself():
    library = FakeNccl()
    assert fake_communicator(library).peer == 0
    assert [fake_communicator(library, rank, world_size=2).peer for rank in (0, 1)] == [1, 0]


# -- CPU: one rank pairs each send with its receive in one group --------------------------------


def test_loopback_groups_a_held_send_with_its_receive():
    library = FakeNccl()
    comm = fake_communicator(library)
    sent = torch.arange(24, dtype=torch.int16)
    comm.send(sent, peer=0)
    assert library.calls == [] and comm.num_held_sends == 1  # held until its receive
    received = torch.zeros(24, dtype=torch.int16)
    comm.recv(received, peer=0)
    assert library.calls == [("group_start",), ("send", 0, 48), ("recv", 0, 48), ("group_end",)]
    assert torch.equal(received, sent) and comm.num_held_sends == 0


def test_loopback_refuses_a_receive_without_send_a_size_mismatch_and_another_peer():
    comm = fake_communicator(FakeNccl())
    with pytest.raises(FailedPrecondition, match="no send is waiting"):
        comm.recv(torch.zeros(4), peer=0)
    comm.send(torch.zeros(4), peer=0)
    with pytest.raises(InvalidArgument, match="16 bytes, the receive buffer 8"):
        comm.recv(torch.zeros(2), peer=0)
    assert comm.num_held_sends == 1  # a refused receive keeps the send for the right one
    with pytest.raises(InvalidArgument, match=r"peer 1 outside \[0, 1\)"):
        comm.send(torch.zeros(4), peer=1)
    comm.close()
    assert comm.num_held_sends == 0


def test_two_ranks_send_and_receive_without_a_group():
    library = FakeNccl()
    library._depth = 1  # another rank would pair these; here only the calls matter
    comm = fake_communicator(library, rank=0, world_size=2)
    comm.send(torch.zeros(4), peer=1)
    comm.recv(torch.zeros(4), peer=1)
    assert library.calls == [("send", 1, 16), ("recv", 1, 16)]


async def test_nccl_sender_and_receiver_on_cpu_over_the_fake_library(monkeypatch):
    """The NCCL transport's own code (headers on the bulk socket, send after each header,
    receive and scatter per header) between two CPU caches through one rank."""
    # Without CUDA `torch.cuda.stream` ignores the fake stream; on a GPU machine make it so.
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    library = FakeNccl()
    comm = fake_communicator(library)
    receiver = KVReceiver(torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16))
    await receiver.start()
    client = KVTransferClient()
    client.add_nccl_peer(receiver.address, comm)
    try:
        src, src_ids, dst_ids = source_cache("cpu"), [15, 0, 7, 3], [2, 9, 4, 11]
        pending = receiver.expect("fake-nccl", dst_ids, timeout_s=10, transport=TransportKind.NCCL, nccl=comm)
        sender = await client.open(pending.handle)
        assert isinstance(sender, NcclKVSender)
        await sender.send_layer(0, src, src_ids, ready="complete")
        await sender.send_layers(range(1, L), src, src_ids, ready="complete")
        stats = await sender.finish(timeout_s=10)
        assert (await pending.wait()).num_bytes == stats.num_bytes
        assert_blocks(receiver.kv_cache, dst_ids, src, src_ids)
        assert library.calls.count(("group_end",)) == L  # one group per layer's chunk
        assert comm.num_held_sends == 0
    finally:
        await client.close()
        await receiver.close()


# -- GPU: the real libnccl, rank 0 to itself ---------------------------------------------------


async def _loopback_transfer(mode: str) -> None:
    comm = await NcclCommunicator.loopback("cuda:0")
    assert (comm.world_size, comm.rank, comm.peer) == (1, 0, 0)
    receiver = KVReceiver(torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda:0"))
    await receiver.start()
    client = KVTransferClient()
    client.add_nccl_peer(receiver.address, comm)
    try:
        src_ids, dst_ids = [15, 0, 7, 3, 12], [2, 9, 4, 11, 0]
        pending = receiver.expect(f"loopback-{mode}", dst_ids, timeout_s=60, transport=TransportKind.NCCL, nccl=comm)
        sender = await client.open(pending.handle)
        assert isinstance(sender, NcclKVSender)
        if mode == "per_layer":  # as a prefill forward hands each layer over
            src = source_cache("cuda:0")
            for layer in range(L):
                await sender.send_layer(layer, src, src_ids)
        else:  # the KV is written on another stream after a device-side delay
            values = source_cache("cuda:0")
            src = torch.zeros_like(values)
            producer = torch.cuda.Stream("cuda:0")
            with torch.cuda.stream(producer):
                torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the KV exists
                src.copy_(values)
                written = torch.cuda.Event()
                written.record(producer)
            await sender.send_layers(range(L), src, src_ids, ready=written)
        await sender.finish(timeout_s=60)
        await pending.wait()
        await sender.close()
        torch.cuda.synchronize()
        assert_blocks(receiver.kv_cache, dst_ids, src, src_ids)
        assert comm.num_held_sends == 0
    finally:
        await client.close()
        await receiver.close()
        comm.close()


@pytest.mark.gpu
@needs_cuda
async def test_nccl_loopback_sends_each_layer_to_itself():
    await _loopback_transfer("per_layer")


@pytest.mark.gpu
@needs_cuda
async def test_nccl_loopback_run_waits_for_the_producer_event():
    # Sent before the producer wrote, the receiver would hold zeros and the check fail.
    await _loopback_transfer("late_producer")
