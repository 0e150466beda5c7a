"""Generation engines of the rollout tier: the interface, its data types, and three engines.

- ``TorchEngine``: exact continuous batching on a transformers model (CPU or GPU).
- ``SimulatedEngine``: model-free, calibrated cost model, for scheduling benchmarks.
- ``VllmEngine``: production engine; lives in ``_vllm`` and is imported only by
  ``make_engine("vllm", ...)`` so that vLLM stays an optional dependency.

Importing this package is light: ``TorchEngine`` (torch + transformers) is
loaded on first access and vLLM only by ``make_engine("vllm")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    from ._torch import TorchEngine

ENGINE_KINDS: tuple[str, ...] = ("torch", "simulated", "vllm")


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from ._torch import TorchEngine

        return TorchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_engine(kind: str, **kwargs: Any) -> GenerationEngine:
    """Build an engine by kind name.

    Args:
        kind: ``"torch"``, ``"simulated"`` or ``"vllm"``.
        **kwargs: Constructor arguments of that engine class.

    Raises:
        ValueError: unknown kind.
        EngineError: vLLM requested but not importable (or the engine refused
            its arguments).
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
    raise ValueError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}")


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
]
