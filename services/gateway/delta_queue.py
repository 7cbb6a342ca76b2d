"""A request's queue of decode deltas that holds, while its client lags, only its own tokens.

A decode worker's Attach stream brings one `StepOutput` a step for all of a gateway's requests
there, and each delta goes into its request's queue. A parsed message's sub-messages live in
the memory of the whole parse, so a delta kept as it came keeps every other request's deltas
of its step alive with it; and one message a step is ~0.7 KB of message for a token of a few
bytes. A client that reads slowly (or not at all) would hold one of either per step it lags.

`DeltaQueue` keeps a delta as it came only when the queue is empty (its consumer takes it
within the step). A delta queued behind others is copied out of its step (`detached`), and
the next ones of the same sample are merged into that copy, as vLLM's output collector merges
a lagging request's outputs: a sample's queued tokens are one message, its token ids a packed
list. One never-read request beside 255 read ones, 4000 steps:
`bench/unread_stream_memory.py` (`bench/results/gateway/`). The consumer sees the same tokens
in the same order per sample, in fewer deltas.
"""

from __future__ import annotations

import asyncio
from collections import deque

from cleave.proto.cleave.v1 import decode_pb2

_SampleKey = tuple[str, int]  # (worker request id, its sample index)


def detached(delta: decode_pb2.RequestDelta) -> decode_pb2.RequestDelta:
    """A copy of `delta` that holds its own memory, not its parse's."""
    copy = decode_pb2.RequestDelta()
    copy.CopyFrom(delta)
    return copy


def merge_into(queued: decode_pb2.RequestDelta, later: decode_pb2.RequestDelta) -> None:
    """`later`'s tokens (and its end, if it ends the sample) appended to `queued`, a delta of
    the same sample that has not ended: one delta that says what the two said."""
    num_reasoning_tokens = queued.num_reasoning_tokens + later.num_reasoning_tokens
    queued.MergeFrom(later)  # repeated fields append (copied); the ending's fields are set
    queued.num_reasoning_tokens = num_reasoning_tokens


class DeltaQueue(asyncio.Queue):
    """An asyncio.Queue of `RequestDelta`s and errors whose queued deltas hold their own memory,
    one message per lagging sample (the module doc). Errors (`WorkerLost`, ...) are queued
    as they come; nothing is merged across one."""

    def _init(self, maxsize: int) -> None:
        self._queue: deque = deque()
        self._open: dict[_SampleKey, decode_pb2.RequestDelta] = {}  # queued copies that can take more tokens

    def _put(self, item: object) -> None:
        if not self._queue:  # the common case, taken within the step: as it came (nothing is open)
            self._queue.append(item)
            return
        if not isinstance(item, decode_pb2.RequestDelta):
            self._open.clear()
            self._queue.append(item)
            return
        key = (item.request_id, item.sample_index)
        queued = self._open.get(key)
        if queued is None:
            queued = detached(item)
            self._queue.append(queued)
        else:
            merge_into(queued, item)
        if item.finish_reason:
            self._open.pop(key, None)
        else:
            self._open[key] = queued

    def _get(self) -> object:
        item = self._queue.popleft()
        if self._open and isinstance(item, decode_pb2.RequestDelta):
            key = (item.request_id, item.sample_index)
            if self._open.get(key) is item:
                del self._open[key]
        return item
