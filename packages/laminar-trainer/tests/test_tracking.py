"""Optional trackers: the real TensorBoard writer and W&B (offline, no network) read back,
the missing-package error at start, and a failing tracker counted while training goes on."""

from __future__ import annotations

import json
import logging
import struct
import sys
import time
from pathlib import Path

import pytest

from laminar_common.codec import Trajectory
from laminar_common.errors import ConfigError
from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd
from laminar_common.transport import ZmqPushSender
from laminar_examples.demo_model import build_tiny_model, build_tokenizer
from laminar_examples.tasks import make_task_records, write_jsonl
from laminar_trainer import cli
from laminar_trainer import service as service_module
from laminar_trainer.config import TrackingConfig, TrainerConfig
from laminar_trainer.service import TrainerService
from laminar_trainer.tracking import MultiTracker, flatten_scalars, make_trackers, markdown_table

ROW = {"step": 1, "loss": 0.5, "tokens": 12, "simulated": True, "note": "text", "eval": None,
       "staleness_hist": {0: 3, 2: 1}, "buffer": {"received": 4, "staleness": {1: 2}}}
SAMPLES = [{"step": 2, "trajectory_id": "p#1", "reward": 1.0, "reward_error": None,
            "completion": "<eos> a|b\n*c*"},
           {"step": 2, "trajectory_id": "p#0", "reward": 0.0, "reward_error": "timeout",
            "completion": "wrong"}]


class RecordingTracker:
    name = "recording"

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []
        self.closed = 0

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


class SampleRecordingTracker(RecordingTracker):
    name = "samples"

    def __init__(self):
        super().__init__()
        self.samples: list[tuple[int, list[dict]]] = []

    def log_samples(self, step, rows):
        self.samples.append((step, rows))


class FailingTracker:
    name = "failing"

    def __init__(self):
        self.calls = 0

    def log(self, step, metrics):
        self.calls += 1
        raise RuntimeError("tracker backend is down")

    def log_samples(self, step, rows):
        self.calls += 1
        raise RuntimeError("tracker backend is down")

    def close(self):
        raise RuntimeError("cannot flush")


def test_flatten_scalars_keeps_numbers_flattens_mappings_and_skips_the_rest():
    assert flatten_scalars(ROW, "summary/") == {
        "summary/step": 1.0, "summary/loss": 0.5, "summary/tokens": 12.0,
        "summary/simulated": 1.0, "summary/staleness_hist/0": 3.0,
        "summary/staleness_hist/2": 1.0, "summary/buffer/received": 4.0,
        "summary/buffer/staleness/1": 2.0,
    }


def test_a_failing_tracker_is_warned_counted_and_the_others_still_log(caplog):
    ok, bad = RecordingTracker(), FailingTracker()
    trackers = MultiTracker([bad, ok])
    with caplog.at_level(logging.WARNING, logger="laminar_trainer.tracking"):
        trackers.log(1, {"loss": 1.0})
        trackers.log(2, {"loss": 0.5})
        trackers.close()
    assert trackers.errors == 3  # two logs and the close
    assert [step for step, _ in ok.rows] == [1, 2] and ok.closed == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("tracker failing failed" in r.getMessage()
                                      for r in warnings)
    assert warnings[0].exc_info and not warnings[1].exc_info, "one traceback a tracker"
    trackers.log(3, {"loss": 0.1})
    trackers.close()
    assert bad.calls == 2 and len(ok.rows) == 2 and ok.closed == 1, "nothing after close"


def test_samples_go_to_trackers_that_take_them_and_a_failing_one_is_counted(caplog):
    plain, takes, bad = RecordingTracker(), SampleRecordingTracker(), FailingTracker()
    trackers = MultiTracker([bad, plain, takes])
    with caplog.at_level(logging.WARNING, logger="laminar_trainer.tracking"):
        trackers.log_samples(2, SAMPLES)
        trackers.log_samples(4, SAMPLES[1:])
        trackers.log_samples(6, [])
    assert [(step, [r["trajectory_id"] for r in rows]) for step, rows in takes.samples] == [
        (2, ["p#1", "p#0"]), (4, ["p#0"])]
    assert plain.rows == [], "a tracker without log_samples is skipped, not an error"
    assert trackers.errors == 2 and bad.calls == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0].startswith("tracker failing failed to log samples at step 2")
    trackers.close()
    trackers.log_samples(8, SAMPLES)
    assert len(takes.samples) == 2 and bad.calls == 2, "nothing after close"


def test_markdown_table_keeps_every_cell_in_its_cell_and_literal():
    assert markdown_table(SAMPLES).splitlines() == [
        "| step | trajectory\\_id | reward | reward\\_error | completion |",
        "|---|---|---|---|---|",
        "| 2 | p#1 | 1.0 |  | &lt;eos&gt; a\\|b<br>\\*c\\* |",
        "| 2 | p#0 | 0.0 | timeout | wrong |",
    ]
    assert markdown_table([]) == ""


@pytest.mark.parametrize("module,field,section", [
    ("wandb", "tracking.wandb.project", {"wandb": {"project": "p"}}),
    ("tensorboard", "tracking.tensorboard.dir", {"tensorboard": {"dir": "tb"}}),
])
def test_a_tracker_without_its_package_is_a_config_error(monkeypatch, tmp_path, module, field,
                                                         section):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` fail
    with pytest.raises(ConfigError) as info:
        make_trackers(TrackingConfig(**section), tmp_path, "run", {})
    assert str(info.value) == (f"trainer config: {field} is set but the '{module}' package is "
                               f"not installed (pip install {module}, or the "
                               f"laminar-trainer[{module}] extra)")


def test_nothing_starts_when_one_asked_for_package_is_missing(monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)
    config = TrackingConfig(tensorboard={"dir": str(tmp_path / "tb")}, wandb={"project": "p"})
    with pytest.raises(ConfigError, match="tracking.wandb.project"):
        make_trackers(config, tmp_path, "run", {})
    assert not (tmp_path / "tb").exists()


def test_disabled_wandb_needs_no_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    trackers = make_trackers(TrackingConfig(wandb={"project": "p", "mode": "disabled"}),
                             tmp_path, "run", {})
    assert trackers.trackers == []


def test_the_cli_fails_at_start_naming_the_field_and_package(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    # The CLI configures the root logger; keep pytest's handlers.
    monkeypatch.setattr("laminar_common.logs.setup_logging", lambda *a, **k: None)
    rc = cli.main(["run", "--set", "simulate.step_s=0", "--set", f"run_dir={tmp_path / 'run'}",
                   "--set", "tracking.wandb.project=p"])
    assert rc == 2
    assert ("tracking.wandb.project is set but the 'wandb' package is not installed "
            "(pip install wandb") in capsys.readouterr().err


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = make_trackers(TrackingConfig(tensorboard={"dir": str(tmp_path / "tb")}),
                             tmp_path, "run", {})
    assert [t.name for t in trackers.trackers] == ["tensorboard"]
    for step in (1, 2, 3):
        trackers.log(step, {"loss": 1.0 / step, "simulated": step == 2, "note": "skipped",
                            "staleness_hist": {0: step}})
    trackers.log_samples(2, SAMPLES)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "simulated", "staleness_hist/0"]
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 2
    assert text.tensor_proto.string_val[0].decode() == markdown_table(SAMPLES)
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in loss] == [1, 2, 3]
    assert [v for _, v in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.value for e in events.Scalars("simulated")] == [0.0, 1.0, 0.0]
    assert [e.value for e in events.Scalars("staleness_hist/0")] == [1.0, 2.0, 3.0]
    assert trackers.errors == 0


def _wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file: LevelDB log format (7-byte file header,
    32 KiB blocks, each chunk ``<crc32, length, type>`` with FULL/FIRST/MIDDLE/LAST types)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero-filled rest of a block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def _items(items) -> dict:
    """Config/history items of a record: the name is in ``key`` or ``nested_key``."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-env" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_wandb_offline_run_holds_config_and_history(tmp_path, wandb_offline):
    config = TrackingConfig(wandb={"project": "laminar-test", "mode": "offline"})
    trackers = make_trackers(config, tmp_path / "run", "trainer-7",
                             {"job": "unit", "optim": {"lr": 0.001}})
    assert [t.name for t in trackers.trackers] == ["wandb"]
    for step in (1, 2, 3):
        trackers.log(step, {"loss": 1.0 / step, "simulated": True})
        if step == 2:
            trackers.log_samples(step, SAMPLES)
    trackers.close()
    assert trackers.errors == 0
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "wandb.dir defaults to run_dir"
    (wandb_file,) = runs[0].glob("*.wandb")
    # wandb's own writer process may still be flushing the file after finish() returns
    # (a CI run once read it without its run record): read until the run record and the
    # three history rows are there, for at most 20 s.
    deadline = time.monotonic() + 20
    while True:
        records = _wandb_records(wandb_file)
        kinds = [r.WhichOneof("record_type") for r in records]
        if ("run" in kinds and kinds.count("history") >= 3) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert kinds.count("run") == 1, (kinds, wandb_file.stat().st_size)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "laminar-test" and run.display_name == "trainer-7"
    run_config = _items(run.config.update)
    assert run_config["job"] == "unit" and run_config["optim"] == {"lr": 0.001}
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss"], h["simulated"]) for h in history] == [
        (1, 1.0, 1.0), (2, 0.5, 1.0), (3, pytest.approx(1 / 3), 1.0)]
    tables = [h for h in history if "samples/_type" in h]
    assert [(h["_step"], h["samples/_type"], h["samples/nrows"]) for h in tables] == [
        (2, "table-file", 2)]
    table = json.loads((runs[0] / "files" / tables[0]["samples/path"]).read_text())
    assert table["columns"] == list(SAMPLES[0])
    assert table["data"] == [list(row.values()) for row in SAMPLES]


# -- the service ------------------------------------------------------------------


def _trajs(prompt_id, n=2):
    return [Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, group_size=n,
                       sample_index=i, worker_id="w", policy_version=0,
                       prompt_token_ids=(1, 10, 11), response_token_ids=(12, 13, 2),
                       behaviour_logprobs=(-3.0, -3.1, -3.2), reward=float(i % 2),
                       finish_reason="stop") for i in range(n)]


def _run_service(cfg: TrainerConfig, prompts: str) -> TrainerService:
    svc = TrainerService(cfg, publish_fn=lambda version, tensors, step: None,
                         coordinator=InMemoryCoordinator(InMemoryEtcd(), cfg.job))
    svc.start()
    try:
        sender = ZmqPushSender(svc.consumer.endpoint)
        for t in [t for p in prompts for t in _trajs(p)]:
            sender.send(t)
        sender.close()
        deadline = time.monotonic() + 60
        while not svc.finished.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert svc.finished.is_set(), f"trainer did not finish: {svc.failure!r}"
    finally:
        svc.close()
    return svc


def test_service_tracks_rows_eval_and_summary_and_counts_tracker_errors(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    tok = build_tokenizer()
    build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2,
                     intermediate_size=64).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    write_jsonl(tmp_path / "eval.jsonl", make_task_records("sort", 2, seed=0, split="eval"))
    ok, bad = RecordingTracker(), FailingTracker()
    made = {}

    def fake_make_trackers(config, run_dir, run_name, run_config):
        made.update(run_name=run_name, run_config=run_config)
        return MultiTracker([ok, bad])

    monkeypatch.setattr(service_module, "make_trackers", fake_make_trackers)
    cfg = TrainerConfig(job="unit", trainer_id="trainer", model_dir=str(model_dir),
                        run_dir=str(tmp_path / "run"), batch_groups=2, total_steps=2,
                        eval={"prompts": str(tmp_path / "eval.jsonl"), "max_new_tokens": 4,
                              "every_steps": 1},
                        etcd={"password": "hunter2"})
    svc = _run_service(cfg, "abcd")

    assert made["run_name"] == "trainer"
    assert made["run_config"]["job"] == "unit" and made["run_config"]["batch_groups"] == 2
    assert made["run_config"]["etcd"]["password"] == "***", "secrets never reach a tracker"
    steps = [step for step, _ in ok.rows]
    assert steps == [0, 1, 2, 2, 2]  # eval before, two rows, eval after, summary
    eval_keys = {"eval_accuracy", "eval_mean_length", "eval_truncated", "eval_reward_errors",
                 "eval_seconds"}
    assert set(ok.rows[0][1]) == eval_keys and ok.rows[0][1]["eval_accuracy"] == svc.heldout.before
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # every_steps 1: step 1 is evaluated in the loop; the last step's weights once, after it.
    assert eval_keys <= set(rows[0]) and rows[0]["eval_seconds"] > 0
    assert not eval_keys & set(rows[1])
    for (_, tracked), row in zip(ok.rows[1:3], rows):
        assert tracked["loss"] == row["loss"] and tracked["reward_mean"] == row["reward_mean"]
        assert tracked["simulated"] == 0.0 and "step" not in tracked and "time" not in tracked
    assert set(ok.rows[3][1]) == eval_keys and ok.rows[3][1]["eval_accuracy"] == svc.heldout.after
    summary_row = ok.rows[4][1]
    assert summary_row["summary/steps"] == 2.0 and summary_row["summary/tokens_consumed"] == 24
    assert sum(v for k, v in summary_row.items() if k.startswith("summary/staleness_hist/")) == 8
    assert "summary/run_dir" not in summary_row
    assert ok.closed == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tracker_errors"] == bad.calls + 1 == 6  # five logs and the close


def test_service_writes_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrainerConfig(job="unit", trainer_id="trainer", simulate={"step_s": 0, "weight_bytes": 8},
                        run_dir=str(tmp_path / "run"), batch_groups=1, total_steps=3,
                        tracking={"tensorboard": {"dir": str(tmp_path / "tb")}})
    _run_service(cfg, "abc")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("reward_mean")] == [0.5, 0.5, 0.5]
    assert [(e.step, e.value) for e in events.Scalars("summary/steps")] == [(3, 3.0)]
    assert [e.value for e in events.Scalars("summary/tracker_errors")] == [0.0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["tracker_errors"] == 0
