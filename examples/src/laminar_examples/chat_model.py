"""The math example's small chat policy: a BPE tokenizer with ChatML, and a Qwen2 model.

This module builds, offline and in code, a model directory shaped like a real
Qwen2.5 instruct checkpoint, so the code that loads it (rollout worker, trainer)
is the code that loads a real one:

- ``build_chat_tokenizer``: a byte-level BPE trained with ``tokenizers`` on a
  corpus, with Qwen2's pre-tokenizer (its split regex, digits one by one), NFC
  normaliser and byte-level decoder, wrapped as ``PreTrainedTokenizerFast``.
  Special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
  (eos) hold ids 0, 1, 2; no BOS is added. ``chat_template`` is ChatML
  (``CHATML_TEMPLATE``). Because the pipeline is Qwen2's own, transformers'
  ``Qwen2Tokenizer`` (which ``AutoTokenizer`` may pick for ``model_type:
  qwen2``) rebuilds the same ids from the saved ``tokenizer.json``.
- ``build_chat_model``: a randomly initialised (seeded) ``Qwen2ForCausalLM``
  with tied embeddings.
- ``save_chat_model``: ``save_pretrained`` of both, with
  ``generation_config.json`` listing ``eos_token_id: [<|im_end|>, <|endoftext|>]``
  as Qwen's does.

The supervised warm start that trains this model lives in
``laminar_examples.chat_warmstart``.

Invariants: deterministic for fixed seeds and corpus on one machine and thread
count; nothing here touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

__all__ = [
    "CHATML_TEMPLATE",
    "CHAT_MODEL_SIZES",
    "CHAT_SPECIAL_TOKENS",
    "DEFAULT_VOCAB_SIZE",
    "ENDOFTEXT_ID",
    "IM_END_ID",
    "IM_START_ID",
    "build_chat_model",
    "build_chat_tokenizer",
    "save_chat_model",
]

CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = range(len(CHAT_SPECIAL_TOKENS))

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as in Qwen2.5's template, without its default system message (which
would add some 20 tokens to every prompt of a model this small)."""

# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

DEFAULT_VOCAB_SIZE = 512
CHAT_MODEL_SIZES: dict[str, int] = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 384,
    "max_position_embeddings": 128,
}
"""Model size of the math example (about 0.8M parameters with a 512-token vocabulary)."""


def build_chat_tokenizer(corpus: Iterable[str],
                         vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a Qwen2-style byte-level BPE on ``corpus`` and wrap it with ChatML.

    ``corpus`` should hold the texts the model will see (rendered chat turns);
    any text still encodes, byte by byte where no merge applies.
    """
    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=CHAT_MODEL_SIZES["max_position_embeddings"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(CHAT_SPECIAL_TOKENS))
    assert ids == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID], ids
    return tokenizer


def build_chat_model(
    vocab_size: int,
    *,
    hidden_size: int = CHAT_MODEL_SIZES["hidden_size"],
    num_layers: int = CHAT_MODEL_SIZES["num_layers"],
    num_heads: int = CHAT_MODEL_SIZES["num_heads"],
    num_kv_heads: int = CHAT_MODEL_SIZES["num_kv_heads"],
    intermediate_size: int = CHAT_MODEL_SIZES["intermediate_size"],
    max_position_embeddings: int = CHAT_MODEL_SIZES["max_position_embeddings"],
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised (seeded) float32 Qwen2 causal LM with tied embeddings.

    Raises:
        ValueError: ``hidden_size`` not divisible by ``num_heads``, or
            ``num_heads`` not divisible by ``num_kv_heads``.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.bos_token_id = ENDOFTEXT_ID
    model.generation_config.pad_token_id = ENDOFTEXT_ID
    model.generation_config.eos_token_id = [IM_END_ID, ENDOFTEXT_ID]
    return model


def save_chat_model(out_dir: str | Path, model: Qwen2ForCausalLM,
                    tokenizer: PreTrainedTokenizerFast) -> Path:
    """``save_pretrained`` model and tokenizer into ``out_dir`` (created); return it.

    ``tokenizer_config.json`` names ``Qwen2Tokenizer`` (as a real Qwen2.5
    checkpoint does, so transformers 4.x picks its fast class and 5.x its
    tokenizers backend) and carries the chat template.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = [IM_END_ID, ENDOFTEXT_ID]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "Qwen2Tokenizer"
    tokenizer_config.setdefault("chat_template", CHATML_TEMPLATE)
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out
