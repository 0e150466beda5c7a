"""A relay's place in the tier: the master election, the chain, and the master probe.

:class:`ChainPosition` reads the election (``relay-master``) and the relay members
from etcd when the control loop asks (:meth:`~ChainPosition.refresh`): it campaigns
when nobody holds the election, takes the election back from an earlier process of
this relay, orders the chain from the master, and hands the downstream neighbour to
the forwarder. The relay right after the master probes the master's port
(:meth:`~ChainPosition.probe_loop`): a port that refuses connections is a dead master,
whose lease it revokes to take over at once (a paused or cut-off master still fails
over by lease). The master makes each committed version visible in etcd, fenced by
its hold (:meth:`~ChainPosition.make_visible`). It never references the relay service.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from laminar_common.codec import WeightManifest
from laminar_common.errors import (
    CoordinationError,
    EtcdUnavailableError,
    FencedError,
    LaminarError,
)
from laminar_common.membership import Coordinator, MemberRecord, VersionRecord
from laminar_common.relay.wire import (
    MASTER_ELECTION,
    RELAY_ROLE,
    NotMasterError,
    VersionConflictError,
)

from .chain import neighbours, order_chain

__all__ = ["ChainPosition"]

log = logging.getLogger(__name__)


def _refuses(address: str, timeout_s: float = 1.0) -> bool:
    """Whether ``host:port`` actively refuses a TCP connection (nothing listens there).
    A timeout or an unreachable host is not a refusal: a paused or cut-off process looks
    like that, and only its lease may decide it is gone."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


class ChainPosition:
    """This relay's role in the tier (see module docstring).

    Args:
        set_downstream: hand the downstream neighbour (or None) to the forwarder.
        wake: set to make the control loop refresh at once.
        probe_interval_s: how often the master probe looks (0: off).
    """

    def __init__(self, coordinator: Coordinator, member_id: str,
                 set_downstream: Callable[[MemberRecord | None], None],
                 wake: threading.Event, probe_interval_s: float) -> None:
        self.coordinator = coordinator
        self.member_id = member_id
        self.set_downstream = set_downstream
        self.wake = wake
        self.probe_interval_s = probe_interval_s
        self.is_master = False
        self.master_id: str | None = None
        self.chain: list[str] = []
        self.upstream_id = ""
        self.takeovers = 0
        """Times this relay revoked a dead master's lease to take over."""
        self.probe_target: tuple[str, str, int] | None = None
        """(master id, its address, the election key's lease) for the master probe, when
        this relay is the one after the master in the chain."""

    def refresh(self) -> None:
        """Read the election and the members once: take over an earlier process's hold,
        campaign when nobody holds the election, and set the chain, this relay's
        neighbours and what the probe may check."""
        held = self.coordinator.election(MASTER_ELECTION)
        leader = held[0] if held else None
        if leader == self.member_id and not self.coordinator.owns(MASTER_ELECTION):
            # An earlier process of this relay (same member id, now dead: this one
            # replaced its record) still holds the election under its lease.
            if self.coordinator.evict_leader(MASTER_ELECTION, leader, held[1]):
                self.takeovers += 1
                log.warning("relay %s: the master election was held by an earlier process "
                            "of this relay; revoked its lease", self.member_id)
            held = self.coordinator.election(MASTER_ELECTION)
            leader = held[0] if held else None
        if leader is None and self.coordinator.registered:
            if self.coordinator.campaign(MASTER_ELECTION, self.member_id):
                log.info("relay %s won the master election", self.member_id)
            held = self.coordinator.election(MASTER_ELECTION)
            leader = held[0] if held else None
        members = self.coordinator.members(RELAY_ROLE)
        chain = order_chain(members, leader)
        upstream, downstream = neighbours(chain, self.member_id)
        was_master = self.is_master
        self.master_id = leader
        self.is_master = leader == self.member_id and self.coordinator.owns(MASTER_ELECTION)
        if self.is_master != was_master:
            log.info(
                "relay %s is %s the master",
                self.member_id,
                "now" if self.is_master else "no longer",
            )
        ids = [m.member_id for m in chain]
        if ids != self.chain:
            log.info("chain: %s", " -> ".join(ids) or "(empty)")
        self.chain = ids
        self.upstream_id = upstream.member_id if upstream else ""
        # One value the probe reads whole: the master it may check, where, under which
        # lease (a torn read could pair a new master with the dead one's address).
        address = next((m.address for m in chain if m.member_id == leader), "")
        self.probe_target = (leader, address, held[1]) \
            if held and upstream is not None and upstream.member_id == leader and address \
            and not self.is_master else None
        self.set_downstream(downstream)

    def probe_loop(self, stopping: threading.Event) -> None:
        """The relay after the master in the chain: a master port that refuses
        connections is a dead master; revoke its lease and take over now."""
        while not stopping.wait(self.probe_interval_s):
            target = self.probe_target
            if target is None:
                continue
            master, address, lease = target
            if not _refuses(address) or not _refuses(address):  # a second look
                continue
            try:
                # Only the lease seen with that address: a master restarted since (a new
                # process, a new lease) is not touched.
                revoked = self.coordinator.evict_leader(MASTER_ELECTION, master, lease)
            except LaminarError as exc:
                log.warning("relay %s: master %s refuses connections at %s but its lease "
                            "could not be revoked (%s); waiting for it to expire",
                            self.member_id, master, address, exc)
                continue
            if revoked:
                self.takeovers += 1
                log.warning("relay %s: master %s refuses connections at %s (its process is "
                            "gone): revoked its lease to take over without waiting for it "
                            "to expire", self.member_id, master, address)
            self.wake.set()

    def current_master(self) -> str | None:
        """The master's id, as the servicer names it to a publisher."""
        leader = self.coordinator.leader(MASTER_ELECTION)
        if leader == self.member_id and not self.coordinator.owns(MASTER_ELECTION):
            return f"{leader} (an earlier process of this relay)"
        return leader

    def make_visible(self, manifest: WeightManifest) -> None:
        """The master's commit: the version is the job's latest in etcd, fenced by this
        relay's hold of the election (a master that lost it is refused).

        Raises:
            NotMasterError, VersionConflictError, EtcdUnavailableError.
        """
        record = VersionRecord(
            version=manifest.version,
            total_bytes=manifest.total_bytes,
            master_id=self.member_id,
            trainer_step=manifest.trainer_step,
        )
        try:
            self.coordinator.publish_version(record, fence=MASTER_ELECTION)
        except FencedError as exc:
            self.wake.set()
            raise NotMasterError(f"relay {self.member_id} is no longer the master, weight "
                                 f"version {manifest.version} was not made visible: {exc}; "
                                 "re-resolve the master and retry") from exc
        except EtcdUnavailableError:
            raise
        except CoordinationError as exc:
            raise VersionConflictError(str(exc)) from exc
        log.info("relay %s published version %d in etcd", self.member_id, manifest.version)
