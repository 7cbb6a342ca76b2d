"""bench/cpu_use.py: CPU seconds of process groups (and their descendants) over a window."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Loaded by path, bench/ not put on sys.path: the bench scripts' bare module names
# (`common`, `engine`) stay out of later tests of this process.
_spec = importlib.util.spec_from_file_location("bench_cpu_use", Path(__file__).resolve().parents[2] / "bench" / "cpu_use.py")
cpu_use = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_use)  # type: ignore[union-attr]
CpuMeter, cpu_seconds, role_of, with_descendants = (
    cpu_use.CpuMeter, cpu_use.cpu_seconds, cpu_use.role_of, cpu_use.with_descendants)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

# Told "go" on stdin, spins until it has used BUSY_S of CPU, says so, then idles until stdin
# closes. With "spawn" it starts the same program as its own child and passes "go" on.
PROGRAM = """
import subprocess, sys, time
if sys.argv[1] == "spawn":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "spin", sys.argv[2]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    print(child.pid, flush=True)
    child.stdin.write(sys.stdin.readline())
    child.stdin.flush()
    print(child.stdout.readline().strip(), flush=True)
    sys.stdin.read()
    child.stdin.close()
    child.wait()
else:
    sys.stdin.readline()
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    print("spun", flush=True)
    sys.stdin.read()
"""
BUSY_S = 0.3


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.stdin is not None:
            process.stdin.close()
        process.kill()
        process.wait()


def _start(processes: list[subprocess.Popen], mode: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", PROGRAM, mode, PROGRAM], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    processes.append(process)
    return process


def test_a_group_counts_the_cpu_its_processes_and_their_children_spent(processes):
    spinner, parent = _start(processes, "spin"), _start(processes, "spawn")
    grandchild = int(parent.stdout.readline())
    meter = CpuMeter({"spinner": [spinner.pid], "tree": [parent.pid], "nobody": []})
    assert grandchild in with_descendants([parent.pid])
    for process in (spinner, parent):
        process.stdin.write("go\n")
        process.stdin.flush()
    assert spinner.stdout.readline().strip() == "spun" and parent.stdout.readline().strip() == "spun"
    used = meter.seconds()
    # each spun 0.3 s of CPU after the meter started (counted in ticks of 10 ms)
    assert BUSY_S - 0.02 <= used["spinner"] <= BUSY_S + 0.05
    assert BUSY_S - 0.02 <= used["tree"] <= BUSY_S + 0.1  # the grandchild's spin, its parent's reads
    assert used["nobody"] == 0.0
    cores = meter.cores(2.0)  # per second of a 2 s window (the spinners idle now: nothing more to count)
    assert cores["spinner"] == pytest.approx(used["spinner"] / 2, abs=0.03) and cores["nobody"] == 0.0


def test_a_process_that_is_gone_reads_zero(processes):
    process = _start(processes, "spin")
    process.kill()
    process.wait()
    assert cpu_seconds(process.pid) == 0.0 and with_descendants([process.pid]) == [process.pid]


def test_roles_of_stack_children():
    assert [role_of(name) for name in ("gateway", "gateway-2", "decode-0", "prefill-1", "kvstore")] == [
        "gateway", "gateway", "decode", "prefill", "kvstore"]
