"""Sample completions with their rewards, every so many steps: ``samples.jsonl`` and trackers.

Owns which trajectories of a step are shown (:func:`pick_samples`), the row each
becomes, and writing those rows to ``run_dir/samples.jsonl`` and to the
trackers' sample channel (:meth:`MultiTracker.log_samples`).

Must not decide anything about training: it only reads the groups a step has
already consumed, and a tracker that fails is the :class:`MultiTracker`'s to
count, never a reason to stop.

Invariants: the pick is deterministic (the same groups give the same rows);
every line of ``samples.jsonl`` is one sample and carries its ``step``, so a
resume cuts the file back to the checkpoint's step as it does ``metrics.jsonl``;
texts are at most ``max_chars`` characters plus a marker saying how many were cut.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from laminar_common.codec import Trajectory

from .buffer import Group
from .config import SamplesConfig
from .tracking import MultiTracker

__all__ = ["SampleLogger", "pick_samples", "truncate_text"]

MAX_CHARS = 2000
"""Longest prompt or completion text kept in a sample row (head and tail, see
:func:`truncate_text`)."""


def pick_samples(groups: Sequence[Group], count: int) -> list[Trajectory]:
    """Up to ``count`` trajectories of a step, chosen to show a success next to a failure.

    From each group chosen, its best-rewarded member then its worst (a reader sees
    what the group's advantage pushed towards and away from, on the same prompt); the
    groups are spread evenly over the step's list (``ceil(count / 2)`` of them, so not
    just the oldest). Should those give fewer than ``count``, the other groups' best
    and worst follow, then a second round of every group's next best and next worst,
    and so on. Ties in reward go to the lower ``sample_index``.
    """
    ordered = [_extremes_first(g.trajectories()) for g in groups]
    ordered = [members for members in ordered if members]
    if count <= 0 or not ordered:
        return []
    k = min(len(ordered), (count + 1) // 2)
    first = [i * len(ordered) // k for i in range(k)]
    order = first + sorted(set(range(len(ordered))) - set(first))
    picked: list[Trajectory] = []
    for start in range(0, max(len(m) for m in ordered), 2):
        for i in order:
            for t in ordered[i][start:start + 2]:
                picked.append(t)
                if len(picked) == count:
                    return picked
    return picked


def _extremes_first(members: Iterable[Trajectory]) -> list[Trajectory]:
    """Best, worst, second best, second worst, ... (ties to the lower sample index)."""
    best = sorted(members, key=lambda t: (-t.reward, t.sample_index))
    worst = sorted(best, key=lambda t: (t.reward, t.sample_index))
    out: list[Trajectory] = []
    taken: set[int] = set()
    for pair in zip(best, worst):
        for t in pair:
            if t.sample_index not in taken:
                taken.add(t.sample_index)
                out.append(t)
    return out


def truncate_text(text: str, max_chars: int = MAX_CHARS) -> str:
    """``text`` if at most ``max_chars`` long, else its head and tail around a marker.

    Both ends are kept: a prompt's head is the system prompt and its tail the
    question; a completion's tail holds the answer the reward judged.
    """
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    cut = len(text) - max_chars
    return f"{text[:head]}\n[... {cut} chars cut ...]\n{text[len(text) - tail:]}"


class SampleLogger:
    """Logs a few of a step's completions with their rewards every ``cfg.every_steps`` steps.

    Each sample is one row (see :meth:`maybe_log`), appended as one JSON line to
    ``run_dir/samples.jsonl`` and sent to ``trackers`` (TensorBoard's text tab,
    a W&B table).

    Args:
        run_dir: the trainer's run directory (it exists).
        cfg: the trainer's ``samples`` section (``every_steps`` 0: never).
        tokenizer: decodes prompts (and completions that came without text); ``None``
            leaves ``prompt`` empty and ``completion`` as the worker sent it.
        trackers: where the rows go besides the file.
        max_chars: longest text kept (see :func:`truncate_text`).
    """

    def __init__(self, run_dir: Path, cfg: SamplesConfig, tokenizer: Any | None,
                 trackers: MultiTracker, max_chars: int = MAX_CHARS) -> None:
        self.path = Path(run_dir) / "samples.jsonl"
        self.every_steps = cfg.every_steps
        self.count = cfg.count
        self.tokenizer = tokenizer
        self.trackers = trackers
        self.max_chars = max_chars

    def due(self, step: int) -> bool:
        """Whether :meth:`maybe_log` logs at ``step``."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def maybe_log(self, step: int, version: int, groups: Sequence[Group]) -> list[dict[str, Any]]:
        """At a due step, write and track the rows of :func:`pick_samples`; return them.

        A row: ``step``, ``version`` (the trainer's, after the step), ``trajectory_id``,
        ``prompt_id``, ``data_source``, ``policy_version`` (the one that generated it),
        ``reward``, ``reward_error``, ``finish_reason``, ``response_tokens``,
        ``prompt`` and ``completion``. ``prompt`` is the decoded prompt ids, special
        tokens and chat template included ("" without a tokenizer); ``completion`` is
        the worker's text, or the decoded response ids when that is empty and there is
        a tokenizer. Both are cut to ``max_chars`` (see :func:`truncate_text`).

        Returns:
            The rows logged; ``[]`` at a step that is not due or with no trajectories.
        """
        if not self.due(step):
            return []
        rows = [self._row(step, version, t) for t in pick_samples(groups, self.count)]
        if not rows:
            return []
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        self.trackers.log_samples(step, rows)
        return rows

    def _row(self, step: int, version: int, t: Trajectory) -> dict[str, Any]:
        completion = t.completion
        if not completion and self.tokenizer is not None:
            completion = self._decode(t.response_token_ids)
        prompt = self._decode(t.prompt_token_ids) if self.tokenizer is not None else ""
        return {"step": step, "version": version, "trajectory_id": t.trajectory_id,
                "prompt_id": t.prompt_id, "data_source": getattr(t, "data_source", ""),
                "policy_version": t.policy_version, "reward": t.reward,
                "reward_error": t.reward_error, "finish_reason": t.finish_reason,
                "response_tokens": len(t.response_token_ids),
                "prompt": truncate_text(prompt, self.max_chars),
                "completion": truncate_text(completion, self.max_chars)}

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens kept: the chat template and the stop token are part of what
        # the policy saw and produced.
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
