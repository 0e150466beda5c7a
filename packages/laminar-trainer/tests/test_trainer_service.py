"""The trainer in one process: real ZeroMQ on loopback, in-memory etcd twin, a tiny
random model, hand-made trajectories; publishing goes to a recording stand-in."""

from __future__ import annotations

import json
import math
import time

import msgspec
import pytest
import torch

from laminar_common.codec import Ack, GroupsFiltered, Trajectory, TrajectoryRejected
from laminar_common.membership import (
    InMemoryCoordinator,
    InMemoryEtcd,
    MemberRecord,
    VersionRecord,
)
from laminar_common.transport import ZmqPullReceiver, ZmqPushSender
from laminar_examples.demo_model import build_tiny_model, build_tokenizer
from laminar_trainer.config import TrainerConfig
from laminar_trainer.service import TrainerService

JOB = "unit"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2,
                     intermediate_size=64).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _trajs(prompt_id, n=2, version=0):
    return [Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, group_size=n,
                       sample_index=i, worker_id="w", policy_version=version,
                       prompt_token_ids=(1, 10, 11), response_token_ids=(12, 13, 2),
                       behaviour_logprobs=(-3.0, -3.1, -3.2), reward=float(i % 2),
                       finish_reason="stop") for i in range(n)]


class Harness:
    def __init__(self, tmp_path, model_dir, **overrides):
        self.store = InMemoryEtcd()
        self.published: list[int] = []
        self.manager_coord = InMemoryCoordinator(self.store, JOB)
        self.acks = ZmqPullReceiver(expect=(Ack, TrajectoryRejected, GroupsFiltered))
        self.manager_coord.register(MemberRecord(member_id="manager", role="manager",
                                                 address="tcp://unused:1",
                                                 extra={"ack": self.acks.endpoint}))
        self.cfg = TrainerConfig(**{
            "job": JOB, "trainer_id": "trainer", "model_dir": model_dir,
            "run_dir": str(tmp_path / "run"), "batch_groups": 2,
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 2},
            "optim": {"lr": 1e-3}, **overrides})
        self.acked: list[str] = []
        self.rejections: list[TrajectoryRejected] = []
        self.filtered: list[str] = []

    def start(self, resume=False):
        svc = TrainerService(self.cfg, publish_fn=self._publish,
                             coordinator=InMemoryCoordinator(self.store, JOB), resume=resume)
        svc.start()
        return svc

    def _publish(self, version, tensors, step):
        # Stands in for the master relay: it makes a stored version visible in etcd.
        assert all(isinstance(t[3], memoryview) for t in tensors)
        self.published.append(version)
        self.manager_coord.publish_version(VersionRecord(version=version, trainer_step=step))

    def send(self, svc, trajs):
        sender = ZmqPushSender(svc.consumer.endpoint)
        for t in trajs:
            sender.send(t)
        sender.close()

    def drain_acks(self, seconds=0.5):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self.acks.recv(timeout_s=0.05)
            if isinstance(msg, TrajectoryRejected):
                self.rejections.append(msg)
            elif isinstance(msg, GroupsFiltered):
                self.filtered.extend(msg.prompt_ids)
            elif msg is not None:
                self.acked.extend(msg.trajectory_ids)


def _wait(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_steps_publish_checkpoint_and_ack(tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=2)
    svc = h.start()
    try:
        before = {k: v.clone() for k, v in svc.model.state_dict().items()}
        h.send(svc, [t for p in ("a", "b", "c", "d") for t in _trajs(p)])
        assert _wait(lambda: svc.finished.is_set(), 60)
        after = svc.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), "no gradient step"
        assert h.published == [0, 1, 2]
        h.drain_acks()
        assert sorted(h.acked) == sorted(f"{p}#{i}" for p in "abcd" for i in range(2))
        lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2]
        metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["tokens"] == 12 and metrics[0]["staleness_mean"] == 0
    finally:
        svc.close()


def test_duplicates_and_consumed_ids_are_not_trained_twice(tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=2)
    svc = h.start()
    try:
        a = _trajs("a")
        h.send(svc, a + a + _trajs("b"))
        assert _wait(lambda: svc.step == 1, 30)
        h.send(svc, a + _trajs("c") + _trajs("d"))
        assert _wait(lambda: svc.finished.is_set(), 60)
        lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
        ids = [i for x in lines for i in x["ids"]]
        assert len(ids) == len(set(ids)) == 8
        # Every copy stops at the door (2 of held ids, 2 of trained ones): the buffer
        # never sees one.
        assert svc.consumer.stats.duplicates == 4 and svc.buffer.stats.duplicates == 0
    finally:
        svc.close()


def test_resume_rolls_back_past_the_checkpoint(tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=4)
    svc = h.start()
    h.send(svc, [t for p in "abcdef" for t in _trajs(p)])
    assert _wait(lambda: svc.step == 3, 60)
    # A failure (not a graceful stop) writes no final checkpoint: the crash case.
    svc.fail(RuntimeError("simulated crash after step 3 (checkpoint at 2)"))
    assert (tmp_path / "ckpt" / "LATEST").read_text() == "step-00000002"

    svc2 = h.start(resume=True)
    try:
        assert svc2.step == 2
        assert svc2.version > 3, "a resumed trainer must publish a newer version"
        assert set(svc2.buffer.consumed) == {f"{p}#{i}" for p in "abcd" for i in range(2)}
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2], "metrics.jsonl is cut back to the checkpoint"
        # Workers re-send everything unacked: e and f (rolled back) plus g and h.
        h.send(svc2, [t for p in "efgh" for t in _trajs(p, version=3)])
        assert _wait(lambda: svc2.finished.is_set(), 60)
        lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
        ids = [i for x in lines for i in x["ids"]]
        assert [x["step"] for x in lines] == [1, 2, 3, 4]
        assert len(ids) == len(set(ids)) == 16
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
    finally:
        svc2.close()


def test_after_a_resume_trajectories_older_than_the_bound_are_generated_again(
        tmp_path, model_dir):
    """Resumed from step 2 (published again as v3) with a staleness bound of 1: what
    workers generated with their initial weights (v0, before the resumed version reached
    them) is refused, not as broken (never given up on) but to be generated again, and
    never trained; v2 and newer trains, whatever the buffer's policy (fifo here)."""
    h = Harness(tmp_path, model_dir, total_steps=4, buffer={"max_staleness": 1})
    svc = h.start()
    h.send(svc, [t for p in "abcd" for t in _trajs(p)])
    assert _wait(lambda: svc.step == 2, 60)
    svc.fail(RuntimeError("simulated crash after step 2 (checkpoint at 2)"))

    svc2 = h.start(resume=True)
    try:
        assert svc2.step == 2 and svc2.version == 3 and svc2.intake.resume_floor == 2
        stale = [t for p in "ef" for t in _trajs(p, version=0)]
        h.send(svc2, stale * 2)  # and again: still not given up on
        assert _wait(lambda: svc2.intake.refused_stale_resume == 8, 20), svc2.intake.refused_stale_resume
        assert len(svc2.buffer) == 0 and svc2.step == 2
        h.send(svc2, [t for p in "gh" for t in _trajs(p, version=2)])
        # e and f generated again by the resumed weights
        h.send(svc2, [t for p in "ef" for t in _trajs(p, version=3)])
        assert _wait(lambda: svc2.finished.is_set(), 60)
        h.drain_acks(1.0)
        refused = [r for r in h.rejections if r.trajectory_id[0] in "ef"]
        assert len(refused) == 8 and not any(r.final for r in refused), refused
        assert refused[0].reason.startswith("stale-after-resume: generated by v0")
        lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text()
                 .splitlines()]
        assert [x["step"] for x in lines] == [1, 2, 3, 4]
        after = sorted(i for x in lines[2:] for i in x["ids"])
        assert after == [f"{p}#{i}" for p in "efgh" for i in range(2)]
        # trained: the v2 and v3 copies only (staleness from the versions they were taken at)
        assert set(svc2.buffer.stats.staleness) <= {0, 1, 2}
        assert svc2.summary()["refused_stale_after_resume"] == 8
    finally:
        svc2.close()


def test_a_first_step_whose_every_reward_failed_stops_the_trainer_with_the_cause(
        tmp_path, model_dir, capsys):
    """A missing answer key or a broken reward makes every reward of the step fail: the
    trainer stops at its first step with the cause (not a run that ends 0 with reward 0),
    trains and acks nothing. Later, one failed reward in a step is shown on its line."""
    h = Harness(tmp_path, model_dir, total_steps=2)
    svc = h.start()
    err = "ValueError: the 'math' reward needs the ground truth in metadata['answer']"
    try:
        h.send(svc, [_bad(t, reward_error=err, reward=0.0) for p in "ab" for t in _trajs(p)])
        assert _wait(lambda: svc.failure is not None, 30)
        text = str(svc.failure)
        assert "step 1: every reward of the step failed (4 of 4)" in text and err in text
        assert "answer_key" in text and svc.step == 0
        h.drain_acks(0.5)
        assert h.acked == []
    finally:
        svc.close()

    h2 = Harness(tmp_path / "2", model_dir, total_steps=1)
    svc = h2.start()
    try:
        trajs = [t for p in "ab" for t in _trajs(p)]
        trajs[1] = _bad(trajs[1], reward_error=err)
        h2.send(svc, trajs)
        assert _wait(lambda: svc.finished.is_set(), 60)
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("STEP 1 "))
        assert "| 1/1 |" in line and "REWARD ERRORS 1/4 (1 so far)" in line, line
        assert "elapsed, ETA 0:00" in line and "tok/s" in line
        assert svc.summary()["reward_errors"] == 1
    finally:
        svc.close()


@pytest.mark.parametrize("action", ["finish", "fail"])
def test_data_that_runs_out_ends_the_run_or_fails_it_naming_the_cause(
        tmp_path, model_dir, monkeypatch, capsys, action):
    """The manager's status says its prompts are exhausted and nothing is left to
    generate: the starved trainer says so, then ends the run there with its final model
    and summary (finish), or fails at once naming the cause (fail), not after
    wait_timeout_s."""
    import laminar_trainer.feed as feed_module
    from laminar_common.roles import State

    monkeypatch.setattr(feed_module, "WAIT_REASON_EVERY_S", 0.3)
    h = Harness(tmp_path, model_dir, total_steps=3, on_data_exhausted=action,
                wait_timeout_s=120)
    h.manager_coord.put_state(State.MANAGER, json.dumps(
        {"prompts_exhausted": True, "cursor": {"epoch": 1, "position": 0},
         "ledger": {"pending": 0, "dispatched": 0, "done": 0, "acked": 4},
         "workers": {"w": {}}}).encode())
    svc = h.start()
    try:
        h.send(svc, [t for p in "ab" for t in _trajs(p)])
        if action == "fail":
            assert _wait(lambda: svc.failure is not None, 30)
            assert "no more data will come at step 2 of 3: 0 complete group(s) held; the " \
                   "manager's prompts are exhausted" in str(svc.failure)
            return
        assert _wait(lambda: svc.finished.is_set(), 60)
        out = capsys.readouterr().out
        assert "WAITING " in out and "DATA EXHAUSTED: the data ran out at step 2 of 3" in out
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["steps"] == 1 and "step 2 of 3" in summary["ended_early"]
        assert summary["final_model"] and (tmp_path / "run" / "final").is_dir()
        assert (tmp_path / "ckpt" / "LATEST").read_text() == "step-00000001"
    finally:
        svc.close()


def test_graceful_stop_writes_a_final_checkpoint_and_acks_it(tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=5)
    svc = h.start()
    h.send(svc, [t for p in "abcdef" for t in _trajs(p)])
    assert _wait(lambda: svc.step == 3, 60)
    svc.close("signal SIGTERM")  # what run_forever does on SIGTERM / SIGINT
    assert (tmp_path / "ckpt" / "LATEST").read_text() == "step-00000003"
    h.drain_acks(1.0)
    assert set(h.acked) == {f"{p}#{i}" for p in "abcdef" for i in range(2)}, h.acked
    svc2 = h.start(resume=True)
    try:
        assert svc2.step == 3
        # A worker re-sends what it still holds: the trained e, f are refused by id.
        h.send(svc2, [t for p in "efghij" for t in _trajs(p, version=3)])
        assert _wait(lambda: svc2.finished.is_set(), 60)
        assert svc2.consumer.stats.duplicates == 4 and svc2.consumer.stats.reacked == 4
        lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
        ids = [i for x in lines for i in x["ids"]]
        assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
        assert len(ids) == len(set(ids)) == 20
    finally:
        svc2.close()


def test_a_checkpointed_step_already_has_its_metrics_and_samples_rows(tmp_path, model_dir):
    """The checkpoint comes last in a step: a trainer killed right after it resumes after a
    step whose rows are all written (before, the rows came after the checkpoint, and a
    kill between the two lost the step's metrics row for good)."""
    h = Harness(tmp_path, model_dir, total_steps=4, samples={"every_steps": 1})
    seen: list[tuple[int, list[int], list[int]]] = []
    svc = h.start()
    checkpoint = svc.durable.checkpoint

    def checked(step: int, version: int) -> None:
        run = tmp_path / "run"
        rows = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        samples = [json.loads(x)["step"] for x in (run / "samples.jsonl").read_text().splitlines()]
        seen.append((step, rows, samples))
        checkpoint(step, version)

    svc.durable.checkpoint = checked
    try:
        h.send(svc, [t for p in "abcdefgh" for t in _trajs(p)])
        assert _wait(lambda: svc.finished.is_set(), 60)
    finally:
        svc.close()
    assert [step for step, _, _ in seen] == [2, 4]
    for step, rows, samples in seen:
        assert rows[-1] == step and samples[-1] == step, (step, rows, samples)


_STREAM = {"batch_groups": 2, "optim": {"lr": 1e-2, "mini_batches": 2, "shuffle": False,
                                         "stream": True},
           "loss": {"proximal": "loglinear"}}


def test_a_streamed_step_trains_its_first_mini_batch_before_the_rest_arrives(
        tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=1, **_STREAM)
    svc = h.start()
    try:
        before = {k: v.clone() for k, v in svc.model.state_dict().items()}
        h.send(svc, _trajs("a"))
        # The step's first update is made on group a alone; the step is not over.
        assert _wait(lambda: any(not torch.equal(before[k], v)
                                 for k, v in svc.model.state_dict().items()), 60)
        time.sleep(0.3)
        assert svc.step == 0 and h.published == [0]
        h.send(svc, _trajs("b"))
        assert _wait(lambda: svc.finished.is_set(), 60)
        assert h.published == [0, 1]
        lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
        assert [sorted(x["ids"]) for x in lines] == [["a#0", "a#1", "b#0", "b#1"]]
        row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
        assert row["updates"] == 2 and row["tokens"] == 12
        # the wait for group b counts as waiting, not as the step's compute
        assert 0.3 <= row["stream_wait_s"] <= row["wait_s"]
        h.drain_acks()
        assert sorted(h.acked) == ["a#0", "a#1", "b#0", "b#1"]
    finally:
        svc.close()


def test_a_streamed_step_stopped_midway_keeps_and_accounts_what_it_trained(
        tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=3, **_STREAM)
    svc = h.start()
    before = {k: v.clone() for k, v in svc.model.state_dict().items()}
    h.send(svc, _trajs("a"))
    assert _wait(lambda: any(not torch.equal(before[k], v)
                             for k, v in svc.model.state_dict().items()), 60)
    svc.close("signal SIGTERM")  # mid-step: the second mini-batch never comes
    lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    assert [(x["step"], sorted(x["ids"])) for x in lines] == [(1, ["a#0", "a#1"])]
    assert (tmp_path / "ckpt" / "LATEST").read_text() == "step-00000001"
    h.drain_acks(1.0)
    assert sorted(h.acked) == ["a#0", "a#1"]


def test_copies_of_trained_ids_are_acked_again_once_durable_even_to_a_new_manager(
        tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=4)
    svc = h.start()
    try:
        h.send(svc, _trajs("a") + _trajs("b"))
        assert _wait(lambda: svc.step == 1, 30)
        h.send(svc, _trajs("a"))  # trained, not checkpointed yet: no ack
        h.drain_acks(1.5)
        assert h.acked == []
        h.send(svc, _trajs("c") + _trajs("d"))
        assert _wait(lambda: svc.step == 2, 30)
        h.drain_acks(0.5)
        assert sorted(h.acked) == sorted(f"{p}#{i}" for p in "abcd" for i in range(2))
        h.acked.clear()
        h.send(svc, _trajs("a"))  # durable now: acked again while the trainer waits
        assert _wait(lambda: (h.drain_acks(0.1), sorted(h.acked))[1] == ["a#0", "a#1"], 5)

        # The manager restarts elsewhere: re-acks follow it to its new address.
        h.manager_coord.close()
        new_acks = ZmqPullReceiver(expect=Ack)
        new_coord = InMemoryCoordinator(h.store, JOB)
        new_coord.register(MemberRecord(member_id="manager", role="manager",
                                        address="tcp://unused:2",
                                        extra={"ack": new_acks.endpoint}))
        h.acked.clear()
        h.send(svc, _trajs("b"))
        got: list[str] = []

        def arrived():
            msg = new_acks.recv(timeout_s=0.1)
            if msg is not None:
                got.extend(msg.trajectory_ids)
            # A new manager incarnation gets every settled id of unsettled groups again
            # (its restored ledger may predate the acks), the re-acked b among them.
            return set(got) == {f"{p}#{i}" for p in "abcd" for i in range(2)}

        assert _wait(arrived, 5), got
        h.drain_acks(0.2)
        assert h.acked == []
        assert svc.consumer.stats.duplicates == 6 and svc.consumer.stats.reacked == 4
        new_coord.close()
        new_acks.close()
    finally:
        svc.close()


def _bad(t: Trajectory, **changes) -> Trajectory:
    return msgspec.structs.replace(t, **changes)


def test_bad_trajectories_are_rejected_by_reason_and_never_reach_the_weights(
        tmp_path, model_dir):
    """Decodable trajectories with wrong contents, against the real (tiny) model: each
    is refused before the buffer, counted by reason, and reported to the manager; after
    max_rejections copies of one id the group trains without it."""
    h = Harness(tmp_path, model_dir, total_steps=2, max_rejections=2)
    # Each bad copy below has its own id (x0, x1, ...): rejected once, generated again.
    svc = h.start()
    try:
        vocab = svc.model.get_input_embeddings().num_embeddings
        good = [t for p in "abcd" for t in _trajs(p)]
        a0 = good[0]
        bad = [
            _bad(a0, behaviour_logprobs=a0.behaviour_logprobs[:-1]),   # length-mismatch
            _bad(a0, prompt_token_ids=()),                            # empty-prompt
            _bad(a0, response_token_ids=(12, vocab, 2)),              # token-out-of-range
            _bad(a0, prompt_token_ids=(1, -5, 11)),                   # token-out-of-range
            _bad(a0, reward=math.nan),                                # non-finite-reward
            _bad(a0, behaviour_logprobs=(-1.0, math.inf, -1.0)),      # bad-logprob
            _bad(a0, sample_index=7),                                 # bad-group
            _bad(a0, group_seq=3, settled_below=5),                   # bad-group: watermark
            _bad(a0, policy_version=99),                              # bad-version
        ]
        bad = [_bad(t, trajectory_id=f"x{k}#0", prompt_id=f"x{k}") for k, t in enumerate(bad)]
        h.send(svc, bad)
        assert _wait(lambda: sum(svc.rejected.values()) == len(bad), 20), svc.rejected
        assert svc.rejected["token-out-of-range"] == 2 and svc.rejected["empty-prompt"] == 1
        assert svc.rejected["length-mismatch"] == svc.rejected["non-finite-reward"] == 1
        assert svc.rejected["bad-logprob"] == 1 and svc.rejected["bad-group"] == 2
        assert svc.buffer.consumed.watermark == -1, "a rejected watermark was believed"
        assert svc.rejected["bad-version"] == 1
        assert len(svc.buffer) == 0, "something partial became visible"
        # b#1 is broken twice (max_rejections=2): given up on, group b trains without it.
        b1 = good[3]
        h.send(svc, [_bad(b1, reward=math.inf)] * 2)
        h.send(svc, [t for t in good if t.trajectory_id != "b#1"])
        assert _wait(lambda: svc.finished.is_set(), 60)
        h.drain_acks(1.0)
        assert all(math.isfinite(float(p.abs().sum())) for p in svc.model.parameters())
        lines = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
        trained = [i for x in lines for i in x["ids"]]
        assert sorted(trained) == ["a#0", "a#1", "b#0", "c#0", "c#1", "d#0", "d#1"]
        notes = {(r.trajectory_id, r.final) for r in h.rejections}
        assert ("x0#0", False) in notes and ("b#1", False) in notes and \
            ("b#1", True) in notes, notes
        assert svc.buffer.stats.failed == 1
        # A later good copy of the given-up id is refused as consumed, never trained.
        assert "b#1" in svc.buffer.consumed
    finally:
        svc.close()


def test_a_non_finite_step_leaves_the_weights_alone(tmp_path, model_dir):
    from laminar_trainer.buffer import Group
    from laminar_trainer.step import train_step

    h = Harness(tmp_path, model_dir, total_steps=1)
    svc = h.start()
    try:
        before = {k: v.clone() for k, v in svc.model.state_dict().items()}
        trajs = _trajs("n")
        trajs[0] = _bad(trajs[0], reward=math.nan)  # past the door, as if it slipped by
        group = Group("n", 2, {t.sample_index: t for t in trajs})
        result = train_step(svc.model, svc.policy.optimizer, svc.policy.scheduler, [group], svc.config)
        assert result.stats["skipped_nonfinite"] == 1.0
        for k, v in svc.model.state_dict().items():
            assert torch.equal(v, before[k]), k
    finally:
        svc.close()


def test_a_fresh_start_clears_an_earlier_runs_checkpoints(tmp_path, model_dir):
    """Checkpoints of an earlier run at higher steps must not outlive (and prune away)
    the new run's: a fresh start removes them, so LATEST always names a checkpoint."""
    stale = tmp_path / "ckpt" / "step-00000370"
    stale.mkdir(parents=True)
    (stale / "trainer.json").write_text('{"step": 370, "version": 370, "consumed": []}')
    (tmp_path / "ckpt" / "LATEST").write_text("step-00000370")
    h = Harness(tmp_path, model_dir, total_steps=2)
    svc = h.start()
    try:
        assert not stale.exists()
        h.send(svc, [t for p in "abcd" for t in _trajs(p)])
        assert _wait(lambda: svc.finished.is_set(), 60)
    finally:
        svc.close()
    assert (tmp_path / "ckpt" / "LATEST").read_text() == "step-00000002"
    svc2 = h.start(resume=True)
    try:
        assert svc2.step == 2
    finally:
        svc2.close()


def test_the_final_model_is_saved_without_checkpoints_and_publishes_are_bf16(tmp_path, model_dir):
    """Default checkpoint config (none) and bf16 training: the trained fp32 master weights
    end in <run_dir>/final as a Hugging Face directory; every publish carried bf16."""
    from transformers import AutoModelForCausalLM

    from laminar_trainer.config import CheckpointConfig

    h = Harness(tmp_path, model_dir, total_steps=2, dtype="bfloat16")
    h.cfg = h.cfg.model_copy(update={"checkpoint": CheckpointConfig()})
    dtypes: set[str] = set()
    record = h._publish

    def publish(version, tensors, step):
        dtypes.update(dtype for _, dtype, _, _ in tensors)
        record(version, tensors, step)

    h._publish = publish
    svc = h.start()
    try:
        h.send(svc, [t for p in "abcd" for t in _trajs(p)])
        assert _wait(lambda: svc.finished.is_set(), 60)
        trained = {k: v.clone() for k, v in svc.model.state_dict().items()}
    finally:
        svc.close()
    assert dtypes == {"bfloat16"} and h.published == [0, 1, 2]
    final = tmp_path / "run" / "final"
    assert not (tmp_path / "ckpt").exists()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_model"] == str(final)
    saved = AutoModelForCausalLM.from_pretrained(str(final))
    assert {p.dtype for p in saved.parameters()} == {torch.float32}
    for name, tensor in trained.items():
        assert torch.equal(saved.state_dict()[name], tensor), name
    assert (final / "tokenizer.json").is_file() and not list(final.glob("optimizer*"))


def _uniform(prompt_id, n=2, reward=1.0):
    return [msgspec.structs.replace(t, reward=reward) for t in _trajs(prompt_id, n)]


def test_dynamic_sampling_trains_only_informative_groups_and_tells_the_manager(
        tmp_path, model_dir):
    """Uniform groups are dropped before the step, logged as dropped, acked once
    durable, counted, and named to the manager at once; a new manager incarnation
    is told again (it credits each group once)."""
    h = Harness(tmp_path, model_dir, total_steps=3, buffer={"dynamic_sampling": True})
    svc = h.start()
    try:
        h.send(svc, _uniform("u1") + _trajs("a") + _uniform("u2", reward=0.0) + _trajs("b"))
        # The step counter moves before the step's accounting: u3 goes out only once
        # step 1 has accounted u1 and u2, or step 1 may count u3 too.
        assert _wait(lambda: svc.step == 1 and svc.progress.groups_filtered == 2, 30), \
            (svc.step, svc.progress.groups_filtered)
        # The notices come while the trainer waits (no step needed), before any ack.
        h.send(svc, _uniform("u3") + _trajs("c"))
        assert _wait(lambda: (h.drain_acks(0.1), sorted(h.filtered))[1] == ["u1", "u2", "u3"],
                     10), h.filtered
        assert h.acked == []  # step 1 is not checkpointed yet
        h.send(svc, _trajs("d"))
        assert _wait(lambda: svc.step == 2, 30)
        h.drain_acks(0.5)  # step 2 is checkpointed: everything so far is acked
        assert sorted(h.acked) == sorted([f"{p}#{i}" for p in ("a", "b", "c", "d", "u1", "u2",
                                                               "u3") for i in range(2)])
        rows = [json.loads(x) for x in
                (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
        assert sorted(i for r in rows for i in r["ids"]) == \
            sorted(f"{p}#{i}" for p in "abcd" for i in range(2))
        assert sorted(i for r in rows for i in r.get("dropped", ())) == \
            sorted(f"u{k}#{i}" for k in (1, 2, 3) for i in range(2))
        assert svc.buffer.stats.filtered == 3 and svc.summary()["buffer"]["filtered"] == 3
        # Step 1 accounted u1 and u2 (complete before b), step 2 u3 (filtered while
        # the trainer waited after step 1).
        assert svc.progress.groups_filtered == 1

        # The manager restarts elsewhere: it is told every filtered group again.
        h.manager_coord.close()
        new_acks = ZmqPullReceiver(expect=(Ack, GroupsFiltered))
        new_coord = InMemoryCoordinator(h.store, JOB)
        new_coord.register(MemberRecord(member_id="manager", role="manager",
                                        address="tcp://unused:2",
                                        extra={"ack": new_acks.endpoint}))
        told: list[str] = []

        def arrived():
            msg = new_acks.recv(timeout_s=0.1)
            if isinstance(msg, GroupsFiltered):
                told.extend(msg.prompt_ids)
            return sorted(told) == ["u1", "u2", "u3"]

        assert _wait(arrived, 10), told
        new_coord.close()
        new_acks.close()
    finally:
        svc.close()


def test_dynamic_sampling_off_trains_uniform_groups(tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=1)
    svc = h.start()
    try:
        h.send(svc, _uniform("u1") + _trajs("a"))
        assert _wait(lambda: svc.finished.is_set(), 30)
        h.drain_acks(0.3)
        assert h.filtered == [] and svc.buffer.stats.filtered == 0
        assert svc.progress.groups_filtered == 0
    finally:
        svc.close()


def test_max_unpublished_steps_pauses_training_while_publishing_fails(tmp_path, model_dir,
                                                                      capsys):
    from laminar_common.errors import TransportError

    h = Harness(tmp_path, model_dir, total_steps=5, max_unpublished_steps=1,
                checkpoint={"dir": None})
    relays_down = {"now": False}
    publish = h._publish

    def flaky(version, tensors, step):
        if relays_down["now"]:
            raise TransportError("no usable relay master (simulated: every relay is cut off)")
        publish(version, tensors, step)

    h._publish = flaky
    svc = h.start()
    try:
        h.send(svc, [t for p in ("a", "b") for t in _trajs(p)])
        assert _wait(lambda: svc.step == 1 and h.published == [0, 1], 30)
        relays_down["now"] = True
        # Plenty of data: only the unpublished weights hold the trainer back.
        h.send(svc, [t for p in ("c", "d", "e", "f", "g", "h") for t in _trajs(p, version=1)])
        assert _wait(lambda: svc.step == 3, 30)
        time.sleep(1.0)
        assert svc.step == 3, "trained on with weights two steps unpublished"
        assert "PAUSED at step 3" in capsys.readouterr().out
        relays_down["now"] = False  # the paused trainer sends its weights again
        assert _wait(lambda: svc.step == 4, 30)
        assert "RESUMED at step 3" in capsys.readouterr().out
    finally:
        svc.close()


def test_a_step_replays_bit_exact_and_a_tampered_record_names_the_tensors(tmp_path, model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from laminar_common.errors import LaminarError
    from laminar_trainer.replay import replay_step, replayable_steps

    ckpt = tmp_path / "ckpt"
    h = Harness(tmp_path, model_dir, total_steps=3,
                checkpoint={"dir": str(ckpt), "every_steps": 1, "keep": 10})
    svc = h.start()
    try:
        h.send(svc, [t for p in "abcdef" for t in _trajs(p)])
        assert _wait(lambda: svc.finished.is_set(), 60)
        written = svc.records.bytes_written
    finally:
        svc.close()
    records = ckpt / "records"
    assert replayable_steps(records, ckpt) == [2, 3] and written > 0
    result = replay_step(records, ckpt, 2)
    assert result.exact and result.tensors > 0, result.describe()
    assert "bit-exact" in result.describe()
    with pytest.raises(LaminarError, match="needs the checkpoints of steps 0 and 1"):
        replay_step(records, ckpt, 1)
    # One reward changed in the record: the recomputed update is not the trained one.
    path = records / "step-00000002.parquet"
    table = pq.read_table(path)
    rewards = table.column("reward").to_pylist()
    rewards[0] += 1.0
    tampered = table.set_column(table.column_names.index("reward"), "reward",
                                pa.array(rewards, pa.float64()))
    pq.write_table(tampered, path)
    result = replay_step(records, ckpt, 2)
    assert not result.exact and result.differing, result.describe()
    worst = max(result.differing, key=result.differing.get)
    assert worst in result.describe() and worst in svc.model.state_dict()


def test_the_step_metrics_split_ratios_and_clipping_by_staleness(tmp_path, model_dir):
    h = Harness(tmp_path, model_dir, total_steps=1, checkpoint={"dir": None})
    svc = h.start()
    try:
        svc.progress.version = 2  # trajectories of v2 are fresh, of v0 two versions stale
        h.send(svc, _trajs("a", version=2) + _trajs("b", version=0))
        assert _wait(lambda: svc.finished.is_set(), 60)
    finally:
        svc.close()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["stale0_token_frac"] == pytest.approx(0.5)
    assert row["stale2_token_frac"] == pytest.approx(0.5)
    assert "stale1_token_frac" not in row and row["staleness_token_mean"] == pytest.approx(1.0)
    for bucket in ("stale0", "stale2"):
        assert 0 <= row[f"{bucket}_clip_frac"] <= 1 and row[f"{bucket}_ratio_mean"] > 0


def test_a_paused_trainer_resends_its_weights_as_a_version_newer_than_the_published(
        tmp_path, model_dir, capsys):
    from laminar_common.errors import TransportError

    h = Harness(tmp_path, model_dir, total_steps=4, max_unpublished_steps=0,
                checkpoint={"dir": None})
    publish = h._publish
    lost = {"v": 2}

    def dying_master(version, tensors, step):
        if version == lost["v"]:
            lost["v"] = -1
            # The old master made it visible and died before answering: the publisher
            # sees a failure, and that version can never be published again.
            h.manager_coord.publish_version(VersionRecord(version=version, trainer_step=step))
            raise TransportError("master relay-0 failed (simulated: SIGKILL after commit)")
        publish(version, tensors, step)

    h._publish = dying_master
    svc = h.start()
    try:
        h.send(svc, [t for p in "abcdef" for t in _trajs(p)])
        assert _wait(lambda: svc.step >= 3, 60), "paused for good: v2 can never be re-sent"
        out = capsys.readouterr().out
        assert "PAUSED at step 2" in out and "RESUMED at step 2" in out
        assert h.published[:3] == [0, 1, 3], h.published
    finally:
        svc.close()
