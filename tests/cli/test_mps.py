"""The stack's MPS daemon (`cleave.cli._mps`), against a stand-in control binary on PATH that
records how it was called, as `nvidia-cuda-mps-control` would be."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cleave.cli._mps import CONTROL, LOG_ENV, PIPE_ENV, MpsDaemon, MpsUnavailable, wants_mps
from cleave.cli._stack import ProcessStack, StackSpec

CONTROL_SCRIPT = """#!/bin/sh
# records: arguments, the pipe directory it was given, and what came on stdin; once told to
# quit, no daemon answers any more (exit 1, unrecorded)
[ -e "{record}.quit" ] && exit 1
input=$( [ "$1" = "-d" ] || cat )
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$input" >> "{record}"
[ "$input" = "quit" ] && touch "{record}.quit"
exit {code}
"""


def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int = 0) -> Path:
    bin_dir, record = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    script = bin_dir / CONTROL
    script.write_text(CONTROL_SCRIPT.format(record=record, code=code))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_ENV, raising=False)
    return record


@pytest.mark.parametrize("setting, device, workers, expected", [
    ("auto", "cuda", 2, True), ("auto", "cuda", 1, False), ("auto", "cpu", 2, False),
    ("on", "cuda", 1, True), ("on", "cpu", 2, False), ("off", "cuda", 3, False), ("auto", "cuda:0", 2, True),
])
def test_mps_is_wanted_when_workers_share_a_gpu(setting, device, workers, expected):
    assert wants_mps(setting, device, workers) is expected


def test_a_started_daemon_gets_its_own_directories_and_quits_on_stop(tmp_path, monkeypatch):
    record = fake_control(tmp_path, monkeypatch)
    daemon = MpsDaemon.start(tmp_path / "mps", {})
    pipe = tmp_path / "mps" / "pipe"
    assert daemon.env == {PIPE_ENV: str(pipe), LOG_ENV: str(tmp_path / "mps" / "log")}
    assert pipe.is_dir() and (tmp_path / "mps" / "log").is_dir()
    daemon.stop()
    daemon.stop()  # idempotent: one quit only
    assert record.read_text().splitlines() == [f"args=-d pipe={pipe} stdin=", f"args= pipe={pipe} stdin=quit"]


def test_a_daemon_the_caller_runs_is_used_and_left_running(tmp_path, monkeypatch):
    record = fake_control(tmp_path, monkeypatch)
    daemon = MpsDaemon.start(tmp_path / "mps", {PIPE_ENV: "/run/their-mps"})
    daemon.stop()
    assert daemon.env == {} and not record.exists()


def test_no_control_binary_or_a_refusal_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsUnavailable, match="not on PATH.*--mps off"):
        MpsDaemon.start(tmp_path / "mps", {})
    monkeypatch.undo()
    record = fake_control(tmp_path, monkeypatch, code=3)
    monkeypatch.setattr("cleave.cli._mps.START_RETRY_S", 0.3)
    (tmp_path / "mps" / "log").mkdir(parents=True)
    (tmp_path / "mps" / "log" / "control.log").write_text("started\nAn MPS server is already running\n\n")
    with pytest.raises(MpsUnavailable, match="-d failed: exit code 3 \\(An MPS server is already running\\)"):
        MpsDaemon.start(tmp_path / "mps", {})
    assert record.read_text().count("args=-d") >= 2  # retried until the deadline


def test_stop_waits_until_the_daemon_is_gone(tmp_path, monkeypatch):
    """`quit` returns while the daemon still exits; stop() returns once the control program
    no longer reaches it (here: at once, the stand-in refuses after quit), so a next stack's
    daemon can start."""
    record = fake_control(tmp_path, monkeypatch)
    daemon = MpsDaemon.start(tmp_path / "mps", {})
    daemon.stop()
    assert (tmp_path / "calls.txt.quit").exists()
    (tmp_path / "calls.txt.quit").unlink()
    again = MpsDaemon.start(tmp_path / "mps2", {})
    assert again.owned and record.read_text().count("args=-d") == 2


def test_the_stack_hands_the_daemon_to_its_children_only_when_it_runs_one(tmp_path, monkeypatch):
    record = fake_control(tmp_path, monkeypatch)
    cpu = ProcessStack(StackSpec(model=tmp_path, device="cpu"), tmp_path / "cpu")
    cpu._start_mps()
    assert cpu.mps is None and PIPE_ENV not in cpu.child_env({})
    gpu = ProcessStack(StackSpec(model=tmp_path, device="cuda", mode="disaggregated"), tmp_path / "gpu")
    gpu._start_mps()
    assert gpu.child_env({})[PIPE_ENV] == str(tmp_path / "gpu" / "mps" / "pipe")
    gpu.stop()  # no children: stops the daemon alone
    assert gpu.mps is None and record.read_text().count("stdin=quit") == 1
    colocated = ProcessStack(StackSpec(model=tmp_path, device="cuda", mode="colocated"), tmp_path / "colocated")
    colocated._start_mps()  # one worker on the device: nothing to share
    assert colocated.mps is None


def test_auto_goes_on_without_mps_where_the_host_has_none_and_on_refuses(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(PIPE_ENV, raising=False)
    auto = ProcessStack(StackSpec(model=tmp_path, device="cuda"), tmp_path / "auto")
    auto._start_mps()
    assert auto.mps is None and "without MPS" in capsys.readouterr().err
    required = ProcessStack(StackSpec(model=tmp_path, device="cuda", mps="on"), tmp_path / "on")
    with pytest.raises(MpsUnavailable):
        required._start_mps()


def test_a_gpu_worker_that_dies_at_start_under_mps_names_the_way_out(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch)
    stack = ProcessStack(StackSpec(model=tmp_path, device="cuda"), tmp_path / "stack")
    stack.workdir.mkdir(parents=True)
    stack._start_mps()
    log_path = stack.workdir / "decode-0.log"
    log_path.write_bytes(b"RuntimeError: CUDA error: MPS client failed to connect\n")

    class Exited:
        returncode = 1

        def poll(self) -> int:
            return 1

    from cleave.cli._stack import Child

    child = Child("decode-0", Exited(), stack.workdir / "decode-0.port", log_path, open(log_path, "ab"))  # type: ignore[arg-type]
    try:
        with pytest.raises(RuntimeError, match="(?s)MPS client failed.*--mps off"):
            stack._wait_healthy([child], timeout_s=5)
    finally:
        child.log.close()
        stack.stop()
