"""Prompt -> token ids, the same way in every tier.

A prompt is text (encoded as is, with the tokenizer's own special tokens such as
a leading ``<bos>``) or a sequence of chat messages, rendered with the
tokenizer's chat template and a generation prompt
(``apply_chat_template(..., add_generation_prompt=True)``) and then encoded
without adding special tokens again (the template already holds them). The
rollout worker and the trainer (held-out evaluation, warm start) both call
:func:`prompt_token_ids`, so the ids a trajectory was generated from are the ids
the trainer would have built for the same record.

The tokenizer is duck-typed (a Hugging Face ``PreTrainedTokenizerBase``); this
module imports neither torch nor transformers.

EOS: a model stops on the tokenizer's ``eos_token_id`` *and* on every id in its
``generation_config.json`` ``eos_token_id`` (an int or a list: chat models list
both ``<|im_end|>`` and ``<|endoftext|>``); :func:`eos_token_ids` merges them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from laminar_common.errors import ConfigError

__all__ = ["Prompt", "prompt_token_ids", "render_chat", "eos_token_ids", "has_chat_template"]

Prompt = str | Sequence[Mapping[str, str]]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]],
                *, add_generation_prompt: bool = True) -> str:
    """The chat template's text for ``messages`` (with the assistant's generation prompt).

    Raises:
        ConfigError: the tokenizer has no chat template (chat-message prompts need one).
    """
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(f"tokenizer {name!r} has no chat_template, but the prompt is a list "
                          "of chat messages (add a chat_template to tokenizer_config.json, or "
                          "use text prompts: data.chat_template: never)")
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def prompt_token_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a text prompt or of chat messages (see module docstring)."""
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer(prompt)["input_ids"]]
    text = render_chat(tokenizer, prompt)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def eos_token_ids(tokenizer: Any, model_dir: str | Path | None = None) -> tuple[int, ...]:
    """The tokenizer's EOS id plus every EOS id of ``model_dir/generation_config.json``.

    Raises:
        ConfigError: generation_config.json exists but is not valid JSON or its
            ``eos_token_id`` is not an int or a list of ints.
    """
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(int(eos))
    if model_dir is not None:
        path = Path(model_dir) / "generation_config.json"
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as exc:
                raise ConfigError(f"{path}: not a readable JSON object: {exc}") from exc
            values = value if isinstance(value, list) else ([] if value is None else [value])
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ConfigError(f"{path}: eos_token_id must be an int or a list of ints, "
                                      f"got {value!r}")
                ids.append(v)
    return tuple(dict.fromkeys(ids))
