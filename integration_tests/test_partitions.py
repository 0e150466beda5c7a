"""Issue 38: partitions on emulated hosts, where both sides stay alive.

One stack for the module (``tools/chaos.py``'s, with ``--hosts``): etcd, the manager,
the trainer, 2 relays and 3 workers, each on a host of its own (a network namespace,
links at 1 Gbit/s), lease TTL 3 s. SIMULATED: the engine and the training step (0.3 s);
everything else is real processes on real sockets. Each test cuts or slows links with
``iptables`` / ``tc`` (silently: packets are dropped, nothing is refused), heals them,
asserts what the job did meanwhile and measures its recovery; the last one stops the
stack and checks that every trajectory was trained exactly once. Recovery figures are
printed (``-s``) and written to ``partitions.json`` beside the stack's logs.

1. a worker host cut from everything for 2 x TTL;
2. a worker cut from the trainer only (it still reaches etcd and the manager) for
   6 x TTL: the manager has its work done elsewhere, the job does not wait on it;
3. a worker's link slowed to 1 Mbit/s for 4 x TTL: the others' steps go on;
4. the trainer's host cut from the relay hosts for 2 x TTL;
5. the master relay cut from the trainer only for 2 x TTL (it stays the master);
6. the etcd host cut from every tier for 2 x TTL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_until
from laminar_common.errors import LaminarError
from laminar_common.testing.hosts import unavailable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import chaos  # noqa: E402

WHY = unavailable()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=str(WHY)),
              pytest.mark.xdist_group("partitions"), pytest.mark.cost(120)]

TTL = 3
STEP_S = 0.3
MAX_STALENESS = 2  # the manager's default: admission stops this + 1 batches past the newest version
RECOVERY: dict[str, dict] = {}


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    root = tmp_path_factory.mktemp("partitions")
    args = argparse.Namespace(ttl_s=TTL, relays=2, workers=3, step_s=STEP_S, seed=38,
                              hosts=True, link_mbit=1000.0, extra={})
    stack = chaos.Stack(root, args)
    stack.closed = False
    try:
        stack.start()
        assert wait_until(lambda: len(_rows(stack)) >= 5, 90), "the trainer took no steps"
        yield stack
    finally:
        (root / "partitions.json").write_text(json.dumps(RECOVERY, indent=2))
        if not stack.closed:
            stack.shutdown()


def _rows(stack) -> list[dict]:
    return chaos.read_jsonl(stack.run_dir / "metrics.jsonl")


def _step_times(stack, t0: float, t1: float) -> list[float]:
    return sorted(r["time"] for r in _rows(stack) if t0 <= r["time"] <= t1)


def _max_gap(stack, t0: float, t1: float) -> float:
    ts = [t0, *_step_times(stack, t0, t1), t1]
    return max(b - a for a, b in zip(ts, ts[1:]))


def _members(stack) -> dict:
    try:
        return stack.watch.members()
    except LaminarError:
        return {}


def _all_registered(stack) -> bool:
    names = set(_members(stack))
    return set(stack.procs) <= names


def _healthy(stack) -> None:
    """Every tier registered and the trainer stepping (each test starts from this)."""
    assert wait_until(lambda: _all_registered(stack), 40), sorted(_members(stack))
    assert wait_until(lambda: _step_times(stack, time.time() - 2, time.time()), 40)
    assert all(p.alive() for p in stack.procs.values()), \
        {n: p.tail(5) for n, p in stack.procs.items() if not p.alive()}


def _cut_for(stack, host: str, peers, seconds: float) -> tuple[float, float, int]:
    """Cut ``host`` from ``peers`` (None: all) for ``seconds``; returns (cut at, healed at,
    the newest version visible once the cut took effect, as the observer reads it)."""
    t_cut = time.time()
    stack.hosts.cut(host, peers)
    try:
        latest = stack.watch.latest_version()
        time.sleep(max(0.0, seconds - (time.time() - t_cut)))
    finally:
        stack.hosts.heal(host)
    assert latest is not None
    return t_cut, time.time(), latest.version


def _trained_to_the_bound(stack, t_cut: float, t_heal: float, latest: int) -> int:
    """The trainer neither blocked nor broke the staleness bound while no version could
    become visible: the manager admits data for steps up to ``latest + 1 + max_staleness``
    and the trainer trained up to it (one short at most: the manager's view of the newest
    version may lag etcd's by one). Returns how many steps it trained meanwhile."""
    steps = [r["step"] for r in _rows(stack) if t_cut <= r["time"] <= t_heal]
    assert steps, "no step during the cut"
    assert latest + MAX_STALENESS <= max(steps) <= latest + 1 + MAX_STALENESS, \
        (latest, steps)
    return len(steps)


def _log(stack, name: str) -> str:
    return (stack.root / "logs" / f"{name}.log").read_text()


def _say(name: str, **figures) -> None:
    RECOVERY[name] = figures
    print(f"\n{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


def test_a_worker_host_cut_from_everything_rejoins_and_the_others_carry_on(net):
    _healthy(net)
    t_cut = time.time()
    chaos.link_fault(net, "worker-0", "cut", [])
    t_heal = time.time()
    gap = _max_gap(net, t_cut, t_heal)
    # Two workers were left: training went on through the cut.
    assert gap < 3.0, gap
    assert wait_until(lambda: "worker-0" in _members(net), 20), "worker-0 never registered again"
    back = time.time() - t_heal
    _say("worker host cut 2xTTL", longest_step_gap_s=round(gap, 2),
         registered_again_after_heal_s=round(back, 2))


def test_a_worker_cut_from_the_trainer_only_has_its_work_done_elsewhere(net):
    """It reaches etcd and the manager but not the trainer: what it finishes cannot be
    delivered. After worker_timeout_s (2 x TTL) of no link, on top of the heartbeat
    timeout (3 s), the manager has its work generated by the others and training goes on
    before the link heals; when it heals the worker sends its outbox again (refused by
    id at the trainer; checked by the exactly-once test at the end)."""
    _healthy(net)
    t_cut = time.time()
    chaos.link_fault(net, "worker-1", "cut-trainer", [], seconds=6 * TTL)
    t_heal = time.time()
    late = _step_times(net, t_heal - 4.0, t_heal)
    assert late, f"no step in the last 4 s of a {6 * TTL} s cut: the job waited on the worker"
    cut_steps = _step_times(net, t_cut, t_heal)
    gaps = [b - a for a, b in zip([t_cut, *cut_steps], cut_steps)]
    assert "no link to the trainer" in _log(net, "manager")
    assert wait_until(lambda: "link to the trainer is back" in _log(net, "worker-1"), 15)
    _say("worker cut from the trainer 6xTTL", longest_step_gap_s=round(max(gaps), 2),
         steps_in_last_4s_of_cut=len(late))


def test_a_slow_worker_link_does_not_slow_the_others_steps(net):
    _healthy(net)
    t_before = time.time()
    time.sleep(4 * TTL)
    t0 = time.time()
    chaos.link_fault(net, "worker-2", "slow", [], seconds=4 * TTL)
    t1 = time.time()
    before = len(_step_times(net, t_before, t0)) / (t0 - t_before)
    during = len(_step_times(net, t0, t1)) / (t1 - t0)
    _say("worker link at 1 Mbit/s 4xTTL", steps_per_s_before=round(before, 2),
         steps_per_s_during=round(during, 2), ratio=round(during / before, 2))
    assert during >= 0.75 * before, (during, before)


def test_the_trainer_cut_from_the_relays_trains_on_and_publishes_the_newest_version(net):
    """Nothing it publishes can reach a relay. The trainer does not block on the hung
    send: it trains every batch the manager still admits (the staleness bound stops
    admission max_staleness + 1 batches past the newest version the workers can load),
    and once the link heals the newest weights are published."""
    _healthy(net)
    relays = sorted(n for n in net.procs if n.startswith("relay"))
    t_cut, t_heal, latest = _cut_for(net, "trainer", relays, 2 * TTL)
    in_cut = _trained_to_the_bound(net, t_cut, t_heal, latest)
    at_heal = max(r["step"] for r in _rows(net) if r["time"] <= t_heal)
    assert net.procs["trainer"].alive()
    assert wait_until(lambda: (v := net.watch.latest_version()) is not None and v.version >= at_heal,
                 20), "the trainer's newest weights were not published after the link healed"
    published = time.time() - t_heal
    assert wait_until(lambda: _step_times(net, t_heal, time.time()), 20)
    stepped = min(_step_times(net, t_heal, time.time())) - t_heal
    _say("trainer cut from the relays 2xTTL", steps_during_cut=in_cut,
         newest_version_published_after_heal_s=round(published, 2),
         first_step_after_heal_s=round(stepped, 2))


def test_the_master_relay_cut_from_the_trainer_only_takes_its_weights_again_after_the_heal(
        net):
    """The master still reaches etcd and the other relays, so it stays the master; the
    trainer's publish fails on it and holds it suspect. Once the link heals the master
    answers its health call again and the newest weights go to it at once (before, the
    publisher waited failover_wait_s, 10 s, for a successor that never came)."""
    _healthy(net)
    master = net.master()
    t_cut = time.time()
    net.hosts.cut(master, ["trainer"])
    try:
        time.sleep(2 * TTL)
    finally:
        net.hosts.heal(master)
    t_heal = time.time()
    assert net.watch.leader("relay-master") == master
    at_heal = max(r["step"] for r in _rows(net) if r["time"] <= t_heal)
    assert wait_until(lambda: (v := net.watch.latest_version()) is not None and v.version >= at_heal,
                 6), "the newest weights did not reach the master within 6 s of the heal"
    published = time.time() - t_heal
    _say("master relay cut from the trainer 2xTTL",
         steps_during_cut=len(_step_times(net, t_cut, t_heal)),
         newest_version_published_after_heal_s=round(published, 2))


def test_the_etcd_host_cut_from_every_tier_costs_no_more_than_the_staleness_bound(net):
    """No tier reaches etcd: no version can become visible (that is etcd's job), so the
    trainer trains what the manager admitted, up to the staleness bound, and nothing
    fails. Every lease expires meanwhile; when the link heals every tier registers again
    and training resumes."""
    _healthy(net)
    t_cut, t_heal, latest = _cut_for(net, "etcd", None, 2 * TTL)
    in_cut = _trained_to_the_bound(net, t_cut, t_heal, latest)
    assert wait_until(lambda: _all_registered(net), 30), sorted(_members(net))
    registered = time.time() - t_heal
    assert wait_until(lambda: _step_times(net, t_heal, time.time()), 30)
    stepped = min(_step_times(net, t_heal, time.time())) - t_heal
    assert all(p.alive() for p in net.procs.values())
    _say("etcd host cut 2xTTL", steps_during_cut=in_cut,
         all_registered_after_heal_s=round(registered, 2),
         first_step_after_heal_s=round(stepped, 2))


def test_after_every_partition_each_trajectory_was_trained_exactly_once(net):
    codes = net.shutdown()
    net.closed = True
    result = chaos.check_exactly_once(net.run_dir, net.state_dir)
    RECOVERY["exactly_once"] = result
    assert result["holds"], result
    assert result["consumed"] > 200, result
    assert not {n: c for n, c in codes.items() if c not in (0, None)}, codes
    assert not net.incidents, net.incidents
