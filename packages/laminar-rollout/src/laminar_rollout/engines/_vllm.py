"""``VllmEngine``: the production engine, wrapping vLLM's (V1) ``LLMEngine``.

This is the only module of Laminar that imports vLLM (``pip install
laminar-rollout[vllm]``); ``make_engine("vllm", ...)`` imports it lazily.

What it relies on in vLLM (V1 engine, >= 0.10):

- ``LLMEngine.from_engine_args`` / ``add_request(id, TokensPrompt, SamplingParams)``
  / ``step()`` / ``abort_request`` / ``has_unfinished_requests``;
- ``SamplingParams(logprobs=0)``: the log-prob of the sampled token only, with
  ``output_kind=DELTA`` so each step returns just the new tokens;
- ``EngineArgs(logprobs_mode="processed_logprobs")``: log-probs after
  temperature. This equals Laminar's definition (full-vocabulary log-softmax
  at the sampling temperature, see ``base``) when ``top_k == 0`` and
  ``top_p == 1``; with truncation vLLM reports the renormalised truncated
  distribution instead. Greedy requests get untempered log-probs, as defined;
- weight updates without a restart: ``EngineArgs(worker_extension_cls=...)``
  mixes ``LaminarWorkerExtension`` into every worker, and
  ``LLMEngine.collective_rpc("laminar_load_weights", args=(tensors,))`` calls
  ``model_runner.model.load_weights(weights)`` (Hugging Face parameter names;
  vLLM maps them onto its fused layers) on each worker; the prefix cache is
  reset afterwards so no KV computed with old weights is reused.

By default the engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
unless the caller set it), so tensors reach ``load_weights`` by reference; in
multiprocess mode vLLM serialises them to the workers (a copy).

Limits: seeded sampling of a resumed request does not reproduce the
uninterrupted trajectory (vLLM's per-request generator restarts); ``load()``
splits unfinished requests into active/queued by ``max_batch`` and counts KV
tokens from Laminar's own records (vLLM's block accounting is internal).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from ._sequences import SequenceState, SequenceTable
from .base import (
    EngineError,
    EngineLoad,
    FinishReason,
    GenerationEngine,
    GenerationOutput,
    GenerationRequest,
    PartialProgress,
    check_load_weights_allowed,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

logger = logging.getLogger(__name__)

_EXTENSION = f"{__name__}.LaminarWorkerExtension"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "aborted"}


class LaminarWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``); runs inside the worker."""

    def laminar_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]
        loaded = model.load_weights(weights=named_tensors)
        return len(loaded) if loaded is not None else len(named_tensors)


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
        dtype, gpu_memory_utilization, tensor_parallel_size, enforce_eager:
            Passed to ``EngineArgs``.
        engine_kwargs: Further ``EngineArgs`` fields (override the above).

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
        engine_kwargs: dict[str, Any] | None = None,
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
            "disable_log_stats": True,
        }
        if context_length is not None:
            args["max_model_len"] = context_length
        args.update(engine_kwargs or {})
        try:
            self._engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        except (TypeError, ValueError) as exc:
            raise EngineError(f"vLLM refused the engine configuration {args}: {exc}") from exc
        self._max_batch = max_batch
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
            top_k=params.top_k if params.top_k > 0 else -1,
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
        active = min(n, self._max_batch)
        kv_used = sum(s.total_length for s in list(self._seqs.values())[:active])
        cache = getattr(getattr(self._engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        capacity = (
            int(blocks) * int(cache.block_size)
            if blocks
            else self._max_batch * self._context_length
        )
        return EngineLoad(active, n - active, self._max_batch, kv_used, capacity)

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
        try:
            self._engine.collective_rpc("laminar_load_weights", args=(tensors,))
        except Exception as exc:
            raise EngineError(f"vLLM rejected weights v{version}: {exc}") from exc
        self._engine.reset_prefix_cache()
        self._weights_intact = True
        self._version = version
        logger.info("loaded weights v%d (%d tensors) into vLLM", version, len(tensors))
