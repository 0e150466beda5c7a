"""Config of the trainer tier (``laminar-trainer run``): one frozen pydantic model."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from laminar_common.config import (
    AuthConfig,
    EtcdConfig,
    LaminarModel,
    LoggingConfig,
    MetricsConfig,
    check_model_dir,
)
from laminar_common.data.records import DataConfig

__all__ = ["TrainerConfig", "BufferConfig", "LossConfig", "OptimConfig", "CheckpointConfig",
           "EvalConfig", "SimulateConfig", "TrackingConfig", "TensorBoardConfig", "WandbConfig"]


class BufferConfig(LaminarModel):
    """The experience buffer."""

    capacity: int = Field(default=8192, ge=1)
    """Most trajectories held; beyond it trajectories of new groups are refused (not
    acked: workers push them again after resend_after_s), members of buffered groups
    are still taken so that partial groups can complete."""
    policy: Literal["fifo", "staleness"] = "fifo"
    """fifo: oldest complete groups first; staleness: also bound staleness."""
    max_staleness: int = Field(default=4, ge=0)
    """With policy=staleness: groups staler than this are dropped or down-weighted."""
    stale_action: Literal["drop", "downweight"] = "drop"
    """What happens to a group beyond max_staleness."""
    downweight: float = Field(default=0.5, ge=0, le=1)
    """Advantage scale of a down-weighted group."""


class LossConfig(LaminarModel):
    """The GRPO/PPO objective (see laminar_trainer.loss)."""

    clip_low: float = Field(default=0.2, ge=0)
    """Lower clip of the ratio (1 - clip_low)."""
    clip_high: float = Field(default=0.28, ge=0)
    """Upper clip of the ratio (1 + clip_high), DAPO clip-higher."""
    correction: Literal["decoupled", "tis", "none"] = "decoupled"
    """Off-policy correction against the behaviour log-probs."""
    tis_cap: float = Field(default=2.0, gt=0)
    """Truncation of the importance weight."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses are reduced."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL to the initial (reference) policy; 0 turns it off."""


class OptimConfig(LaminarModel):
    """Optimizer and schedule."""

    lr: float = Field(default=1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR after warm-up."""
    micro_batch_groups: int = Field(default=0, ge=0)
    """Groups per forward/backward (gradient accumulation); 0 = the whole step at once."""


class CheckpointConfig(LaminarModel):
    """Checkpoints (atomic; resume with --resume)."""

    dir: str | None = None
    """Checkpoint directory (none: no checkpoints)."""
    every_steps: int = Field(default=5, ge=1)
    """Checkpoint (and durably ack) every this many steps."""
    keep: int = Field(default=2, ge=1)
    """Checkpoints kept."""


class EvalConfig(LaminarModel):
    """Held-out evaluation: greedy accuracy (and pass@k) on a dataset in the job's schema."""

    prompts: str | None = None
    """Held-out JSONL or parquet, read like the rollout's prompt file (see ``data``);
    none: no eval."""
    data: DataConfig = DataConfig()
    """Keys of the held-out file (prompt_key, answer_key, id_key, system_prompt,
    chat_template), as the manager's ``data``."""
    reward: str = "synthetic"
    """Reward that scores completions: a built-in name (synthetic, exact, math, gsm8k)
    or ``package.module:function`` (the worker's contract)."""
    every_steps: int = Field(default=0, ge=0)
    """Evaluate every this many steps (0: only before and after)."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Decoding budget per completion."""
    limit: int = Field(default=200, ge=1)
    """Records evaluated (the file's first ones)."""
    samples: int = Field(default=0, ge=0)
    """k of pass@k: completions sampled per record at ``temperature`` (0: greedy only)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the pass@k samples."""
    pass_threshold: float = 1.0
    """A sampled completion passes when its reward is at least this."""
    seed: int = 0
    """Seed of the pass@k sampling (the same on every rank)."""


class SimulateConfig(LaminarModel):
    """A simulated training step, for scheduling benchmarks (no model is loaded)."""

    step_s: float = Field(default=0.5, ge=0)
    """Seconds one simulated step takes (the loop sleeps)."""
    weight_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    """Size of the simulated weights published each step."""


class TensorBoardConfig(LaminarModel):
    """TensorBoard event files (needs the ``tensorboard`` package)."""

    dir: str | None = None
    """Event-file directory (none: no TensorBoard)."""


class WandbConfig(LaminarModel):
    """Weights & Biases run (needs the ``wandb`` package)."""

    project: str | None = None
    """W&B project (none: no W&B)."""
    mode: Literal["online", "offline", "disabled"] = "offline"
    """online: stream to the W&B server; offline: write locally (``wandb sync`` later);
    disabled: no W&B even with project set."""
    run_name: str | None = None
    """Display name of the run (none: the trainer_id)."""
    dir: str | None = None
    """Where wandb writes its files (none: run_dir)."""


class TrackingConfig(LaminarModel):
    """Optional experiment trackers fed with the metrics.jsonl rows (all off by default)."""

    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """TensorBoard (on when tensorboard.dir is set)."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases (on when wandb.project is set and mode is not disabled)."""


class TrainerConfig(LaminarModel):
    """Config of ``laminar-trainer run``."""

    job: str = "laminar"
    """Job name."""
    trainer_id: str = Field(default_factory=lambda: f"trainer-{socket.gethostname()}")
    """Member id."""
    model_dir: str | None = None
    """Warm-started model + tokenizer (save_pretrained dir); required unless simulate is set.
    Checked when the config loads: the directory must exist and hold a config.json."""
    simulate: SimulateConfig | None = None
    """Simulated training step instead of a model (benchmarks only)."""
    listen: str = "tcp://127.0.0.1:0"
    """ZeroMQ endpoint workers push trajectories to."""
    batch_groups: int = Field(default=8, ge=1)
    """Complete GRPO groups consumed per step."""
    total_steps: int = Field(default=20, ge=1)
    """Steps to train; the trainer exits 0 after the last one."""
    publish_every: int = Field(default=1, ge=1)
    """Publish weights every this many steps."""
    temperature: float | None = Field(default=None, gt=0)
    """Log-probs are computed at each trajectory's own sampling temperature (it travels
    on the trajectory). Set this to fix one: a trajectory sampled at another temperature
    is then rejected (reason ``bad-sampling``) instead of trained at the wrong one."""
    max_rejections: int = Field(default=3, ge=1)
    """A trajectory id whose copies fail content validation this many times is given
    up on: its group trains without it and the manager records it as rejected (before
    that, each rejected copy is generated again)."""
    wait_timeout_s: float = Field(default=600.0, gt=0)
    """Give up if no full step of data arrives for this long."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision. float32: everything in fp32. bfloat16: mixed precision, the
    master weights and the optimizer state stay fp32 and forward/backward run under
    ``torch.autocast(dtype=bfloat16)`` (FSDP2 under torchrun: ``MixedPrecisionPolicy``,
    bf16 parameters in the forward, fp32 gradient reduction); log-probs are computed in
    fp32 from the logits either way."""
    publish_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the floating-point weights published to the relays: the rollout engines'
    dtype (bfloat16 carries half the bytes of float32); engines cast what arrives into
    their own dtype. Checkpoints and the final model keep the fp32 master weights."""
    final_dir: str | None = None
    """Where the trained model is saved when the last step is done (a clean Hugging Face
    directory: safetensors, config.json, generation_config.json, tokenizer); unset:
    ``<run_dir>/final``. Always written, with or without checkpoints."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains: auto = CUDA (cuda:LOCAL_RANK) when available, else CPU.
    Under torchrun (WORLD_SIZE > 1) the model is sharded with FSDP2 over the ranks."""
    buffer: BufferConfig = BufferConfig()
    """Experience buffer."""
    loss: LossConfig = LossConfig()
    """Objective."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    run_dir: str = "runs/latest"
    """Metrics (metrics.jsonl), consumed-id log and summary go here."""
    tracking: TrackingConfig = TrackingConfig()
    """Metric rows also sent to TensorBoard and/or Weights & Biases (off by default)."""
    seed: int = 0
    """Seed of torch."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads."""
    metrics: MetricsConfig = MetricsConfig()
    """Prometheus /metrics endpoint (off unless metrics.port is set)."""
    auth: AuthConfig = AuthConfig()
    """Authentication (CURVE on ZeroMQ, TLS to relays); off unless auth.dir is set."""
    etcd: EtcdConfig = EtcdConfig()
    """etcd connection and lease."""
    logging: LoggingConfig = LoggingConfig()
    """Log level and format."""

    @field_validator("model_dir")
    @classmethod
    def _model_dir_exists(cls, value: str | None) -> str | None:
        # Here, not when the model loads: a typo fails at once (and --print-config shows
        # it) with this field's path, not later as a Hugging Face "repo id" error.
        return value if value is None else check_model_dir(value)

    @property
    def final_model_dir(self) -> Path:
        """``final_dir``, or ``<run_dir>/final`` when it is unset."""
        return Path(self.final_dir) if self.final_dir is not None else Path(self.run_dir) / "final"
