"""Generation engines of the rollout tier: the interface, its data types, three engines, yours.

- ``TorchEngine``: exact continuous batching on a transformers model (CPU or GPU).
- ``SimulatedEngine``: model-free, calibrated cost model, for scheduling benchmarks.
- ``VllmEngine``: production engine; lives in ``_vllm`` and is imported only by
  ``make_engine("vllm", ...)`` so that vLLM stays an optional dependency.
- ``custom``: your own :class:`GenerationEngine`, returned by a
  ``package.module:function`` factory (``engine: {type: custom, factory: ...}``).

Importing this package is light: ``TorchEngine`` (torch + transformers) is
loaded on first access, vLLM only by ``make_engine("vllm")`` and a custom
factory's module only by ``make_engine("custom")``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from laminar_common.errors import ConfigError, LaminarError

from ._simulated import Clock, LogNormalLengths, ManualClock, MonotonicClock, SimulatedEngine
from .base import (
    EngineError,
    EngineLoad,
    FinishReason,
    GenerationEngine,
    GenerationOutput,
    GenerationRequest,
    KVState,
    PartialProgress,
    SamplingParams,
)

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ._torch import TorchEngine

ENGINE_KINDS: tuple[str, ...] = ("torch", "simulated", "vllm", "custom")


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from ._torch import TorchEngine

        return TorchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_engine(kind: str, **kwargs: Any) -> GenerationEngine:
    """Build an engine by kind name.

    Args:
        kind: ``"torch"``, ``"simulated"``, ``"vllm"`` or ``"custom"``.
        **kwargs: Constructor arguments of that engine class; for ``"custom"``,
            ``factory="package.module:function"`` and the factory's own arguments.

    Raises:
        ValueError: unknown kind.
        EngineError: vLLM requested but not importable (or the engine refused
            its arguments).
        ConfigError: a custom factory that cannot be imported, does not take
            its options, or returns something that is not a GenerationEngine
            (the message names ``engine.factory`` or ``engine.options``).
    """
    if kind == "torch":
        from ._torch import TorchEngine

        return TorchEngine(**kwargs)
    if kind == "simulated":
        return SimulatedEngine(**kwargs)
    if kind == "vllm":
        try:
            from ._vllm import VllmEngine
        except ImportError as exc:
            raise EngineError(
                "engine kind 'vllm' needs vLLM: pip install 'laminar-rollout[vllm]'"
            ) from exc
        return VllmEngine(**kwargs)
    if kind == "custom":
        if "factory" not in kwargs:
            raise ConfigError("engine.factory: a custom engine needs 'package.module:function'")
        return _make_custom(kwargs.pop("factory"), kwargs)
    raise ValueError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}")


def make_engine_from_config(config: EngineConfig) -> GenerationEngine:
    """Build the engine a worker config's ``engine`` section describes (any ``type``; an
    unset ``seed`` is 0 here: a worker fills it from its id first)."""
    seed = getattr(config, "seed", 0)
    seed = 0 if seed is None else seed
    if config.type == "torch":
        import torch

        torch.set_num_threads(config.threads)
        return make_engine("torch", model=config.model_dir, max_batch=config.max_batch,
                           context_length=config.context_length, device=config.device,
                           seed=seed, dtype=getattr(torch, config.dtype))
    if config.type == "simulated":
        return make_engine(
            "simulated", max_batch=config.max_batch, kv_capacity_tokens=config.kv_capacity_tokens,
            lengths=LogNormalLengths(median=config.median_length, tail_ratio=config.tail_ratio,
                                     max_length=config.max_length),
            step_time_base=config.step_time_base, step_time_per_seq=config.step_time_per_seq,
            prefill_time_per_token=config.prefill_time_per_token,
            vocab_size=config.vocab_size, seed=seed,
            weight_load_time_s=config.weight_load_time_s)
    if config.type == "vllm":
        return make_engine("vllm", model=config.model_dir, max_batch=config.max_batch,
                           gpu_memory_utilization=config.gpu_memory_utilization,
                           context_length=config.context_length, seed=seed,
                           tensor_parallel_size=config.tensor_parallel_size,
                           dtype=config.dtype, enforce_eager=config.enforce_eager,
                           enable_prefix_caching=config.enable_prefix_caching,
                           kv_cache_bytes=(None if config.kv_cache_mb is None
                                           else config.kv_cache_mb << 20),
                           kv_cache_tokens=config.kv_cache_tokens,
                           multiprocess=config.multiprocess,
                           engine_kwargs=dict(config.engine_kwargs),
                           weight_bucket_bytes=config.weight_bucket_mb << 20,
                           weight_update_timeout_s=config.weight_update_timeout_s)
    return make_engine("custom", factory=config.factory, **config.options)


def _make_custom(spec: str, options: dict[str, Any]) -> GenerationEngine:
    """``factory(**options)`` for ``spec`` = ``package.module:function``, checked."""
    where = f"engine.factory {spec!r}"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where}: expected 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code: any import failure is a config error
        raise ConfigError(f"{where}: cannot import {module_name!r}: "
                          f"{type(exc).__name__}: {exc} (is it on the worker's PYTHONPATH?)"
                          ) from exc
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ConfigError(f"{where}: {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(target).bind(**options)
    except TypeError as exc:
        raise ConfigError(f"engine.options: {sorted(options)} do not fit {spec}: {exc}") from exc
    except ValueError:
        pass  # no signature to check (a builtin): the call below tells
    try:
        engine = target(**options)
    except LaminarError:
        raise
    except Exception as exc:
        raise EngineError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(engine, GenerationEngine):
        raise ConfigError(f"{where} returned {type(engine).__name__}, not a GenerationEngine "
                          "(subclass laminar_rollout.engines.GenerationEngine)")
    return engine


__all__ = [
    "ENGINE_KINDS",
    "Clock",
    "EngineError",
    "EngineLoad",
    "FinishReason",
    "GenerationEngine",
    "GenerationOutput",
    "GenerationRequest",
    "KVState",
    "LogNormalLengths",
    "ManualClock",
    "MonotonicClock",
    "PartialProgress",
    "SamplingParams",
    "SimulatedEngine",
    "TorchEngine",
    "make_engine",
    "make_engine_from_config",
]
