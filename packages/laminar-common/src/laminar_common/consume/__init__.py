"""laminar_common.consume: the trainer's side of the trajectory protocol.

Owns what any trainer (the built-in one, or your own through
:class:`TrajectoryConsumer`) needs to consume trajectories exactly once:
the consumer itself (:mod:`.consumer`: receive, drop copies, refuse bad
content, ack, follow manager incarnations), the exactly-once memory
(:mod:`.consumed`: ``ConsumedIds``, compacted below the manager's watermark)
and the content checks at the door (:mod:`.validation`). No array library.

Names below are imported on first use.
"""

from laminar_common._lazy import lazy_exports

_EXPORTS = {
    "TrajectoryConsumer": "consumer", "ConsumerStats": "consumer",
    "ConsumedIds": "consumed",
    "Invalid": "validation", "REASONS": "validation", "check_trajectory": "validation",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
