"""Reward functions: loading ``module:function`` specs, and the built-ins.

A reward function is called as ``fn(metadata, completion) -> float`` where
``metadata`` is the prompt record's string fields (``task``, ``answer``, ...)
and ``completion`` the decoded response. It must be deterministic and cheap;
the worker calls it on its generation thread.

A reward function that raises does not lose the trajectory: :func:`score`
returns reward 0.0 and the error text, and the worker sends the trajectory
marked with ``reward_error`` (the trainer can drop or keep it) and counts it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping

from laminar_common.errors import ConfigError
from laminar_common.launch.tasks import score_completion, score_exact_answer

__all__ = ["RewardFn", "load_reward_fn", "score", "synthetic_task", "exact_answer"]

RewardFn = Callable[[Mapping[str, str], str], float]


def synthetic_task(metadata: Mapping[str, str], completion: str) -> float:
    """The project's synthetic tasks (sort, reverse, add): 1.0 when exactly right."""
    return score_completion(metadata, completion)


def exact_answer(metadata: Mapping[str, str], completion: str) -> float:
    """Exact-answer math (``\\boxed{}``, ``####``, numeric equality) against ``answer``."""
    if "answer" not in metadata:
        raise ValueError("prompt record has no 'answer' field")
    return score_exact_answer(metadata["answer"], completion)


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``package.module:function``.

    Raises:
        ConfigError: malformed spec, module not importable, or not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"reward {spec!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def score(fn: RewardFn, metadata: Mapping[str, str], completion: str) -> tuple[float, str | None]:
    """Call ``fn``; returns ``(reward, None)`` or ``(0.0, error text)`` if it failed."""
    try:
        value = float(fn(metadata, completion))
    except Exception as exc:  # noqa: BLE001 - a user reward function: any failure is data
        return 0.0, f"{type(exc).__name__}: {exc}"
    if not math.isfinite(value):
        return 0.0, f"reward function returned {value!r}"
    return value, None
