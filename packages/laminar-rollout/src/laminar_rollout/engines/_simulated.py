"""``SimulatedEngine``: a model-free engine with a calibrated cost model, for scheduling studies.

It implements the full ``GenerationEngine`` contract (continuous batching,
slots, KV capacity, export/resume, version stamping) but produces synthetic
tokens, so manager and repack policies can be benchmarked at cluster scale on
a laptop. Every output says ``simulated=True``; benchmarks that use it must say
so in their output.

Cost model, per ``step``: ``step_time_base + step_time_per_seq * active`` for
the decode iteration plus ``prefill_time_per_token * prefilled tokens`` for the
requests admitted in it. The time passes on an injectable clock: the real
monotonic clock sleeps, ``ManualClock`` just advances (instant, deterministic
tests and fast simulations).

Responses: each request's natural length is drawn from a long-tail
distribution (by default log-normal with p99/median = 10) and its tokens and
log-probs from a generator keyed by ``(seed, request_id)``, so the same
request yields the same trajectory on any engine with the same seed, also when
it is migrated midway. A natural end emits a stop token (the request's first
stop id, else the engine's EOS) and finishes with ``"stop"``; ``max_tokens`` or
the context length cut it short with ``"length"``.

KV capacity: a queued request is admitted only if its prompt plus resumed
tokens (plus one) fit the free KV budget; if decode growth would overflow the
budget, the most recently admitted sequences are preempted back to the front
of the queue and re-prefilled later (as vLLM does).
"""

from __future__ import annotations

import math
import statistics
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ._sequences import SequenceState, SequenceTable
from .base import (
    EngineError,
    EngineLoad,
    GenerationEngine,
    GenerationOutput,
    GenerationRequest,
    PartialProgress,
    check_fits_context,
    check_load_weights_allowed,
    check_weight_version,
)

if TYPE_CHECKING:
    import torch

_Z99 = statistics.NormalDist().inv_cdf(0.99)


class Clock(Protocol):
    """Time source of a simulated engine."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """Wall time: ``sleep`` really sleeps."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class ManualClock:
    """Virtual time: ``sleep`` advances ``now`` instantly."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative duration ({seconds})")
        self._now += seconds

    def advance(self, seconds: float) -> None:
        self.sleep(seconds)


class LengthDistribution(Protocol):
    """Draws a natural response length (>= 1)."""

    def sample(self, rng: np.random.Generator) -> int: ...


@dataclass(frozen=True, slots=True)
class LogNormalLengths:
    """Log-normal response lengths with a given median and p99/median ratio, capped.

    Args:
        median: Median length in tokens.
        tail_ratio: p99 / median of the uncapped distribution (10 models the
            long tail of reasoning RL).
        max_length: Hard cap (``None`` for none).
    """

    median: float = 256.0
    tail_ratio: float = 10.0
    max_length: int | None = 16384

    def __post_init__(self) -> None:
        if not self.median >= 1:
            raise ValueError(f"median must be >= 1, got {self.median!r}")
        if not self.tail_ratio >= 1:
            raise ValueError(f"tail_ratio must be >= 1, got {self.tail_ratio!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be None or >= 1, got {self.max_length!r}")

    @property
    def sigma(self) -> float:
        """Log-space standard deviation giving the requested tail ratio."""
        return math.log(self.tail_ratio) / _Z99

    def sample(self, rng: np.random.Generator) -> int:
        length = max(1, round(self.median * math.exp(self.sigma * rng.standard_normal())))
        return length if self.max_length is None else min(length, self.max_length)


@dataclass(slots=True)
class _Script:
    """Pre-drawn trajectory of one request."""

    natural_length: int
    tokens: np.ndarray
    logprobs: np.ndarray


class SimulatedEngine(GenerationEngine):
    """Model-free engine with the real interface and a configurable cost model.

    Args:
        max_batch: Decode slots.
        context_length: Prompt plus response limit.
        kv_capacity_tokens: KV budget over all active sequences; defaults to
            ``max_batch * context_length`` (never binding).
        lengths: Natural response length distribution; defaults to
            ``LogNormalLengths()`` (median 256, p99/median 10, cap 16384).
        step_time_base: Seconds per decode step, fixed part (``a``).
        step_time_per_seq: Seconds per decode step per active sequence (``b``).
        prefill_time_per_token: Seconds per prefilled (or re-prefilled) token.
        vocab_size: Synthetic token ids lie in ``[0, vocab_size)``.
        eos_token_id: Stop token of every request.
        seed: Keys the synthetic trajectories (with each request id, or the
            request's own seed when set).
        weight_version: Initial version.
        clock: Time source; defaults to ``MonotonicClock()``.
        weight_load_time_s: Seconds one ``load_weights`` takes (on ``clock``): a
            real engine's weight update (copy into the model, cache reset).
    """

    def __init__(
        self,
        *,
        max_batch: int = 64,
        context_length: int = 32768,
        kv_capacity_tokens: int | None = None,
        lengths: LengthDistribution | None = None,
        step_time_base: float = 0.02,
        step_time_per_seq: float = 0.0005,
        prefill_time_per_token: float = 2e-5,
        vocab_size: int = 32000,
        eos_token_id: int = 0,
        seed: int = 0,
        weight_version: int = 0,
        clock: Clock | None = None,
        weight_load_time_s: float = 0.0,
    ) -> None:
        self._table = SequenceTable(max_batch)
        if context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {context_length!r}")
        for name, value in (
            ("step_time_base", step_time_base),
            ("step_time_per_seq", step_time_per_seq),
            ("prefill_time_per_token", prefill_time_per_token),
            ("weight_load_time_s", weight_load_time_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size!r}")
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id must be in [0, vocab_size), got {eos_token_id!r}")
        self._context_length = context_length
        self._load_time = weight_load_time_s
        self._kv_capacity = (
            max_batch * context_length if kv_capacity_tokens is None else kv_capacity_tokens
        )
        if self._kv_capacity < 2:
            raise ValueError(f"kv_capacity_tokens must be >= 2, got {kv_capacity_tokens!r}")
        self._lengths = lengths if lengths is not None else LogNormalLengths()
        self._a = step_time_base
        self._b = step_time_per_seq
        self._c = prefill_time_per_token
        self._vocab = vocab_size
        self._eos = eos_token_id
        self._seed = seed
        self._version = check_weight_version(weight_version)
        self._clock = clock if clock is not None else MonotonicClock()
        self._scripts: dict[str, _Script] = {}
        self._steps = 0
        self._busy = 0.0
        self._preemptions = 0

    # -- interface -------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def steps_run(self) -> int:
        """Steps that did work (decode and/or prefill)."""
        return self._steps

    @property
    def busy_seconds(self) -> float:
        """Simulated seconds spent in steps."""
        return self._busy

    @property
    def preemptions(self) -> int:
        """Sequences pushed back to the queue for lack of KV capacity."""
        return self._preemptions

    def add_request(self, request: GenerationRequest) -> None:
        total = check_fits_context(request, self._context_length)
        if total + 1 > self._kv_capacity:
            raise EngineError(
                f"request {request.request_id!r}: {total} tokens can never fit the KV capacity "
                f"of {self._kv_capacity} tokens"
            )
        self._table.add(request, weight_version=self._version, eos_ids=(self._eos,))

    def has_unfinished(self) -> bool:
        return len(self._table) > 0

    def load(self) -> EngineLoad:
        return EngineLoad(
            active=len(self._table.active()),
            queued=len(self._table.queued()),
            max_batch=self._table.max_batch,
            kv_used_tokens=self._kv_used(),
            kv_capacity_tokens=self._kv_capacity,
        )

    def progress(self) -> list[PartialProgress]:
        return self._table.progress(self._version)

    def export(self, request_ids: Iterable[str] | None = None) -> list[GenerationRequest]:
        taken = self._table.take(request_ids)
        self._forget(taken)
        return [SequenceTable.resumable(s, self._version) for s in taken]

    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationOutput]:
        taken = self._table.take(request_ids)
        self._forget(taken)
        return [SequenceTable.output(s, "aborted", self._version, simulated=True) for s in taken]

    def load_weights(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
    ) -> None:
        """Adopt ``version``; tensors, if given, are consumed and discarded."""
        check_load_weights_allowed(self, version)
        if named_tensors is not None:
            for name, _tensor in named_tensors:
                if not isinstance(name, str):
                    raise EngineError(f"weights v{version}: tensor name {name!r} is not a str")
        if self._load_time:
            self._clock.sleep(self._load_time)
        self._version = version

    # -- stepping --------------------------------------------------------------------

    def step(self) -> list[GenerationOutput]:
        finished: list[GenerationOutput] = []
        prefill_tokens = self._admit(finished)
        active = self._table.active()
        self._fit_kv(active)
        active = self._table.active()
        if not active and prefill_tokens == 0:
            return finished
        for seq in active:
            self._emit(seq)
        duration = self._c * prefill_tokens + (self._a + self._b * len(active) if active else 0.0)
        self._clock.sleep(duration)
        self._busy += duration
        self._steps += 1
        for seq in active:
            reason = seq.finish_reason(self._context_length)
            if reason is not None:
                self._table.release(seq)
                self._forget([seq])
                finished.append(SequenceTable.output(seq, reason, self._version, simulated=True))
        return finished

    def _admit(self, finished: list[GenerationOutput]) -> int:
        prefill_tokens = 0
        active = self._table.active()
        used = sum(s.total_length for s in active)
        n_active = len(active)
        for slot in self._table.free_slots():
            head = self._table.peek_queued()
            # room for its tokens plus one new token for every sequence this step
            if head is None or used + head.total_length + n_active + 1 > self._kv_capacity:
                break
            seq = self._table.admit_next(slot)
            reason = seq.finish_reason(self._context_length)
            if reason is not None:  # a resumed trajectory that was already complete
                self._table.release(seq)
                self._forget([seq])
                finished.append(SequenceTable.output(seq, reason, self._version, simulated=True))
                continue
            used += seq.total_length
            n_active += 1
            prefill_tokens += seq.total_length
        return prefill_tokens

    def _fit_kv(self, active: list[SequenceState]) -> None:
        """Preempt the newest sequences until one more token each fits the budget."""
        by_age = sorted(active, key=lambda s: s.admitted_seq)
        used = sum(s.total_length for s in by_age)
        while by_age and used + len(by_age) > self._kv_capacity:
            victim = by_age.pop()
            used -= victim.total_length
            self._table.preempt(victim)
            self._preemptions += 1

    def _kv_used(self) -> int:
        return sum(s.total_length for s in self._table.active())

    def _forget(self, seqs: Iterable[SequenceState]) -> None:
        for seq in seqs:
            self._scripts.pop(seq.request_id, None)

    def _script(self, seq: SequenceState) -> _Script:
        script = self._scripts.get(seq.request_id)
        if script is not None:
            return script
        params = seq.request.params
        key = self._seed if params.seed is None else params.seed
        rng = np.random.default_rng([key, zlib.crc32(seq.request_id.encode())])
        natural = self._lengths.sample(rng)
        if natural < 1:
            raise EngineError(f"length distribution returned {natural} for {seq.request_id!r}")
        budget = min(natural, params.max_tokens)
        stops = np.array(sorted({t for t in seq.stop_ids if t < self._vocab}), dtype=np.int64)
        draws = rng.integers(0, self._vocab - len(stops), size=budget)
        # shift draws past every stop id below them: uniform over the non-stop tokens
        tokens = draws + np.searchsorted(stops - np.arange(len(stops)), draws, side="right")
        logprobs = -rng.exponential(0.7, size=budget)
        script = _Script(natural_length=natural, tokens=tokens, logprobs=logprobs)
        self._scripts[seq.request_id] = script
        return script

    def _emit(self, seq: SequenceState) -> None:
        script = self._script(seq)
        i = len(seq.token_ids)
        if i >= script.natural_length - 1:
            # natural end (or resumed past it from another engine's trajectory)
            stop = seq.request.params.stop_token_ids
            token = stop[0] if stop else self._eos
        else:
            token = int(script.tokens[i])
        logprob = float(script.logprobs[i]) if i < len(script.logprobs) else -0.1
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
