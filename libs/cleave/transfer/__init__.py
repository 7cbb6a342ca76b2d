"""cleave.transfer: KV blocks between workers over one interface and three transports.

Receiver (decode worker): `KVReceiver(kv_cache)`, `await start()`, `expect(transfer_id,
block_ids, timeout_s=...)` -> `PendingTransfer` (`.handle` for the sender, `await .wait()`).
Sender (prefill worker): `KVTransferClient().open(handle)` -> a `KVSender` (`BaseKVSender`)
with `send_layers(layers, cache, block_ids, ready=...)` / `send_layer` / `send_all` /
`finish` / `close`. The two ends of a transfer are `BaseKVSender` / `BaseKVReceiver`
(`base`), one pair per transport module: `cuda_ipc`, `nccl`, `tcp`, and `memory` (both ends
in one process, for tests). `choose_transport` picks CUDA_IPC, NCCL or TCP from the two
`EndpointInfo`s (the decode worker's Handshake; the prefill side is
`cleave.worker.TransportNegotiator`). `KVStoreClient` talks to services/kvstore. A
tensor-parallel decode worker receives on every rank (`rank_receivers.RankReceivers`: one
`KVReceiver` per rank behind one `expect`, the followers' driven over `rank_messages`).
"""

from cleave.transfer.base import BaseKVReceiver, BaseKVSender
from cleave.transfer.block_copy import copy_blocks, copy_blocks_reference
from cleave.transfer.choose import (
    EndpointInfo,
    choose_transport,
    local_endpoint,
    peer_endpoint,
    proposed_transports,
)
from cleave.transfer.cuda_ipc import IpcCacheMap, IpcTensorHandle, export_tensor, import_tensor
from cleave.transfer.kvstore_client import (
    KVStoreClient,
    KVStorePutResult,
    KVStoreStats,
    gather_blocks,
    gather_blocks_to_host,
    scatter_blocks,
)
from cleave.transfer.layout import check_layout, layout_mismatch, layout_of, require_same_layout
from cleave.transfer.receiver import KVReceiver, PendingTransfer
from cleave.transfer.sender import KVSender, KVTransferClient

__all__ = [
    "BaseKVReceiver",
    "BaseKVSender",
    "EndpointInfo",
    "IpcCacheMap",
    "IpcTensorHandle",
    "KVReceiver",
    "KVStoreClient",
    "KVStorePutResult",
    "KVStoreStats",
    "KVSender",
    "KVTransferClient",
    "PendingTransfer",
    "check_layout",
    "choose_transport",
    "copy_blocks",
    "copy_blocks_reference",
    "export_tensor",
    "gather_blocks",
    "gather_blocks_to_host",
    "import_tensor",
    "layout_mismatch",
    "layout_of",
    "local_endpoint",
    "peer_endpoint",
    "proposed_transports",
    "require_same_layout",
    "scatter_blocks",
]
