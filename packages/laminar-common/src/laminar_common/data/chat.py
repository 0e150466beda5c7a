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

Multi-turn: after the model's turn ends on its stop token, what follows in the
sequence (the tool results and the next assistant header) is taken from the
template itself (:func:`observation_text`): the conversation is rendered with
and without the new messages, and the difference, plus whatever the template
writes after the stop token's text, is encoded. A template that does not render
the longer conversation as an extension of the shorter one is refused.

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

__all__ = ["Prompt", "prompt_token_ids", "render_chat", "observation_text", "eos_token_ids",
           "has_chat_template"]

Prompt = str | Sequence[Mapping[str, str]]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]],
                *, add_generation_prompt: bool = True,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The chat template's text for ``messages`` (with the assistant's generation prompt;
    ``tools``: function descriptions the template lists for the model).

    Raises:
        ConfigError: the tokenizer has no chat template (chat-message prompts need one).
    """
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(f"tokenizer {name!r} has no chat_template, but the prompt is a list "
                          "of chat messages (add a chat_template to tokenizer_config.json, or "
                          "use text prompts: data.chat_template: never)")
    kwargs = {"tools": [dict(t) for t in tools]} if tools else {}
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def observation_text(tokenizer: Any, history: Sequence[Mapping[str, str]],
                     observations: Sequence[Mapping[str, str]], stop_text: str,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The text that follows a model's turn ending in ``stop_text``: the template's rest of
    that turn, ``observations`` (tool results) and the next assistant header.

    Args:
        history: the conversation up to and including the model's last message.
        observations: the messages the environment adds.
        stop_text: the text of the stop token the model's turn ended with (e.g.
            ``<|im_end|>``); what the template writes after it belongs here.

    Raises:
        ConfigError: the template does not render the longer conversation as an
            extension of the shorter one, or never writes ``stop_text``.
    """
    base = render_chat(tokenizer, history, add_generation_prompt=False, tools=tools)
    full = render_chat(tokenizer, [*history, *observations], tools=tools)
    if not full.startswith(base):
        raise ConfigError("the chat template renders a conversation with tool results added "
                          "differently from the conversation without them (not a prefix), "
                          "so observation tokens cannot be appended to a running sequence")
    cut = base.rfind(stop_text) if stop_text else -1
    if cut < 0:
        raise ConfigError(f"the chat template never writes the stop token {stop_text!r} after "
                          "an assistant message; set the worker's stop tokens to the template's "
                          "end-of-turn token")
    return base[cut + len(stop_text):] + full[len(base):]


def prompt_token_ids(tokenizer: Any, prompt: Prompt,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids of a text prompt or of chat messages (see module docstring; ``tools``:
    function descriptions the chat template lists)."""
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer(prompt)["input_ids"]]
    text = render_chat(tokenizer, prompt, tools=tools)
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
