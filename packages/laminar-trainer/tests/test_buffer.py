import msgspec
import pytest

from laminar_common.codec import Trajectory
from laminar_trainer.buffer import Added, ExperienceBuffer


def traj(prompt, i, version=0, n=2, reward=1.0):
    return Trajectory(trajectory_id=f"{prompt}#{i}", prompt_id=prompt, group_size=n,
                      sample_index=i, worker_id="w", policy_version=version,
                      prompt_token_ids=(1,), response_token_ids=(2, 3),
                      behaviour_logprobs=(-0.1, -0.2), reward=reward, finish_reason="stop")


def test_groups_complete_in_order_and_dedup():
    buf = ExperienceBuffer()
    assert buf.add(traj("a", 0)) is Added.YES
    assert buf.add(traj("a", 0)) is Added.DUPLICATE
    assert buf.ready_groups() == 0
    assert buf.add(traj("b", 0)) and buf.add(traj("b", 1))
    assert buf.add(traj("a", 1))
    groups = buf.take(5, trainer_version=0)
    assert [g.prompt_id for g in groups] == ["a", "b"]
    assert [t.sample_index for t in groups[0].trajectories()] == [0, 1]
    assert buf.stats.duplicates == 1
    # Consumed ids are refused forever after.
    assert buf.add(traj("a", 0)) is Added.CONSUMED
    assert buf.stats.already_consumed == 1
    assert len(buf) == 0


def test_take_hands_out_whole_groups_only():
    buf = ExperienceBuffer()
    buf.add(traj("a", 0))
    assert buf.take(1, 0) == []
    assert not buf.wait_ready(1, timeout_s=0.01)


def test_capacity_refuses_new_groups_but_lets_buffered_groups_complete():
    buf = ExperienceBuffer(capacity=1)
    assert buf.add(traj("a", 0))
    assert buf.add(traj("b", 0)) is Added.FULL
    assert buf.stats.dropped_full == 1
    # A member of a buffered group is taken even when full: partial groups alone
    # would otherwise hold the buffer for good.
    assert buf.add(traj("a", 1)) is Added.YES
    assert [g.prompt_id for g in buf.take(1, 0)] == ["a"]
    assert buf.add(traj("b", 0)) is Added.YES


def test_group_size_mismatch_is_refused():
    buf = ExperienceBuffer()
    assert buf.add(traj("a", 0, n=2))
    assert buf.add(traj("a", 1, n=3)) is Added.MISMATCH
    assert buf.stats.mismatched == 1 and len(buf) == 1


def test_failed_sample_completes_its_group_and_counts_as_consumed():
    buf = ExperienceBuffer()
    buf.add(traj("a", 0, n=3))
    buf.fail(traj("a", 1, n=3))
    assert buf.ready_groups() == 0
    buf.add(traj("a", 2, n=3))
    (g,) = buf.take(1, 0)
    assert [t.sample_index for t in g.trajectories()] == [0, 2]
    assert buf.add(traj("a", 1, n=3)) is Added.CONSUMED
    # A group whose every sample failed completes empty and is never handed out.
    buf.fail(traj("z", 0, n=1))
    assert buf.take(5, 0) == [] and "z#0" in buf.consumed


def test_stale_dropped_groups_wait_to_be_acked():
    buf = ExperienceBuffer(policy="staleness", max_staleness=0)
    buf.add(traj("old", 0, version=0, n=1))
    assert buf.take(1, trainer_version=3) == []
    assert buf.pop_dropped() == ["old#0"] and buf.pop_dropped() == []
    assert "old#0" in buf.consumed


def test_consumed_ids_stay_flat_below_the_watermark():
    from laminar_trainer.buffer import ConsumedIds

    buf = ExperienceBuffer()
    for seq in range(1000):
        t = msgspec.structs.replace(traj(f"p{seq}", 0, n=1), group_seq=seq,
                                    settled_below=max(0, seq - 10))
        assert buf.add(t)
        assert len(buf.take(1, 0)) == 1
    assert len(buf.consumed) <= 11, len(buf.consumed)
    assert buf.consumed.watermark == 989
    # Below the watermark: refused as consumed with no per-id record.
    old = msgspec.structs.replace(traj("p5", 0, n=1), group_seq=5)
    assert buf.add(old) is Added.CONSUMED
    # Above it: by id. Unnumbered groups (-1) are kept by id and never compacted.
    assert buf.add(msgspec.structs.replace(traj("p999", 0, n=1), group_seq=999)) \
        is Added.CONSUMED
    c = ConsumedIds(["x", "y"], [3, -1], watermark=2)
    c.advance(10)
    assert list(c) == ["y"] and c.covers("x", 3) and not c.covers("q", 12)


def test_staleness_drop_and_downweight_and_record():
    buf = ExperienceBuffer(policy="staleness", max_staleness=1)
    for p, v in (("old", 0), ("new", 2)):
        buf.add(traj(p, 0, version=v))
        buf.add(traj(p, 1, version=v))
    groups = buf.take(5, trainer_version=2)
    assert [g.prompt_id for g in groups] == ["new"]
    assert buf.stats.dropped_stale == 1
    assert buf.stats.staleness == {2: 2, 0: 2}
    down = ExperienceBuffer(policy="staleness", max_staleness=0, stale_action="downweight",
                            downweight=0.25)
    down.add(traj("x", 0, version=0, n=1))
    (g,) = down.take(1, trainer_version=3)
    assert g.weight == 0.25 and down.stats.downweighted == 1


def test_bad_policy_refused():
    with pytest.raises(ValueError, match="policy"):
        ExperienceBuffer(policy="lifo")


def _seq(t, seq):
    return msgspec.structs.replace(t, group_seq=seq)


def test_dynamic_sampling_drops_uniform_groups_and_counts_them():
    buf = ExperienceBuffer(dynamic_sampling=True)
    for i, r in enumerate((1.0, 1.0)):
        buf.add(_seq(traj("same", i, reward=r), 0))
    for i, r in enumerate((0.0, 1.0)):
        buf.add(_seq(traj("mixed", i, reward=r), 1))
    # Only the informative group is ready; the uniform one waits to be dropped.
    assert buf.ready_groups() == 1 and len(buf) == 4
    assert buf.pop_filtered() == [("same", 0)] and buf.pop_filtered() == []
    assert buf.stats.filtered == 1 and len(buf) == 2
    # Consumed only once handed out to be logged: a copy until then is a duplicate.
    assert "same#0" not in buf.consumed
    assert buf.add(traj("same", 0)) is Added.DUPLICATE and len(buf) == 2
    assert sorted(buf.pop_dropped()) == ["same#0", "same#1"]
    assert "same#0" in buf.consumed and buf.add(traj("same", 1)) is Added.CONSUMED
    (g,) = buf.take(5, trainer_version=0)
    assert g.prompt_id == "mixed" and buf.pop_dropped() == []
    # Filtered groups are not trained: no staleness is recorded for them.
    assert sum(buf.stats.staleness.values()) == 2


def test_dynamic_sampling_take_drops_uniform_groups_itself():
    buf = ExperienceBuffer(dynamic_sampling=True)
    buf.add(traj("u", 0, n=1))  # one member: no group-relative advantage
    buf.add(traj("m", 0, reward=0.0))
    buf.add(traj("m", 1, reward=0.5))
    assert [g.prompt_id for g in buf.take(5, 0)] == ["m"]
    assert buf.pop_dropped() == ["u#0"]
    assert buf.pop_filtered() == [("u", -1)] and buf.stats.filtered == 1


def test_dynamic_sampling_wait_ready_counts_only_informative_groups():
    buf = ExperienceBuffer(dynamic_sampling=True)
    for p in ("a", "b"):
        buf.add(traj(p, 0))
        buf.add(traj(p, 1))
    assert not buf.wait_ready(1, timeout_s=0.01)
    buf.add(traj("c", 0, reward=0.0))
    buf.add(traj("c", 1, reward=1.0))
    assert buf.wait_ready(1, timeout_s=0.01) and not buf.wait_ready(2, timeout_s=0.01)
    # Off, the same uniform groups are ordinary groups.
    plain = ExperienceBuffer()
    plain.add(traj("a", 0))
    plain.add(traj("a", 1))
    assert plain.wait_ready(1, timeout_s=0.01) and plain.pop_filtered() == []


def test_dynamic_sampling_group_with_a_failed_member():
    buf = ExperienceBuffer(dynamic_sampling=True)
    # Three samples, one given up on: the two left differ, so it trains without it.
    buf.add(traj("a", 0, n=3, reward=0.0))
    buf.fail(traj("a", 1, n=3))
    buf.add(traj("a", 2, n=3, reward=1.0))
    # Two given up on: one member left, nothing to compare it with.
    buf.add(_seq(traj("b", 0, n=3, reward=1.0), 7))
    buf.fail(_seq(traj("b", 1, n=3), 7))
    buf.fail(_seq(traj("b", 2, n=3), 7))
    # Every sample given up on: filtered too, with no ids to ack (failed ids are
    # settled by their final rejections).
    buf.fail(_seq(traj("z", 0, n=1), 8))
    assert buf.ready_groups() == 1
    (g,) = buf.take(5, 0)
    assert g.prompt_id == "a" and [t.sample_index for t in g.trajectories()] == [0, 2]
    assert buf.pop_filtered() == [("b", 7), ("z", 8)]
    assert buf.pop_dropped() == ["b#0"] and buf.stats.filtered == 2 and len(buf) == 0


def test_dynamic_sampling_keeps_a_group_whose_every_reward_failed():
    """Filtered, a group of failed rewards (all 0.0) would hide a broken reward until the
    prompts ran out; kept, the trainer's first-step check names the error."""
    buf = ExperienceBuffer(dynamic_sampling=True)
    for i in range(2):
        buf.add(_seq(msgspec.structs.replace(traj("broken", i, reward=0.0),
                                             reward_error="ValueError: no answer"), 0))
    for i in range(2):
        buf.add(_seq(traj("same", i, reward=0.0), 1))
    assert buf.ready_groups() == 1 and buf.pop_filtered() == [("same", 1)]
    (g,) = buf.take(5, trainer_version=0)
    assert g.prompt_id == "broken"
