"""Tokenizers the worker uses around an engine (engines see token ids only).

- :class:`HfTokenizer`: the tokenizer saved next to a model (``save_pretrained``
  directory), loaded offline. ``encode`` applies the tokenizer's own template
  (e.g. a leading ``<bos>``), exactly as the trainer's warm start did.
- :class:`ByteTokenizer`: for the simulated engine: UTF-8 bytes offset past a
  few special ids. It exists so scheduling benchmarks need no model files.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Tokenizer", "HfTokenizer", "ByteTokenizer", "make_tokenizer"]


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HfTokenizer:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        eos = self._tok.eos_token_id
        self.eos_token_ids = () if eos is None else (int(eos),)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class ByteTokenizer:
    OFFSET = 3
    eos_token_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [1] + [b + self.OFFSET for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET).decode(
            "utf-8", "replace")


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
