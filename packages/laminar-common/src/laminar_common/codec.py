"""Wire protocol and codec: every message that crosses a process boundary.

Owns ``PROTOCOL_VERSION``, the message types and their one encoding. A frame
is ``MAGIC (4 bytes) | protocol version (uint16, big endian) | msgpack body``;
the body is a msgspec struct tagged by its ``kind``. Nothing is pickled.

Invariants:

- :func:`decode` either returns a fully validated message or raises
  :class:`~laminar_common.errors.ProtocolError`; it never returns something
  half-parsed. Size is checked before parsing.
- Changing a message incompatibly means bumping ``PROTOCOL_VERSION``; peers
  with another version are refused at handshake and per frame.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Union

import msgspec

from laminar_common.errors import ProtocolError

__all__ = [
    "trajectory_seed",
    "PROTOCOL_VERSION",
    "MAGIC",
    "DEFAULT_MAX_FRAME_BYTES",
    "Message",
    "Hello",
    "Welcome",
    "Refused",
    "SamplingSpec",
    "PromptTask",
    "ConversationState",
    "KvCache",
    "KvRef",
    "KvFetch",
    "KvMissing",
    "kv_digest",
    "KV_DTYPES",
    "Trajectory",
    "PartialProgress",
    "Ack",
    "TrajectoryRejected",
    "GroupsFiltered",
    "WorkerReport",
    "Command",
    "PullWeights",
    "ExportTrajectories",
    "Acked",
    "GenerationRejected",
    "TensorSpec",
    "ChunkSpec",
    "WeightManifest",
    "encode",
    "decode",
    "peek_version",
]

PROTOCOL_VERSION = 11
"""11: :class:`WorkerReport` carries ``trainer_down_s``, how long the worker's link to the
trainer has been down (the manager re-generates elsewhere what a worker cut off from a
trainer that others reach cannot deliver). 10: :class:`Trajectory` carries ``engine``, the engine (and its library's version) that
generated it, for the trainer's step records. 9: a migrated :class:`PromptTask`'s ``kv`` may be a :class:`KvRef` (the cache waits on
the source worker, and the destination fetches it from there with :class:`KvFetch`,
answered by the :class:`KvCache` or :class:`KvMissing`). 8: a migrated :class:`PromptTask` may carry its attention cache (:class:`KvCache`), so
the destination worker skips the re-prefill; :class:`PartialProgress` may carry only the
tokens since the last report (``offset``), batched in :class:`WorkerReport` ``progress``. 7: :class:`Trajectory` carries ``observation_spans`` (multi-turn: the response tokens an
environment added, never trained on; behaviour log-probs cover only the generated ones);
a migrated :class:`PromptTask` carries its :class:`ConversationState`.
6: member records carry ``host_id`` (same-host decisions compare it, not host
names) and a relay's fetch reply names its host id. 5: :class:`Trajectory` carries its task's ``data_source`` (the dataset it came
from, for per-source metrics); adds :class:`GroupsFiltered` (trainer -> manager,
dynamic sampling). 4: :class:`PromptTask` carries chat ``messages`` and nested
JSON ``metadata`` (a record's fields as the dataset holds them); :class:`Trajectory` carries the
:class:`SamplingSpec` it was generated with, so the trainer computes log-probs at
the same temperature. 3: the stringly ``Command(action=...)`` becomes one tagged struct per command
(:class:`PullWeights`, :class:`ExportTrajectories`, :class:`Acked`,
:class:`GenerationRejected`). 2: adds :class:`TrajectoryRejected` (trainer -> manager) and the group watermark
(``group_seq``, ``settled_below``) of :class:`PromptTask` and :class:`Trajectory`."""
MAGIC = b"LMNR"
_HEADER = struct.Struct(">4sH")
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class _Msg(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    """Base of every wire message (tagged by class name in ``kind``)."""


class Hello(_Msg, tag="hello"):
    """First message on a connection: who I am and what I speak."""

    member_id: str
    role: str
    protocol_version: int
    package_version: str = ""
    capacity: int = 0


class Welcome(_Msg, tag="welcome"):
    """Reply to an accepted :class:`Hello`."""

    member_id: str
    protocol_version: int


class Refused(_Msg, tag="refused"):
    """Reply to a refused :class:`Hello` (or frame); ``reason`` is for humans."""

    reason: str


def trajectory_seed(base: int, trajectory_id: str) -> int:
    """A trajectory's own sampling seed, from a job's ``sampling.seed`` and its id: each
    member of a group samples its own stream, and the same job seed and id give the same
    seed again (``laminar replay --trajectory`` regenerates it)."""
    digest = hashlib.blake2b(f"{base}/{trajectory_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


class SamplingSpec(_Msg, tag="sampling"):
    """Sampling parameters carried with a prompt."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


class ConversationState(_Msg, tag="conversation"):
    """Where a multi-turn trajectory stood when it left a worker (repack or recovery):
    enough for another worker of the same version to continue it."""

    observation_spans: tuple[tuple[int, int], ...]
    """Ranges of the resumed tokens the environment added (as on :class:`Trajectory`)."""
    messages: tuple[dict[str, Any], ...]
    """The conversation so far, as chat messages (for rendering the next tool results)."""
    env_state: dict[str, Any] = {}
    """The environment's ``state()`` (JSON), restored on the next worker."""
    env_reward: float = 0.0
    """Per-turn environment rewards so far."""
    turns: int = 0
    """Assistant turns generated so far (the current one included if it had begun)."""
    replayable: bool = True
    """Whether running its tool calls again is harmless; if not, a trajectory lost with
    its worker is generated again from its first turn, never resumed."""


KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""The cache dtypes a :class:`KvCache` may carry, with their sizes in bytes."""


def _kv_bytes(kv: KvCache | KvRef) -> int:
    """The bytes a cache of ``kv``'s dtype and sizes takes (checking them)."""
    if kv.dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype {kv.dtype!r} is not one of {sorted(KV_DTYPES)}")
    for name in ("layers", "kv_heads", "head_dim", "num_tokens"):
        if getattr(kv, name) < 1:
            raise ValueError(f"kv {name} must be >= 1, got {getattr(kv, name)}")
    return 2 * kv.layers * kv.kv_heads * kv.num_tokens * kv.head_dim * KV_DTYPES[kv.dtype]


class _KvShape(_Msg):
    """The fields that say what a cache holds (:class:`KvCache`, :class:`KvRef`)."""

    engine: str
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    num_tokens: int


class KvCache(_KvShape, tag="kv"):
    """The attention cache of a migrated trajectory, as the engine that wrote it held it.

    ``data`` is every layer's keys then values, each ``[kv_heads, num_tokens, head_dim]``
    in C order, in ``dtype``; positions ``0 .. num_tokens - 1`` of the prompt and the
    resumed tokens (all but the last, which the destination feeds next). Only an engine
    of the same kind (``engine``) and model shape takes it; any other re-prefills.
    Checked on decode: known dtype, positive sizes, and exactly the bytes they describe.
    """

    data: bytes

    def __post_init__(self) -> None:
        want = _kv_bytes(self)
        if len(self.data) != want:
            raise ValueError(
                f"kv data holds {len(self.data)} bytes; {self.layers} layers x 2 x "
                f"[{self.kv_heads}, {self.num_tokens}, {self.head_dim}] {self.dtype} "
                f"take {want}")


class KvRef(_KvShape, tag="kvref"):
    """Where a migrated trajectory's attention cache waits: the source worker's KV plane.

    The destination fetches it from ``endpoint`` (:class:`KvFetch` with ``token``) and
    takes it only if what arrives is exactly what this describes: the same shape fields
    as :class:`KvCache`, ``nbytes`` of data whose xxh3-128 is ``digest``. The source
    serves it once and for a limited time; a destination that cannot get it re-prefills.
    """

    endpoint: str
    trajectory_id: str
    token: str
    nbytes: int
    digest: str

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("tcp://", "inproc://")):
            raise ValueError(f"kv endpoint {self.endpoint!r} is not a tcp:// or inproc:// "
                             "address")
        want = _kv_bytes(self)
        if self.nbytes != want:
            raise ValueError(f"kv ref says {self.nbytes} bytes; its shape takes {want}")
        if len(self.digest) != 32 or any(c not in "0123456789abcdef" for c in self.digest):
            raise ValueError("kv digest must be 32 lowercase hex digits")
        if not 16 <= len(self.token) <= 64:
            raise ValueError("kv token must be 16 to 64 characters")

    def describes(self, blob: KvCache) -> str | None:
        """Why ``blob`` is not the cache this names (None: it is)."""
        for name in _KvShape.__struct_fields__:
            if getattr(blob, name) != getattr(self, name):
                return (f"{name} {getattr(blob, name)!r} where the ref says "
                        f"{getattr(self, name)!r}")
        if len(blob.data) != self.nbytes:
            return f"{len(blob.data)} bytes where the ref says {self.nbytes}"
        if kv_digest(blob.data) != self.digest:
            return "its bytes do not match the ref's digest"
        return None


def kv_digest(data: bytes | memoryview) -> str:
    """xxh3-128 of a cache's bytes, hex (what :class:`KvRef` ``digest`` holds). Like the
    relay's chunk checksums it guards against a wrong or corrupted cache, not a malicious
    peer (authentication's job), at tens of GB/s instead of BLAKE2b's ~0.6 here."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


class KvFetch(_Msg, tag="kvfetch"):
    """Destination worker -> source worker's KV plane: the cache a :class:`KvRef` names."""

    trajectory_id: str
    token: str


class KvMissing(_Msg, tag="kvmissing"):
    """The KV plane's answer when it does not hold that cache (served already, expired,
    evicted, or a wrong token); the destination re-prefills."""

    trajectory_id: str
    reason: str


class PromptTask(_Msg, tag="prompt"):
    """One trajectory to generate (one sample of a GRPO group).

    ``resume_token_ids``/``resume_logprobs`` are non-empty for a migrated or
    recovered trajectory; ``policy_version`` is then the version that produced
    them and the receiving worker must run that same version.

    ``group_seq`` numbers the prompt's group in the manager's creation order
    (kept across manager restarts); ``settled_below`` is the manager's watermark
    when it dispatched the task: every group numbered below it is acked or
    rejected for good, so the trainer needs no per-id record of those (-1:
    unknown). Both travel on to the :class:`Trajectory`.

    The prompt is either ``prompt`` (text, encoded as is) or ``messages`` (chat
    messages, ``{"role": ..., "content": ...}``, rendered with the tokenizer's chat
    template and a generation prompt); ``metadata`` is the record's other fields,
    nested values kept (JSON types only), for the reward function.
    """

    trajectory_id: str
    prompt_id: str
    group_size: int
    sample_index: int
    prompt: str
    prompt_token_ids: tuple[int, ...] = ()
    metadata: dict[str, Any] = {}
    messages: tuple[dict[str, str], ...] = ()
    sampling: SamplingSpec = SamplingSpec()
    resume_token_ids: tuple[int, ...] = ()
    resume_logprobs: tuple[float, ...] = ()
    policy_version: int = -1
    group_seq: int = -1
    settled_below: int = -1
    conversation: ConversationState | None = None
    """A multi-turn trajectory past its first turn: the resumed tokens hold tool results
    (see :class:`ConversationState`); None for a single turn or a first turn."""
    kv: KvCache | KvRef | None = None
    """A migrated trajectory's attention cache (repack between workers whose engines
    transfer KV): the cache itself (through the manager, which holds it in memory only)
    or where to fetch it from the source worker (:class:`KvRef`, the default plane);
    used once and never required: without it, or when it does not fit or cannot be
    fetched, the destination re-prefills."""


class Trajectory(_Msg, tag="trajectory"):
    """A finished, scored trajectory, produced by exactly one policy version."""

    trajectory_id: str
    prompt_id: str
    group_size: int
    sample_index: int
    worker_id: str
    policy_version: int
    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    reward: float
    finish_reason: str
    reward_error: str | None = None
    completion: str = ""
    generation_s: float = 0.0
    simulated: bool = False
    group_seq: int = -1
    settled_below: int = -1
    sampling: SamplingSpec = SamplingSpec()
    data_source: str = ""
    """The task's ``metadata["data_source"]`` when it is a string (verl-format rows
    carry one), else empty: the trainer reports rewards per source."""
    observation_spans: tuple[tuple[int, int], ...] = ()
    """Multi-turn: the ``[start, end)`` ranges of ``response_token_ids`` that the
    environment added between the model's turns (tool results and the chat template's
    turn markers), in order and disjoint. They are context for the later turns and are
    never trained on; ``behaviour_logprobs`` holds one value per generated token (the
    response without these ranges), in order. Empty for a single-turn trajectory."""
    engine: str = ""
    """The engine that generated it and its library's version (``TorchEngine torch
    2.13.0+cpu``), as the worker names it; recorded in the trainer's step records."""

    @property
    def generated_tokens(self) -> int:
        """Response tokens the policy generated (the ones the loss trains on)."""
        return len(self.response_token_ids) - sum(end - start
                                                  for start, end in self.observation_spans)


class PartialProgress(_Msg, tag="partial"):
    """Tokens generated so far for an unfinished trajectory, or the ones since the last
    report: ``token_ids`` / ``logprobs`` continue the trajectory at index ``offset``
    (0: all of them). A worker sends only what is new (and all of it now and then), so
    a report costs the tokens decoded since the last one, not every token so far."""

    trajectory_id: str
    worker_id: str
    policy_version: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    offset: int = 0

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"progress of {self.trajectory_id!r}: offset {self.offset} < 0")


class Ack(_Msg, tag="ack"):
    """Trainer -> manager: these trajectory ids were consumed by a step."""

    trajectory_ids: tuple[str, ...]
    trainer_step: int
    trainer_version: int


class TrajectoryRejected(_Msg, tag="trajectory-rejected"):
    """Trainer -> manager: a decodable trajectory whose contents are wrong was not trained.

    ``final`` false: generate it again (the worker's copy is dropped). ``final``
    true: the trainer gave up on this id (it was rejected too often; the group
    trains without it) and the manager records it as rejected. A final
    rejection is sent only once it is durable, like an :class:`Ack`.
    """

    trajectory_id: str
    worker_id: str
    reason: str
    final: bool = False
    trainer_step: int = -1


class GroupsFiltered(_Msg, tag="groups-filtered"):
    """Trainer -> manager: these prompts' complete groups were dropped untrained
    (dynamic sampling: every member scored the same, so the group teaches nothing).

    The manager grants one group of creation credit per prompt id, once per group
    however often it is told (the trainer re-sends to a new manager incarnation), so
    the trainer's wait for informative groups is met. Not durable: the groups'
    trajectory ids are acked as usual once the trainer's consumed state is.
    """

    prompt_ids: tuple[str, ...]
    trainer_step: int = -1


class WorkerReport(_Msg, tag="report"):
    """Worker -> manager: load, version and the trajectories it holds."""

    worker_id: str
    policy_version: int
    active: int
    queued: int
    max_batch: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    holding: tuple[str, ...] = ()
    done: tuple[str, ...] = ()
    progress: tuple[PartialProgress, ...] = ()
    """The unfinished trajectories' new tokens since the last report (one frame for all)."""
    trainer_down_s: float = 0.0
    """Seconds this worker's link to the trainer has been down (0.0: up)."""


class PullWeights(_Msg, tag="pull_weights"):
    """Manager -> worker: load weight ``version`` once idle (a no-op if not newer)."""

    version: int


class ExportTrajectories(_Msg, tag="export"):
    """Manager -> worker: hand these unfinished trajectories back for migration."""

    trajectory_ids: tuple[str, ...]


class Acked(_Msg, tag="acked"):
    """Manager -> worker: the trainer durably consumed these; drop them from the outbox."""

    trajectory_ids: tuple[str, ...]


class GenerationRejected(_Msg, tag="generation_rejected"):
    """Worker -> manager: these tasks cannot be generated; ``reason`` says why."""

    trajectory_ids: tuple[str, ...]
    reason: str = ""


Command = Union[PullWeights, ExportTrajectories, Acked, GenerationRejected]
"""The control messages between manager and worker, one tagged struct each."""


class TensorSpec(_Msg, tag="tensor"):
    """Where one named tensor lives in a version's flat byte stream."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class ChunkSpec(_Msg, tag="chunk"):
    """One chunk of a version's byte stream and its checksum (hex, by the manifest's
    ``checksum_algo``)."""

    index: int
    offset: int
    nbytes: int
    checksum: str


class WeightManifest(_Msg, tag="manifest"):
    """Everything needed to reassemble and verify one weight version."""

    version: int
    total_bytes: int
    chunk_bytes: int
    tensors: tuple[TensorSpec, ...]
    chunks: tuple[ChunkSpec, ...]
    created_at: float = 0.0
    trainer_step: int = -1
    checksum_algo: str = "xxh3-128"
    """How chunk checksums are computed: ``xxh3-128`` (what publishers use) or
    ``blake2b-128`` (a relay or trainer from before the field, whose protobuf
    manifest has none; still verified)."""
    base_version: int = -1
    """A delta version's base (see :mod:`laminar_common.relay.delta`); -1 for a full one."""
    full: WeightManifest | None = None
    """A delta version's target: the full version's manifest, whose checksums the
    rebuilt stream must match; None for a full version."""


Message = Union[
    Hello,
    Welcome,
    Refused,
    PromptTask,
    Trajectory,
    PartialProgress,
    Ack,
    TrajectoryRejected,
    GroupsFiltered,
    WorkerReport,
    PullWeights,
    ExportTrajectories,
    Acked,
    GenerationRejected,
    WeightManifest,
    KvFetch,
    KvMissing,
    KvCache,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_HEADER_PREFIX = _HEADER.pack(MAGIC, PROTOCOL_VERSION)


def encode(msg: _Msg) -> bytes:
    """Encode one message into a frame (header + msgpack body)."""
    return _HEADER_PREFIX + _encoder.encode(msg)


def peek_version(frame: bytes | memoryview) -> int:
    """Return the protocol version in a frame's header.

    Raises:
        ProtocolError: the frame is too short or lacks the magic bytes.
    """
    if len(frame) < _HEADER.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than the header")
    magic, version = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(f"frame does not start with {MAGIC!r} (got {bytes(magic)!r})")
    return version


def decode(
    frame: bytes | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    expect: type | tuple[type, ...] | None = None,
) -> Message:
    """Decode and validate one frame.

    Args:
        frame: the raw bytes received.
        max_bytes: frames larger than this are refused before parsing.
        expect: if given, the message must be an instance of this type(s).

    Raises:
        ProtocolError: oversized, bad header, other protocol version,
            malformed body, or an unexpected message kind.
    """
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    version = peek_version(frame)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"frame speaks protocol version {version}, this process speaks "
            f"{PROTOCOL_VERSION}: upgrade the older side"
        )
    try:
        msg = _decoder.decode(memoryview(frame)[_HEADER.size:])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed frame body: {exc}") from exc
    except RecursionError as exc:  # a manifest's ``full`` nested without end
        raise ProtocolError("malformed frame body: nested too deeply") from exc
    if expect is not None and not isinstance(msg, expect):
        raise ProtocolError(f"unexpected message kind {type(msg).__name__!r}")
    return msg
