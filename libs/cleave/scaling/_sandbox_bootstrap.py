"""Runs inside the sandboxed interpreter (`python -I -S this_file CONFIG_JSON`); not imported.

Order matters: namespaces first (they need privileges the later steps give up), then the
pid-namespace fork, then resource limits, then the audit hook, and only then the candidate.
Every helper the hook calls is bound as a default argument of a globals-free copy, so a
candidate that rebinds module globals or builtins cannot change what the hook checks.
"""

import gc
import json
import os
import resource
import signal
import sys
import types

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
EXIT_MEMORY = 86
EXIT_CHECK_FAILED = 87

_BLOCKED_EVENTS = frozenset(
    {
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
        "os.startfile", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg",
        "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "os.unshare",
        "os.setns",
    }
)
_BLOCKED_PREFIXES = ("socket.", "ctypes.", "_ctypes.")
_BLOCKED_IMPORTS = frozenset({"_posixsubprocess", "_ctypes", "ctypes"})
_PATH_EVENTS = {  # event -> indices of path arguments that get written, and of their dir_fd
    "os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2),
    "os.rename": ((0, 1), None), "os.link": ((0, 1), None), "os.symlink": ((1,), 2),
    "os.chmod": ((0,), 2), "os.chown": ((0,), 3), "os.truncate": ((0,), None),
    "os.utime": ((0,), 3), "os.chflags": ((0,), None), "os.lchflags": ((0,), None),
    "os.setxattr": ((0,), None), "os.removexattr": ((0,), None), "os.mkfifo": ((0,), 2),
    "os.mknod": ((0,), 3), "shutil.rmtree": ((0,), 1), "shutil.copyfile": ((1,), None),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _unshare(use_network: bool, use_pid: bool) -> bool:
    """Enter new namespaces; returns whether a pid namespace was entered."""
    if not (use_network or use_pid):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = (CLONE_NEWNET if use_network else 0) | (CLONE_NEWPID if use_pid else 0)
    user = 0 if os.geteuid() == 0 else CLONE_NEWUSER
    for attempt in (flags | user, (flags & ~CLONE_NEWPID) | user):
        if attempt & ~CLONE_NEWUSER and libc.unshare(attempt) == 0:
            return bool(attempt & CLONE_NEWPID)
    return False


def _set_parent_death_signal() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _forget_ctypes() -> None:
    for name in [name for name in sys.modules if name == "ctypes" or name.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    gc.collect()


def _wait_and_mirror(child_pid: int) -> None:
    """In the pid namespace's creator: wait for its init and exit the same way."""
    _, status = os.waitpid(child_pid, 0)
    if os.WIFSIGNALED(status):
        signal_number = os.WTERMSIG(status)
        if signal_number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signal_number, signal.SIG_DFL)
        os.kill(os.getpid(), signal_number)
    os._exit(os.waitstatus_to_exitcode(status))


def _limit(config: dict) -> None:
    limits = (
        (resource.RLIMIT_CPU, config["cpu_time_s"]),
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_size_bytes"]),
        (resource.RLIMIT_NPROC, config["max_processes"]),
        (resource.RLIMIT_NOFILE, config["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    )
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def _resolve(path, dir_fd=None, _getcwd=os.getcwd, _readlink=os.readlink, _fsdecode=os.fsdecode,
             _fspath=os.fspath, _str=str, _OSError=OSError, _PermissionError=PermissionError):
    """Absolute path with every symlink followed (the kernel's view of `path`)."""
    text = _fsdecode(_fspath(path))
    if not text.startswith("/"):
        base = _getcwd() if dir_fd is None or dir_fd < 0 else _readlink("/proc/self/fd/" + _str(dir_fd))
        text = base + "/" + text
    parts = []
    pending = text.split("/")[::-1]
    hops = 0
    while pending:
        part = pending.pop()
        if part == "" or part == ".":
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        location = "/" + "/".join(parts + [part])
        try:
            target = _readlink(location)
        except _OSError:
            parts.append(part)
            continue
        hops += 1
        if hops > 40:
            raise _PermissionError("sandbox: too many symlinks")
        if target.startswith("/"):
            parts = []
        pending.extend(target.split("/")[::-1])
    return "/" + "/".join(parts)


def _inside(path, dir_fd=None, _root="/nonexistent", _resolve=_resolve, _isinstance=isinstance, _int=int,
            _devices=("/dev/null",)):
    """Whether writing `path` stays inside the work directory."""
    if path is None or _isinstance(path, _int):
        return True
    real = _resolve(path, dir_fd)
    return real == _root or real.startswith(_root + "/") or real in _devices


def _hook(event, args, _inside=_inside, _blocked=_BLOCKED_EVENTS, _prefixes=_BLOCKED_PREFIXES,
          _imports=_BLOCKED_IMPORTS, _path_events=_PATH_EVENTS, _write_flags=_WRITE_FLAGS, _int=int,
          _isinstance=isinstance, _type=type, _len=len, _any=any, _this_file=__file__,
          _guarded=("__code__", "__defaults__", "__kwdefaults__"), _PermissionError=PermissionError):
    if event in _blocked or event.startswith(_prefixes):
        raise _PermissionError("sandbox: " + event + " is not allowed")
    if event == "import" and args[0] in _imports:
        raise _PermissionError("sandbox: importing " + args[0] + " is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and _any(c in mode for c in "wax+")) or (
            _isinstance(flags, _int) and flags & _write_flags
        )
        if writes and not _inside(path):
            raise _PermissionError("sandbox: writing outside the work directory is not allowed")
    elif event in _path_events:
        indices, dir_fd_index = _path_events[event]
        dir_fd = args[dir_fd_index] if dir_fd_index is not None and dir_fd_index < _len(args) else None
        for index in indices:
            if not _inside(args[index], dir_fd):
                raise _PermissionError("sandbox: " + event + " outside the work directory is not allowed")
    elif (
        event == "object.__setattr__"
        and _type(args[0]).__name__ == "function"
        and args[1] in _guarded
        and args[0].__code__.co_filename == _this_file
    ):
        raise _PermissionError("sandbox: rebinding the sandbox's functions is not allowed")


def _frozen(function, **overrides):
    """A copy of `function` with some defaults replaced and no globals to tamper with."""
    code = function.__code__
    names = code.co_varnames[code.co_argcount - len(function.__defaults__) : code.co_argcount]
    values = dict(zip(names, function.__defaults__), **overrides)
    defaults = tuple(values[name] for name in names)
    return types.FunctionType(code, {"__builtins__": {}}, function.__name__, defaults)


def _make_hook(root):
    """The audit hook for work directory `root`; it reads no globals, closures or builtins."""
    inside = _frozen(_inside, _root=root, _resolve=_frozen(_resolve))
    return _frozen(_hook, _inside=inside)


def _run_candidate(program_path: str, check_path: str | None) -> int:
    with open(program_path, encoding="utf-8") as file:
        program = compile(file.read(), "solution.py", "exec")
    check = None
    if check_path is not None:
        with open(check_path, encoding="utf-8") as file:
            check = compile(file.read(), "check.py", "exec")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        try:
            exec(program, namespace)
        except SystemExit as exit_request:
            if exit_request.code not in (None, 0):
                raise
        if check is not None:
            try:
                exec(check, namespace)
            except AssertionError:
                import traceback

                traceback.print_exc()
                return EXIT_CHECK_FAILED
    except MemoryError:
        sys.stderr.write("MemoryError\n")
        return EXIT_MEMORY
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def main() -> None:
    config = json.loads(sys.argv[1])
    root = config["workdir"]
    in_pid_namespace = _unshare(config["network_namespace"], config["pid_namespace"])
    if in_pid_namespace:
        child_pid = os.fork()
        if child_pid != 0:
            _wait_and_mirror(child_pid)
        _set_parent_death_signal()
    _forget_ctypes()
    _limit(config)
    sys.argv = ["solution.py"]
    if config["audit_hook"]:
        sys.addaudithook(_make_hook(root))
    os._exit(_run_candidate(config["program_path"], config.get("check_path")))


if __name__ == "__main__":
    main()
