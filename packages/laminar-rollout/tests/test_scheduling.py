from laminar_rollout.repack import KvLifecycle, WorkerLoad, kv_phase, plan_repack
from laminar_rollout.scheduling import (
    Admission,
    WorkerView,
    plan_barrier,
    plan_dispatch,
    required_version,
    water_fill,
)

UNBOUNDED = Admission(batch_groups=2, group_size=4, max_staleness=None)


def test_laminar_feeds_current_drains_stale_and_pulls_empty_stale():
    plan = plan_dispatch([
        WorkerView("fresh", 2, capacity=4, assigned=1),
        WorkerView("stale-busy", 1, capacity=4, assigned=2),
        WorkerView("stale-empty", 1, capacity=4, assigned=0),
        WorkerView("pulling", 1, capacity=4, assigned=0, pulling=2),
    ], latest=2, pending=100, created=100, admission=UNBOUNDED)
    assert plan.grants == {"fresh": 3}
    assert plan.pulls == {"stale-empty": 2}
    assert plan.new_groups == 0  # 100 pending already cover the 16 slots


def test_a_binding_bound_spreads_the_work_instead_of_filling_the_first_workers():
    workers = [WorkerView(f"w{i}", 3, capacity=8, assigned=a) for i, a in enumerate([0, 0, 5, 1])]
    # Bound 1 at version 3: (3 + 1 + 1) * 2 groups * 4 = 40 may exist; 30 do: 2 groups more.
    plan = plan_dispatch(workers, latest=3, pending=2, created=30,
                         admission=Admission(batch_groups=2, group_size=4, max_staleness=1))
    assert plan.new_groups == 2
    # 2 + 8 = 10 to give: the empty workers rise first, w2 (5 held) gets nothing.
    assert plan.grants == {"w0": 4, "w1": 4, "w3": 2}  # loads 4, 4, 5, 3
    assert sum(plan.grants.values()) == 10
    loads = {w.worker_id: w.assigned + plan.grants.get(w.worker_id, 0) for w in workers}
    assert max(loads[w] for w in ("w0", "w1", "w3")) - min(loads[w] for w in ("w0", "w1", "w3")) <= 1
    # At the bound nothing is created and only what is pending is granted.
    at_bound = plan_dispatch(workers, latest=3, pending=3, created=40,
                             admission=Admission(batch_groups=2, group_size=4, max_staleness=1))
    assert at_bound.new_groups == 0 and sum(at_bound.grants.values()) == 3
    assert at_bound.grants == {"w0": 2, "w1": 1}  # loads 2, 1, 5, 1: the empty ones first


def test_the_waiting_bound_counts_finished_work_only_so_a_long_tail_does_not_idle_slots():
    # Long tails hold 10 of 32 slots; 40 trajectories were created at version 1.
    workers = [WorkerView("tail", 1, capacity=16, assigned=10),
               WorkerView("free", 1, capacity=16, assigned=0)]
    # The run-ahead bound (1): (1 + 1 + 1) * 2 * 4 = 24 < 40 created: nothing new, the
    # free worker idles although the trainer waits for the tail.
    runahead = plan_dispatch(workers, latest=1, pending=0, created=40,
                             admission=Admission(2, 4, max_staleness=1))
    assert runahead.new_groups == 0 and runahead.grants == {}
    # The waiting bound (1 batch = 8 finished trajectories) with 3 waiting: fill the slots.
    waiting = Admission(2, 4, max_staleness=None, max_waiting=1)
    plan = plan_dispatch(workers, latest=1, pending=0, created=40, admission=waiting,
                         waiting=3)
    assert plan.new_groups == 8 and plan.grants == {"free": 16, "tail": 6}  # (pending: 10)
    # With a batch's worth finished and waiting, over-production stops.
    full = plan_dispatch(workers, latest=1, pending=0, created=40, admission=waiting,
                         waiting=8)
    assert full.new_groups == 0 and full.grants == {}
    # Both bounds: each can stop admission.
    both = Admission(2, 4, max_staleness=1, max_waiting=1)
    assert both.room(latest=1, created=40, waiting=0) == 0
    assert both.room(latest=5, created=40, waiting=8) == 0
    assert both.room(latest=5, created=40, waiting=7) == (5 + 2) * 8 - 40


def test_water_fill_never_exceeds_capacity_or_budget():
    workers = [WorkerView("a", 0, capacity=2, assigned=0), WorkerView("b", 0, capacity=10, assigned=3),
               WorkerView("c", 0, capacity=10, assigned=0)]
    assert water_fill(workers, 100) == {"a": 2, "b": 7, "c": 10}
    assert water_fill(workers, 5) == {"a": 2, "c": 3}  # a is full at 2; c rises to b's 3
    assert water_fill(workers, 0) == {}
    assert water_fill([], 5) == {}


def test_never_a_pull_for_a_worker_holding_trajectories():
    import itertools

    for assigned, pulling, version in itertools.product((0, 1, 5), (None, 3), (1, 2, 3)):
        w = WorkerView("w", version, capacity=8, assigned=assigned, pulling=pulling)
        plan = plan_dispatch([w], latest=3, pending=0, created=0, admission=UNBOUNDED)
        pulled = "w" in plan.pulls
        assert pulled == (assigned == 0 and pulling is None and version < 3), (w, plan)
        assert not plan.grants.get("w") or (version == 3 and pulling is None)


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
    # The latest version's group is repacked too (the default), unless left out.
    assert len(plan_repack(loads, latest=2)) == 1
    assert plan_repack(loads, latest=2, include_latest=False) == []


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


def test_the_kv_lifecycle_climbs_plateaus_then_falls():
    """A worker's KV trace after it is given a batch: it climbs while sequences are
    prefilled and grow, plateaus while they decode, then falls as they finish; a last
    straggler adds a token a step, which is not a climb. New work starts it again."""
    life = KvLifecycle()
    trace = [0, 300, 700, 950, 1000, 1010, 1015, 900, 600, 300, 120, 121, 122]
    phases = []
    for kv in trace:
        life.observe(kv)
        phases.append(life.phase)
    assert phases == ["climb", "climb", "climb", "climb", "climb", "plateau", "plateau",
                      "plateau", "fall", "fall", "fall", "fall", "fall"]
    assert life.falling
    life.refill()  # given new trajectories: no longer a source
    assert not life.falling
    life.observe(400)
    assert life.phase == "climb"
    assert kv_phase(0, 0, 0) == "climb"  # nothing observed yet


def test_repack_takes_falling_workers_as_sources_and_never_climbing_ones():
    """Sources come from the lifecycle: the worker in its fall is emptied into the
    fullest one that fits; a worker whose KV still climbs is left alone."""
    lives = {wid: KvLifecycle() for wid in ("falling", "climbing", "full")}
    for wid, trace in {"falling": [800, 500, 200], "climbing": [100, 150, 260],
                       "full": [600, 610, 615]}.items():
        for kv in trace:
            lives[wid].observe(kv)
    loads = [WorkerLoad(wid, 3, active=a, max_batch=8, kv_used=int(lives[wid].current),
                        kv_capacity=1000, falling=lives[wid].falling)
             for wid, a in (("falling", 1), ("climbing", 2), ("full", 5))]
    moves = plan_repack(loads, latest=3)
    assert [(m.source, m.destination) for m in moves] == [("falling", "full")]
