"""TCP transport over real loopback sockets: exact bytes land in the reserved blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import struct

import pytest
import torch

from cleave.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.types import KVLayout
from cleave.transfer import KVReceiver, KVTransferClient
from cleave.transfer import framing
from cleave.transfer.tensors import as_bytes

L, BS, H, D = 3, 4, 2, 8


def cache(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, num_blocks, BS, H, D, generator=generator).to(dtype)


@pytest.fixture
async def receiver():
    receiver = KVReceiver(torch.zeros(L, 2, 16, BS, H, D, dtype=torch.bfloat16))
    await receiver.start()
    yield receiver
    await receiver.close()


@pytest.fixture
async def client():
    client = KVTransferClient()
    yield client
    await client.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
async def test_send_all_scatters_exact_bytes(dtype, client):
    receiver = KVReceiver(torch.zeros(L, 2, 16, BS, H, D, dtype=dtype))
    await receiver.start()
    src = cache(10, dtype, seed=1)
    src_ids, dst_ids = [7, 2, 9, 0], [3, 11, 5, 14]
    pending = receiver.expect("t1", dst_ids, timeout_s=10)
    sender = await client.open(pending.handle)
    stats = await sender.send_all(src, src_ids)
    received = await pending.wait()
    dst = receiver.kv_cache
    # bitwise equal, compared as bytes so NaN/rounding cannot hide a difference
    assert torch.equal(dst[:, :, dst_ids].view(torch.uint8), src[:, :, src_ids].view(torch.uint8))
    untouched = [b for b in range(16) if b not in dst_ids]
    assert torch.count_nonzero(dst[:, :, untouched].view(torch.uint8)) == 0
    expected_bytes = L * 2 * len(src_ids) * BS * H * D * src.element_size()
    assert (stats.num_bytes, received.num_bytes, received.num_blocks) == (expected_bytes, expected_bytes, 4)
    await receiver.close()


async def test_layer_by_layer_with_cached_prefix(receiver, client):
    src = cache(8, torch.bfloat16, seed=2)
    pending = receiver.expect("t2", [1, 4, 6, 8, 10], num_cached_blocks=2, timeout_s=10)
    sender = await client.open(pending.handle)
    for layer in (2, 0, 1):  # any order; the receiver completes when all layers are in
        assert not pending.done
        await sender.send_layer(layer, src, [0, 1, 5, 3, 7])
        await asyncio.sleep(0)
    await sender.finish(timeout_s=5)
    stats = await pending.wait()
    dst = receiver.kv_cache
    assert torch.equal(dst[:, :, [6, 8, 10]], src[:, :, [5, 3, 7]])
    assert torch.count_nonzero(dst[:, :, [1, 4]]) == 0  # cached blocks receive nothing
    assert stats.num_blocks == 3


async def test_concurrent_transfers(receiver, client):
    sources = [cache(6, torch.bfloat16, seed=10 + i) for i in range(4)]
    pendings = [receiver.expect(f"c{i}", [4 * i, 4 * i + 1, 4 * i + 3], timeout_s=10) for i in range(4)]
    senders = [await client.open(p.handle) for p in pendings]
    await asyncio.gather(*(s.send_all(src, [5, 0, 2]) for s, src in zip(senders, sources)))
    await asyncio.gather(*(p.wait() for p in pendings))
    for i, src in enumerate(sources):
        assert torch.equal(receiver.kv_cache[:, :, [4 * i, 4 * i + 1, 4 * i + 3]], src[:, :, [5, 0, 2]])


async def test_timeout_raises_and_late_chunks_are_refused(receiver, client):
    src = cache(4, torch.bfloat16, seed=3)
    pending = receiver.expect("slow", [2, 3], timeout_s=0.2)
    sender = await client.open(pending.handle)
    await sender.send_layer(0, src, [0, 1])  # never sends layers 1 and 2
    with pytest.raises(DeadlineExceeded, match="2 of 3 layers missing"):
        await pending.wait()
    with pytest.raises(DeadlineExceeded):  # the sender hears the verdict too
        await sender.send_layer(1, src, [0, 1])
    # a fresh sender for the expired id is told it is unknown
    late_client = KVTransferClient()
    late = await late_client.open(dataclasses.replace(pending.handle, deadline_unix_s=None))
    await late.send_layer(0, src, [0, 1])
    await late.send_layer(1, src, [0, 1])
    await late.send_layer(2, src, [0, 1])
    with pytest.raises(NotFound, match="unknown transfer id 'slow'"):
        await late.finish(timeout_s=5)
    await late_client.close()
    # the connection still serves other transfers
    ok = receiver.expect("after", [5], timeout_s=10)
    await (await client.open(ok.handle)).send_all(src, [3])
    await ok.wait()


async def test_mismatched_layout_is_refused_by_receiver(receiver, client):
    pending = receiver.expect("wrong", [0, 1], timeout_s=10)
    sender = await client.open(pending.handle)
    with pytest.raises(InvalidArgument, match="dtype DTYPE_FLOAT32 differs"):
        await sender.send_all(cache(4, torch.float32, seed=4), [0, 1], timeout_s=5)
    with pytest.raises(InvalidArgument):
        await pending.wait()
    narrow = torch.zeros(L, 2, 4, BS, H, D // 2, dtype=torch.bfloat16)
    pending = receiver.expect("narrow", [0, 1], timeout_s=10)
    with pytest.raises(InvalidArgument, match="shape"):
        await (await client.open(pending.handle)).send_all(narrow, [0, 1], timeout_s=5)


async def test_sender_refuses_handle_layout_mismatch(client):
    layout = KVLayout("m", "bfloat16", BS, L, H, D)
    receiver = KVReceiver(torch.zeros(L, 2, 4, BS, H, D, dtype=torch.bfloat16), layout=layout)
    await receiver.start()
    pending = receiver.expect("t", [0], timeout_s=10)
    sender = await client.open(pending.handle)
    wrong = torch.zeros(L, 2, 4, BS, H + 1, D, dtype=torch.bfloat16)
    with pytest.raises(FailedPrecondition, match="num_kv_heads"):
        await sender.send_layer(0, wrong, [0])
    await receiver.close()


async def test_a_bf16_decode_cache_refuses_fp8_kv_from_a_prefill_worker(client):
    # a decode worker on the model's dtype, a prefill worker with --kv-cache-dtype fp8
    receiver = KVReceiver(torch.zeros(L, 2, 4, BS, H, D, dtype=torch.bfloat16),
                          layout=KVLayout("m", "bfloat16", BS, L, H, D))
    await receiver.start()
    pending = receiver.expect("t", [0], timeout_s=10)
    sender = await client.open(pending.handle)
    refusal = r"differ in dtype: 'bfloat16' here, 'float8_e4m3fn' offered.*the same --dtype and --kv-cache-dtype"
    with pytest.raises(FailedPrecondition, match=refusal):
        await sender.send_layer(0, cache(4, torch.float8_e4m3fn, seed=5), [0])
    assert torch.count_nonzero(receiver.kv_cache) == 0  # nothing was reinterpreted
    await receiver.close()


async def _raw_exchange(address: str, frames: list[bytes]) -> common_pb2.ErrorDetail:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    for frame in frames:
        writer.write(frame)
    await writer.drain()
    reply = await asyncio.wait_for(framing.read_reply(reader), 5)
    writer.close()
    return reply


async def test_corrupt_and_unknown_headers_rejected(receiver):
    garbage = struct.pack(">I", 6) + b"\xff\xff\xff\xff\xff\xff"
    reply = await _raw_exchange(receiver.address, [garbage])
    assert reply.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT and "corrupt KVChunkHeader" in reply.message
    oversized = struct.pack(">I", framing.MAX_FRAME_BYTES + 1)
    reply = await _raw_exchange(receiver.address, [oversized])
    assert "exceeds" in reply.message
    header = common_pb2.KVChunkHeader(transfer_id="nope", layer_index=0, block_ids=[0], byte_length=3)
    reply = await _raw_exchange(receiver.address, [framing.encode_frame(header) + b"abc"])
    assert (reply.code, reply.request_id) == (common_pb2.ERROR_CODE_NOT_FOUND, "nope")


async def test_wrong_block_ids_and_duplicate_layer_fail_the_transfer(receiver):
    pending = receiver.expect("ids", [1, 2], timeout_s=10)
    shape = [2, 2, BS, H, D]
    nbytes = 2 * 2 * BS * H * D * 2
    header = common_pb2.KVChunkHeader(transfer_id="ids", layer_index=0, block_ids=[2, 1],
                                      dtype=common_pb2.DTYPE_BFLOAT16, shape=shape, byte_length=nbytes)
    reply = await _raw_exchange(receiver.address, [framing.encode_frame(header) + bytes(nbytes)])
    assert "block ids differ" in reply.message
    with pytest.raises(InvalidArgument, match="block_ids"):
        await pending.wait()
    pending = receiver.expect("dup", [1, 2], timeout_s=10)
    header = common_pb2.KVChunkHeader(transfer_id="dup", layer_index=1, block_ids=[1, 2],
                                      dtype=common_pb2.DTYPE_BFLOAT16, shape=shape, byte_length=nbytes)
    frame = framing.encode_frame(header) + bytes(nbytes)
    reply = await _raw_exchange(receiver.address, [frame, frame])
    assert "layer 1 arrived twice" in reply.message


async def test_block_ids_are_required_on_the_first_chunk_only(receiver):
    shape = [2, 2, BS, H, D]
    nbytes = 2 * 2 * BS * H * D * 2

    def chunk(transfer_id, layer, block_ids, is_last=False):
        header = common_pb2.KVChunkHeader(transfer_id=transfer_id, layer_index=layer, block_ids=block_ids,
                                          dtype=common_pb2.DTYPE_BFLOAT16, shape=shape, byte_length=nbytes,
                                          is_last=is_last)
        return framing.encode_frame(header) + bytes(nbytes)

    pending = receiver.expect("once", [1, 2], timeout_s=10)
    frames = [chunk("once", 0, [1, 2])] + [chunk("once", layer, [], layer == L - 1) for layer in range(1, L)]
    reply = await _raw_exchange(receiver.address, frames)
    assert reply.code == common_pb2.ERROR_CODE_UNSPECIFIED, reply.message
    assert (await pending.wait()).num_blocks == 2
    pending = receiver.expect("none", [1, 2], timeout_s=10)
    reply = await _raw_exchange(receiver.address, [chunk("none", 0, [])])
    assert "block ids differ" in reply.message
    with pytest.raises(InvalidArgument, match="block_ids"):
        await pending.wait()


async def test_receiver_closes_while_a_sender_keeps_its_connection(client):
    receiver = KVReceiver(torch.zeros(L, 2, 4, BS, H, D))
    await receiver.start()
    pending = receiver.expect("live", [0], timeout_s=10)
    await (await client.open(pending.handle)).send_all(cache(2, torch.float32, seed=5), [1])
    await pending.wait()
    # the sender's connection stays open (it is reused for later transfers)
    await asyncio.wait_for(receiver.close(), 5)


def test_expect_validates_block_ids():
    async def run():
        receiver = KVReceiver(torch.zeros(L, 2, 4, BS, H, D))
        await receiver.start()
        try:
            with pytest.raises(InvalidArgument, match="block id 4 outside"):
                receiver.expect("x", [0, 4])
            receiver.expect("x", [0])
            with pytest.raises(InvalidArgument, match="already registered"):
                receiver.expect("x", [1])
        finally:
            await receiver.close()

    asyncio.run(run())


async def test_one_chunk_may_carry_a_run_of_layers(receiver):
    src = cache(6, torch.bfloat16, seed=3)
    src_ids, dst_ids = [4, 1], [9, 2]
    pending = receiver.expect("run", dst_ids, timeout_s=10)
    payload = src[:, :, src_ids].contiguous()  # [L, 2, n, BS, H, D]: every layer in one chunk
    header = common_pb2.KVChunkHeader(
        transfer_id="run", layer_index=0, num_layers=L, block_ids=dst_ids, dtype=common_pb2.DTYPE_BFLOAT16,
        shape=list(payload.shape), byte_length=payload.numel() * 2, is_last=True)
    reply = await _raw_exchange(receiver.address, [framing.encode_frame(header) + bytes(as_bytes(payload))])
    assert reply.code == common_pb2.ERROR_CODE_UNSPECIFIED, reply.message
    stats = await pending.wait()
    dst = receiver.kv_cache
    assert torch.equal(dst[:, :, dst_ids].view(torch.int16), src[:, :, src_ids].view(torch.int16))
    assert stats.num_bytes == payload.numel() * 2


async def test_a_run_overlapping_sent_layers_fails_the_transfer(receiver):
    pending = receiver.expect("overlap", [1], timeout_s=10)
    one = common_pb2.KVChunkHeader(transfer_id="overlap", layer_index=1, block_ids=[1], dtype=common_pb2.DTYPE_BFLOAT16,
                                   shape=[2, 1, BS, H, D], byte_length=2 * BS * H * D * 2)
    run = common_pb2.KVChunkHeader(transfer_id="overlap", layer_index=0, num_layers=2, block_ids=[1],
                                   dtype=common_pb2.DTYPE_BFLOAT16, shape=[2, 2, 1, BS, H, D],
                                   byte_length=2 * 2 * BS * H * D * 2)
    reply = await _raw_exchange(receiver.address, [
        framing.encode_frame(one) + bytes(one.byte_length), framing.encode_frame(run) + bytes(run.byte_length)])
    assert "layer 1 arrived twice" in reply.message
    with pytest.raises(InvalidArgument, match="arrived twice"):
        await pending.wait()


async def test_send_layers_sends_a_run_and_refuses_it_twice(receiver, client):
    src = cache(6, torch.bfloat16, seed=4)
    pending = receiver.expect("layers", [0, 5, 3], timeout_s=10)
    sender = await client.open(pending.handle)
    await sender.send_layers(range(0, 2), src, [2, 3, 4])
    with pytest.raises(InvalidArgument, match="layer 1"):
        await sender.send_layers(range(1, 3), src, [2, 3, 4])
    with pytest.raises(FailedPrecondition, match="2 layers sent of 3"):
        await sender.finish(timeout_s=5)
    await sender.send_layers(range(2, 3), src, [2, 3, 4])
    await sender.finish(timeout_s=5)
    await pending.wait()
    assert torch.equal(receiver.kv_cache[:, :, [0, 5, 3]].view(torch.int16), src[:, :, [2, 3, 4]].view(torch.int16))


@pytest.mark.parametrize("sender_token", [None, "guess"], ids=["no-token", "wrong-token"])
async def test_a_receiver_with_an_internal_token_refuses_senders_without_it(sender_token):
    receiver = KVReceiver(torch.zeros(L, 2, 16, BS, H, D), internal_token="s3cret")
    await receiver.start()
    outsider, insider = KVTransferClient(sender_token), KVTransferClient("s3cret")
    try:
        src = cache(4, torch.float32, seed=5)
        forged = receiver.expect("t-forged", [1, 2], timeout_s=10)
        sender = await outsider.open(forged.handle)
        with pytest.raises(Unavailable, match="closed the connection"):  # before any chunk is read
            await sender.send_all(src, [0, 1])
            await sender.finish(timeout_s=5)
        assert not forged.done and torch.count_nonzero(receiver.kv_cache) == 0
        # the same transfer, sent with the token, lands
        sender = await insider.open(forged.handle)
        await sender.send_all(src, [0, 1])
        await forged.wait()
        assert torch.equal(receiver.kv_cache[:, :, [1, 2]], src[:, :, [0, 1]])
    finally:
        await outsider.close()
        await insider.close()
        await receiver.close()


async def test_a_refused_connection_is_told_why():
    receiver = KVReceiver(torch.zeros(L, 2, 4, BS, H, D), internal_token="s3cret")
    await receiver.start()
    host, _, port = receiver.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(framing.encode_hello("guess"))
        reply = await framing.read_reply(reader)
        assert "internal token is wrong" in reply.message and "CLEAVE_INTERNAL_TOKEN" in reply.message
        assert await reader.read() == b""  # then closed
    finally:
        writer.close()
        await receiver.close()
