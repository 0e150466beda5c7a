import threading
import time

import pytest

from laminar_common.errors import ConfigError
from laminar_rollout.config import WorkerConfig
from laminar_rollout.rewards import RewardPool, load_reward_fn, score, synthetic_task


def _collect(pool, n, deadline_s=10.0):
    """Poll until ``n`` results came back (or the deadline passed)."""
    out = []
    deadline = time.monotonic() + deadline_s
    while len(out) < n and time.monotonic() < deadline:
        out.extend(pool.poll())
        time.sleep(0.001)
    return out


@pytest.fixture
def gate():
    """An event slow rewards wait on; set at teardown so no test thread outlives it long."""
    event = threading.Event()
    yield event
    event.set()


def test_default_reward_is_the_synthetic_builtin():
    config = WorkerConfig(engine={"type": "simulated"})
    assert config.reward == "synthetic"
    assert config.reward_workers >= 1 and config.reward_timeout_s > 0
    fn = load_reward_fn(config.reward)
    assert fn("sort 21=", "12", {"task": "sort", "answer": "12"}) == 1.0


def test_old_spec_still_loads_with_the_new_signature():
    fn = load_reward_fn("laminar_rollout.rewards:synthetic_task")
    assert fn is synthetic_task
    assert score(fn, "sort 321=", "123", {"task": "sort", "answer": "123"}) == (1.0, None)
    exact = load_reward_fn("laminar_rollout.rewards:exact_answer")
    assert exact("q", "so \\boxed{1/2}", {"answer": "0.5"}) == 1.0
    with pytest.raises(ConfigError, match="laminar_rollout.rewards:missing"):
        load_reward_fn("laminar_rollout.rewards:missing")


def test_the_synthetic_alias_without_laminar_examples_says_what_to_install(monkeypatch):
    """The demo's reward lives in laminar-examples, which this tier does not import: the
    alias resolves it through the loader, and says what to install when it is missing."""
    import sys

    for name in [m for m in sys.modules if m.split(".")[0] == "laminar_examples"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "laminar_examples", None)  # as if not installed
    for spec in ("synthetic", "laminar_rollout.rewards:synthetic_task"):
        with pytest.raises(ConfigError, match="pip install laminar-examples"):
            load_reward_fn(spec)


def test_results_come_back_once_per_key_with_their_own_reward():
    pool = RewardPool(lambda p, c, m: float(m["n"]) * 2, workers=3, timeout_s=5)
    try:
        for i in range(50):
            pool.submit(f"t{i}", "p", "c", {"n": i})
        assert pool.pending == 50
        results = _collect(pool, 50)
        assert sorted(results) == sorted((f"t{i}", 2.0 * i, None) for i in range(50))
        assert pool.pending == 0 and pool.poll() == []
    finally:
        pool.close()


def test_one_worker_scores_in_submission_order():
    pool = RewardPool(lambda p, c, m: 1.0, workers=1, timeout_s=5)
    try:
        for i in range(20):
            pool.submit(i, "p", "c", {})
        assert [k for k, _, _ in _collect(pool, 20)] == list(range(20))
    finally:
        pool.close()


def test_slow_reward_does_not_block_submit_or_poll(gate):
    started = threading.Event()

    def reward(prompt, completion, metadata):
        started.set()
        return float(gate.wait(10))

    pool = RewardPool(reward, workers=1, timeout_s=30)
    try:
        pool.submit(0, "p", "c", {})
        assert started.wait(5)
        for i in range(1, 10):
            pool.submit(i, "p", "c", {})
        # submit and poll returned while the one worker is parked inside a call
        assert pool.poll() == [] and not gate.is_set()
        assert pool.pending == 10
        gate.set()
        assert sorted(_collect(pool, 10)) == [(i, 1.0, None) for i in range(10)]
    finally:
        pool.close()


def test_exceptions_come_back_as_errors():
    def reward(prompt, completion, metadata):
        if completion == "bad":
            raise ValueError("cannot parse")
        return 1.0

    pool = RewardPool(reward, workers=2, timeout_s=5)
    try:
        pool.submit("a", "p", "bad", {})
        pool.submit("b", "p", "good", {})
        got = dict((k, (r, e)) for k, r, e in _collect(pool, 2))
        assert got == {"a": (0.0, "ValueError: cannot parse"), "b": (1.0, None)}
    finally:
        pool.close()


def test_timeout_is_an_error_and_the_key_comes_back_once(gate):
    def reward(prompt, completion, metadata):
        if completion == "hang":
            gate.wait(10)
            return 1.0  # late: must be ignored
        return 0.5

    pool = RewardPool(reward, workers=1, timeout_s=0.2)
    try:
        pool.submit("hung", "p", "hang", {})
        pool.submit("next", "p", "ok", {})
        results = _collect(pool, 2)
        assert ("hung", 0.0, "reward timed out after 0.2s") in results
        assert ("next", 0.5, None) in results  # a replacement thread took it
        assert pool.timeouts == 1 and pool.abandoned == 1
        gate.set()  # the hung call now finishes late; its result is dropped
        deadline = time.monotonic() + 10
        while pool.abandoned and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pool.abandoned == 0
        assert pool.poll() == [] and pool.pending == 0
        pool.submit("after", "p", "ok", {})
        assert _collect(pool, 1) == [("after", 0.5, None)]
    finally:
        pool.close()


def test_bounded_abandoned_threads_fail_queued_calls_fast(gate):
    pool = RewardPool(lambda p, c, m: float(gate.wait(10)), workers=1, timeout_s=0.05,
                      max_abandoned=1)
    try:
        for key in ("a", "b", "c"):
            pool.submit(key, "p", "c", {})
        results = dict((k, e) for k, _, e in _collect(pool, 3))
        assert results["a"] == results["b"] == "reward timed out after 0.05s"
        assert "exhausted" in results["c"]
        assert pool.abandoned == 2 and pool.pending == 0
    finally:
        pool.close()


def test_close_returns_with_a_call_running_and_drops_the_rest(gate):
    started = threading.Event()
    calls = []

    def reward(prompt, completion, metadata):
        calls.append(completion)
        started.set()
        gate.wait(10)
        return 1.0

    pool = RewardPool(reward, workers=1, timeout_s=30)
    for i in range(5):
        pool.submit(i, "p", str(i), {})
    assert started.wait(5)
    pool.close()  # returns although the call it runs waits on the gate
    assert not gate.is_set()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("late", "p", "c", {})
    gate.set()
    assert pool.poll() == []
    assert calls == ["0"]  # queued calls were dropped, not run


def test_bad_arguments():
    with pytest.raises(ValueError, match="workers"):
        RewardPool(lambda p, c, m: 1.0, workers=0, timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(lambda p, c, m: 1.0, workers=1, timeout_s=0)
