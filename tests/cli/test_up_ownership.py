"""`cleave up` leaves no process behind: Ctrl-C after its stdout pipe closed (`cleave up | tee`
whose tee died first; and started with SIGINT ignored, as a shell starts `cleave up &`) and a
closed terminal (SIGHUP) both stop every child; a busy port fails at once, naming it, before
any worker loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleave.testing.tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("up") / "model")


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _up(model: Path, workdir: Path) -> subprocess.Popen:
    """`cleave up` as a script's `cleave up &` starts it: with SIGINT ignored, which it inherits
    (the shell's `trap "" INT`, kept across its exec)."""
    command = [sys.executable, "-m", "cleave.cli.main", "up", "--model", str(model), "--mode", "colocated",
               "--grpc-port", "0", "--http-port", "-1", "--workdir", str(workdir), "--num-kv-blocks", "256"]
    return subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["ctrl-c with stdout closed", "terminal closed"])
def test_every_child_stops_with_cleave_up(tiny_model, tmp_path, how):
    up = _up(tiny_model, tmp_path)
    children: list[int] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if b"press Ctrl-C" in line:
                break
        else:
            pytest.fail(f"cleave up did not come up (exit {up.wait()}); logs in {tmp_path}")
        children = _children_of(up.pid)
        assert len(children) == 3  # kvstore, decode-0, gateway
        if how == "ctrl-c with stdout closed":
            up.stdout.close()  # the reader is gone: every later print hits a broken pipe
            up.send_signal(signal.SIGINT)
        else:
            up.send_signal(signal.SIGHUP)
        assert up.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in children):
            assert time.monotonic() < deadline, [pid for pid in children if _alive(pid)]
            time.sleep(0.1)
    finally:
        if up.poll() is None:
            up.kill()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_busy_port_fails_at_once_naming_it(tiny_model, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        completed = subprocess.run(
            [sys.executable, "-m", "cleave.cli.main", "up", "--model", str(tiny_model), "--grpc-port", str(port),
             "--http-port", "0", "--workdir", str(tmp_path)],
            capture_output=True, text=True, timeout=60,
        )
    assert completed.returncode == 2, completed.stdout + completed.stderr
    (error,) = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert f"port {port} on 127.0.0.1 (gateway gRPC, --grpc-port) is in use" in error
    assert not list(tmp_path.glob("*.log"))  # nothing was started
