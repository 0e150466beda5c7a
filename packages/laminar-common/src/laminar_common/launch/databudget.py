"""Whether a job's prompts last its training: checked by ``laminar up`` after the set-up.

The trainer of a job consumes ``total_steps x batch_groups`` groups, one prompt each;
the manager creates groups from its prompt file, ``epochs`` passes over it (at most
``max_prompts``). A job whose prompts run out first stalls at the step they run out
(the trainer waits for data that never comes, then fails after ``wait_timeout_s``), so
``laminar up`` refuses it before any tier starts, naming the numbers and the fields to
change. Groups consumed without training (the trainer's dynamic sampling, stale drops)
need prompts too: with either on, a job that only just fits is warned about.

Reads the job's tier configs as the job file gives them (Laminar's own manager and
trainer tiers, found by their commands) and the manager's prompt file; a job with
neither, or a prompt file it cannot read (the manager's start names the problem), is
not checked. Imports no tier package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laminar_common.errors import ConfigError
from laminar_common.launch.jobfile import RESUMABLE_COMMANDS

__all__ = ["Budget", "data_budget", "check_data_budget"]

TRAINER, MANAGER = RESUMABLE_COMMANDS


@dataclass(frozen=True)
class Budget:
    """The groups a job's trainer needs and the prompts its manager has."""

    needed: int
    """total_steps x batch_groups."""
    available: int
    """prompts x epochs, at most max_prompts."""
    prompts: int
    epochs: int
    max_prompts: int | None
    total_steps: int
    batch_groups: int
    untrained_groups: bool
    """The trainer consumes some groups without training them (dynamic sampling, or
    stale groups dropped)."""

    @property
    def last_step(self) -> int:
        """The last step the prompts fill."""
        return self.available // max(self.batch_groups, 1)


def data_budget(manager: dict[str, Any], trainer: dict[str, Any]) -> Budget | None:
    """The budget of a manager and a trainer config (as job files give them), or None
    where the prompt file cannot be read here (the manager's own start says why)."""
    from laminar_common.data.records import DataConfig, load_records

    try:
        records = load_records(manager["prompts"], DataConfig(**manager.get("data", {})))
    except (ConfigError, KeyError, TypeError, ValueError, ImportError):
        return None
    epochs = int(manager.get("epochs", 1))
    cap = manager.get("max_prompts")
    available = len(records) * epochs
    if cap is not None:
        available = min(available, int(cap))
    buffer = trainer.get("buffer") or {}
    dropping = buffer.get("policy") == "staleness" and buffer.get("stale_action", "drop") == "drop"
    return Budget(needed=int(trainer.get("total_steps", 20)) * int(trainer.get("batch_groups", 8)),
                  available=available, prompts=len(records), epochs=epochs,
                  max_prompts=None if cap is None else int(cap),
                  total_steps=int(trainer.get("total_steps", 20)),
                  batch_groups=int(trainer.get("batch_groups", 8)),
                  untrained_groups=bool(buffer.get("dynamic_sampling")) or dropping)


def check_data_budget(tiers: dict[str, tuple[tuple[str, ...], dict[str, Any]]]
                      ) -> list[str]:
    """Refuse a job whose prompts run out before its last step; warnings otherwise.

    Args:
        tiers: each tier's command and config (placeholders filled).

    Returns:
        Warnings for the console (a job that just fits with untrained groups on).

    Raises:
        ConfigError: the prompts fill fewer steps than ``total_steps``; the message
            gives the numbers and the fields that change them.
    """
    managers = [(n, c) for n, (cmd, c) in tiers.items() if tuple(cmd[:2]) == MANAGER]
    trainers = [(n, c) for n, (cmd, c) in tiers.items() if tuple(cmd[:2]) == TRAINER]
    if len(managers) != 1 or len(trainers) != 1:
        return []
    (mname, manager), (tname, trainer) = managers[0], trainers[0]
    budget = data_budget(manager, trainer)
    if budget is None:
        return []
    epochs = f"epochs {budget.epochs}" + (f", max_prompts {budget.max_prompts}"
                                          if budget.max_prompts is not None else "")
    if budget.available < budget.needed:
        more = -(-budget.needed // budget.prompts)
        raise ConfigError(
            f"the prompts run out at step {budget.last_step} of {budget.total_steps}: the "
            f"trainer consumes total_steps {budget.total_steps} x batch_groups "
            f"{budget.batch_groups} = {budget.needed} groups (one prompt each) and the "
            f"manager has {budget.prompts} prompts ({manager['prompts']}) x {epochs} = "
            f"{budget.available}; set tiers.{mname}.config.epochs to {more} or more "
            + ("(and raise or drop max_prompts) " if budget.max_prompts is not None else "")
            + f"or tiers.{tname}.config.total_steps to {budget.last_step} or fewer, or give "
            "more prompts")
    if budget.untrained_groups and budget.available < 2 * budget.needed:
        return [f"the prompts ({budget.available} groups) only just cover the "
                f"{budget.needed} groups of {budget.total_steps} steps, and this trainer "
                "consumes some groups untrained (dynamic sampling or stale drops): the run "
                f"may run out before step {budget.total_steps}; raise "
                f"tiers.{mname}.config.epochs to be sure"]
    return []
