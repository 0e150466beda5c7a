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


def test_capacity_refuses_and_counts():
    buf = ExperienceBuffer(capacity=1)
    assert buf.add(traj("a", 0))
    assert not buf.add(traj("a", 1))
    assert buf.stats.dropped_full == 1


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
