"""Hostile and honest candidates in the sandbox; each layer is also tested on its own."""

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from cleave.errors import InvalidArgument
from cleave.scaling.code_verifier import MAX_TEST_IO_CHARS, CodeTest, CodeVerifier, FailureReason
from cleave.scaling.sandbox import SandboxLimits, run_sandboxed

FAST = SandboxLimits(wall_timeout_s=3.0, cpu_time_s=3, memory_bytes=256 * 1024**2, max_stdout_bytes=4096)
ADD_TESTS = [CodeTest("2 3\n", "5"), CodeTest("10 -4\n", "6\n")]


def _processes_in_group(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def test_correct_candidate_passes_and_wrong_one_fails():
    verifier = CodeVerifier(ADD_TESTS, FAST)
    good = verifier.verify("```python\na, b = map(int, input().split())\nprint(a + b)\n```")
    assert good.reward == 1.0 and good.passed and good.reason is None
    wrong = verifier.verify("```python\na, b = map(int, input().split())\nprint(a * b)\n```")
    assert wrong.reward == 0.0 and wrong.reason is FailureReason.WRONG_ANSWER
    half = verifier.verify("```python\na, b = map(int, input().split())\nprint(5)\n```")
    assert half.reward == 0.5 and [o.passed for o in half.outcomes] == [True, False]
    assert verifier.verify("no code").reason is FailureReason.NO_CODE


def test_check_code_runs_in_the_program_namespace():
    verifier = CodeVerifier([CodeTest(check_code="assert add(2, 3) == 5")], FAST)
    assert verifier.verify_program("def add(a, b):\n    return a + b\n").passed
    assert verifier.verify_program("def add(a, b):\n    return a - b\n").reason is FailureReason.WRONG_ANSWER
    crash = verifier.verify_program("raise ValueError('boom')")
    assert crash.reason is FailureReason.RUNTIME_ERROR and "ValueError: boom" in crash.outcomes[0].stderr


@pytest.fixture
def listening_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@pytest.mark.parametrize(
    "layers, expected_error",
    [
        ({}, "PermissionError: sandbox: socket."),
        ({"audit_hook": False}, "OSError: [Errno 101] Network is unreachable"),  # namespace alone
        ({"network_namespace": False, "pid_namespace": False}, "PermissionError: sandbox: socket."),  # hook alone
    ],
)
def test_socket_to_local_server_fails(listening_server, layers, expected_error):
    port, accepted = listening_server
    program = "import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=1)\nprint('connected')\n" % port
    run = run_sandboxed(program, limits=SandboxLimits(**{**FAST.__dict__, **layers}))
    if "Network is unreachable" in expected_error and "network" not in run.isolation.namespaces:
        pytest.skip(f"the kernel refuses a network namespace here: {run.isolation.errors}")
    assert run.returncode == 1 and run.stdout == ""
    assert expected_error in run.stderr.strip().splitlines()[-1]
    time.sleep(0.3)
    assert accepted == []


def test_socket_control_without_any_layer_connects(listening_server):
    port, accepted = listening_server
    program = "import socket\nsocket.create_connection(('127.0.0.1', %d), timeout=1)\nprint('connected')\n" % port
    limits = SandboxLimits(**{**FAST.__dict__, "audit_hook": False, "network_namespace": False})
    assert run_sandboxed(program, limits=limits).stdout == "connected\n"


def test_write_outside_workdir_fails(tmp_path):
    target = tmp_path / "escaped.txt"
    direct_program = f"open({str(target)!r}, 'w').write('x')\n"
    link_program = f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')\n"
    low_level_program = f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n"
    for program in (direct_program, link_program, low_level_program):
        run = run_sandboxed(program, limits=FAST)
        assert run.returncode == 1 and "writing outside the work directory" in run.stderr
    assert not target.exists()
    kept = tmp_path / "keep.txt"
    kept.write_text("keep")
    for program in (f"import os\nos.remove({str(kept)!r})", f"import os\nos.rename({str(kept)!r}, 'stolen')"):
        run = run_sandboxed(program, limits=FAST)
        assert run.returncode == 1 and "outside the work directory is not allowed" in run.stderr
    assert kept.read_text() == "keep"


def test_writes_inside_workdir_are_allowed():
    run = run_sandboxed("open('a.txt', 'w').write('hi')\nimport os\nos.rename('a.txt', 'b.txt')\nprint(open('b.txt').read())", limits=FAST)
    assert (run.returncode, run.stdout) == (0, "hi\n")


def test_infinite_loop_is_killed_within_the_limit_and_leaves_no_process():
    limits = SandboxLimits(**{**FAST.__dict__, "wall_timeout_s": 1.0, "cpu_time_s": 10})
    started = time.monotonic()
    run = run_sandboxed("while True:\n    pass\n", limits=limits)
    assert run.timed_out and run.returncode < 0
    assert time.monotonic() - started < 2.5
    assert _processes_in_group(run.pid) == []
    verification = CodeVerifier([CodeTest()], limits).verify_program("while True:\n    pass\n")
    assert verification.reason is FailureReason.TIMEOUT


def test_cpu_time_limit_stops_a_busy_loop_before_the_wall_clock():
    limits = SandboxLimits(**{**FAST.__dict__, "wall_timeout_s": 20.0, "cpu_time_s": 1})
    verification = CodeVerifier([CodeTest()], limits).verify_program("while True:\n    pass\n")
    assert verification.reason is FailureReason.TIMEOUT and verification.outcomes[0].elapsed_s < 5.0


def test_fork_bomb_is_contained():
    program = "import os\nwhile True:\n    os.fork()\n"
    run = run_sandboxed(program, limits=FAST)
    assert run.returncode == 1 and "os.fork is not allowed" in run.stderr
    assert _processes_in_group(run.pid) == []
    spawn = run_sandboxed("import subprocess\nsubprocess.run(['sleep', '100'])", limits=FAST)
    assert spawn.returncode == 1 and "not allowed" in spawn.stderr


def test_huge_allocation_fails_with_memory_reason():
    verification = CodeVerifier([CodeTest()], FAST).verify_program("blob = bytearray(8 * 1024**3)\n")
    assert verification.reason is FailureReason.MEMORY


def test_huge_output_is_truncated_and_stopped():
    started = time.monotonic()
    run = run_sandboxed("while True:\n    print('y' * 1000)\n", limits=FAST)
    assert run.output_limited and len(run.stdout) == FAST.max_stdout_bytes
    assert time.monotonic() - started < 2.0
    verification = CodeVerifier([CodeTest()], FAST).verify_program("print('z' * 100000)")
    assert verification.reason is FailureReason.OUTPUT_LIMIT


def test_escape_hatches_are_closed():
    for program, needle in [
        ("import ctypes", "importing ctypes"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit"),
        ("import os, signal\nos.kill(1, signal.SIGKILL)", "os.kill"),
        ("import os\nopen('/proc/self/mem', 'wb')", "writing outside"),
        ("import os\nos.system('true')", "os.system"),
    ]:
        run = run_sandboxed(program, limits=FAST)
        assert run.returncode == 1 and needle in run.stderr, (program, run.stderr)


def test_environment_is_isolated():
    run = run_sandboxed("import os, sys\nprint(os.getcwd() == os.environ['HOME'], sys.flags.isolated, sys.flags.no_site)", limits=FAST)
    assert run.stdout.split() == ["True", "1", "1"]
    assert os.environ.get("HOME") != run.stdout


def test_total_timeout_budget_covers_all_tests():
    verifier = CodeVerifier([CodeTest(), CodeTest(), CodeTest()], FAST, total_timeout_s=0.5)
    started = time.monotonic()
    verification = verifier.verify_program("while True:\n    pass\n")
    assert time.monotonic() - started < 2.0
    assert [outcome.reason for outcome in verification.outcomes] == [FailureReason.TIMEOUT] * 3


def test_a_tests_stdin_and_expected_output_are_bounded_together():
    half = MAX_TEST_IO_CHARS // 2
    echo = "import sys\nsys.stdout.write(sys.stdin.read())\n"
    assert CodeVerifier([CodeTest("1 2\n" * (half // 4), "1 2\n" * (half // 4))]).verify_program(echo).passed
    with pytest.raises(InvalidArgument, match=f"at most {MAX_TEST_IO_CHARS} characters together, got") as raised:
        CodeVerifier([CodeTest("1\n", "1"), CodeTest("x" * half, "y" * (half + 1))])
    assert raised.value.field == "tests[1]"
