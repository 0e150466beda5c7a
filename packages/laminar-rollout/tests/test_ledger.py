import pytest

from laminar_common.codec import SamplingSpec
from laminar_rollout.ledger import ACKED, DISPATCHED, DONE, PENDING, REJECTED, TrajectoryLedger
from laminar_rollout.prompts import PromptRecord

SAMPLING = SamplingSpec(max_tokens=8)


def _ledger(n_prompts=2, group=2):
    led = TrajectoryLedger()
    for i in range(n_prompts):
        led.add_group(PromptRecord(f"p{i}", f"prompt {i}", {"answer": str(i)}), group, SAMPLING)
    return led


def test_happy_path_exactly_once():
    led = _ledger()
    tasks = led.take_pending("w1", version=0, limit=10)
    assert [t.trajectory_id for t in tasks] == ["p0#0", "p0#1", "p1#0", "p1#1"]
    assert led.counts()[DISPATCHED] == 4
    for t in tasks:
        assert led.mark_done(t.trajectory_id, "w1")
    assert not led.settled()
    for t in tasks:
        assert led.mark_acked(t.trajectory_id) == "w1"
    assert led.settled()
    assert led.counts() == {PENDING: 0, DISPATCHED: 0, DONE: 0, ACKED: 4, REJECTED: 0}


def test_duplicate_prompt_id_refused():
    led = _ledger(1)
    with pytest.raises(ValueError, match="already exists"):
        led.add_group(PromptRecord("p0", "x", {}), 2, SAMPLING)


def test_stale_reports_change_nothing():
    led = _ledger(1, 1)
    led.take_pending("w1", 0, 1)
    assert not led.mark_done("p0#0", "w2")
    assert not led.mark_done("nope", "w1")
    assert led.counters.stale_reports == 2
    assert led.counts()[DISPATCHED] == 1


def test_progress_continuations_extend_the_tokens_and_gaps_are_counted_not_applied():
    led = _ledger(1, 1)
    led.take_pending("w1", version=3, limit=1)
    entry = led.entries["p0#0"]
    assert led.record_partial("p0#0", "w1", 3, (5, 6), (-0.1, -0.2))  # full
    assert led.record_partial("p0#0", "w1", 3, (7,), (-0.3,), offset=2)  # continues
    assert entry.partial_tokens == [5, 6, 7] and entry.partial_logprobs == [-0.1, -0.2, -0.3]
    led.record_partial("p0#0", "w1", 3, (7, 8), (-0.3, -0.4), offset=2)  # overlaps: fine
    assert entry.partial_tokens == [5, 6, 7, 8]
    led.record_partial("p0#0", "w1", 3, (10,), (-0.5,), offset=6)  # a gap: dropped
    led.record_partial("p0#0", "w1", 4, (9,), (-0.5,), offset=4)  # another version
    assert entry.partial_tokens == [5, 6, 7, 8] and led.counters.progress_gaps == 2
    led.record_partial("p0#0", "w1", 3, (5, 6, 7, 8, 9, 10), (-0.1,) * 6)  # full mends it
    assert entry.partial_tokens == [5, 6, 7, 8, 9, 10]
    assert not led.record_partial("p0#0", "w2", 3, (11,), (-0.1,), offset=6)  # not its holder
    assert entry.partial_tokens == [5, 6, 7, 8, 9, 10]
    # The worker restarted it at another version: its whole (shorter) report replaces
    # the old tokens, and its continuations then apply.
    led.record_partial("p0#0", "w1", 4, (20, 21), (-0.2, -0.2))
    led.record_partial("p0#0", "w1", 4, (22,), (-0.3,), offset=2)
    assert entry.partial_tokens == [20, 21, 22] and entry.partial_version == 4


def test_lost_worker_resumes_partial_and_regenerates_unacked():
    led = _ledger(2, 1)
    led.take_pending("w1", version=3, limit=2)
    led.record_partial("p0#0", "w1", 3, (5, 6), (-0.1, -0.2))
    led.mark_done("p1#0", "w1")
    resumable, again = led.worker_lost("w1")
    assert resumable == ["p0#0"] and again == ["p1#0"]
    assert led.counts()[PENDING] == 2
    # A worker at another version cannot continue the resumable one.
    tasks = led.take_pending("w2", version=4, limit=5)
    assert [t.trajectory_id for t in tasks] == ["p1#0"]
    assert tasks[0].resume_token_ids == ()
    tasks = led.take_pending("w3", version=3, limit=5)
    assert tasks[0].trajectory_id == "p0#0"
    assert tasks[0].resume_token_ids == (5, 6) and tasks[0].policy_version == 3
    assert led.counters.resumed == 1


def test_restart_unresumable_drops_tokens():
    led = _ledger(1, 1)
    led.take_pending("w1", 2, 1)
    led.record_partial("p0#0", "w1", 2, (1,), (-1.0,))
    led.worker_lost("w1")
    assert led.restart_unresumable({5}) == 1
    assert led.take_pending("w2", 5, 1)[0].resume_token_ids == ()


def test_ack_of_a_redispatched_trajectory_wins():
    led = _ledger(1, 1)
    led.take_pending("w1", 0, 1)
    led.mark_done("p0#0", "w1")
    led.worker_lost("w1")
    led.take_pending("w2", 0, 1)
    # The trainer had received w1's copy: it acks; w2's later completion is stale.
    assert led.mark_acked("p0#0") == "w2"
    assert not led.mark_done("p0#0", "w2")
    assert led.settled()


def test_export_and_specific_placement():
    led = _ledger(1, 1)
    task = led.take_pending("w1", 1, 1)[0]
    from laminar_common.codec import PromptTask

    exported = PromptTask(trajectory_id=task.trajectory_id, prompt_id=task.prompt_id,
                          group_size=1, sample_index=0, prompt=task.prompt,
                          resume_token_ids=(9,), resume_logprobs=(-0.5,), policy_version=1)
    assert led.requeue_exported(exported, "w1")
    assert led.pending_resumable() == [("p0#0", 1)]
    assert led.take_specific("p0#0", "w2", version=2) is None
    moved = led.take_specific("p0#0", "w2", version=1)
    assert moved.resume_token_ids == (9,)
    assert led.held_by("w2") == ["p0#0"]


def test_an_exported_conversation_travels_with_its_tokens_and_a_lost_one_follows_replayable():
    from laminar_common.codec import ConversationState, PromptTask

    led = _ledger(2, 1)
    state = ConversationState(observation_spans=((2, 4),), messages=({"role": "user",
                                                                     "content": "q"},),
                              env_state={"turns": 1}, turns=2)
    for replayable in (True, False):
        task = led.take_pending("w1", 1, 1)[0]
        led.requeue_exported(PromptTask(
            trajectory_id=task.trajectory_id, prompt_id=task.prompt_id, group_size=1,
            sample_index=0, prompt="q", resume_token_ids=(7, 8, 9, 9, 5),
            resume_logprobs=(-0.1, -0.2, 0.0, 0.0, -0.3), policy_version=1,
            conversation=ConversationState(**{**{f: getattr(state, f) for f in
                                                 state.__struct_fields__},
                                              "replayable": replayable})), "w1")
        moved = led.take_specific(task.trajectory_id, "w2", version=1)
        assert moved.conversation.observation_spans == ((2, 4),)
        assert moved.conversation.replayable is replayable
        # A partial from the new holder cannot replace the exported tokens-and-state pair.
        led.record_partial(task.trajectory_id, "w2", 1, (1,) * 9, (-0.1,) * 9)
        assert led.entries[task.trajectory_id].partial_tokens == [7, 8, 9, 9, 5]
    resumable, again = led.worker_lost("w2")
    # The replayable one resumes where it was exported; the other starts afresh.
    assert resumable == ["p0#0"] and again == ["p1#0"]
    assert led.entries["p1#0"].partial_conversation is None
    assert led.entries["p1#0"].partial_tokens == []


def test_rejected_is_final():
    led = _ledger(1, 1)
    led.take_pending("w1", 0, 1)
    assert led.mark_rejected("p0#0", "w1", "too long")
    assert led.settled()
    assert led.entries["p0#0"].reason == "too long"


def test_batches():
    led = TrajectoryLedger()
    led.add_group(PromptRecord("a", "x", {}), 1, SAMPLING, batch=0)
    led.add_group(PromptRecord("b", "x", {}), 1, SAMPLING, batch=1)
    assert not led.batch_done(0)
    led.take_pending("w", 0, 1)
    led.mark_done("a#0", "w")
    assert led.batch_done(0) and not led.batch_done(1)


def test_indexes_agree_with_a_full_scan_under_random_operations():
    import random

    from laminar_common.codec import PromptTask

    rng = random.Random(3)
    led = TrajectoryLedger()
    for b in range(6):
        led.add_group(PromptRecord(f"b{b}", "x", {}), 4, SAMPLING, batch=b)
    workers = ["w0", "w1", "w2"]
    for _ in range(400):
        op = rng.randrange(6)
        w = rng.choice(workers)
        tid = rng.choice(list(led.entries))
        if op == 0:
            led.take_pending(w, version=rng.randrange(2), limit=rng.randrange(4))
        elif op == 1:
            led.record_partial(tid, w, 0, (1, 2), (-0.1, -0.2))
            led.mark_done(tid, w)
        elif op == 2:
            led.mark_acked(tid)
        elif op == 3:
            led.worker_lost(w)
        elif op == 4 and led.entries[tid].state == DISPATCHED:
            e = led.entries[tid]
            led.requeue_exported(PromptTask(trajectory_id=tid, prompt_id=e.task.prompt_id,
                                            group_size=4, sample_index=0, prompt="x",
                                            resume_token_ids=(5,), resume_logprobs=(-1.0,),
                                            policy_version=0), e.worker)
        else:
            led.restart_unresumable({rng.randrange(2)})
        for worker in workers:
            scan = sorted(t for t, e in led.entries.items()
                          if e.worker == worker and e.state == DISPATCHED)
            assert led.held_by(worker) == scan and led.assigned(worker) == len(scan)
        for b in range(6):
            scan = all(e.state not in (PENDING, DISPATCHED) for e in led.entries.values()
                       if e.batch == b)
            assert led.batch_done(b) == scan
        scan = sorted((t, e.partial_version) for t, e in led.entries.items()
                      if e.state == PENDING and e.partial_tokens)
        assert led.pending_resumable() == scan
        assert sum(led.counts().values()) == 24


def test_restore_keeps_acked_and_rejected_and_makes_the_rest_pending():
    led = TrajectoryLedger()
    records = {f"p{i}": PromptRecord(f"p{i}", f"prompt {i}", {"answer": str(i)}) for i in range(3)}
    for i in range(3):
        led.add_group(records[f"p{i}"], 2, SAMPLING, batch=i // 2)
    tasks = {t.trajectory_id: t for t in led.take_pending("w1", 0, 6)}
    led.record_partial("p0#0", "w1", 0, (5, 6), (-0.1, -0.2))
    for tid in ("p0#1", "p1#0", "p1#1"):
        led.mark_done(tid, "w1")
    led.mark_acked("p1#0")
    led.mark_rejected("p2#0", "w1", "too long")
    snap = led.snapshot()
    assert snap["dispatched_to"] == {"w1": 2}  # p0#0 and p2#1

    back = TrajectoryLedger.restored(snap, records.get, SAMPLING)
    assert back.counts() == {PENDING: 4, DISPATCHED: 0, DONE: 0, ACKED: 1, REJECTED: 1}
    assert back.entries["p1#0"].state == ACKED and back.entries["p2#0"].state == REJECTED
    assert back.entries["p0#0"].partial_tokens == []  # tokens are not kept
    assert back.entries["p2#1"].batch == 1
    assert not back.batch_done(0) and not back.batch_done(1)
    again = back.take_pending("w2", 1, 10)
    assert [t.trajectory_id for t in again] == ["p0#0", "p0#1", "p1#1", "p2#1"]
    assert again[0].prompt == tasks["p0#0"].prompt
    # A copy trained before the restart is acked again: it stays acked, once.
    assert back.mark_acked("p1#0") is None
    assert back.counts()[ACKED] == 1


def test_restore_refuses_a_snapshot_that_does_not_fit():
    led = _ledger(n_prompts=1)
    snap = led.snapshot()
    with pytest.raises(ValueError, match="prompt 'p0' is not in the prompt file"):
        TrajectoryLedger.restored(snap, {}.get, SAMPLING)
    with pytest.raises(ValueError, match="malformed ledger snapshot"):
        TrajectoryLedger.restored({"states": {}}, {}.get, SAMPLING)
    bad = {**snap, "states": {**snap["states"], ACKED: ["zz#0"]}}
    with pytest.raises(ValueError, match="trajectory of no group: 'zz#0'"):
        TrajectoryLedger.restored(bad, lambda pid: PromptRecord(pid, "x", {}), SAMPLING)


def test_trainer_rejection_regenerates_or_fails_for_good():
    led = _ledger(1, 2)
    led.take_pending("w1", 0, 2)
    assert led.mark_done("p0#0", "w1")
    # A copy from another worker is stale; the known copy goes back to pending.
    assert not led.trainer_rejected("p0#0", "w2", "bad", final=False)
    assert led.trainer_rejected("p0#0", "w1", "bad", final=False)
    assert led.entries["p0#0"].state == PENDING and led.counters.regenerated == 1
    (task,) = led.take_pending("w2", 0, 5)
    assert task.trajectory_id == "p0#0"
    assert led.trainer_rejected("p0#0", "w2", "bad again", final=True)
    assert led.entries["p0#0"].state == REJECTED
    assert led.entries["p0#0"].reason == "trainer: bad again"
    assert not led.trainer_rejected("p0#0", "w2", "x", final=True)  # final is final


def _settle_all(led, worker="w1"):
    for t in led.take_pending(worker, 0, 10_000):
        led.mark_done(t.trajectory_id, worker)
        led.mark_acked(t.trajectory_id)


def test_watermark_moves_over_settled_groups_and_travels_with_tasks():
    led = _ledger(3, 2)
    assert led.settled_below == 0
    tasks = {t.trajectory_id: t for t in led.take_pending("w1", 0, 10)}
    assert [tasks[f"p{i}#0"].group_seq for i in range(3)] == [0, 1, 2]
    for tid in ("p1#0", "p1#1"):  # group 1 settles first: the watermark waits for 0
        led.mark_done(tid, "w1")
        led.mark_acked(tid)
    assert led.settled_below == 0
    for tid in ("p0#0", "p0#1"):
        led.mark_done(tid, "w1")
        led.mark_acked(tid)
    assert led.settled_below == 2
    led.add_group(PromptRecord("p3", "x", {}), 2, SAMPLING)
    (t,) = led.take_pending("w1", 0, 1)
    assert t.trajectory_id == "p3#0" and t.group_seq == 3 and t.settled_below == 2


def test_compaction_keeps_memory_flat_and_survives_a_restore():
    led = TrajectoryLedger(keep_settled=5)
    for i in range(200):
        led.add_group(PromptRecord(f"p{i}", "x", {}), 2, SAMPLING)
    _settle_all(led)
    led.add_group(PromptRecord("tail", "x", {}), 2, SAMPLING)
    assert led.settled_below == 200 and led.compacted_groups == 195
    assert len(led.entries) == 5 * 2 + 2
    assert led.counts()[ACKED] == 400 and led.created == 402
    snap = led.snapshot()
    assert snap["compacted"] == {"groups": 195, ACKED: 390}
    records = {f"p{i}": PromptRecord(f"p{i}", "x", {}) for i in range(200)}
    records["tail"] = PromptRecord("tail", "x", {})
    back = TrajectoryLedger.restored(snap, records.get, SAMPLING, keep_settled=5)
    assert back.settled_below == 200 and back.counts()[ACKED] == 400
    (t, _) = back.take_pending("w9", 0, 2)
    assert t.trajectory_id == "tail#0" and t.group_seq == 200 and t.settled_below == 200
    # Reports and acks for compacted ids are stale, never a crash.
    assert not back.mark_done("p3#0", "w1") and back.mark_acked("p3#0") is None


def test_chat_prompts_and_nested_metadata_travel_untouched_in_their_tasks():
    """The batch is the ledger's own: a record's fields (even one named ``batch``, of any
    JSON type) reach the worker as the file holds them."""
    messages = ({"role": "user", "content": "2+2?"},)
    meta = {"batch": [1, 2], "reward_model": {"ground_truth": "4"}, "answer": "4"}
    led = TrajectoryLedger()
    led.add_group(PromptRecord("chat", messages, meta), 2, SAMPLING, batch=0)
    led.add_group(PromptRecord("text", "plain", {"batch": {"n": 9}}), 1, SAMPLING)
    tasks = {t.trajectory_id: t for t in led.take_pending("w1", 0, 3)}
    assert tasks["chat#1"].prompt == "" and tasks["chat#1"].messages == messages
    assert tasks["chat#1"].metadata == meta
    assert tasks["text#0"].prompt == "plain" and tasks["text#0"].messages == ()
    assert tasks["text#0"].metadata == {"batch": {"n": 9}}
    assert led.mark_done("text#0", "w1") and not led.batch_done(0)
    led.mark_done("chat#0", "w1")
    led.mark_done("chat#1", "w1")
    assert led.batch_done(0) and led.counts()[DONE] == 3


def test_filtered_groups_are_credited_once_and_survive_a_restore():
    led = TrajectoryLedger(keep_settled=1)
    records = {f"p{i}": PromptRecord(f"p{i}", "x", {}) for i in range(4)}
    for i in range(4):
        led.add_group(records[f"p{i}"], 2, SAMPLING)
    assert led.mark_filtered("p1") is True and led.filtered_groups == 1
    assert led.mark_filtered("p1") is False  # a re-sent notice: no second credit
    assert led.mark_filtered("nope") is None and led.mark_filtered("p1#0") is None
    assert led.counters.filtered_again == 1 and led.counters.filtered_unknown == 2
    assert led.mark_filtered("p0") is True
    # Filtered groups are acked like the rest. p0 and p1 settle; p0 is compacted away
    # (its count stays).
    for t in led.take_pending("w1", 0, 4):
        led.mark_done(t.trajectory_id, "w1")
        led.mark_acked(t.trajectory_id)
    assert led.compacted_groups == 1 and led.filtered_groups == 2
    assert led.mark_filtered("p0") is None  # compacted: unknown, never credited again
    snap = led.snapshot()
    assert snap["filtered"] == {"groups": 2, "prompt_ids": ["p1"]}
    back = TrajectoryLedger.restored(snap, records.get, SAMPLING, keep_settled=1)
    assert back.filtered_groups == 2
    assert back.mark_filtered("p1") is False and back.mark_filtered("p2") is True
    assert back.filtered_groups == 3
    # A snapshot from before dynamic sampling has no "filtered": nothing credited.
    old = {k: v for k, v in snap.items() if k != "filtered"}
    assert TrajectoryLedger.restored(old, records.get, SAMPLING).filtered_groups == 0
    with pytest.raises(ValueError, match="filtered prompt 'zz'"):
        TrajectoryLedger.restored({**snap, "filtered": {"groups": 1, "prompt_ids": ["zz"]}},
                                  records.get, SAMPLING)


def test_a_job_seed_gives_each_trajectory_its_own_recorded_seed():
    from laminar_common.codec import trajectory_seed

    led = TrajectoryLedger()
    ids = led.add_group(PromptRecord("p0", "x", {}), 4, SamplingSpec(seed=11))
    seeds = [led.entries[t].task.sampling.seed for t in ids]
    assert seeds == [trajectory_seed(11, t) for t in ids] and len(set(seeds)) == 4
    unseeded = led.add_group(PromptRecord("p1", "x", {}), 2, SamplingSpec())
    assert {led.entries[t].task.sampling.seed for t in unseeded} == {None}
