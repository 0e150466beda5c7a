"""What the trainer's step loop trains: a real model or a simulated step, behind one interface.

The service (``laminar_trainer.service``) drives a :class:`PolicyBackend` and never asks
which one it holds:

- :class:`ModelBackend`: the model, tokenizer, optimizer and schedule of
  :func:`~laminar_trainer.policy.build_training`, in one process or as rank 0 of
  torchrun (every collective goes through the :class:`~laminar_trainer.distributed.DistContext`);
- :class:`SimulatedBackend`: ``simulate`` in the config (benchmarks of the other tiers): a
  step sleeps ``simulate.step_s``, a version is ``simulate.weight_bytes`` of synthetic
  bytes, a checkpoint holds the consumed ids only, and there is nothing to evaluate.

:func:`make_backend` picks one from the config. A backend never references the service.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .buffer import Group
from .checkpoint import TrainerState, load_checkpoint, save_checkpoint, save_model_dir
from .config import TrainerConfig
from .distributed import DistContext, save_sharded
from .policy import Training, build_training, evaluate_records, restore_training
from .precision import torch_dtype
from .publisher import Snapshot, snapshot_model, snapshot_state
from .step import StepResult, train_step

__all__ = ["ModelBackend", "PolicyBackend", "SimulatedBackend", "make_backend"]

MoreGroups = Callable[[int], list[Group]]
"""A streamed step's source of its later mini-batches (``optim.stream``)."""


class PolicyBackend:
    """The trainer's policy, real or simulated (see the module docstring)."""

    simulated: bool = False
    """True for a simulated step (the summary's ``simulated_step``)."""
    model: Any = None
    tokenizer: Any = None
    optimizer: Any = None
    scheduler: Any = None
    vocab_size: int | None = None
    """The model's vocabulary, which every trajectory's token ids must lie in (None: no
    check, a simulated step)."""

    @property
    def can_evaluate(self) -> bool:
        """Whether held-out evals run (``eval.prompts``)."""
        return not self.simulated

    @property
    def can_stream(self) -> bool:
        """Whether a step may start on its first mini-batch (``optim.stream``)."""
        return not self.simulated

    def load(self, checkpoint: Path | None) -> TrainerState | None:
        """Build the policy, from ``checkpoint`` when given; returns the checkpoint's
        trainer state (None: a fresh start)."""
        raise NotImplementedError

    def snapshot(self, version: int, step: int) -> Snapshot:
        """The weights to publish as ``version``."""
        raise NotImplementedError

    def train(self, groups: list[Group], version: int, more: MoreGroups | None) -> StepResult:
        """One optimizer step on ``groups`` (generated for weights up to ``version``)."""
        raise NotImplementedError

    def checkpoint(self, state: TrainerState) -> None:
        """Write a checkpoint of the policy with ``state`` (``checkpoint.dir``)."""
        raise NotImplementedError

    def save_final(self) -> Path | None:
        """Save the trained model as a Hugging Face directory; None where there is none."""
        raise NotImplementedError

    def evaluate(self, records: list[dict]) -> Any:
        """The held-out :class:`~laminar_trainer.evaluation.EvalResult` of ``records``."""
        raise NotImplementedError


class ModelBackend(PolicyBackend):
    """A real model: one process, or rank 0 driving the other ranks through ``dist``."""

    def __init__(self, config: TrainerConfig, dist: DistContext | None) -> None:
        self.config = config
        self.dist = dist
        self.training: Training | None = None
        self.ref_model: Any = None

    def load(self, checkpoint: Path | None) -> TrainerState | None:
        # One process reads a checkpoint's weights once, at build; ranks get them sharded
        # from rank 0 in restore_training.
        weights = checkpoint if self.dist is None else None
        t = self.training = build_training(self.config, self.dist, weights)
        self.model, self.tokenizer, self.ref_model = t.model, t.tokenizer, t.ref_model
        self.optimizer, self.scheduler = t.optimizer, t.scheduler
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        return restore_training(t, checkpoint, self.dist)

    def snapshot(self, version: int, step: int) -> Snapshot:
        dtype = torch_dtype(self.config.publish_dtype)
        if self.dist is None:
            return snapshot_model(self.model, version, step, dtype=dtype)
        t0 = time.perf_counter()
        # Gathered tensor by tensor, cast on the device: fresh CPU copies already.
        full = self.dist.gather_for_publish(self.model, dtype)
        return snapshot_state(full, version, step, time.perf_counter() - t0, copy=False)

    def train(self, groups: list[Group], version: int, more: MoreGroups | None) -> StepResult:
        if self.dist is not None:
            return train_step(self.model, self.optimizer, self.scheduler,
                              self.dist.send_step(groups, version), self.config,
                              ref_model=self.ref_model, dist=self.dist, version=version)
        return train_step(self.model, self.optimizer, self.scheduler, groups, self.config,
                          ref_model=self.ref_model, version=version, more=more)

    def checkpoint(self, state: TrainerState) -> None:
        cfg = self.config
        full: dict[str, Any] = {"model_state": None, "optimizer_state": None}
        if cfg.checkpoint.format == "sharded":
            save = save_sharded if self.dist is None else self.dist.save_sharded
            model, optimizer = self.model, self.optimizer
            full["write_sharded"] = lambda path: save(model, optimizer, path)
        elif self.dist is not None:
            full["model_state"], full["optimizer_state"] = self.dist.gather_for_checkpoint(
                self.model, self.optimizer)
        save_checkpoint(cfg.checkpoint.dir, self.model, self.tokenizer, self.optimizer, state,
                        keep=cfg.checkpoint.keep, **full)

    def save_final(self) -> Path | None:
        full = self.dist.gather_for_publish(self.model) if self.dist is not None else None
        return save_model_dir(self.config.final_model_dir, self.model, self.tokenizer,
                              state_dict=full)

    def evaluate(self, records: list[dict]) -> Any:
        if self.dist is not None:
            self.dist.send_eval(records, self.config.eval.max_new_tokens)
        return evaluate_records(self.training, records, self.config)


class SimulatedBackend(PolicyBackend):
    """A simulated step (``simulate``): no model, synthetic weights, a fixed step time."""

    simulated = True

    def __init__(self, config: TrainerConfig) -> None:
        assert config.simulate is not None
        self.config = config
        self.simulate = config.simulate

    def load(self, checkpoint: Path | None) -> TrainerState | None:
        return None if checkpoint is None else load_checkpoint(checkpoint, None)

    def snapshot(self, version: int, step: int) -> Snapshot:
        t0 = time.perf_counter()
        # Zeros but for every 200th byte from an offset that moves with the version, so
        # consecutive versions differ in 1% of their bytes.
        raw = bytearray(self.simulate.weight_bytes)
        marks = range(version % 200, len(raw), 200)
        raw[marks.start::200] = bytes([version % 251 + 1]) * len(marks)
        blob = memoryview(raw)
        return Snapshot(version, step, [("simulated.weights", "uint8", (blob.nbytes,), blob)],
                        blob.nbytes, time.perf_counter() - t0)

    def train(self, groups: list[Group], version: int, more: MoreGroups | None) -> StepResult:
        time.sleep(self.simulate.step_s)
        return StepResult.simulated(groups)

    def checkpoint(self, state: TrainerState) -> None:
        save_checkpoint(self.config.checkpoint.dir, None, None, None, state,
                        keep=self.config.checkpoint.keep, model_state=None, optimizer_state=None)

    def save_final(self) -> Path | None:
        return None

    def evaluate(self, records: list[dict]) -> Any:
        raise RuntimeError("a simulated step has no model to evaluate (can_evaluate is False)")


def make_backend(config: TrainerConfig, dist: DistContext | None) -> PolicyBackend:
    """The backend the config asks for: :class:`SimulatedBackend` with ``simulate``, else
    :class:`ModelBackend` (built by :meth:`PolicyBackend.load`)."""
    return SimulatedBackend(config) if config.simulate is not None else ModelBackend(config,
                                                                                      dist)
