"""The run dir of a launch: locked for one launcher, stamped, logs and etcd data afresh."""

from __future__ import annotations

import json
import os

import pytest

from laminar_common.errors import LaminarError
from laminar_common.launch.rundir import LOCK_NAME, RunDir


def test_a_launch_keeps_set_up_products_and_starts_logs_and_etcd_afresh(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "trainer.log").write_text("the previous launch\n")
    (run / "etcd" / "data").mkdir(parents=True)
    (run / "model").mkdir()
    launch = RunDir(run)
    launch.lock()
    launch.begin("j", "job.yaml", embedded_etcd=True)
    stamp = json.loads((run / "launch.json").read_text())
    assert stamp == {"launch_id": launch.launch_id, "started_at": launch.started_at,
                     "pid": os.getpid(), "job": "j", "job_file": "job.yaml"}
    assert (run / "logs.previous" / "trainer.log").read_text() == "the previous launch\n"
    assert not (run / "logs").exists() and not (run / "etcd").exists()
    assert (run / "model").is_dir()
    assert (run / LOCK_NAME).read_text() == str(os.getpid())
    launch.release()


def test_etcd_data_of_an_external_etcd_job_is_not_touched(tmp_path):
    (tmp_path / "etcd").mkdir()
    launch = RunDir(tmp_path)
    launch.lock()
    launch.begin("j", None, embedded_etcd=False)
    assert (tmp_path / "etcd").is_dir()
    launch.release()


def test_only_one_launch_holds_a_run_dir(tmp_path):
    first, second = RunDir(tmp_path), RunDir(tmp_path)
    first.lock()
    with pytest.raises(LaminarError, match=rf"in use by another `laminar up` \(pid {os.getpid()}\)"):
        second.lock()
    first.release()
    second.lock()
    assert second.launch_id != first.launch_id
    second.release()
    second.release()  # idempotent
