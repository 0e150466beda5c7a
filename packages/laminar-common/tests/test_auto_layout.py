"""``layout: auto``: the rule, what it fills in and what it leaves alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from laminar_common.launch.jobfile import JobFile
from laminar_common.launch.layout import apply_layout, choose_layout
from laminar_common.launch.local import LocalLauncher


def _job(tmp_path, worker: dict | None = None, trainer: dict | None = None,
         worker_spec: dict | None = None, trainer_spec: dict | None = None, **top) -> JobFile:
    return JobFile.model_validate({
        "job": "lay", "run_dir": str(tmp_path / "run"),
        "tiers": {
            "manager": {"command": ["laminar-rollout", "manage"],
                        "config": {"prompts": "p.jsonl", "group_size": 8, "batch_groups": 32}},
            "worker": {"command": ["laminar-rollout", "serve"], "id_field": "worker_id",
                       "config": worker if worker is not None else
                       {"engine": {"type": "torch", "model_dir": "m"}},
                       **(worker_spec or {})},
            "trainer": {"command": ["laminar-trainer", "run"],
                        "config": trainer if trainer is not None else {"model_dir": "m"},
                        **(trainer_spec or {})},
        },
        "wait_for": "trainer", **top})


def test_the_rule_is_measured_up_to_two_cores_and_extrapolated_above():
    for cores in (1, 2):
        lay = choose_layout(cores)
        assert (lay.trainer_threads, lay.workers, lay.worker_threads, lay.measured) == \
            (cores, 1, 1, True)
    big = choose_layout(16)
    assert (big.trainer_threads, big.workers, big.worker_threads, big.measured) == \
        (11, 5, 1, False)
    assert big.trainer_threads + big.workers * big.worker_threads == 16
    with pytest.raises(ValueError, match="cores"):
        choose_layout(0)


def test_unset_cpu_fields_are_filled_for_the_cores():
    job, lay, said = apply_layout(_job(Path("/tmp")), 2)
    worker, trainer = job.tiers["worker"], job.tiers["trainer"]
    assert lay is not None and lay.cores == 2
    assert trainer.config["threads"] == 2
    assert worker.replicas == 1
    assert worker.config["engine"]["threads"] == 1
    assert worker.config["engine"]["max_batch"] == 256  # a step's 32 x 8 samples
    assert any("max_batch 256" in line for line in said)
    job16, _, _ = apply_layout(_job(Path("/tmp")), 16)
    assert job16.tiers["worker"].replicas == 5
    assert job16.tiers["worker"].config["engine"]["max_batch"] == 52  # ceil(256 / 5)
    assert job16.tiers["trainer"].config["threads"] == 11


def test_what_the_job_file_sets_is_kept():
    job, _, said = apply_layout(_job(
        Path("/tmp"), worker={"engine": {"type": "torch", "model_dir": "m", "threads": 3}},
        trainer={"model_dir": "m", "threads": 1}, worker_spec={"replicas": 2}), 16)
    assert job.tiers["trainer"].config["threads"] == 1
    assert job.tiers["worker"].replicas == 2
    assert job.tiers["worker"].config["engine"]["threads"] == 3
    assert job.tiers["worker"].config["engine"]["max_batch"] == 128  # over the 2 it has
    assert said == ["worker: engine.max_batch 128 (a step's 256 samples over 2 worker(s))"]


@pytest.mark.parametrize("kwargs", [
    {"layout": "manual"},
    {"worker": {"engine": {"type": "simulated"}}, "trainer": {"simulate": {"step_s": 0.1}}},
    {"worker": {"engine": {"type": "vllm", "model_dir": "m"}},
     "trainer": {"model_dir": "m", "device": "cuda"}},
    {"worker": {"engine": {"type": "torch", "model_dir": "m", "device": "cuda:0"}},
     "trainer": {"model_dir": "m"}, "trainer_spec": {"ranks": 2}},
])
def test_gpu_simulated_multi_rank_and_manual_tiers_are_left_alone(kwargs):
    job = _job(Path("/tmp"), **kwargs)
    out, lay, said = apply_layout(job, 2)
    assert (out, lay, said) == (job, None, [])


def test_the_launcher_writes_the_laid_out_configs(tmp_path):
    launcher = LocalLauncher(_job(tmp_path), echo=False)
    assert launcher.layout is not None and launcher.layout.cores == launcher.cores
    _, argv = launcher.replica_argv("worker", launcher.job.tiers["worker"], 0)
    written = yaml.safe_load(open(argv[argv.index("--config") + 1]))
    assert written["engine"]["threads"] == 1
    assert written["engine"]["max_batch"] == 256
    _, argv = launcher.replica_argv("trainer", launcher.job.tiers["trainer"], 0)
    written = yaml.safe_load(open(argv[argv.index("--config") + 1]))
    assert written["threads"] == choose_layout(launcher.cores).trainer_threads


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_usable_cores_follows_the_cpu_affinity():
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c",
         "from laminar_common.launch.layout import usable_cores; print(usable_cores())"],
        capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_the_ray_launcher_does_not_lay_out():
    from laminar_common.launch.ray_backend import RayLauncher

    assert LocalLauncher.lays_out and not RayLauncher.lays_out


def test_replicas_only_where_each_gets_its_own_id():
    job = _job(Path("/tmp"), worker_spec={"id_field": None})
    out, _, said = apply_layout(job, 16)
    assert out.tiers["worker"].replicas == 1  # copies would share one worker id
    assert out.tiers["worker"].config["engine"]["max_batch"] == 256
    assert not any("replica" in line for line in said)
    one_per_node = _job(Path("/tmp"), worker_spec={"replicas": -1})
    out, _, _ = apply_layout(one_per_node, 16)
    assert out.tiers["worker"].replicas == -1
    assert out.tiers["worker"].config["engine"]["max_batch"] == 256  # -1 is one here
