"""Role names and member-record fields: the one place they are spelled.

Every member registers under a role (``members/<role>/<id>`` in etcd) and
tells the job what others need to reach it in ``MemberRecord.extra``; the
tiers, launchers, tools and a custom stack all read these names from here.
"""

from __future__ import annotations

__all__ = ["Role", "Extra", "State", "is_ready"]


class Role:
    """Member roles (``MemberRecord.role``, ``Hello.role``)."""

    RELAY = "relay"
    MANAGER = "manager"
    WORKER = "worker"
    TRAINER = "trainer"
    ALL = (RELAY, MANAGER, WORKER, TRAINER)


class Extra:
    """Keys of ``MemberRecord.extra`` (all values are strings)."""

    READY = "ready"
    """``"1"`` once the member serves: sockets bound, state loaded, peers reached.
    Launchers and tests wait on this instead of parsing a process's stdout."""
    ACK = "ack"
    """Manager: the endpoint a trainer pushes acks and rejections to."""
    MODE = "mode"
    """Manager: its dispatch mode."""
    METRICS = "metrics"
    """Any member: its Prometheus endpoint (``http://host:port/metrics``)."""
    ENGINE = "engine"
    """Worker: the generation engine class."""
    VERSION = "version"
    """Worker / trainer: the weight version it holds when it became ready."""
    STEP = "step"
    """Trainer: the step it starts from (> 0 after ``--resume``)."""
    DATA = "data"
    """Relay: its chunk data-plane endpoint."""
    STORE = "store"
    """Relay: ``memfd`` (same-host readers map it) or ``heap``."""


class State:
    """Names under ``state/`` that a tier owns (its status for ``laminar status``)."""

    TRAINER = "trainer"
    MANAGER = "manager"


def is_ready(extra: dict[str, str]) -> bool:
    """Whether a member record's ``extra`` says the member serves."""
    return extra.get(Extra.READY) == "1"
