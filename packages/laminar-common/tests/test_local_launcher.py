"""`laminar up`'s local launcher with stand-in tiers: configs checked first, early exits
reported with their log's tail, one launch's report per launch.

The tiers are a small script (``FAKE_TIER``) with a check flag like the real tiers'
``--print-config``; no tier reads etcd here (no ``ready``), so the job names an
endpoint nothing listens on and no etcd runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from laminar_common.errors import ConfigError, LaminarError
from laminar_common.launch.jobfile import load_job
from laminar_common.launch.local import LocalLauncher
from laminar_common.launch.rundir import RunDir

FAKE_TIER = r'''
import json, pathlib, signal, sys, time
import yaml
args = sys.argv[1:]
config = yaml.safe_load(open(args[args.index("--config") + 1]))
if "--check" in args:
    if "typo" in config:
        sys.exit("fake: invalid FakeConfig:\n  typo: unknown field")
    if config.get("needs") and not pathlib.Path(config["needs"]).exists():
        sys.exit(f"fake: needs: {config['needs']!r} does not exist")
    sys.exit(0)
for i in range(config.get("lines", 0)):
    print(f"{config['member_id']} line {i}", flush=True)
if config.get("metrics"):
    with open(config["metrics"], "a") as fh:
        fh.write(json.dumps({"step": 1, "version": 1, "time": time.time(), "reward_mean": 0.5,
                             "tokens_per_s": 1.0, "step_s": 0.1, "wait_s": 0.1}) + "\n")
if config.get("busy_s"):
    end = time.process_time() + config["busy_s"]
    while time.process_time() < end:
        pass
if config.get("exit") is not None:
    time.sleep(config.get("after_s", 0))
    sys.exit(config["exit"])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
'''


def _tier(tmp_path: Path, **config) -> dict:
    script = tmp_path / "fake_tier.py"
    script.write_text(FAKE_TIER)
    return {"command": [sys.executable, str(script)], "check": ["--check"],
            "id_field": "member_id", "config": config}


def _launcher(tmp_path: Path, tiers: dict, setup=(), report=None) -> LocalLauncher:
    job = {"job": "j", "run_dir": str(tmp_path / "run"),
           "etcd": {"embedded": False, "endpoints": ["127.0.0.1:9"]},
           "setup": [list(s) for s in setup], "tiers": tiers, "wait_for": "trainer",
           "timeout_s": 120, "report": report}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return LocalLauncher(load_job(path), job_file=str(path))


def _gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


def test_a_typo_in_a_tier_config_stops_the_launch_before_set_up(tmp_path, capsys):
    marker = tmp_path / "run" / "set-up-ran"
    launcher = _launcher(tmp_path, {
        "relay": _tier(tmp_path),
        "trainer": _tier(tmp_path, typo=1)},
        setup=[[sys.executable, "-c", "import sys; open(sys.argv[1], 'w')", str(marker)]])
    with pytest.raises(ConfigError) as err:
        launcher.run()
    text = str(err.value)
    assert text.startswith("1 tier config check(s) failed (nothing was started):")
    config = tmp_path / "run" / "configs" / "trainer.yaml"
    assert f"tier trainer (trainer): config {config} (tiers.trainer.config in " in text
    assert "    typo: unknown field" in text and "relay" not in text
    assert launcher.tier_children == [] and not marker.exists()
    assert not (tmp_path / "run" / "launch.json").exists()
    assert "started " not in capsys.readouterr().out


def test_a_path_the_set_up_writes_is_checked_again_after_it(tmp_path, capsys):
    made = tmp_path / "run" / "model"
    launcher = _launcher(tmp_path, {"trainer": _tier(tmp_path, needs="{run_dir}/model", exit=0)},
                         setup=[[sys.executable, "-c", "import sys; open(sys.argv[1], 'w')",
                                 "{run_dir}/model"]])
    assert launcher.run() == 0
    out = capsys.readouterr().out
    assert "checked 0 tier config(s)" in out and "(trainer again after the set-up" in out
    assert "checked 1 tier config(s) after the set-up" in out and made.exists()

    # A set-up that does not write it: the launch ends before the tiers, naming the path.
    launcher = _launcher(tmp_path, {"trainer": _tier(tmp_path, needs="{run_dir}/other", exit=0)},
                         setup=[[sys.executable, "-c", "pass", "{run_dir}/other"]])
    with pytest.raises(ConfigError, match=r"failed \(after the set-up; etcd and the tiers were "
                                          r"not started\):(.|\n)*needs: '.*/run/other' does"):
        launcher.run()
    assert launcher.tier_children == []


def test_a_tier_that_exits_early_is_named_with_its_log_tail_and_the_rest_stopped(
        tmp_path, capsys):
    launcher = _launcher(tmp_path, {
        "relay": _tier(tmp_path),
        "worker": _tier(tmp_path, lines=50, exit=3, after_s=0.5),
        "trainer": _tier(tmp_path)})
    t0 = time.monotonic()
    assert launcher.run() == 1
    out = capsys.readouterr().out
    log = tmp_path / "run" / "logs" / "worker.log"
    assert (f"worker exited early with exit code 3 (pid {launcher.tier_children[1][1].pid}); "
            f"last 40 lines of {log}:") in out
    assert "    worker| worker line 49" in out and "    worker| worker line 10" in out
    assert "worker line 9\n" not in out
    assert "worker ended before the job did: stopping the rest of the stack" in out
    assert "stopping trainer (pid" in out and "stopping relay (pid" in out
    assert all(_gone(child.pid) for _, child in launcher.tier_children)
    assert time.monotonic() - t0 < 60
    assert log.read_text().count("worker line 49") == 1


def test_a_wait_for_tier_that_fails_shows_its_tail_and_the_launch_fails(tmp_path, capsys):
    launcher = _launcher(tmp_path, {"relay": _tier(tmp_path),
                                    "trainer": _tier(tmp_path, lines=3, exit=2)})
    assert launcher.run() == 1
    out = capsys.readouterr().out
    assert "trainer failed with exit code 2 (pid " in out
    assert "    trainer| trainer line 2" in out
    assert "trainer failed: stopping the rest of the stack" in out and "stopping relay" in out


def test_a_second_launch_reports_only_its_own_metrics(tmp_path, capsys):
    tiers = {"trainer": _tier(tmp_path, exit=0)}
    first = _launcher(tmp_path, tiers, report="{run_dir}/trainer")
    assert first.run() == 0
    first_id = json.loads((tmp_path / "run" / "launch.json").read_text())["launch_id"]
    # What an earlier run left: a metrics file, a summary and a worker's timeline.
    trainer = tmp_path / "run" / "trainer"
    trainer.mkdir()
    row = {"step": 77, "version": 77, "time": time.time() - 3600, "reward_mean": 0.9,
           "tokens_per_s": 9.0, "step_s": 0.1, "wait_s": 0.1}
    (trainer / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    old = time.time() - 3600
    os.utime(trainer / "metrics.jsonl", (old, old))
    capsys.readouterr()

    second = _launcher(tmp_path, tiers, report="{run_dir}/trainer")
    assert second.run() == 0
    out = capsys.readouterr().out
    assert "steps: 77" not in out
    assert "no report: " in out and "metrics.jsonl is an earlier launch's" in out
    stamp = json.loads((tmp_path / "run" / "launch.json").read_text())
    assert stamp["launch_id"] != first_id and stamp["launch_id"] in out
    assert (tmp_path / "run" / "logs.previous" / "trainer.log").exists()

    # This launch's trainer writes a step: the report shows it, not the old one.
    third = _launcher(tmp_path, {"trainer": _tier(tmp_path, exit=0,
                                                  metrics="{run_dir}/trainer/metrics.jsonl")},
                      report="{run_dir}/trainer")
    assert third.run() == 0
    out = capsys.readouterr().out
    assert "steps: 1 (weight version 1)" in out and "steps: 77" not in out
    assert "no summary.json from this launch" in out


def test_a_run_dir_in_use_by_another_launch_is_refused(tmp_path):
    holder = RunDir(tmp_path / "run")
    holder.lock()
    launcher = _launcher(tmp_path, {"trainer": _tier(tmp_path, exit=0)})
    with pytest.raises(LaminarError, match=rf"in use by another `laminar up` \(pid {os.getpid()}"):
        launcher.run()
    assert launcher.tier_children == []
    holder.release()
    assert _launcher(tmp_path, {"trainer": _tier(tmp_path, exit=0)}).run() == 0


def test_each_tier_s_cpu_time_is_reported_and_written(tmp_path, capsys):
    # The trainer burns 0.6 s of CPU and exits; the idle worker is stopped afterwards.
    tiers = {"worker": _tier(tmp_path), "trainer": _tier(tmp_path, exit=0, busy_s=0.6)}
    trainer_dir = tmp_path / "run" / "trainer"
    trainer_dir.mkdir(parents=True)
    launcher = _launcher(tmp_path, tiers, report=str(trainer_dir))
    assert launcher.run() == 0
    out = capsys.readouterr().out
    assert "CPU time over " in out and "trainer " in out and "worker " in out
    written = json.loads((trainer_dir / "cpu.json").read_text())
    assert set(written["cpu_s"]) == {"trainer", "worker"}
    assert written["cpu_s"]["trainer"] >= 0.55  # its final count, read before reaping
    assert written["cpu_s"]["worker"] < written["cpu_s"]["trainer"]
    assert written["wall_s"] > 0.5 and written["cores"] >= 1


def test_tiers_get_passive_openmp_waits_unless_the_environment_says_otherwise():
    from laminar_common.launch.processes import tier_env

    assert tier_env({}) == {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                            "TQDM_DISABLE": "1"}
    assert tier_env({"OMP_WAIT_POLICY": "ACTIVE", "TQDM_DISABLE": "0"}) == \
        {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _stateful_job(tmp_path: Path) -> Path:
    """A job whose trainer and manager are Laminar's (resumable) tiers; never started."""
    job = {"job": "j", "run_dir": str(tmp_path / "run"),
           "etcd": {"embedded": False, "endpoints": ["127.0.0.1:9"]},
           "tiers": {"manager": {"command": ["laminar-rollout", "manage"],
                                 "config": {"state_dir": "{run_dir}/manager"}},
                     "trainer": {"command": ["laminar-trainer", "run"],
                                 "config": {"checkpoint": {"dir": "{run_dir}/ckpt"}}}},
           "wait_for": "trainer"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def test_a_new_launch_over_checkpoints_is_refused_and_resume_or_fresh_say_what_they_do(
        tmp_path, capsys):
    from laminar_common.launch.jobfile import for_resume

    path = _stateful_job(tmp_path)
    ckpt = tmp_path / "run" / "ckpt"
    (ckpt / "step-00000030").mkdir(parents=True)
    (ckpt / "LATEST").write_text("step-00000030")
    with pytest.raises(ConfigError, match=r"earlier run's checkpoints \(trainer: .*step-00000030"
                                          r"\): laminar up --resume .* --fresh"):
        LocalLauncher(load_job(path)).check_earlier_run()

    fresh = LocalLauncher(load_job(path), start="fresh")
    fresh.check_earlier_run()
    assert "--fresh: trainer removes the earlier run's checkpoints" in capsys.readouterr().out

    job = for_resume(load_job(path))
    assert job.tiers["trainer"].args == ("--resume",) == job.tiers["manager"].args
    assert for_resume(job).tiers["trainer"].args == ("--resume",)  # not twice
    LocalLauncher(job, start="resume").check_earlier_run()
    out = capsys.readouterr().out
    assert f"--resume: trainer goes on from {ckpt / 'step-00000030'}" in out
    assert "--resume: manager has nothing to resume from (state_dir " in out


def test_resume_arguments_are_added_whole_and_once(tmp_path):
    from laminar_common.launch.jobfile import for_resume, resume_args

    path = _stateful_job(tmp_path)
    job = load_job(path)
    trainer = job.tiers["trainer"].model_copy(update={
        "args": ("--set", "a=1"), "restart_args": ("--resume", "--set", "b=2")})
    job = job.model_copy(update={"tiers": {**job.tiers, "trainer": trainer}})
    resumed = for_resume(job).tiers["trainer"]
    assert resumed.args == ("--set", "a=1", "--resume", "--set", "b=2")
    assert for_resume(for_resume(job)).tiers["trainer"].args == resumed.args
    # what a Ray restart adds: the same
    assert resume_args(trainer) == ("--resume", "--set", "b=2")
    assert resume_args(job.tiers["manager"]) == ("--resume",)


def test_a_failing_set_up_step_shows_its_error_even_after_a_long_output(tmp_path, capsys):
    chatty = ("import sys\nfor i in range(100): print(f'line {i}')\n"
              "print('the real error', file=sys.stderr); sys.exit(3)")
    launcher = _launcher(tmp_path, {"trainer": _tier(tmp_path, exit=0)},
                         setup=[("python", "-c", chatty)])
    with pytest.raises(LaminarError, match="setup command failed"):
        launcher.run()
    out = capsys.readouterr().out
    assert "line 59" in out and "line 60" not in out.split("more lines in")[0]
    assert "(41 more lines in " in out and "the real error" in out.split("more lines in")[1]


def test_a_tier_that_saves_nothing_gets_no_resume_argument(tmp_path):
    from laminar_common.launch.jobfile import resume_args

    job = load_job(_stateful_job(tmp_path))
    bare = {name: spec.model_copy(update={"config": {}}) for name, spec in job.tiers.items()}
    assert resume_args(bare["manager"]) == () == resume_args(bare["trainer"])
