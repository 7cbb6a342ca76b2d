"""Bulk KV connections over TLS (`cleave.tls`): the KV lands exactly through an encrypted
connection, and a sender without a certificate of the receiver's CA gets no connection."""

from __future__ import annotations

import pytest
import torch

from cleave.errors import Unavailable
from cleave.tls import TlsConfig
from cleave.transfer import KVReceiver, KVTransferClient
from tests.tls_files import stack_tls

L, BS, H, D = 2, 4, 2, 8


def cache(num_blocks: int, seed: int) -> torch.Tensor:
    return torch.randn(L, 2, num_blocks, BS, H, D, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def tls(tmp_path) -> TlsConfig:
    return stack_tls(tmp_path / "stack")


@pytest.fixture
async def receiver(tls):
    receiver = KVReceiver(torch.zeros(L, 2, 8, BS, H, D), internal_token="s3cret", tls=tls)
    try:
        await receiver.start()
        yield receiver
    finally:
        await receiver.close()


async def test_kv_lands_exactly_over_tls(receiver, tls):
    client = KVTransferClient("s3cret", tls=tls)
    try:
        src = cache(4, seed=1)
        pending = receiver.expect("t-tls", [5, 1, 6], timeout_s=10)
        sender = await client.open(pending.handle)
        await sender.send_all(src, [3, 0, 2])
        stats = await pending.wait()
        assert torch.equal(receiver.kv_cache[:, :, [5, 1, 6]], src[:, :, [3, 0, 2]])
        assert stats.num_blocks == 3
    finally:
        await client.close()


async def test_a_sender_without_a_stack_certificate_gets_no_connection(receiver, tmp_path):
    stranger = stack_tls(tmp_path / "stranger")  # another CA: each side refuses the other's certificate
    for outsider in (KVTransferClient("s3cret"), KVTransferClient("s3cret", tls=stranger)):
        try:
            pending = receiver.expect(f"t-{id(outsider)}", [1], timeout_s=10)
            with pytest.raises(Unavailable):
                sender = await outsider.open(pending.handle)
                await sender.send_all(cache(2, seed=2), [0])
                await sender.finish(timeout_s=5)
            assert not pending.done and torch.count_nonzero(receiver.kv_cache) == 0
            pending.cancel()
        finally:
            await outsider.close()

