"""The isolation steps of the sandbox (loaded by `_sandbox_bootstrap` inside the sandboxed
interpreter; not imported as part of the package).

Order matters: each step needs privileges a later one gives up.
1. Namespaces, each asked for on its own so a kernel that refuses one still grants the
   others: user (only when not root: it gives the mount and pid namespaces to an ordinary
   user; the user keeps its own uid inside), mount, pid, network, ipc, uts.
2. With a pid namespace, a fork: the child is the namespace's init and runs the candidate;
   the parent only waits and exits the same way.
3. The filesystem view (mount namespace): every mount read-only, nosuid, nodev; the
   directories that hold other users' and this user's private files (`_HIDDEN_DIRS`) replaced
   by empty tmpfs, with only the interpreter's prefix and the work directory bound back;
   the work directory the one writable place; /proc a fresh procfs of the pid namespace
   (or, where the kernel refuses that, an empty one).
4. Resource limits (CPU seconds, address space, file size, processes, open files, no core).
5. The uid: as root, every uid and gid becomes the configured unprivileged one (nobody by
   default), which also drops every capability; as an ordinary user the uid stays and the
   capabilities the user namespace gave are dropped. Then no_new_privs.
`isolate` returns a report of what held; a step the kernel refuses is left out of it, except
the uid drop, whose failure ends the run (a candidate never runs as root).

No seccomp or landlock filter: the uid drop and the namespaces already take away what a
filter would (other processes, the network, writes outside the work directory, reading
private files), and a hand-written BPF program per architecture is a larger risk than it
removes.
"""

import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # one number on every architecture (asm-generic table, Linux 5.12+)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 1, 38, 24
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Where private files live: each is replaced by an empty tmpfs (paths the sandbox needs inside
# them are bound back). /tmp holds pytest's and other services' scratch files, /root and
# /home keys and tokens, /run sockets and secrets.
_HIDDEN_DIRS = ("/root", "/home", "/tmp", "/var/tmp", "/run", "/dev/shm", "/mnt", "/media", "/srv")
_NAMESPACES = (("mount", CLONE_NEWNS), ("pid", CLONE_NEWPID), ("network", CLONE_NEWNET),
               ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS))


class _Kernel:
    """The few system calls Python 3.11's os module lacks, through libc."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
        self.libc.syscall.restype = ctypes.c_long

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags: int) -> str | None:
        """Enter new namespaces; None, or why the kernel refused."""
        return None if self.libc.unshare(flags) == 0 else os.strerror(self.ctypes.get_errno())

    def mount(self, source, target: str, fstype, flags: int, data=None) -> None:
        encode = lambda value: None if value is None else value.encode()  # noqa: E731
        self._check(self.libc.mount(encode(source), target.encode(), encode(fstype), flags, encode(data)),
                    f"mount {target}")

    def mount_setattr(self, path: str, flags: int, attr_set: int, attr_clr: int = 0) -> None:
        attr = (self.ctypes.c_uint64 * 4)(attr_set, attr_clr, 0, 0)
        result = self.libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, self.ctypes.byref(attr),
                                   self.ctypes.sizeof(attr))
        self._check(result, f"mount_setattr {path}")

    def prctl(self, option: int, value: int) -> None:
        self._check(self.libc.prctl(option, value, 0, 0, 0), f"prctl {option}")

    def drop_capabilities(self) -> None:
        """Empty the bounding, effective, permitted and inheritable sets."""
        for capability in range(64):
            if self.libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
                break  # past the last capability this kernel knows
        header = (self.ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
        data = (self.ctypes.c_uint32 * 6)()
        self._check(self.libc.capset(self.ctypes.byref(header), self.ctypes.byref(data)), "capset")


def _unshare(kernel: _Kernel, config: dict, report: dict) -> None:
    """Enter every namespace the kernel grants; `report["namespaces"]` lists them."""
    wanted = {"mount": config["mount_namespace"], "pid": config["pid_namespace"],
              "network": config["network_namespace"], "ipc": True, "uts": True}
    if not any(wanted.values()):
        return
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        refused = kernel.unshare(CLONE_NEWUSER)
        if refused is not None:
            report["errors"].append(f"user namespace refused: {refused}")
            return
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as file:
                    file.write(text)
            report["namespaces"].append("user")
        except OSError as error:  # e.g. this uid is itself unmapped: the ids stay as they were
            report["errors"].append(f"user namespace ids: {error}")
    for name, flag in _NAMESPACES:
        if wanted[name]:
            refused = kernel.unshare(flag)
            if refused is None:
                report["namespaces"].append(name)
            else:
                report["errors"].append(f"{name} namespace refused: {refused}")


def _is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _build_view(kernel: _Kernel, workdir: str, report: dict) -> None:
    """The read-only filesystem view of step 3 (in the new mount namespace)."""
    kernel.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    exposed = sorted({os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), workdir})
    handles = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in exposed}
    try:
        hidden = [d for d in _HIDDEN_DIRS if os.path.isdir(d) and not os.path.islink(d)
                  and not any(_is_under(d, path) for path in exposed)]
        for directory in hidden:
            kernel.mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
        for path, handle in handles.items():
            if path == workdir or any(_is_under(path, directory) for directory in hidden):
                os.makedirs(path, exist_ok=True)
                kernel.mount(f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC)
    finally:
        for handle in handles.values():
            os.close(handle)
    report["hidden_dirs"] = hidden
    kernel.mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    kernel.mount_setattr(workdir, 0, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, attr_clr=MOUNT_ATTR_RDONLY)
    report["read_only_root"] = True
    os.chdir(workdir)  # the old cwd is the directory under the new mount, now read-only


def _mount_proc(kernel: _Kernel, in_pid_namespace: bool, report: dict) -> None:
    """This pid namespace's own /proc, or an empty one where that is refused (a container
    whose /proc has parts masked refuses a new procfs to a user namespace)."""
    if in_pid_namespace:
        try:
            kernel.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
            report["proc"] = "private"
            return
        except OSError:
            pass
    kernel.mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")
    report["proc"] = "empty"


def _isolate_filesystem(kernel: _Kernel, config: dict, report: dict) -> None:
    if "mount" not in report["namespaces"]:
        return
    try:
        _build_view(kernel, config["workdir"], report)
        _mount_proc(kernel, "pid" in report["namespaces"], report)
    except OSError as error:
        report["errors"].append(str(error))


def _drop_privileges(kernel: _Kernel, config: dict, report: dict) -> None:
    """Step 5: the unprivileged uid (as root), no capabilities, no_new_privs."""
    if os.geteuid() == 0 and config["run_as_uid"] is not None:
        os.setgroups([])
        os.setresgid(config["run_as_gid"], config["run_as_gid"], config["run_as_gid"])
        os.setresuid(config["run_as_uid"], config["run_as_uid"], config["run_as_uid"])
    if "user" in report["namespaces"]:
        kernel.drop_capabilities()
    kernel.prctl(PR_SET_NO_NEW_PRIVS, 1)
    report["uid"], report["gid"] = os.getuid(), os.getgid()


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


def isolate(config: dict) -> dict:
    """Steps 1-5 of the module docstring; returns the report of what holds."""
    report = {"namespaces": [], "read_only_root": False, "hidden_dirs": [], "proc": "host", "errors": []}
    kernel = _Kernel()
    _unshare(kernel, config, report)
    if "pid" in report["namespaces"]:
        child_pid = os.fork()
        if child_pid != 0:
            os.close(config["status_fd"])  # only the candidate's side reports
            _wait_and_mirror(child_pid)
        kernel.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _isolate_filesystem(kernel, config, report)
    _limit(config)
    _drop_privileges(kernel, config, report)
    return report
