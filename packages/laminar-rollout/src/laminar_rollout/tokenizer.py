"""Tokenizers the worker uses around an engine (engines see token ids only).

- :class:`HfTokenizer`: the tokenizer saved next to a model (``save_pretrained``
  directory), loaded offline. ``encode_prompt`` turns a text prompt or chat
  messages into ids with :func:`laminar_common.data.chat.prompt_token_ids`, the
  function the trainer uses too; EOS ids are the tokenizer's plus those of the
  model's ``generation_config.json``. ``encode_observation`` gives the tokens that
  follow a model turn in a multi-turn conversation, from the chat template
  (:func:`laminar_common.data.chat.observation_text`).
- :class:`ByteTokenizer`: for the simulated engine: UTF-8 bytes offset past a
  few special ids. It exists so scheduling benchmarks need no model files; it
  renders chat messages with a fixed ChatML-like text layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from laminar_common.data.chat import Prompt, eos_token_ids, observation_text, prompt_token_ids

__all__ = ["Tokenizer", "HfTokenizer", "ByteTokenizer", "make_tokenizer"]


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, prompt: Prompt, tools: Sequence[Mapping] | None = None
                      ) -> list[int]: ...

    def encode_observation(self, history: Sequence[Mapping[str, str]],
                           observations: Sequence[Mapping[str, str]], stop_id: int,
                           tools: Sequence[Mapping] | None = None) -> list[int]:
        """Tokens after a model turn that ended on ``stop_id``: the template's rest of the
        turn, ``observations`` and the next assistant header."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class HfTokenizer:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids = eos_token_ids(self._tok, model_dir)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def encode_prompt(self, prompt: Prompt, tools: Sequence[Mapping] | None = None
                      ) -> list[int]:
        """Text as is; chat messages through the chat template (ConfigError if none)."""
        return prompt_token_ids(self._tok, prompt, tools=tools)

    def encode_observation(self, history: Sequence[Mapping[str, str]],
                           observations: Sequence[Mapping[str, str]], stop_id: int,
                           tools: Sequence[Mapping] | None = None) -> list[int]:
        text = observation_text(self._tok, history, observations,
                                self._tok.decode([stop_id]), tools=tools)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class ByteTokenizer:
    OFFSET = 3
    eos_token_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [1] + [b + self.OFFSET for b in text.encode()]

    def encode_prompt(self, prompt: Prompt, tools: Sequence[Mapping] | None = None
                      ) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        return self.encode(render_plain_chat(prompt))

    def encode_observation(self, history: Sequence[Mapping[str, str]],
                           observations: Sequence[Mapping[str, str]], stop_id: int,
                           tools: Sequence[Mapping] | None = None) -> list[int]:
        """The plain layout's newline after the turn, the messages, the next header."""
        text = "\n" + render_plain_chat(observations)
        return [b + self.OFFSET for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET).decode(
            "utf-8", "replace")


def render_plain_chat(messages: Sequence[Mapping[str, str]]) -> str:
    """A fixed ChatML-like text layout for tokenizers without a template (simulated runs)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def make_tokenizer(engine_config) -> Tokenizer:
    """The tokenizer a worker's ``engine`` config implies: bytes for the simulated
    engine (and a custom one without ``tokenizer_dir``), else the Hugging Face
    tokenizer in ``model_dir`` / ``tokenizer_dir``."""
    if engine_config.type == "simulated":
        return ByteTokenizer()
    if engine_config.type == "custom":
        if engine_config.tokenizer_dir is None:
            return ByteTokenizer()
        return HfTokenizer(engine_config.tokenizer_dir)
    return HfTokenizer(engine_config.model_dir)
