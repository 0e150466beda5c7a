"""Synthetic tasks with verifiable rewards, and exact-answer scoring.

This module owns the project's built-in tasks (used by the demo RL run, the
tests and the feasibility tool), the prompt-record format they produce, the
train/eval split rule, and the reward functions that score a completion.

Record format (one JSON object per line in a prompt file)::

    {"id": "sort-train-0-000007", "task": "sort", "prompt": "sort 3142=", "answer": "1234"}

Tasks (``TASKS``):

- ``sort``: sort a list of digits, ``"sort 3142="`` -> ``"1234"``. The list
  length is drawn uniformly from ``min_len..max_len``, so responses vary in
  length.
- ``reverse``: reverse a list of digits, ``"reverse 3142="`` -> ``"2413"``.
- ``add``: add two non-negative integers, ``"add 57+8="`` -> ``"65"``. Each
  operand has a digit count drawn uniformly from ``min_digits..max_digits``.
- ``repeat``: repeat a string of letters, ``"repeat ab*3="`` -> ``"ababab"``.
  The long-tail task: the unit has ``min_unit..max_unit`` letters (uniform)
  and the count is log-normal (median ``median_count``, log-space standard
  deviation ``REPEAT_SPREAD``), redrawn until the answer has at most
  ``max_len`` characters. With the defaults the answer length over a train
  split has median 4, p90 about 17 and p99 about 40 (p99 / median about 10),
  and the longest prompt plus answer plus ``<eos>`` fits the demo model's 64
  positions. Getting the answer right means stopping after exactly ``count``
  units, which a small model does less reliably the longer the answer. Its
  plausible mistake stops one unit early: RL that corrects it pushes towards
  longer answers, so a policy that cannot count that far still writes long
  ones and the long tail stays in the generated responses.

Answer extraction (``extract_answer``): the completion is read up to the first
``ANSWER_END`` character (if any) and stripped of surrounding whitespace. A
model is expected to emit the answer and then its end-of-sequence token, which
the caller removes when decoding; ``ANSWER_END`` lets a text-only generator end
an answer too. ``score_completion`` is 1.0 when the extracted text equals the
record's answer string exactly (so ``"0123"`` and ``"123"`` differ), else 0.0.
``synthetic_reward`` is the same score under the reward contract of
:mod:`laminar_common.data.rewards` (the ``synthetic`` built-in).
``score_exact_answer`` (re-exported from there) is the looser scorer for
exact-answer math (``\\boxed``, ``####``, numeric equality).

Held-out split: every problem belongs to exactly one split, decided by a hash
of its prompt text (``split_of``), so train and eval records are disjoint
whatever seeds and sizes are used to draw them; ``find_overlap`` checks it.

Invariants:
- Stdlib and laminar-common's core only: this module never imports torch,
  transformers, tokenizers or numpy (the relay and common tiers run without them).
- Every character of every prompt and answer is in ``TASK_ALPHABET``.
- Generation is deterministic in ``(task, n, seed, split, difficulty)`` and
  independent of Python's hash randomisation.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar_common.data.rewards import Prompt, score_exact_answer

__all__ = [
    "ANSWER_END",
    "EVAL_BUCKETS",
    "REPEAT_SPREAD",
    "SPLITS",
    "TASKS",
    "TASK_ALPHABET",
    "Task",
    "extract_answer",
    "find_overlap",
    "make_task_records",
    "parse_difficulty",
    "plausible_mistake",
    "score_completion",
    "score_exact_answer",
    "split_of",
    "synthetic_reward",
    "write_jsonl",
]

TASK_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:,.\n"
"""Every character any task can put in a prompt or answer, in a fixed order
(a character-level tokenizer built from it has stable ids)."""

ANSWER_END = "\n"
"""Marks the end of an answer in completion text; anything after it is ignored."""

SPLITS = ("train", "eval")

EVAL_BUCKETS = 10
"""One prompt in ``EVAL_BUCKETS`` (by hash) belongs to the eval split."""

REPEAT_SPREAD = 1.1
"""Standard deviation of the log of ``repeat``'s count (a log-normal); 1.1 puts the
answer length's p99 near 10x its median (a log-normal's p99/median is exp(2.33 sigma),
thinned here by the ``max_len`` cap)."""

_MAX_DRAWS_PER_RECORD = 1000


@dataclass(frozen=True)
class Task:
    """A synthetic task: draws one ``(prompt, answer)`` pair from an RNG.

    ``draw`` takes the RNG plus the difficulty keywords; ``defaults`` holds the
    default difficulty (the demo's settings) and names the accepted keywords.
    """

    name: str
    draw: Callable[..., tuple[str, str]]
    defaults: Mapping[str, int] = field(default_factory=dict)
    description: str = ""
    mistake: Callable[[str], str] | None = None
    """Maps a prompt to a plausible wrong answer (see ``plausible_mistake``)."""


def _check_range(name_lo: str, lo: int, name_hi: str, hi: int, floor: int) -> None:
    if lo < floor or hi < lo:
        raise ValueError(
            f"need {floor} <= {name_lo} <= {name_hi}, got {name_lo}={lo}, {name_hi}={hi}"
        )


def _draw_digits(rng: random.Random, min_len: int, max_len: int, max_digit: int) -> str:
    _check_range("min_len", min_len, "max_len", max_len, floor=1)
    if not 0 <= max_digit <= 9:
        raise ValueError(f"max_digit must be in 0..9, got {max_digit}")
    length = rng.randint(min_len, max_len)
    return "".join(str(rng.randint(0, max_digit)) for _ in range(length))


def _draw_sort(
    rng: random.Random, min_len: int, max_len: int, max_digit: int
) -> tuple[str, str]:
    digits = _draw_digits(rng, min_len, max_len, max_digit)
    return f"sort {digits}=", "".join(sorted(digits))


def _draw_reverse(
    rng: random.Random, min_len: int, max_len: int, max_digit: int
) -> tuple[str, str]:
    digits = _draw_digits(rng, min_len, max_len, max_digit)
    return f"reverse {digits}=", digits[::-1]


def _draw_operand(rng: random.Random, n_digits: int) -> int:
    if n_digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (n_digits - 1), 10**n_digits - 1)


def _draw_add(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    _check_range("min_digits", min_digits, "max_digits", max_digits, floor=1)
    a = _draw_operand(rng, rng.randint(min_digits, max_digits))
    b = _draw_operand(rng, rng.randint(min_digits, max_digits))
    return f"add {a}+{b}=", str(a + b)


def _draw_repeat(
    rng: random.Random, min_unit: int, max_unit: int, median_count: int, max_len: int
) -> tuple[str, str]:
    _check_range("min_unit", min_unit, "max_unit", max_unit, floor=1)
    _check_range("max_unit", max_unit, "max_len", max_len, floor=1)
    if median_count < 1:
        raise ValueError(f"median_count must be >= 1, got {median_count}")
    unit = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_unit, max_unit)))
    # Redrawing the count (not clamping it) keeps the tail free of a spike at max_len;
    # count 1 always fits since max_unit <= max_len.
    while True:
        count = max(1, round(rng.lognormvariate(math.log(median_count), REPEAT_SPREAD)))
        if len(unit) * count <= max_len:
            return f"repeat {unit}*{count}=", unit * count


def _operands(prompt: str, verb: str) -> str:
    return prompt[len(verb) + 1 : -1]


def _mistake_sort(prompt: str) -> str:
    # The list as given: the copy a model falls back to before it can sort.
    return _operands(prompt, "sort")


def _mistake_reverse(prompt: str) -> str:
    return _operands(prompt, "reverse")


def _mistake_add(prompt: str) -> str:
    # Digit-wise sum with the carries dropped.
    a, b = (int(x) for x in _operands(prompt, "add").split("+"))
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return str(out)


def _mistake_repeat(prompt: str) -> str:
    # One unit too few (the empty answer for a count of 1): the policy that stops early.
    unit, sep, count = _operands(prompt, "repeat").partition("*")
    if not sep or not unit.isalpha() or not count.isdigit():
        raise ValueError("expected UNIT*COUNT")
    return unit * (int(count) - 1)


TASKS: dict[str, Task] = {
    "sort": Task(
        name="sort",
        draw=_draw_sort,
        defaults={"min_len": 2, "max_len": 6, "max_digit": 9},
        description="sort a list of digits ascending",
        mistake=_mistake_sort,
    ),
    "reverse": Task(
        name="reverse",
        draw=_draw_reverse,
        defaults={"min_len": 2, "max_len": 6, "max_digit": 9},
        description="reverse a list of digits",
        mistake=_mistake_reverse,
    ),
    "add": Task(
        name="add",
        draw=_draw_add,
        defaults={"min_digits": 1, "max_digits": 3},
        description="add two non-negative integers",
        mistake=_mistake_add,
    ),
    "repeat": Task(
        name="repeat",
        draw=_draw_repeat,
        defaults={"min_unit": 1, "max_unit": 2, "median_count": 3, "max_len": 48},
        description="repeat a string of letters a (heavy-tailed) number of times",
        mistake=_mistake_repeat,
    ),
}


def _get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None


def split_of(prompt: str) -> str:
    """Return the split (``"train"`` or ``"eval"``) a prompt belongs to.

    Decided by a SHA-256 of the prompt text, so it is stable across processes,
    Python versions and seeds.
    """
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0 else "train"


def parse_difficulty(task: str, items: Sequence[str]) -> dict[str, int]:
    """Parse ``KEY=INT`` strings (a CLI's ``--difficulty``) for ``task``.

    Raises:
        ValueError: unknown task or key, an item without ``=``, or a value
            that is not an integer; the message names the item.
    """
    spec = _get_task(task)
    out: dict[str, int] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"difficulty {item!r}: expected KEY=INT")
        if key not in spec.defaults:
            raise ValueError(
                f"difficulty {item!r}: task {task!r} accepts {sorted(spec.defaults)}"
            )
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"difficulty {item!r}: {value!r} is not an integer") from None
    return out


def plausible_mistake(record: Mapping[str, str]) -> str:
    """The task's systematic wrong answer to ``record``'s prompt.

    ``sort`` and ``reverse``: the digits as given; ``add``: the sum with its
    carries dropped; ``repeat``: one repetition too few (the empty answer for a
    count of 1). It equals the right answer on some prompts (an already sorted
    list, a palindrome, a sum without carries; never for ``repeat``). Used to
    build noisy demonstrations for a warm start that RL then has to correct.

    Raises:
        ValueError: unknown task, or a prompt not of the task's form.
    """
    spec = _get_task(record["task"])
    if spec.mistake is None:
        raise ValueError(f"task {spec.name!r} defines no plausible mistake")
    prompt = record["prompt"]
    if not prompt.startswith(spec.name + " ") or not prompt.endswith("="):
        raise ValueError(f"prompt {prompt!r} is not a {spec.name!r} prompt")
    try:
        return spec.mistake(prompt)
    except ValueError as exc:
        raise ValueError(f"prompt {prompt!r} is not a {spec.name!r} prompt: {exc}") from exc


def make_task_records(
    task: str, n: int, seed: int, split: str = "train", **difficulty: int
) -> list[dict[str, str]]:
    """Draw ``n`` prompt records of one task from one split.

    Problems are drawn i.i.d. from the task's distribution restricted to the
    split (rejection on ``split_of``), so a split may repeat a problem but the
    two splits never share one.

    Args:
        task: a key of ``TASKS``.
        n: number of records (>= 0).
        seed: RNG seed; the same arguments always give the same records.
        split: ``"train"`` or ``"eval"``.
        **difficulty: overrides of the task's ``defaults`` (e.g. ``max_len=6``).

    Returns:
        JSON-serialisable dicts ``{"id", "task", "prompt", "answer"}`` with ids
        unique across tasks, splits and seeds.

    Raises:
        ValueError: unknown task, split or difficulty keyword, a bad range, or
            a problem space with (almost) no problems in the requested split.
    """
    spec = _get_task(task)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    unknown = sorted(set(difficulty) - set(spec.defaults))
    if unknown:
        raise ValueError(
            f"task {task!r} has no difficulty setting(s) {unknown}; "
            f"it accepts {sorted(spec.defaults)}"
        )
    settings = {**spec.defaults, **difficulty}
    # A string seed keeps the stream independent of the split and task while
    # staying deterministic (random.Random hashes str seeds with SHA-512).
    rng = random.Random(f"{task}/{split}/{seed}")
    records: list[dict[str, str]] = []
    draws = 0
    while len(records) < n:
        if draws >= _MAX_DRAWS_PER_RECORD * (len(records) + 1):
            raise ValueError(
                f"drew {draws} {task!r} problems with {settings} and found only "
                f"{len(records)} in split {split!r}; the problem space is too small"
            )
        draws += 1
        prompt, answer = spec.draw(rng, **settings)
        if split_of(prompt) != split:
            continue
        records.append(
            {
                "id": f"{task}-{split}-{seed}-{len(records):06d}",
                "task": task,
                "prompt": prompt,
                "answer": answer,
            }
        )
    return records


def find_overlap(
    records_a: Iterable[Mapping[str, Any]], records_b: Iterable[Mapping[str, Any]]
) -> set[str]:
    """Return the prompts that occur in both record collections (empty if disjoint)."""
    return {r["prompt"] for r in records_a} & {r["prompt"] for r in records_b}


def extract_answer(completion: str) -> str:
    """Return the answer part of a completion: text before ``ANSWER_END``, stripped."""
    return completion.split(ANSWER_END, 1)[0].strip()


def score_completion(record: Mapping[str, Any], completion: str) -> float:
    """Score a completion of a task record: 1.0 if its answer is exactly right, else 0.0.

    Raises:
        ValueError: the record names an unknown task or lacks an ``answer``.
    """
    _get_task(str(record.get("task")))
    if "answer" not in record:
        raise ValueError(f"record {record.get('id')!r} has no 'answer' field")
    return 1.0 if extract_answer(completion) == record["answer"] else 0.0


def synthetic_reward(prompt: Prompt, completion: str, metadata: Mapping[str, Any]) -> float:
    """The ``synthetic`` built-in reward (:mod:`laminar_common.data.rewards`):
    :func:`score_completion` of ``metadata`` (which holds ``task`` and ``answer``).

    Raises:
        ValueError: the record names an unknown task or lacks an ``answer``.
    """
    return score_completion(metadata, completion)


def write_jsonl(path: str | Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write records as JSON lines (creating parent directories); return the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
    return count
