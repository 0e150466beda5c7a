"""The seccomp filter a sandboxed snippet runs under, compiled with libseccomp.

Owns the list of system calls a model-written snippet may not make and turning it
into a BPF program (``pyseccomp``, ctypes bindings to the system's libseccomp,
API-compatible with libseccomp's own Python bindings). The sandbox's supervisor
installs the program in the snippet's process right before ``exec`` (after the
uid drop and ``PR_SET_NO_NEW_PRIVS``), under both isolation modes.

Refused calls fail with ``EPERM`` (``clone3`` with ``ENOSYS``, so that libc falls
back to ``clone``, whose namespace flags are checked); a call from another
architecture's ABI (x32, i386 ``int 0x80``) kills the process (libseccomp's
default for a foreign architecture). Everything else is allowed: the filter
closes the kernel's attack surface the namespaces do not, it is not a whitelist.

This module imports no sandbox or rollout code.
"""

from __future__ import annotations

import errno
import functools
import io
import logging

__all__ = ["DENIED_SYSCALLS", "NAMESPACE_FLAGS", "compile_filter", "seccomp_unavailable"]

log = logging.getLogger(__name__)

DENIED_SYSCALLS: tuple[str, ...] = (
    # other processes' memory and execution
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # mounts and namespaces (namespace flags of clone are checked separately)
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "mount_setattr",
    # kernel keyrings, eBPF, perf, userfaultfd, io_uring
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # kernel modules, kexec, reboot, swap, accounting, clocks, hostname
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "adjtimex",
    "clock_adjtime", "sethostname", "setdomainname", "syslog",
    # raw devices and handles
    "iopl", "ioperm", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "quotactl", "nfsservctl", "vhangup", "personality",
)
"""System calls the snippet's process may not make (EPERM)."""

NAMESPACE_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                   | 0x20000000 | 0x40000000 | 0x00000080)
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME:
a ``clone`` with any of them is refused."""


@functools.cache
def seccomp_unavailable() -> str | None:
    """None where a filter can be compiled here, else why not (no bindings or library)."""
    try:
        import pyseccomp
    except ImportError:
        return "the pyseccomp package is not installed"
    except OSError as exc:  # the bindings found no libseccomp.so.2
        return f"libseccomp cannot be loaded ({exc}); install libseccomp2"
    try:
        pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    except Exception as exc:  # noqa: BLE001 - any failure of the C library means "unavailable"
        return f"libseccomp refused to build a filter: {type(exc).__name__}: {exc}"
    return None


@functools.cache
def compile_filter() -> bytes:
    """The BPF program (``struct sock_filter`` array) refusing :data:`DENIED_SYSCALLS`.

    Raises:
        RuntimeError: :func:`seccomp_unavailable` says why no filter can be built.
    """
    why = seccomp_unavailable()
    if why is not None:
        raise RuntimeError(why)
    import pyseccomp as sc

    filt = sc.SyscallFilter(sc.ALLOW)
    skipped = []
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):  # a call this kernel/arch does not have
            skipped.append(name)
    for bit in range(32):
        flag = 1 << bit
        if NAMESPACE_FLAGS & flag:
            filt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    if skipped:
        log.debug("seccomp: not on this architecture: %s", ", ".join(skipped))
    out = io.BytesIO()
    _export(filt, out)
    return out.getvalue()


def _export(filt, out: io.BytesIO) -> None:
    """``filt.export_bpf`` needs a real file descriptor: go through a memfd."""
    import os

    fd = os.memfd_create("laminar-seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb") as fh:
            filt.export_bpf(fh)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        out.write(b"".join(chunks))
    finally:
        os.close(fd)
