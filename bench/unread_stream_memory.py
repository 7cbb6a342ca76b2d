"""A gateway's memory while one client does not read its stream beside a busy decode worker.

A decode worker's Attach stream brings one `StepOutput` a step with the deltas of every
request of the gateway there; `AttachStream` drops each delta into its request's queue. Here
a fake worker sends `--steps` steps of `--batch` requests (each step parsed from its bytes,
as gRPC's deserializer does), `--batch` - 1 requests are read as they arrive, and one request
is never read, as a stalled or hostile client leaves it. The table gives the process's
resident memory grown over the run, with the deltas queued as they came (`views`: each keeps
its whole step's parse alive), copied when queued behind another (`detached`: a message a
delta), and as the gateway queues them (`merged`: `services.gateway.delta_queue.DeltaQueue`,
a lagging sample's deltas merged into one copy), and the event loop's time a step (the reader
filing the step, the readers taking their deltas). Each case runs in a process of its own.

    python bench/unread_stream_memory.py --out bench/results/gateway
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import format_table, run_name, write_results  # noqa: E402

from cleave.proto.cleave.v1 import common_pb2, decode_pb2  # noqa: E402
from services.gateway import attach  # noqa: E402
from services.gateway.delta_queue import DeltaQueue, detached  # noqa: E402

COLUMNS = ["mode", "batch", "top_logprobs", "steps", "queued_deltas", "rss_growth_mb", "loop_us_per_step"]
UNREAD = "req-unread"


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


def _step_bytes(batch: int, top_logprobs: int) -> bytes:
    step = decode_pb2.StepOutput(step=1)
    for index in range(batch):
        request_id = UNREAD if index == 0 else f"req-{index:06d}"
        delta = step.deltas.add(request_id=request_id, sample_index=0, token_ids=[1000 + index])
        if top_logprobs:
            scores = delta.logprobs.add()
            scores.sampled.token_id, scores.sampled.logprob = 1000 + index, -0.5
            for rank in range(top_logprobs):
                entry = scores.top.add()
                entry.token_id, entry.logprob = rank, -1.0 - rank
    return step.SerializeToString()


class _Call:
    """The worker's side of an Attach stream: `steps` parses of one step's bytes."""

    def __init__(self, data: bytes, steps: int) -> None:
        self.data, self.steps, self.reader_s = data, steps, 0.0

    def cancel(self) -> bool:
        return True

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for _ in range(self.steps):
            step = decode_pb2.StepOutput.FromString(self.data)
            start = time.perf_counter()
            yield step
            await asyncio.sleep(0)  # the reader files this step; the readers' tasks drain their queues
            self.reader_s += time.perf_counter() - start
            await asyncio.sleep(0)


class _CopyingQueue(asyncio.Queue):
    """The `detached` mode: a delta queued behind another is copied, never merged."""

    def _put(self, item: object) -> None:
        self._queue.append(detached(item) if self._queue and isinstance(item, decode_pb2.RequestDelta) else item)


QUEUES = {"views": asyncio.Queue, "detached": _CopyingQueue, "merged": DeltaQueue}


async def _one_case(mode: str, batch: int, top_logprobs: int, steps: int) -> dict:
    queue_type = QUEUES[mode]
    call = _Call(_step_bytes(batch, top_logprobs), steps)
    worker = SimpleNamespace(address="fake:0", load=common_pb2.WorkerLoad(),
                             stub=SimpleNamespace(Attach=lambda request: call))
    stream = attach.AttachStream(worker, "gateway-0")  # type: ignore[arg-type]
    stream.is_open = True
    unread = stream.register(UNREAD, queue_type())  # type: ignore[arg-type]
    queues = [stream.register(f"req-{index:06d}", queue_type()) for index in range(1, batch)]  # type: ignore[arg-type]

    async def drain(queue: asyncio.Queue) -> None:
        while True:
            await queue.get()

    readers = [asyncio.create_task(drain(queue)) for queue in queues]
    before = _rss_mb()
    stream.open()
    await stream._task  # type: ignore[misc]  # ends with the steps (a WorkerLost into every queue)
    grown = _rss_mb() - before
    for task in readers:
        task.cancel()
    held = [unread.get_nowait() for _ in range(unread.qsize())]
    assert isinstance(held.pop(), attach.WorkerLost)  # the stream's end, after every delta:
    assert sum(len(delta.token_ids) for delta in held) == steps, len(held)
    return {"mode": mode, "batch": batch, "top_logprobs": top_logprobs, "steps": steps, "queued_deltas": len(held),
            "rss_growth_mb": round(grown, 1), "loop_us_per_step": round(call.reader_s / steps * 1e6, 1)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--top-logprobs", default="0,5", help="comma-separated")
    parser.add_argument("--modes", default="views,detached,merged")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # MODE:TOP_LOGPROBS, in a child process
    args = parser.parse_args(argv)
    if args.one:
        mode, top = args.one.split(":")
        print(json.dumps(asyncio.run(_one_case(mode, args.batch, int(top), args.steps))))
        return []
    rows = []
    for top in (int(value) for value in args.top_logprobs.split(",")):
        for mode in args.modes.split(","):
            child = subprocess.run([sys.executable, __file__, "--one", f"{mode}:{top}", "--batch", str(args.batch),
                                    "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(format_table(rows[-1:], COLUMNS), flush=True)
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("unread-stream-memory"), rows, COLUMNS, argv=argv)
    return rows


if __name__ == "__main__":
    main()
