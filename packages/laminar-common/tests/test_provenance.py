"""Step records: written atomically, read back exactly, retained, validated on read."""

from __future__ import annotations

import pytest

from laminar_common.codec import SamplingSpec, Trajectory, trajectory_seed
from laminar_common.data.provenance import (
    RecordedGroup,
    StepRecordWriter,
    find_records,
    find_trajectory,
    read_step_record,
    records_in,
    show_samples,
)
from laminar_common.errors import LaminarError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _group(prompt: str, version: int, n: int = 3, failed=()) -> RecordedGroup:
    group = RecordedGroup(prompt, n, weight=0.75, failed=set(failed), group_seq=7)
    for i in range(n):
        if i in failed:
            continue
        group.members[i] = Trajectory(
            trajectory_id=f"{prompt}#{i}", prompt_id=prompt, group_size=n, sample_index=i,
            worker_id="w1", policy_version=version, prompt_token_ids=(1, 2, 3),
            response_token_ids=(4, 5, 6, 7), behaviour_logprobs=(-0.1 / 3, -1e-17, -2.5, -0.7),
            reward=1 / 3 + i, finish_reason="stop", completion=f"answer {i}",
            reward_error="KeyError: 'answer'" if i == 2 else None,
            engine="TorchEngine torch 2.13.0+cpu",
            sampling=SamplingSpec(max_tokens=9, temperature=1.3, top_p=0.9, top_k=5,
                                  seed=trajectory_seed(3, f"{prompt}#{i}")),
            observation_spans=((1, 2),) if i == 1 else ())
    return group


def test_a_record_reads_back_the_groups_exactly(tmp_path):
    writer = StepRecordWriter(tmp_path / "records", "model_dir: m\nseed: 3\n",
                              decode=lambda ids: " ".join(map(str, ids)))
    groups = [_group("p0", 4), _group("p1", 5, failed=(1,))]
    path = writer.write(6, 5, groups)
    record = read_step_record(path)
    assert (record.step, record.version, record.config) == (6, 5, {"model_dir": "m", "seed": 3})
    assert [g.trajectories() for g in record.groups] == [g.trajectories() for g in groups]
    assert [(g.weight, g.failed, g.group_seq) for g in record.groups] == [(0.75, set(), 7),
                                                                           (0.75, {1}, 7)]
    assert record.prompts["p0#0"] == "1 2 3"
    # A person opens it with pandas-like tools as it is: one row a trajectory.
    table = pq.read_table(path)
    assert table.num_rows == 5 and table.column("staleness").to_pylist() == [1, 1, 1, 0, 0]
    assert writer.tokens_written == 5 * 7 and writer.bytes_written == path.stat().st_size


def test_retention_keeps_the_newest_and_a_resume_drops_what_it_trains_again(tmp_path):
    writer = StepRecordWriter(tmp_path, "{}", keep_steps=3)
    for step in range(1, 7):
        writer.write(step, step, [_group(f"p{step}", step)])
    assert list(records_in(tmp_path)) == [4, 5, 6]
    writer.drop_after(4)
    assert list(records_in(tmp_path)) == [4]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_damaged_record_is_refused_naming_the_file_and_row(tmp_path):
    path = StepRecordWriter(tmp_path, "{}").write(1, 1, [_group("p0", 1)])
    table = pq.read_table(path)
    bad = table.set_column(table.column_names.index("sample_index"), "sample_index",
                           pa.array([0, 0, 2], pa.int32()))
    pq.write_table(bad.replace_schema_metadata(table.schema.metadata), path)
    with pytest.raises(LaminarError, match=r"row 1: trajectory 'p0#1' does not fit group 0"):
        read_step_record(path)
    (tmp_path / "step-00000002.parquet").write_bytes(b"not parquet")
    with pytest.raises(LaminarError, match="step-00000002.parquet: cannot be read as Parquet"):
        read_step_record(tmp_path / "step-00000002.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "step-00000003.parquet")
    with pytest.raises(LaminarError, match="not a laminar-step-record/1 file"):
        read_step_record(tmp_path / "step-00000003.parquet")


def test_samples_and_trajectories_are_found_from_a_run_dir(tmp_path):
    writer = StepRecordWriter(tmp_path / "run" / "ckpt" / "records", "checkpoint:\n  dir: x\n")
    writer.write(1, 1, [_group("a", 1)])
    writer.write(2, 2, [_group("b", 1)])
    records_dir, ckpt = find_records(tmp_path / "run")
    # The default place (no records.dir): the checkpoints are the records' parent, even
    # where the recorded checkpoint.dir is relative to another working directory.
    assert records_dir == tmp_path / "run" / "ckpt" / "records"
    assert ckpt == tmp_path / "run" / "ckpt"
    elsewhere = StepRecordWriter(tmp_path / "other" / "custom" / "records",
                                 "records:\n  dir: custom/records\ncheckpoint:\n  dir: ck\n")
    elsewhere.write(1, 1, [_group("c", 1)])
    (tmp_path / "other" / "ck").mkdir()
    assert find_records(tmp_path / "other") == (tmp_path / "other" / "custom" / "records",
                                                tmp_path / "other" / "ck")
    record, traj = find_trajectory(records_dir, "a#1")
    assert record.step == 1 and traj.observation_spans == ((1, 2),)
    text = show_samples(tmp_path / "run", order="worst", count=2)
    assert text.startswith("step 2 (trainer at v2): 3 trajectories in 1 groups")
    assert text.index("b#0") < text.index("b#1") and "REWARD ERROR" not in text
    assert "REWARD ERROR KeyError" in show_samples(tmp_path / "run", step=1, order="best")
    with pytest.raises(LaminarError, match="no record of step 9"):
        show_samples(tmp_path / "run", step=9)
    with pytest.raises(LaminarError, match="no step records under"):
        find_records(tmp_path / "run" / "ckpt" / "elsewhere")


def test_a_trajectory_seed_is_its_own_and_repeatable():
    assert trajectory_seed(3, "p#0") == trajectory_seed(3, "p#0")
    assert len({trajectory_seed(3, f"p#{i}") for i in range(64)}) == 64
    assert trajectory_seed(3, "p#0") != trajectory_seed(4, "p#0")
    assert 0 <= trajectory_seed(3, "p#0") < 2 ** 63
