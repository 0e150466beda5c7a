"""Content validation of trajectories at a trainer's door, before they are buffered.

Owns :func:`check_trajectory`: the codec already proved a frame is a
well-formed :class:`~laminar_common.codec.Trajectory`; this checks that what
it says can be trained on without crashing the step or poisoning the weights.
A failed check returns an :class:`Invalid` with a short ``reason`` (a metrics
label) and a ``detail`` naming the trajectory, its worker and the value.

Checks, in order: group fields (``group_size`` >= 1, ``0 <= sample_index <
group_size``, a watermark ``settled_below`` not past its own ``group_seq``),
a non-empty prompt and response, ``observation_spans`` (multi-turn) in
order, disjoint, inside the response and not at its start, one behaviour
log-prob per generated token (the response without those spans), token ids inside the model's vocabulary, a finite reward,
finite log-probs that are <= 0, a positive sampling temperature (the
trainer's, if it fixes one), a policy version the trainer has published
(``0 <= policy_version <= trainer_version``), and a ``data_source`` of at most
:data:`MAX_DATA_SOURCE_CHARS` characters (it becomes a metrics label). Consistency with the
group's other members (same ``group_size``) is checked by the buffer, which
holds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from laminar_common.codec import Trajectory

__all__ = ["Invalid", "check_trajectory", "REASONS", "MAX_DATA_SOURCE_CHARS",
           "STALE_AFTER_RESUME"]

STALE_AFTER_RESUME = "stale-after-resume"
"""The reason a resumed trainer gives (first) for a trajectory from weights older than its
staleness bound allows: not its content; the manager has it generated again and counts it
apart from content rejections."""

REASONS = ("bad-group", "empty-prompt", "empty-response", "length-mismatch",
           "token-out-of-range", "non-finite-reward", "bad-logprob", "bad-version",
           "group-mismatch", "bad-sampling", "bad-data-source", "bad-observation-spans")
"""Every reason a trajectory can be rejected for (metrics labels)."""

MAX_DATA_SOURCE_CHARS = 200
"""Longest ``data_source`` a trajectory may carry (workers send a longer one as "")."""

_LOGPROB_SLACK = 1e-3
"""Log-probs a little above 0 are float rounding of a probability of 1."""


@dataclass(frozen=True)
class Invalid:
    """Why a trajectory cannot be trained on: a short ``reason`` and a ``detail``."""

    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def _bad_token(ids: tuple[int, ...], vocab_size: int | None) -> int | None:
    for tok in ids:
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            return tok
    return None


def _bad_spans(spans: tuple[tuple[int, int], ...], n: int) -> str | None:
    """Why ``observation_spans`` do not describe ``n`` response tokens (None: they do)."""
    previous_end = 0
    for i, span in enumerate(spans):
        if len(span) != 2:
            return f"observation span {i} is {span!r}, not [start, end)"
        start, end = span
        if not previous_end <= start < end <= n:
            return (f"observation span {i} [{start}, {end}) is empty, out of order, overlaps "
                    f"the one before or lies outside the {n} response tokens")
        previous_end = end
    if spans and spans[0][0] == 0:
        return "an observation span starts the response: the model speaks first"
    return None


def check_trajectory(traj: Trajectory, vocab_size: int | None = None,
                     trainer_version: int | None = None,
                     temperature: float | None = None) -> Invalid | None:
    """None if ``traj`` can be trained on, else why not (see module docstring).

    Args:
        vocab_size: the model's vocabulary; None (the simulated training step)
            skips the vocabulary bound but still refuses negative ids.
        trainer_version: the newest published weight version; None skips the
            upper bound (a stack that does not publish through the relay tier).
        temperature: the one sampling temperature the trainer accepts; None accepts
            any positive temperature (log-probs are then computed at each
            trajectory's own). A greedy (temperature 0) trajectory has no
            sampling distribution to correct against and is always refused.
    """
    who = f"trajectory {traj.trajectory_id!r} from worker {traj.worker_id!r}"
    if traj.group_size < 1 or not 0 <= traj.sample_index < traj.group_size:
        return Invalid("bad-group", f"{who}: sample_index {traj.sample_index} of a group of "
                                    f"{traj.group_size}")
    if traj.settled_below > traj.group_seq >= 0:
        # The manager stamps its watermark when it dispatches, while this group is open:
        # a watermark past the trajectory's own group is wrong (and would hide groups).
        return Invalid("bad-group", f"{who}: watermark {traj.settled_below} is past its own "
                                    f"group {traj.group_seq}")
    if not traj.prompt_token_ids:
        return Invalid("empty-prompt", f"{who}: no prompt tokens")
    if not traj.response_token_ids:
        return Invalid("empty-response", f"{who}: no response tokens")
    spans = _bad_spans(traj.observation_spans, len(traj.response_token_ids))
    if spans is not None:
        return Invalid("bad-observation-spans", f"{who}: {spans}")
    if len(traj.behaviour_logprobs) != traj.generated_tokens:
        extra = "" if not traj.observation_spans else \
            f" generated (of {len(traj.response_token_ids)} response tokens)"
        return Invalid("length-mismatch", f"{who}: {len(traj.behaviour_logprobs)} behaviour "
                                          f"log-probs for {traj.generated_tokens} tokens{extra}")
    for part, ids in (("prompt", traj.prompt_token_ids), ("response", traj.response_token_ids)):
        tok = _bad_token(ids, vocab_size)
        if tok is not None:
            return Invalid("token-out-of-range", f"{who}: {part} token id {tok} outside the "
                                                 f"vocabulary [0, {vocab_size})")
    if not math.isfinite(traj.reward):
        return Invalid("non-finite-reward", f"{who}: reward {traj.reward}")
    for i, lp in enumerate(traj.behaviour_logprobs):
        if not math.isfinite(lp) or lp > _LOGPROB_SLACK:
            return Invalid("bad-logprob", f"{who}: behaviour log-prob {lp} at token {i}")
    t = traj.sampling.temperature
    if not (math.isfinite(t) and t > 0):
        return Invalid("bad-sampling", f"{who}: sampled at temperature {t}; training needs a "
                                       "positive temperature (the behaviour log-probs are "
                                       "a sampling distribution's)")
    if temperature is not None and abs(t - temperature) > 1e-6:
        return Invalid("bad-sampling", f"{who}: sampled at temperature {t}, but the trainer's "
                                       f"config fixes temperature {temperature} (set the "
                                       "manager's sampling.temperature to match, or leave the "
                                       "trainer's temperature unset to use each trajectory's)")
    if traj.policy_version < 0 or (trainer_version is not None
                                   and traj.policy_version > trainer_version):
        return Invalid("bad-version", f"{who}: policy version {traj.policy_version} but the "
                                      f"trainer has published up to {trainer_version}")
    if len(traj.data_source) > MAX_DATA_SOURCE_CHARS:
        return Invalid("bad-data-source", f"{who}: data_source of {len(traj.data_source)} "
                                          f"characters (at most {MAX_DATA_SOURCE_CHARS}; it "
                                          "names the dataset, for per-source metrics)")
    return None
