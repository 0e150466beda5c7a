"""Tests for laminar_examples.chat_model and chat_warmstart: the math example's chat policy."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from laminar_common.data.chat import eos_token_ids, prompt_token_ids, render_chat
from laminar_examples.chat_model import (
    CHATML_TEMPLATE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    build_chat_model,
    build_chat_tokenizer,
    save_chat_model,
)
from laminar_examples.chat_warmstart import (
    chat_examples,
    math_accuracy,
    train_chat_supervised,
    warm_start_chat,
)
from laminar_examples.math_tasks import make_math_problems, math_messages

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
        "intermediate_size": 64, "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def problems():
    return make_math_problems(64, seed=0)


@pytest.fixture(scope="module")
def tokenizer(problems):
    corpus = [f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n{p.answer}"
              for p in problems]
    return build_chat_tokenizer(corpus, vocab_size=400)


def test_tokenizer_round_trips_and_has_chatml_special_tokens(tokenizer, problems):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) \
        == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    assert tokenizer.eos_token_id == IM_END_ID and tokenizer.pad_token_id == ENDOFTEXT_ID
    for text in [problems[0].question, problems[1].answer, "unseen: Zürich 1234 ok?\n"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Qwen2's split: digits are single tokens, so arithmetic sees every digit.
    assert tokenizer.tokenize("12+7=19") == ["1", "2", "+", "7", "=", "1", "9"]
    assert len(tokenizer("hello")["input_ids"]) == len(tokenizer.tokenize("hello"))  # no BOS


def test_chat_template_renders_chatml_and_prompt_ids_end_with_the_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert render_chat(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render_chat(tokenizer, messages, add_generation_prompt=False).endswith(
        "2+2?<|im_end|>\n")
    ids = prompt_token_ids(tokenizer, messages)
    tail = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert tail[0] == IM_START_ID and ids[-len(tail):] == tail
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2


def test_saved_directory_reloads_with_auto_classes(tokenizer, problems, tmp_path):
    model = build_chat_model(len(tokenizer), seed=1, **TINY)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    save_chat_model(tmp_path, model, tokenizer)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID]
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = math_messages(problems[3].question)
    assert prompt_token_ids(loaded_tok, messages) == prompt_token_ids(tokenizer, messages)
    assert loaded_tok(problems[3].answer, add_special_tokens=False)["input_ids"] == \
        tokenizer(problems[3].answer, add_special_tokens=False)["input_ids"]
    assert eos_token_ids(loaded_tok, tmp_path) == (IM_END_ID, ENDOFTEXT_ID)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([prompt_token_ids(tokenizer, messages)])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)


def test_model_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="num_heads"):
        build_chat_model(100, hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_chat_model(100, hidden_size=32, num_heads=4, num_kv_heads=3)


def test_a_few_supervised_steps_lower_the_loss(tokenizer, problems):
    model = build_chat_model(len(tokenizer), seed=0, **TINY)
    examples = chat_examples(problems[:8])
    torch.manual_seed(0)
    losses = train_chat_supervised(model, tokenizer, examples, 12, batch_size=8, lr=1e-2,
                                   warmup_steps=2)
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0]
    score, solved = math_accuracy(model, tokenizer, problems[:4], max_new_tokens=4)
    assert 0.0 <= score <= solved <= 1.0


def test_noisy_demonstrations_use_the_mistake(problems):
    noisy = chat_examples(problems, demo_error_rate=0.5, seed=1)
    mistaken = sum(e.answer == p.mistake != p.answer for e, p in zip(noisy, problems))
    assert 0 < mistaken < len(problems)
    assert all(e.ground_truth == p.ground_truth for e, p in zip(noisy, problems))
    with pytest.raises(ValueError, match="demo_error_rate"):
        chat_examples(problems, demo_error_rate=1.0)


def test_warm_start_chat_saves_a_loadable_model_and_summary(tmp_path):
    result = warm_start_chat(tmp_path / "m", steps=3, seed=0, batch_size=8, n_eval=4,
                             model_sizes=TINY, demo_error_rate=0.5)
    summary = json.loads((tmp_path / "m" / "warm_start.json").read_text())
    assert summary["steps"] == 3 and summary["demo_error_rate"] == 0.5
    assert summary["eval_accuracy"] == result.accuracy
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    with pytest.raises(ValueError, match="unknown model size"):
        warm_start_chat(tmp_path / "x", steps=1, model_sizes={"depth": 2})
