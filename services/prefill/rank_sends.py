"""A prompt's KV sent to every rank of a tensor-parallel decode worker.

Such a worker's handle is rank 0's, and `rank_handles` names the others: each rank holds a
slice of the model's KV heads in blocks of its own cache and listens on its own bulk
endpoint (TCP in this version). The prefill worker holds every head, so each rank's sender
stages that rank's slice (`BaseKVSender.select_heads`, done by the caller's `open_sender`)
and sends it:

    handles (rank 0, 1, .. N-1) --open_sender--> N senders --send_all, concurrently--> N verdicts

The send succeeds when every rank confirmed its slice. Each send runs to its end (none is
cancelled mid-frame, which would leave a bulk connection shared with other transfers half
written); a rank whose send fails makes the decode worker fail and cancel the other ranks'
parts, so their verdicts follow soon. Then the whole send fails with the first rank's real
error (a cancellation that rank 0 hears because rank 1 failed is not the reason).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import torch

from cleave.errors import NotFound, Unavailable
from cleave.rpc.types import TransferHandle, TransferStats
from cleave.transfer import KVSender
from services.prefill.cleanup import run_to_end

OpenSender = Callable[[TransferHandle], Awaitable[KVSender]]
Lost = Callable[[TransferHandle, Exception], Exception]


async def send_to_every_rank(handles: Sequence[TransferHandle], open_sender: OpenSender, cache: torch.Tensor,
                             table: list[int], lost: Lost) -> TransferStats:
    """Send the KV of blocks `table` (cache [L, 2, NB, BS, Hkv, D]) to every handle at once;
    stats over all of them (bytes summed). Raises the first failed rank's error, a broken
    connection as `lost(handle, error)`. Every sender is closed before it returns."""
    senders: list[KVSender] = []
    try:
        results = await asyncio.gather(
            *(_send(handle, open_sender, cache, table, lost, senders) for handle in handles), return_exceptions=True)
    finally:  # also when cancelled: no copy may read the blocks once they are released
        await run_to_end(asyncio.gather(*(sender.close() for sender in senders), return_exceptions=True))
    errors = [result for result in results if isinstance(result, BaseException)]
    if errors:
        raise next((error for error in errors if not isinstance(error, NotFound)), errors[0])
    return TransferStats.of_parts(results)  # type: ignore[arg-type]


async def _send(handle: TransferHandle, open_sender: OpenSender, cache: torch.Tensor, table: list[int], lost: Lost,
                senders: list[KVSender]) -> TransferStats:
    try:
        sender = await open_sender(handle)
    except Unavailable as error:  # the rank's endpoint cannot be reached
        raise lost(handle, error) from None
    senders.append(sender)
    try:
        # "complete": the step that wrote this KV returned its tokens, so its device work is done
        return await sender.send_all(cache, table, ready="complete")
    except (OSError, asyncio.IncompleteReadError, Unavailable) as error:  # the bulk connection broke
        raise lost(handle, error) from None
