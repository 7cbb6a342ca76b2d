"""The supervisor restarts a dead child on its address with exponential backoff and gives up
on one that keeps crashing right after its start; `cleave up` checks its ports before anything
loads, and its children die with it (real processes, no model)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleave.cli import _stack
from cleave.cli._ownership import PortInUse, check_ports_free
from cleave.parent_death import follow_parent
from cleave.cli._stack import ProcessStack, StackSpec
from cleave.cli._supervisor import GaveUp, RestartPolicy, Supervisor, describe_exit


class FakeProcess:
    """A child that runs until `exit()`; records its command line."""

    pids = iter(range(1000, 100000))

    def __init__(self, command: list[str], **kwargs: object) -> None:
        self.command = command
        self.pid = next(self.pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code

    def send_signal(self, signum: int) -> None:
        self.returncode = 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        self.returncode = -9


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def stack(monkeypatch, tmp_path):
    """A started stack of fake processes, each with an address."""
    monkeypatch.setattr(_stack.subprocess, "Popen", FakeProcess)

    def healthy(self, children, timeout_s):  # type: ignore[no-untyped-def]
        for child in children:
            child.address = f"127.0.0.1:{50000 + self.children.index(child)}"

    monkeypatch.setattr(ProcessStack, "_wait_healthy", healthy)
    monkeypatch.setattr(ProcessStack, "_wait_attached", lambda self, decode, num_gateways, timeout_s: None)
    running = ProcessStack(StackSpec(model=Path("/m"), num_decode=2, grpc_port=0, http_port=None), tmp_path)
    running.start()
    yield running
    running.stop()


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_a_dead_worker_restarts_on_its_address_with_growing_backoff(stack):
    clock, lines = Clock(), []
    supervisor = Supervisor(stack, RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, fast_crash_s=30.0),
                            say=lines.append, clock=clock)
    decode = next(child for child in stack.children if child.name == "decode-1")
    address, started_at = decode.address, decode.started_at
    clock.now = started_at + 100  # it served a while, then died
    decode.process.exit(-9)
    assert supervisor.poll() == []
    assert lines == ["decode-1 exited with signal SIGKILL after 100.0 s; restarting in 0.5 s"]
    clock.now += 0.4
    assert supervisor.poll() == []  # not yet due
    clock.now += 0.2
    (restarted,) = supervisor.poll()
    assert restarted.name == "decode-1" and restarted.address == address
    assert _flag(restarted.process.command, "--listen") == address  # peers keep the address
    assert stack.children[[c.name for c in stack.children].index("decode-1")] is restarted
    others = {child.name: child.process.returncode for child in stack.children}
    assert others == dict.fromkeys(others)  # nothing else was touched
    delays = []
    for _ in range(3):  # crashes right after each start: the wait doubles
        restarted.started_at = clock.now
        restarted.process.exit(1)
        supervisor.poll()
        delays.append(lines[-1].rsplit("restarting in ", 1)[1])
        clock.now += 10
        (restarted,) = supervisor.poll()
    assert delays == ["1 s", "2 s", "4 s"]


def test_a_child_that_keeps_crashing_at_start_is_given_up_naming_it(stack):
    clock = Clock()
    supervisor = Supervisor(stack, RestartPolicy(max_fast_crashes=3), say=lambda line: None, clock=clock)
    child = next(child for child in stack.children if child.name == "kvstore")
    child.log_path.write_text("Traceback...\nValueError: bad flag\n")
    with pytest.raises(GaveUp, match=r"(?s)kvstore crashed 3 times in a row.*\(last: code 3\).*ValueError: bad flag"):
        for _ in range(10):
            child.started_at = clock.now
            child.process.exit(3)
            supervisor.poll()
            clock.now += 100
            (child,) = supervisor.poll()
            child.log_path.write_text("Traceback...\nValueError: bad flag\n")


def test_a_restarted_gateway_keeps_its_ports(monkeypatch, tmp_path):
    monkeypatch.setattr(_stack.subprocess, "Popen", FakeProcess)
    def healthy(self, children, timeout_s):  # type: ignore[no-untyped-def]
        for child in children:
            child.address = "127.0.0.1:41234"
            if "--http-port-file" in child.process.command:  # the gateway reports the HTTP port it bound
                Path(_flag(child.process.command, "--http-port-file")).write_text("41235\n")

    monkeypatch.setattr(ProcessStack, "_wait_healthy", healthy)
    monkeypatch.setattr(ProcessStack, "_wait_attached", lambda self, decode, num_gateways, timeout_s: None)
    stack = ProcessStack(StackSpec(model=Path("/m"), grpc_port=0, http_port=0), tmp_path)
    stack.start()
    try:
        gateway = stack.gateway
        assert _flag(gateway.process.command, "--http-listen") == "127.0.0.1:0"
        assert stack.http_port == 41235 and stack.http_url == "http://127.0.0.1:41235/v1"
        gateway.process.exit(1)
        restarted = stack.restart(gateway)
        assert _flag(restarted.process.command, "--listen") == "127.0.0.1:41234"
        assert _flag(restarted.process.command, "--http-listen") == "127.0.0.1:41235"
        assert "--http-port-file" not in restarted.process.command
        assert stack.gateway is restarted
    finally:
        stack.stop()


def test_describe_exit():
    assert describe_exit(-15) == "signal SIGTERM"
    assert describe_exit(2) == "code 2"


def test_a_busy_port_fails_before_anything_starts(monkeypatch, tmp_path):
    spawned = []
    monkeypatch.setattr(_stack.subprocess, "Popen", lambda *args, **kwargs: spawned.append(args))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        stack = ProcessStack(StackSpec(model=Path("/m"), grpc_port=port, http_port=0), tmp_path)
        with pytest.raises(PortInUse, match=rf"port {port} on 127.0.0.1 \(gateway gRPC, --grpc-port\) is in use"):
            stack.start()
        with pytest.raises(PortInUse, match="gateway HTTP, --http-port"):
            check_ports_free("127.0.0.1", [(0, "any"), (port, "gateway HTTP, --http-port")])
    assert spawned == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_children_die_with_their_parent(tmp_path):
    """A child that follows its parent's pid (as services do with --parent-pid), and the
    parent SIGKILLed with no cleanup of its own: the kernel sends the child SIGTERM."""
    pid_file = tmp_path / "child.pid"
    child_code = (
        "import os, sys, time\n"
        "from cleave.parent_death import follow_parent\n"
        "assert follow_parent(int(sys.argv[1]))\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    parent_code = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child_code!r}, str(os.getpid())], start_new_session=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None, "the parent did not start its child"
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while _alive(child_pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        if pid_file.is_file() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_child_whose_parent_is_gone_already_signals_itself():
    """Following a parent that died before the request: the signal comes at once (in a
    child process: the request would outlive the test in this one)."""
    code = (
        "import os, signal, sys, time\n"
        "from cleave.parent_death import follow_parent\n"
        "signal.signal(signal.SIGTERM, lambda *_: os._exit(7))\n"
        "assert not follow_parent(None)\n"
        "follow_parent(os.getppid() + 1_000_000)\n"
        "time.sleep(60)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 7
