"""Step records: what every trainer step trained on, as a Parquet file a person opens.

Owns the record of one step (``step-00000012.parquet``): one row per trajectory the
step trained on, in the order the step took them, with everything that went into the
update (prompt and response token ids, behaviour log-probs, reward, group, sampling
parameters, policy version and staleness) and what a person looks for (the completion
text, the worker, the reward error). The file's schema metadata holds the step, the
trainer's version when it took the data and its configuration, so one file is enough
to recompute the step from the checkpoint before it (``laminar_trainer.replay``), and
a seeded trajectory can be generated again (``laminar_rollout.regenerate``).

Files are written atomically (a ``.tmp`` renamed) and compressed (zstd); the newest
``keep_steps`` stay. ``pandas.read_parquet`` and ``datasets.load_dataset("parquet",
...)`` read them as they are.

Invariants: the rows rebuild exactly the groups the step trained on (float64
log-probs and rewards, group weights and given-up members included); a file is
complete or absent. Reading validates every column and names the file and row of
anything wrong.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from laminar_common.codec import SamplingSpec, Trajectory
from laminar_common.errors import LaminarError

__all__ = ["StepRecord", "RecordedGroup", "StepRecordWriter", "read_step_record", "record_path",
           "records_in", "find_records", "find_trajectory", "show_samples"]

log = logging.getLogger(__name__)

FORMAT = "laminar-step-record/1"
_NAME = "step-{:08d}.parquet"


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
        raise LaminarError("step records need pyarrow (pip install pyarrow), or set "
                           "records.enabled: false") from exc
    return pa, pq


def record_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / _NAME.format(step)


def records_in(directory: str | os.PathLike[str]) -> dict[int, Path]:
    """Step -> record file, for every complete record in ``directory``."""
    out = {}
    for path in Path(directory).glob("step-*.parquet"):
        try:
            out[int(path.stem.removeprefix("step-"))] = path
        except ValueError:
            continue
    return dict(sorted(out.items()))


class GroupLike(Protocol):
    """What a record is written from (the trainer's buffer groups are)."""

    prompt_id: str
    group_size: int
    weight: float
    failed: set[int]
    group_seq: int

    def trajectories(self) -> list[Trajectory]: ...


@dataclass
class RecordedGroup:
    """One group as a step trained it: its members by sample index, its weight and the
    members given up on."""

    prompt_id: str
    group_size: int
    weight: float = 1.0
    failed: set[int] = field(default_factory=set)
    group_seq: int = -1
    members: dict[int, Trajectory] = field(default_factory=dict)

    def trajectories(self) -> list[Trajectory]:
        return [self.members[i] for i in sorted(self.members)]


@dataclass
class StepRecord:
    """One step's record, read back."""

    step: int
    version: int
    """The trainer's weight version when the step took its data (staleness counts from it)."""
    config: dict
    """The trainer's configuration (as its start-up log shows it, secrets masked)."""
    groups: list[RecordedGroup]
    path: Path
    prompts: dict[str, str] = field(default_factory=dict)
    """Trajectory id -> its prompt as text (where the trainer had a tokenizer)."""
    meta: dict[str, str] = field(default_factory=dict)
    """The file's other metadata (``world_size``: the trainer's ranks)."""


def _schema(pa):
    ints = pa.list_(pa.int32())
    return pa.schema([
        ("step", pa.int64()), ("group_index", pa.int32()), ("prompt_id", pa.string()),
        ("group_seq", pa.int64()), ("group_size", pa.int32()), ("group_weight", pa.float64()),
        ("group_failed", ints), ("trajectory_id", pa.string()), ("sample_index", pa.int32()),
        ("worker_id", pa.string()), ("engine", pa.string()), ("policy_version", pa.int64()), ("staleness", pa.int64()),
        ("reward", pa.float64()), ("reward_error", pa.string()), ("finish_reason", pa.string()),
        ("prompt_token_ids", ints), ("response_token_ids", ints),
        ("behaviour_logprobs", pa.list_(pa.float64())),
        ("observation_spans", pa.list_(pa.list_(pa.int32()))),
        ("prompt", pa.string()), ("completion", pa.string()), ("data_source", pa.string()), ("generation_s", pa.float64()),
        ("simulated", pa.bool_()), ("settled_below", pa.int64()),
        ("trajectory_group_seq", pa.int64()),
        ("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int32()),
        ("max_tokens", pa.int32()), ("seed", pa.int64()), ("stop_token_ids", ints),
    ])


class StepRecordWriter:
    """Writes one record per step into ``directory``, keeping the newest ``keep_steps``.

    Args:
        directory: where the records go (created).
        config_text: the trainer's configuration, stored in every file.
        keep_steps: records to keep (None: all).
        decode: token ids -> text, for the prompt column (None: left empty).
    """

    def __init__(self, directory: str | os.PathLike[str], config_text: str,
                 keep_steps: int | None = None, compression: str = "zstd",
                 decode: Callable[[Sequence[int]], str] | None = None,
                 meta: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_text = config_text
        self.keep_steps = keep_steps
        self.compression = compression
        self.decode = decode
        self.meta = dict(meta or {})
        self.bytes_written = 0
        self.tokens_written = 0

    def drop_after(self, step: int) -> None:
        """Remove the records of steps after ``step`` (a resume trains them again)."""
        for s, path in records_in(self.directory).items():
            if s > step:
                path.unlink(missing_ok=True)

    def write(self, step: int, version: int, groups: Sequence[GroupLike]) -> Path:
        pa, pq = _pa()
        rows: dict[str, list] = {name: [] for name in _schema(pa).names}
        for gi, group in enumerate(groups):
            for traj in group.trajectories():
                s = traj.sampling
                for key, value in (
                    ("step", step), ("group_index", gi), ("prompt_id", group.prompt_id),
                    ("group_seq", group.group_seq), ("group_size", group.group_size),
                    ("group_weight", group.weight), ("group_failed", sorted(group.failed)),
                    ("trajectory_id", traj.trajectory_id), ("sample_index", traj.sample_index),
                    ("worker_id", traj.worker_id), ("engine", traj.engine),
                    ("policy_version", traj.policy_version),
                    ("staleness", version - traj.policy_version), ("reward", traj.reward),
                    ("reward_error", traj.reward_error), ("finish_reason", traj.finish_reason),
                    ("prompt_token_ids", list(traj.prompt_token_ids)),
                    ("response_token_ids", list(traj.response_token_ids)),
                    ("behaviour_logprobs", list(traj.behaviour_logprobs)),
                    ("observation_spans", [list(x) for x in traj.observation_spans]),
                    ("prompt", self.decode(traj.prompt_token_ids) if self.decode else ""),
                    ("completion", traj.completion), ("data_source", traj.data_source),
                    ("generation_s", traj.generation_s), ("simulated", traj.simulated),
                    ("settled_below", traj.settled_below),
                    ("trajectory_group_seq", traj.group_seq), ("temperature", s.temperature),
                    ("top_p", s.top_p), ("top_k", s.top_k), ("max_tokens", s.max_tokens),
                    ("seed", s.seed), ("stop_token_ids", list(s.stop_token_ids)),
                ):
                    rows[key].append(value)
                self.tokens_written += len(traj.prompt_token_ids) + len(traj.response_token_ids)
        meta = {**self.meta, "format": FORMAT, "step": str(step), "version": str(version),
                "config": self.config_text}
        table = pa.table(rows, schema=_schema(pa).with_metadata(meta))
        out = record_path(self.directory, step)
        tmp = out.with_name(out.name + ".tmp")
        pq.write_table(table, tmp, compression=self.compression)
        os.replace(tmp, out)
        self.bytes_written += out.stat().st_size
        if self.keep_steps is not None:
            for path in list(records_in(self.directory).values())[:-self.keep_steps]:
                path.unlink(missing_ok=True)
        return out


def read_step_record(path: str | os.PathLike[str]) -> StepRecord:
    """Read one step record back into the groups the step trained on.

    Raises:
        LaminarError: not a step record, or a column or row that does not parse (the
            message names the file, the row and the column).
    """
    import yaml

    pa, pq = _pa()
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise LaminarError(f"step record {path}: cannot be read as Parquet: {exc}") from exc
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if meta.get("format") != FORMAT:
        raise LaminarError(f"step record {path}: not a {FORMAT} file "
                           f"(format {meta.get('format')!r})")
    missing = [n for n in _schema(pa).names if n not in table.column_names]
    if missing:
        raise LaminarError(f"step record {path}: missing column(s) {', '.join(missing)}")
    try:
        step, version = int(meta["step"]), int(meta["version"])
        config = yaml.safe_load(meta["config"]) or {}
    except (KeyError, ValueError, yaml.YAMLError) as exc:
        raise LaminarError(f"step record {path}: bad metadata: {exc}") from exc
    groups: dict[int, RecordedGroup] = {}
    prompts: dict[str, str] = {}
    for row, r in enumerate(table.to_pylist()):
        try:
            traj = Trajectory(
                trajectory_id=r["trajectory_id"], prompt_id=r["prompt_id"],
                group_size=r["group_size"], sample_index=r["sample_index"],
                worker_id=r["worker_id"], engine=r["engine"],
                policy_version=r["policy_version"],
                prompt_token_ids=tuple(r["prompt_token_ids"]),
                response_token_ids=tuple(r["response_token_ids"]),
                behaviour_logprobs=tuple(r["behaviour_logprobs"]), reward=r["reward"],
                finish_reason=r["finish_reason"], reward_error=r["reward_error"],
                completion=r["completion"], generation_s=r["generation_s"],
                simulated=r["simulated"], group_seq=r["trajectory_group_seq"],
                settled_below=r["settled_below"],
                sampling=SamplingSpec(max_tokens=r["max_tokens"], temperature=r["temperature"],
                                      top_p=r["top_p"], top_k=r["top_k"],
                                      stop_token_ids=tuple(r["stop_token_ids"]), seed=r["seed"]),
                data_source=r["data_source"],
                observation_spans=tuple(tuple(x) for x in r["observation_spans"]))
            group = groups.setdefault(r["group_index"], RecordedGroup(
                r["prompt_id"], r["group_size"], weight=r["group_weight"],
                failed=set(r["group_failed"]), group_seq=r["group_seq"]))
        except (TypeError, ValueError, KeyError) as exc:
            raise LaminarError(f"step record {path}, row {row}: {exc}") from exc
        if group.prompt_id != traj.prompt_id or traj.sample_index in group.members:
            raise LaminarError(f"step record {path}, row {row}: trajectory "
                               f"{traj.trajectory_id!r} does not fit group {r['group_index']}")
        group.members[traj.sample_index] = traj
        if r["prompt"]:
            prompts[traj.trajectory_id] = r["prompt"]
    return StepRecord(step, version, config, [groups[i] for i in sorted(groups)], path, prompts,
                      meta)


def find_records(run_dir: str | Path) -> tuple[Path, Path]:
    """``(records dir, checkpoint dir)`` of a run: from the trainer config a record
    holds, or the usual places under ``run_dir``.

    Raises:
        LaminarError: no step record is found.
    """
    run = Path(run_dir)
    for cand in (run / "records", run / "trainer" / "records", run / "ckpt" / "records",
                 run / "trainer" / "ckpt" / "records", *run.glob("**/records")):
        found = records_in(cand) if cand.is_dir() else {}
        if found:
            record = read_step_record(list(found.values())[-1])
            if not (record.config.get("records") or {}).get("dir"):
                return cand, cand.parent  # the default place: checkpoint.dir/records
            ckpt = Path((record.config.get("checkpoint") or {}).get("dir") or cand.parent)
            if not ckpt.is_absolute() and not ckpt.is_dir():
                ckpt = run / ckpt  # a job file's relative path, from elsewhere
            return cand, ckpt
    raise LaminarError(f"no step records under {run} (records.enabled in the trainer config; "
                       "they are written to checkpoint.dir/records or run_dir/records)")


def show_samples(run_dir: str | os.PathLike[str], step: int | None = None,
                 order: str | None = None, count: int = 8, width: int = 400) -> str:
    """What ``laminar samples`` prints: ``count`` trajectories of one step's record.

    Args:
        order: None (as trained, group by group), ``worst`` / ``best`` (by reward) or
            ``longest`` (by response tokens).

    Raises:
        LaminarError: no records, or no record of ``step``.
    """
    records_dir, _ = find_records(run_dir)
    records = records_in(records_dir)
    if step is None:
        step = max(records)
    if step not in records:
        raise LaminarError(f"no record of step {step} in {records_dir} (steps "
                           f"{min(records)}-{max(records)} are recorded)")
    record = read_step_record(records[step])
    trajs = [t for g in record.groups for t in g.trajectories()]
    if order in ("worst", "best"):
        trajs.sort(key=lambda t: t.reward, reverse=order == "best")
    elif order == "longest":
        trajs.sort(key=lambda t: len(t.response_token_ids), reverse=True)
    rewards = [t.reward for t in trajs]
    out = [f"step {step} (trainer at v{record.version}): {len(trajs)} trajectories in "
           f"{len(record.groups)} groups, reward mean {sum(rewards) / max(1, len(rewards)):.3f}"
           f"{', ' + order + ' first' if order else ''}; {records[step]}"]

    def clip(text: str) -> str:
        text = text.replace("\n", "\\n ")
        return text if len(text) <= width else text[:width] + f"... (+{len(text) - width} chars)"

    for t in trajs[:count]:
        staleness = record.version - t.policy_version
        error = f" REWARD ERROR {t.reward_error}" if t.reward_error else ""
        out.append(f"\n-- {t.trajectory_id}  reward {t.reward:.3f}{error}  v{t.policy_version} "
                   f"(staleness {staleness})  {len(t.response_token_ids)} response tokens, "
                   f"{t.finish_reason}, worker {t.worker_id}"
                   + (f" ({t.engine})" if t.engine else ""))
        prompt = record.prompts.get(t.trajectory_id, "")
        if prompt:
            out.append(f"   prompt:     {clip(prompt)}")
        out.append(f"   completion: {clip(t.completion) if t.completion else '(no text)'}")
    return "\n".join(out)


def find_trajectory(records_dir: str | os.PathLike[str], trajectory_id: str
                    ) -> tuple[StepRecord, Trajectory]:
    """The step record holding ``trajectory_id`` (newest first) and the trajectory.

    Raises:
        LaminarError: no record holds it.
    """
    _, pq = _pa()
    records = records_in(records_dir)
    for path in reversed(records.values()):
        ids = pq.read_table(path, columns=["trajectory_id"]).column(0).to_pylist()
        if trajectory_id in ids:
            record = read_step_record(path)
            traj = next(t for g in record.groups for t in g.trajectories()
                        if t.trajectory_id == trajectory_id)
            return record, traj
    raise LaminarError(f"no step record in {records_dir} holds trajectory {trajectory_id!r} "
                       f"({len(records)} records searched)")
