"""A worker's hello to the manager: find it, connect, and be welcomed.

:func:`connect_manager` takes the manager's record (the one the worker was given, with
no etcd call, or the one registered), connects a DEALER with a ``Hello`` (this worker's
id, protocol and package versions, and capacity) and waits for the welcome. It never
references the worker service.
"""

from __future__ import annotations

import logging
import threading
import time

from laminar_common import codec
from laminar_common.auth import CurveAuth
from laminar_common.errors import LaminarError, TransportError
from laminar_common.membership import Coordinator, MemberRecord
from laminar_common.roles import Role
from laminar_common.transport import Client, make_client

from .version import __version__

__all__ = ["connect_manager"]

log = logging.getLogger(__name__)


def connect_manager(coordinator: Coordinator, worker_id: str, capacity: int,
                    stopping: threading.Event, *, auth: CurveAuth | None = None,
                    timeout_s: float = 60.0, known: MemberRecord | None = None,
                    ) -> tuple[Client, MemberRecord] | None:
    """Say hello to the manager: ``known`` (no etcd call), else the one registered,
    waiting up to ``timeout_s`` for one to register; None if ``stopping`` is set first.

    Raises:
        LaminarError: no manager registered in time.
        TransportError: the manager did not welcome this worker.
    """
    deadline = time.monotonic() + timeout_s
    while not stopping.is_set():
        managers = {known.member_id: known} if known is not None else \
            coordinator.members(Role.MANAGER)
        if managers:
            rec = sorted(managers.values(), key=lambda r: r.member_id)[0]
            hello = codec.Hello(member_id=worker_id, role=Role.WORKER,
                                protocol_version=codec.PROTOCOL_VERSION,
                                package_version=__version__, capacity=capacity)
            client = make_client(rec.address, hello, auth=auth)
            try:
                client.connect(timeout_s=10)
            except TransportError:
                client.close()
                raise
            log.info("connected to manager %s at %s", rec.member_id, rec.address)
            return client, rec
        if time.monotonic() > deadline:
            raise LaminarError(f"no manager registered in job {coordinator.keys.job!r} "
                               f"after {timeout_s:.0f}s")
        stopping.wait(0.2)
    return None
