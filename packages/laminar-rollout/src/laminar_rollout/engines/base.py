"""The generation-engine interface of the rollout tier and its plain data types.

A ``GenerationEngine`` turns token-id prompts into token-id responses with
continuous batching: callers ``add_request`` at any time, drive the engine with
``step`` (one decode iteration over every active sequence), and receive each
``GenerationOutput`` from the step in which it finished. Engines work on token
ids only; tokenisation, rewards and transport live elsewhere.

Invariants every engine keeps:

- **One policy version per trajectory.** Every token of an output was produced
  by the weights of ``output.policy_version``. ``load_weights`` is refused while
  any request is queued or in flight, and versions only increase.
- **Migration is lossless.** ``export`` aborts requests and hands them back as
  resumable ``GenerationRequest`` objects carrying the tokens and log-probs
  generated so far plus the version that produced them. An engine re-prefills
  ``prompt + resume`` tokens and continues; the final output holds the resumed
  tokens followed by the new ones. An engine whose weight version differs from
  the request's ``policy_version`` refuses it.
- **KV transfer is an optional shortcut.** ``export_with_kv`` may attach a
  request's attention cache (``GenerationRequest.kv``, a :class:`KVState`), and
  a request with ``keep_kv`` gets its finished sequence's cache on its output
  (the next turn of a multi-turn conversation continues from it); a cache may
  cover only a prefix of ``prompt + resume``, and the engine then prefills only
  the rest (the tool results appended between turns); an
  engine of the same kind and model shape then continues from it without the
  re-prefill. Engines without it (``supports_kv_transfer`` False) export plain
  resumable requests, and a request's ``kv`` must fit the engine that takes it
  or it is refused at ``add_request``.
- **Budgets count the whole trajectory.** ``max_tokens`` bounds resumed plus
  newly generated tokens, and prompt plus response never exceed the engine's
  ``context_length``.

Log-prob definition (what ``GenerationOutput.logprobs`` holds): for each
generated token, ``log_softmax(logits / T)[token]`` over the *full* vocabulary,
where ``T`` is the request's sampling temperature, computed *before* top-k /
top-p truncation. This is the behaviour log-probability the trainer recomputes
for the same policy at the same temperature, so importance ratios are exactly 1
on-policy. Greedy requests (``T == 0``) record the untempered
``log_softmax(logits)[token]`` (i.e. ``T`` taken as 1). A stop token that ends a
trajectory is part of ``token_ids`` (the trainer must learn to stop) and has a
log-prob like any other token.

This module must not import an engine implementation, vLLM or transformers.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from laminar_common.errors import EngineError, EngineWedgedError

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "aborted"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "aborted")

_MAX_SEED = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(name: str, tokens: Sequence[int], *, allow_empty: bool) -> None:
    if not isinstance(tokens, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(tokens).__name__}")
    if not tokens and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    for i, tok in enumerate(tokens):
        if not _is_int(tok) or tok < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative int, got {tok!r}")


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request is sampled.

    Args:
        temperature: Softmax temperature; ``0`` means greedy (argmax).
        top_p: Nucleus sampling mass in ``(0, 1]``; ``1`` disables it.
        top_k: Keep only the ``k`` most likely tokens; ``0`` disables it.
        max_tokens: Maximum response length (resumed plus new tokens), ``>= 1``.
        stop_token_ids: Extra token ids that end the response (the engine's EOS
            ids always do). The stop token is included in the output.
        seed: Per-request seed. A seeded request samples the same tokens for
            the same logits regardless of batch composition or migration.

    Raises:
        ValueError: naming the offending field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise ValueError(
                f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
            )
        stops = tuple(self.stop_token_ids)
        _check_token_ids("stop_token_ids", stops, allow_empty=True)
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax."""
        return self.temperature == 0


@dataclass(slots=True, frozen=True)
class KVState:
    """The attention cache of one exported sequence (see ``export_with_kv``).

    ``keys[layer]`` / ``values[layer]`` are ``[kv_heads, num_tokens, head_dim]``
    for positions ``0 .. num_tokens - 1``: the prompt and every resumed token
    but the last, which the taking engine feeds as its next decode input.
    ``engine`` names the engine kind that wrote it (only that kind reads it).
    """

    engine: str
    num_tokens: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(slots=True)
class GenerationRequest:
    """One prompt to complete, possibly resuming a migrated trajectory.

    Args:
        request_id: Unique among the engine's unfinished requests.
        prompt_token_ids: The prompt, non-empty.
        params: Sampling parameters.
        resume_token_ids: Tokens already generated elsewhere for this
            trajectory; the engine continues after them.
        resume_logprobs: The behaviour log-prob of each resumed token.
        policy_version: The weight version that produced the resumed tokens.
            Required when resuming; when set, an engine at another version
            refuses the request.
        kv: The attention cache of a prefix of prompt + resumed tokens (at most
            all but the last resumed one), from ``export_with_kv`` or a previous
            turn's output; the engine prefills the tokens it does not cover.
            ``None`` re-prefills everything.
        keep_kv: Attach the finished sequence's cache (every token but the last)
            to its output, for a next turn (engines with ``supports_kv_transfer``).

    Raises:
        ValueError: naming the offending field.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    resume_token_ids: list[int] = field(default_factory=list)
    resume_logprobs: list[float] = field(default_factory=list)
    policy_version: int | None = None
    kv: KVState | None = None
    keep_kv: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        _check_token_ids("prompt_token_ids", self.prompt_token_ids, allow_empty=False)
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        _check_token_ids("resume_token_ids", self.resume_token_ids, allow_empty=True)
        if len(self.resume_logprobs) != len(self.resume_token_ids):
            raise ValueError(
                f"resume_logprobs has {len(self.resume_logprobs)} entries but resume_token_ids "
                f"has {len(self.resume_token_ids)} (request {self.request_id!r})"
            )
        if self.policy_version is not None and (
            not _is_int(self.policy_version) or self.policy_version < 0
        ):
            raise ValueError(
                f"policy_version must be None or an int >= 0, got {self.policy_version!r}"
            )
        if self.resume_token_ids and self.policy_version is None:
            raise ValueError(
                f"policy_version is required when resume_token_ids is non-empty "
                f"(request {self.request_id!r})"
            )
        if self.kv is not None:
            cached = len(self.prompt_token_ids) + len(self.resume_token_ids) - 1
            if not self.resume_token_ids or not 0 < self.kv.num_tokens <= cached:
                raise ValueError(
                    f"kv of request {self.request_id!r} caches {self.kv.num_tokens} tokens; "
                    f"it must cache a prefix of prompt + resumed tokens but the last (at most "
                    f"{cached}), and only a request with resumed tokens carries one"
                )


@dataclass(slots=True)
class GenerationOutput:
    """A finished (or aborted) trajectory.

    ``token_ids`` and ``logprobs`` hold resumed tokens first, then new ones;
    ``num_resumed`` says how many came from ``resume_token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    simulated: bool = False
    num_resumed: int = 0
    kv: KVState | None = None
    """The finished sequence's cache (every token but the last), for a request with
    ``keep_kv`` on an engine that supports it."""


@dataclass(slots=True, frozen=True)
class EngineLoad:
    """A snapshot of how busy an engine is (used by dispatch and repack)."""

    active: int
    queued: int
    max_batch: int
    kv_used_tokens: int
    kv_capacity_tokens: int

    @property
    def free_slots(self) -> int:
        """Decode slots not taken by active or queued requests."""
        return max(0, self.max_batch - self.active - self.queued)


@dataclass(slots=True)
class PartialProgress:
    """Tokens generated so far for one unfinished request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int


class GenerationEngine(abc.ABC):
    """A continuous-batching generator over token ids.

    Engines are single-threaded objects: the owner calls every method from one
    thread (the worker's generation loop).
    """

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""

    @property
    @abc.abstractmethod
    def context_length(self) -> int:
        """Maximum prompt plus response length, in tokens."""

    @abc.abstractmethod
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request.

        Raises:
            EngineError: duplicate id, version mismatch, prompt too long, or
                invalid token ids for this engine.
        """

    @abc.abstractmethod
    def step(self) -> list[GenerationOutput]:
        """Run one decode iteration; return the requests that finished in it."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is queued or in flight."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Current occupancy."""

    @abc.abstractmethod
    def progress(self) -> list[PartialProgress]:
        """Snapshot of every unfinished request (queued ones have no new tokens)."""

    @abc.abstractmethod
    def export(self, request_ids: Iterable[str] | None = None) -> list[GenerationRequest]:
        """Abort requests and return them as resumable requests for migration.

        Args:
            request_ids: Requests to export; ``None`` exports every unfinished one.

        Returns:
            One request per exported id, carrying resume tokens, log-probs and
            the version that produced them (``None`` if none were generated and
            the original request had none).

        Raises:
            EngineError: an id is not unfinished on this engine (nothing is
                exported then).
        """

    supports_kv_transfer: bool = False
    """Whether ``export_with_kv`` attaches caches and ``add_request`` takes them."""

    def kv_layout(self) -> tuple[str, int, int, int, str] | None:
        """The caches this engine takes: ``(engine kind, layers, KV heads, head size,
        dtype name)`` as a :class:`~laminar_common.codec.KvRef` names them (None: it
        takes none), so a worker need not fetch a cache it could not use."""
        return None

    def export_with_kv(self, request_ids: Iterable[str] | None = None,
                       max_bytes: int | None = None) -> list[GenerationRequest]:
        """``export``, with each decoding request's attention cache in ``request.kv``
        (on the host; a cache larger than ``max_bytes`` is left out, never copied).

        The hook for moving KV instead of re-prefilling on the destination.
        Engines without KV transfer (this default) return plain ``export``
        requests; queued requests never carry a cache.
        """
        return self.export(request_ids)

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationOutput]:
        """Drop requests; return their partial outputs with ``finish_reason="aborted"``.

        Raises:
            EngineError: an id is not unfinished on this engine (nothing is
                aborted then).
        """

    @abc.abstractmethod
    def load_weights(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
    ) -> None:
        """Install weights of ``version``.

        Raises:
            EngineError: requests are unfinished, ``version`` is not greater
                than the current one, or a tensor does not fit the model.
        """

    def run_until_done(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
        """Add ``requests`` and step until the engine is idle.

        Returns:
            Every output finished during the call: the given requests in the
            order given, then any other request that finished meanwhile.
        """
        order: list[str] = []
        for request in requests:
            self.add_request(request)
            order.append(request.request_id)
        finished: dict[str, GenerationOutput] = {}
        while self.has_unfinished():
            for output in self.step():
                finished[output.request_id] = output
        ordered = [finished.pop(rid) for rid in order if rid in finished]
        return ordered + list(finished.values())


def check_weight_version(version: object) -> int:
    """Validate a weight version argument (an int >= 0)."""
    if not _is_int(version) or version < 0:
        raise ValueError(f"weight_version must be an int >= 0, got {version!r}")
    return version


def check_fits_context(request: GenerationRequest, context_length: int) -> int:
    """The request's prompt plus resumed tokens, checked against ``context_length`` (a
    prompt must leave room for one generated token); returns their count.

    Raises:
        EngineError: it does not fit (names the request and the sizes).
    """
    rid, n_prompt = request.request_id, len(request.prompt_token_ids)
    if n_prompt > context_length - 1:
        raise EngineError(
            f"request {rid!r}: prompt of {n_prompt} tokens does not fit context_length "
            f"{context_length} (at most {context_length - 1} prompt tokens leave room for one "
            "generated token)")
    total = n_prompt + len(request.resume_token_ids)
    if total > context_length:
        raise EngineError(
            f"request {rid!r}: prompt ({n_prompt}) plus resumed tokens "
            f"({len(request.resume_token_ids)}) exceed context_length {context_length}")
    return total


def check_load_weights_allowed(engine: GenerationEngine, version: int) -> None:
    """Shared guard for ``load_weights``: idle engine and a strictly newer version."""
    if not _is_int(version) or version < 0:
        raise EngineError(f"weight version must be an int >= 0, got {version!r}")
    if engine.has_unfinished():
        load = engine.load()
        raise EngineError(
            f"cannot load weights v{version} while {load.active} requests are active and "
            f"{load.queued} queued: a trajectory never spans two versions; drain or export first"
        )
    if version <= engine.weight_version:
        raise EngineError(
            f"weight version regression refused: v{version} is not newer than the loaded "
            f"v{engine.weight_version}"
        )


_T = TypeVar("_T")


def call_with_deadline(fn: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """``fn()``, run on a helper thread and waited for at most ``timeout_s`` seconds.

    An exception of ``fn`` is re-raised here (a ``TimeoutError`` of the engine's own,
    e.g. vLLM's multiprocess executor, as :class:`EngineWedgedError`).

    Raises:
        EngineWedgedError: ``fn`` did not return in time. It may still be running
            (a thread cannot be stopped), so whatever it was working on must not be
            used again; ``what`` names the call in the message.
    """
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"deadline-{what[:40]}", daemon=True).start()
    if not done.wait(timeout_s):
        raise EngineWedgedError(f"{what} did not return within {timeout_s:g}s: the engine is "
                                "wedged and this process cannot use it again")
    error = box.get("error")
    if isinstance(error, TimeoutError):
        raise EngineWedgedError(f"{what} timed out inside the engine: {error}") from error
    if isinstance(error, BaseException):
        raise error
    return box["value"]  # type: ignore[return-value]


def weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], limit_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named_tensors`` in order, cut into lists of at most ``limit_bytes`` (a tensor
    larger than that alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
