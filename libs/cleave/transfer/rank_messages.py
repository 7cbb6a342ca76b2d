"""The control messages between a tensor-parallel decode worker's leader and each follower
rank's KV receiver, over one pipe per follower (apart from the lockstep pipe, which is read
only at step boundaries: an idle leader does not step, and a transfer must not wait for it).

    leader (rank 0: `RankReceivers`)             follower (rank r: `FollowerReceiver`)
    Listen(host, token, model id)       ---->    KVReceiver over its cache, started
                                        <----    Listening(address, layout)  (or ListenFailed)
    Expect(transfer id, block ids, ...) ---->    receiver.expect(...)
                                        <----    Registered(handle)  (or RegistrationFailed)
    Cancel(transfer id, reason)         ---->    the transfer fails, later chunks are refused
                                        <----    Done(transfer id, stats) / Failed(transfer id, error)

Every Expect gets exactly one Registered or RegistrationFailed, in order; every registered
transfer settles exactly once, with Done or Failed. Messages are pickled by the pipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from cleave.errors import CleaveError
from cleave.rpc.types import KVLayout, TransferHandle, TransferStats
from cleave.tls import TlsConfig


@dataclass(frozen=True)
class Listen:
    """Start a bulk endpoint over the rank's KV cache on `host` (port 0)."""

    host: str
    advertise_host: str | None
    internal_token: str | None
    model_id: str
    tls: TlsConfig | None = None  # the endpoint serves TLS with it (`cleave.tls`)


@dataclass(frozen=True)
class Listening:
    """The rank's endpoint is up: senders connect to `address`; `layout` names its heads."""

    address: str
    layout: KVLayout


@dataclass(frozen=True)
class ListenFailed:
    error: str


@dataclass(frozen=True)
class Expect:
    """Register a transfer into the rank's copy of the leader's reservation."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_cached_blocks: int
    deadline_unix_s: float | None
    worker_id: str


@dataclass(frozen=True)
class Registered:
    """The rank expects the transfer: the sender sends its slice over `handle` (TCP)."""

    transfer_id: str
    handle: TransferHandle


@dataclass(frozen=True)
class RegistrationFailed:
    transfer_id: str
    error: CleaveError


@dataclass(frozen=True)
class Cancel:
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Done:
    """Every layer of the rank's slice arrived."""

    transfer_id: str
    stats: TransferStats


@dataclass(frozen=True)
class Failed:
    """The rank's transfer failed (deadline, a refused chunk, a cancel): its blocks stay
    reserved until the leader releases them."""

    transfer_id: str
    error: CleaveError


ToFollower = Union[Listen, Expect, Cancel]
ToLeader = Union[Listening, ListenFailed, Registered, RegistrationFailed, Done, Failed]
