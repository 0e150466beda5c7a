"""StatusWriter: a caller never waits on etcd; values coalesce while it is stuck."""

from __future__ import annotations

import threading
import time

from laminar_common.errors import CoordinationError
from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd
from laminar_common.status import StatusWriter


class _StuckCoordinator(InMemoryCoordinator):
    """put_state blocks until released (an etcd hang), then fails once."""

    def __init__(self, store):
        super().__init__(store, "job")
        self.release = threading.Event()
        self.fail_next = False

    def put_state(self, name, value):
        self.release.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise CoordinationError("etcd unreachable (test)")
        super().put_state(name, value)


def test_put_never_blocks_and_only_the_newest_value_is_written():
    store = InMemoryEtcd()
    coord = _StuckCoordinator(store)
    writer = StatusWriter(coord, "test")
    t0 = time.monotonic()
    for i in range(200):
        writer.put("trainer", f"step {i}".encode())
    assert time.monotonic() - t0 < 0.5, "put waited on the stuck store"
    coord.release.set()
    assert writer.flush(5)
    assert coord.get_state("trainer") == b"step 199"
    assert writer.coalesced >= 190 and writer.written <= 3
    writer.close()


def test_failures_are_counted_not_raised():
    store = InMemoryEtcd()
    coord = _StuckCoordinator(store)
    coord.release.set()
    coord.fail_next = True
    writer = StatusWriter(coord, "test")
    writer.put("manager", b"a")
    assert writer.flush(5)
    assert writer.failed == 1 and coord.get_state("manager") is None
    writer.put("manager", b"b")
    assert writer.flush(5) and coord.get_state("manager") == b"b"
    writer.close()
