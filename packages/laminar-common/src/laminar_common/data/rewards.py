"""Reward functions: the contract, the built-ins, and loading them by name or spec.

The contract. A reward function is called as::

    fn(prompt, completion, metadata) -> float

- ``prompt``: the record's prompt as the dataset gave it: a ``str``, or a
  sequence of chat messages (mappings with ``"role"`` and ``"content"``).
- ``completion``: the decoded response text (special tokens removed).
- ``metadata``: the record's other fields, nested values kept
  (``dict[str, Any]``), plus ``metadata["answer"]``: the ground truth as a
  string when the dataset has one (the dataset reader fills it from e.g.
  ``reward_model.ground_truth``).

Other frameworks' reward signatures are accepted as they are (detected by
:func:`load_reward_fn` from the function's parameters, and adapted):

- TRL's batched ``fn(completions, **kwargs) -> list[float]`` (also with ``prompts``
  and dataset columns by name, e.g. ``fn(prompts, completions, solution, **kwargs)``):
  called with one sample, ``prompts=[prompt]``, ``completions=[completion]`` (for a
  chat prompt, ``[[{"role": "assistant", "content": completion}]]`` as TRL passes) and
  every metadata field as a one-item list; it must return one number (``None``, TRL's
  "not applicable", is an error here).
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
  (or any function with ``solution_str`` and ``ground_truth``): ``ground_truth`` is the
  record's ``reward_model.ground_truth`` as the file holds it, else
  ``metadata["answer"]``; a dict result gives its ``"score"``.

A function that fits none of these is refused when it is loaded, with the expected
signatures in the message.

It returns a finite float. It may raise: :func:`score` turns an exception or a
non-finite value into ``(0.0, error text)``, so a failing reward never loses a
trajectory (the worker sends it marked with ``reward_error`` and counts it).
It must be thread-safe: rollout workers call it from a thread pool, off the
decode loop, with a timeout (``laminar_rollout.rewards.RewardPool``). Anything
that needs the main thread (``signal.alarm`` timeouts) does not work there.

Built-ins (:data:`BUILTIN_REWARDS`, resolved lazily by :func:`load_reward_fn`):

- ``math``: :func:`math_reward`, equivalence checked by math-verify
  (``pip install 'laminar-common[math]'``).
- ``gsm8k``: :func:`gsm8k_reward`, the number after ``####`` compared as a number.
- ``exact``: :func:`exact_reward`, the stdlib exact-answer scorer
  (:func:`score_exact_answer`).
- ``synthetic``: ``laminar_examples.tasks.synthetic_reward``, the demo's
  sort / reverse / add / repeat tasks; it lives with the tasks in the laminar-examples
  package (``pip install laminar-examples``), loading it without that package is a
  :class:`ConfigError` saying so.

The ground truth of ``math``, ``gsm8k`` and ``exact`` is ``metadata["answer"]``;
when it contains ``####`` (a GSM8K answer column: worked solution, then
``#### 72``) only the text after the last ``####`` counts.

Part of laminar-common's ``data`` subpackage: stdlib only at import time (math-verify
is imported on first use); imports the core only, never ``relay``, ``launch`` or
``consume``, nor the examples (the ``synthetic`` built-in is a string, resolved when
loaded).
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from laminar_common.errors import ConfigError

__all__ = [
    "BUILTIN_REWARDS",
    "CONTRACTS",
    "Prompt",
    "adapt_reward_fn",
    "reward_style",
    "RewardFn",
    "exact_reward",
    "gsm8k_reward",
    "load_reward_fn",
    "math_reward",
    "score",
    "score_exact_answer",
]

Prompt = str | Sequence[Mapping[str, Any]]
"""A record's prompt: plain text, or chat messages ``{"role", "content"}``."""

RewardFn = Callable[[Prompt, str, Mapping[str, Any]], float]
"""``fn(prompt, completion, metadata) -> float`` (see the module docstring)."""

BUILTIN_REWARDS: Mapping[str, str] = {
    "math": "laminar_common.data.rewards:math_reward",
    "gsm8k": "laminar_common.data.rewards:gsm8k_reward",
    "exact": "laminar_common.data.rewards:exact_reward",
    "synthetic": "laminar_examples.tasks:synthetic_reward",
}
"""Built-in reward names and the ``module:function`` each stands for."""

_MATH_EXTRA = "pip install 'laminar-common[math]'"
_DISTRIBUTIONS = {"laminar_examples": "laminar-examples"}
"""Packages a built-in lives in that laminar-common does not bring, by import name."""
_GSM8K_MARK = "####"

# -- loading -----------------------------------------------------------------------


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve a built-in name (``math``, ``gsm8k``, ``exact``, ``synthetic``) or
    ``package.module:function``.

    Raises:
        ConfigError: malformed spec, module not importable, not callable, or a
            built-in whose optional dependency or package is missing (the message
            names the spec and what to install: ``synthetic`` needs laminar-examples).
    """
    target = BUILTIN_REWARDS.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"reward {spec!r}: expected a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) "
            "or 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing in _DISTRIBUTIONS and module_name.partition(".")[0] == missing:
            others = ", ".join(sorted(name for name, target in BUILTIN_REWARDS.items()
                                      if not target.startswith(missing)))
            raise ConfigError(
                f"reward {spec!r}: {module_name!r} is in the {_DISTRIBUTIONS[missing]} "
                f"package, which is not installed here: pip install {_DISTRIBUTIONS[missing]}, "
                f"or set the reward to another built-in ({others}) or to module:function"
            ) from exc
        raise ConfigError(f"reward {spec!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {module_name!r} has no callable {attr!r}")
    if fn is math_reward:
        try:
            _math_verify()
        except ConfigError as exc:
            raise ConfigError(f"reward {spec!r}: {exc}") from exc
    return adapt_reward_fn(fn, spec)


CONTRACTS = ("fn(prompt, completion, metadata) -> float (Laminar's)",
             "fn(prompts, completions, **kwargs) -> list[float] (TRL's)",
             "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> "
             "float | dict (verl's)")
"""The reward signatures :func:`load_reward_fn` accepts, as its errors list them."""


def reward_style(fn: Callable[..., Any]) -> str:
    """``laminar``, ``trl`` or ``verl``: how ``fn`` wants to be called (see the module
    docstring). A callable without a readable signature (a builtin) counts as Laminar's.

    Raises:
        ValueError: ``fn`` fits none of them (the message says why).
    """
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "laminar"
    params = sig.parameters
    if "solution_str" in params and "ground_truth" in params:
        return "verl"
    if "completions" in params:
        return "trl"
    try:
        sig.bind("prompt", "completion", {})
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    return "laminar"


def adapt_reward_fn(fn: Callable[..., Any], spec: str = "") -> RewardFn:
    """``fn`` as a Laminar reward (``fn(prompt, completion, metadata) -> float``), whatever
    of the accepted signatures it has (see the module docstring).

    Raises:
        ConfigError: ``fn`` fits none of them; the message lists the ones accepted.
    """
    try:
        style = reward_style(fn)
    except ValueError as exc:
        raise ConfigError(f"reward {spec!r}: cannot be called as any reward Laminar knows "
                          f"({exc}); expected one of: {'; '.join(CONTRACTS)}") from exc
    if style == "trl":
        return _TrlReward(fn, spec)
    if style == "verl":
        return _VerlReward(fn, spec)
    return fn


def _accepted(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``offered`` that ``fn`` takes (all of them with **kwargs)."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}


class _Adapted:
    """Another framework's reward function called as a Laminar one (a subclass per
    style): it is handed the keyword arguments it takes, of what the style offers."""

    style = ""
    label = ""
    """The framework's name in messages."""
    default_name = "reward"

    def __init__(self, fn: Callable[..., Any], spec: str) -> None:
        self.fn, self.spec = fn, spec
        self.__name__ = getattr(fn, "__name__", self.default_name)

    def _call(self, offered: dict[str, Any]) -> Any:
        return self.fn(**_accepted(self.fn, offered))

    @property
    def _what(self) -> str:
        return f"{self.label}-style reward {self.spec or self.__name__}"


class _TrlReward(_Adapted):
    """TRL's batched reward called one sample at a time (see the module docstring)."""

    style = "trl"
    label = "TRL"

    def __call__(self, prompt: Prompt, completion: str, metadata: Mapping[str, Any]) -> float:
        chat = not isinstance(prompt, str)
        offered = {key: [value] for key, value in metadata.items()}
        offered["prompts"] = [list(prompt) if chat else prompt]
        offered["completions"] = [[{"role": "assistant", "content": completion}] if chat
                                  else completion]
        out = self._call(offered)
        if hasattr(out, "tolist") and not isinstance(out, (str, bytes)):
            out = out.tolist()  # a numpy array or a torch tensor, as some TRL rewards return
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) or len(out) != 1:
            raise TypeError(f"{self._what} returned {out!r} for one completion: expected a "
                            "list of one number")
        if out[0] is None:
            raise TypeError(f"{self._what} returned [None] (not applicable): Laminar needs a "
                            "score for every sample")
        return float(out[0])


class _VerlReward(_Adapted):
    """verl's ``compute_score`` (see the module docstring)."""

    style = "verl"
    label = "verl"
    default_name = "compute_score"

    def __call__(self, prompt: Prompt, completion: str, metadata: Mapping[str, Any]) -> float:
        model = metadata.get("reward_model")
        truth = model.get("ground_truth") if isinstance(model, Mapping) else None
        if truth is None:
            truth = metadata.get("answer")
        if truth is None:
            raise ValueError("verl-style reward: the record has no reward_model.ground_truth "
                             "and no answer (data.answer_key)")
        offered = {"data_source": metadata.get("data_source", ""), "solution_str": completion,
                   "ground_truth": truth, "extra_info": metadata.get("extra_info")}
        out = self._call(offered)
        if isinstance(out, Mapping):
            if "score" not in out:
                raise TypeError(f"{self._what} returned a dict without 'score' (keys "
                                f"{sorted(out)[:8]})")
            out = out["score"]
        return float(out)


def score(
    fn: RewardFn, prompt: Prompt, completion: str, metadata: Mapping[str, Any]
) -> tuple[float, str | None]:
    """Call ``fn``; returns ``(reward, None)`` or ``(0.0, error text)`` if it failed.

    Failing is raising anything, or returning something that is not a finite number.
    """
    try:
        value = float(fn(prompt, completion, metadata))
    except Exception as exc:  # noqa: BLE001 - a user reward function: any failure is data
        return 0.0, f"{type(exc).__name__}: {exc}"
    if not math.isfinite(value):
        return 0.0, f"reward function returned {value!r}"
    return value, None


def _ground_truth(metadata: Mapping[str, Any], reward: str) -> str:
    answer = metadata.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(
            f"the {reward!r} reward needs the ground truth in metadata['answer'], "
            "and this record has none"
        )
    text = str(answer)
    if _GSM8K_MARK in text:
        text = text.rsplit(_GSM8K_MARK, 1)[1]
    return text.strip()


# -- math (math-verify) ----------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable[..., list], Callable[..., bool], list]:
    """``(parse, verify, extraction_config)``, imported once."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ConfigError(
            f"the 'math' reward needs the math-verify package: {_MATH_EXTRA}"
        ) from exc
    return parse, verify, [LatexExtractionConfig(), ExprExtractionConfig()]


_PLAIN_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


def _parse_math(text: str) -> list:
    parse, _, config = _math_verify()
    # parsing_timeout=None: math-verify's timeouts use signal.alarm, which only works on
    # the main thread; the RewardPool's timeout bounds the call instead.
    return parse(text, extraction_config=config, parsing_timeout=None)


def math_reward(prompt: Prompt, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the completion's final answer is mathematically equal to the ground truth.

    The ground truth (``metadata["answer"]``, the text after its last ``####`` if any)
    is parsed as LaTeX or a plain expression; a bare number is read as ``$number$``.
    The completion's answer is the text after its last ``####`` when it has one and
    that parses, else what math-verify extracts (the last ``\\boxed{}``, else the last
    expression). Equality is math-verify's (``\\frac{1}{2}`` == ``0.5``, symbolic
    equivalence, sets, intervals...).

    Raises:
        ValueError: no ground truth in ``metadata["answer"]``, or one that cannot be
            parsed.
        ConfigError: math-verify is not installed.
    """
    truth = _ground_truth(metadata, "math")
    if _PLAIN_NUMBER.fullmatch(truth):
        truth = truth.replace(",", "")
    if "$" not in truth and "\\boxed" not in truth:
        truth = f"${truth}$"
    gold = _parse_math(truth)
    if not gold:
        raise ValueError(f"cannot parse the ground truth {truth!r}")
    answer: list = []
    if _GSM8K_MARK in completion:
        answer = _parse_math(completion.rsplit(_GSM8K_MARK, 1)[1].strip())
    if not answer:
        answer = _parse_math(completion)
    if not answer:
        return 0.0
    _, verify, _ = _math_verify()
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


# -- gsm8k (stdlib) --------------------------------------------------------------------

# A sign counts only where it cannot be a minus between two numbers ("48-24").
_NUMBER = re.compile(r"(?:(?<![\w)])[+-])?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_reward(prompt: Prompt, completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the completion's final number equals the ground truth's (GSM8K style).

    The completion's number is the first one after its last ``####``; a completion
    without ``####`` falls back to its last number. Thousands separators are ignored
    (``1,234`` == ``1234``) and the comparison is numeric (``72.0`` == ``72``).

    Raises:
        ValueError: no ground truth, or one with no number (the text after its last
            ``####``, else the whole of it, must be a number).
    """
    truth = _ground_truth(metadata, "gsm8k")
    want = _number(truth.strip("$ ").rstrip("."))
    if want is None:
        raise ValueError(f"the ground truth {truth!r} is not a number")
    if _GSM8K_MARK in completion:
        found = _NUMBER.search(completion.rsplit(_GSM8K_MARK, 1)[1])
    else:
        found = None
        for found in _NUMBER.finditer(completion):  # noqa: B007 - the last match is wanted
            pass
    if found is None:
        return 0.0
    return 1.0 if _number(found.group()) == want else 0.0


# -- exact (stdlib) --------------------------------------------------------------------


def exact_reward(prompt: Prompt, completion: str, metadata: Mapping[str, Any]) -> float:
    """:func:`score_exact_answer` against the ground truth (after its last ``####``).

    Raises:
        ValueError: no ground truth in ``metadata["answer"]``.
    """
    return score_exact_answer(_ground_truth(metadata, "exact"), completion)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


def _normalise_math(text: str) -> str:
    text = text.lstrip(" \t\n$").rstrip(" \t\n$.")
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    return " ".join(text.split())


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def score_exact_answer(answer: str, completion: str) -> float:
    """Score a free-form completion against an exact (math) answer: 1.0 or 0.0.

    The completion's final answer is the content of its last ``\\boxed{...}``;
    failing that, the text after its last ``####`` (up to a newline); failing
    that, the text up to the first newline. Both sides are normalised
    (surrounding whitespace and ``$`` removed, a trailing period dropped,
    thousands separators removed from numbers, inner whitespace collapsed).
    They match if the strings are equal or both parse as the same rational
    number (``"0.50"`` == ``"1/2"``).
    """
    boxed = _last_boxed(completion)
    if boxed is not None:
        candidate = boxed
    elif _GSM8K_MARK in completion:
        candidate = _first_line(completion.rsplit(_GSM8K_MARK, 1)[1].lstrip())
    else:
        candidate = _first_line(completion)
    got, want = _normalise_math(candidate), _normalise_math(answer)
    if not got:
        return 0.0
    if got == want:
        return 1.0
    got_num, want_num = _as_number(got), _as_number(want)
    return 1.0 if got_num is not None and got_num == want_num else 0.0
