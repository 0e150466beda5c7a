"""TrajectoryConsumer over the inproc transport and the in-memory etcd twin.

The test plays the other tiers: a "worker" pushes trajectories to the consumer's
address, a "manager" registers a record whose ``extra["ack"]`` is an inproc PULL
receiver expecting exactly what the real manager's ack socket expects.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

import pytest

from laminar_common.codec import Ack, GroupsFiltered, Trajectory, TrajectoryRejected
from laminar_common.consume.consumer import (
    ConsumedIds,
    Invalid,
    TrajectoryConsumer,
    check_trajectory,
)
from laminar_common.launch.readiness import wait_ready
from laminar_common.membership import (
    InMemoryCoordinator,
    InMemoryEtcd,
    MemberRecord,
    VersionRecord,
)
from laminar_common.roles import Extra, Role
from laminar_common.transport import make_pull_receiver, make_push_sender

_names = itertools.count()


def traj(tid: str = "p0#0", seq: int = 0, settled: int = -1, **fields) -> Trajectory:
    prompt, index = tid.split("#")
    base = dict(trajectory_id=tid, prompt_id=prompt, group_size=2, sample_index=int(index),
                worker_id="w0", policy_version=0, prompt_token_ids=(1, 2),
                response_token_ids=(3, 4), behaviour_logprobs=(-0.1, -0.2), reward=1.0,
                finish_reason="stop", group_seq=seq, settled_below=settled)
    return Trajectory(**(base | fields))


class Manager:
    """A stand-in manager: a record in etcd and its ack socket."""

    def __init__(self, store: InMemoryEtcd, started_at: float) -> None:
        self.rx = make_pull_receiver(f"inproc://acks-{next(_names)}",
                                     expect=(Ack, TrajectoryRejected, GroupsFiltered))
        self.coord = InMemoryCoordinator(store, "job")
        self.coord.register(MemberRecord(member_id="manager", role=Role.MANAGER,
                                         started_at=started_at,
                                         extra={Extra.ACK: self.rx.endpoint}))

    def received(self, timeout_s: float = 0.5,
                 count: int | None = None) -> list[Ack | TrajectoryRejected]:
        """What arrived: until a 50 ms lull, or with ``count`` until that many arrived
        (within ``timeout_s`` each), so a loaded machine does not split the list."""
        out = []
        msg = self.rx.recv(timeout_s=timeout_s)
        while msg is not None:
            out.append(msg)
            wait = timeout_s if count is not None and len(out) < count else 0.05
            msg = self.rx.recv(timeout_s=wait)
        return out

    def acked(self, timeout_s: float = 0.5) -> list[str]:
        return [t for m in self.received(timeout_s) if isinstance(m, Ack) for t in m.trajectory_ids]

    def stop(self) -> None:
        self.coord.close()
        self.rx.close()


@pytest.fixture
def store():
    return InMemoryEtcd()


@pytest.fixture
def make_consumer(store):
    made = []

    def make(**kwargs) -> tuple[TrajectoryConsumer, object]:
        consumer = TrajectoryConsumer(InMemoryCoordinator(store, "job"),
                                      listen=f"inproc://trainer-{next(_names)}",
                                      owns_coordinator=True, **kwargs)
        made.append(consumer)
        return consumer, make_push_sender(consumer.endpoint)

    yield make
    for consumer in made:
        consumer.close(timeout_s=0)


def test_registers_a_ready_trainer_record_at_its_address(store, make_consumer):
    consumer, _ = make_consumer(extra={Extra.METRICS: "http://x/metrics"})
    [rec] = wait_ready(InMemoryCoordinator(store, "job"), Role.TRAINER, "trainer", timeout_s=1)
    assert rec.address == consumer.endpoint
    assert rec.extra[Extra.METRICS] == "http://x/metrics"
    consumer.close()
    assert InMemoryCoordinator(store, "job").members(Role.TRAINER) == {}


def test_a_wildcard_bind_advertises_the_given_address_and_host_id(store):
    """Over real ZeroMQ: bound on every interface, workers are told advertise_host."""
    with pytest.raises(ValueError, match="advertise_host"):
        TrajectoryConsumer(InMemoryCoordinator(store, "job"), listen="tcp://0.0.0.0:0")
    consumer = TrajectoryConsumer(InMemoryCoordinator(store, "job"), listen="tcp://0.0.0.0:0",
                                  advertise_host="127.0.0.1", host_id="host-7",
                                  owns_coordinator=True)
    try:
        [rec] = wait_ready(InMemoryCoordinator(store, "job"), Role.TRAINER, "trainer",
                           timeout_s=1)
        assert rec.address.startswith("tcp://127.0.0.1:") and rec.host_id == "host-7"
        sender = make_push_sender(rec.address)
        sender.send(traj("w0#0"))
        got = consumer.poll(timeout_s=5)
        assert got is not None and got.trajectory_id == "w0#0"
        sender.close()
    finally:
        consumer.close(timeout_s=0)


def test_each_id_is_returned_once_and_acks_reach_the_manager(store, make_consumer):
    manager = Manager(store, started_at=1.0)
    consumer, worker = make_consumer()
    for t in (traj("p0#0"), traj("p0#1"), traj("p0#0")):
        worker.send(t)
    got = [consumer.poll(timeout_s=1), consumer.poll(timeout_s=1), consumer.poll(timeout_s=0.2)]
    assert [t.trajectory_id for t in got[:2]] == ["p0#0", "p0#1"] and got[2] is None
    assert consumer.stats.duplicates == 1 and consumer.stats.reacked == 0
    assert sorted(consumer.pending) == ["p0#0", "p0#1"]
    assert manager.acked(timeout_s=0.1) == []  # nothing is acked for you

    consumer.ack(["p0#0", "p0#1"])
    assert sorted(manager.acked()) == ["p0#0", "p0#1"]
    assert consumer.pending == []
    # A copy of an acked id (a worker re-sending it) is acked again, not returned.
    worker.send(traj("p0#1"))
    assert consumer.poll(timeout_s=0.3) is None
    assert manager.acked() == ["p0#1"]
    assert consumer.stats.reacked == 1 and consumer.stats.delivered == 2


def test_acks_wait_for_a_manager_to_register(store, make_consumer):
    consumer, worker = make_consumer()
    worker.send(traj("p0#0"))
    consumer.ack([consumer.poll(timeout_s=1).trajectory_id])
    assert consumer.flush() is False
    manager = Manager(store, started_at=1.0)
    assert consumer.poll(timeout_s=0.3) is None  # a waiting poll sends what is queued
    assert manager.acked() == ["p0#0"]


def test_bad_contents_are_rejected_then_given_up_on(store, make_consumer):
    manager = Manager(store, started_at=1.0)
    consumer, worker = make_consumer(max_rejections=2)
    bad = traj("p0#0", behaviour_logprobs=(-0.1,))
    for _ in range(3):
        worker.send(bad)
    # Poll until all three copies were answered (a loaded machine may deliver the third
    # after one poll's wait).
    notes: list = []
    deadline = time.monotonic() + 10
    while len(notes) < 3 and time.monotonic() < deadline:
        assert consumer.poll(timeout_s=0.2) is None
        notes += manager.received(timeout_s=0.05)
    assert [(n.trajectory_id, n.final) for n in notes] == [("p0#0", False), ("p0#0", True),
                                                           ("p0#0", True)]
    assert all(isinstance(n, TrajectoryRejected) and n.reason.startswith("length-mismatch")
               for n in notes)
    # Given up on: even a good copy is answered with the rejection, never returned or acked.
    worker.send(traj("p0#0"))
    assert consumer.poll(timeout_s=0.3) is None
    [note] = manager.received()
    assert isinstance(note, TrajectoryRejected) and note.final
    # The third copy was already given up on: answered, not checked (or counted) again.
    assert consumer.stats.rejected["length-mismatch"] == 2 and consumer.stats.failed == 1
    assert consumer.stats.duplicates == 2 and consumer.stats.delivered == 0


def test_a_version_newer_than_published_is_rejected(store, make_consumer):
    publisher = InMemoryCoordinator(store, "job")
    publisher.publish_version(VersionRecord(version=2))
    manager = Manager(store, started_at=1.0)
    consumer, worker = make_consumer()
    worker.send(traj("p0#0", policy_version=5))
    worker.send(traj("p0#1", policy_version=2))
    assert consumer.poll(timeout_s=1).trajectory_id == "p0#1"
    assert consumer.latest_version == 2
    [note] = manager.received()
    assert note.trajectory_id == "p0#0" and note.reason.startswith("bad-version")
    assert not note.final


def test_caller_rejections(store, make_consumer):
    manager = Manager(store, started_at=1.0)
    consumer, worker = make_consumer()
    worker.send(traj("p0#0"))
    worker.send(traj("p0#1"))
    a, b = consumer.poll(timeout_s=1), consumer.poll(timeout_s=1)
    consumer.reject(a.trajectory_id, "too long for my model")
    consumer.reject(b.trajectory_id, "garbage", final=True)
    notes = manager.received()
    assert [(n.trajectory_id, n.final, n.reason) for n in notes] == [
        ("p0#0", False, "too long for my model"), ("p0#1", True, "garbage")]
    with pytest.raises(ValueError, match="not returned by poll"):
        consumer.reject("p0#0", "again")
    # Not final: the manager generates it again and the new copy is a new trajectory.
    worker.send(traj("p0#0"))
    worker.send(traj("p0#1"))
    assert consumer.poll(timeout_s=1).trajectory_id == "p0#0"
    assert consumer.poll(timeout_s=0.3) is None
    assert consumer.stats.caller_rejections == 2


def test_a_restarted_manager_gets_the_unsettled_acks_again(store, make_consumer):
    old = Manager(store, started_at=1.0)
    consumer, worker = make_consumer()
    for tid, seq in (("p0#0", 0), ("p0#1", 0), ("p1#0", 1)):
        worker.send(traj(tid, seq=seq))
    ids = [consumer.poll(timeout_s=1).trajectory_id for _ in range(3)]
    consumer.ack(ids)
    assert sorted(old.acked()) == sorted(ids)
    # The manager settled group 0; a trajectory says so, and the consumer forgets its ids.
    worker.send(traj("p2#0", seq=2, settled=1))
    assert consumer.poll(timeout_s=1).trajectory_id == "p2#0"
    old.stop()
    new = Manager(store, started_at=2.0)
    assert consumer.poll(timeout_s=0.3) is None
    # Group 1's ack may predate the new incarnation's restored ledger: sent again. Group 0
    # is settled (below the watermark); p2#0 is not acked yet.
    assert new.acked() == ["p1#0"]
    assert consumer.stats.manager_switches == 2
    # A copy of a settled group's trajectory is dropped (and acked again for its worker).
    worker.send(traj("p0#0", seq=0))
    assert consumer.poll(timeout_s=0.3) is None
    assert new.acked() == ["p0#0"]


def test_state_survives_a_restart(store, make_consumer):
    manager = Manager(store, started_at=1.0)
    first, worker = make_consumer()
    for tid in ("p0#0", "p0#1", "p1#0"):
        worker.send(traj(tid, seq=int(tid[1])))
    got = [first.poll(timeout_s=1).trajectory_id for _ in range(3)]
    # Checkpoint covers p0#0 and p0#1 (p1#0 is still in the caller's own buffer); the
    # process dies before acking.
    saved = first.state(untrained=["p1#0"])
    first.close(timeout_s=0)
    assert manager.acked(timeout_s=0.1) == []
    second, worker = make_consumer(state=saved)
    for tid in got:
        worker.send(traj(tid, seq=int(tid[1])))
    assert second.poll(timeout_s=1).trajectory_id == "p1#0"
    assert second.poll(timeout_s=0.3) is None
    # What the checkpoint covered is acked by the new incarnation, and never returned.
    assert sorted(set(manager.acked())) == ["p0#0", "p0#1"]
    with pytest.raises(ValueError, match="malformed"):
        make_consumer(state={"consumed": [["p0#0"]]})


def test_consumed_ids_compact_below_the_watermark():
    ids = ConsumedIds(["a", "b", "c"], [0, 1, -1])
    ids.advance(1)
    assert "a" not in ids and ids.covers("a", 0)  # settled group: covered without a record
    assert "b" in ids and "c" in ids and not ids.covers("d", 1)
    ids.discard("b")
    assert not ids.covers("b", 1)


def test_check_trajectory_reasons():
    assert check_trajectory(traj()) is None
    cases = {
        "bad-group": traj(sample_index=2), "empty-response": traj(response_token_ids=(),
                                                                   behaviour_logprobs=()),
        "token-out-of-range": traj(response_token_ids=(3, 99)),
        "non-finite-reward": traj(reward=float("nan")), "bad-logprob": traj(
            behaviour_logprobs=(0.5, -0.1)), "bad-version": traj(policy_version=-1),
    }
    for reason, bad in cases.items():
        assert check_trajectory(bad, vocab_size=50).reason == reason
    assert check_trajectory(traj(seq=0, settled=3)).reason == "bad-group"
    assert check_trajectory(traj(policy_version=4), trainer_version=3).reason == "bad-version"


def test_observation_spans_travel_and_are_checked():
    """Multi-turn: one behaviour log-prob per generated token; spans in order, disjoint,
    inside the response and after the model's first token."""
    from laminar_common import codec as wire

    ok = traj(response_token_ids=(3, 7, 8, 4, 9, 5), behaviour_logprobs=(-0.1, -0.2, -0.3),
              observation_spans=((1, 3), (4, 5)))
    assert ok.generated_tokens == 3 and check_trajectory(ok, vocab_size=50) is None
    back = wire.decode(wire.encode(ok))
    assert back.observation_spans == ((1, 3), (4, 5)) and back == ok
    bad = {
        "overlapping": ((1, 3), (2, 4)), "empty": ((1, 1),), "past the end": ((4, 7),),
        "out of order": ((4, 5), (1, 3)), "at the start": ((0, 2), (4, 5)),
    }
    for case, spans in bad.items():
        got = check_trajectory(traj(response_token_ids=(3, 7, 8, 4, 9, 5),
                                    behaviour_logprobs=(-0.1,) * 3, observation_spans=spans))
        assert got is not None and got.reason == "bad-observation-spans", case
        assert "observation span" in got.detail, case
    # Log-probs for every response token (the environment's too) is a length mismatch.
    wrong = traj(response_token_ids=(3, 7, 8, 4), behaviour_logprobs=(-0.1,) * 4,
                 observation_spans=((1, 3),))
    got = check_trajectory(wrong)
    assert got.reason == "length-mismatch" and "2 tokens generated (of 4" in got.detail


def test_the_data_source_travels_and_its_length_is_bounded():
    from laminar_common.consume.validation import MAX_DATA_SOURCE_CHARS, REASONS

    assert traj().data_source == ""
    assert check_trajectory(traj(data_source="x" * MAX_DATA_SOURCE_CHARS)) is None
    long = check_trajectory(traj(data_source="x" * (MAX_DATA_SOURCE_CHARS + 1)))
    assert long.reason == "bad-data-source" and long.reason in REASONS
    assert f"{MAX_DATA_SOURCE_CHARS + 1} characters" in long.detail and "p0#0" in long.detail


def test_the_sampling_temperature_travels_and_is_checked():
    from laminar_common.codec import SamplingSpec

    hot = traj(sampling=SamplingSpec(temperature=0.7))
    assert check_trajectory(hot) is None  # any positive temperature: trained at its own
    assert check_trajectory(hot, temperature=0.7) is None
    wrong = check_trajectory(hot, temperature=1.0)
    assert wrong.reason == "bad-sampling" and "0.7" in wrong.detail and "p0#0" in wrong.detail
    greedy = check_trajectory(traj(sampling=SamplingSpec(temperature=0.0)))
    assert greedy.reason == "bad-sampling"


def test_importing_the_consumer_does_not_import_torch():
    code = ("import sys, laminar_common.consume.consumer; "
            "sys.exit(any(m.split('.')[0] == 'torch' for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_held_final_rejections_wait_for_the_checkpoint_that_records_them(store, make_consumer):
    """hold_final_rejections (the built-in trainer with checkpoints): a final rejection
    goes out only with the first ack after a state() that records the id as failed, so
    a trainer restored from an older checkpoint never trains an id the manager was told
    it gave up on."""
    manager = Manager(store, started_at=1.0)
    failed = []
    consumer, worker = make_consumer(max_rejections=1, hold_final_rejections=True,
                                     on_failed=lambda t, why: failed.append((t.trajectory_id,
                                                                             why)))
    worker.send(traj("p0#0", reward=float("nan")))
    worker.send(traj("p0#1"))
    assert consumer.poll(timeout_s=1).trajectory_id == "p0#1"
    assert [t for t, _ in failed] == ["p0#0"] and "non-finite-reward" in failed[0][1]
    # A copy of the failed id is dropped and its notice stays held too.
    worker.send(traj("p0#0"))
    assert consumer.poll(timeout_s=0.3) is None
    assert manager.received(0.3) == [], "a final rejection left before any checkpoint"
    consumer.ack([])  # no state() yet: nothing is durable
    assert manager.received(0.3) == []
    state = consumer.state(trained=["p0#1"])
    assert state["failed"] == {"p0#0": failed[0][1]}
    worker.send(traj("p1#0", reward=float("inf")))  # failed after the state: stays held
    assert consumer.poll(timeout_s=0.5) is None
    consumer.ack(["p0#1"])
    got = manager.received(count=2)
    assert [(type(m).__name__, getattr(m, "trajectory_id", None)) for m in got] == [
        ("TrajectoryRejected", "p0#0"), ("Ack", None)], got
    assert got[0].final and got[1].trajectory_ids == ("p0#1",)
    consumer.state()
    consumer.ack([])
    [late] = manager.received(count=1)
    assert late.trajectory_id == "p1#0" and late.final


def test_state_with_trained_leaves_out_what_was_polled_but_not_trained(store, make_consumer):
    Manager(store, started_at=1.0)
    consumer, worker = make_consumer()
    for tid in ("p0#0", "p0#1", "p1#0"):
        worker.send(traj(tid))
    ids = [consumer.poll(timeout_s=1).trajectory_id for _ in range(3)]
    consumer.ack(["p0#0"])
    state = consumer.state(trained=["p0#1"])
    # Acked, and pending but trained, are recorded; pending untrained (p1#0) is not.
    assert sorted(t for t, _ in state["consumed"]) == ["p0#0", "p0#1"], ids


def test_refuse_counts_against_max_rejections_and_release_forgets_quietly(store, make_consumer):
    manager = Manager(store, started_at=1.0)
    failed = []
    consumer, worker = make_consumer(max_rejections=2,
                                     on_failed=lambda t, why: failed.append(t.trajectory_id))
    wrong = Invalid("group-mismatch", "group_size differs")
    for copy in (1, 2):
        worker.send(traj("p0#0"))
        t = consumer.poll(timeout_s=1)
        consumer.refuse(t, wrong)
        [note] = manager.received(count=1)
        assert note.trajectory_id == "p0#0" and note.final == (copy == 2)
    assert failed == ["p0#0"] and consumer.stats.rejected["group-mismatch"] == 2
    with pytest.raises(ValueError, match="not returned by poll"):
        consumer.refuse(t, wrong)
    # release: nothing is sent, and the next copy is returned again.
    worker.send(traj("p1#0"))
    consumer.release(consumer.poll(timeout_s=1).trajectory_id)
    assert manager.received(0.3) == [] and consumer.pending == []
    worker.send(traj("p1#0"))
    assert consumer.poll(timeout_s=1).trajectory_id == "p1#0"
    assert consumer.stats.released == 1


def test_filtered_groups_go_before_acks_and_again_to_a_new_manager(store, make_consumer):
    old = Manager(store, started_at=1.0)
    consumer, worker = make_consumer()
    for tid, seq in (("p0#0", 0), ("p0#1", 0), ("p1#0", 1), ("p1#1", 1)):
        worker.send(traj(tid, seq=seq))
    ids = [consumer.poll(timeout_s=1).trajectory_id for _ in range(4)]
    consumer.version = 7
    consumer.groups_filtered([("p0", 0), ("p1", 1)])
    consumer.ack(ids)
    got = old.received(count=2)
    assert isinstance(got[0], GroupsFiltered) and got[0].prompt_ids == ("p0", "p1")
    assert isinstance(got[1], Ack) and got[1].trainer_version == 7
    assert consumer.stats.groups_filtered == 2
    # Group 0 settles; a new manager incarnation hears of group 1 only, acks after.
    worker.send(traj("p2#0", seq=2, settled=1))
    consumer.poll(timeout_s=1)
    old.stop()
    new = Manager(store, started_at=2.0)
    assert consumer.poll(timeout_s=0.3) is None
    got = new.received(count=2)
    assert isinstance(got[0], GroupsFiltered) and got[0].prompt_ids == ("p1",), got
    assert sorted(got[1].trajectory_ids) == ["p1#0", "p1#1"]


def test_settling_from_another_thread_while_one_polls(store, make_consumer):
    """The built-in trainer polls on a receive thread and acks, checkpoints and files
    filtered groups from its training thread: every id is returned once, every ack
    arrives, nothing raises."""
    import threading

    manager = Manager(store, started_at=1.0)
    consumer, worker = make_consumer()
    n = 400
    got: list[str] = []
    done = threading.Event()

    def poller():
        while len(got) < n and not done.is_set():
            t = consumer.poll(timeout_s=0.05)
            if t is not None:
                got.append(t.trajectory_id)

    thread = threading.Thread(target=poller)
    thread.start()
    for i in range(n):
        worker.send(traj(f"p{i}#0", seq=i))
        if i % 2:
            worker.send(traj(f"p{i}#0", seq=i))  # a copy
    acked: list[str] = []
    deadline = time.monotonic() + 20
    while len(acked) < n and time.monotonic() < deadline:
        batch = got[len(acked):]
        consumer.state(trained=batch)
        consumer.ack(batch)
        acked += batch
        time.sleep(0.005)
    done.set()
    thread.join(5)
    assert sorted(got) == sorted(f"p{i}#0" for i in range(n)), "an id twice or missing"
    sent = [t for m in manager.received(count=1, timeout_s=2) if isinstance(m, Ack)
            for t in m.trajectory_ids]
    assert set(sent) == set(acked) and len(acked) == n
