"""laminar_common: the core every Laminar tier shares.

The top level is the core: errors, config, the wire codec, transports,
membership and its etcd coordinator, the service lifecycle, auth, metrics and
the etcd key schema. Three subpackages sit beside it:

- :mod:`laminar_common.relay`: the relay tier's client half (publish and
  fetch weight versions, the gRPC wire, the chunk data plane, manifests);
- :mod:`laminar_common.consume`: the trainer's side of the trajectory protocol
  (``TrajectoryConsumer``, exactly-once memory, content checks);
- :mod:`laminar_common.launch`: the operator toolkit (the ``laminar`` CLI,
  local and Ray launchers, a local etcd, processes, reports; the example jobs' tasks
  and models are the laminar-examples package's).

Names below are imported on first use.
"""

from laminar_common._lazy import lazy_exports
from laminar_common.version import __version__

_EXPORTS = {
    # errors
    "LaminarError": "errors", "ConfigError": "errors", "ProtocolError": "errors",
    "CoordinationError": "errors", "TransportError": "errors",
    "EtcdUnavailableError": "errors", "EngineError": "errors",
    # config
    "LaminarModel": "config", "EtcdConfig": "config", "LoggingConfig": "config",
    "MetricsConfig": "config", "AuthConfig": "config", "load_config": "config",
    "read_jsonl": "jsonl",
    # wire
    "PROTOCOL_VERSION": "codec", "Trajectory": "codec", "PromptTask": "codec",
    "Command": "codec",
    # transports
    "make_push_sender": "transport", "make_pull_receiver": "transport",
    "make_server": "transport", "make_client": "transport",
    # membership
    "MemberRecord": "membership", "VersionRecord": "membership", "Coordinator": "membership",
    "InMemoryEtcd": "membership", "make_coordinator": "etcd", "JobKeys": "keys",
    "Role": "roles",
    # lifecycle
    "Service": "service", "StatusWriter": "status", "MetricsServer": "metrics",
    "setup_logging": "logs",
    # custom trainers
    "TrajectoryConsumer": "consume.consumer",
}

__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
