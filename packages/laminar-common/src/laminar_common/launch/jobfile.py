"""The job file of ``laminar up``: what a stack is (see :mod:`laminar_common.launch.local`).

Owns the schema (:class:`JobFile`, :class:`TierSpec`, :class:`EtcdSpec`),
loading it with ``--set`` overrides and ``{run_dir}``-style placeholders.
Both launchers import it; it imports neither.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator

from laminar_common.config import LaminarModel, load_config
from laminar_common.keys import validate_name

__all__ = ["EtcdSpec", "TierSpec", "JobFile", "load_job", "fill_placeholders", "resume_args",
           "for_resume", "saved_state", "RESUMABLE_COMMANDS"]

RESUMABLE_COMMANDS = (("laminar-trainer", "run"), ("laminar-rollout", "manage"))
"""Laminar's tiers that keep state to resume from (checkpoint.dir, state_dir): ``laminar up
--resume`` and a Ray restart give them ``--resume``."""


class EtcdSpec(LaminarModel):
    """Where the job's etcd is."""

    embedded: bool = True
    """Start a local etcd in <run_dir>/etcd for the job's lifetime."""
    endpoints: tuple[str, ...] = ()
    """Use an existing etcd (host:port) instead."""
    host: str | None = None
    """The one address the embedded etcd listens on. Default: 127.0.0.1; with the Ray
    backend on a cluster of more than one node, the head node's address (the one Ray
    knows it by), so the other nodes reach it."""
    ttl_s: int = Field(default=5, ge=2)
    """Lease TTL given to every tier."""


class TierSpec(LaminarModel):
    """One tier: its CLI, how many replicas, its config."""

    command: tuple[str, ...]
    """The tier's entry point and sub-command, e.g. [laminar-relay, serve]."""
    replicas: int = Field(default=1, ge=-1)
    """Processes to start; -1: one per node (Ray backend: per alive Ray node; local: 1)."""
    max_restarts: int = Field(default=-1, ge=-1)
    """Ray backend: times Ray restarts a replica that failed (-1: without limit)."""
    restart_args: tuple[str, ...] = ()
    """CLI arguments that make the tier resume: added when Ray starts a failed replica
    again, and by ``laminar up --resume``. Empty: ``--resume`` for Laminar's trainer
    (checkpoint.dir) and manager (state_dir), nothing for other commands."""
    config: dict[str, Any] = {}
    """The tier's config (written to a YAML file per replica)."""
    id_field: str | None = None
    """Config field set to the replica name (e.g. worker_id) when replicas > 1."""
    args: tuple[str, ...] = ()
    """Extra CLI arguments."""
    check: tuple[str, ...] | None = None
    """Arguments that make ``command`` validate its config and exit (0: valid) instead of
    running; ``laminar up`` runs every replica so before it sets up or starts anything.
    None: Laminar's own tiers' flag (``--print-config``; the relay's ``--check``), no check
    for other commands; []: no check."""
    ready: str | None = None
    """Role whose etcd member records say this tier is up (``extra.ready``, e.g.
    ``manager``): the next tier starts once every replica of this one registered
    ready. None: do not wait."""

    @field_validator("ready")
    @classmethod
    def _ready_is_a_role(cls, value: str | None) -> str | None:
        return None if value is None else validate_name("role", value)
    resources: dict[str, float] = {}
    """Ray backend: resources each replica needs (e.g. {GPU: 1})."""
    ranks: int = Field(default=1, ge=1)
    """Processes of each replica, started by torchrun (``python -m torch.distributed.run
    --standalone --nproc-per-node RANKS``): a trainer across the GPUs of its node
    (``ranks: 8`` with ``resources: {GPU: 8}``). Needs a Laminar tier (or ``python -m``)
    command; the config check runs once, without torchrun."""


class JobFile(LaminarModel):
    """A whole stack."""

    job: str
    """Job name (etcd key prefix)."""
    run_dir: str = "runs/{job}"
    """Where logs, configs, metrics and checkpoints go."""
    etcd: EtcdSpec = EtcdSpec()
    """etcd."""
    setup: tuple[tuple[str, ...], ...] = ()
    """Commands run before the tiers (each must exit 0)."""
    tiers: dict[str, TierSpec]
    """Tiers in start order."""
    wait_for: str
    """The tier whose exit ends the run."""
    timeout_s: float = Field(default=3600, gt=0)
    """Stop everything after this long."""
    report: str | None = None
    """A trainer run_dir to summarize and plot when the run ends (laminar report)."""
    layout: Literal["auto", "manual"] = "auto"
    """``auto``: the local launcher fills in what the job leaves unset of its CPU tiers'
    processes and threads (trainer ``threads``; torch-engine workers' ``replicas``,
    ``engine.threads``, ``engine.max_batch``) for the cores it may use
    (:mod:`laminar_common.launch.layout`); ``manual``: only what the job file says."""


def fill_placeholders(value: Any, subs: dict[str, str]) -> Any:
    if isinstance(value, str):
        for key, sub in subs.items():
            value = value.replace("{" + key + "}", sub)
        return value
    if isinstance(value, dict):
        return {k: fill_placeholders(v, subs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [fill_placeholders(v, subs) for v in value]
    return value


def load_job(path: str | os.PathLike[str], overrides: list[str] = ()) -> JobFile:
    return load_config(JobFile, path, overrides, env={})


def saved_state(command: tuple[str, ...], config: dict[str, Any]) -> tuple[str, str | None] | None:
    """Where a Laminar tier keeps what it resumes from, as ``(field, value)``: the trainer's
    ``checkpoint.dir``, the manager's ``state_dir`` (value None: unset); None for any other
    command."""
    command = tuple(command[:2])
    if command == RESUMABLE_COMMANDS[0]:
        return "checkpoint.dir", (config.get("checkpoint") or {}).get("dir")
    if command == RESUMABLE_COMMANDS[1]:
        return "state_dir", config.get("state_dir")
    return None


def resume_args(spec: TierSpec) -> tuple[str, ...]:
    """The arguments that make ``spec``'s tier resume: its ``restart_args`` where the job
    gives them, else ``--resume`` for Laminar's trainer with a ``checkpoint.dir`` and
    manager with a ``state_dir`` (as the job's config gives them), else none."""
    if spec.restart_args:
        return tuple(spec.restart_args)
    saved = saved_state(spec.command, spec.config)
    # A tier that saves nothing has nothing to resume from (a manager refuses --resume
    # without state_dir): it starts afresh, as before.
    return ("--resume",) if saved is not None and saved[1] else ()


def for_resume(job: JobFile) -> JobFile:
    """``job`` with every tier's resume arguments added (``laminar up --resume``)."""
    tiers = {}
    for name, spec in job.tiers.items():
        extra = resume_args(spec)
        if not extra or _contains(spec.args, extra):
            tiers[name] = spec
        else:
            tiers[name] = spec.model_copy(update={"args": (*spec.args, *extra)})
    return job.model_copy(update={"tiers": tiers})


def _contains(args: tuple[str, ...], part: tuple[str, ...]) -> bool:
    """Whether ``part`` appears in ``args`` as a run of whole arguments."""
    n = len(part)
    return any(tuple(args[i:i + n]) == part for i in range(len(args) - n + 1))
