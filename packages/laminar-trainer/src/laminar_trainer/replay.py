"""Replay one trainer step: recompute it from the checkpoint before it and its record.

``laminar-trainer replay RUN --step N`` (and ``laminar replay``) loads the checkpoint
of step ``N - 1`` (weights, optimizer, schedule, RNG) and the step record of step
``N`` (:mod:`laminar_trainer.records`), runs the trainer's own ``train_step`` on the
record's groups with the record's configuration, and compares every weight with the
checkpoint of step ``N``. On the CPU in the same environment the result is bit-exact;
otherwise each differing tensor is named with its largest difference.

A step is replayable when its record and the checkpoints at both ends exist
(``checkpoint.every_steps: 1`` and a ``checkpoint.keep`` that covers it), its
training step was real (not ``simulate``), one process trained it (no FSDP ranks) and
its mini-batches were not streamed (``optim.stream``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from laminar_common.data.provenance import find_records, read_step_record, records_in
from laminar_common.errors import LaminarError

from .buffer import Group
from .config import TrainerConfig

__all__ = ["ReplayResult", "replay_step", "replayable_steps", "main"]


@dataclass
class ReplayResult:
    step: int
    exact: bool
    tensors: int
    differing: dict[str, float] = field(default_factory=dict)
    """Tensor name -> largest absolute difference from the checkpoint after the step."""
    loss: float | None = None

    def describe(self) -> str:
        if self.exact:
            return (f"step {self.step}: replayed bit-exact ({self.tensors} tensors equal the "
                    f"checkpoint after it)")
        worst = sorted(self.differing.items(), key=lambda kv: -kv[1])[:10]
        return (f"step {self.step}: {len(self.differing)} of {self.tensors} tensors differ "
                "from the checkpoint after it; largest differences: "
                + ", ".join(f"{k} {v:.3g}" for k, v in worst)
                + ". Expected where the step ran elsewhere (another device, thread count "
                "or torch build, non-deterministic kernels); on the same machine and "
                "environment it means the record or a checkpoint is not what was trained")


def replayable_steps(records_dir: Path, ckpt_dir: Path) -> list[int]:
    have = {int(p.name.removeprefix("step-")) for p in ckpt_dir.glob("step-*")
            if p.is_dir() and not p.name.endswith(".tmp")}
    return [s for s in records_in(records_dir) if s in have and s - 1 in have]


def _config(record) -> TrainerConfig:
    data = dict(record.config)
    data.pop("tracking", None)  # secrets are masked there; nothing of it trains
    try:
        return TrainerConfig.model_validate(data)
    except ValueError as exc:
        raise LaminarError(f"step record {record.path}: its trainer config does not "
                           f"validate here: {exc}") from exc


def replay_step(records_dir: Path, ckpt_dir: Path, step: int) -> ReplayResult:
    """Recompute step ``step`` and compare it with its checkpoint.

    Raises:
        LaminarError: the step is not replayable (says why).
    """
    from .policy import build_training, restore_training
    from .step import train_step

    records = records_in(records_dir)
    if step not in records:
        raise LaminarError(f"no record of step {step} in {records_dir} (records of steps "
                           f"{_span(list(records))})")
    before, after = ckpt_dir / f"step-{step - 1:08d}", ckpt_dir / f"step-{step:08d}"
    for path in (before, after):
        if not path.is_dir():
            raise LaminarError(
                f"step {step} needs the checkpoints of steps {step - 1} and {step}; {path} "
                f"is missing (replayable steps: "
                f"{_span(replayable_steps(records_dir, ckpt_dir))}; checkpoint every step "
                "and keep enough of them to replay any)")
    record = read_step_record(records[step])
    cfg = _config(record)
    if cfg.simulate is not None:
        raise LaminarError(f"step {step} was a simulated step (simulate): nothing to replay")
    if int(record.meta.get("world_size", "1")) > 1:
        raise LaminarError(f"step {step} was trained by {record.meta['world_size']} FSDP "
                           "ranks: a replay in one process does not reproduce their "
                           "reduction order; not replayable")
    if cfg.optim.stream:
        raise LaminarError(f"step {step} streamed its mini-batches (optim.stream): its "
                           "groups came while it trained, in an order the record does not "
                           "keep; not replayable")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    training = build_training(cfg, None, before)
    state = restore_training(training, before, None)
    if state is None or state.step != step - 1:
        raise LaminarError(f"checkpoint {before} holds step "
                           f"{None if state is None else state.step}, not {step - 1}")
    groups = [Group(g.prompt_id, g.group_size, dict(g.members), g.weight, set(g.failed),
                    g.group_seq) for g in record.groups]
    result = train_step(training.model, training.optimizer, training.scheduler, groups, cfg,
                        ref_model=training.ref_model, version=record.version)
    expected = build_training(cfg, None, after).model.state_dict()
    got = training.model.state_dict()
    differing = {}
    for name, tensor in got.items():
        ref = expected.get(name)
        if ref is None or ref.shape != tensor.shape:
            differing[name] = float("inf")
        elif not torch.equal(ref, tensor):
            differing[name] = float((ref.double() - tensor.double()).abs().max())
    return ReplayResult(step, not differing, len(got), differing, result.loss)


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) \
        else ", ".join(map(str, steps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="laminar-trainer replay", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's directory (or its trainer's run_dir)")
    p.add_argument("--step", type=int, help="the step to recompute (default: list the "
                   "replayable steps)")
    args = p.parse_args(argv)
    try:
        records_dir, ckpt_dir = find_records(args.run_dir)
        if args.step is None:
            print(f"replayable steps: {_span(replayable_steps(records_dir, ckpt_dir))} "
                  f"(records in {records_dir}, checkpoints in {ckpt_dir})")
            return 0
        result = replay_step(records_dir, ckpt_dir, args.step)
    except LaminarError as exc:
        print(f"laminar replay: {exc}", file=sys.stderr)
        return 2
    print(result.describe())
    return 0 if result.exact else 1


if __name__ == "__main__":
    sys.exit(main())
