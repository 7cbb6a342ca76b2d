"""AdmissionQueue at its edges, over a pool of free blocks: first come first served within a
priority (a small prompt never overtakes a larger one that waits), a lower priority value
ahead of every higher one, only the head tries, a head that leaves hands its turn on, a short
head keeps waiting, and a drain fails everyone who waits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from cleave.errors import ResourceExhausted, Unavailable
from cleave.kv.block_pool import OutOfBlocksError
from services.decode.admission_queue import AdmissionQueue

TIMEOUT_S = 5.0  # a guard: every wait below ends at once unless the queue forgets someone


class Pool:
    """Free blocks that `attempt` reserves (OutOfBlocksError when too few); `free` gives
    blocks back and wakes the queue, as a finished engine step does."""

    def __init__(self, queue: AdmissionQueue, num_free: int) -> None:
        self.queue = queue
        self.num_free = num_free
        self.admitted: list[str] = []  # in the order the reservations succeeded
        self.num_attempts = 0

    def attempt(self, name: str, num_blocks: int):  # type: ignore[no-untyped-def]
        async def reserve() -> list[int]:
            self.num_attempts += 1
            if num_blocks > self.num_free:
                raise OutOfBlocksError(f"{name} needs {num_blocks} blocks, {self.num_free} are free")
            self.num_free -= num_blocks
            self.admitted.append(name)
            return list(range(num_blocks))

        return reserve

    def free(self, num_blocks: int) -> None:
        self.num_free += num_blocks
        self.queue.wake()


def admit(pool: Pool, name: str, num_blocks: int, priority: int = 0) -> asyncio.Task:
    return asyncio.ensure_future(pool.queue.reserve(pool.attempt(name, num_blocks), priority))


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run until `condition` holds (each step gets there in one pass; no timed
    sleep), failing after TIMEOUT_S."""
    async def passes() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(passes(), TIMEOUT_S)


async def until_waiting(queue: AdmissionQueue, count: int) -> None:
    await until(lambda: queue.num_waiting >= count)


async def test_a_small_prompt_waits_behind_a_larger_one_that_came_first():
    queue = AdmissionQueue()
    pool = Pool(queue, num_free=4)
    large = admit(pool, "large", 8)
    await until_waiting(queue, 1)
    small = admit(pool, "small", 2)  # it would fit in the 4 free blocks, but "large" came first
    await until_waiting(queue, 2)
    assert pool.admitted == [] and pool.num_free == 4
    pool.free(6)
    assert await asyncio.wait_for(asyncio.gather(large, small), TIMEOUT_S) == [list(range(8)), list(range(2))]
    assert pool.admitted == ["large", "small"] and queue.num_waiting == 0


async def test_a_lower_priority_value_goes_ahead_of_everyone_waiting_at_a_higher_one():
    queue = AdmissionQueue()
    pool = Pool(queue, num_free=0)
    batch = [admit(pool, f"batch{index}", 2, priority=5) for index in range(2)]
    await until_waiting(queue, 2)
    assert pool.num_attempts == 1  # the first tried (nobody waited), the second queued behind it
    plain = admit(pool, "plain", 2)  # tries at once: nobody waits at 0 or lower
    await until_waiting(queue, 3)
    urgent = admit(pool, "urgent", 2, priority=-1)
    await until_waiting(queue, 4)
    assert pool.num_attempts == 3 and pool.admitted == []
    later = admit(pool, "batch-later", 2, priority=5)
    await until_waiting(queue, 5)
    for expected in (["urgent"], ["urgent", "plain"], ["urgent", "plain", "batch0"]):
        pool.free(2)
        await until(lambda: len(pool.admitted) == len(expected))
        assert pool.admitted == expected
    pool.free(4)
    await asyncio.wait_for(asyncio.gather(urgent, plain, *batch, later), TIMEOUT_S)
    assert pool.admitted == ["urgent", "plain", "batch0", "batch1", "batch-later"] and queue.num_waiting == 0


async def test_an_urgent_admission_that_fits_takes_the_blocks_a_waiting_larger_one_needs():
    """A lower priority value than every waiting admission tries at once, so it may take free
    blocks the waiting head is short of: priority first, then arrival."""
    queue = AdmissionQueue()
    pool = Pool(queue, num_free=3)
    large = admit(pool, "large", 4)
    await until_waiting(queue, 1)
    assert await asyncio.wait_for(queue.reserve(pool.attempt("urgent", 2), -1), TIMEOUT_S) == [0, 1]
    same = admit(pool, "same", 1)  # its priority is the waiting head's: it queues behind it
    await until_waiting(queue, 2)
    assert pool.admitted == ["urgent"]
    pool.free(5)
    await asyncio.wait_for(asyncio.gather(large, same), TIMEOUT_S)
    assert pool.admitted == ["urgent", "large", "same"]


async def test_an_admitted_head_lets_the_next_one_try_with_what_is_left():
    """One freed batch of blocks is enough for both: the step wakes the head alone, and the
    head wakes the next as it leaves."""
    queue = AdmissionQueue()
    pool = Pool(queue, num_free=0)
    first, second = admit(pool, "first", 2), admit(pool, "second", 2)
    await until_waiting(queue, 2)
    pool.free(4)
    await asyncio.wait_for(asyncio.gather(first, second), TIMEOUT_S)
    assert pool.admitted == ["first", "second"] and (pool.num_free, queue.num_waiting) == (0, 0)


async def test_a_cancelled_head_hands_its_turn_to_the_next():
    queue = AdmissionQueue()
    pool = Pool(queue, num_free=0)
    gone, next_one = admit(pool, "gone", 2), admit(pool, "next", 2)
    await until_waiting(queue, 2)
    pool.free(2)  # wakes "gone", which is cancelled before it runs
    gone.cancel()
    assert await asyncio.wait_for(next_one, TIMEOUT_S) == [0, 1]
    assert gone.cancelled() and pool.admitted == ["next"] and queue.num_waiting == 0


async def test_a_head_still_short_of_blocks_keeps_waiting_for_the_next_free():
    queue = AdmissionQueue()
    pool = Pool(queue, num_free=0)
    waiting = admit(pool, "big", 4)
    await until_waiting(queue, 1)
    pool.free(3)  # not enough yet: it tries, fails and waits again
    await until(lambda: pool.num_attempts >= 2)
    assert not waiting.done() and queue.num_waiting == 1
    pool.free(1)
    assert await asyncio.wait_for(waiting, TIMEOUT_S) == [0, 1, 2, 3]


async def test_fail_all_ends_every_waiting_admission_with_the_error():
    queue = AdmissionQueue()
    pool = Pool(queue, num_free=0)
    waiting = [admit(pool, f"r{index}", 1) for index in range(3)]
    await until_waiting(queue, 3)
    draining = Unavailable("the decode worker is draining")
    queue.fail_all(draining)
    results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), TIMEOUT_S)
    assert results == [draining] * 3 and queue.num_waiting == 0
    pool.free(3)  # nobody is left to take them
    assert pool.admitted == []


async def test_a_full_queue_refuses_with_a_retry_hint():
    queue = AdmissionQueue(max_waiting=1)
    pool = Pool(queue, num_free=0)
    waiting = admit(pool, "waits", 1)
    await until_waiting(queue, 1)
    with pytest.raises(ResourceExhausted) as refused:
        await queue.reserve(pool.attempt("refused", 1))
    assert not isinstance(refused.value, OutOfBlocksError) and refused.value.retry_after_s == 1.0
    assert "--max-queued-admissions 1" in str(refused.value)
    pool.free(1)
    assert await asyncio.wait_for(waiting, TIMEOUT_S) == [0]
