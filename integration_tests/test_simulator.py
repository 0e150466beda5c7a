"""The discrete-event simulator of ``tools/`` (simlib): determinism, accounting, mode ordering.

Small clusters and short runs (seconds in all); the simulator drives the project's real
``plan_dispatch`` / ``plan_barrier`` / ``plan_repack`` and ``TrajectoryLedger``, so these
tests also exercise them together over thousands of trajectories.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from simlib import Cluster, SimConfig, TimeModel, Workload, simulate  # noqa: E402

from laminar_rollout.engines import LogNormalLengths  # noqa: E402

MODEL = TimeModel(max_batch=32, kv_capacity_tokens=60_000, weight_bytes=2e9,
                  train_tokens_per_gpu_s=2000.0, train_step_overhead_s=1.0)
WORKLOAD = Workload(lengths=LogNormalLengths(median=256, tail_ratio=10.0, max_length=2560),
                    prompt_tokens=64, group_size=8, batch_groups=16)
CLUSTER = Cluster(32, rollout_fraction=0.75, gpus_per_worker=2)


def _run(mode: str, **kw):
    kw.setdefault("measure_steps", 4)
    kw.setdefault("warmup_steps", 2)
    return simulate(CLUSTER, MODEL, WORKLOAD, SimConfig(mode, **kw))


def test_deterministic_for_a_seed():
    a = _run("laminar", seed=3)
    b = _run("laminar", seed=3)
    c = _run("laminar", seed=4)
    assert a.key() == b.key()
    assert a.key() != c.key()


@pytest.mark.parametrize("mode", ["sync", "one-step", "laminar"])
def test_every_trajectory_trained_exactly_once(mode):
    r = _run(mode, check_invariants=True, laminar_max_staleness=None)
    assert r.consumed_trajectories > 0
    assert r.duplicate_consumes == 0
    assert r.consumed_not_done == 0
    assert r.ledger_counts["acked"] == r.consumed_trajectories
    assert r.consumed_trajectories % WORKLOAD.batch_trajectories == 0


def test_throughput_order_on_long_tail():
    sync, one, lam = (_run(m) for m in ("sync", "one-step", "laminar"))
    assert sync.throughput_tok_s <= one.throughput_tok_s <= lam.throughput_tok_s
    assert lam.throughput_tok_s > 1.2 * sync.throughput_tok_s


def test_staleness_by_mode():
    assert _run("sync").staleness_max == 0
    one = _run("one-step")
    assert one.staleness_max == 1 and one.staleness_p50 == 1
    lam = _run("laminar", laminar_max_staleness=None)
    assert lam.staleness_max >= 1


def test_repack_reduces_idle_slots_on_stale_workers():
    kw = dict(laminar_max_staleness=None, measure_steps=6)
    on, off = _run("laminar", repack=True, **kw), _run("laminar", repack=False, **kw)
    assert on.repacks > 0 and on.migrated > 0 and on.repack_prefill_tokens > 0
    assert off.repacks == off.migrated == 0
    assert on.stale_drain_idle_frac < off.stale_drain_idle_frac
    assert on.slot_util > off.slot_util


def test_kv_transfer_carries_migrated_caches_instead_of_re_prefilling():
    kw = dict(laminar_max_staleness=None, measure_steps=6, check_invariants=True)
    prefill = _run("laminar", repack=True, **kw)
    carried = _run("laminar", repack=True, kv_transfer=True, **kw)
    assert prefill.kv_carried_tokens == prefill.kv_transfer_s == 0
    assert carried.migrated > 0 and carried.kv_carried_tokens > 0
    # Each carried cache takes its bytes over the link, and nothing partial is lost.
    assert carried.kv_transfer_s == pytest.approx(
        carried.kv_carried_tokens * MODEL.kv_bytes_per_token / MODEL.kv_transfer_bandwidth)
    assert carried.duplicate_consumes == carried.consumed_not_done == 0
    # Fewer tokens re-prefilled per migrated trajectory (only those whose destination
    # could not take them, and the ones with no tokens yet), so less destination stall.
    assert carried.repack_prefill_tokens / carried.migrated < \
        prefill.repack_prefill_tokens / prefill.migrated
    assert carried.repack_stall_s / carried.window_s < prefill.repack_stall_s / prefill.window_s


def test_staleness_bound_limits_laminar_staleness():
    free = _run("laminar", laminar_max_staleness=None, measure_steps=8)
    bounded = _run("laminar", laminar_max_staleness=1, measure_steps=8)
    assert bounded.staleness_p99 <= free.staleness_p99
    assert bounded.staleness_p50 <= 3


def test_the_waiting_bound_keeps_slots_busy_and_stops_the_backlog():
    kw = dict(measure_steps=8)
    free = _run("laminar", laminar_max_staleness=None, **kw)
    runahead = _run("laminar", laminar_max_staleness=1, **kw)
    waiting = _run("laminar", laminar_max_staleness=None, laminar_max_waiting=1, **kw)
    # (seed 0: free 5/9/9 staleness, slots 0.61; run-ahead 1: 1/3/3, 0.15; waiting 1:
    # 3/7/7, 0.31 and 2.5x the run-ahead bound's throughput)
    assert waiting.consumed_trajectories > 0 and waiting.duplicate_consumes == 0
    assert waiting.staleness_max <= free.staleness_max
    assert waiting.slot_util > runahead.slot_util
    assert waiting.throughput_tok_s > runahead.throughput_tok_s


def test_broadcast_is_pipelined():
    m = TimeModel(weight_bytes=64e9, relay_bandwidth=25e9, chunk_bytes=64e6)
    assert m.broadcast_s(0) == pytest.approx(64e9 / 25e9)
    assert m.broadcast_s(100) - m.broadcast_s(0) == pytest.approx(100 * 64e6 / 25e9)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="mode"):
        SimConfig("async")
    with pytest.raises(ValueError, match="rollout workers"):
        Cluster(4, rollout_fraction=0.75, gpus_per_worker=8)
    with pytest.raises(ValueError, match="decode_base_s"):
        TimeModel(decode_base_s=-1.0)


def test_decode_cost_grows_with_the_kv_cache():
    # steps_in and time_for invert each other, and a KV term makes the same work slower.
    from simlib import _Sim

    sim = _Sim(CLUSTER, MODEL, WORKLOAD, SimConfig("laminar"))
    w = sim.workers[0]
    w.n, w.kv_offset, w.s_ref = 20, 4000.0, 100.0
    for steps in (1.0, 37.5, 900.0):
        assert sim.time_for(w, sim.steps_in(w, sim.time_for(w, steps))) == \
            pytest.approx(sim.time_for(w, steps), rel=1e-9)
        assert sim.steps_in(w, sim.time_for(w, steps)) == pytest.approx(steps, rel=1e-9)
    no_kv = TimeModel(**{**MODEL.__dict__, "decode_per_kv_token_s": 0.0})
    slow, fast = _run("laminar", seed=1), simulate(CLUSTER, no_kv, WORKLOAD,
                                                   SimConfig("laminar", measure_steps=4,
                                                             warmup_steps=2, seed=1))
    assert slow.generation_tok_s < fast.generation_tok_s


def test_colocated_sync_trains_on_every_gpu_and_pays_the_switch():
    colo = Cluster(32, gpus_per_worker=2, colocated=True)
    assert colo.rollout_gpus == colo.trainer_gpus == 32 and colo.workers == 16
    r = simulate(colo, MODEL, WORKLOAD, SimConfig("sync", measure_steps=3, warmup_steps=1))
    assert r.duplicate_consumes == 0 and r.consumed_not_done == 0
    assert r.staleness_max == 0 and r.weight_wait_per_pull_s == 0.0
    cheap = TimeModel(**{**MODEL.__dict__, "colocate_switch_s": 0.0})
    r0 = simulate(colo, cheap, WORKLOAD, SimConfig("sync", measure_steps=3, warmup_steps=1))
    assert r.mean_step_s == pytest.approx(r0.mean_step_s + MODEL.colocate_switch_s, rel=1e-6)
    with pytest.raises(ValueError, match="colocated cluster runs sync mode only"):
        simulate(colo, MODEL, WORKLOAD, SimConfig("laminar"))


def test_nccl_one_step_syncs_every_engine_at_once_and_the_trainer_waits():
    r = _run("one-step", weight_sync="nccl")
    assert r.duplicate_consumes == 0 and r.consumed_not_done == 0
    assert r.staleness_max <= 1
    # Every worker got each version in the sync (none pulled from a relay): the wait per
    # "pull" is the sync's duration.
    assert r.weight_wait_per_pull_s == pytest.approx(MODEL.nccl_sync_s(CLUSTER.rollout_gpus))
    relay = _run("one-step")
    assert r.throughput_tok_s < relay.throughput_tok_s  # the trainer waits for idle engines
    assert MODEL.nccl_sync_s(1024) > MODEL.nccl_sync_s(64)
    with pytest.raises(ValueError, match="laminar mode publishes through the relays"):
        SimConfig("laminar", weight_sync="nccl")


def test_correlated_group_lengths_keep_the_marginal():
    import numpy as np

    lengths = LogNormalLengths(median=256, tail_ratio=10.0, max_length=100_000)
    for rho in (0.0, 0.8):
        wl = Workload(lengths=lengths, group_size=8, group_correlation=rho)
        rng = np.random.default_rng(0)
        groups = np.log(np.array([wl.group_lengths(rng) for _ in range(3000)], dtype=float))
        assert np.exp(np.median(groups)) == pytest.approx(256, rel=0.05)
        p99 = np.exp(np.percentile(groups, 99))
        assert p99 / 256 == pytest.approx(10.0, rel=0.15)
        within = np.corrcoef(groups[:, 0], groups[:, 1])[0, 1]
        assert within == pytest.approx(rho, abs=0.06)
    with pytest.raises(ValueError, match="group_correlation"):
        Workload(group_correlation=1.5)


def test_simulate_prints_the_paper_baselines_assumptions_and_sensitivity(tmp_path, capsys):
    import json

    import simulate

    out = tmp_path / "speedup.json"
    assert simulate.main([
        "--scales", "32,64", "--fractions", "0.5,0.75", "--gpus-per-worker", "2",
        "--batch-prompts", "16", "--group-size", "8", "--prompt-len", "64", "--median", "256",
        "--max-len", "2560", "--max-batch", "32", "--kv-tokens", "60000", "--weights-gb", "2",
        "--switch-s", "0.5", "--train-overhead", "0.2", "--steps", "2", "--laminar-steps", "3",
        "--sensitivity", "32", "--out", str(tmp_path / "speedup.png"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Calibration: colocated sync at 32 GPUs" in text
    assert "Assumptions (every number the result depends on, with its source):" in text
    for name in ("decode k (KV)", "group correlation", "colocated switch", "NCCL sync",
                 "trainer rate"):
        assert name in text
    data = json.loads(out.read_text())
    assert [r["gpus"] for r in data["ratios"]] == [32, 64]
    for r in data["ratios"]:
        assert r["laminar/sync"] > 0 and r["laminar/one-step"] > 0
        assert r["laminar split"] in (0.5, 0.75) and r["one-step split"] in (0.5, 0.75)
        assert len(r["sweep"]) == 4
    assert [(s["assumption"], s["value"]) for s in data["sensitivity"]] == [
        ("p99/median length", 5.0), ("p99/median length", 20.0),
        ("group correlation", 0.0), ("group correlation", 0.9),
        ("colocated switch s", 2.0), ("colocated switch s", 10.0),
        ("generation share", 0.7), ("generation share", 0.9)]
    # colocated sync: every GPU generates and trains
    syncs = [r for r in data["runs"] if r["mode"] == "sync"]
    assert all(r["split"] == "all" and r["trainer_gpus"] == r["gpus"] for r in syncs)
