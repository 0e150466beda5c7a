"""The rollout tier's Prometheus metrics, read from the services' parts on each scrape.

Nothing here is computed per trajectory or waits on anything; the services pass what
they own (counters, the engine, the ledger, sockets) and never reference this module's
callers.
"""

from __future__ import annotations

import collections
from typing import Any

from laminar_common.metrics import Metric

from .kv_plane import KvPlane
from .ledger import TrajectoryLedger
from .outbox import Outbox
from .rewards import RewardPool

__all__ = ["worker_metrics", "manager_metrics", "FULL_PROGRESS_EVERY"]

FULL_PROGRESS_EVERY = 100
"""Every this many reports, progress carries every token: it mends what the manager
missed (a frame lost with a dropped connection; the manager then still holds a shorter,
valid prefix and counts a gap), at a cost amortised over the reports between."""


def worker_metrics(c: collections.Counter[str], load: Any, *, engine: Any, rewards: RewardPool,
                   scoring: int, kv_plane: KvPlane | None, outbox: Outbox,
                   weight_wait_s: float, busy_s: float) -> list[Metric]:
    """A worker's metrics (``c``: its counters; ``load``: the engine's last load)."""
    return [
        Metric("trajectories_total", "counter", "trajectories finished and pushed",
               c["finished"]),
        Metric("rejected_total", "counter", "prompts refused (e.g. too long)", c["rejected"]),
        Metric("reward_errors_total", "counter", "reward function failures",
               c["reward_errors"]),
        Metric("reward_timeouts_total", "counter",
               "reward calls past reward_timeout_s (scored 0.0, counted as errors)",
               rewards.timeouts),
        Metric("reward_pending", "gauge", "generated trajectories waiting for a score",
               scoring),
        Metric("exported_total", "counter", "trajectories handed back by repack",
               c["exported"]),
        Metric("progress_tokens_total", "counter",
               "partial-progress tokens sent to the manager (only new ones, and all of "
               f"them every {FULL_PROGRESS_EVERY} reports)", c["progress_tokens"]),
        Metric("kv_migrated_out_total", "counter",
               "exported trajectories that took their KV cache along", c["kv_migrated_out"]),
        Metric("kv_migrated_in_total", "counter",
               "migrated trajectories continued from their KV cache (no re-prefill)",
               c["kv_migrated_in"]),
        Metric("kv_refused_total", "counter",
               "migrated KV caches not used (another engine or model shape): re-prefilled",
               c["kv_refused"]),
        Metric("kv_fetched_total", "counter",
               "migrated caches fetched from their source worker's KV plane",
               c["kv_fetched"]),
        Metric("kv_fetch_failed_total", "counter",
               "migrated caches that could not be fetched (source gone, slow, expired, "
               "or other bytes than its ref named): re-prefilled", c["kv_fetch_failed"]),
        Metric("kv_plane_served_total", "counter",
               "caches this worker's KV plane handed to a destination",
               kv_plane.counters["served"] if kv_plane else 0),
        Metric("kv_plane_dropped_total", "counter",
               "exported caches dropped unfetched (expired or evicted)",
               kv_plane.counters["expired"] + kv_plane.counters["evicted"]
               if kv_plane else 0),
        Metric("kv_plane_held_bytes", "gauge", "exported caches waiting to be fetched",
               kv_plane.held_bytes if kv_plane else 0),
        Metric("kv_too_large_total", "counter",
               "exports whose cache exceeded kv_transfer_max_mb (re-prefilled)",
               c["kv_too_large"]),
        Metric("shared_prefill_tokens_total", "counter",
               "prompt tokens not prefilled: a row admitted with the same input had them",
               getattr(engine, "shared_prefill_tokens", 0)),
        Metric("kv_reused_tokens_total", "counter",
               "prompt and resumed tokens taken from a cache instead of prefilled",
               getattr(engine, "kv_reused_tokens", 0)),
        Metric("weight_loads_total", "counter", "weight versions loaded", c["weight_loads"]),
        Metric("weight_pull_failures_total", "counter",
               "weight fetches or loads that failed (retried)", c["pull_failed"]),
        Metric("weight_loads_wedged_total", "counter",
               "weight loads that did not return within weight_load_timeout_s",
               c["weight_load_wedged"]),
        Metric("weight_delta_loads_total", "counter",
               "weight versions rebuilt from delta versions", c["weight_delta_loads"]),
        Metric("weight_fetched_bytes_total", "counter",
               "version bytes fetched from relays (deltas count their own size)",
               c["weight_bytes"]),
        Metric("weight_version", "gauge", "policy version of the engine",
               engine.weight_version),
        Metric("weight_wait_seconds_total", "counter", "time spent fetching + loading weights",
               weight_wait_s),
        Metric("busy_seconds_total", "counter", "time spent in engine steps", busy_s),
        Metric("active_sequences", "gauge", "sequences being decoded", load.active),
        Metric("queued_sequences", "gauge", "sequences waiting for a slot", load.queued),
        Metric("kv_used_tokens", "gauge", "KV-cache tokens in use", load.kv_used_tokens),
        Metric("outbox_trajectories", "gauge", "pushed but not yet durably acked",
               len(outbox)),
        Metric("rejoins_total", "counter",
               "hellos again after the manager forgot this worker (lease lost while paused)",
               c["rejoins"]),
        Metric("manager_switches_total", "counter", "new manager incarnations followed",
               c["manager_switches"]),
        Metric("trainer_switches_total", "counter",
               "trainer incarnations seen (each gets the whole outbox again)",
               c["trainer_switches"]),
        Metric("trainer_reconnects_total", "counter",
               "links to the trainer back after being down (each re-sends the outbox)",
               c["trainer_reconnects"]),
        Metric("trainer_link_down_seconds", "gauge",
               "how long the link to the trainer has been down (0: up)",
               outbox.down_s),
        Metric("resent_total", "counter", "pushes repeated because no ack came in time",
               c["resent"]),
        Metric("push_failed_total", "counter", "pushes to the trainer that failed",
               c["push_failed"]),
    ]


def manager_metrics(st: Any, ledger: TrajectoryLedger, *, workers: int, latest: int, server: Any,
                    acks: Any) -> list[Metric]:
    """The manager's metrics (``st``: its ``ManagerStats``)."""
    lc = ledger.counters
    return [
        Metric("trajectories", "gauge", "trajectories by ledger state", labels=("state",),
               values={(k,): v for k, v in ledger.counts().items()}),
        Metric("dispatched_total", "counter", "trajectories sent to workers", st.dispatched),
        Metric("acks_total", "counter", "durable trainer acks received", st.acks),
        Metric("workers", "gauge", "connected workers", workers),
        Metric("workers_lost_total", "counter", "workers declared dead", st.workers_lost),
        Metric("repacks_total", "counter", "repack rounds that moved work", st.repacks),
        Metric("repack_migrated_total", "counter", "trajectories migrated by repack",
               st.repack_migrated),
        Metric("repack_seconds_total", "counter", "time spent planning + commanding repacks",
               st.repack_seconds),
        Metric("migration_seconds_total", "counter",
               "export command -> re-dispatch, summed over migrated trajectories",
               st.migration_seconds),
        Metric("recoveries_total", "counter", "lost workers whose work runs again",
               len(st.recovery_seconds)),
        Metric("recovery_seconds_last", "gauge",
               "last heard from -> work dispatched again, last lost worker",
               st.recovery_seconds[-1] if st.recovery_seconds else 0.0),
        Metric("resumed_total", "counter", "trajectories resumed from partial tokens",
               lc.resumed),
        Metric("progress_gaps_total", "counter",
               "progress continuations that did not meet the tokens held (dropped)",
               lc.progress_gaps),
        Metric("kv_carried_total", "counter",
               "migrated trajectories that brought their KV cache (sent on with them)",
               lc.kv_carried),
        Metric("stale_reports_total", "counter", "worker reports that did not fit the ledger",
               lc.stale_reports),
        Metric("latest_version", "gauge", "latest published weight version", latest),
        Metric("rejected_frames_total", "counter", "frames refused by the worker socket",
               labels=("reason",),
               values={(k,): v for k, v in server.stats.rejected.items()}
               if server else {}),
        Metric("ack_rejected_frames_total", "counter", "frames refused by the ack socket",
               labels=("reason",),
               values={(k,): v for k, v in acks.stats.rejected.items()}
               if acks else {}),
        Metric("trainer_rejections_total", "counter",
               "trajectories the trainer refused by content", st.trainer_rejections),
        Metric("groups_filtered_total", "counter",
               "groups the trainer dropped untrained (dynamic sampling), each credited once",
               ledger.filtered_groups),
        Metric("filtered_unknown_total", "counter",
               "filtered-group notices naming a prompt the ledger does not hold",
               lc.filtered_unknown),
        Metric("workers_cut_off_total", "counter",
               "workers whose finished work was generated again: no link to the trainer "
               "while other workers had one", st.workers_cut_off),
        Metric("lease_expired_kept_total", "counter",
               "workers kept although their lease expired (they kept talking)",
               st.lease_expired_kept),
    ]
