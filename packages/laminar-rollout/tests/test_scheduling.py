from laminar_rollout.repack import WorkerLoad, plan_repack
from laminar_rollout.scheduling import WorkerView, plan_barrier, plan_laminar, required_version


def test_laminar_feeds_current_drains_stale_and_pulls_empty_stale():
    plan = plan_laminar([
        WorkerView("fresh", 2, capacity=4, assigned=1),
        WorkerView("stale-busy", 1, capacity=4, assigned=2),
        WorkerView("stale-empty", 1, capacity=4, assigned=0),
        WorkerView("pulling", 1, capacity=4, assigned=0, pulling=2),
    ], latest=2)
    assert plan.grants == {"fresh": 3}
    assert plan.pulls == {"stale-empty": 2}


def test_required_versions():
    assert [required_version("sync", b) for b in range(3)] == [0, 1, 2]
    assert [required_version("one-step", b) for b in range(3)] == [0, 0, 1]


def test_barrier_waits_for_weights():
    workers = [WorkerView("a", 0, 4, 0), WorkerView("b", 1, 4, 0)]
    plan = plan_barrier(workers, required=1, latest=1)
    assert plan.grants == {"b": 4} and plan.pulls == {"a": 1}
    plan = plan_barrier(workers, required=2, latest=1)
    assert plan.grants == {} and plan.pulls == {}


def test_repack_best_fit_smallest_source_first():
    loads = [
        WorkerLoad("s1", 1, active=1, max_batch=8, kv_used=10, kv_capacity=100),
        WorkerLoad("s2", 1, active=2, max_batch=8, kv_used=20, kv_capacity=100),
        WorkerLoad("big", 1, active=5, max_batch=8, kv_used=50, kv_capacity=100),
        WorkerLoad("new", 2, active=1, max_batch=8, kv_used=5, kv_capacity=100),
    ]
    moves = plan_repack(loads, latest=2)
    assert [(m.source, m.destination, m.trajectories) for m in moves] == [
        ("s1", "big", 1), ("s2", "big", 2)]


def test_repack_respects_batch_and_kv_limits_and_latest_group():
    loads = [
        WorkerLoad("a", 1, active=3, max_batch=4, kv_used=10, kv_capacity=100),
        WorkerLoad("b", 1, active=3, max_batch=4, kv_used=10, kv_capacity=100),
    ]
    assert plan_repack(loads, latest=2) == []
    loads = [
        WorkerLoad("a", 1, active=1, max_batch=8, kv_used=60, kv_capacity=100),
        WorkerLoad("b", 1, active=2, max_batch=8, kv_used=60, kv_capacity=100),
    ]
    assert plan_repack(loads, latest=2) == []
    loads = [
        WorkerLoad("a", 2, active=1, max_batch=8, kv_used=1, kv_capacity=100),
        WorkerLoad("b", 2, active=2, max_batch=8, kv_used=1, kv_capacity=100),
    ]
    assert plan_repack(loads, latest=2) == []
    assert len(plan_repack(loads, latest=2, include_latest=True)) == 1


def test_repack_skips_rising_or_busy_queue_sources():
    loads = [
        WorkerLoad("a", 1, active=1, max_batch=8, kv_used=1, kv_capacity=0, falling=False),
        WorkerLoad("b", 1, active=1, max_batch=8, kv_used=1, kv_capacity=0, queue_empty=False),
        WorkerLoad("c", 1, active=3, max_batch=8, kv_used=1, kv_capacity=0, falling=False),
    ]
    assert plan_repack(loads, latest=2) == []


def test_repack_min_sources():
    loads = [
        WorkerLoad("a", 1, active=1, max_batch=8, kv_used=1, kv_capacity=0),
        WorkerLoad("b", 1, active=3, max_batch=8, kv_used=1, kv_capacity=0, falling=False),
    ]
    assert len(plan_repack(loads, latest=2)) == 1
    assert plan_repack(loads, latest=2, min_sources=2) == []


def test_barrier_spreads_the_batch_over_workers():
    workers = [WorkerView(f"w{i}", 1, capacity=256, assigned=0) for i in range(4)]
    plan = plan_barrier(workers, required=1, latest=1, share=3)
    assert plan.grants == {"w0": 3, "w1": 3, "w2": 3, "w3": 3}
    # What a worker already holds counts toward its share.
    workers[0] = WorkerView("w0", 1, capacity=256, assigned=2)
    workers[3] = WorkerView("w3", 0, capacity=256, assigned=0)
    plan = plan_barrier(workers, required=1, latest=1, share=3)
    assert plan.grants == {"w0": 1, "w1": 3, "w2": 3} and plan.pulls == {"w3": 1}
