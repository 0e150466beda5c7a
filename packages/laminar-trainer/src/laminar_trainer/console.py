"""What the trainer tells a person on its console: the step line, why it waits for data,
and the check that stops a run whose rewards all failed.

Pure functions over plain values (no service, no etcd client): the trainer calls them
with its figures, and the manager's status as read from etcd.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from laminar_common.codec import Trajectory
from laminar_common.errors import LaminarError
from laminar_common.progress import format_clock as clock

__all__ = ["WAIT_REASON_EVERY_S", "step_line", "why_waiting", "nothing_more_coming",
           "check_rewards", "clock"]

WAIT_REASON_EVERY_S = 15.0
"""A starved trainer says why it waits (console, ``laminar status``) this often."""


def step_line(step: int, version: int, total: int, reward_mean: float, metrics: dict,
              elapsed_s: float, steps_done: int, eval_last: dict, eval_step: int,
              reward_errors_so_far: int) -> str:
    """The line ``laminar up`` shows for a step: the step of the total, time, ETA,
    throughput, the latest eval, and what a user must see as it happens (reward errors,
    groups that all scored the same). It starts ``STEP <step> `` (what tools match).

    Args:
        steps_done: steps this process took (the ETA's rate; a resumed run's start
            is not counted).
    """
    eta = elapsed_s / steps_done * (total - step) if steps_done > 0 else 0.0
    parts = [f"STEP {step} v{version} reward={reward_mean:.3f}", f"{step}/{total}",
             f"{clock(elapsed_s)} elapsed, ETA {clock(eta)}",
             f"{metrics['tokens_per_s']:.0f} tok/s"]
    if eval_last:
        parts.append(f"eval {eval_last.get('eval_accuracy', float('nan')):.3f} "
                     f"(step {eval_step})")
    errors = metrics.get("reward_errors", 0)
    if errors:
        parts.append(f"REWARD ERRORS {errors:.0f}/{metrics.get('trajectories', 0):.0f} "
                     f"({reward_errors_so_far} so far)")
    if metrics.get("uniform_group_fraction", 0.0) >= 1.0:
        parts.append("every group scored the same: nothing learned")
    return " | ".join(parts)


def why_waiting(held_groups: int, manager_status: bytes | None) -> str:
    """Why no data comes to a starved trainer, from the manager's status in etcd
    (``None``: no manager has written one)."""
    held = f"{held_groups} complete group(s) held; "
    if manager_status is None:
        return f"{held}no manager has reported a status (is the rollout tier up?)"
    try:
        status = json.loads(manager_status)
        ledger = status.get("ledger", {})
        workers = status.get("workers", {})
        n_workers = len(workers) if isinstance(workers, dict) else int(workers)
    except (ValueError, TypeError, AttributeError) as exc:
        return f"{held}the manager's status does not parse ({exc})"
    if status.get("prompts_exhausted"):
        return (f"{held}the manager's prompts are exhausted (cursor {status.get('cursor')}, "
                f"ledger {ledger}): no new groups will come; give more prompts or epochs, "
                "or fewer total_steps (laminar up checks this before it starts)")
    if status.get("holding_for_resume"):
        return f"{held}the manager holds new work until resumed weights are published"
    if n_workers == 0:
        return f"{held}no rollout worker is connected to the manager"
    rejected = status.get("trainer_rejections", 0)
    return (f"{held}{n_workers} worker(s) generating, manager ledger {ledger}"
            + (f", {rejected} trajectories rejected by this trainer" if rejected else ""))


def nothing_more_coming(manager_status: bytes | None, held: int) -> bool:
    """No more trajectories will come: the manager's prompts are exhausted, it has
    nothing pending or out at workers, and every trajectory it counts as done (finished,
    not acked) is with the trainer, which holds ``held`` unacked ones (buffered, or
    trained and waiting for a checkpoint's ack). A done one the trainer lacks is still
    on its way (a worker re-sends what was not acked, at growing intervals)."""
    if manager_status is None:
        return False
    try:
        status = json.loads(manager_status)
        ledger = status.get("ledger", {})
        return bool(status.get("prompts_exhausted")) and \
            int(ledger.get("pending", 0)) == 0 and int(ledger.get("dispatched", 0)) == 0 \
            and int(ledger.get("done", 0)) <= held
    except (ValueError, TypeError, AttributeError):
        return False


def check_rewards(step: int, trajs: Sequence[Trajectory]) -> None:
    """Stop a run's first step whose every reward failed (a missing answer key, a reward
    that cannot run): nothing it could train on would teach anything, and the run would
    otherwise end with exit 0.

    Raises:
        LaminarError: every trajectory of the step carries a ``reward_error``.
    """
    failed = [t for t in trajs if t.reward_error is not None]
    if not trajs or len(failed) < len(trajs):
        return
    first = failed[0]
    raise LaminarError(
        f"step {step}: every reward of the step failed ({len(failed)} of {len(trajs)}), "
        f"e.g. {first.trajectory_id} from {first.worker_id}: {first.reward_error[:300]}; "
        "fix the reward or the data (answer_key) and start again (nothing was trained "
        "or acked)")
