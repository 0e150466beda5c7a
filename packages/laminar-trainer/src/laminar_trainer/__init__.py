"""laminar_trainer: the trainer tier (streaming GRPO with off-policy correction, async
weight publishing, checkpoints).

Curated exports, what a custom stack uses: publishing a state dict from your own loop
(``publish_state_dict``) and reading one back (``state_dict_from``, ``load_into``), the
config, the service, and the export of a checkpoint to a Hugging Face directory. Loaded on
first use (``laminar_common._lazy``). How the tier works: docs/trainer.md in the repository.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from laminar_common._lazy import lazy_exports

from .version import __version__

if TYPE_CHECKING:
    from .config import TrainerConfig
    from .export import export_model
    from .publishing import load_into, publish_state_dict, state_dict_from
    from .service import TrainerService, make_trainer_service

_EXPORTS = {
    "publish_state_dict": "publishing", "state_dict_from": "publishing",
    "load_into": "publishing", "TrainerConfig": "config", "TrainerService": "service",
    "make_trainer_service": "service",
    "export_model": "export",
}

__all__ = [
    "__version__",
    "publish_state_dict",
    "state_dict_from",
    "load_into",
    "TrainerConfig",
    "TrainerService",
    "make_trainer_service",
    "export_model",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
