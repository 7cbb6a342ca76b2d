"""Escapes a hostile candidate tried against the code-verifier sandbox; each must fail while an
honest candidate still passes.

What stops an escape depends on who runs the suite: as root the candidate runs as nobody
(always), so files of this test (under pytest's 0700 temporary directory) are out of its
reach; as an ordinary user the candidate keeps the uid and only the mount namespace (read-only
view, private directories hidden) stands between it and this user's files. Where the kernel
refuses that namespace to an ordinary user, the escape tests skip and say so.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cleave.scaling.code_verifier import MAX_CODE_TESTS, CodeTest, CodeVerifier
from cleave.scaling.sandbox import MAX_WALL_TIMEOUT_S, SandboxLimits, SandboxRun, run_sandboxed

FAST = SandboxLimits(wall_timeout_s=3.0, cpu_time_s=3, memory_bytes=256 * 1024**2, max_stdout_bytes=65536)
HOOK_ALONE = SandboxLimits(**{**FAST.__dict__, "network_namespace": False, "pid_namespace": False,
                              "mount_namespace": False, "drop_privileges": False})
IS_ROOT = os.geteuid() == 0
HONEST = "a, b = map(int, input().split())\nprint(a + b)\n"


def _honest_candidate_passes() -> None:
    verification = CodeVerifier([CodeTest("2 3\n", "5")], FAST).verify_program(HONEST)
    assert verification.passed, verification.outcomes


def _run_escape(program: str, needs: str = "mount") -> SandboxRun:
    """Run `program` in the full sandbox; skip where no layer that must stop it holds (only
    as an ordinary user whose kernel refuses the namespace `needs`)."""
    run = run_sandboxed(program, limits=FAST)
    if not IS_ROOT:
        isolation = run.isolation
        if isolation is None or needs not in isolation.namespaces or (needs == "mount" and not isolation.read_only_root):
            reach = "this user's files" if needs == "mount" else "this user's other processes"
            pytest.skip(f"the kernel refuses a {needs} namespace to this user: a candidate running as this "
                        f"user can reach {reach}, so this escape cannot be shown closed here")
    return run


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of this test, outside any sandbox's work directory."""
    path = tmp_path / "victim.txt"
    path.write_text("untouched")
    path.chmod(0o600)
    return path


def test_write_through_a_directory_descriptor_stays_inside(tmp_path: Path):
    target = tmp_path / "escaped.txt"
    program = (f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
               "os.close(os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))\nprint('wrote')\n")
    run = _run_escape(program)
    assert run.returncode != 0 and "wrote" not in run.stdout
    assert not target.exists()
    _honest_candidate_passes()


def test_fchmod_of_an_outside_file_fails(victim: Path):
    program = f"import os\nfd = os.open({str(victim)!r}, os.O_RDONLY)\nos.fchmod(fd, 0o777)\nprint('changed')\n"
    hook = run_sandboxed(program, limits=HOOK_ALONE)  # the audit hook alone refuses it
    assert hook.returncode == 1 and "os.chmod outside the work directory" in hook.stderr
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    run = _run_escape(program)
    assert run.returncode != 0 and "changed" not in run.stdout
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    _honest_candidate_passes()


def test_emptying_the_hooks_tables_does_not_open_the_hook(victim: Path):
    program = ("import os, sys\nbootstrap = sys.modules['__main__']\n"
               "for name in ('_PATH_EVENTS', '_BLOCKED_EVENTS', '_BLOCKED_PREFIXES'):\n"
               "    try:\n        getattr(bootstrap, name).clear()\n    except AttributeError:\n"
               "        setattr(bootstrap, name, ())\n"
               f"os.remove({str(victim)!r})\nprint('removed')\n")
    hook = run_sandboxed(program, limits=HOOK_ALONE)
    assert hook.returncode == 1 and "os.remove outside the work directory" in hook.stderr
    assert victim.read_text() == "untouched"
    run = _run_escape(program)
    assert run.returncode != 0 and "removed" not in run.stdout
    assert victim.read_text() == "untouched"
    _honest_candidate_passes()


def test_sqlite_cannot_create_a_database_outside(tmp_path: Path):
    target = tmp_path / "stolen.db"
    for database in (str(target), f"file:{target}?mode=rwc"):
        program = (f"import sqlite3\nconnection = sqlite3.connect({database!r}, uri=True)\n"
                   "connection.execute('create table t (x)')\nconnection.commit()\nprint('created')\n")
        for limits in (HOOK_ALONE, FAST):
            run = run_sandboxed(program, limits=limits) if limits is HOOK_ALONE else _run_escape(program)
            assert run.returncode != 0 and "created" not in run.stdout, (database, limits, run.stderr)
            assert not target.exists()
    inside = run_sandboxed("import sqlite3\nc = sqlite3.connect('mine.db')\nc.execute('create table t (x)')\n"
                           "c.commit()\nprint('ok')\n", limits=FAST)
    assert (inside.returncode, inside.stdout) == (0, "ok\n"), inside.stderr
    _honest_candidate_passes()


def test_private_files_cannot_be_read(victim: Path):
    victim.write_text("secret-7f3a")
    program = (f"for path in ({str(victim)!r}, '/etc/shadow'):\n"
               "    try:\n        print(open(path).read())\n    except OSError as error:\n"
               "        print('refused', type(error).__name__)\n")
    run = _run_escape(program)
    assert run.returncode == 0 and "secret-7f3a" not in run.stdout
    assert run.stdout.count("refused") == 2, run.stdout  # /etc/shadow too (absent or unreadable)
    _honest_candidate_passes()


def test_other_processes_environment_cannot_be_read(monkeypatch):
    monkeypatch.setenv("CLEAVE_SANDBOX_PROBE", "probe-91c2")  # in this process's /proc/PID/environ
    program = (f"import os\nprint('mine', os.path.exists('/proc/{os.getpid()}/environ'))\n"
               "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
               "    try:\n        print(open('/proc/' + pid + '/environ', 'rb').read())\n"
               "    except OSError:\n        pass\n")
    run = _run_escape(program, needs="pid")
    assert run.returncode == 0 and "probe-91c2" not in run.stdout, run.stderr
    if run.isolation is not None and run.isolation.proc != "host":
        assert "mine False" in run.stdout  # this process is not even visible
    _honest_candidate_passes()


def test_the_candidate_is_unprivileged_and_bound_by_its_limits():
    program = ("import os, resource\nprint(os.getuid(), os.getgid())\n"
               "print(resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_CPU)[0])\n"
               "print([line for line in open('/proc/self/status') if line.startswith(('CapEff', 'NoNewPrivs'))])\n")
    run = run_sandboxed(program, limits=FAST)
    assert run.returncode == 0, run.stderr
    ids, limits, status = run.stdout.splitlines()
    uid, gid = map(int, ids.split())
    assert (uid != 0 and gid != 0) if IS_ROOT else uid == os.getuid()
    assert run.isolation is not None and (run.isolation.uid, run.isolation.gid) == (uid, gid)
    assert limits.split() == [str(FAST.max_processes), str(FAST.cpu_time_s)]
    assert "CapEff:\\t0000000000000000" in status and "NoNewPrivs:\\t1" in status


def test_the_filesystem_is_read_only_but_the_work_directory():
    program = ("import os\nfor line in open('/proc/self/mountinfo'):\n"
               "    fields = line.split()\n    print(fields[4], fields[5].split(',')[0])\n"
               "open('here.txt', 'w').write('ok')\nprint('wrote', open('here.txt').read())\n")
    run = run_sandboxed(program, limits=SandboxLimits(**{**FAST.__dict__, "audit_hook": False}))
    isolation = run.isolation
    if isolation is None or not isolation.read_only_root:
        pytest.skip("the kernel refuses a mount namespace here: no read-only view to check "
                    f"({isolation.errors if isolation else 'no report'})")
    assert run.returncode == 0, run.stderr
    *mounts, wrote = run.stdout.splitlines()
    assert wrote == "wrote ok"
    writable = [line.split()[0] for line in mounts if line.split()[1] != "ro"]
    assert len(writable) == 1 and "cleave-sandbox-" in writable[0], mounts
    denied = run_sandboxed("open('/etc/cleave-sandbox-probe', 'w')", limits=SandboxLimits(**{**FAST.__dict__, "audit_hook": False}))
    assert denied.returncode == 1 and ("Read-only file system" in denied.stderr or "Permission denied" in denied.stderr)
    assert not os.path.exists("/etc/cleave-sandbox-probe")


def test_the_hosts_private_directories_are_hidden(tmp_path: Path):
    (tmp_path / "note.txt").write_text("x")
    run = run_sandboxed(f"import os\nprint(os.path.exists({str(tmp_path)!r}), sorted(os.listdir('/tmp')))",
                        limits=FAST)
    isolation = run.isolation
    if isolation is None or "/tmp" not in isolation.hidden_dirs:
        pytest.skip("the kernel refuses a mount namespace here: the host's directories cannot be hidden")
    exists, listing = run.stdout.split(" ", 1)
    assert exists == "False" and listing.count("cleave-sandbox-") == 1, run.stdout  # only its own work directory


def test_timeouts_and_test_counts_are_bounded():
    with pytest.raises(ValueError, match="wall_timeout_s must be in"):
        SandboxLimits(wall_timeout_s=1e9)
    with pytest.raises(ValueError, match="wall_timeout_s must be in"):
        SandboxLimits(wall_timeout_s=0)
    assert SandboxLimits(wall_timeout_s=MAX_WALL_TIMEOUT_S).wall_timeout_s == MAX_WALL_TIMEOUT_S
    with pytest.raises(ValueError, match=f"at most {MAX_CODE_TESTS} test cases"):
        CodeVerifier([CodeTest()] * (MAX_CODE_TESTS + 1))
    if IS_ROOT:
        with pytest.raises(ValueError, match="never runs a candidate as uid or gid 0"):
            run_sandboxed("print(1)", limits=SandboxLimits(run_as_uid=0))
