"""A worker's side of KV-cache migration (repack with ``kv_transfer_max_mb`` > 0).

When repack moves a long-tail trajectory, its cache can go with it, so the
destination continues without prefilling again:

- **out** (:meth:`KvMigration.out`): an exported request's cache goes on the wire
  with the task, or (``kv_plane: direct``) waits on this worker's
  :class:`~laminar_rollout.kv_plane.KvPlane` and the task carries a ref to it;
- **in** (:meth:`KvMigration.incoming`, :meth:`KvMigration.collect`): a task with a
  cache this engine cannot take (another engine, model shape, or no tokens to
  resume) is re-prefilled, said and counted; a ref is fetched from its source off the
  decode loop (the trajectory is held and reported meanwhile) and the task starts when
  the cache is here, or re-prefilled if it cannot be had.

It never references the worker service.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging

import msgspec

from laminar_common import codec
from laminar_common.auth import CurveAuth
from laminar_common.codec import PromptTask

from .config import WorkerConfig
from .engines import GenerationEngine, GenerationRequest
from .engines.kv_wire import kv_to_wire
from .kv_plane import KvFetchError, KvPlane, fetch_kv

__all__ = ["KvMigration"]

log = logging.getLogger(__name__)


class KvMigration:
    """KV caches in and out of one worker's engine (see module docstring).

    Args:
        counters: the worker's counters (``kv_*`` are counted there).
    """

    def __init__(self, config: WorkerConfig, engine: GenerationEngine,
                 counters: collections.Counter[str], auth: CurveAuth | None = None) -> None:
        self.config = config
        self.engine = engine
        self.counters = counters
        self._auth = auth
        self.plane: KvPlane | None = None
        """Serves the caches of trajectories this worker exported (``kv_plane: direct``)."""
        self.waiting: dict[str, tuple[PromptTask, concurrent.futures.Future]] = {}
        """Migrated trajectories whose cache is being fetched from their source (held)."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def with_kv(self) -> bool:
        """Whether exported trajectories take their cache along."""
        return self.config.kv_transfer_max_mb > 0 and self.engine.supports_kv_transfer

    @property
    def direct(self) -> bool:
        """Whether exported caches wait here for their destination (see ``kv_plane``)."""
        return self.config.kv_plane == "direct" and self.with_kv

    @property
    def limit(self) -> int:
        return int(self.config.kv_transfer_max_mb * 2**20)

    def start_plane(self) -> None:
        """Serve exported caches from here (``kv_plane: direct``; else nothing)."""
        if not self.direct:
            return
        cfg = self.config
        where = cfg.addresses()
        self.plane = KvPlane(cfg.kv_listen or where.tcp(cfg.kv_port), cfg.worker_id,
                             max_bytes=int(cfg.kv_hold_max_mb * 2**20), hold_s=cfg.kv_hold_s,
                             advertise=where.advertised, auth=self._auth).start()
        log.info("KV plane at %s", self.plane.endpoint)

    # -- in ------------------------------------------------------------------------

    def incoming(self, task: PromptTask) -> PromptTask | None:
        """A task from the manager: itself (its cache dropped when this engine cannot
        take it), or None while its cache is fetched (:meth:`collect` returns it)."""
        if task.kv is not None and not (task.resume_token_ids
                                        and self.engine.supports_kv_transfer):
            self.refuse(task, "this worker's engine takes no KV cache"
                        if task.resume_token_ids else "the task resumes no tokens")
            task = msgspec.structs.replace(task, kv=None)
        unfit = self._unfit(task.kv) if isinstance(task.kv, codec.KvRef) else None
        if unfit is not None:
            self.refuse(task, f"not fetched: {unfit}")
            task = msgspec.structs.replace(task, kv=None)
        if isinstance(task.kv, codec.KvRef):
            self._fetch(task)
            return None
        return task

    def collect(self) -> list[PromptTask]:
        """The migrated tasks whose cache fetch ended: with the cache if it came, else
        without (re-prefilled)."""
        ready = []
        for tid, (task, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[tid]
            try:
                blob = future.result()
            except KvFetchError as exc:
                self.counters["kv_fetch_failed"] += 1
                self.refuse(task, str(exc))
                ready.append(msgspec.structs.replace(task, kv=None))
                continue
            self.counters["kv_fetched"] += 1
            self.counters["kv_bytes_in"] += len(blob.data)
            ready.append(msgspec.structs.replace(task, kv=blob))
        return ready

    def drop_waiting(self) -> list[str]:
        """Forget the fetches under way (a rejoin: the manager dispatches them again);
        returns their ids."""
        ids = list(self.waiting)
        for _, future in self.waiting.values():
            future.cancel()  # (one already running ends on its timeout; its result is dropped)
        self.waiting.clear()
        return ids

    def refuse(self, task: PromptTask, why: str) -> None:
        """``task``'s cache is not used: re-prefilled instead (said and counted)."""
        self.counters["kv_refused"] += 1
        log.warning("trajectory %s: its KV cache (%d positions, %s engine) is not used, "
                    "re-prefilling instead: %s", task.trajectory_id, task.kv.num_tokens,
                    task.kv.engine, why)

    def _unfit(self, ref: codec.KvRef) -> str | None:
        """Why this engine could not take the cache ``ref`` names (None: it could)."""
        mine = self.engine.kv_layout()
        theirs = (ref.engine, ref.layers, ref.kv_heads, ref.head_dim, ref.dtype)
        if mine is None or mine != theirs:
            return (f"the cache is {theirs[0]} {theirs[1]} layers x {theirs[2]} KV heads x "
                    f"{theirs[3]} {theirs[4]}; this engine takes "
                    f"{'none' if mine is None else ' '.join(map(str, mine))}")
        return None

    def _fetch(self, task: PromptTask) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=2, thread_name_prefix=f"kv-fetch-{self.config.worker_id}")
        ref = task.kv
        assert isinstance(ref, codec.KvRef)
        future = self._pool.submit(fetch_kv, ref, self.config.worker_id,
                                   timeout_s=self.config.kv_fetch_timeout_s,
                                   max_cache_bytes=self.limit, auth=self._auth)
        self.waiting[task.trajectory_id] = (task, future)

    # -- out -----------------------------------------------------------------------

    def out(self, req: GenerationRequest) -> codec.KvCache | codec.KvRef | None:
        """The cache ``export_with_kv`` attached, for the wire, or a ref to it on this
        worker's KV plane (it left out any over ``kv_transfer_max_mb``; a request with no
        tokens generated has none)."""
        if req.kv is None:
            if req.resume_token_ids:
                self.counters["kv_too_large"] += 1
            return None
        blob = kv_to_wire(req.kv)
        self.counters["kv_migrated_out"] += 1
        self.counters["kv_bytes_out"] += len(blob.data)
        if self.plane is not None:  # the destination fetches it from here
            return self.plane.offer(req.request_id, blob)
        return blob

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.plane is not None:
            self.plane.close()
