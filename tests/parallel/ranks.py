"""Run one function in N processes joined by a gloo process group: the CPU stand-in for N
GPUs of a tensor-parallel pool.

`run_ranks(program, world_size, *args)` spawns the ranks, each of which joins the group through
a rendezvous store the parent serves on a free local port (bound before the ranks start), calls `program(group, *args)` and saves what it returns; the parent
waits on the processes' exits (not on sleeps) up to a deadline that starts once every rank has
joined (spawning and importing torch take what they take on a busy machine; a rank that never
joins fails on the group's own timeout) and ends every process it started on every path, so a
hung collective fails the test instead of hanging it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cleave.parallel.group import TensorParallelGroup

DEFAULT_TIMEOUT_S = 240.0
POLL_S = 0.25  # how often the parent looks for the ranks' joined marks while none has exited
# a collective whose peer is gone fails after this instead of waiting forever
COLLECTIVE_TIMEOUT = timedelta(seconds=90)


def run_ranks(
    program: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """What `program(group, *args)` returned on each rank, in rank order.

    `program` must be a module-level function (the ranks are spawned, not forked). A rank's
    exception is raised here with its traceback; ranks still running `timeout_s` after every
    rank joined the group are ended and TimeoutError is raised.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="cleave-tp-") as out_dir:
        context = mp.start_processes(
            _rank_main, args=(world_size, store.port, out_dir, program, args), nprocs=world_size, join=False,
            start_method="spawn",
        )
        try:
            deadline = None
            while not context.join(timeout=POLL_S if deadline is None else max(0.0, deadline - time.monotonic())):
                if deadline is None:
                    if all((Path(out_dir) / f"rank{rank}.joined").exists() for rank in range(world_size)):
                        deadline = time.monotonic() + timeout_s
                elif time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{world_size} tensor-parallel ranks still running {timeout_s:g} s after they joined")
        finally:
            _end(context.processes)
        return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world_size)]


def _rank_main(
    rank: int, world_size: int, port: int, out_dir: str, program: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)  # two ranks share a small CPU; oversubscribed threads crawl
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    (Path(out_dir) / f"rank{rank}.joined").touch()
    try:
        result = program(TensorParallelGroup.from_process_group(), *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _end(processes: list) -> None:  # type: ignore[type-arg]
    """Terminate, then kill, every process still alive; reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
