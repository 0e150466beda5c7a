"""SimulatedEngine: length distribution, cost model on a manual clock, and the engine contract."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from laminar_rollout.engines import (
    EngineError,
    GenerationRequest,
    LogNormalLengths,
    ManualClock,
    SamplingParams,
    SimulatedEngine,
)


@dataclass
class FixedLengths:
    length: int

    def sample(self, rng: np.random.Generator) -> int:
        return self.length


def _req(rid: str, prompt_len: int = 4, **params) -> GenerationRequest:
    return GenerationRequest(
        rid, [1] * prompt_len, SamplingParams(**{"max_tokens": 10**6, **params})
    )


def test_lognormal_lengths_have_the_configured_tail_ratio():
    dist = LogNormalLengths(median=200, tail_ratio=10.0, max_length=None)
    rng = np.random.default_rng(0)
    lengths = np.array([dist.sample(rng) for _ in range(40_000)])
    median, p99 = np.percentile(lengths, [50, 99])
    assert median == pytest.approx(200, rel=0.05)
    assert p99 / median == pytest.approx(10.0, rel=0.12)
    capped = LogNormalLengths(median=200, max_length=500)
    assert max(capped.sample(rng) for _ in range(2000)) == 500


def test_engine_response_lengths_are_long_tailed():
    engine = SimulatedEngine(
        max_batch=512, lengths=LogNormalLengths(median=30, max_length=None), clock=ManualClock()
    )
    outs = engine.run_until_done([_req(f"r{i}") for i in range(3000)])
    lengths = np.array([len(o.token_ids) for o in outs])
    median, p99 = np.percentile(lengths, [50, 99])
    assert p99 / median == pytest.approx(10.0, rel=0.2)
    assert all(o.finish_reason == "stop" and o.token_ids[-1] == 0 for o in outs)


def test_step_time_model_is_honoured_on_the_injected_clock():
    clock = ManualClock(start=100.0)
    engine = SimulatedEngine(
        max_batch=3,
        lengths=FixedLengths(4),
        step_time_base=0.01,
        step_time_per_seq=0.002,
        prefill_time_per_token=0.001,
        clock=clock,
    )
    for i in range(4):
        engine.add_request(_req(f"r{i}", prompt_len=5))
    expected = 100.0
    per_step = []
    while engine.has_unfinished():
        before = engine.load()
        queued_admitted = min(before.queued, before.max_batch - before.active)
        engine.step()
        active = before.active + queued_admitted
        expected += 0.01 + 0.002 * active + 0.001 * 5 * queued_admitted
        per_step.append(active)
        assert clock.now() == pytest.approx(expected)
    # 3 run 4 steps; the 4th joins when they finish and runs 4 more
    assert per_step == [3, 3, 3, 3, 1, 1, 1, 1]
    assert engine.busy_seconds == pytest.approx(expected - 100.0)
    assert engine.steps_run == 8
    assert engine.step() == [] and clock.now() == pytest.approx(expected)  # idle: no time passes


def test_outputs_are_labelled_and_shaped():
    engine = SimulatedEngine(
        max_batch=4,
        vocab_size=50,
        eos_token_id=7,
        clock=ManualClock(),
        lengths=LogNormalLengths(median=12),
    )
    outs = engine.run_until_done([_req(f"r{i}", max_tokens=20) for i in range(16)])
    assert len(outs) == 16
    for out in outs:
        assert out.simulated is True and out.policy_version == 0
        assert len(out.token_ids) == len(out.logprobs) <= 20
        assert all(0 <= t < 50 for t in out.token_ids)
        assert all(lp <= 0 for lp in out.logprobs)
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == 7 and 7 not in out.token_ids[:-1]
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 20
    assert {o.finish_reason for o in outs} == {"stop", "length"}


def test_trajectories_are_deterministic_in_the_seed():
    def run(seed: int) -> list[list[int]]:
        engine = SimulatedEngine(seed=seed, clock=ManualClock(), lengths=LogNormalLengths(median=8))
        return [o.token_ids for o in engine.run_until_done([_req(f"r{i}") for i in range(8)])]

    assert run(1) == run(1)
    assert run(1) != run(2)
    stopped = SimulatedEngine(clock=ManualClock(), lengths=FixedLengths(5)).run_until_done(
        [_req("s", stop_token_ids=[3])]
    )[0]
    assert stopped.token_ids[-1] == 3 and len(stopped.token_ids) == 5


def test_export_resume_continues_the_same_trajectory():
    lengths = LogNormalLengths(median=40)
    whole = SimulatedEngine(clock=ManualClock(), lengths=lengths, seed=5).run_until_done(
        [_req("m")]
    )[0]
    assert len(whole.token_ids) > 6
    source = SimulatedEngine(clock=ManualClock(), lengths=lengths, seed=5)
    source.add_request(_req("m"))
    for _ in range(6):
        source.step()
    (moved,) = source.export(["m"])
    assert moved.policy_version == 0 and moved.resume_token_ids == whole.token_ids[:6]
    assert not source.has_unfinished()
    dest = SimulatedEngine(clock=ManualClock(), lengths=lengths, seed=5)
    out = dest.run_until_done([moved])[0]
    assert out.token_ids == whole.token_ids and out.logprobs == whole.logprobs
    assert out.num_resumed == 6
    with pytest.raises(EngineError, match="policy v0 but this engine holds v3"):
        SimulatedEngine(weight_version=3).add_request(moved)


def test_weight_versions_are_stamped_and_guarded():
    engine = SimulatedEngine(clock=ManualClock(), lengths=FixedLengths(3))
    engine.add_request(_req("a"))
    with pytest.raises(EngineError, match="while 0 requests are active and 1 queued"):
        engine.load_weights(1, None)
    assert engine.run_until_done([])[0].policy_version == 0
    engine.load_weights(1, None)
    assert engine.run_until_done([_req("b")])[0].policy_version == 1
    with pytest.raises(EngineError, match="regression"):
        engine.load_weights(1, None)
    engine.load_weights(2, iter([("w", object())]))
    assert engine.weight_version == 2


def test_kv_capacity_limits_admission_and_preempts():
    engine = SimulatedEngine(
        max_batch=8,
        kv_capacity_tokens=60,
        lengths=FixedLengths(20),
        clock=ManualClock(),
        prefill_time_per_token=0.0,
    )
    for i in range(6):
        engine.add_request(_req(f"r{i}", prompt_len=10))
    done = []
    while engine.has_unfinished():
        done.extend(engine.step())
        load = engine.load()
        assert load.kv_used_tokens <= 60 and load.active <= 8
    assert sorted(o.request_id for o in done) == [f"r{i}" for i in range(6)]
    assert all(len(o.token_ids) == 20 for o in done)
    assert engine.preemptions > 0
    with pytest.raises(EngineError, match="can never fit the KV capacity of 60"):
        engine.add_request(_req("huge", prompt_len=60))


def test_overlong_prompt_and_unknown_export_are_refused():
    engine = SimulatedEngine(context_length=16, clock=ManualClock())
    with pytest.raises(EngineError, match="'p'.*16 tokens.*context_length 16"):
        engine.add_request(_req("p", prompt_len=16))
    engine.add_request(_req("q"))
    with pytest.raises(EngineError, match="'zz'"):
        engine.abort(["q", "zz"])
    assert [o.finish_reason for o in engine.abort(["q"])] == ["aborted"]
    assert engine.abort() == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"step_time_base": -1.0}, "step_time_base"),
        ({"eos_token_id": 10, "vocab_size": 10}, "eos_token_id"),
        ({"max_batch": 0}, "max_batch"),
        ({"weight_version": -1}, "weight_version"),
    ],
)
def test_constructor_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SimulatedEngine(**kwargs)
