"""GSM8K-style arithmetic word problems, written as verl-format parquet.

This module owns the math example's data (``examples/math.yaml``): templated
word problems (names, objects, one or two operations on small numbers) with a
worked answer that ends in the GSM8K convention ``#### N``, the plausible
mistake a noisy demonstration makes, and the parquet layout verl's
``data.train_files`` reads::

    data_source   "laminar/arith_gsm8k"
    prompt        [{"role": "user", "content": question + " " + MATH_INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "14"}
    extra_info    {"split": "train", "index": 7, "question": ..., "answer": "12+7=19. ... #### 14"}

There is no ``id`` column: a reader derives ids (``laminar_common.data``).

Worked answers are compact (``"12+7=19. 19-5=14. #### 14"``) so that a small
chat model's completion fits in about 24 tokens with digit-by-digit
tokenization: every operand, intermediate and result is at most two digits.

Held-out split: a question belongs to the split ``tasks.split_of`` gives its
text, so train and eval never share a question whatever seeds and sizes are
used; within one call questions are unique.

Invariants:
- Stdlib only, except pyarrow, imported only to write parquet (with a clear
  error when missing); never torch, transformers or numpy.
- Deterministic in ``(n, seed, split, difficulty)``, independent of Python's
  hash randomisation.
- Every ground truth equals the number after the worked answer's ``####`` and
  is the exact result of the problem's operations.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tasks import SPLITS, split_of

__all__ = [
    "DATA_SOURCE",
    "MATH_DIFFICULTY",
    "MATH_INSTRUCTION",
    "MathProblem",
    "make_math_problems",
    "math_messages",
    "math_rows",
    "parse_math_difficulty",
    "write_math_prompts",
]

DATA_SOURCE = "laminar/arith_gsm8k"
MATH_INSTRUCTION = "Put the final answer after ####."
MATH_DIFFICULTY: dict[str, int] = {"max_value": 9, "max_factor": 5, "max_steps": 2}
"""Default difficulty: operands up to ``max_value``, multipliers up to
``max_factor``, up to ``max_steps`` operations (1 or 2)."""

_MAX_RESULT = 99
_MAX_DRAWS_PER_PROBLEM = 1000

NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo",
         "Kai", "Lea", "Max", "Nia", "Omar", "Pia", "Ray", "Sam", "Tia", "Zoe")
OBJECTS = ("apples", "books", "cards", "coins", "eggs", "marbles", "pens", "shells",
           "stamps", "stickers", "toys", "cookies")

Step = tuple[int, str, int, int]
"""One operation of a worked answer: ``(left, op, right, result)``, op in ``+ - *``."""


@dataclass(frozen=True)
class MathProblem:
    """One word problem: its question, worked steps and a plausible wrong solution."""

    question: str
    steps: tuple[Step, ...]
    mistake_steps: tuple[Step, ...]

    @property
    def ground_truth(self) -> str:
        return str(self.steps[-1][3])

    @property
    def answer(self) -> str:
        """The worked answer, e.g. ``"12+7=19. 19-5=14. #### 14"``."""
        return _worked(self.steps)

    @property
    def mistake(self) -> str:
        """A worked answer with a reasoning error: the wrong operation on a one-step
        problem, stopping one step short on a two-step one (right only for 2*2)."""
        return _worked(self.mistake_steps)


def _worked(steps: Sequence[Step]) -> str:
    lines = " ".join(f"{a}{op}{b}={r}." for a, op, b, r in steps)
    return f"{lines} #### {steps[-1][3]}"


def _step(a: int, op: str, b: int) -> Step:
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return a, op, b, result


def _wrong_op(a: int, op: str, b: int) -> Step:
    # Misreading the question: adding what should be taken away, and so on.
    if op == "+":
        return _step(max(a, b), "-", min(a, b))
    return _step(a, "+", b)


_Op = tuple[int | None, str, int]
"""An operation before solving: ``None`` as left operand means the previous result."""
_Draw = Callable[[random.Random, int, int], tuple[str, list[_Op]]]


def _names(rng: random.Random) -> tuple[str, str, str]:
    first, second = rng.sample(NAMES, 2)
    return first, second, rng.choice(OBJECTS)


def _one_add(rng: random.Random, hi: int, factor: int) -> tuple[str, list[_Op]]:
    p, q, obj = _names(rng)
    a, b = rng.randint(2, hi), rng.randint(2, hi)
    text = rng.choice((
        f"{p} has {a} {obj}. {q} gives {p} {b} more {obj}. How many {obj} does {p} have now?",
        f"{p} found {a} {obj} in the morning and {b} {obj} in the afternoon. "
        f"How many {obj} did {p} find in all?",
    ))
    return text, [(a, "+", b)]


def _one_sub(rng: random.Random, hi: int, factor: int) -> tuple[str, list[_Op]]:
    p, q, obj = _names(rng)
    a = rng.randint(2, hi)
    b = rng.randint(1, a - 1)
    text = rng.choice((
        f"{p} had {a} {obj} and gave {b} of them to {q}. How many {obj} does {p} have left?",
        f"There are {a} {obj} in a box. {p} takes {b} of them out. "
        f"How many {obj} are still in the box?",
    ))
    return text, [(a, "-", b)]


def _one_mul(rng: random.Random, hi: int, factor: int) -> tuple[str, list[_Op]]:
    p, _, obj = _names(rng)
    a, b = rng.randint(2, factor), rng.randint(2, hi)
    text = f"{p} buys {a} bags with {b} {obj} in each bag. How many {obj} does {p} buy?"
    return text, [(a, "*", b)]


def _two_add_sub(rng: random.Random, hi: int, factor: int) -> tuple[str, list[_Op]]:
    p, q, obj = _names(rng)
    a, b = rng.randint(2, hi), rng.randint(1, hi)
    c = rng.randint(1, a + b - 1)
    text = (f"{p} has {a} {obj}. {p} buys {b} more and then gives {c} to {q}. "
            f"How many {obj} does {p} have now?")
    return text, [(a, "+", b), (None, "-", c)]


def _two_sub_add(rng: random.Random, hi: int, factor: int) -> tuple[str, list[_Op]]:
    p, _, obj = _names(rng)
    a = rng.randint(2, hi)
    b, c = rng.randint(1, a - 1), rng.randint(1, hi)
    text = (f"{p} had {a} {obj}, lost {b} of them and then found {c} more. "
            f"How many {obj} does {p} have now?")
    return text, [(a, "-", b), (None, "+", c)]


def _two_mul_add(rng: random.Random, hi: int, factor: int) -> tuple[str, list[_Op]]:
    p, q, obj = _names(rng)
    a, b, c = rng.randint(2, factor), rng.randint(2, hi), rng.randint(2, hi)
    text = (f"{p} buys {a} packs with {b} {obj} in each pack, and {q} gives {p} {c} more "
            f"{obj}. How many {obj} does {p} have?")
    return text, [(a, "*", b), (None, "+", c)]


_ONE_STEP: tuple[_Draw, ...] = (_one_add, _one_sub, _one_mul)
_TWO_STEP: tuple[_Draw, ...] = (_two_add_sub, _two_sub_add, _two_mul_add)


def _solve(ops: Sequence[_Op]) -> tuple[Step, ...]:
    steps: list[Step] = []
    for a, op, b in ops:
        steps.append(_step(steps[-1][3] if a is None else a, op, b))
    return tuple(steps)


def _mistaken(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    if len(steps) > 1:
        return steps[:1]  # stops one step short
    a, op, b, _ = steps[0]
    return (_wrong_op(a, op, b),)


def parse_math_difficulty(items: Sequence[str]) -> dict[str, int]:
    """Parse ``KEY=INT`` strings (a CLI's ``--difficulty``) for the math problems.

    Raises:
        ValueError: an unknown key, an item without ``=`` or a non-integer value.
    """
    out: dict[str, int] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"difficulty {item!r}: expected KEY=INT")
        if key not in MATH_DIFFICULTY:
            raise ValueError(f"difficulty {item!r}: math accepts {sorted(MATH_DIFFICULTY)}")
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"difficulty {item!r}: {value!r} is not an integer") from None
    return out


def _settings(difficulty: Mapping[str, int]) -> dict[str, int]:
    unknown = sorted(set(difficulty) - set(MATH_DIFFICULTY))
    if unknown:
        raise ValueError(f"math has no difficulty setting(s) {unknown}; "
                         f"it accepts {sorted(MATH_DIFFICULTY)}")
    settings = {**MATH_DIFFICULTY, **difficulty}
    if not 2 <= settings["max_value"] <= 49:
        raise ValueError(f"max_value must be in 2..49, got {settings['max_value']}")
    if not 2 <= settings["max_factor"] <= 9:
        raise ValueError(f"max_factor must be in 2..9, got {settings['max_factor']}")
    if settings["max_steps"] not in (1, 2):
        raise ValueError(f"max_steps must be 1 or 2, got {settings['max_steps']}")
    return settings


def make_math_problems(n: int, seed: int, split: str = "train",
                       **difficulty: int) -> list[MathProblem]:
    """Draw ``n`` distinct word problems of one split.

    Args:
        n: number of problems (>= 0).
        seed: RNG seed; the same arguments always give the same problems.
        split: ``"train"`` or ``"eval"``.
        **difficulty: overrides of ``MATH_DIFFICULTY``.

    Raises:
        ValueError: bad split, ``n`` or difficulty, or a problem space too
            small for ``n`` distinct problems in the split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    settings = _settings(difficulty)
    draws = _ONE_STEP + (_TWO_STEP if settings["max_steps"] == 2 else ())
    rng = random.Random(f"arith_gsm8k/{split}/{seed}")
    problems: list[MathProblem] = []
    seen: set[str] = set()
    attempts = 0
    while len(problems) < n:
        if attempts >= _MAX_DRAWS_PER_PROBLEM * (len(problems) + 1):
            raise ValueError(f"found only {len(problems)} distinct {split!r} math problems "
                             f"with {settings} after {attempts} draws")
        attempts += 1
        question, ops = rng.choice(draws)(rng, settings["max_value"], settings["max_factor"])
        steps = _solve(ops)
        if any(r > _MAX_RESULT for *_, r in steps):
            continue
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        problems.append(MathProblem(question, steps, _mistaken(steps)))
    return problems


def math_messages(question: str) -> list[dict[str, str]]:
    """The chat prompt of a question: one user turn with the answer-format instruction."""
    return [{"role": "user", "content": f"{question} {MATH_INSTRUCTION}"}]


def math_rows(problems: Iterable[MathProblem], split: str) -> list[dict[str, Any]]:
    """verl-format rows (see the module docstring), ``index`` counting from 0."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": math_messages(p.question),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.ground_truth},
            "extra_info": {"split": split, "index": i, "question": p.question,
                           "answer": p.answer},
        }
        for i, p in enumerate(problems)
    ]


def write_math_prompts(path: str | Path, n: int, split: str, seed: int,
                       **difficulty: int) -> int:
    """Write ``n`` problems of ``split`` as a verl-format parquet file; return the count.

    Raises:
        ValueError: bad arguments (see ``make_math_problems``) or a path not
            ending in ``.parquet``.
        ImportError: pyarrow is not installed.
    """
    path = Path(path)
    if path.suffix != ".parquet":
        raise ValueError(f"{path}: math prompts are written as .parquet")
    rows = math_rows(make_math_problems(n, seed, split, **difficulty), split)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("writing math prompts as parquet needs pyarrow "
                          "(pip install pyarrow)") from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return len(rows)
