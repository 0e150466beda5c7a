"""Memory for weight versions: the store's buffer backends.

Owns how a version's bytes are held in this process: ``memfd`` shared memory
(Linux; a same-host reader maps it read-only through ``/proc/<pid>/fd/<fd>``
while it holds a lease, and the kernel frees it when the relay exits, even by
SIGKILL) or private heap memory.

Invariant: a buffer is never unmapped explicitly. ``free()`` gives up the
relay's handle; memory views still in use (a data-plane send, a reader) keep
the mapping valid until they are released.
"""

from __future__ import annotations

import abc
import mmap
import os
from collections.abc import Callable

from laminar_common.errors import LaminarError

__all__ = ["VersionBuffer", "MemfdBuffer", "HeapBuffer", "make_allocator"]


class VersionBuffer(abc.ABC):
    """Writable memory for one version; ``share_path`` is set when other processes can map it."""

    nbytes: int
    view: memoryview
    share_path: str = ""

    @abc.abstractmethod
    def free(self) -> None:
        """Give the memory back (views still held elsewhere stay valid until dropped)."""


class MemfdBuffer(VersionBuffer):
    """Anonymous shared memory (``memfd_create``), mappable by same-host readers."""

    def __init__(self, nbytes: int, name: str) -> None:
        self.nbytes = nbytes
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            self._mm = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED)
        except OSError:
            os.close(self._fd)
            raise
        self.view = memoryview(self._mm)
        self.share_path = f"/proc/{os.getpid()}/fd/{self._fd}"

    def free(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.share_path = ""


class HeapBuffer(VersionBuffer):
    """Private process memory (readers stream it)."""

    def __init__(self, nbytes: int, name: str) -> None:
        self.nbytes = nbytes
        self.view = memoryview(bytearray(nbytes))

    def free(self) -> None:
        pass


def make_allocator(backend: str) -> Callable[[int, str], VersionBuffer]:
    """Buffer factory for a store backend (``memfd`` or ``heap``)."""
    if backend == "memfd":
        if not hasattr(os, "memfd_create"):
            raise LaminarError("store.backend=memfd needs Linux; use store.backend=heap here")
        return MemfdBuffer
    if backend == "heap":
        return HeapBuffer
    raise LaminarError(f"unknown store backend {backend!r}; use memfd or heap")
