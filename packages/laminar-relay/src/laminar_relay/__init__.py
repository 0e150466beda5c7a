"""laminar_relay: the relay tier (parameter service) of Laminar.

A relay keeps recent weight versions in host memory, takes new versions from
the trainer (master relay), forwards them down a chain of relays chunk by
chunk, and serves rollouts on its host. See the package README.

Curated exports; everything else in the package is an implementation detail.
Importing this package does not import gRPC or ZeroMQ (the CLI stays fast);
the service classes are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from laminar_common._lazy import lazy_exports

from .version import __version__

if TYPE_CHECKING:
    from .chain import ChainForwarder, order_chain
    from .config import ChainConfig, DataPlaneConfig, RelayConfig, StoreConfig
    from .memory import make_allocator
    from .service import RelayService, make_relay_service
    from .store import StoredVersion, WeightStore

__all__ = [
    "__version__",
    "RelayConfig",
    "StoreConfig",
    "DataPlaneConfig",
    "ChainConfig",
    "RelayService",
    "make_relay_service",
    "WeightStore",
    "StoredVersion",
    "make_allocator",
    "ChainForwarder",
    "order_chain",
]

_EXPORTS = {
    "RelayConfig": "config",
    "StoreConfig": "config",
    "DataPlaneConfig": "config",
    "ChainConfig": "config",
    "RelayService": "service",
    "make_relay_service": "service",
    "WeightStore": "store",
    "StoredVersion": "store",
    "make_allocator": "memory",
    "ChainForwarder": "chain",
    "order_chain": "chain",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
