"""A worker's tensor-parallel ranks: the worker process is rank 0 and starts ranks 1..N-1.

    worker (rank 0)                                  rank r (spawned process)
    start_lockstep_engine(config)
      spawn ranks 1..N-1, two pipes to each ---->    init_process_group(rank r)
      init_process_group(rank 0)                     LLMEngine(config on device r)
      LockstepEngine(config) ... agree on blocks ... FollowerReceiver (thread) + follow(engine, channel)
      ... serve; engine.close() -> Stop ---------->  returns, process exits

Ranks meet over TCP on a free loopback port. The model's collectives run on the default
group (NCCL on GPUs, gloo on the CPU); the engine's ops go over one pipe per rank
(`LockstepChannel`, read at step boundaries), and each rank's KV receiver is driven over a
second pipe (`LockstepEngine.rank_links` -> `cleave.transfer.rank_receivers.RankReceivers`
on rank 0, `cleave.worker.rank_receiver.FollowerReceiver` on rank r), read at any time: a
decode worker's ranks each take their slice of a prompt's KV from a prefill worker. That
path is CPU-tested over TCP with gloo ranks; NCCL or CUDA IPC into the extra ranks, and
several GPUs, are untested. On CUDA, rank r of a worker on `cuda:K` runs on `cuda:K+r`. A
rank process ends with its worker (the kernel signals it when the worker dies) and stops
after the worker's Stop.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from dataclasses import replace
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from cleave.engine.config import EngineConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.lockstep import LockstepChannel, LockstepEngine, follow
from cleave.parent_death import follow_parent
from cleave.worker.kv_layout import kv_layout_of
from cleave.worker.rank_receiver import FollowerReceiver

log = structlog.get_logger(__name__)

# The model's collectives: a rank that stops answering fails the step after this.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
STOP_WAIT_S = 30.0


def rank_device(device: str, rank: int) -> str:
    """The device of `rank` for a worker on `device`: cuda:K -> cuda:K+rank; cpu stays."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def start_lockstep_engine(config: EngineConfig) -> LockstepEngine:
    """Rank 0's engine of a worker with `config.tensor_parallel_size` > 1, its other ranks
    started and loaded. Blocking (minutes on a large model): call it off the event loop.
    If any rank fails to start, every started rank is ended and the error raised."""
    size = config.tensor_parallel_size
    # the group's rendezvous store, bound here on any free port before a rank is started (a port
    # picked, released and passed on could be taken in between)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    port = store.port
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(1, size)]
    controls = [context.Pipe() for _ in range(1, size)]  # the ranks' KV receivers
    processes = [
        context.Process(target=_rank_main, args=(rank, port, config, os.getpid(), pipe[1], control[1]),
                        name=f"cleave-rank{rank}", daemon=True)
        for rank, (pipe, control) in enumerate(zip(pipes, controls), start=1)
    ]
    for process, (_, rank_end), (_, control_end) in zip(processes, pipes, controls):
        process.start()
        rank_end.close()  # the rank's copy lives in its process: EOF reaches each side when the other ends
        control_end.close()

    def stop_ranks() -> None:
        _join_or_end(processes)
        if dist.is_initialized():
            dist.destroy_process_group()

    try:
        _join_group(0, size, port, config.device, store)
        channel = LockstepChannel(0, [leader_end for leader_end, _ in pipes])
        engine = LockstepEngine(replace(config, device=rank_device(config.device, 0)), channel, on_close=stop_ranks,
                                rank_links=[leader_end for leader_end, _ in controls])
    except BaseException:
        for leader_end, _ in controls:
            leader_end.close()
        for process in processes:
            if process.is_alive():
                process.kill()
        stop_ranks()
        raise
    log.info("tensor-parallel ranks started", world_size=size, pids=[process.pid for process in processes])
    return engine


def _rank_main(rank: int, port: int, config: EngineConfig, parent_pid: int, connection: Connection,
               control: Connection) -> None:
    """Rank `rank`'s process: join the group, load the shard, serve its KV receiver for
    rank 0 (`control`) and follow rank 0 until Stop."""
    follow_parent(parent_pid, signal.SIGKILL)  # nothing to drain: rank 0 holds every request
    _join_group(rank, config.tensor_parallel_size, port, config.device)
    channel = LockstepChannel(rank, [connection])
    receiver: FollowerReceiver | None = None
    try:
        engine = LLMEngine(replace(config, device=rank_device(config.device, rank)))
        receiver = FollowerReceiver(rank, engine.kv_cache, control, lambda model_id: kv_layout_of(engine, model_id))
        receiver.start()
        follow(engine, channel)
    finally:
        if receiver is not None:
            receiver.stop()
        control.close()
        channel.close()
        dist.destroy_process_group()


def _join_group(rank: int, size: int, port: int, device: str, store: dist.Store | None = None) -> None:
    """Join the ranks' process group: rank 0 through the `store` it serves, the others through
    its port."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank_device(device, rank))
        backend = "nccl"
    else:
        # ranks share the host's cores: each takes its share of the intra-op threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        backend = "gloo"
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)


def _join_or_end(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Wait for the rank processes to exit after Stop; end those that do not."""
    for process in processes:
        process.join(timeout=STOP_WAIT_S)
        if process.is_alive():
            log.warning("tensor-parallel rank did not stop; ending it", pid=process.pid)
            process.kill()
            process.join()

