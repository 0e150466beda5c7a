"""The demo's tiny policy: a character-level tokenizer and a small Llama model.

This module owns everything needed to produce, offline and in code, a model
directory that the rest of Laminar loads like any Hugging Face checkpoint:

- ``build_tokenizer``: a character-level ``PreTrainedTokenizerFast`` over
  ``laminar_examples.tasks.TASK_ALPHABET`` plus ``<pad>``, ``<bos>``, ``<eos>``
  and ``<unk>``. Encoding a text prepends ``<bos>``; there are no merges, so
  ``encode(prompt + answer) == encode(prompt) + chars(answer)``.
- ``build_tiny_model``: a randomly initialised (seeded) ``LlamaForCausalLM``.
  Llama rather than Qwen2 because transformers 5 ignores a checkpoint's own
  tokenizer class for ``model_type: qwen2`` and rebuilds a byte-level Qwen2
  tokenizer, which would re-tokenize our character vocabulary differently.

Decoding lives in ``laminar_trainer.decoding`` (held-out accuracy on task records
in ``laminar_examples.accuracy``); the generic log-prob code the loss needs in
``laminar_trainer.logprobs``.

The supervised warm start that makes a saved model directory from these
lives in ``laminar_examples.warmstart``. The default model size is the one the
feasibility experiment picked for the demo run; see ``tools/rl_feasibility.py``.

Invariants: everything is deterministic for fixed seeds on one machine and
thread count (CPU matmuls may differ in the last bits across thread counts);
special-token ids are fixed (``PAD_ID=0, BOS_ID=1, EOS_ID=2, UNK_ID=3``) and
the character ids follow ``TASK_ALPHABET`` order.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .tasks import TASK_ALPHABET

__all__ = ["BOS_ID", "DEFAULT_MODEL_SIZES", "EOS_ID", "PAD_ID", "SPECIAL_TOKENS", "UNK_ID",
           "build_tiny_model", "build_tokenizer"]


SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
DEFAULT_MODEL_SIZES: dict[str, int] = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 64,
}
"""Model size used by the demo (about 0.8M parameters)."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer over ``TASK_ALPHABET`` plus special tokens."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *TASK_ALPHABET])}
    if len(vocab) != len(SPECIAL_TOKENS) + len(TASK_ALPHABET):
        raise ValueError("TASK_ALPHABET repeats a character or clashes with a special token")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=DEFAULT_MODEL_SIZES["max_position_embeddings"],
    )


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = DEFAULT_MODEL_SIZES["hidden_size"],
    num_layers: int = DEFAULT_MODEL_SIZES["num_layers"],
    num_heads: int = DEFAULT_MODEL_SIZES["num_heads"],
    intermediate_size: int = DEFAULT_MODEL_SIZES["intermediate_size"],
    max_position_embeddings: int = DEFAULT_MODEL_SIZES["max_position_embeddings"],
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build a randomly initialised (seeded) float32 Llama causal LM.

    Raises:
        ValueError: ``hidden_size`` is not divisible by ``num_heads``.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        # Untied input/output embeddings: in the feasibility runs the warm start
        # left less probability on non-answer characters than with tied ones.
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    return model
