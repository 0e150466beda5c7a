"""From a finished generation to a trajectory: scored by the reward function, off the
worker's loop.

:class:`Scoring` submits each finished generation (its last turn's completion, with
the task's prompt and metadata) to the worker's reward pool, holds it while it is
scored (the worker reports it as held), and builds the :class:`Trajectory` the
trainer gets: tokens, behaviour log-probs, the reward plus what the environment gave,
the reward's error if it failed (scored 0.0), the task's group fields and data source,
and the engine that generated it. It never references the worker service.
"""

from __future__ import annotations

import collections
import logging
import sys

from laminar_common.codec import PromptTask, Trajectory
from laminar_common.consume.validation import MAX_DATA_SOURCE_CHARS

from .conversations import Completed
from .rewards import RewardPool

__all__ = ["Scoring", "engine_label"]

log = logging.getLogger(__name__)


def engine_label(engine: object) -> str:
    """``"TorchEngine torch 2.13.0+cpu"``: the engine's class and, for the built-in ones,
    its library's version (what a step record says generated a trajectory)."""
    name = type(engine).__name__
    library = {"TorchEngine": "torch", "VllmEngine": "vllm"}.get(name)
    version = getattr(sys.modules.get(library or ""), "__version__", "") if library else ""
    return f"{name} {library} {version}" if version else name


def _data_source(task: PromptTask) -> str:
    """The task's ``metadata["data_source"]`` (verl-format rows have one) when it is a
    string the trainer accepts, else "" (a longer one is logged: the trainer would
    refuse the trajectory for it)."""
    value = task.metadata.get("data_source")
    if not isinstance(value, str):
        return ""
    if len(value) > MAX_DATA_SOURCE_CHARS:
        log.warning("prompt %s: data_source of %d characters is longer than %d; sent as ''",
                    task.prompt_id, len(value), MAX_DATA_SOURCE_CHARS)
        return ""
    return value


class Scoring:
    """Finished generations waiting for their score (see module docstring)."""

    def __init__(self, worker_id: str, rewards: RewardPool, engine: str) -> None:
        self.worker_id = worker_id
        self.rewards = rewards
        self.engine = engine
        self.waiting: dict[str, tuple[PromptTask, Completed]] = {}
        """Generated, waiting for the reward pool: still held (reported), not yet pushed."""

    def submit(self, task: PromptTask, completed: Completed) -> None:
        self.waiting[task.trajectory_id] = (task, completed)
        prompt = [dict(m) for m in task.messages] if task.messages else task.prompt
        self.rewards.submit(task.trajectory_id, prompt, completed.text, task.metadata)

    def collect(self, counters: collections.Counter[str]) -> list[Trajectory]:
        """The trajectories scored since the last call (a failed reward is counted in
        ``counters["reward_errors"]`` and said)."""
        out = []
        for tid, reward, error in self.rewards.poll():
            entry = self.waiting.pop(tid, None)
            if entry is None:  # dropped meanwhile (a rejoin cannot drop these; defensive)
                log.warning("reward for %s arrived but the trajectory is gone", tid)
                continue
            task, done = entry
            if error is not None:
                counters["reward_errors"] += 1
                log.warning("reward function failed on %s: %s", tid, error)
            out.append(Trajectory(
                trajectory_id=task.trajectory_id, prompt_id=task.prompt_id,
                group_size=task.group_size, sample_index=task.sample_index,
                worker_id=self.worker_id, policy_version=done.policy_version,
                prompt_token_ids=done.prompt_token_ids,
                response_token_ids=done.response_token_ids,
                behaviour_logprobs=done.behaviour_logprobs,
                reward=reward + done.env_reward, finish_reason=done.finish_reason,
                reward_error=error, completion=done.completion, simulated=done.simulated,
                group_seq=task.group_seq, settled_below=task.settled_below,
                sampling=task.sampling, data_source=_data_source(task),
                observation_spans=done.observation_spans, engine=self.engine))
        return out
