"""The tensor-parallel ranks of one worker, stepping one engine in lockstep.

Every rank of a tensor-parallel worker runs a whole `LLMEngine` over its shard of the model
(`cleave.parallel`): the same scheduler decisions, block tables and sampled tokens, since the
logits are gathered to every rank and sampling is seeded alike. Only rank 0, the leader,
serves RPCs. So that the followers' engines see what the leader's sees, in the same order
between the same steps, the leader records every call that changes which requests run, and
before each step broadcasts the calls since the last one with the step; a follower applies
them and steps too, dropping its outputs:

    leader (rank 0: the worker's engine)       follower (rank r: `follow`)
    enqueue(state)          -> Add
    abort(id)               -> Abort
    step()                  -> [Add, Abort, Step]   enqueue, abort, step
    close()                 -> [Stop]               returns

The model's collectives inside a step line up because every rank runs the same step. The ops
travel over pipes (`LockstepChannel`), not the process group: a rank idles in a read for as
long as its worker idles, and a step costs the leader one small write per rank.

Not mirrored yet: the KV hand-off between workers (reserve/receive/export, the kvstore's
prefix holds), which would need every rank's KV slice moved by a transport of its own. A
lockstep engine refuses those calls (FailedPrecondition) and prefill-only requests, so a
tensor-parallel worker serves the requests it prefills itself.
"""

from __future__ import annotations

import pickle
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from collections.abc import Callable
from typing import Any, Union

import structlog

from cleave.engine.config import EngineConfig
from cleave.engine.handoff import KVHandoff
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
class Step:
    pass


@dataclass(frozen=True)
class Stop:
    pass


EngineOp = Union[Add, Abort, AbortSample, Step, Stop]


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


class _LocalOnlyHandoff(KVHandoff):
    """The leader's hand-off: lookups work, taking KV in or out of the engine is refused."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise FailedPrecondition(
            "this worker runs tensor-parallel ranks (--tensor-parallel-size > 1) and serves only requests it "
            "prefills itself; KV hand-off between workers is not available on it yet"
        )

    # the releases stay: no-ops here, since nothing can be exported, held or reserved
    export = hold_prefix = publish_hold = reserve = receive = _refuse


class LockstepEngine(LLMEngine):
    """Rank 0's engine of a tensor-parallel worker: an `LLMEngine` whose request changes and
    steps are mirrored on the other ranks (see the module docstring). `close()` ends the
    followers' loops, then calls `on_close` (e.g. to reap the rank processes)."""

    def __init__(
        self, config: EngineConfig, channel: LockstepChannel, on_close: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        self._channel = channel
        self._on_close = on_close
        self._ops: list[EngineOp] = []
        self._closed = False
        self.handoff = _LocalOnlyHandoff(self.kv, self.scheduler, self.max_model_len, requests=weakref.proxy(self))
        channel.agree("the number of KV blocks", self.runner.num_blocks)

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
            self._channel.publish([Stop()])
        finally:
            self._channel.close()
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
            elif isinstance(op, Stop):
                log.info("lockstep follower stopped", rank=channel.rank, steps=num_steps)
                return num_steps
