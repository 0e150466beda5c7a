"""A minimal stand-alone member: registers in etcd, serves a trajectory sink.

It exists to exercise the shared core end to end without any tier: the
membership demo (``laminar demo``) and the failure tests (SIGKILL, etcd
restart, protocol refusal) run it as a real separate process. It must not
grow tier logic.
"""

from __future__ import annotations

import logging
import socket

from pydantic import Field

from laminar_common.codec import PROTOCOL_VERSION
from laminar_common.config import EtcdConfig, LaminarModel, LoggingConfig
from laminar_common.etcd import make_coordinator
from laminar_common.membership import MemberRecord, MembershipEvent
from laminar_common.service import Service
from laminar_common.transport import PullReceiver, make_pull_receiver
from laminar_common.version import __version__

__all__ = ["MemberConfig", "MemberService"]

log = logging.getLogger(__name__)


class MemberConfig(LaminarModel):
    """Config of ``laminar member``."""

    job: str = "laminar"
    """Job name: all keys live under /laminar/<job>/."""
    member_id: str = Field(default_factory=lambda: f"member-{socket.gethostname()}")
    """This member's id, unique in the job."""
    role: str = "probe"
    """Role the member registers under."""
    listen: str = "tcp://127.0.0.1:0"
    """ZeroMQ endpoint of the member's message sink."""
    protocol_version: int = PROTOCOL_VERSION
    """Protocol version to claim (tests set another to see the refusal)."""
    etcd: EtcdConfig = EtcdConfig()
    """etcd connection and lease."""
    logging: LoggingConfig = LoggingConfig()
    """Log level and format."""


class MemberService(Service):
    """Registers, watches the job's members, counts what its sink receives."""

    name = "member"

    def __init__(self, config: MemberConfig) -> None:
        super().__init__()
        self.config = config
        self.coordinator = None
        self.receiver: PullReceiver | None = None

    def _start(self) -> None:
        self.receiver = make_pull_receiver(self.config.listen)
        self.coordinator = make_coordinator(self.config.etcd, self.config.job)
        self.coordinator.watch_members(self._on_member)
        self.coordinator.register(MemberRecord(
            member_id=self.config.member_id,
            role=self.config.role,
            address=self.receiver.endpoint,
            package_version=__version__,
            protocol_version=self.config.protocol_version,
        ))
        print(f"REGISTERED {self.config.member_id} {self.receiver.endpoint}", flush=True)
        self.spawn(self._sink_loop, "sink")

    def _on_member(self, event: MembershipEvent) -> None:
        log.info("member %s: %s/%s", event.kind, event.role, event.member_id)
        print(f"MEMBER {event.kind} {event.role}/{event.member_id}", flush=True)

    def _sink_loop(self) -> None:
        assert self.receiver is not None
        while not self.stopping.is_set():
            msg = self.receiver.recv(timeout_s=0.2)
            if msg is not None:
                stats = self.receiver.stats
                print(f"SINK received={stats.received} kind={type(msg).__name__} "
                      f"rejected={dict(sorted(stats.rejected.items()))}", flush=True)

    def _close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        if self.receiver is not None:
            self.receiver.close()
