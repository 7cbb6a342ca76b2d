"""Async client of the KVStore service (services/kvstore), for prefill workers.

Blocks travel as `[num_layers, 2, block_size, num_kv_heads, head_dim]` tensors: all layers'
K and V of one block. `gather_blocks` / `scatter_blocks` convert between those and the
paged cache `[L, 2, NB, BS, Hkv, D]`.

    client = KVStoreClient("kvstore:50081", client_id="prefill-0")
    await client.connect(layout)
    hit = await client.lookup(hashes)                       # leading blocks stored
    cached = await client.get(hashes[:hit])                 # [BS-token blocks], chain order
    await client.put(hashes[hit:], gather_blocks(cache, block_ids[hit:]))

    await client.watch()                                    # opt-in: follow the store's blocks
    if client.index.is_live:
        hit = client.index.num_leading(hashes)              # no round trip (a hint: see StoredIndex)
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import structlog
import torch

from cleave.device_copy import to_host
from cleave.errors import FailedPrecondition, InvalidArgument
from cleave.kernels.kv_cache_dtype import as_words
from cleave.proto.cleave.v1 import kvstore_pb2, kvstore_pb2_grpc
from cleave.rpc.client import aio_channel, tls_credentials
from cleave.rpc.convert import dtype_to_proto, kv_layout_to_proto
from cleave.rpc.types import KVLayout
from cleave.tls import TlsConfig
from cleave.transfer.kvstore_index import StoredIndex
from cleave.rpc.kvstore_wire import GET_METHOD, PUT_METHOD, decode_kv_block, encode_kv_block
from cleave.transfer.tensors import as_bytes, device_index, dtype_name, torch_dtype

PUT_BATCH_BLOCKS = 8  # blocks per message batch built off the event loop
WATCH_BACKOFF_MIN_S = 0.05  # wait before calling Watch again after the stream broke ...
WATCH_BACKOFF_MAX_S = 5.0  # ... doubling while it keeps breaking before a whole snapshot

log = structlog.get_logger("cleave.kvstore.client")


@dataclass(frozen=True)
class KVStorePutResult:
    """Blocks a Put stored, and those it found already present."""

    num_stored: int
    num_already_present: int


@dataclass(frozen=True)
class KVStoreStats:
    """The store's counters (see kvstore.proto StatsResponse)."""

    hits: int
    misses: int
    bytes_stored: int
    bytes_served: int
    evictions: int
    num_blocks_ram: int
    num_blocks_disk: int
    num_lookups: int = 0


def gather_blocks(cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """Per-block payloads of a paged cache.

    cache: [L, 2, NB, BS, Hkv, D] -> [n, L, 2, BS, Hkv, D] (contiguous, cache's device)
    """
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.device)
    return _gathered(cache, index)


def _gathered(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[L, 2, NB, BS, Hkv, D] -> blocks `index` as [n, L, 2, BS, Hkv, D], gathered as integer
    words (a float8 cache needs no gather kernel of its own)."""
    return as_words(cache).index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous().view(cache.dtype)


def gather_blocks_to_host(cache: torch.Tensor, block_ids: Sequence[int],
                          stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """`gather_blocks` into host memory. On CUDA the gather and the copy to pinned memory run
    on `stream` and only that stream's work is waited for (meant for a thread beside the
    engine's: the blocks must be held so that nothing writes them meanwhile).

    cache: [L, 2, NB, BS, Hkv, D] -> [n, L, 2, BS, Hkv, D] on the CPU
    """
    if not cache.is_cuda:
        return gather_blocks(cache, block_ids)
    stream = stream or torch.cuda.current_stream(cache.device)
    with torch.cuda.stream(stream):
        index = device_index(block_ids, cache.device, stream)
        blocks = _gathered(cache, index)
        host = to_host(blocks)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return host


def scatter_blocks(cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    """Write per-block payloads [n, L, 2, BS, Hkv, D] into blocks `block_ids` of the cache."""
    if blocks.dtype != cache.dtype:
        raise InvalidArgument(f"{blocks.dtype} blocks for a {cache.dtype} KV cache: their bytes would be misread",
                              field="blocks")
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.device)
    as_words(cache).index_copy_(2, index, as_words(blocks.to(cache.device)).permute(1, 2, 0, 3, 4, 5))


class KVStoreClient:
    """One connection to a KV store, bound to one layout after `connect`."""

    def __init__(
        self, address: str, client_id: str = "", timeout_s: float = 30.0, internal_token: str | None = None,
        *, tls: TlsConfig | None = None,
    ) -> None:
        self._channel = aio_channel(address, internal_token=internal_token, credentials=tls_credentials(tls))
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        # Put's messages are wire bytes already (`encode_kv_block`): sent without a serializer.
        self._put = self._channel.stream_unary(PUT_METHOD, response_deserializer=kvstore_pb2.PutResponse.FromString)
        # Get's are read as wire bytes (`decode_kv_block`): each payload is copied once, into the result.
        self._get = self._channel.unary_stream(GET_METHOD, request_serializer=kvstore_pb2.GetRequest.SerializeToString)
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.layout: KVLayout | None = None
        self.layout_id = ""
        self.block_num_bytes = 0
        self.index = StoredIndex()  # live only after `watch()`
        self.num_watch_calls = 0  # Watch streams opened (one more per resubscription)
        self._watch_task: asyncio.Task[None] | None = None
        self._jitter = random.Random()  # spreads the workers' resubscriptions after a store restart

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the watch (if any), then close the channel."""
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # close() itself was cancelled
        await self._channel.close()

    async def connect(self, layout: KVLayout) -> str:
        """Register the layout; raises grpc FAILED_PRECONDITION when the store holds another."""
        response = await self._stub.Connect(
            kvstore_pb2.ConnectRequest(layout=kv_layout_to_proto(layout), client_id=self.client_id),
            timeout=self.timeout_s)
        self.layout, self.layout_id, self.block_num_bytes = layout, response.layout_id, response.block_num_bytes
        return self.layout_id

    async def watch(self) -> StoredIndex:
        """Keep `self.index` up to date from the store's Watch stream, in a background task
        that calls Watch again (with backoff) whenever the stream ends; `index.is_live` says
        when it may be used. Call after `connect`; later calls change nothing; `close` stops it."""
        self._require()
        if self._watch_task is None:
            self._watch_task = asyncio.create_task(self._follow(), name=f"kvstore-watch {self.client_id}")
        return self.index

    async def _follow(self) -> None:
        backoff_s = WATCH_BACKOFF_MIN_S
        while True:
            call = self._stub.Watch(kvstore_pb2.WatchRequest(layout_id=self.layout_id))
            self.num_watch_calls += 1
            try:
                async for message in call:
                    self.index.apply(message.stored_hashes, message.removed_hashes, message.snapshot_done)
                    if message.snapshot_done:
                        backoff_s = WATCH_BACKOFF_MIN_S  # a whole snapshot came: the store is fine
                log.info("kvstore watch ended; calling Watch again", client_id=self.client_id)
            except grpc.aio.AioRpcError as error:
                log.warning("kvstore watch broke; calling Watch again", client_id=self.client_id,
                            code=error.code().name, details=error.details())
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    await self._reconnect()  # a restarted RAM-only store forgot the layout
            except Exception:  # noqa: BLE001 - the index must not die with its stream
                log.exception("kvstore watch failed; calling Watch again", client_id=self.client_id)
            finally:
                call.cancel()
                self.index.reset()  # not live: lookups go to the store until a new snapshot
            await asyncio.sleep(backoff_s * self._jitter.uniform(0.5, 1.0))
            backoff_s = min(2 * backoff_s, WATCH_BACKOFF_MAX_S)

    async def _reconnect(self) -> None:
        try:
            await self.connect(self._require())
        except grpc.aio.AioRpcError as error:
            log.warning("kvstore connect failed", client_id=self.client_id, code=error.code().name,
                        details=error.details())

    def _require(self) -> KVLayout:
        if self.layout is None:
            raise FailedPrecondition("call connect(layout) first")
        return self.layout

    @property
    def block_shape(self) -> tuple[int, ...]:
        layout = self._require()
        return (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)

    async def lookup(self, block_hashes: Sequence[bytes], timeout_s: float | None = None) -> int:
        """How many leading blocks of the chain the store holds (`timeout_s`: this call's
        deadline, else the client's)."""
        self._require()
        if not block_hashes:
            return 0
        response = await self._stub.Lookup(
            kvstore_pb2.LookupRequest(layout_id=self.layout_id, block_hashes=list(block_hashes)),
            timeout=self.timeout_s if timeout_s is None else timeout_s)
        return response.num_hit_blocks

    def _messages(self, block_hashes: Sequence[bytes], blocks: torch.Tensor, parent_hash: bytes,
                  positions: range) -> list[bytes]:
        """Encoded KVBlock messages of some blocks (each payload copied once)."""
        layout = self._require()
        dtype = dtype_to_proto(layout.dtype)
        messages = []
        for position in positions:
            payload = blocks[position].cpu().contiguous()  # [L, 2, BS, Hkv, D]
            messages.append(encode_kv_block(
                block_hashes[position], parent_hash if position == 0 else block_hashes[position - 1],
                self.layout_id, dtype, payload.shape, as_bytes(payload)))
        return messages

    async def _message_stream(self, block_hashes: Sequence[bytes], blocks: torch.Tensor,
                              parent_hash: bytes) -> AsyncIterator[bytes]:
        """Put's messages, built a few blocks at a time on a thread: copying a long
        prompt's blocks into messages would otherwise hold the caller's event loop."""
        for start in range(0, len(block_hashes), PUT_BATCH_BLOCKS):
            positions = range(start, min(start + PUT_BATCH_BLOCKS, len(block_hashes)))
            for message in await asyncio.to_thread(self._messages, block_hashes, blocks, parent_hash, positions):
                yield message

    async def put(self, block_hashes: Sequence[bytes], blocks: torch.Tensor,
                  parent_hash: bytes = b"") -> KVStorePutResult:
        """Store consecutive blocks of a chain; `parent_hash` is the block before the first.

        blocks: [n, L, 2, BS, Hkv, D] of the layout's dtype (see `gather_blocks`).
        """
        layout = self._require()
        if blocks.shape[0] != len(block_hashes) or tuple(blocks.shape[1:]) != self.block_shape:
            raise InvalidArgument(
                f"blocks must be [{len(block_hashes)}, {', '.join(map(str, self.block_shape))}], "
                f"got {list(blocks.shape)}", field="blocks")
        if dtype_name(blocks.dtype) != layout.dtype:
            raise InvalidArgument(f"blocks are {blocks.dtype}, the layout is {layout.dtype}", field="blocks")
        if not block_hashes:
            return KVStorePutResult(0, 0)
        response = await self._put(self._message_stream(block_hashes, blocks, parent_hash), timeout=self.timeout_s)
        return KVStorePutResult(response.num_stored, response.num_already_present)

    async def get(self, block_hashes: Sequence[bytes], timeout_s: float | None = None) -> torch.Tensor:
        """The stored leading blocks of the chain: [hit, L, 2, BS, Hkv, D] on the CPU
        (`timeout_s`: this call's deadline, else the client's)."""
        layout = self._require()
        dtype = torch_dtype(layout.dtype)
        out = torch.empty(len(block_hashes), *self.block_shape, dtype=dtype)
        if not block_hashes:
            return out
        count = 0
        call = self._get(
            kvstore_pb2.GetRequest(layout_id=self.layout_id, block_hashes=list(block_hashes)),
            timeout=self.timeout_s if timeout_s is None else timeout_s)
        async for message in call:
            block = decode_kv_block(message)
            if block.hash != block_hashes[count] or block.shape != self.block_shape:
                raise InvalidArgument(f"store answered block {count} with the wrong hash or shape")
            target = as_bytes(out[count])
            if block.data.nbytes != target.nbytes:
                raise InvalidArgument(f"store answered block {count} with {block.data.nbytes} bytes")
            target[:] = block.data
            count += 1
        return out[:count]

    async def stats(self) -> KVStoreStats:
        response = await self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=self.timeout_s)
        return KVStoreStats(response.hits, response.misses, response.bytes_stored, response.bytes_served,
                            response.evictions, response.num_blocks_ram, response.num_blocks_disk,
                            response.num_lookups)
