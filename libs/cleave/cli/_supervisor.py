"""Restarting the stack's dead children while the rest keeps serving.

`cleave up` calls `Supervisor.poll()` in its wait loop. A child that exited (crashed, was
killed, or drained and stopped on a SIGTERM from outside) is started again by
`ProcessStack.restart` on the same address, so its peers need no new configuration: the
gateway's health checks see a restarted worker SERVING and route to it again (and, meanwhile,
its migration moved the dead decode worker's streams to the others); prefill workers'
channels reconnect to a restarted kvstore or decode worker by themselves.

Backoff: the first restart after a child ran a while waits `initial_backoff_s`; each crash
within `fast_crash_s` of its start doubles the wait (up to `max_backoff_s`); after
`max_fast_crashes` such crashes in a row the supervisor gives up (`GaveUp`, naming the child,
its exit code and its log), since restarting it again would only crash again.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cleave.cli._stack import Child, ProcessStack


@dataclass(frozen=True)
class RestartPolicy:
    """How soon and how often a dead child is started again."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    fast_crash_s: float = 30.0  # a child that exits sooner than this after its start crashed fast
    max_fast_crashes: int = 5  # fast crashes in a row before giving up


class GaveUp(RuntimeError):
    """A child kept crashing right after its start; the stack cannot heal it."""


@dataclass
class _Record:
    """One child name's restart history."""

    fast_crashes: int = 0
    restarts: int = 0
    due: float | None = None  # when the pending restart runs (monotonic)


def describe_exit(returncode: int | None) -> str:
    """`code 1`, or `signal SIGKILL` for a child a signal ended."""
    if returncode is not None and returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


@dataclass
class Supervisor:
    """Restarts the exited children of a started `ProcessStack` (see the module docstring).

    Args:
        stack: the started stack.
        policy: backoff and give-up limits.
        say: where each restart is reported (one line each).
        clock: monotonic seconds (tests pass a fake one).
    """

    stack: ProcessStack
    policy: RestartPolicy = RestartPolicy()
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    _records: dict[str, _Record] = field(default_factory=dict)

    def poll(self) -> list[Child]:
        """Schedule restarts of newly exited children and run those that are due; returns
        the children started now. Raises GaveUp when one crashed too often in a row."""
        now = self.clock()
        started = []
        for child in list(self.stack.children):
            if child.process.poll() is None:
                continue
            record = self._records.setdefault(child.name, _Record())
            if record.due is None:
                self._schedule(child, record, now)
            elif now >= record.due:
                record.due = None
                record.restarts += 1
                restarted = self.stack.restart(child)
                self.say(f"{child.name} restarted (restart {record.restarts}, pid {restarted.process.pid}) "
                         f"on {restarted.address or 'a new port'}")
                started.append(restarted)
        return started

    def _schedule(self, child: Child, record: _Record, now: float) -> None:
        policy = self.policy
        ran_s = now - child.started_at
        record.fast_crashes = record.fast_crashes + 1 if ran_s < policy.fast_crash_s else 0
        how = describe_exit(child.process.returncode)
        if record.fast_crashes >= policy.max_fast_crashes:
            raise GaveUp(
                f"{child.name} crashed {record.fast_crashes} times in a row, each within "
                f"{policy.fast_crash_s:g} s of its start (last: {how}); giving up. Its log ({child.log_path}) "
                f"ends with:\n"
                f"{child.log_tail()}"
            )
        delay = min(policy.initial_backoff_s * 2 ** record.fast_crashes, policy.max_backoff_s)
        record.due = now + delay
        self.say(f"{child.name} exited with {how} after {ran_s:.1f} s; restarting in {delay:g} s")


class SupervisedStack:
    """A started ProcessStack whose supervisor is polled on a thread of its own, as `cleave up`
    polls it on its main loop (benchmarks and tests that kill children use it). The thread
    lives as long as the stack: children it restarts die with it (`cleave.parent_death`).

    Attributes:
        lines: what the supervisor said (restarts, give-ups).
        gave_up: the supervisor's GaveUp, once it gave up (polling then stops).
    """

    def __init__(self, stack: ProcessStack, policy: RestartPolicy = RestartPolicy(initial_backoff_s=0.2)) -> None:
        self.stack = stack
        self.lines: list[str] = []
        self.gave_up: GaveUp | None = None
        self.supervisor = Supervisor(stack, policy, say=self.lines.append)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(0.1):
            try:
                self.supervisor.poll()
            except GaveUp as error:
                self.gave_up = error
                return

    def child(self, name: str) -> Child:
        return next(child for child in self.stack.children if child.name == name)

    def wait_restarted(self, old: Child, timeout_s: float = 120.0) -> Child | None:
        """The child that replaced `old` once SERVING on its address; None past the timeout
        (a guard against a hang) or once the supervisor gave up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.gave_up is None:
            new = self.child(old.name)
            if new is not old and new.process.poll() is None and self.stack.is_serving(new):
                return new
            time.sleep(0.05)
        return None

    def close(self) -> None:
        """Stop polling, then stop the stack."""
        self._stopping.set()
        self._thread.join()
        self.stack.stop()
