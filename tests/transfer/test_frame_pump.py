"""FramePump: frames leave in submission order as their copies finish, merged when several
finished together, without waiting on anything but the oldest pending copy."""

from __future__ import annotations

import asyncio

import pytest

from cleave.transfer.frame_pump import FramePump


class FakeCompletion:
    """Device work that the test finishes by hand."""

    def __init__(self, done: bool = False) -> None:
        self._event = asyncio.Event()
        if done:
            self._event.set()
        self.num_waits = 0

    def finish(self) -> None:
        self._event.set()

    def query(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        self.num_waits += 1
        await self._event.wait()


class Frames:
    def __init__(self, fail_on: int | None = None) -> None:
        self.written: list[range] = []
        self.fail_on = fail_on

    async def write(self, layers: range) -> None:
        if self.fail_on is not None and layers.start == self.fail_on:
            raise ConnectionError("receiver went away")
        self.written.append(layers)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_frames_wait_for_their_copy_and_keep_order():
    frames = Frames()
    pump = FramePump(frames.write)
    first, second = FakeCompletion(), FakeCompletion()
    pump.submit(range(0, 1), first)
    pump.submit(range(1, 2), second)
    second.finish()  # a later copy finishing first does not overtake the earlier frame
    await settle()
    assert frames.written == []
    first.finish()
    await pump.flush()
    assert frames.written == [range(0, 2)]  # both done together: one frame
    assert pump.num_frames == 1 and pump.num_pending == 0


async def test_ready_runs_merge_and_gaps_split_frames():
    frames = Frames()
    pump = FramePump(frames.write)
    gate = FakeCompletion()
    pump.submit(range(0, 2), gate)
    for layers in (range(2, 3), range(3, 4), range(6, 8)):
        pump.submit(layers, FakeCompletion(done=True))
    late = FakeCompletion()
    pump.submit(range(8, 9), late)
    gate.finish()
    await settle()
    assert frames.written == [range(0, 4), range(6, 8)]
    late.finish()
    await pump.flush()
    assert frames.written == [range(0, 4), range(6, 8), range(8, 9)]
    # Submitting after a flush starts writing again.
    pump.submit(range(9, 10), FakeCompletion(done=True))
    await pump.flush()
    assert frames.written[-1] == range(9, 10) and pump.num_frames == 4


async def test_a_write_error_reaches_flush_and_later_submits():
    frames = Frames(fail_on=1)
    pump = FramePump(frames.write)
    pump.submit(range(0, 1), FakeCompletion(done=True))
    await settle()
    pump.submit(range(1, 2), FakeCompletion(done=True))
    with pytest.raises(ConnectionError):
        await pump.flush()
    assert frames.written == [range(0, 1)]
    with pytest.raises(ConnectionError):
        pump.submit(range(2, 3), FakeCompletion(done=True))


async def test_close_writes_nothing_more_but_waits_for_queued_copies():
    frames = Frames()
    pump = FramePump(frames.write)
    copies = [FakeCompletion(), FakeCompletion()]
    pump.submit(range(0, 1), copies[0])
    pump.submit(range(1, 2), copies[1])
    await settle()
    closing = asyncio.ensure_future(pump.close())
    await settle()
    assert not closing.done()  # the copies still run: their blocks must not be freed yet
    copies[0].finish()
    copies[1].finish()
    await asyncio.wait_for(closing, 1.0)
    assert frames.written == [] and pump.num_pending == 0
