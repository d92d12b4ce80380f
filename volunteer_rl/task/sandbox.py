"""The reward worker's walls (Linux; task.bounded_worker raises them, task.bounded_process
starts the worker inside the rest): what a completion that takes over a task's reward (a
grader that parses answers with `sympy.sympify` evaluates them) can still reach.

Two layers, each set up by the worker itself while it is still trusted, and each one that the
kernel refuses named in the worker's ready line (the trainer says so once, in one line):

- Namespaces, before the task loads (`enter_namespaces`): a user namespace (no privilege of
  the trainer's user outside it, root's included), a network namespace (no interface but a
  loopback that is down: no TCP, UDP or abstract Unix socket reaches anything), and a PID
  namespace for every process the worker starts. Its first process, `reaper`, forked here,
  is the namespace's init: when it dies the kernel kills every process in the namespace,
  whatever session or group they moved to. It dies when the trainer kills it (its pid is in
  the ready line) and when the worker ends (a pipe only the worker holds reaches EOF).
- Landlock, after the task has loaded and before the first completion (`restrict`): the
  worker and everything it starts may read and execute only under READ_ROOTS and the
  folders on its sys.path and Python's prefixes, write only in its own folder (and
  /dev/null), open no TCP connection or port (ABI 4), and send no signal to, nor reach an
  abstract socket of, a process outside (ABI 6). Not /proc: not the trainer's environment,
  descriptors or memory. The restriction cannot be lifted by the process or its children.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import struct
import sys

_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = _CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNET
"""The namespaces the worker enters: user (no privilege outside), PID (its processes die
together), network (nothing to connect to)."""

READ_ROOTS = ("/usr", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache", "/dev/urandom",
              "/dev/random", "/dev/zero")
"""What a worker may read and execute besides its sys.path folders and Python's prefixes: the
system's programs and shared libraries (a lazy import of a C extension loads them), the
loader's cache, and random bytes. Nothing under /etc, /home, /root, /proc, /tmp or /var."""

FULL_ABI = 6
"""The Landlock ABI that has every wall restrict() raises (4: TCP; 6: signals and abstract
sockets); a kernel with less is named in the ready line."""

# Landlock's ABI (linux/landlock.h): syscall numbers are the same on every architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_V1 = (1 << 13) - 1  # execute .. make_sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_ONLY = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV
_NET_TCP = (1 << 0) | (1 << 1)  # bind, connect
_SCOPE_ALL = (1 << 0) | (1 << 1)  # abstract unix sockets, signals
_PR_SET_NO_NEW_PRIVS = 38


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _why(call: str) -> str:
    e = ctypes.get_errno()
    return f"{call}: {errno.errorcode.get(e, e)} ({os.strerror(e)})"


def enter_namespaces() -> tuple[int | None, str | None]:
    """Unshare NAMESPACES, keeping this process's uid and gid inside, and fork the PID
    namespace's reaper. Returns the reaper's pid (None: the kernel refused, nothing changed)
    and why the kernel refused something (None: nothing). Call while the process has one
    thread."""
    if not sys.platform.startswith("linux"):
        return None, "not Linux"
    uid, gid = os.getuid(), os.getgid()
    if _libc().unshare(NAMESPACES) != 0:
        return None, _why("unshare")
    why = None
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError as exc:
        # Inside the namespaces with no mapping: the kernel still checks files against our
        # own uid, and the worker shows as nobody. Go on, and say so.
        why = f"uid_map: {exc.strerror}"
    return reaper(), why


def reaper() -> int:
    """Fork the PID namespace's first process and return its pid (as the trainer sees it).
    It holds no descriptor of the worker's, reaps what is orphaned in the namespace, and ends
    when the worker does (the read end of a pipe whose write end, non-inheritable, stays here
    reaches EOF); the trainer also kills it when it ends the worker."""
    r, _held = os.pipe()  # the write end stays open, unused, until the worker ends
    pid = os.fork()
    if pid == 0:
        try:
            os.closerange(0, r)
            os.closerange(r + 1, os.sysconf("SC_OPEN_MAX"))
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the orphans
            while os.read(r, 1):
                pass
        finally:
            os._exit(0)
    os.close(r)
    return pid


def _abi() -> int:
    return _libc().syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)


def _fs_rights(abi: int) -> int:
    return _FS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0) | \
        (_IOCTL_DEV if abi >= 5 else 0)


def read_roots() -> list[str]:
    """Every path a worker may read under: READ_ROOTS, its sys.path, Python's prefixes."""
    found = [*READ_ROOTS, *sys.path, sys.prefix, sys.exec_prefix, sys.base_prefix,
             sys.base_exec_prefix]
    return list(dict.fromkeys(os.path.abspath(p) for p in found if p))


def restrict(folder: str) -> int | str:
    """Landlock this process and all it starts from now on: read and execute under
    read_roots(), everything in `folder`, /dev/null read and written; no TCP; no signal or
    abstract socket outside. The ABI it got, or why the kernel refused (then nothing
    changed)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    libc = _libc()
    abi = _abi()
    if abi < 1:
        return _why("landlock_create_ruleset")
    fs = _fs_rights(abi)
    attr = struct.pack("=QQQ", fs, _NET_TCP, _SCOPE_ALL)[:8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = libc.syscall(_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        return _why("landlock_create_ruleset")
    try:
        rules = [(p, _EXECUTE | _READ_FILE | _READ_DIR) for p in read_roots()]
        rules += [(folder, fs), (os.devnull, _READ_FILE | _WRITE_FILE | (fs & _TRUNCATE))]
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not here: nothing to allow
            try:
                if not os.path.isdir(path):
                    rights &= _FILE_ONLY
                rule = struct.pack("=Qi", rights & fs, fd)
                if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, rule, 0) != 0:
                    return _why(f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return _why("prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_RESTRICT_SELF, ruleset, 0) != 0:
            return _why("landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi
