"""Configuration of ``laminar-relay serve``: one frozen pydantic model.

Owns every knob of a relay process and its validation. Library classes never
see this model: :func:`laminar_relay.service.make_relay_service` turns it into
plain constructor arguments.

Invariants: a :class:`RelayConfig` is complete and consistent once built
(cross-field checks run in validators), so the service never meets a bad value.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from laminar_common.config import (
    AuthConfig,
    EtcdConfig,
    LaminarModel,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
)
from laminar_common.keys import validate_name
from laminar_common.relay.manifests import MAX_CHUNK_BYTES

__all__ = ["RelayConfig", "StoreConfig", "DataPlaneConfig", "ChainConfig"]

GiB = 1024**3


class StoreConfig(LaminarModel):
    """The versioned weight store in host memory."""

    backend: Literal["memfd", "heap"] = "memfd"
    """``memfd``: versions live in shared-memory files that same-host readers
    map without a copy (Linux); ``heap``: private memory, readers stream."""
    max_bytes: int = Field(default=16 * GiB, gt=0)
    """Memory cap for all versions held, including those being received."""
    max_version_bytes: int | None = Field(default=None, gt=0)
    """Largest version accepted (default: half of ``max_bytes``, so a new
    version fits next to the previous one)."""
    keep_versions: int = Field(default=2, ge=1)
    """Retention: keep the newest K complete versions (older ones are dropped
    as soon as no reader holds them)."""
    max_tensors: int = Field(default=1_000_000, ge=1)
    """Largest number of tensors a manifest may list."""
    reader_lease_s: float = Field(default=300.0, gt=0)
    """A reader's hold on a version expires after this if not released."""

    @model_validator(mode="after")
    def _version_fits(self) -> StoreConfig:
        if self.max_version_bytes is not None and self.max_version_bytes > self.max_bytes:
            raise ValueError(
                f"max_version_bytes ({self.max_version_bytes}) exceeds max_bytes ({self.max_bytes})"
            )
        return self

    @property
    def version_limit(self) -> int:
        return self.max_version_bytes or self.max_bytes // 2


class DataPlaneConfig(LaminarModel):
    """How chunk bytes travel between publisher, relays and remote readers."""

    type: Literal["zmq"] = "zmq"
    """Transport for pushes (publish and chain): ZeroMQ multipart over TCP."""
    port: int = Field(default=0, ge=0, le=65535)
    """Data-plane TCP port (0: any free port; it is advertised in etcd)."""
    max_chunk_bytes: int = Field(default=MAX_CHUNK_BYTES, gt=0, le=MAX_CHUNK_BYTES)
    """Chunks larger than this are rejected."""
    send_hwm: int = Field(default=8, ge=1)
    """Chunks queued per downstream connection before a send blocks (backpressure)."""
    send_timeout_s: float = Field(default=10.0, gt=0)
    """A send blocked this long fails (the receiver is gone or stuck)."""
    verify_threads: int = Field(default=2, ge=1, le=64)
    """Threads checksumming and storing received chunks."""


class ChainConfig(LaminarModel):
    """Chain broadcast and publish sessions."""

    verify_forwarded: bool = True
    """Checksum chunks received from an upstream relay (the master always
    checksums what a publisher sends)."""
    max_forward_bytes_per_s: int = Field(default=0, ge=0)
    """Rate limit on the link to the downstream relay (0: unlimited)."""
    commit_timeout_s: float = Field(default=60.0, gt=0)
    """How long a commit waits for chunks still in flight."""
    session_idle_s: float = Field(default=30.0, gt=0)
    """An open publish session with no traffic for this long is dropped."""
    control_interval_s: float | None = Field(default=None, gt=0)
    """How often to re-check the election and the chain (default: TTL / 3)."""
    master_probe_interval_s: float = Field(default=0.2, ge=0)
    """How often the relay next to the master in the chain checks that the master's port
    still accepts connections. A port that refuses them means the master's process is
    gone: this relay revokes its lease and takes over at once instead of waiting for the
    lease to expire (a paused or cut-off master still fails over by lease). 0: off."""


class RelayConfig(ListenConfig):
    """Everything ``laminar-relay serve`` needs."""

    job: str = "laminar"
    """Job name: relays, trainer and rollouts of one job share it (etcd prefix)."""
    member_id: str | None = None
    """This relay's id in etcd (default: ``relay-<hostname>-<pid>``)."""
    grpc_port: int = Field(default=0, ge=0, le=65535)
    """Control API (gRPC) port (0: any free port; it is advertised in etcd)."""
    grpc_workers: int = Field(default=16, ge=2)
    """Threads serving gRPC calls (a commit or a waiting fetch holds one)."""
    max_fetch_wait_s: float = Field(default=120.0, ge=0)
    """Cap on how long a fetch may wait for a version still arriving."""
    data: DataPlaneConfig = DataPlaneConfig()
    store: StoreConfig = StoreConfig()
    chain: ChainConfig = ChainConfig()
    etcd: EtcdConfig = EtcdConfig()
    metrics: MetricsConfig = MetricsConfig()
    """Prometheus /metrics endpoint (off unless metrics.port is set)."""
    auth: AuthConfig = AuthConfig()
    """With auth.dir: mutual TLS on the gRPC control API (only the trainer's certificate
    and relays' own may publish) and CURVE on the weight data plane; off unless set."""
    logging: LoggingConfig = LoggingConfig()

    @field_validator("job")
    @classmethod
    def _job_name(cls, value: str) -> str:
        return validate_name("job", value)

    @field_validator("member_id")
    @classmethod
    def _member_name(cls, value: str | None) -> str | None:
        return None if value is None else validate_name("member id", value)
