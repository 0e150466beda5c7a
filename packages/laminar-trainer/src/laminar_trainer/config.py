"""Config of the trainer tier (``laminar-trainer run``): one frozen pydantic model."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from laminar_common.config import (
    AuthConfig,
    EtcdConfig,
    LaminarModel,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
    check_model_dir,
)
from laminar_common.data.records import DataConfig

__all__ = ["TrainerConfig", "BufferConfig", "LossConfig", "OptimConfig", "CheckpointConfig",
           "EvalConfig", "SamplesConfig", "SimulateConfig", "TrackingConfig", "TensorBoardConfig", "WandbConfig"]


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
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: a complete group whose rewards are all equal (zero
    advantage: it teaches nothing) is dropped before the step, counted
    (``groups_filtered``), and the step waits for ``batch_groups`` informative groups;
    the manager is told, and generates that many more groups."""


ALGORITHMS = ("grpo", "dr_grpo", "gspo", "rloo")

# What each algorithm sets when the config leaves a field out (an explicit value wins).
_ALGORITHM_DEFAULTS: dict[str, dict[str, object]] = {
    "grpo": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token-mean"},
    "dr_grpo": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "seq-mean-token-sum-norm"},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "seq-mean-token-mean"},
    "rloo": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token-mean"},
}


class LossConfig(LaminarModel):
    """The policy objective (see laminar_trainer.loss).

    ``algorithm`` picks the advantage estimator and the ratio, and the defaults of
    ``clip_low``, ``clip_high`` and ``aggregation`` (a value given in the config wins;
    ``--print-config`` shows what was resolved):

    - ``grpo``: group-normalised advantages ``(r - mean) / (std + eps)``, per-token
      ratio, token-mean (DAPO); clip 0.2 / 0.28.
    - ``dr_grpo``: Dr. GRPO, advantages only centred (no std), per-token ratio,
      ``seq-mean-token-sum-norm`` (token sums over a constant, ``norm_tokens``).
    - ``gspo``: GSPO, group-normalised advantages, one length-normalised ratio per
      sequence, clipped per sequence; seq-mean-token-mean; clip 3e-4 / 4e-4.
    - ``rloo``: leave-one-out baseline ``r_i - mean_{j != i} r_j``, per-token ratio,
      token-mean.
    """

    algorithm: Literal["grpo", "dr_grpo", "gspo", "rloo"] = "grpo"
    """Advantage estimator and ratio (see above)."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """Lower clip of the ratio (1 - clip_low). Default by algorithm: 0.2 (gspo 3e-4)."""
    clip_high: float = Field(default=0.28, ge=0)
    """Upper clip of the ratio (1 + clip_high), DAPO clip-higher. Default by algorithm:
    0.28 (gspo 4e-4)."""
    correction: Literal["decoupled", "tis", "none"] = "decoupled"
    """Off-policy correction against the behaviour log-probs."""
    tis_cap: float = Field(default=2.0, ge=1)
    """Truncation of the importance weight."""
    proximal: Literal["recompute", "loglinear"] = "recompute"
    """Where decoupled PPO's proximal log-probs (the weights at the step's start) come from
    for the step's second and later updates (the first update's own forward is exact):
    ``recompute``, a no-grad forward over those mini-batches before the first update;
    ``loglinear`` (AReaL's ``prox_logp_method: loglinear``), no forward: interpolated in
    log space between the behaviour log-probs and the current ones by policy version,
    ``log mu + a (log pi - log mu)`` with ``a = s / (s + u / U)`` for a trajectory ``s``
    versions stale at update ``u`` of ``U`` (``s = 0``: the behaviour log-probs). Needs
    ``correction: decoupled`` and ``publish_every: 1``."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                         "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses are reduced over a mini-batch (exactly, across micro-batches and
    ranks). Default by algorithm: token-mean (dr_grpo seq-mean-token-sum-norm, gspo
    seq-mean-token-mean)."""
    norm_tokens: int | None = Field(default=None, ge=1)
    """The constant of seq-mean-token-sum-norm (Dr. GRPO); unset: the generation budget,
    the largest ``max_tokens`` the mini-batch's trajectories were sampled with."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL to the initial (reference) policy; 0 turns it off."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus (the loss minus entropy_coef x the mean token entropy,
    aggregated like the policy loss); the entropy is a metric whatever its weight."""
    overlong_filter: bool = False
    """DAPO overlong filtering: completions cut at max_tokens (finish_reason "length")
    are left out of the loss (they still count in their group's advantages)."""
    overlong_buffer: int = Field(default=0, ge=0)
    """DAPO soft overlong punishment: a completion in the last ``overlong_buffer`` tokens
    of its ``max_tokens`` budget loses up to ``overlong_penalty`` reward, linearly in how
    far it went into that zone (0: off). Applied before the advantages."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Largest soft overlong penalty (reached at max_tokens)."""

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        algorithm = data.get("algorithm", "grpo")
        defaults = _ALGORITHM_DEFAULTS.get(algorithm) if isinstance(algorithm, str) else None
        if defaults is None:
            return data  # an unknown algorithm: the field's own error names it
        return {**defaults, **data}

    @model_validator(mode="after")
    def _proximal_needs_decoupled(self) -> LossConfig:
        if self.proximal == "loglinear" and self.correction != "decoupled":
            raise ValueError(f"loss.proximal: loglinear approximates decoupled PPO's proximal "
                             f"log-probs; loss.correction is {self.correction!r}")
        return self


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
    mini_batches: int = Field(default=1, ge=1)
    """PPO mini-batches per trainer step: the step's ``batch_groups`` are split into this
    many equal mini-batches, one optimizer update each (``batch_groups`` must be a
    multiple). The proximal log-probs are computed once per step before the first
    update, so the clip acts from the second update on. One weight version per step."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the step's mini-batches (PPO epochs): ``mini_batches x epochs``
    optimizer updates per trainer step."""
    shuffle: bool = True
    """Shuffle the step's groups (whole groups) before splitting them into mini-batches,
    seeded by ``seed`` and the groups' prompt ids (the same order on every rank). Groups
    arrive in completion order, short answers first, so unshuffled mini-batches are
    sorted by length and each update sees one length bucket. No effect with one
    mini-batch."""
    stream: bool = False
    """Stream the step's mini-batches: its first update starts as soon as
    ``batch_groups / mini_batches`` groups are complete, and each later update waits only
    for its own mini-batch, so generating the step's long answers overlaps training on
    its short ones. With ``max_staleness`` 0 every step trains on data of its start
    weights without waiting for the whole batch. Mini-batches are in arrival order
    (needs ``shuffle`` false), advantages are computed within each, decoupled PPO needs
    ``loss.proximal: loglinear`` (the later mini-batches arrive after the weights moved),
    and the trainer runs in one process (not under torchrun)."""
    micro_batch_groups: int = Field(default=0, ge=0)
    """Groups per forward/backward on each rank (gradient accumulation inside a
    mini-batch); 0 = the rank's whole mini-batch at once. The loss is normalised over the
    whole mini-batch, so any split gives the same gradient."""
    micro_batch_tokens: int = Field(default=0, ge=0)
    """Instead of ``micro_batch_groups``: split each mini-batch by padded size, at most
    about this many token positions (rows x the longest row) per forward/backward, with
    the trajectories (not whole groups) sorted by length so short answers are not padded
    to the long tail's length (as verl's dynamic batch size). Every rank runs the same
    number of micro-batches. Same gradient as any other split; 0: off."""


    @model_validator(mode="after")
    def _stream_in_arrival_order(self) -> OptimConfig:
        if self.stream and self.shuffle and self.mini_batches > 1:
            raise ValueError("optim.stream trains each mini-batch as its groups arrive, so "
                             "they cannot be shuffled first: set optim.shuffle false")
        return self


class CheckpointConfig(LaminarModel):
    """Checkpoints (atomic; resume with --resume)."""

    dir: str | None = None
    """Checkpoint directory (none: no checkpoints)."""
    every_steps: int = Field(default=5, ge=1)
    """Checkpoint (and durably ack) every this many steps."""
    keep: int = Field(default=2, ge=1)
    """Checkpoints kept."""
    format: Literal["full", "sharded"] = "full"
    """full: rank 0 gathers the whole model and optimizer state and writes a Hugging Face
    model directory beside it. sharded: every rank of a torchrun trainer writes its own
    shards (torch.distributed.checkpoint; nothing gathered; the directory must be on a
    filesystem the ranks share); resumes on any number of ranks, one process included;
    ``laminar-trainer export`` makes a model directory of it."""


class EvalConfig(LaminarModel):
    """Held-out evaluation: greedy accuracy (and pass@k) on a dataset in the job's schema."""

    prompts: str | None = None
    """Held-out JSONL or parquet, read like the rollout's prompt file (see ``data``);
    none: no eval."""
    data: DataConfig = DataConfig()
    """Keys of the held-out file (prompt_key, answer_key, id_key, system_prompt,
    chat_template), as the manager's ``data``."""
    reward: str = "synthetic"
    """Reward that scores completions: a built-in name (synthetic, the demo's tasks,
    needs laminar-examples; exact, math, gsm8k) or ``package.module:function`` (the
    worker's contract)."""
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


class SamplesConfig(LaminarModel):
    """Sample completions logged with their rewards (``samples.jsonl`` and trackers)."""

    every_steps: int = Field(default=10, ge=0)
    """Log samples every this many steps (0: never)."""
    count: int = Field(default=4, ge=1)
    """Completions logged each time (from the step's batch)."""


class RecordsConfig(LaminarModel):
    """Step records: what every step trained on, one Parquet file a step (``laminar
    samples`` shows them, ``laminar replay`` recomputes a step from them)."""

    enabled: bool = True
    """Write a record for every step (the switch for jobs where their size matters)."""
    dir: str | None = None
    """Where they go (default: ``records`` in ``checkpoint.dir``, else in ``run_dir``)."""
    keep_steps: int | None = Field(default=1000, ge=1)
    """Records kept, newest first (null: all)."""


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


class TrainerConfig(ListenConfig):
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
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port workers push trajectories to, on ``bind_host`` (0: any free port;
    advertised in etcd)."""
    listen: str | None = None
    """A whole ZeroMQ endpoint to bind instead of ``bind_host``:``port`` (e.g.
    ``inproc://`` in tests); advertised as bound."""
    batch_groups: int = Field(default=8, ge=1)
    """Complete GRPO groups consumed per step."""
    total_steps: int = Field(default=20, ge=1)
    """Steps to train; the trainer exits 0 after the last one."""
    publish_every: int = Field(default=1, ge=1)
    """Publish weights every this many steps."""
    max_unpublished_steps: int | None = Field(default=None, ge=0)
    """What training does while no new weights reach the relays (a master relay failing
    over, relays cut off): None trains on, on whatever trajectories the manager still
    admits within its staleness bound (``max_staleness``), which stops admission
    ``max_staleness + 1`` batches past the newest published version. N pauses training
    once this trainer is more than N steps (beyond ``publish_every``) ahead of the
    newest version the relays took, saying so, until publishing recovers: no update is
    taken on data whose weights lag further. The console says what happens either way."""
    temperature: float | None = Field(default=None, gt=0)
    """Log-probs are computed at each trajectory's own sampling temperature (it travels
    on the trajectory). Set this to fix one: a trajectory sampled at another temperature
    is then rejected (reason ``bad-sampling``) instead of trained at the wrong one."""
    max_rejections: int = Field(default=3, ge=1)
    """A trajectory id whose copies fail content validation this many times is given
    up on: its group trains without it and the manager records it as rejected (before
    that, each rejected copy is generated again)."""
    wait_timeout_s: float = Field(default=600.0, gt=0)
    """Give up if the data a step waits for (its whole batch; with ``optim.stream``, each
    mini-batch) does not arrive for this long."""
    on_data_exhausted: Literal["fail", "finish"] = "fail"
    """When the manager says its prompts are exhausted and nothing is left to generate
    before ``total_steps`` (two checks 15 s apart): ``fail`` at once naming the cause, or
    ``finish`` the run there, with its final eval, final model and summary
    (``ended_early``). ``laminar up`` refuses a job whose prompts cannot last beforehand."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision. float32: everything in fp32. bfloat16: mixed precision, the
    master weights and the optimizer state stay fp32 and forward/backward run under
    ``torch.autocast(dtype=bfloat16)`` (FSDP2 under torchrun: ``MixedPrecisionPolicy``,
    bf16 parameters in the forward, fp32 gradient reduction); log-probs are computed in
    fp32 from the logits either way."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them
    (less memory for long sequences and large models, about a third more compute)."""
    publish_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the floating-point weights published to the relays: the rollout engines'
    dtype (bfloat16 carries half the bytes of float32); engines cast what arrives into
    their own dtype. Checkpoints and the final model keep the fp32 master weights."""
    publish_delta_full_every: int = Field(default=0, ge=0)
    """0: every version is published in full. K > 0: a version is published as a delta
    against the one before (per tensor, the elements whose published bits changed,
    about 3x their share of the bytes), with a full version every K versions and
    whenever the master relay changed or the delta would be at least half the full
    bytes; rollouts rebuild it bit-exact over the version they hold (checked against
    the full version's checksums). Pays when rollouts fetch over the network (other
    hosts); same-host rollouts read full versions from shared memory without a copy.
    Costs the trainer one host copy of the published weights."""
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
    samples: SamplesConfig = SamplesConfig()
    """Sample completions in the run dir and the trackers."""
    records: RecordsConfig = RecordsConfig()
    """Step records (what each step trained on, for ``laminar samples`` and ``replay``)."""
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

    @model_validator(mode="after")
    def _mini_batches_divide(self) -> TrainerConfig:
        if self.batch_groups % self.optim.mini_batches:
            raise ValueError(f"optim.mini_batches ({self.optim.mini_batches}) must divide "
                             f"batch_groups ({self.batch_groups})")
        if (self.optim.stream and self.loss.correction == "decoupled"
                and self.loss.proximal == "recompute"
                and self.optim.mini_batches * self.optim.epochs > 1):
            raise ValueError("optim.stream: the later mini-batches arrive after the first "
                             "updates, when the step's start weights are gone, so loss."
                             "proximal recompute cannot run; set loss.proximal loglinear")
        if self.loss.proximal == "loglinear" and self.publish_every != 1:
            raise ValueError(f"loss.proximal: loglinear counts staleness in versions of one "
                             f"step each; publish_every is {self.publish_every}, must be 1")
        return self

    @property
    def final_model_dir(self) -> Path:
        """``final_dir``, or ``<run_dir>/final`` when it is unset."""
        return Path(self.final_dir) if self.final_dir is not None else Path(self.run_dir) / "final"
