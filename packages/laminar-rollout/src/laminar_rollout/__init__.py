"""laminar_rollout: the rollout tier (generation workers and the rollout manager).

Curated exports, what a custom stack uses: the engine interface to implement
(``GenerationEngine`` and its request/output types), the built-in engines' factory,
the configs, the services and their composition roots, and the reward contract. Loaded
on first use (``laminar_common._lazy``): ``import laminar_rollout`` imports no torch.
How the tier works: docs/rollout.md in the repository.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from laminar_common._lazy import lazy_exports

from .version import __version__

if TYPE_CHECKING:
    from .cli import make_manager_service, make_worker_service
    from .config import EngineConfig, ManagerConfig, WorkerConfig
    from .engines import (
        EngineError,
        EngineLoad,
        GenerationEngine,
        GenerationOutput,
        GenerationRequest,
        KVState,
        PartialProgress,
        SamplingParams,
        make_engine,
        make_engine_from_config,
    )
    from .manager import ManagerService
    from .rewards import RewardFn, load_reward_fn
    from .worker import WorkerService

_EXPORTS = {
    "GenerationEngine": "engines", "GenerationRequest": "engines",
    "GenerationOutput": "engines", "SamplingParams": "engines", "EngineLoad": "engines",
    "EngineError": "engines", "KVState": "engines", "PartialProgress": "engines",
    "make_engine": "engines", "make_engine_from_config": "engines",
    "WorkerConfig": "config", "ManagerConfig": "config", "EngineConfig": "config",
    "WorkerService": "worker", "ManagerService": "manager",
    "make_worker_service": "cli", "make_manager_service": "cli",
    "RewardFn": "rewards", "load_reward_fn": "rewards",
}

__all__ = [
    "__version__",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationOutput",
    "SamplingParams",
    "EngineLoad",
    "EngineError",
    "KVState",
    "PartialProgress",
    "make_engine",
    "make_engine_from_config",
    "WorkerConfig",
    "ManagerConfig",
    "EngineConfig",
    "WorkerService",
    "ManagerService",
    "make_worker_service",
    "make_manager_service",
    "RewardFn",
    "load_reward_fn",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
