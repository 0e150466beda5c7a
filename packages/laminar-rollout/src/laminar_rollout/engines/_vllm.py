"""``VllmEngine``: the production engine, wrapping vLLM's (V1) ``LLMEngine``.

This is the only module of Laminar that imports vLLM (``pip install
laminar-rollout[vllm]``); ``make_engine("vllm", ...)`` imports it lazily.

Written against vLLM's source (read at 0.34.0, checked back to 0.11 where
noted); it has not run here (no GPU and no vLLM wheel on the build machine,
see the package README). What it relies on:

- ``LLMEngine.from_engine_args(EngineArgs(...))`` / ``add_request(id,
  TokensPrompt, SamplingParams)`` / ``step()`` / ``abort_request(ids)`` /
  ``reset_prefix_cache()`` / ``collective_rpc(method, timeout, args)`` /
  ``get_metrics()``;
- ``SamplingParams(logprobs=0)``: the sampled token's log-prob only, with
  ``output_kind=DELTA`` so each step returns just the new tokens;
- ``EngineArgs(logprobs_mode="processed_logprobs")``: the log-softmax of the
  logits after temperature (and after top-k / top-p masking, renormalised over
  the kept tokens). That equals Laminar's definition (full-vocabulary
  log-softmax at the sampling temperature, see ``base``) exactly when nothing
  is masked, so this engine refuses ``top_k > 0`` or ``top_p < 1`` at
  ``add_request`` rather than report log-probs of another distribution. vLLM has
  no mode of "after temperature, before masking". Greedy requests get
  untempered log-probs, as defined;
- weight updates without a restart, vLLM's RL path for weights that arrive on
  the host: ``EngineArgs(worker_extension_cls=...)`` mixes
  ``LaminarWorkerExtension`` into every worker, and ``collective_rpc`` calls its
  ``laminar_begin_update`` / ``laminar_load_weights(bucket)`` /
  ``laminar_finish_update`` on each worker. The tensors go in buckets of at most
  ``weight_bucket_bytes`` into ``model.load_weights`` (Hugging Face names; vLLM
  maps them onto its fused and tensor-parallel layers). Where vLLM has the
  layerwise reload (``vllm.model_executor.model_loader.reload``, >= 0.16), a
  quantized model is updated between ``start_reload`` and ``finish_reload``
  (``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` where it has
  the earlier names; what vLLM's own weight-transfer engines do); older vLLM
  updates unquantized models only. The prefix cache is reset afterwards so no KV computed with old
  weights is reused. Every call has a deadline (``weight_update_timeout_s``,
  enforced here: vLLM's in-process executor ignores ``collective_rpc``'s own
  timeout); one that does not return raises ``EngineWedgedError`` and the worker
  leaves the job and is restarted;
- ``get_metrics()`` (``disable_log_stats=False``): ``vllm:kv_cache_usage_perc``
  and ``vllm:num_requests_running`` from vLLM's own scheduler stats give
  ``load()`` (repack's KV signal; queued = the rest of Laminar's unfinished
  requests); before the first step reports them, Laminar's own records do.

By default the engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
unless the caller set it), so tensors reach ``load_weights`` by reference; in
multiprocess mode vLLM serialises each bucket to the workers (a copy).

Limits: seeded sampling of a resumed request does not reproduce the
uninterrupted trajectory (vLLM's per-request generator restarts); vLLM's stats
live in a process-wide registry, so one process should hold one VllmEngine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from laminar_common.errors import EngineWedgedError

from ._sequences import SequenceState, SequenceTable
from .base import (
    EngineError,
    EngineLoad,
    FinishReason,
    GenerationEngine,
    GenerationOutput,
    GenerationRequest,
    PartialProgress,
    call_with_deadline,
    check_load_weights_allowed,
    weight_buckets,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

logger = logging.getLogger(__name__)

_EXTENSION = f"{__name__}.LaminarWorkerExtension"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "aborted"}
_STATS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running")


class LaminarWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``); runs inside the worker."""

    def _laminar_config_scope(self):
        try:
            from vllm.config import set_current_vllm_config
        except ImportError:  # pragma: no cover - older vLLM
            return contextlib.nullcontext()
        return set_current_vllm_config(self.vllm_config)  # type: ignore[attr-defined]

    def laminar_begin_update(self) -> bool:
        """Start an update; True when vLLM's layerwise reload wraps it (quantized)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        self._laminar_reload = False
        if getattr(self.model_config, "quantization", None):  # type: ignore[attr-defined]
            start, _ = _reload_functions()
            with self._laminar_config_scope(), torch.device(self.device):  # type: ignore[attr-defined]
                start(model)
            self._laminar_reload = True
        return self._laminar_reload

    def laminar_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]
        with self._laminar_config_scope():
            loaded = model.load_weights(weights=named_tensors)
        return len(loaded) if loaded is not None else len(named_tensors)

    def laminar_finish_update(self) -> bool:
        if getattr(self, "_laminar_reload", False):
            _, finish = _reload_functions()
            with self._laminar_config_scope(), torch.device(self.device):  # type: ignore[attr-defined]
                finish(self.model_runner.model, self.model_config,  # type: ignore[attr-defined]
                       self.device)  # type: ignore[attr-defined]
            self._laminar_reload = False
        return True


def _reload_functions():
    """vLLM's layerwise reload as (start(model), finish(model, model_config, device)):
    ``start_reload`` / ``finish_reload`` where vLLM has them (0.34), else
    ``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (the earlier names).

    Raises:
        RuntimeError: this vLLM has neither (a quantized model cannot be updated).
    """
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError as exc:
        raise RuntimeError("updating a quantized model's weights needs vLLM's layerwise "
                           "reload (vllm.model_executor.model_loader.reload)") from exc
    if hasattr(reload, "start_reload") and hasattr(reload, "finish_reload"):
        return reload.start_reload, reload.finish_reload
    if hasattr(reload, "initialize_layerwise_reload"):
        return (reload.initialize_layerwise_reload,
                lambda model, model_config, _device: reload.finalize_layerwise_reload(
                    model, model_config))
    raise RuntimeError("this vLLM's reload module has neither start_reload nor "
                       "initialize_layerwise_reload: a quantized model cannot be updated")


class VllmEngine(GenerationEngine):
    """Generation engine on vLLM.

    Args:
        model: Local model directory (or anything vLLM's ``model=`` accepts).
        max_batch: ``max_num_seqs``.
        context_length: ``max_model_len``; ``None`` lets vLLM take the model's.
        weight_version: Version of the weights in ``model``.
        eos_token_ids: ``None`` keeps vLLM's EOS handling; otherwise exactly
            these ids end every response (``()`` disables EOS).
        seed: Engine seed.
        dtype, gpu_memory_utilization, tensor_parallel_size, enforce_eager,
        enable_prefix_caching: Passed to ``EngineArgs`` (``None``: vLLM's default).
        engine_kwargs: Further ``EngineArgs`` fields (override the above).
        weight_bucket_bytes: Most bytes handed to the workers in one weight-update call.
        weight_update_timeout_s: Deadline of each weight-update call.

    Raises:
        EngineError: vLLM refused the configuration.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        max_batch: int = 256,
        context_length: int | None = None,
        weight_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        enable_prefix_caching: bool | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        weight_bucket_bytes: int = 512 << 20,
        weight_update_timeout_s: float = 120.0,
    ) -> None:
        args: dict[str, Any] = {
            "model": os.fspath(model),
            "max_num_seqs": max_batch,
            "seed": seed,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "worker_extension_cls": _EXTENSION,
            "logprobs_mode": "processed_logprobs",
            "disable_log_stats": False,  # load() reads vLLM's scheduler stats
        }
        if context_length is not None:
            args["max_model_len"] = context_length
        if enable_prefix_caching is not None:
            args["enable_prefix_caching"] = enable_prefix_caching
        if weight_bucket_bytes < 1 or not weight_update_timeout_s > 0:
            raise EngineError(f"weight_bucket_bytes ({weight_bucket_bytes}) must be >= 1 and "
                              f"weight_update_timeout_s ({weight_update_timeout_s}) > 0")
        args.update(engine_kwargs or {})
        try:
            self._engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        except (TypeError, ValueError) as exc:
            raise EngineError(f"vLLM refused the engine configuration {args}: {exc}") from exc
        self._max_batch = max_batch
        self._bucket_bytes = weight_bucket_bytes
        self._update_timeout = weight_update_timeout_s
        self._context_length = int(self._engine.model_config.max_model_len)
        self._version = weight_version
        self._weights_intact = True
        self._eos = None if eos_token_ids is None else tuple(eos_token_ids)
        self._seqs: dict[str, SequenceState] = {}
        self._ready: list[GenerationOutput] = []

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def context_length(self) -> int:
        return self._context_length

    def add_request(self, request: GenerationRequest) -> None:
        rid = request.request_id
        if not self._weights_intact:
            raise EngineError(
                f"refusing request {rid!r}: the last load_weights failed, weights are inconsistent"
            )
        if rid in self._seqs:
            raise EngineError(f"request {rid!r} is already unfinished on this engine")
        if request.policy_version is not None and request.policy_version != self._version:
            raise EngineError(
                f"request {rid!r} was generated with policy v{request.policy_version} but this "
                f"engine holds v{self._version}: a trajectory never spans two versions"
            )
        n_prompt = len(request.prompt_token_ids)
        if n_prompt > self._context_length - 1:
            raise EngineError(
                f"request {rid!r}: prompt of {n_prompt} tokens does not fit context_length "
                f"{self._context_length} (at most {self._context_length - 1} prompt tokens)"
            )
        total = n_prompt + len(request.resume_token_ids)
        if total > self._context_length:
            raise EngineError(
                f"request {rid!r}: prompt ({n_prompt}) plus resumed tokens "
                f"({len(request.resume_token_ids)}) exceed context_length {self._context_length}"
            )
        params = request.params
        if params.temperature > 0 and (params.top_k > 0 or params.top_p < 1):
            raise EngineError(
                f"request {rid!r}: top_k={params.top_k} / top_p={params.top_p}: vLLM reports "
                "log-probs renormalised over the kept tokens, not the full-vocabulary ones "
                "the trainer's importance ratios need; sample with top_k 0 and top_p 1 on "
                "vLLM (or use the torch engine, which records them exactly)")
        seq = SequenceState(
            request=request,
            token_ids=list(request.resume_token_ids),
            logprobs=[float(x) for x in request.resume_logprobs],
            num_resumed=len(request.resume_token_ids),
            stop_ids=frozenset(self._eos or ()) | frozenset(params.stop_token_ids),
        )
        reason = seq.finish_reason(self._context_length) if seq.token_ids else None
        if reason is not None:
            self._ready.append(SequenceTable.output(seq, reason, self._version, simulated=False))
            return
        stop_ids = sorted(set(params.stop_token_ids) | set(self._eos or ()))
        sampling = vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_tokens=params.max_tokens - len(seq.token_ids),
            stop_token_ids=stop_ids,
            ignore_eos=self._eos is not None,
            seed=params.seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=seq.input_ids())
        self._engine.add_request(rid, prompt, sampling)
        self._seqs[rid] = seq

    def step(self) -> list[GenerationOutput]:
        finished, self._ready = self._ready, []
        if not self._seqs:
            return finished
        for out in self._engine.step():
            seq = self._seqs.get(out.request_id)
            if seq is None:
                continue
            completion = out.outputs[0]
            new_tokens = list(completion.token_ids)
            if new_tokens and completion.logprobs is None:
                raise EngineError(f"vLLM returned no log-probs for request {out.request_id!r}")
            for i, tok in enumerate(new_tokens):
                seq.token_ids.append(int(tok))
                seq.logprobs.append(float(completion.logprobs[i][tok].logprob))
            if out.finished:
                del self._seqs[out.request_id]
                reason = _FINISH.get(completion.finish_reason or "", "length")
                finished.append(SequenceTable.output(seq, reason, self._version, simulated=False))
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._ready)

    def load(self) -> EngineLoad:
        n = len(self._seqs)
        cache = getattr(getattr(self._engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        capacity = (
            int(blocks) * int(cache.block_size)
            if blocks
            else self._max_batch * self._context_length
        )
        stats = self._scheduler_stats() if n else None
        if stats is not None:
            usage, running = stats
            # vLLM's counts may lag a step behind Laminar's (finished / newly added).
            active = min(running, n)
            return EngineLoad(active, n - active, self._max_batch, round(usage * capacity),
                              capacity)
        active = min(n, self._max_batch)
        kv_used = sum(s.total_length for s in list(self._seqs.values())[:active])
        return EngineLoad(active, n - active, self._max_batch, kv_used, capacity)

    def _scheduler_stats(self) -> tuple[float, int] | None:
        """(KV-cache usage fraction, running requests) from vLLM's own scheduler stats,
        or None before a step has reported them (queued = Laminar's unfinished - running)."""
        try:
            metrics = self._engine.get_metrics()
        except AssertionError:  # "Stat logging disabled" (engine_kwargs turned it off)
            return None
        found: dict[str, float] = {}
        for metric in metrics:
            if metric.name in _STATS and hasattr(metric, "value"):
                found[metric.name] = found.get(metric.name, 0.0) + float(metric.value)
        if len(found) < len(_STATS):
            return None
        return (min(max(found["vllm:kv_cache_usage_perc"], 0.0), 1.0),
                int(found["vllm:num_requests_running"]))

    def progress(self) -> list[PartialProgress]:
        return [
            PartialProgress(rid, list(s.token_ids), list(s.logprobs), self._version)
            for rid, s in self._seqs.items()
        ]

    def _take(self, request_ids: Iterable[str] | None) -> list[SequenceState]:
        if request_ids is None:
            ids = list(self._seqs)
        else:
            ids = list(dict.fromkeys(request_ids))
            unknown = [rid for rid in ids if rid not in self._seqs]
            if unknown:
                raise EngineError(f"requests not unfinished on this engine: {unknown}")
        if ids:
            self._engine.abort_request(ids)
        return [self._seqs.pop(rid) for rid in ids]

    def export(self, request_ids: Iterable[str] | None = None) -> list[GenerationRequest]:
        return [SequenceTable.resumable(s, self._version) for s in self._take(request_ids)]

    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationOutput]:
        return [
            SequenceTable.output(s, "aborted", self._version, simulated=False)
            for s in self._take(request_ids)
        ]

    def load_weights(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
    ) -> None:
        """Load Hugging Face-named tensors into every worker's model, then adopt ``version``.

        Raises:
            EngineError: busy engine, version not newer, no tensors, or vLLM
                rejected a tensor (the engine then refuses requests until a
                later load succeeds).
        """
        check_load_weights_allowed(self, version)
        if named_tensors is None:
            raise EngineError("VllmEngine.load_weights needs named tensors, got None")
        tensors = list(named_tensors)
        if not tensors:
            raise EngineError(f"weights v{version}: no tensors were given")
        self._weights_intact = False
        buckets = 0
        self._rpc("laminar_begin_update", version)
        for bucket in weight_buckets(tensors, self._bucket_bytes):
            self._rpc("laminar_load_weights", version, bucket)
            buckets += 1
        self._rpc("laminar_finish_update", version)
        if self._engine.reset_prefix_cache() is False:
            # vLLM keeps blocks a running request holds; none should run during a load.
            raise EngineError(f"weights v{version} loaded but vLLM did not reset its prefix "
                              "cache (blocks still held): refusing requests until a later "
                              "load succeeds, so no KV of the old weights is reused")
        self._weights_intact = True
        self._version = version
        logger.info("loaded weights v%d (%d tensors, %d buckets) into vLLM", version,
                    len(tensors), buckets)

    def _rpc(self, method: str, version: int, *args: Any) -> list[Any]:
        """``collective_rpc(method)`` on every worker, within the update deadline.

        Raises:
            EngineWedgedError: no answer in time (the engine may still be in the call).
            EngineError: a worker raised.
        """
        what = f"vLLM {method} for weights v{version}"
        try:
            return call_with_deadline(
                lambda: self._engine.collective_rpc(method, timeout=self._update_timeout,
                                                    args=args),
                self._update_timeout, what)
        except EngineWedgedError:
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; all refuse the load
            raise EngineError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
