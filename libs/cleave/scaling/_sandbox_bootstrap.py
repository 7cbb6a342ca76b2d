"""Runs inside the sandboxed interpreter (`python -I -S -B this_file CONFIG_JSON`); not imported.

First the isolation of `_sandbox_isolation` (namespaces, read-only filesystem view, limits,
unprivileged uid); its report of what held goes to the status pipe (fd in the config), which is
closed before the candidate runs, so the candidate cannot write to it. Then the audit hook,
defence in depth only: with the isolation in place a candidate that gets past it is still an
unprivileged process that sees a read-only filesystem without secrets, no network and no other
process. Every helper the hook calls is bound as a default argument of a globals-free copy,
and the tables it reads are immutable, so a candidate that rebinds module globals, builtins or
mutable containers cannot change what the hook checks.
"""

import gc
import importlib.util
import json
import os
import sys
import types

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
# event, indices of path arguments that get written, index of their dir_fd: a tuple, not a
# dict, so nothing the candidate can reach is mutable
_PATH_EVENTS = (
    ("os.remove", (0,), 1), ("os.rmdir", (0,), 1), ("os.mkdir", (0,), 2),
    ("os.rename", (0, 1), None), ("os.link", (0, 1), None), ("os.symlink", (1,), 2),
    ("os.chmod", (0,), 2), ("os.chown", (0,), 3), ("os.truncate", (0,), None),
    ("os.utime", (0,), 3), ("os.chflags", (0,), None), ("os.lchflags", (0,), None),
    ("os.setxattr", (0,), None), ("os.removexattr", (0,), None), ("os.mkfifo", (0,), 2),
    ("os.mknod", (0,), 3), ("shutil.rmtree", (0,), 1), ("shutil.copyfile", (1,), None),
    ("sqlite3.connect", (0,), None),
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _forget_ctypes() -> None:
    for name in [name for name in sys.modules if name == "ctypes" or name.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    gc.collect()


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
            _str=str, _readlink=os.readlink, _OSError=OSError, _devices=("/dev/null",)):
    """Whether writing `path` (a path, or an open descriptor's file) stays inside the work
    directory."""
    if path is None:
        return True
    if _isinstance(path, _int):
        try:
            target = _readlink("/proc/self/fd/" + _str(path))
        except _OSError:
            return False  # cannot tell where it points: refuse
        if not target.startswith("/"):
            return True  # a pipe, socket or anonymous file
        path = target
    real = _resolve(path, dir_fd)
    return real == _root or real.startswith(_root + "/") or real in _devices


def _hook(event, args, _inside=_inside, _blocked=_BLOCKED_EVENTS, _prefixes=_BLOCKED_PREFIXES,
          _imports=_BLOCKED_IMPORTS, _path_events=_PATH_EVENTS, _write_flags=_WRITE_FLAGS, _int=int,
          _isinstance=isinstance, _type=type, _len=len, _any=any, _str=str, _this_file=__file__,
          _guarded=("__code__", "__defaults__", "__kwdefaults__"), _PermissionError=PermissionError):
    if event in _blocked or event.startswith(_prefixes):
        raise _PermissionError("sandbox: " + event + " is not allowed")
    if event == "sqlite3.connect" and "file:" in _str(args[0]):
        raise _PermissionError("sandbox: sqlite URIs are not allowed")
    if event == "import" and args[0] in _imports:
        raise _PermissionError("sandbox: importing " + args[0] + " is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and _any(c in mode for c in "wax+")) or (
            _isinstance(flags, _int) and flags & _write_flags
        )
        if writes and not _inside(path):
            raise _PermissionError("sandbox: writing outside the work directory is not allowed")
    else:
        for name, indices, dir_fd_index in _path_events:
            if name != event:
                continue
            dir_fd = args[dir_fd_index] if dir_fd_index is not None and dir_fd_index < _len(args) else None
            for index in indices:
                if not _inside(args[index], dir_fd):
                    raise _PermissionError("sandbox: " + event + " outside the work directory is not allowed")
            return
    if (
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


def _load_isolation() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("_sandbox_isolation", os.path.join(os.path.dirname(__file__), "_sandbox_isolation.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    config = json.loads(sys.argv[1])
    report = _load_isolation().isolate(config)
    _forget_ctypes()
    with os.fdopen(config["status_fd"], "w") as status:
        status.write(json.dumps(report))
    sys.argv = ["solution.py"]
    if config["audit_hook"]:
        sys.addaudithook(_make_hook(config["workdir"]))
    os._exit(_run_candidate(config["program_path"], config.get("check_path")))


if __name__ == "__main__":
    main()
