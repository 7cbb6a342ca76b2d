"""The engine-backed prefill worker: prompt -> KV in a decode worker's blocks + first token.

    prefill(spec):
        Decode.Admit on spec.decode's worker       (sent at once; see `decode_handoff`)
        kvstore prefix -> engine prefix cache      (optional: those tokens are not recomputed)
        engine prefill-only request                (chunked and batched with other prompts)
        first token of each of the n samples sampled, prompt KV kept (once) as the
        request's export (engine.handoff.export)
        first tokens handed to `early`              (spec.decode: once the reservation is
                                                   back, before the KV goes out)
        handshake with the destination's worker    (first transfer to it only: CUDA IPC /
                                                   NCCL / TCP, see cleave.worker.handshake)
        KV -> destination's reserved blocks        (the handle's transport, all layers; or
                                                   layer by layer during the final chunk's
                                                   forward, see `layer_stream`)
        Decode.Start(first tokens)                 (spec.decode: in the background)
        result returned                            (first tokens, transfer statistics)
    then, in the background (store_to_kvstore):
        new full blocks -> host memory -> kvstore  (`kvstore_puts.BackgroundPuts`)
    export blocks released                         (always, also on error or cancellation:
                                                   after the send, or once the background
                                                   task has gathered the blocks to host)

The first token never waits for the kvstore: the put runs as a task the backend tracks
(shutdown lets it finish for a moment, then cancels it; failures are logged with the
request id). The prompt's blocks stay held until that task has copied them to host memory,
so nothing reads a freed block, and its `finally` releases them on every path.

The engine makes no text (`detokenize` off): the gateway detokenizes and matches stop
strings. Nothing on a request's path waits for the device or for another request: prompts
that arrive together are prefilled in one engine step, and each one's KV then goes out with
no per-layer round trip (CUDA IPC: one copy launch on the transfer stream, one control frame,
one acknowledgement; see `cleave.transfer.sender`), while the kvstore's copy to host runs on
a thread of its own, not on the engine's.

Layer streaming (`layer_streaming`, "auto": CUDA IPC handles and prompts of at least
`AUTO_LAYER_STREAM_MIN_TOKENS` tokens only): when the destination is
known before the step that runs the prompt's final chunk starts (a `destination` in the
request, or a decode reservation that came back in time), each layer's KV is copied as soon
as that layer's forward queued it, ordered after its CUDA event, so the copy overlaps the
remaining layers (`services.prefill.layer_stream`). Otherwise, and for TCP (each layer would
be gathered and written on the event loop while the engine computes), the KV goes after the
step as above. Only the final chunk's forward overlaps: a chunked prompt's earlier chunks
are sent with it, layer by layer.

A tensor-parallel decode worker's handle lists its other ranks (`rank_handles`, TCP): each
rank gets its slice of the KV heads, all ranks at once after the step (never streamed), and
the send fails as a whole when any rank's does (`rank_sends`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import grpc
import structlog

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.config import EngineConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.errors import CleaveError, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from cleave.generation.outputs import RequestOutput
from cleave.metrics.transfer import TransferTotals, add_transfer
from cleave.rpc.drain import DrainGate, wait_until
from cleave.rpc.types import KVLayout, TopLogprobs, TransferHandle, TransferStats, TransportKind, WorkerLoad
from cleave.tls import TlsConfig
from cleave.tracing import span
from cleave.transfer import KVSender, KVStoreClient, KVTransferClient, local_endpoint
from cleave.transfer.layout import head_slice
from cleave.worker import TransportNegotiator, device_nccl, kv_layout_of, load_engine, top_logprobs_from_engine
from cleave.worker.engine_failure import EngineFailure
from cleave.worker.handshake import grpc_handshake
from services.prefill.backend import EarlyFirstTokens, PrefillResult, PrefillSpec
from services.prefill.cleanup import run_to_end
from services.prefill.decode_handoff import DecodeHandoff, DecodeLinks
from services.prefill.kvstore_prefix import DEFAULT_MIN_PREFIX_TOKENS, KVStorePrefix, PrefixFetch
from services.prefill.kvstore_puts import STORE_BACKLOG_BYTES, BackgroundPuts
from services.prefill.layer_stream import LAYER_STREAMING_MODES, LayerStream, LayerStreaming, LayerStreams
from services.prefill.rank_sends import send_to_every_rank

log = structlog.get_logger("cleave.prefill")
STORE_DRAIN_S = 5.0  # at shutdown, how long background kvstore puts may still run
HANDSHAKE_TIMEOUT_S = 30.0  # one Decode.Handshake call
# "auto" streams a prompt's layers only from this length on. A shorter prompt's forward is
# launch-bound (a 512-token prompt: ~8 ms of eager launches on an H200), and the per-layer
# callbacks on the event loop take the GIL from the step thread that launches it, so its
# forward slows by more than the ~1 ms send after the step that streaming hides; a long
# prompt's forward is compute-bound and its KV larger.
AUTO_LAYER_STREAM_MIN_TOKENS = 4096


@dataclass
class PrefillCounters:
    """Cumulative work of this worker (what kvstore and prefix-cache hits saved)."""

    num_prefills: int = 0
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # prompt tokens run through the model
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a cache
    num_kvstore_blocks_loaded: int = 0
    num_kvstore_blocks_stored: int = 0
    num_kvstore_puts_skipped: int = 0  # prompts not stored: the put backlog was full
    transfers: dict[str, TransferTotals] = field(default_factory=dict)  # transport name -> KV sent over it


class EnginePrefillBackend:
    """A PrefillBackend over an AsyncEngine, a KV transfer client and an optional kvstore.

    Args:
        engine_config: the model and engine to load at `start()`.
        worker_id: stable id for load reports and the kvstore.
        model_id: model identity of the KV layout decode workers must match.
        kvstore_address: host:port of a kvstore service, or None.
        internal_token: the stack's shared secret (`cleave.rpc.auth`), sent on calls to decode
            workers and the kvstore and on bulk KV connections; None: sent nowhere.
        tls: the process's certificate and CA (`cleave.tls`): calls to decode workers and the
            kvstore and bulk KV connections go over TLS with it; None: plain text.
        store_backlog_bytes: host bytes of background kvstore puts in flight at most; a
            prompt that would exceed it is not stored (counted in `num_kvstore_puts_skipped`).
        layer_streaming: "auto" streams KV layer by layer during the forward over CUDA IPC
            for prompts of `AUTO_LAYER_STREAM_MIN_TOKENS` or more, "on" for every prompt over
            any transport (tests, TCP on CPU), "off" never.
        kvstore_min_prefix_tokens: prefixes shorter than this are neither fetched from nor
            put into the kvstore (`KVStorePrefix`).
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        worker_id: str,
        model_id: str,
        kvstore_address: str | None = None,
        store_backlog_bytes: int = STORE_BACKLOG_BYTES,
        layer_streaming: LayerStreaming = "auto",
        internal_token: str | None = None,
        tls: TlsConfig | None = None,
        kvstore_min_prefix_tokens: int = DEFAULT_MIN_PREFIX_TOKENS,
    ) -> None:
        if layer_streaming not in LAYER_STREAMING_MODES:
            raise ValueError(f"layer_streaming must be one of {', '.join(LAYER_STREAMING_MODES)}, "
                             f"not {layer_streaming!r}")
        self.engine_config = replace(engine_config, detokenize=False)  # token ids are all it returns
        self.worker_id = worker_id
        self.failure = EngineFailure()  # the engine's error, if it fails: the service then ends
        self.model_id = model_id
        self.kvstore_address = kvstore_address
        self.kvstore_min_prefix_tokens = kvstore_min_prefix_tokens
        self._internal_token = internal_token  # sent on calls to decode workers and the kvstore
        self._tls = tls
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.layout: KVLayout | None = None
        self.transfers = KVTransferClient(internal_token, tls=tls)
        self.negotiator: TransportNegotiator | None = None
        self.kvstore: KVStorePrefix | None = None
        self.counters = PrefillCounters()
        self._in_flight: dict[str, int] = {}  # request id -> prompt tokens
        self._store_backlog_bytes = store_backlog_bytes  # the puts' bound, once they exist
        self.puts: BackgroundPuts | None = None  # with a kvstore, set at start()
        self._tables: dict[str, list[int]] = {}  # request id -> prompt blocks, read on the step thread
        self._releases: set[asyncio.Task[None]] = set()  # block releases after a response went out
        self.decode_links = DecodeLinks(internal_token, tls=tls)
        self._handoffs: set[asyncio.Future] = set()  # Start / Abort calls on decode workers
        self.layer_streaming = layer_streaming
        self.layer_streams: LayerStreams | None = None  # set at start() unless streaming is off
        self.gate = DrainGate(f"prefill worker {worker_id}")

    async def start(self) -> None:
        self.engine = await load_engine(self.engine_config)
        self.layout = kv_layout_of(self.engine, self.model_id)
        device = self.engine.kv_cache.device
        nccl = device_nccl(device)
        self.negotiator = TransportNegotiator(
            self.worker_id, local_endpoint(device, nccl_available=nccl is not None), self.layout,
            self.transfers, nccl=nccl, call=grpc_handshake(HANDSHAKE_TIMEOUT_S, self._internal_token, tls=self._tls))
        if self.layer_streaming != "off":
            cache = self.engine.kv_cache
            self.layer_streams = LayerStreams(asyncio.get_running_loop(), cache.shape[0], cache.device)
            self.engine.watch_layers = self.layer_streams.watch  # before the step thread starts
        self.failure.bind()
        self.async_engine = AsyncEngine(self.engine, on_step=self._keep_block_tables, on_failure=self.failure.report)
        if self.kvstore_address:
            client = KVStoreClient(self.kvstore_address, client_id=self.worker_id, internal_token=self._internal_token,
                                   tls=self._tls)
            await client.connect(self.layout)
            self.kvstore = KVStorePrefix(client, self.engine, self.async_engine, self.kvstore_min_prefix_tokens)
            await self.kvstore.start()  # follows what the store holds: misses need no Lookup
            counters = self.counters

            def stored(num_blocks: int) -> None:
                counters.num_kvstore_blocks_stored += num_blocks

            def skipped() -> None:
                counters.num_kvstore_puts_skipped += 1

            self.puts = BackgroundPuts(self.kvstore, self._cleanup, self._store_backlog_bytes, stored, skipped)

    async def failed(self) -> BaseException:
        """The engine's error once it failed (`run_service`'s fatal: the worker then ends)."""
        return await self.failure.wait()

    async def drain(self) -> None:
        """Refuse new prefills, return once the admitted ones answered and their decode
        starts went out (`cleave.rpc.Drainable`); background kvstore puts finish at shutdown."""
        self.gate.close()
        await wait_until(lambda: not self._in_flight and not self._handoffs)

    async def shutdown(self) -> None:
        await asyncio.gather(*self._releases, return_exceptions=True)
        await asyncio.gather(*self._handoffs, return_exceptions=True)
        await self.decode_links.close()
        if self.puts is not None:
            await self.puts.stop(timeout_s=STORE_DRAIN_S)
        await self.transfers.close()
        if self.negotiator is not None:
            await self.negotiator.close()
        if self.kvstore is not None:
            await self.kvstore.client.close()
        if self.async_engine is not None:
            await self.async_engine.shutdown()

    def _require_engine(self) -> AsyncEngine:
        if self.async_engine is None:
            raise FailedPrecondition("the prefill worker is still loading its model; retry shortly")
        if not self.async_engine.is_running:
            raise Unavailable("the prefill worker's engine stopped")
        return self.async_engine

    def _check_destination(self, handle: TransferHandle, num_prompt_tokens: int) -> None:
        assert self.engine is not None and self.layout is not None
        num_blocks = self.engine.handoff.num_blocks_for(num_prompt_tokens)
        for rank, part in enumerate((handle, *handle.rank_handles)):
            where = "destination" if rank == 0 else f"destination.rank_handles[{rank - 1}]"
            if part.layout is not None:
                head_slice(self.layout, part.layout, f"{where}.layout")
            if len(part.block_ids) != num_blocks:
                raise InvalidArgument(
                    f"lists {len(part.block_ids)} blocks but the {num_prompt_tokens}-token prompt fills {num_blocks}",
                    field=f"{where}.block_ids",
                )
        if handle.deadline_unix_s is not None and time.time() >= handle.deadline_unix_s:
            raise DeadlineExceeded("the destination's reservation already expired; admit the request again")

    async def prefill(self, spec: PrefillSpec, early: EarlyFirstTokens | None = None) -> PrefillResult:
        async_engine = self._require_engine()
        self.gate.check()
        request_id, prompt = spec.request_id, list(spec.prompt_token_ids)
        if request_id in self._in_flight:
            raise InvalidArgument(f"{request_id!r} is already prefilling here; use a unique id", field="request_id")
        if spec.destination is not None:
            self._check_destination(spec.destination, len(prompt))
        previous = self.puts.get(request_id) if self.puts is not None else None
        if previous is not None:  # the same id again: its blocks are still held by the put
            await asyncio.wait({previous})
        self._in_flight[request_id] = len(prompt)
        handoff = None
        if spec.decode is not None:
            handoff = DecodeHandoff(self.decode_links, spec, self.worker_id, self._spawn_handoff)
            handoff.admit()  # the decode worker reserves while the prompt runs
        opening = self._open_layer_stream(request_id, spec.destination or handoff, len(prompt))
        fetch = PrefixFetch(0, 0, cache_salt=spec.sampling.cache_salt)
        handed_off = False  # the background store releases the blocks from then on
        stream: LayerStream | None = None
        try:
            if spec.sampling.prompt_logprobs is None:  # a scored prompt runs whole: nothing to fetch
                fetch = await self._fetch_prefix(request_id, prompt, spec.sampling.cache_salt)
            if opening is not None and spec.destination is not None:
                await asyncio.wait({opening})  # a known destination streams from the first step on
            result = await self._run_prefill(async_engine, request_id, prompt, spec)
            destination = spec.destination
            if handoff is not None:
                with span("prefill.admit_wait"):  # only what the forward did not hide
                    destination = await handoff.reserved()
                self._check_destination(destination, len(prompt))
                if early is not None:  # the blocks are reserved: the client may see its tokens now
                    with span("prefill.first_tokens"):
                        await early(result)
            stream = await self._take_layer_stream(request_id, opening)
            table = self._tables.pop(request_id, None)
            if table is None:  # not kept by the step (e.g. an engine without the hook)
                table = await async_engine.call(lambda e: e.handoff.export(request_id))
            transfer = None
            if destination is not None:
                streamed = stream is not None and stream.is_claimed
                with span("prefill.kv_send", num_blocks=len(table), layer_streamed=streamed):
                    sending, stream = stream, None  # `_send` closes it
                    transfer = await self._send(destination, table, sending)
                add_transfer(self.counters.transfers, transfer)
            if handoff is not None:
                handoff.start(result.first_token_ids, result.first_token_logprobs)
            if spec.store_to_kvstore and self.puts is not None:
                handed_off = self.puts.start(request_id, prompt, table, fetch)
            elif self.kvstore is not None:
                self.kvstore.remember(prompt, fetch)  # computed here: later fetches need not ask the engine
        except BaseException:
            # Also when cancelled again meanwhile: an await cut short here would skip the release.
            await run_to_end(self._abandon(request_id, handoff, opening, stream, release=not handed_off))
            raise
        finally:
            self._in_flight.pop(request_id, None)
            self._tables.pop(request_id, None)
        if not handed_off:
            # The KV is delivered: the response need not wait for the engine's next step
            # boundary to free the blocks. (The release is queued on the step thread before
            # any later request can reuse this id: commands apply in order.)
            self._release_in_background(request_id)
        counters = self.counters
        counters.num_prefills += 1
        counters.num_prompt_tokens += len(prompt)
        counters.num_computed_tokens += result.num_computed_tokens
        counters.num_cached_tokens += result.num_cached_tokens
        return replace(result, transfer=transfer)

    async def _abandon(self, request_id: str, handoff: DecodeHandoff | None, opening: asyncio.Task[None] | None,
                       stream: LayerStream | None, release: bool) -> None:
        """A failed or cancelled prefill's cleanup: abort the decode reservation, close the
        layer stream (no copy may read the blocks once they are released), then free the
        prompt's blocks and kvstore hold unless the background put owns them (`release`)."""
        if handoff is not None:
            handoff.abort()
        try:
            if stream is None:
                stream = await self._take_layer_stream(request_id, opening, cancel=True)
            if stream is not None:
                await stream.close()
        finally:
            if release:
                await self._cleanup(request_id)

    def _keep_block_tables(self, outputs: list[RequestOutput]) -> None:
        """Step thread, right after a step: keep each finished prefill's block table, so
        sending its KV does not wait for the engine's next step to end."""
        assert self.engine is not None
        for output in outputs:
            if output.finished and output.request_id in self._in_flight:
                try:
                    self._tables[output.request_id] = self.engine.handoff.export(output.request_id)
                except CleaveError:  # ended without exported KV (an error): the caller reports it
                    pass

    def _spawn_handoff(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)

    def _release_in_background(self, request_id: str) -> None:
        task = asyncio.ensure_future(self._cleanup(request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _run_prefill(
        self, async_engine: AsyncEngine, request_id: str, prompt: list[int], spec: PrefillSpec
    ) -> PrefillResult:
        """Each sample's first token (in sample order), their logprobs when asked for, the
        prompt tokens computed and cached, and the prompt's scores (tokens after the first)
        when asked for; no transfer yet."""
        first_tokens: dict[int, int] = {}
        logprobs: dict[int, TopLogprobs] = {}
        prompt_logprobs: list[TopLogprobs] = []
        num_cached = 0
        async for output in async_engine.submit(request_id, prompt, spec.sampling, prefill_only=True):
            prompt_logprobs.extend(top_logprobs_from_engine(lp) for lp in output.prompt_logprobs or () if lp is not None)
            for sample in output.outputs:
                if sample.token_ids:
                    first_tokens.setdefault(sample.index, sample.token_ids[0])
                if sample.logprobs:
                    logprobs.setdefault(sample.index, top_logprobs_from_engine(sample.logprobs[0]))
            num_cached = output.usage.cached_prompt_tokens
        num_samples = spec.sampling.n
        if len(first_tokens) != num_samples:
            raise Unavailable(f"the engine ended request {request_id!r} without a first token for every sample")
        samples = range(num_samples)
        return PrefillResult(
            first_token_ids=tuple(first_tokens[i] for i in samples),
            num_prompt_tokens=len(prompt),
            num_cached_tokens=num_cached,
            num_computed_tokens=len(prompt) - num_cached,
            first_token_logprobs=tuple(logprobs[i] for i in samples) if len(logprobs) == num_samples else (),
            prompt_logprobs=tuple(prompt_logprobs),
        )

    async def _fetch_prefix(self, request_id: str, prompt: list[int], cache_salt: str) -> PrefixFetch:
        if self.kvstore is None:
            return PrefixFetch(0, 0, cache_salt=cache_salt)
        try:
            fetch = await self.kvstore.fetch(request_id, prompt, cache_salt)
        except (grpc.aio.AioRpcError, CleaveError) as error:  # the store is an optimisation
            log.warning("kvstore lookup failed; computing the whole prompt", request_id=request_id, error=str(error))
            return PrefixFetch(0, 0, cache_salt=cache_salt)
        self.counters.num_kvstore_blocks_loaded += fetch.num_loaded_blocks
        return fetch

    async def _send(self, handle: TransferHandle, table: list[int], stream: LayerStream | None = None) -> TransferStats:
        """The prompt's KV into the handle's blocks: the layers a claimed `stream` sent during
        the step (waits for its verdict), else all layers now (with the stream's sender when
        one was opened too late to be claimed). Closes the sender."""
        assert self.engine is not None
        if handle.rank_handles:  # never streamed (`_offer_layer_stream`): every rank's slice at once
            return await self._send_to_ranks(handle, table, stream)
        if stream is not None and stream.is_claimed:
            close = stream.close
            if stream.block_ids != table:
                await run_to_end(close())
                raise FailedPrecondition(f"the layers were sent from blocks {stream.block_ids} but the prompt's KV "
                                         f"is in {table}; this is a bug in the prefill worker")
            sending = stream.result()
        else:
            try:
                sender = stream.sender if stream is not None else await self._open_sender(handle)
            except Unavailable as error:  # the receiver cannot be reached
                raise receiver_lost(handle, error) from None
            close = sender.close
            # "complete": the step that wrote this KV returned its sampled tokens to the
            # host, so its device work is done; the copy starts at once on the transfer's
            # own stream instead of queueing behind the engine's next step.
            sending = sender.send_all(self.engine.kv_cache, table, ready="complete")
        try:
            return await sending
        except (OSError, asyncio.IncompleteReadError, Unavailable) as error:  # the bulk connection broke
            raise receiver_lost(handle, error) from None
        finally:
            # No queued copy may still read these blocks once they are released.
            await run_to_end(close())

    async def _send_to_ranks(self, handle: TransferHandle, table: list[int],
                             stream: LayerStream | None) -> TransferStats:
        """The prompt's KV into a tensor-parallel decode worker: each rank's heads to its
        handle (rank 0's is `handle`), all at once (`rank_sends.send_to_every_rank`)."""
        assert self.engine is not None
        if stream is not None:  # opened before the destination was known to be tensor-parallel
            await run_to_end(stream.close())
        return await send_to_every_rank((handle, *handle.rank_handles), self._open_sender, self.engine.kv_cache,
                                        table, lost=receiver_lost)

    async def _open_sender(self, handle: TransferHandle) -> KVSender:
        assert self.negotiator is not None
        await self.negotiator.prepare(handle)  # once per decode worker; this handle's transport stands
        sender = await self.transfers.open(handle)
        if handle.layout is not None and self.layout is not None:
            sender.select_heads(head_slice(self.layout, handle.layout, "destination.layout"))  # a TP decode rank's
        return sender

    def _open_layer_stream(
        self, request_id: str, destination: TransferHandle | DecodeHandoff | None, num_prompt_tokens: int
    ) -> asyncio.Task[None] | None:
        """Start opening the request's layer stream (None: streaming is off, the prompt is
        too short for "auto", or there is no destination); see `_offer_layer_stream`."""
        if self.layer_streams is None or destination is None:
            return None
        if self.layer_streaming == "auto" and num_prompt_tokens < AUTO_LAYER_STREAM_MIN_TOKENS:
            return None
        return asyncio.ensure_future(self._offer_layer_stream(request_id, destination, num_prompt_tokens))

    async def _offer_layer_stream(
        self, request_id: str, destination: TransferHandle | DecodeHandoff, num_prompt_tokens: int
    ) -> None:
        """Once the destination is known, open its sender and offer the stream to the step
        that runs the prompt's final chunk. Any error leaves the KV to the send after the
        step, which meets the error again and reports it."""
        assert self.engine is not None and self.layer_streams is not None
        try:
            handle = destination if isinstance(destination, TransferHandle) else await destination.reserved()
            if self.layer_streaming == "auto" and handle.transport is not TransportKind.CUDA_IPC:
                return  # TCP and NCCL: sent after the step
            if handle.rank_handles:
                # A tensor-parallel destination takes one transfer per rank; streaming them all
                # layer by layer is not built yet: its KV goes after the step, to every rank at once.
                return
            self._check_destination(handle, num_prompt_tokens)
            sender = await self._open_sender(handle)
        except Exception as error:  # reported by the send after the step
            log.debug("no layer stream; the KV goes after the step", request_id=request_id, error=str(error))
            return
        self.layer_streams.offer(request_id, LayerStream(sender, self.engine.kv_cache))

    async def _take_layer_stream(self, request_id: str, opening: asyncio.Task[None] | None,
                                 cancel: bool = False) -> LayerStream | None:
        """Withdraw the request's stream once its opening settled (claimed by the step or not)."""
        if opening is None or self.layer_streams is None:
            return None
        if cancel:
            opening.cancel()
        if not opening.done():  # (a done one costs no trip through the event loop)
            await asyncio.wait({opening})
        return self.layer_streams.take(request_id)

    async def wait_for_stores(self, timeout_s: float | None = None) -> bool:
        """Wait until the background kvstore puts started so far are done (True), or
        `timeout_s` passed (False)."""
        return True if self.puts is None else await self.puts.wait(timeout_s)

    async def _cleanup(self, request_id: str) -> None:
        """Free the exported prompt blocks and the kvstore hold (no-ops when absent; a
        fetch cut short may hold blocks, so the hold is released in any case)."""
        if self.async_engine is None or not self.async_engine.is_running:
            return

        def release(e: LLMEngine) -> None:
            e.handoff.release_export(request_id)
            e.handoff.release_hold(request_id)

        await self.async_engine.call(release)

    def load(self) -> WorkerLoad:
        if self.engine is None:
            return WorkerLoad(worker_id=self.worker_id)
        kv = self.engine.handoff.snapshot()
        return WorkerLoad(
            worker_id=self.worker_id,
            num_running=len(self._in_flight),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_usable_blocks,
            num_queued_prompt_tokens=sum(self._in_flight.values()),
            max_num_running=self.engine.config.scheduler.max_num_seqs,
        )


def receiver_lost(handle: TransferHandle, error: Exception) -> Exception:
    """A transfer that failed on the receiving end (the socket broke, or the transport's
    Unavailable: receiver unreachable, connection dropped or closed) as the decode worker's
    failure (field "decode"): the gateway then moves the request to another decode worker
    instead of taking this prefill worker out of rotation. An error that already names its
    field is returned as it is."""
    if isinstance(error, Unavailable) and error.field is not None:
        return error
    return Unavailable(
        f"the KV transfer to decode worker {handle.worker_id or handle.address} broke mid-transfer "
        f"({type(error).__name__}: {error}); its blocks were freed, retry", field="decode")
