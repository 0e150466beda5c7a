"""``layout: auto``: processes and threads chosen for the cores ``laminar up`` has.

Owns the rule (:func:`choose_layout`) and applying it to a job file's tiers
(:func:`apply_layout`) for the local launcher. It only fills in what the job file
leaves unset, and only for tiers that run on the CPU:

- a trainer tier (``laminar-trainer run``, no ``simulate``, one rank, no GPU
  resources, ``device`` not cuda): ``threads``;
- a rollout-worker tier (``laminar-rollout serve``) whose engine is ``torch`` on the
  CPU: ``replicas`` (when the tier does not give it and has an ``id_field``, so each
  replica gets its own worker id), the engine's ``threads``, and its ``max_batch`` (a
  step's samples spread over the workers, when the manager's config gives
  ``batch_groups`` and ``group_size``, so one step's groups decode at once and a short
  answer's slot is refilled while the tail decodes).

The rule, and where each part comes from (``tools/bench_layout.py`` measures it):

- at most 2 cores: one worker with 1 thread and the trainer with every core. Measured
  on a 2-core machine on the demo job (2026-12-05): this layout was the fastest of the
  ones tried (trainer 1 or 2 threads, worker 1 or 2 threads, 1 or 2 workers); the
  trainer's threads and the worker's share the cores, and the worker's small decode
  forwards do not gain from a second thread. On 1 core (``taskset``), the same.
- more cores: NOT measured here (the machine this was written on has 2). Extrapolated
  from the demo's CPU split (the trainer ~70% of the tiers' CPU time, the workers
  ~27%): the workers get ``round(0.3 x cores)`` cores as 1-thread processes (a small
  model's decode scales across processes, not threads) and the trainer the rest.

Ray jobs (several machines) are not touched: each node's share is the cluster's
resources, not this machine's cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from laminar_common.launch.jobfile import JobFile, TierSpec

__all__ = ["Layout", "usable_cores", "choose_layout", "apply_layout", "tier_command",
           "step_samples"]

TRAINER = ("laminar-trainer", "run")
WORKER = ("laminar-rollout", "serve")
MANAGER = ("laminar-rollout", "manage")
WORKER_SHARE = 0.3
"""Cores for the rollout workers above 2 cores (the demo's CPU split, see above)."""


@dataclass(frozen=True)
class Layout:
    """What ``layout: auto`` gives each CPU tier on ``cores`` cores."""

    cores: int
    trainer_threads: int
    workers: int
    worker_threads: int
    measured: bool
    """True where the rule was measured (at most 2 cores), False where extrapolated."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: ``taskset`` and cgroup
    cpusets count), not the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def choose_layout(cores: int) -> Layout:
    """The layout for ``cores`` usable cores (see the module docstring)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if cores <= 2:
        return Layout(cores, trainer_threads=cores, workers=1, worker_threads=1, measured=True)
    workers = max(1, round(WORKER_SHARE * cores))
    return Layout(cores, trainer_threads=max(1, cores - workers), workers=workers,
                  worker_threads=1, measured=False)


def tier_command(spec: TierSpec) -> tuple[str, ...]:
    """The tier's entry point and sub-command, the entry point without its directory."""
    return tuple(os.path.basename(part) for part in spec.command[:2])


def _on_cpu_trainer(spec: TierSpec) -> bool:
    cfg = spec.config
    return (tier_command(spec) == TRAINER and not cfg.get("simulate") and spec.ranks == 1
            and not spec.resources.get("GPU") and cfg.get("device", "auto") != "cuda")


def _torch_cpu_worker(spec: TierSpec) -> bool:
    engine = spec.config.get("engine")
    return (tier_command(spec) == WORKER and isinstance(engine, dict)
            and engine.get("type") == "torch" and not spec.resources.get("GPU")
            and not str(engine.get("device", "cpu")).startswith("cuda"))


def step_samples(job: JobFile) -> int | None:
    """A step's samples (the manager's batch_groups x group_size), when the job says."""
    for spec in job.tiers.values():
        if tier_command(spec) == MANAGER:
            groups, size = spec.config.get("batch_groups"), spec.config.get("group_size")
            if isinstance(groups, int) and isinstance(size, int) and groups > 0 and size > 0:
                return groups * size
    return None


def apply_layout(job: JobFile, cores: int) -> tuple[JobFile, Layout | None, list[str]]:
    """``job`` with the layout's values where it leaves them unset; the layout and one
    line per value set. ``layout: manual`` (or no CPU tier to lay out): the job as is,
    None, []."""
    if job.layout != "auto":
        return job, None, []
    layout = choose_layout(cores)
    tiers: dict[str, TierSpec] = {}
    said: list[str] = []
    samples = step_samples(job)
    for name, spec in job.tiers.items():
        config: dict[str, Any] = dict(spec.config)
        update: dict[str, Any] = {}
        if _on_cpu_trainer(spec) and "threads" not in config:
            config["threads"] = layout.trainer_threads
            said.append(f"{name}: threads {layout.trainer_threads}")
        elif _torch_cpu_worker(spec):
            engine = dict(config["engine"])
            replicas = 1 if spec.replicas == -1 else spec.replicas  # -1: one here
            # Replicas only where each gets its own id (id_field): copies of one worker id
            # would share its member key, socket identity and engine seed.
            if "replicas" not in spec.model_fields_set and spec.id_field:
                replicas = update["replicas"] = layout.workers
                said.append(f"{name}: {replicas} replica(s)")
            if "threads" not in engine:
                engine["threads"] = layout.worker_threads
                said.append(f"{name}: engine.threads {layout.worker_threads}")
            if "max_batch" not in engine and samples is not None and replicas > 0:
                engine["max_batch"] = -(-samples // replicas)
                said.append(f"{name}: engine.max_batch {engine['max_batch']} (a step's "
                            f"{samples} samples over {replicas} worker(s))")
            config["engine"] = engine
        if config != spec.config or update:
            tiers[name] = spec.model_copy(update={"config": config, **update})
        else:
            tiers[name] = spec
    if not said:
        return job, None, []
    return job.model_copy(update={"tiers": tiers}), layout, said
