"""Run untrusted Python in a confined child process.

Layers, outermost first (`_sandbox_isolation` and `_sandbox_bootstrap` say how each is built
and in which order):
- a fresh temporary directory as cwd, HOME and TMPDIR, removed afterwards;
- an isolated interpreter (`python -I -S -B`: no site-packages, no environment variables, no
  user directories, no bytecode writes) with a minimal environment;
- namespaces where the kernel grants them (as root; as an ordinary user through a user
  namespace): mount (every mount read-only, private directories such as /root, /home and /tmp
  replaced by empty ones, the work directory the one writable place), pid (the candidate
  sees only its own processes, under a /proc of its own), network (a down loopback only),
  ipc and uts;
- an unprivileged uid: as root the candidate runs as `SandboxLimits.run_as_uid` (nobody by
  default), with no capabilities and no_new_privs, so it can read only what anyone may read
  and the resource limits bind it;
- resource limits: CPU seconds, address space, file size, process count, open files, no core
  dumps;
- an audit hook that refuses sockets, process creation, signals to other processes, ctypes,
  limit changes and any write outside the work directory (defence in depth);
- a wall-clock deadline after which the whole process group is SIGKILLed, and output capped
  (past the cap on stdout the run is stopped).
Where the kernel refuses a namespace the run goes on with the layers that hold, and
`SandboxRun.isolation` says which did.
"""

from __future__ import annotations

import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_BOOTSTRAP = Path(__file__).with_name("_sandbox_bootstrap.py")
EXIT_MEMORY = 86  # _sandbox_bootstrap: the candidate raised MemoryError
EXIT_CHECK_FAILED = 87  # _sandbox_bootstrap: the check code raised AssertionError
_READ_CHUNK = 65536
MAX_WALL_TIMEOUT_S = 30.0  # the longest wall-clock limit one test may ask for
_NOBODY = 65534  # the conventional uid and gid of nobody, where the user database lacks it


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run; the layer switches exist so each can be tested alone."""

    wall_timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_bytes: int = 512 * 1024**2
    file_size_bytes: int = 16 * 1024**2
    max_processes: int = 64
    max_open_files: int = 64
    max_stdout_bytes: int = 1024**2
    max_stderr_bytes: int = 64 * 1024
    network_namespace: bool = True
    pid_namespace: bool = True
    mount_namespace: bool = True
    audit_hook: bool = True
    drop_privileges: bool = True  # as root; off only to test the other layers alone
    run_as_uid: int | None = None  # as root: the candidate's uid; None: nobody's
    run_as_gid: int | None = None  # as root: the candidate's gid; None: the uid's group

    def __post_init__(self) -> None:
        if not 0 < self.wall_timeout_s <= MAX_WALL_TIMEOUT_S:
            raise ValueError(f"wall_timeout_s must be in (0, {MAX_WALL_TIMEOUT_S}], got {self.wall_timeout_s}")


@dataclass(frozen=True)
class SandboxIsolation:
    """What the kernel granted one run (the bootstrap's report).

    Attributes:
        namespaces: those entered, of "user", "mount", "pid", "network", "ipc", "uts".
        uid, gid: the candidate's ids.
        read_only_root: every mount but the work directory is read-only.
        hidden_dirs: private directories replaced by empty ones.
        proc: "private" (this pid namespace's), "empty", or "host" (the host's /proc).
        errors: why a step that was tried did not hold.
    """

    namespaces: tuple[str, ...]
    uid: int
    gid: int
    read_only_root: bool
    hidden_dirs: tuple[str, ...]
    proc: str
    errors: tuple[str, ...]

    @classmethod
    def from_report(cls, text: str) -> SandboxIsolation | None:
        try:
            report = json.loads(text)
            return cls(tuple(report["namespaces"]), int(report["uid"]), int(report["gid"]),
                       bool(report["read_only_root"]), tuple(report["hidden_dirs"]), str(report["proc"]),
                       tuple(report["errors"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class SandboxRun:
    """What one sandboxed run did.

    Attributes:
        returncode: the process's exit status (negative: killed by that signal).
        stdout, stderr: captured output, cut at the limits (decoded as UTF-8, replacing errors).
        timed_out: stopped at the wall-clock deadline.
        output_limited: stopped because stdout passed `max_stdout_bytes`.
        elapsed_s: wall-clock seconds from start to the last process reaped.
        pid: the sandbox's process id, which is also its process group id.
        isolation: what the kernel granted, or None when the sandbox failed before saying.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_limited: bool
    elapsed_s: float
    pid: int
    isolation: SandboxIsolation | None = None


class _Capture:
    """Reads a child's stdout and stderr together, keeping at most a cap of each."""

    def __init__(self, process: subprocess.Popen, limits: SandboxLimits) -> None:
        self.selector = selectors.DefaultSelector()
        self.stdout = process.stdout
        self.buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
        self.caps = {process.stdout: limits.max_stdout_bytes, process.stderr: limits.max_stderr_bytes}
        self.num_stdout_bytes = 0
        for stream in self.buffers:
            os.set_blocking(stream.fileno(), False)
            self.selector.register(stream, selectors.EVENT_READ)

    @property
    def is_open(self) -> bool:
        """Whether either stream may still deliver output."""
        return bool(self.selector.get_map())

    @property
    def stdout_overflow(self) -> bool:
        """Whether the child wrote more to stdout than the cap."""
        return self.num_stdout_bytes > self.caps[self.stdout]

    def pump(self, timeout: float) -> None:
        """Read whatever is ready within `timeout` seconds."""
        for key, _ in self.selector.select(timeout):
            stream = key.fileobj
            chunk = os.read(stream.fileno(), _READ_CHUNK)
            if not chunk:
                self.selector.unregister(stream)
                continue
            if stream is self.stdout:
                self.num_stdout_bytes += len(chunk)
            buffer = self.buffers[stream]
            buffer += chunk[: max(0, self.caps[stream] - len(buffer))]

    def drain(self, timeout: float) -> None:
        """Read until both streams close or `timeout` passes (an escaped writer keeps one open)."""
        deadline = time.monotonic() + timeout
        while self.is_open and time.monotonic() < deadline:
            self.pump(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.selector.close()


def _child_pids(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox and everything in its process group, leaving no zombie behind.

    With a pid namespace the candidate runs as the namespace's init, a child of the
    sandbox process. It is killed first so the sandbox process reaps it (its exit takes the
    whole namespace with it); killing both at once would orphan it as a zombie of the host's
    init.
    """
    if process.poll() is None:
        for child in _child_pids(process.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_sandboxed(
    program: str,
    *,
    stdin: str = "",
    check_code: str | None = None,
    limits: SandboxLimits = SandboxLimits(),
) -> SandboxRun:
    """Run `program` (then `check_code` in its namespace) as an untrusted script."""
    workdir = tempfile.mkdtemp(prefix="cleave-sandbox-")
    try:
        return _run_in(Path(workdir).resolve(), program, stdin, check_code, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _candidate_ids(limits: SandboxLimits) -> tuple[int, int] | None:
    """The uid and gid the candidate runs as when this process is root (None otherwise)."""
    if os.geteuid() != 0 or not limits.drop_privileges:
        return None
    uid = limits.run_as_uid
    if uid is None:
        try:
            uid = pwd.getpwnam("nobody").pw_uid
        except KeyError:
            uid = _NOBODY
    gid = limits.run_as_gid
    if gid is None:
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = uid
    if uid == 0 or gid == 0:
        raise ValueError("the sandbox never runs a candidate as uid or gid 0; set run_as_uid/run_as_gid")
    return uid, gid


def _read_status(status_read: int) -> SandboxIsolation | None:
    chunks = []
    os.set_blocking(status_read, False)
    try:
        while chunk := os.read(status_read, _READ_CHUNK):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return SandboxIsolation.from_report(b"".join(chunks).decode("utf-8", "replace"))


def _run_in(workdir: Path, program: str, stdin: str, check_code: str | None, limits: SandboxLimits) -> SandboxRun:
    (workdir / "solution.py").write_text(program, encoding="utf-8")
    if check_code is not None:
        (workdir / "check.py").write_text(check_code, encoding="utf-8")
    (workdir / "stdin.txt").write_text(stdin, encoding="utf-8")
    ids = _candidate_ids(limits)
    if ids is not None:
        os.chown(workdir, *ids)  # the one place the candidate may write
    status_read, status_write = os.pipe()
    config = {
        "workdir": str(workdir),
        "program_path": str(workdir / "solution.py"),
        "check_path": str(workdir / "check.py") if check_code is not None else None,
        "cpu_time_s": limits.cpu_time_s,
        "memory_bytes": limits.memory_bytes,
        "file_size_bytes": limits.file_size_bytes,
        "max_processes": limits.max_processes,
        "max_open_files": limits.max_open_files,
        "network_namespace": limits.network_namespace,
        "pid_namespace": limits.pid_namespace,
        "mount_namespace": limits.mount_namespace,
        "audit_hook": limits.audit_hook,
        "run_as_uid": None if ids is None else ids[0],
        "run_as_gid": None if ids is None else ids[1],
        "status_fd": status_write,
    }
    environment = {"HOME": str(workdir), "TMPDIR": str(workdir), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    command = [sys.executable, "-I", "-S", "-B", "-X", "utf8", str(_BOOTSTRAP), json.dumps(config)]
    started = time.monotonic()
    try:
        with open(workdir / "stdin.txt", "rb") as stdin_file:
            process = subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=environment,
                start_new_session=True,
                close_fds=True,
                pass_fds=(status_write,),
            )
    finally:
        os.close(status_write)
    capture = _Capture(process, limits)
    deadline = started + limits.wall_timeout_s
    timed_out = False
    try:
        while not capture.stdout_overflow:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if capture.is_open:
                capture.pump(min(remaining, 0.1))
            elif process.poll() is None:
                try:
                    process.wait(min(remaining, 0.1))
                except subprocess.TimeoutExpired:
                    pass
            else:
                break
    finally:
        # Also ends anything the candidate left in its process group after a normal exit.
        _kill(process)
        returncode = process.wait()
        capture.drain(timeout=0.5)
        capture.close()
        process.stdout.close()
        process.stderr.close()
        isolation = _read_status(status_read)
        os.close(status_read)
    return SandboxRun(
        returncode=returncode,
        stdout=bytes(capture.buffers[process.stdout]).decode("utf-8", "replace"),
        stderr=bytes(capture.buffers[process.stderr]).decode("utf-8", "replace"),
        timed_out=timed_out,
        output_limited=capture.stdout_overflow,
        elapsed_s=time.monotonic() - started,
        pid=process.pid,
        isolation=isolation,
    )
