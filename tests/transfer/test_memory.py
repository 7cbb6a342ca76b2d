"""In-memory transport: the real sender and receiver bookkeeping between two caches of one
process, every reserved block checked, refusals, and a copy that fails part-way."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cleave.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from cleave.transfer.base import BaseKVReceiver, BaseKVSender
from cleave.transfer.block_copy import copy_blocks
from cleave.transfer.memory import MemoryEndpoint, MemoryKVReceiver, MemoryKVSender, MemoryTransferClient

L, NB, BS, H, D = 3, 12, 4, 2, 8


def source_cache(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, 10, BS, H, D, generator=generator).to(dtype)  # [L, 2, NB, BS, Hkv, D]


def assert_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
    """Every reserved block holds its source block bit for bit; every other block is untouched (zero)."""
    for dst_id, src_id in zip(dst_ids, src_ids):
        assert torch.equal(dst[:, :, dst_id].view(torch.uint8), src[:, :, src_id].view(torch.uint8)), (dst_id, src_id)
    others = [block for block in range(dst.shape[2]) if block not in dst_ids]
    assert torch.count_nonzero(dst[:, :, others]) == 0


@pytest.fixture
async def endpoint():
    endpoint = MemoryEndpoint(torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16))
    await endpoint.start()
    yield endpoint
    await endpoint.close()


async def test_send_all_moves_every_block(endpoint):
    src, src_ids, dst_ids = source_cache(), [7, 2, 9, 0, 4], [3, 11, 5, 1, 8]
    pending = endpoint.expect("all", dst_ids, timeout_s=10)
    client = MemoryTransferClient(endpoint)
    sender = await client.open(pending.handle)
    assert isinstance(sender, MemoryKVSender) and isinstance(sender, BaseKVSender)
    stats = await sender.send_all(src, src_ids)
    received = await pending.wait()
    assert_blocks(endpoint.kv_cache, dst_ids, src, src_ids)
    expected_bytes = L * 2 * len(src_ids) * BS * H * D * src.element_size()
    assert (stats.num_bytes, received.num_bytes, received.num_blocks) == (expected_bytes, expected_bytes, 5)
    assert pending.handle.address.startswith("memory://")


async def test_layer_by_layer_with_cached_prefix(endpoint):
    src = source_cache(seed=1)
    pending = endpoint.expect("layers", [1, 4, 6, 8, 10], num_cached_blocks=2, timeout_s=10)
    sender = await MemoryTransferClient(endpoint).open(pending.handle)
    for layer in (2, 0):  # any order; the transfer completes with its last layer
        await sender.send_layer(layer, src, [0, 1, 5, 3, 7])
        assert not pending.done
    await sender.send_layers(range(1, 2), src, [5, 3, 7])  # ids after the cached prefix only
    await sender.finish(timeout_s=5)
    assert (await pending.wait()).num_blocks == 3
    assert_blocks(endpoint.kv_cache, [6, 8, 10], src, [5, 3, 7])  # cached blocks 1 and 4 receive nothing


async def test_receiver_refuses_a_mismatched_chunk_before_any_write(endpoint):
    client = MemoryTransferClient(endpoint)
    pending = endpoint.expect("fp32", [2, 3], timeout_s=10)
    sender = await client.open(pending.handle)
    with pytest.raises(InvalidArgument, match="dtype DTYPE_FLOAT32 differs"):
        await sender.send_layer(0, source_cache(torch.float32), [0, 1])
    with pytest.raises(InvalidArgument, match="dtype"):
        await pending.wait()
    assert torch.count_nonzero(endpoint.kv_cache) == 0  # refused before the copy ran
    with pytest.raises(InvalidArgument, match="dtype"):  # the sender keeps hearing the verdict
        await sender.send_layer(1, source_cache(), [0, 1])
    # the refused id is gone: a chunk for it is unknown
    stale = await client.open(pending.handle)
    with pytest.raises(NotFound, match="unknown transfer id 'fp32'"):
        await stale.send_layer(0, source_cache(), [0, 1])


async def test_a_copy_failing_mid_layer_fails_the_transfer_and_the_blocks_can_be_reserved_again(endpoint):
    def copy_then_fault(src, dst, src_ids, dst_ids, layers):
        copy_blocks(src, dst, src_ids, dst_ids, range(layers.start, layers.start + 1))
        dst[layers.start + 1, 0].index_copy_(0, dst_ids[:1], src[layers.start + 1, 0].index_select(0, src_ids[:1]))
        raise RuntimeError("device fault after one block of layer 1")

    src, src_ids, dst_ids = source_cache(seed=2), [1, 5, 6], [9, 0, 2]
    pending = endpoint.expect("faulty", dst_ids, timeout_s=10)
    sender = await MemoryTransferClient(endpoint, copy=copy_then_fault).open(pending.handle)
    with pytest.raises(Unavailable, match="device fault"):
        await sender.send_all(src, src_ids)
    with pytest.raises(Unavailable) as failure:
        await pending.wait()
    message = str(failure.value)
    assert "'faulty' failed while layers 0..2 were written" in message
    assert "RuntimeError: device fault after one block of layer 1" in message
    assert "must be freed" in message
    assert pending.done
    with pytest.raises(Unavailable, match="device fault"):
        await sender.finish(timeout_s=1)  # the verdict, not a hang
    # The caller frees the blocks and reserves them again: a retry overwrites the partial KV.
    retry = endpoint.expect("retry", dst_ids, timeout_s=10)
    await (await MemoryTransferClient(endpoint).open(retry.handle)).send_all(src, src_ids)
    await retry.wait()
    assert_blocks(endpoint.kv_cache, dst_ids, src, src_ids)


async def test_deadline_fails_an_incomplete_transfer(endpoint):
    pending = endpoint.expect("slow", [2, 3], timeout_s=0.05)
    sender = await MemoryTransferClient(endpoint).open(pending.handle)
    await sender.send_layer(0, source_cache(), [0, 1])
    with pytest.raises(DeadlineExceeded, match="2 of 3 layers missing"):
        await pending.wait()
    with pytest.raises(DeadlineExceeded):
        await sender.send_layer(1, source_cache(), [0, 1])


async def test_close_fails_pending_transfers_and_unknown_addresses_are_unavailable(endpoint):
    pending = endpoint.expect("open", [0], timeout_s=10)
    client = MemoryTransferClient()
    with pytest.raises(Unavailable, match="add its MemoryEndpoint"):
        await client.open(pending.handle)
    await endpoint.close()
    with pytest.raises(Exception, match="shutting down"):
        await pending.wait()


async def test_receiving_end_is_a_base_kv_receiver(endpoint):
    pending = endpoint.expect("kind", [0, 1], timeout_s=10)
    end = endpoint.receiving_end("kind")
    assert isinstance(end, MemoryKVReceiver) and isinstance(end, BaseKVReceiver)
    assert end.block_ids == (0, 1) and not end.is_settled
    pending.cancel("admission withdrawn")
    with pytest.raises(NotFound, match="admission withdrawn"):
        await pending.wait()
    with pytest.raises(NotFound, match="unknown transfer id"):
        endpoint.receiving_end("kind")
    await asyncio.sleep(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_memory_transport_between_cuda_caches_waits_for_the_producer():
    endpoint = MemoryEndpoint(torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda"))
    await endpoint.start()
    values, src_ids, dst_ids = source_cache(seed=4).cuda(), [3, 8, 1], [10, 0, 6]
    src = torch.zeros_like(values)
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)  # the KV exists only after a device-side delay
        src.copy_(values)
        written = torch.cuda.Event()
        written.record(producer)
    pending = endpoint.expect("cuda", dst_ids, timeout_s=30)
    await (await MemoryTransferClient(endpoint).open(pending.handle)).send_all(src, src_ids, ready=written)
    await pending.wait()
    assert_blocks(endpoint.kv_cache.cpu(), dst_ids, values.cpu(), src_ids)
    await endpoint.close()
