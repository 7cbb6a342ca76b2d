"""The tensor-parallel ranks of one worker, stepping one engine in lockstep.

Every rank of a tensor-parallel worker runs a whole `LLMEngine` over its shard of the model
(`cleave.parallel`): the same scheduler decisions, block tables and sampled tokens, since the
logits are gathered to every rank and sampling is seeded alike. Only rank 0, the leader,
serves RPCs. So that the followers' engines see what the leader's sees, in the same order
between the same steps, the leader records every call that changes which requests run or
which KV blocks are held, and before each step broadcasts the calls since the last one with
the step; a follower applies them and steps too, dropping its outputs:

    leader (rank 0: the worker's engine)       follower (rank r: `follow`)
    enqueue(state)          -> Add
    abort(id)               -> Abort
    abort_sample(id, i)     -> AbortSample
    handoff.reserve(id, n)  -> [.., Reserve]   reserve; its block ids must equal the leader's
    handoff.release(id)     -> [.., Release]   release
    handoff.receive(id,..)  -> [.., Receive]   receive (admits the same samples)
    step()                  -> [Add, Abort, Step]   enqueue, abort, step
    rank_snapshots()        -> [ReportKV]      answers its KV block counts
    close()                 -> [Stop]          returns

The model's collectives inside a step line up because every rank runs the same step. The ops
travel over pipes (`LockstepChannel`), not the process group: a rank idles in a read for as
long as its worker idles, and a step costs the leader one small write per rank. The KV
hand-off ops (and ReportKV) go out at once, with whatever was recorded before them, not
with the next step: an idle worker does not step, and its followers' pools should match the
leader's all the same (block allocation is deterministic given the same state, so every
rank reserves the same block ids; a follower that does not raises).

The decode side of disaggregated serving works on such a worker: the KV of a request
prefilled elsewhere arrives on every rank, each rank's slice of the KV heads over a bulk
endpoint of its own (`cleave.transfer.rank_receivers` on the leader,
`cleave.worker.rank_receiver` on the followers; TCP, CPU-tested with gloo ranks; NCCL and
CUDA IPC into the extra ranks, and anything on several GPUs, are untested). The prefill
side (export, the kvstore's prefix holds) and prefill-only requests stay refused
(FailedPrecondition): prefill workers run one rank.
"""

from __future__ import annotations

import pickle
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from collections.abc import Callable, Sequence
from typing import Any, Union

import structlog

from cleave.engine.config import EngineConfig
from cleave.engine.handoff import KVHandoff, KVSnapshot, first_token_list
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import RequestState
from cleave.errors import FailedPrecondition, InvalidArgument
from cleave.generation.outputs import RequestOutput
from cleave.generation.sampling_params import SamplingParams

log = structlog.get_logger(__name__)

@dataclass(frozen=True)
class Add:
    """A request queued on the leader; followers build it from the same inputs."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float  # the leader's: queue order by arrival is the same on every rank


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class AbortSample:
    request_id: str
    index: int


@dataclass(frozen=True)
class Reserve:
    """`handoff.reserve` on the leader: a follower reserves too and checks it got `block_ids`
    (where the KV transfer into its cache writes)."""

    request_id: str
    num_prompt_tokens: int
    block_ids: tuple[int, ...]  # the leader's


@dataclass(frozen=True)
class Release:
    """`handoff.release` on the leader: a reservation that will not be received."""

    request_id: str


@dataclass(frozen=True)
class Receive:
    """`handoff.receive` on the leader: a request whose prompt KV is in its reservation on
    every rank starts decoding; followers admit it from the same inputs."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_tokens: tuple[int, ...]
    params: SamplingParams
    priority: int
    arrival_time: float  # the leader's, as for Add


@dataclass(frozen=True)
class ReportKV:
    """Followers answer with their `KVSnapshot` (`LockstepEngine.rank_snapshots`)."""


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class Stop:
    pass


EngineOp = Union[Add, Abort, AbortSample, Reserve, Release, Receive, ReportKV, Step, Stop]


class LockstepChannel:
    """Rank 0's engine calls, sent to the other ranks of the worker: one pipe per rank (the
    worker starts its ranks itself), a few microseconds per step where a collective of the
    process group took near a millisecond. A rank reading from a pipe whose leader is gone
    gets EOFError.

    Args:
        rank: this process's rank (0: the leader).
        connections: the leader's end of each other rank's pipe (rank 0), or this rank's
            end of its pipe to the leader.
    """

    def __init__(self, rank: int, connections: list[Connection]) -> None:
        if rank != 0 and len(connections) != 1:
            raise ValueError(f"rank {rank} talks to rank 0 only: one connection, got {len(connections)}")
        self.rank = rank
        self._connections = connections

    def publish(self, ops: list[EngineOp]) -> None:
        """Leader: send `ops` to every other rank."""
        payload = pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL)
        for connection in self._connections:
            connection.send_bytes(payload)

    def receive(self) -> list[EngineOp]:
        """Other ranks: the leader's next batch of ops (blocks until it comes)."""
        return pickle.loads(self._connections[0].recv_bytes())

    def answer(self, value: Any) -> None:
        """Other ranks: reply to an op that asks (ReportKV)."""
        self._connections[0].send(value)

    def answers(self) -> list[Any]:
        """Leader: every other rank's reply to the op just published, in rank order."""
        return [connection.recv() for connection in self._connections]

    def agree(self, name: str, value: Any) -> None:
        """Every rank: check that all ranks hold the same `value` (e.g. their KV block count,
        which the schedulers' decisions depend on); ValueError naming it otherwise."""
        if self.rank != 0:
            self._connections[0].send(value)
            verdict = self._connections[0].recv()
        else:
            values = [value] + [connection.recv() for connection in self._connections]
            verdict = None
            if any(other != value for other in values):
                verdict = (
                    f"the tensor-parallel ranks disagree on {name}: {values} (rank order); they must match, "
                    "e.g. set the KV blocks explicitly (--num-kv-blocks) so every rank allocates the same"
                )
            for connection in self._connections:
                connection.send(verdict)
        if verdict is not None:
            raise ValueError(verdict)

    def close(self) -> None:
        for connection in self._connections:
            connection.close()


class _LockstepHandoff(KVHandoff):
    """The leader's hand-off: the decode side's calls are recorded for the followers (and
    published at once), the prefill side's are refused."""

    def __init__(self, *args: Any, record: Callable[[EngineOp], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._record = record

    def reserve(self, request_id: str, num_prompt_tokens: int, priority: int | None = None) -> list[int]:
        # followers replay the reservation without `priority`: they take what the leader took
        block_ids = super().reserve(request_id, num_prompt_tokens, priority)
        self._record(Reserve(request_id, num_prompt_tokens, tuple(block_ids)))
        return block_ids

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._record(Release(request_id))  # a no-op on every rank alike when nothing was reserved

    def receive(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_tokens: int | Sequence[int],
        params: SamplingParams | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
    ) -> RequestState:
        state = super().receive(request_id, prompt_token_ids, first_tokens, params, priority, arrival_time)
        seq = state.samples[0].seq
        self._record(Receive(request_id, tuple(prompt_token_ids), tuple(first_token_list(first_tokens)), state.params,
                             seq.priority, seq.arrival_time))
        return state

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise FailedPrecondition(
            "this worker runs tensor-parallel ranks (--tensor-parallel-size > 1): it receives KV computed "
            "elsewhere but does not export any (prefill workers and the kvstore's prefix holds run one rank)"
        )

    # the releases stay: no-ops here, since nothing can be exported or held
    export = hold_prefix = publish_hold = _refuse


class LockstepEngine(LLMEngine):
    """Rank 0's engine of a tensor-parallel worker: an `LLMEngine` whose request changes and
    steps are mirrored on the other ranks (see the module docstring). `close()` ends the
    followers' loops, then calls `on_close` (e.g. to reap the rank processes).

    Args:
        config: this rank's engine config.
        channel: the ops' pipes to the other ranks.
        on_close: called once the followers were told to stop.
        rank_links: the leader's end of each follower's KV receiver control pipe (rank
            order), for `cleave.transfer.rank_receivers.RankReceivers`; empty: none.
    """

    def __init__(
        self, config: EngineConfig, channel: LockstepChannel, on_close: Callable[[], None] | None = None,
        rank_links: Sequence[Connection] = (), **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        self._channel = channel
        self._on_close = on_close
        self._ops: list[EngineOp] = []
        self._closed = False
        self.rank_links = list(rank_links)
        self.handoff = _LockstepHandoff(self.kv, self.scheduler, self.max_model_len, requests=weakref.proxy(self),
                                        record=self._publish_now)
        channel.agree("the number of KV blocks", self.runner.num_blocks)

    def _publish_now(self, op: EngineOp) -> None:
        """Send `op`, after the ops recorded before it, without waiting for a step."""
        ops, self._ops = self._ops, []
        ops.append(op)
        self._channel.publish(ops)

    def rank_snapshots(self) -> list[KVSnapshot]:
        """Engine thread: every rank's KV block counts, rank order (each follower answers
        once it applied every op before this call)."""
        self._publish_now(ReportKV())
        return [self.handoff.snapshot(), *self._channel.answers()]

    def enqueue(self, state: RequestState) -> None:
        if state.prefill_only:
            raise FailedPrecondition(
                "prefill-only requests need KV hand-off, which a tensor-parallel worker does not offer yet"
            )
        super().enqueue(state)
        seq = state.samples[0].seq
        self._ops.append(Add(state.request_id, list(state.prompt_token_ids), state.params, seq.priority,
                             seq.arrival_time))

    def abort(self, request_id: str) -> bool:
        found = super().abort(request_id)
        if found:
            self._ops.append(Abort(request_id))
        return found

    def abort_sample(self, request_id: str, index: int) -> bool:
        ended = super().abort_sample(request_id, index)
        if ended:
            self._ops.append(AbortSample(request_id, index))
        return ended

    def step(self) -> list[RequestOutput]:
        ops, self._ops = self._ops, []
        ops.append(Step())
        self._channel.publish(ops)
        return super().step()

    def close(self) -> None:
        """Stop the followers (idempotent); the engine is not stepped after this."""
        if self._closed:
            return
        self._closed = True
        try:
            self._channel.publish([*self._ops, Stop()])  # releases recorded since the last step
        finally:
            self._ops = []
            self._channel.close()
            for link in self.rank_links:
                link.close()
            if self._on_close is not None:
                self._on_close()


def follow(engine: LLMEngine, channel: LockstepChannel) -> int:
    """A follower rank's loop: apply the leader's ops to `engine` until Stop; returns the
    number of steps taken. Raises what the broadcast raises when the leader is gone."""
    channel.agree("the number of KV blocks", engine.runner.num_blocks)
    num_steps = 0
    while True:
        for op in channel.receive():
            if isinstance(op, Step):
                engine.step()
                num_steps += 1
            elif isinstance(op, Add):
                try:
                    state = engine.prepare_request(
                        op.request_id, op.prompt_token_ids, op.params, op.priority, op.arrival_time
                    )
                    engine.enqueue(state)
                except InvalidArgument as error:  # the leader accepted it: the ranks differ
                    raise RuntimeError(f"rank {channel.rank} refused a request rank 0 took: {error}") from error
            elif isinstance(op, Abort):
                engine.abort(op.request_id)
            elif isinstance(op, AbortSample):
                engine.abort_sample(op.request_id, op.index)
            elif isinstance(op, Reserve):
                block_ids = tuple(engine.handoff.reserve(op.request_id, op.num_prompt_tokens))
                if block_ids != op.block_ids:  # the transfer wrote into the leader's ids: the KV is lost
                    raise RuntimeError(
                        f"rank {channel.rank} reserved blocks {list(block_ids)} for {op.request_id!r} where rank 0 "
                        f"reserved {list(op.block_ids)}: the ranks' KV pools diverged")
            elif isinstance(op, Release):
                engine.handoff.release(op.request_id)
            elif isinstance(op, Receive):
                try:
                    engine.handoff.receive(op.request_id, op.prompt_token_ids, op.first_tokens, op.params,
                                           op.priority, op.arrival_time)
                except InvalidArgument as error:
                    raise RuntimeError(f"rank {channel.rank} refused a request rank 0 received: {error}") from error
            elif isinstance(op, ReportKV):
                channel.answer(engine.handoff.snapshot())
            elif isinstance(op, Stop):
                kv = engine.handoff.snapshot()
                log.info("lockstep follower stopped", rank=channel.rank, steps=num_steps,
                         num_free_blocks=kv.num_free_blocks, num_usable_blocks=kv.num_usable_blocks)
                return num_steps
