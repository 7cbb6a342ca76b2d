"""KV moved between workers that hold different ranges of the model's KV heads (tensor-
parallel pools): each receiver gets exactly the slice of the sender's heads it holds, over
real sockets (TCP) and in one process (memory); layouts that cannot be mapped are refused
at connect with the field named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cleave.errors import FailedPrecondition
from cleave.rpc.convert import kv_layout_from_proto, kv_layout_to_proto
from cleave.rpc.types import KVLayout
from cleave.errors import InvalidArgument
from cleave.transfer import KVReceiver, KVTransferClient
from cleave.transfer.layout import head_slice, require_same_layout
from cleave.transfer.memory import MemoryEndpoint, MemoryTransferClient

L, BS, D, MODEL_HEADS = 2, 4, 8, 4


def layout(num_heads: int, start: int = 0, total: int = MODEL_HEADS, **changes) -> KVLayout:
    return dataclasses.replace(KVLayout("m", "float32", BS, L, num_heads, D, "ns", start, total), **changes)


def ranks(tp: int) -> list[KVLayout]:
    """The layouts of a TP=`tp` pool's ranks (one head each, replicated, when tp > heads)."""
    if tp <= MODEL_HEADS:
        per = MODEL_HEADS // tp
        return [layout(per, rank * per) for rank in range(tp)]
    return [layout(1, rank * MODEL_HEADS // tp) for rank in range(tp)]


@pytest.mark.parametrize("src_tp, dst_tp, expected", [
    (1, 1, [None]),
    (1, 2, [slice(0, 2), slice(2, 4)]),
    (1, 4, [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]),
    (2, 4, [slice(0, 1), slice(1, 2), slice(0, 1), slice(1, 2)]),
    (1, 8, [slice(h, h + 1) for h in (0, 0, 1, 1, 2, 2, 3, 3)]),  # replicated heads
])
def test_each_receiver_rank_gets_its_heads_from_one_sender(src_tp, dst_tp, expected):
    sources = ranks(src_tp)
    got = []
    for destination in ranks(dst_tp):
        source = next(s for s in sources if destination.kv_head_start in s.heads)
        got.append(head_slice(source, destination))
    assert got == expected


def test_unmappable_layouts_are_refused_naming_the_field():
    with pytest.raises(FailedPrecondition, match="must all come from one sender") as refused:
        head_slice(layout(2, 0), layout(4, 0))  # TP=2 -> TP=1: two senders per receiver
    assert refused.value.field == "layout.kv_head_start"
    with pytest.raises(FailedPrecondition, match="4 and 8 KV heads") as refused:
        head_slice(layout(4), layout(4, total=8))
    assert refused.value.field == "layout.total_kv_heads"
    with pytest.raises(FailedPrecondition, match="head_dim") as refused:
        head_slice(layout(4), layout(2, head_dim=D * 2))
    assert refused.value.field == "layout.head_dim"
    with pytest.raises(FailedPrecondition, match="kv_head_start"):
        require_same_layout(layout(2, 0), layout(2, 2))  # equal shapes, other heads
    with pytest.raises(FailedPrecondition, match="total_kv_heads"):
        require_same_layout(layout(2, 0), layout(2, 0, total=8))  # the same heads of other models


def test_the_head_range_crosses_the_wire_and_is_checked():
    sharded = layout(2, 2)
    assert kv_layout_from_proto(kv_layout_to_proto(sharded)) == sharded
    assert kv_layout_from_proto(kv_layout_to_proto(layout(4, total=0))).model_kv_heads == MODEL_HEADS
    with pytest.raises(InvalidArgument, match="not among the model's 4") as refused:
        kv_layout_from_proto(kv_layout_to_proto(layout(2, 3)))
    assert refused.value.field == "layout.kv_head_start"


def source_cache() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(L, 2, 10, BS, MODEL_HEADS, D, generator=generator)


@pytest.mark.parametrize("per_layer", [False, True], ids=["one-run", "layer-by-layer"])
async def test_tcp_receivers_get_exactly_their_heads(per_layer):
    src, src_layout = source_cache(), layout(MODEL_HEADS)
    src_ids, dst_ids = [7, 2, 9], [5, 1, 3]
    client = KVTransferClient()
    receivers = []
    try:
        for rank_layout in ranks(2):
            receiver = KVReceiver(torch.zeros(L, 2, 8, BS, 2, D), layout=rank_layout)
            await receiver.start()
            receivers.append(receiver)
            pending = receiver.expect(f"t{rank_layout.kv_head_start}", dst_ids, timeout_s=10)
            sender = await client.open(pending.handle)
            sender.select_heads(head_slice(src_layout, rank_layout))
            if per_layer:
                for layer in range(L):
                    await sender.send_layer(layer, src, src_ids)
                stats = await sender.finish(timeout_s=10)
            else:
                stats = await sender.send_all(src, src_ids, timeout_s=10)
            await pending.wait()
            heads = rank_layout.heads
            expected = src[:, :, src_ids][:, :, :, :, heads.start:heads.stop]
            assert torch.equal(receiver.kv_cache[:, :, dst_ids], expected)
            untouched = [b for b in range(8) if b not in dst_ids]
            assert torch.count_nonzero(receiver.kv_cache[:, :, untouched]) == 0
            assert stats.num_bytes == expected.numel() * expected.element_size()
    finally:
        for receiver in receivers:
            await receiver.close()
        await client.close()


async def test_memory_receiver_gets_its_heads_and_whole_sends_are_refused():
    src, src_layout = source_cache(), layout(MODEL_HEADS)
    rank = ranks(4)[3]
    endpoint = MemoryEndpoint(torch.zeros(L, 2, 8, BS, 1, D), layout=rank)
    await endpoint.start()
    client = MemoryTransferClient(endpoint)
    pending = endpoint.expect("t", [4, 6], timeout_s=10)
    sender = await client.open(pending.handle)
    with pytest.raises(FailedPrecondition, match="num_kv_heads"):
        await sender.send_layer(0, src, [1, 8])  # all four heads into a one-head cache
    await sender.close()
    pending = endpoint.expect("t2", [4, 6], timeout_s=10)
    sender = await client.open(pending.handle)
    sender.select_heads(head_slice(src_layout, rank))
    await sender.send_all(src, [1, 8], timeout_s=10)
    await pending.wait()
    assert torch.equal(endpoint.kv_cache[:, :, [4, 6]], src[:, :, [1, 8]][:, :, :, :, 3:4])
    with pytest.raises(FailedPrecondition, match="before the first send"):
        sender.select_heads(None)
    await endpoint.close()
