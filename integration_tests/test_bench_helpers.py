"""The pure parts of tools/bench_vs_trl.py and tools/bench_layout.py: time to an accuracy,
the reuse of a first run's set-up, the layouts tried around the auto rule."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_layout import candidates  # noqa: E402
from bench_vs_trl import accuracy_at, read_job_settings, reuse_setup, time_to  # noqa: E402

from laminar_common.launch.layout import choose_layout  # noqa: E402


def test_time_to_an_accuracy_counts_the_first_point_that_reaches_it():
    run = {"eval_before": 0.3, "window_s": 30.0, "eval_after": 0.7,
           "evals": [{"t": 9.0, "accuracy": 0.72}, {"t": 19.0, "accuracy": 0.6}]}
    assert time_to(run, 0.7) == 9.0     # reached mid-run, even if it fell back after
    assert time_to(run, 0.3) == 0.0     # the warm start already had it
    assert time_to(run, 0.71) == 9.0
    assert time_to(run, 0.8) is None    # never
    assert time_to({**run, "evals": []}, 0.7) == 30.0  # only the final weights


def test_a_run_that_went_on_past_the_window_counts_its_later_evals():
    # --laminar-steps: 30 steps in the window, the run went on to 60; the step-30 eval
    # is the window's "after", the step-60 weights the run's final.
    run = {"eval_before": 0.1, "steps": 30, "window_s": 30.0, "eval_after": 0.5,
           "steps_run": 60, "window_all_s": 61.0, "eval_final": 0.65,
           "evals": [{"step": 10, "t": 10.0, "accuracy": 0.4},
                     {"step": 30, "t": 30.0, "accuracy": 0.5},
                     {"step": 40, "t": 41.0, "accuracy": 0.72},
                     {"step": 50, "t": 51.0, "accuracy": 0.6}]}
    assert time_to(run, 0.7) == 41.0   # after the window, before the run's end
    assert time_to(run, 0.64) == 41.0
    assert time_to(run, 0.73) is None
    assert time_to({**run, "evals": run["evals"][:2]}, 0.6) == 61.0  # the final weights
    assert accuracy_at(run, 35.0) == 0.5     # the last eval by then
    assert accuracy_at(run, 55.0) == 0.6
    assert accuracy_at(run, 5.0) == 0.1      # before training


def test_later_runs_reuse_the_set_up_but_not_the_tiers_state(tmp_path):
    job = ROOT / "examples" / "demo.yaml"
    first = read_job_settings(str(job), [f"run_dir={tmp_path / 'a'}"])
    later = read_job_settings(str(job), [f"run_dir={tmp_path / 'b'}"])
    a = Path(first.run_dir)
    for rel in ("model/config.json", "train.jsonl", "eval.jsonl", "logs/up.log",
                "trainer/metrics.jsonl", "checkpoints/step-5/x", "manager/state.json"):
        (a / rel).parent.mkdir(parents=True, exist_ok=True)
        (a / rel).write_text(rel)
    reuse_setup(a.resolve(), Path(later.run_dir).resolve(), later)
    b = Path(later.run_dir)
    assert (b / "model" / "config.json").read_text() == "model/config.json"
    assert (b / "train.jsonl").exists() and (b / "eval.jsonl").exists()
    for gone in ("logs", "trainer", "checkpoints", "manager"):
        assert not (b / gone).exists(), gone


def test_the_layouts_tried_include_the_auto_pick_and_its_neighbours():
    for cores in (1, 2, 8):
        auto = choose_layout(cores)
        tried = candidates(cores)
        assert tried[0] == (auto.trainer_threads, auto.workers, auto.worker_threads)
        assert len(tried) == len(set(tried)) >= 3
        assert (auto.trainer_threads, auto.workers + 1, auto.worker_threads) in tried
