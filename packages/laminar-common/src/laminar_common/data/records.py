"""Datasets: JSONL and parquet files read into validated :class:`Record` objects.

Owns what a dataset row means to Laminar: where its prompt, id and answer are
(:class:`DataConfig`, dot paths such as ``reward_model.ground_truth``), the
prompt's normal form (text, or chat messages to be rendered with a tokenizer's
chat template) and the metadata that travels with it to the reward function.
It reads the formats RL engineers bring: verl parquet (``prompt`` = a list of
chat messages, ``reward_model``, ``data_source``, ``extra_info``, no ``id``),
GSM8K-style JSONL (``question`` / ``answer``), Laminar's own
``{"id", "prompt", ...}`` lines.

It must not tokenize, render templates or score (``chat``, ``rewards``), nor
import ``relay``, ``launch`` or ``consume``; pyarrow is imported only to read a
parquet file.

Invariants: a file loads completely or raises :class:`ConfigError` naming the
file, the line (JSONL, 1-based) or row (parquet, 0-based) and the field's dot
path; ids are non-empty, unique within the file and never contain ``#`` or
``@e`` (the rollout builds trajectory ids as ``<id>#<sample>`` and later
epochs' ids as ``<id>@e<epoch>``); metadata holds JSON types only.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import field_validator, model_validator

from laminar_common.config import LaminarModel
from laminar_common.errors import ConfigError
from laminar_common.jsonl import iter_jsonl

__all__ = ["DataConfig", "Record", "load_records", "prompt_text", "ROLES", "RESERVED_IN_IDS"]

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
"""Chat message roles a prompt may hold."""
RESERVED_IN_IDS = ("#", "@e")
"""What a record id must not contain: the rollout's trajectory-id (``#``) and epoch
(``@e``) separators."""
DEFAULT_ANSWER_KEY = "answer"
VERL_ANSWER_KEY = "reward_model.ground_truth"
"""Where a verl dataset keeps the answer: read when the default ``answer`` is absent."""

_DOT_PATH = re.compile(r"[^.]+(\.[^.]+)*")


class DataConfig(LaminarModel):
    """Where a dataset row's prompt, id and answer are, and how its prompt is shown."""

    prompt_key: str = "prompt"
    """Dot path of the prompt: a string (encoded as is) or a list of chat messages
    ``{"role": system|user|assistant|tool, "content": str}`` (rendered with the
    tokenizer's chat template)."""
    answer_key: str | None = DEFAULT_ANSWER_KEY
    """Dot path of the answer, e.g. ``reward_model.ground_truth`` (verl); its value,
    as a string, becomes ``metadata["answer"]`` for the reward. A record without one
    is fine (some rewards need none), but a path other than ``answer`` that no record
    of the file has is an error (a typo). With the default ``answer``, a record that has
    none there but has verl's ``reward_model.ground_truth`` answers from that (a verl
    parquet as it is). None: take no answer."""
    id_key: str | None = None
    """Dot path of the record id (a string or an integer). None: the record's ``id``
    field when the file's records have one, else ``<file stem>:<line>`` (JSONL,
    1-based) or ``<file stem>:<row>`` (parquet, 0-based), stable for a given file."""
    system_prompt: str | None = None
    """A system message put first in every message prompt that has none. With
    ``chat_template: auto`` it also turns a text prompt into messages (system, then
    the text as the user's message): a system prompt only exists in a chat."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """auto: text prompts stay text, message prompts stay messages (see
    system_prompt); always: a text prompt becomes one user message, so every prompt
    goes through the chat template; never: every prompt is text, a message prompt is
    an error."""
    shuffle: bool = False
    """Visit each epoch in its own random order, a permutation drawn from
    (seed, epoch) alone, so a resumed run continues the same order. Reading a file
    keeps its order; the rollout's prompt cursor shuffles."""
    seed: int = 0
    """Seed of the shuffle."""

    @field_validator("prompt_key", "answer_key", "id_key")
    @classmethod
    def _dot_path(cls, value: str | None) -> str | None:
        if value is not None and not _DOT_PATH.fullmatch(value):
            raise ValueError(f"{value!r} is not a dot path like 'reward_model.ground_truth'")
        return value

    @model_validator(mode="after")
    def _system_prompt_needs_chat(self) -> DataConfig:
        if self.system_prompt is not None and self.chat_template == "never":
            raise ValueError("system_prompt needs a chat template; chat_template is 'never'")
        return self


@dataclass(frozen=True, slots=True)
class Record:
    """One dataset row, validated.

    ``prompt`` is a string (encoded as is) or a tuple of chat messages
    ``{"role", "content"}`` (rendered with the tokenizer's chat template);
    ``metadata`` is every other field of the row, nested values as the file holds
    them, plus ``"answer"`` (a string) when the row has one at ``answer_key``.
    """

    record_id: str
    prompt: str | tuple[dict[str, str], ...]
    metadata: dict[str, Any]


def prompt_text(prompt: str | tuple[dict[str, str], ...]) -> str:
    """A display string for logs: the text itself, or the last user message's content
    (the last message's when no user spoke)."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message["role"] == "user":
            return message["content"]
    return prompt[-1]["content"] if prompt else ""


def load_records(path: str | Path, config: DataConfig = DataConfig()) -> list[Record]:
    """Read and validate every record of a ``.jsonl`` / ``.json`` (JSON lines) or
    ``.parquet`` dataset (parquet needs pyarrow).

    Raises:
        ConfigError: a missing, empty or unreadable file, an unknown suffix, a
            malformed record (naming its line or row and the field's dot path), a
            duplicate id (naming both), records that disagree on having an ``id``,
            or an ``answer_key`` no record has.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data file {str(p)!r} does not exist")
    records: list[Record] = []
    seen: dict[str, str] = {}
    id_field: tuple[bool, str] | None = None  # (first record has "id", its place)
    answered = 0
    for where, place, obj in _rows(p):
        if config.id_key is None:
            if id_field is None:
                id_field = ("id" in obj, place)
            elif ("id" in obj) != id_field[0]:
                with_id, without = (id_field[1], place) if id_field[0] else (place, id_field[1])
                raise ConfigError(
                    f"{p}: records disagree on ids: {with_id} has an 'id' field, {without} has "
                    "none; give every record an id or none (ids are then derived from the file "
                    "name and line or row), or set id_key")
        record, has_answer = _record(obj, where, f"{p.stem}:{place.split()[-1]}", config)
        if record.record_id in seen:
            raise ConfigError(f"{p}: duplicate id {record.record_id!r} "
                              f"({seen[record.record_id]} and {place})")
        seen[record.record_id] = place
        answered += has_answer
        records.append(record)
    if not records:
        raise ConfigError(f"data file {str(p)!r} holds no records")
    key = config.answer_key
    if key is not None and key != DEFAULT_ANSWER_KEY and answered == 0:
        raise ConfigError(f"{p}: no record has answer_key {key!r} (a typo?); set answer_key to "
                          "the answer's dot path, or to null if the reward needs no answer")
    if key is not None and 0 < answered < len(records):
        log.warning("%s: %d of %d records have no answer at %r", p, len(records) - answered,
                    len(records), key)
    return records


# -- reading ------------------------------------------------------------------


def _rows(p: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(where, place, row)``: ``where`` prefixes errors, ``place`` is "line N" / "row N"."""
    if p.suffix in (".jsonl", ".json"):
        for where, obj in iter_jsonl(p):
            yield where, f"line {where.rpartition(':')[2]}", obj
    elif p.suffix == ".parquet":
        for row, obj in enumerate(_parquet_rows(p)):
            yield f"{p}: row {row}", f"row {row}", obj
    else:
        raise ConfigError(f"data file {str(p)!r}: unknown suffix {p.suffix!r}; use .jsonl or "
                          ".json (JSON lines) or .parquet")


def _parquet_rows(p: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"data file {str(p)!r}: reading parquet needs pyarrow "
                          "(pip install pyarrow, or 'laminar-rollout[parquet]')") from exc
    try:
        return pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"data file {str(p)!r}: not a readable parquet file: {exc}") from exc


# -- one record -----------------------------------------------------------------

_MISSING = object()


def _get(obj: Mapping[str, Any], path: str) -> Any:
    """The value at dot path ``path``, or ``_MISSING``."""
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _without(obj: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A copy of ``obj`` without the field at dot path ``path`` (containers copied on the way)."""
    head, _, rest = path.partition(".")
    out = dict(obj)
    if not rest:
        out.pop(head, None)
    elif isinstance(out.get(head), Mapping):
        out[head] = _without(out[head], rest)
    return out


def _record(obj: dict[str, Any], where: str, derived_id: str,
            config: DataConfig) -> tuple[Record, bool]:
    prompt_key = config.prompt_key
    raw_prompt = _get(obj, prompt_key)
    if raw_prompt is _MISSING or raw_prompt is None:
        raise ConfigError(f"{where}: field {prompt_key!r} is missing (the prompt; see prompt_key)")
    prompt = _prompt(raw_prompt, where, prompt_key, config)

    id_key = config.id_key if config.id_key is not None else ("id" if "id" in obj else None)
    if id_key is None:
        record_id = _checked_id(derived_id, where, None)
    else:
        raw_id = _get(obj, id_key)
        if raw_id is _MISSING:
            raise ConfigError(f"{where}: field {id_key!r} is missing (the record id; see id_key)")
        record_id = _checked_id(raw_id, where, id_key)

    metadata = _without(obj, prompt_key)
    if id_key is not None:
        metadata = _without(metadata, id_key)
    for key, value in metadata.items():
        _check_json(value, where, key)
    has_answer = False
    if config.answer_key is not None:
        answer = _get(obj, config.answer_key)
        if (answer is _MISSING or answer is None) and config.answer_key == DEFAULT_ANSWER_KEY:
            answer = _get(obj, VERL_ANSWER_KEY)
        if answer is not _MISSING and answer is not None:
            _check_json(answer, where, config.answer_key)
            metadata["answer"] = answer if isinstance(answer, str) else \
                json.dumps(answer, ensure_ascii=False)
            has_answer = True
    return Record(record_id, prompt, metadata), has_answer


def _checked_id(value: Any, where: str, key: str | None) -> str:
    field = f"field {key!r}" if key is not None else "the derived id"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{where}: {field} must be a string or an integer, "
                          f"got {_kind(value)}")
    text = str(value)
    if not text:
        raise ConfigError(f"{where}: {field} is an empty string")
    for part in RESERVED_IN_IDS:
        if part in text:
            hint = ("rename the file or set id_key" if key is None
                    else "the rollout builds trajectory ids as <id>#<sample> and later "
                         "epochs' ids as <id>@e<epoch>")
            raise ConfigError(f"{where}: {field} {text!r} contains {part!r}, which ids must not "
                              f"hold ({hint})")
    return text


def _prompt(value: Any, where: str, path: str,
            config: DataConfig) -> str | tuple[dict[str, str], ...]:
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"{where}: field {path!r} is an empty string")
        if config.chat_template == "always" or config.system_prompt is not None:
            return _with_system(({"role": "user", "content": value},), config)
        return value
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: field {path!r} must be a string or a list of chat "
                          f"messages, got {_kind(value)}")
    if config.chat_template == "never":
        raise ConfigError(f"{where}: field {path!r} is a list of chat messages but "
                          "chat_template is 'never'")
    if not value:
        raise ConfigError(f"{where}: field {path!r} is an empty list of messages")
    return _with_system(tuple(_message(m, where, f"{path}[{i}]") for i, m in enumerate(value)),
                        config)


def _message(value: Any, where: str, path: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: field {path!r} must be a message "
                          f"{{'role': ..., 'content': ...}}, got {_kind(value)}")
    # Parquet gives every struct the union of the fields: a None one is padding.
    extra = sorted(str(k) for k, v in value.items() if k not in ("role", "content")
                   and v is not None)
    if extra:
        raise ConfigError(f"{where}: field {path!r} has {', '.join(map(repr, extra))} besides "
                          "'role' and 'content'")
    role, content = value.get("role"), value.get("content")
    if role not in ROLES:
        raise ConfigError(f"{where}: field '{path}.role' must be one of {', '.join(ROLES)}, "
                          f"got {role!r}")
    if not isinstance(content, str):
        raise ConfigError(f"{where}: field '{path}.content' must be a string, "
                          f"got {_kind(content)}")
    return {"role": role, "content": content}


def _with_system(messages: tuple[dict[str, str], ...],
                 config: DataConfig) -> tuple[dict[str, str], ...]:
    if config.system_prompt is None or any(m["role"] == "system" for m in messages):
        return messages
    return ({"role": "system", "content": config.system_prompt}, *messages)


def _check_json(value: Any, where: str, path: str) -> None:
    """Refuse anything but JSON types (finite floats, str keys), naming the dot path."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where}: field {path!r} is {value!r}, not a finite number")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, where, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}: field {path!r} has a non-string key {key!r}")
            _check_json(item, where, f"{path}.{key}")
        return
    raise ConfigError(f"{where}: field {path!r} must hold JSON values (string, number, bool, "
                      f"null, list, object), got {_kind(value)}")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
