"""Sample completions: which are picked, the rows in samples.jsonl and the trackers,
when nothing is logged, decoding with the demo tokenizer, and truncation."""

from __future__ import annotations

import json
import logging

import msgspec
import pytest

from laminar_common.codec import Trajectory
from laminar_examples.demo_model import EOS_ID, build_tokenizer
from laminar_trainer.buffer import Group
from laminar_trainer.config import SamplesConfig
from laminar_trainer.samples import SampleLogger, pick_samples, truncate_text
from laminar_trainer.tracking import MultiTracker


class RecordingTracker:
    name = "recording"

    def __init__(self):
        self.samples: list[tuple[int, list[dict]]] = []

    def log(self, step, metrics):
        pass

    def log_samples(self, step, rows):
        self.samples.append((step, rows))

    def close(self):
        pass


class FailingTracker:
    name = "failing"

    def log(self, step, metrics):
        pass

    def log_samples(self, step, rows):
        raise RuntimeError("tracker backend is down")

    def close(self):
        pass


def _traj(prompt_id, i, reward, n=4, completion="", prompt=(1, 10, 11), response=(12, 13, 2),
          reward_error=None):
    return Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, group_size=n,
                      sample_index=i, worker_id="w", policy_version=3,
                      prompt_token_ids=prompt, response_token_ids=response,
                      behaviour_logprobs=(-1.0,) * len(response), reward=reward,
                      finish_reason="stop", reward_error=reward_error, completion=completion)


def _group(prompt_id, rewards, **kw):
    n = len(rewards)
    group = Group(prompt_id=prompt_id, group_size=n)
    for i, reward in enumerate(rewards):
        group.members[i] = _traj(prompt_id, i, reward, n=n, **kw)
    return group


def _ids(trajectories):
    return [t.trajectory_id for t in trajectories]


def test_pick_takes_best_and_worst_of_groups_spread_over_the_step():
    groups = [_group(p, [0.0, 1.0, 0.5, 0.0]) for p in "abcdef"]
    # ceil(4 / 2) = 2 groups, spread: the first and the middle one; best then worst,
    # ties to the lower sample index.
    assert _ids(pick_samples(groups, 4)) == ["a#1", "a#0", "d#1", "d#0"]
    assert _ids(pick_samples(groups, 3)) == ["a#1", "a#0", "d#1"]
    assert _ids(pick_samples(groups, 6)) == ["a#1", "a#0", "c#1", "c#0", "e#1", "e#0"]


def test_pick_takes_further_members_when_the_groups_run_short():
    one = [_group("a", [0.2, 0.9, 0.1, 0.5, 0.3])]
    # best, worst, next best, next worst, middle
    assert _ids(pick_samples(one, 10)) == ["a#1", "a#2", "a#3", "a#0", "a#4"]
    singles = [_group("a", [1.0]), _group("b", [0.0]), _group("c", [0.5])]
    assert _ids(pick_samples(singles, 2)) == ["a#0", "b#0"]
    # the groups chosen first give one each: the rest follow before any second round
    mixed = [_group("a", [1.0, 0.0, 0.5]), _group("b", [0.0]), _group("c", [1.0, 0.0])]
    assert _ids(pick_samples(mixed, 4)) == ["a#0", "a#1", "b#0", "c#0"]
    assert pick_samples([], 4) == [] and pick_samples([Group("e", 2)], 4) == []


def test_rows_are_written_to_samples_jsonl_and_sent_to_the_trackers(tmp_path):
    tracker = RecordingTracker()
    logger = SampleLogger(tmp_path, SamplesConfig(every_steps=5, count=2), None,
                          MultiTracker([tracker]))
    groups = [_group("a", [0.0, 1.0], completion="the answer"),
              _group("b", [0.5, 0.5], reward_error="timeout")]
    rows = logger.maybe_log(10, 11, groups)
    assert rows == [
        {"step": 10, "version": 11, "trajectory_id": "a#1", "prompt_id": "a", "data_source": "",
         "policy_version": 3, "reward": 1.0, "reward_error": None, "finish_reason": "stop",
         "response_tokens": 3, "prompt": "", "completion": "the answer"},
        {"step": 10, "version": 11, "trajectory_id": "a#0", "prompt_id": "a", "data_source": "",
         "policy_version": 3, "reward": 0.0, "reward_error": None, "finish_reason": "stop",
         "response_tokens": 3, "prompt": "", "completion": "the answer"},
    ]
    logger.maybe_log(15, 16, groups[1:])
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines[:2] == rows
    assert [(r["step"], r["trajectory_id"], r["reward_error"]) for r in lines[2:]] == [
        (15, "b#0", "timeout"), (15, "b#1", "timeout")]
    assert [(step, [r["trajectory_id"] for r in rs]) for step, rs in tracker.samples] == [
        (10, ["a#1", "a#0"]), (15, ["b#0", "b#1"])]


def test_nothing_is_logged_off_schedule_or_when_turned_off(tmp_path):
    tracker = RecordingTracker()
    groups = [_group("a", [0.0, 1.0])]
    every_3 = SampleLogger(tmp_path, SamplesConfig(every_steps=3, count=2), None,
                           MultiTracker([tracker]))
    assert [step for step in range(1, 8) if every_3.maybe_log(step, step, groups)] == [3, 6]
    never = SampleLogger(tmp_path / "never", SamplesConfig(every_steps=0), None,
                         MultiTracker([tracker]))
    assert all(never.maybe_log(step, step, groups) == [] for step in range(0, 21))
    assert every_3.maybe_log(9, 9, []) == [], "a step without trajectories logs nothing"
    assert [step for step, _ in tracker.samples] == [3, 6]
    steps = [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [3, 3, 6, 6]
    assert not (tmp_path / "never").exists()


def test_a_failing_tracker_is_counted_and_the_file_and_other_trackers_still_get_rows(
        tmp_path, caplog):
    ok, bad = RecordingTracker(), FailingTracker()
    trackers = MultiTracker([bad, ok])
    logger = SampleLogger(tmp_path, SamplesConfig(every_steps=1, count=1), None, trackers)
    with caplog.at_level(logging.WARNING, logger="laminar_trainer.tracking"):
        for step in (1, 2):
            assert len(logger.maybe_log(step, step, [_group("a", [1.0, 0.0])])) == 1
    assert trackers.errors == 2
    assert [step for step, _ in ok.samples] == [1, 2]
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2
    assert "tracker failing failed to log samples at step 1" in caplog.records[0].getMessage()


def test_prompt_and_empty_completion_are_decoded_with_the_tokenizer(tmp_path):
    tok = build_tokenizer()
    prompt = tuple(tok.encode("sort: cab"))  # <bos> and the characters
    response = tuple(tok.encode("abc", add_special_tokens=False)) + (EOS_ID,)
    group = Group(prompt_id="p", group_size=2)
    group.members[0] = _traj("p", 0, 1.0, n=2, prompt=prompt, response=response)
    group.members[1] = _traj("p", 1, 0.0, n=2, prompt=prompt, response=response,
                             completion="as the worker sent it")
    logger = SampleLogger(tmp_path, SamplesConfig(every_steps=1, count=2), tok, MultiTracker())
    rows = logger.maybe_log(1, 1, [group])
    assert [(r["prompt"], r["completion"], r["response_tokens"]) for r in rows] == [
        ("<bos>sort: cab", "abc<eos>", 4), ("<bos>sort: cab", "as the worker sent it", 4)]


def test_long_texts_keep_head_and_tail_and_say_how_much_was_cut(tmp_path):
    text = "h" * 1500 + "m" * 1000 + "t" * 1500
    cut = truncate_text(text, 2000)
    assert cut == "h" * 1000 + "\n[... 2000 chars cut ...]\n" + "t" * 1000
    assert truncate_text("short", 2000) == "short" and truncate_text("x" * 2000) == "x" * 2000
    logger = SampleLogger(tmp_path, SamplesConfig(every_steps=1, count=1), None, MultiTracker(),
                          max_chars=10)
    (row,) = logger.maybe_log(1, 1, [_group("a", [1.0], completion="0123456789abcdef")])
    assert row["completion"] == "01234\n[... 6 chars cut ...]\nbcdef"
    (line,) = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert json.loads(line)["completion"] == row["completion"]


def test_a_row_names_the_trajectorys_data_source(tmp_path):
    if "data_source" not in Trajectory.__struct_fields__:
        pytest.skip("Trajectory has no data_source field yet")
    group = Group(prompt_id="a", group_size=1)
    group.members[0] = msgspec.structs.replace(_traj("a", 0, 1.0, n=1), data_source="gsm8k")
    logger = SampleLogger(tmp_path, SamplesConfig(every_steps=1, count=1), None, MultiTracker())
    assert [r["data_source"] for r in logger.maybe_log(1, 1, [group])] == ["gsm8k"]
