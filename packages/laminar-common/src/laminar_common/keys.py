"""The whole etcd key schema. Nothing else in Laminar formats an etcd key.

Every key lives under ``/laminar/<job>/``:

- ``members/<role>/<member_id>``: a member record (JSON), bound to its lease.
- ``weights/latest``: the latest complete weight version (JSON), written by
  compare-and-swap so versions only increase.
- ``weights/versions/<version:012d>``: the manifest summary of one version.
- ``election/<name>``: a singleton owner (e.g. the master relay), bound to the
  owner's lease so it vanishes when the owner dies.
- ``state/<name>``: small singletons a tier owns (e.g. the manager's cursor).
- ``protocol``: the ``PROTOCOL_VERSION`` of the job, set by its first member;
  a member speaking another version is refused at registration.

Versions are zero-padded so that lexical order is numeric order.
"""

from __future__ import annotations

import re

__all__ = ["JobKeys", "validate_name"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def validate_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a safe key segment, else raise ``ValueError``."""
    if not _NAME.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use 1-128 characters from "
            "[A-Za-z0-9_.-], starting with a letter or digit"
        )
    return value


class JobKeys:
    """Builds every etcd key of one job."""

    def __init__(self, job: str, root: str = "/laminar") -> None:
        self.job = validate_name("job", job)
        self.prefix = f"{root.rstrip('/')}/{job}/"

    def members(self, role: str | None = None) -> str:
        """Prefix of all member records, or of one role's."""
        if role is None:
            return f"{self.prefix}members/"
        return f"{self.prefix}members/{validate_name('role', role)}/"

    def member(self, role: str, member_id: str) -> str:
        return f"{self.members(role)}{validate_name('member id', member_id)}"

    def parse_member(self, key: str) -> tuple[str, str]:
        """Split a member key into ``(role, member_id)``."""
        rest = key[len(self.members()):] if key.startswith(self.members()) else None
        if rest is None or rest.count("/") != 1:
            raise ValueError(f"{key!r} is not a member key of job {self.job!r}")
        role, member_id = rest.split("/")
        return role, member_id

    def protocol(self) -> str:
        """The protocol version the job's first member registered with."""
        return f"{self.prefix}protocol"

    def weights_latest(self) -> str:
        return f"{self.prefix}weights/latest"

    def weights_versions(self) -> str:
        return f"{self.prefix}weights/versions/"

    def weights_version(self, version: int) -> str:
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        return f"{self.weights_versions()}{version:012d}"

    def election(self, name: str) -> str:
        return f"{self.prefix}election/{validate_name('election', name)}"

    def state(self, name: str) -> str:
        return f"{self.prefix}state/{validate_name('state', name)}"
