"""`RankReceivers`, a tensor-parallel decode worker's receiver, in one process: rank 0's
`KVReceiver` and a follower's `FollowerReceiver` (its own thread and event loop, driven over
a pipe, as in a rank process). The handle names both ranks, each gets exactly its heads over
TCP, and the transfer completes only when both did; a part that fails (its deadline, a lost
rank) fails the whole and cancels the rest."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
import torch

from cleave.errors import DeadlineExceeded, NotFound, Unavailable
from cleave.rpc.types import KVLayout, TransportKind
from cleave.transfer import KVReceiver, KVTransferClient
from cleave.transfer.layout import head_slice
from cleave.transfer.rank_messages import Failed
from cleave.transfer.rank_receivers import RankReceivers
from cleave.worker.rank_receiver import FollowerReceiver

L, BS, D, HEADS, NUM_BLOCKS = 2, 4, 8, 4, 8


def rank_layout(rank: int, model_id: str = "m") -> KVLayout:
    return KVLayout(model_id, "float32", BS, L, HEADS // 2, D, "ns", rank * HEADS // 2, HEADS)


class TwoRanks:
    """Rank 0's receiver and rank 1's follower endpoint behind one `RankReceivers`."""

    def __init__(self) -> None:
        self.local = KVReceiver(torch.zeros(L, 2, NUM_BLOCKS, BS, HEADS // 2, D), layout=rank_layout(0))
        leader_end, self.follower_end = multiprocessing.Pipe()
        self.follower = FollowerReceiver(1, torch.zeros(L, 2, NUM_BLOCKS, BS, HEADS // 2, D), self.follower_end,
                                         lambda model_id: rank_layout(1, model_id))
        self.leader_end = leader_end
        self.receivers = RankReceivers(self.local, [leader_end])

    async def start(self) -> None:
        await self.local.start()
        self.follower.start()
        await self.receivers.start(host="127.0.0.1", model_id="m")

    async def close(self) -> None:
        await self.receivers.close()
        await self.local.close()
        self.leader_end.close()
        await asyncio.to_thread(self.follower.stop)
        self.follower_end.close()


@pytest.fixture
async def two_ranks():
    ranks = TwoRanks()
    try:
        await ranks.start()
        yield ranks
    finally:
        await ranks.close()


async def test_the_handle_names_every_rank_and_each_gets_its_heads(two_ranks):
    source = torch.randn(L, 2, 10, BS, HEADS, D, generator=torch.Generator().manual_seed(4))
    source_layout = KVLayout("m", "float32", BS, L, HEADS, D, "ns", 0, HEADS)
    src_ids, dst_ids = [7, 2, 9], [5, 1, 3]
    transfer = two_ranks.receivers.expect("t1", dst_ids, timeout_s=30, worker_id="decode-0")
    handle = await transfer.registered()
    [rank_1] = handle.rank_handles
    assert handle.layout == rank_layout(0) and rank_1.layout == rank_layout(1)
    assert rank_1.transport is TransportKind.TCP and rank_1.address == two_ranks.receivers.rank_addresses[0]
    assert rank_1.block_ids == tuple(dst_ids) and rank_1.deadline_unix_s == handle.deadline_unix_s
    client = KVTransferClient()
    try:
        for part in (handle, rank_1):
            sender = await client.open(part)
            sender.select_heads(head_slice(source_layout, part.layout))
            await sender.send_all(source, src_ids, timeout_s=30)
            if part is handle:
                assert not transfer.done  # rank 1's heads are still to come
        # the follower reports its part over the pipe, after its sender returned
        stats = await asyncio.wait_for(transfer.wait(), timeout=30)
    finally:
        await client.close()
    for cache, part in ((two_ranks.local.kv_cache, handle), (two_ranks.follower.kv_cache, rank_1)):
        heads = part.layout.heads
        assert torch.equal(cache[:, :, dst_ids], source[:, :, src_ids][:, :, :, :, heads.start:heads.stop])
    assert stats.num_bytes == source[:, :, src_ids].numel() * source.element_size()  # both halves


async def test_a_part_past_its_deadline_fails_the_transfer_and_cancels_the_rest(two_ranks):
    transfer = two_ranks.receivers.expect("t2", [1, 2], deadline_unix_s=time.time() + 0.5)
    await transfer.registered()
    with pytest.raises(DeadlineExceeded):
        await transfer.wait()
    assert transfer.done
    again = two_ranks.receivers.expect("t2", [1, 2], timeout_s=30)  # every rank forgot the id
    await again.registered()
    again.cancel("test over")
    with pytest.raises(NotFound, match="test over"):
        await again.wait()


async def test_a_late_verdict_on_an_earlier_expectation_leaves_a_new_one_alone(two_ranks):
    """A follower's Failed for the first expectation of an id (its deadline fired after the
    leader had given up on it) arrives once the id is expected again: the new part waits on."""
    first = two_ranks.receivers.expect("t5", [1], timeout_s=30)
    old_part = (await first.registered()).rank_handles[0].transfer_id
    first.cancel("first over")
    again = two_ranks.receivers.expect("t5", [1], timeout_s=30)
    new_part = (await again.registered()).rank_handles[0].transfer_id
    assert old_part != new_part and old_part.startswith("t5/rank1") and new_part.startswith("t5/rank1")
    [link] = two_ranks.receivers._links
    two_ranks.receivers._on_message(link, Failed(old_part, DeadlineExceeded("the first expectation's deadline")))
    assert not link.completions[new_part].done()
    again.cancel("test over")
    with pytest.raises(NotFound, match="test over"):
        await again.wait()


async def test_a_cancel_reaches_the_follower(two_ranks):
    transfer = two_ranks.receivers.expect("t3", [4], timeout_s=30)
    handle = await transfer.registered()
    transfer.cancel("aborted")
    client = KVTransferClient()
    try:
        sender = await client.open(handle.rank_handles[0])
        sender.select_heads(slice(2, 4))
        with pytest.raises(NotFound):  # the follower refuses the cancelled id
            await sender.send_all(torch.zeros(L, 2, 2, BS, HEADS, D), [0], timeout_s=30)
    finally:
        await client.close()


async def test_a_lost_rank_fails_its_transfers_as_unavailable():
    ranks = TwoRanks()
    try:
        await ranks.start()
        transfer = ranks.receivers.expect("t4", [3], timeout_s=30)
        await transfer.registered()
        await asyncio.to_thread(ranks.follower.stop)
        ranks.follower_end.close()  # the rank process ended: its pipe reads EOF
        with pytest.raises(Unavailable, match="rank 1 of this decode worker stopped"):
            await transfer.wait()
        with pytest.raises(Unavailable):
            ranks.receivers.expect("t5", [3], timeout_s=30)
        assert not ranks.local._transfers  # rank 0's part was dropped too
    finally:
        await ranks.close()

