"""What the rollout tier checks before it starts, beyond its config's fields.

``laminar-rollout serve|manage --print-config`` (the check ``laminar up`` runs for
every replica before any set-up step or tier starts) validates the config, then
calls :func:`check_worker` / :func:`check_manager`: every data file the tier will
read parses where it exists (the manager's prompt file, every row, with the
configured prompt and answer keys; a file a set-up step will write is checked when
the manager starts), and every code spec imports and has a signature Laminar
can call (the reward, a custom environment, a custom engine factory). Each failure
is a :class:`ConfigError` naming the field and the file; what a user must know but
that does not stop the job (a tool sandbox that can only isolate by rlimits) is
returned as warnings, which ``laminar up`` prints on its console.

This module builds no service and starts nothing that outlives a check.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from laminar_common.config import PREFLIGHT_WARNING_PREFIX
from laminar_common.errors import ConfigError

__all__ = ["WARNING_PREFIX", "check_manager", "check_worker"]

WARNING_PREFIX = PREFLIGHT_WARNING_PREFIX
"""Lines a check prints with this prefix are shown by ``laminar up`` even when it passes."""


def check_manager(config: Any) -> list[str]:
    """The prompt file parses, every row, with the configured keys.

    A file that does not exist yet is left to the manager's start: a job's set-up may
    write it (``laminar up`` checks before the set-up, and a set-up step may be told a
    directory rather than the file); the manager refuses a missing file when it starts.

    Raises:
        ConfigError: naming ``prompts`` / ``data``, the file and the row.
    """
    from pathlib import Path

    from .prompts import load_prompt_file

    if not Path(config.prompts).exists():
        return []
    try:
        records = load_prompt_file(config.prompts, config.data)
    except ConfigError as exc:
        raise ConfigError(f"prompts ({config.prompts}): {exc}") from exc
    if not records:
        raise ConfigError(f"prompts ({config.prompts}): the file holds no records")
    key = config.data.answer_key
    if key is not None and not any("answer" in r.metadata for r in records):
        return [f"prompts ({config.prompts}): no record has an answer at data.answer_key "
                f"{key!r}: a reward that needs one (math, gsm8k, exact) scores every sample "
                "0; set data.answer_key to the answer's dot path (verl: "
                "reward_model.ground_truth)"]
    return []


def check_worker(config: Any) -> list[str]:
    """The reward, environment and engine factory load and can be called as Laminar
    calls them; the tool sandbox's isolation is what the job expects.

    Raises:
        ConfigError: naming ``reward``, ``environment.type`` or ``engine.factory``.
    """
    from .rewards import load_reward_fn

    warnings: list[str] = []
    fn = load_reward_fn(config.reward)
    _check_call(fn, ("prompt", "completion", {}), f"reward {config.reward!r}",
                "fn(prompt, completion, metadata) -> float")
    env = config.environment
    if env is not None:
        from .environments import _environment_class

        if env.type != "tools":
            try:
                _environment_class(env.type)
            except ConfigError as exc:
                raise ConfigError(f"environment.type: {exc}") from exc
        elif "python" in env.tools:
            warnings += _sandbox_warnings(env.sandbox)
    if config.engine.type == "custom":
        factory = _import_spec(config.engine.factory, "engine.factory")
        try:
            inspect.signature(factory).bind(**config.engine.options)
        except TypeError as exc:
            raise ConfigError(f"engine.options: {sorted(config.engine.options)} do not fit "
                              f"{config.engine.factory}: {exc}") from exc
        except ValueError:
            pass  # a builtin without a signature: the worker's start tells
    return warnings


def _check_call(fn: Any, args: tuple, what: str, contract: str) -> None:
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as exc:
        raise ConfigError(f"{what}: cannot be called as {contract} ({exc})") from exc
    except ValueError:
        pass  # no signature to read (a builtin): the first call tells


def _import_spec(spec: str, field: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code: any import failure is a config error
        raise ConfigError(f"{field} {spec!r}: cannot import {module_name!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ConfigError(f"{field} {spec!r}: {module_name!r} has no callable {attr!r}")
    return target


def _sandbox_warnings(sb: Any) -> list[str]:
    """Build the python tool's sandbox as the worker will; what it cannot guarantee."""
    from .sandbox import CodeSandbox, SandboxLimits

    sandbox = CodeSandbox(SandboxLimits(cpu_s=sb.cpu_s, memory_bytes=sb.memory_mb << 20,
                                        file_bytes=sb.file_mb << 20, wall_s=sb.wall_s,
                                        output_bytes=sb.output_bytes),
                          isolation=sb.isolation, sandbox_uid=sb.sandbox_uid)
    out = []
    if sandbox.isolation == "rlimit":
        out.append("the python tool's sandbox runs with rlimit isolation: no filesystem, "
                   "network or pid isolation" + (" and snippets run as root"
                                                  if sandbox.run_uid == 0 else "")
                   + " (install bubblewrap; see docs/rollout.md)")
    if not sandbox.seccomp:
        out.append("the python tool's sandbox has no seccomp filter (libseccomp2 missing)")
    if sandbox.whole_run_bound != "cgroup":
        out.append("the python tool's sandbox bounds memory and processes per process "
                   "only (no cgroup this worker may make)")
    return out
