import threading
import time

import pytest

from laminar_common.errors import LaminarError
from laminar_common.launch.readiness import wait_ready
from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd, MemberRecord
from laminar_common.roles import Extra, Role


def _member(store, member_id, ready, started_at=None):
    coord = InMemoryCoordinator(store, "job")
    kwargs = {} if started_at is None else {"started_at": started_at}
    extra = {Extra.READY: "1"} if ready else {}
    coord.register(MemberRecord(member_id=member_id, role=Role.WORKER, extra=extra, **kwargs))
    return coord


def test_waits_for_the_ready_record_not_the_registration():
    store = InMemoryEtcd()
    watcher = InMemoryCoordinator(store, "job")
    member = _member(store, "w0", ready=False)
    rec = member._record

    def later():
        time.sleep(0.3)
        member.update_record(MemberRecord(member_id="w0", role=Role.WORKER,
                                          started_at=rec.started_at, extra={Extra.READY: "1"}))

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    got = wait_ready(watcher, Role.WORKER, "w0", timeout_s=5)
    assert time.monotonic() - t0 >= 0.25
    assert [r.member_id for r in got] == ["w0"]


def test_count_newer_than_and_timeouts_name_what_was_seen():
    store = InMemoryEtcd()
    watcher = InMemoryCoordinator(store, "job")
    _member(store, "old", ready=True, started_at=100.0)
    _member(store, "w1", ready=True)
    # The record of an earlier process of the same id (started before) does not count.
    with pytest.raises(LaminarError, match=r"2 worker member\(s\) not ready after 0s; "
                                           r"registered: \['old', 'w1'\]"):
        wait_ready(watcher, Role.WORKER, count=2, timeout_s=0.2, newer_than=1000.0)
    assert len(wait_ready(watcher, Role.WORKER, count=2, timeout_s=1)) == 2


def test_a_process_that_exits_fails_fast():
    watcher = InMemoryCoordinator(InMemoryEtcd(), "job")
    t0 = time.monotonic()
    with pytest.raises(LaminarError, match="exited before it was ready"):
        wait_ready(watcher, Role.TRAINER, "t", timeout_s=30, alive=lambda: False)
    assert time.monotonic() - t0 < 1
